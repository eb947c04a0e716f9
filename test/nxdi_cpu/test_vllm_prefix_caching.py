"""Prefix caching served through vLLM on CPU: `scripts/compile_and_save.py --for-vllm --prefix-caching` (NEFFs aside,
vllm_support.compile_for_vllm), then `vllm serve` of that folder with the line it prints (--enable-prefix-caching
--block-size --num-gpu-blocks-override --enable-prompt-tokens-details, Kimi's middleware) -> vLLM 0.13's scheduler
and block manager (its block hashes, its LRU of free blocks) -> vllm-neuron 0.2.0's runner (slot mappings, block
tables) -> NxDI's block layout in NxD's CPU mode. One server for the module; one scenario (the `served` fixture)
records every reply, the tests read it.

The agent: a system prompt, a tool, a task, then turns that each add the assistant's tool call and its result (a
replayed transcript: the calls are scripted, as an agent harness resends what it recorded), each turn asking the model
for the next message, greedy. The reference of every request is the same request with a cache_salt of its own
(vLLM's: its block hashes start apart, so nothing is cached): the same engine without the cache. The cached blocks a
turn reads were written by earlier prefills (the earlier prompts; a reply's tokens differ from the scripted call that
follows them), whose positions the block path computes as a cold prefill does, bit for bit
(test_prefix_caching.py), so the tokens are compared exactly.

- Ten turns of session A: each reply's tokens equal its uncached reference; each prompt extends the one before, and
  usage.prompt_tokens_details.cached_tokens is >= 90 % of the previous turn's prompt (vLLM hits whole 16-position
  blocks); the references report none. prompt_cache_key is accepted (the middleware takes it out).
- Session B, the same system prompt and tool, another task: its first turn finds the shared prefix's blocks cached.
- A pool of 208 blocks, the least vllm-neuron takes (2 rows x 1664 / 16), holds one session's history and not both:
  B's turns evict A's history (least recently used free blocks first), so A's next turn finds less cached, and
  gives its reference's tokens all the same.
- A and B at once (batch 2, both reading the shared blocks): each gives its reference's tokens.
Not here: TP > 1 through vLLM (test_vllm_serving.py says why), trn2.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (bash scripts/build_nxdi_cpu_tier.sh VENV adds it)")
pytest.importorskip("vllm_neuron", reason="vllm-neuron is not installed here (scripts/build_nxdi_cpu_tier.sh)")

import vllm_support as vs  # noqa: E402

from kimi_k2_neuron.neuron.spec import RunSpec  # noqa: E402

SERVE_LEN, BATCH, BS = 1664, 2, 16  # A's twelfth turn: a prompt of ~1,650 tokens
POOL = BATCH * SERVE_LEN // BS
SYSTEM = "You are Kimi, a coding agent. Work in the repository; call a tool when you need a file or a test run."
RUN = {"type": "function", "function": {"name": "run", "description": "Run a shell command.",
                                        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                                       "required": ["cmd"]}}}
MAX_TOKENS = 6

pytestmark = [pytest.mark.fp8_selective_cpu, pytest.mark.slow]


def transcript(task: str, turns: int, tag: str) -> list[list[dict]]:
    """The messages of each turn: the task, then one more scripted tool call and its result per turn."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    out = [list(messages)]
    for k in range(turns - 1):
        call = {"id": f"functions.run:{k}", "type": "function",
                "function": {"name": "run", "arguments": json.dumps({"cmd": f"pytest -k {tag}{k}"})}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": f"{tag}{k} failed: assert {k} == {k + 1}"}]
        out.append(list(messages))
    return out


@pytest.fixture(scope="module")
def server(converted, tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    model = converted[("fp8", "fp8-blockwise")]
    dists = vs.write_dists(root / "dists")
    compiled = root / "compiled"
    stdout = vs.compile_for_vllm(model, compiled, vs.child_env(dists), SERVE_LEN, BATCH, "--prefix-caching",
                                 "--block-size", str(BS))
    command = stdout.split("serve it with vLLM (docs/vllm.md):\n", 1)[1].replace("\\\n", " ").split()
    cache = RunSpec(batch=BATCH, seq_len=SERVE_LEN, prefix_caching=True, block_size=BS)
    assert " ".join(vs_cache_flags(cache)) in " ".join(command)  # the printed line serves what was compiled
    tokenizer = vs.write_hf_tokenizer(model, root / "hf-tokenizer")
    extra = ("--middleware", "kimi_k2_neuron.neuron.vllm_api.KimiApi", "--chat-template-content-format", "string")
    srv = vs.Server(model, tokenizer, vs.child_env(dists, NEURON_COMPILED_ARTIFACTS=compiled), root / "serve.log",
                    SERVE_LEN, BATCH, extra, cache=cache)
    try:
        srv.wait_ready(600)
        yield srv
    finally:
        srv.stop()


def vs_cache_flags(spec):
    from kimi_k2_neuron.neuron.vllm_request import cache_flags

    return cache_flags(spec)


def ask(server, messages, **fields) -> dict:
    """-> the reply's prompt ids, token ids, cached tokens."""
    body = {"model": "kimi", "messages": messages, "tools": [RUN], "temperature": 0, "max_tokens": MAX_TOKENS,
            "return_token_ids": True, **fields}
    reply = server.post("/v1/chat/completions", body)
    details = reply["usage"].get("prompt_tokens_details") or {}
    return {"prompt": reply["prompt_token_ids"], "tokens": reply["choices"][0]["token_ids"],
            "cached": details.get("cached_tokens") or 0}


def _caught(server, messages):
    """ask() in a thread: the reply, or what went wrong as text (an exception in a thread would only warn)."""
    try:
        return ask(server, messages)
    except Exception as e:  # noqa: BLE001 (reported by the test that reads it)
        return f"{type(e).__name__}: {e} {getattr(e, 'read', lambda: b'')()[:500]!r}"


def turn(server, messages, name: str) -> dict:
    """The request warm (what the pool holds), then its reference: the same with a cache_salt of its own."""
    warm = ask(server, messages, prompt_cache_key=name.split("-")[0])
    cold = ask(server, messages, cache_salt=f"cold-{name}")
    return {"warm": warm, "cold": cold}


@pytest.fixture(scope="module")
def served(server):
    a = transcript("Fix the failing test in tests/test_io.py.", 12, "a")
    b = transcript("Speed up the slow loader in src/load.py.", 6, "b")
    got = {"A": [turn(server, a[k], f"A-{k}") for k in range(10)]}
    got["B"] = [turn(server, b[k], f"B-{k}") for k in range(5)]  # B's history evicts A's
    got["A10"] = turn(server, a[10], "A-10")
    both, threads = {}, []
    for name, messages in (("A11", a[11]), ("B5", b[5])):
        threads.append(threading.Thread(target=lambda n=name, m=messages: both.__setitem__(n, _caught(server, m))))
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    failed = {name: got for name, got in both.items() if isinstance(got, str)}
    assert len(both) == 2 and not failed, failed
    got["together"] = {name: {"warm": both[name], "cold": ask(server, m, cache_salt=f"cold-{name}")}
                       for name, m in (("A11", a[11]), ("B5", b[5]))}
    return got


def test_every_turn_gives_the_tokens_it_gives_without_the_cache(served):
    pairs = [*served["A"], *served["B"], served["A10"], *served["together"].values()]
    for i, pair in enumerate(pairs):
        assert pair["warm"]["tokens"] == pair["cold"]["tokens"], i
        assert pair["warm"]["prompt"] == pair["cold"]["prompt"] and pair["cold"]["cached"] == 0
        assert len(pair["warm"]["prompt"]) + MAX_TOKENS <= SERVE_LEN


def test_each_turn_finds_at_least_90_percent_of_the_previous_turn_cached(served):
    turns = [t["warm"] for t in served["A"]]
    assert turns[0]["cached"] == 0
    for before, now in zip(turns, turns[1:]):
        assert now["prompt"][:len(before["prompt"])] == before["prompt"]  # the history is resent as it was
        assert now["cached"] >= 0.9 * len(before["prompt"]), (now["cached"], len(before["prompt"]))
        assert now["cached"] % BS == 0 and now["cached"] < len(now["prompt"])


def test_a_second_session_shares_the_system_prompts_blocks(served):
    a0, b0 = served["A"][0]["warm"]["prompt"], served["B"][0]["warm"]["prompt"]
    common = next(i for i, (x, y) in enumerate(zip(a0, b0)) if x != y)
    assert served["B"][0]["warm"]["cached"] == common // BS * BS > 0


def test_a_pool_too_small_for_both_sessions_evicts_and_changes_no_output(served):
    """208 blocks: A's tenth turn needed ~88 of them, B's turns and their references ~240 more."""
    a9, a10 = served["A"][9]["warm"], served["A10"]["warm"]
    assert a10["prompt"][:len(a9["prompt"])] == a9["prompt"]
    assert a10["cached"] < len(a9["prompt"]) // BS * BS  # some of A's history was evicted for B's
    assert a10["tokens"] == served["A10"]["cold"]["tokens"]


def test_two_sessions_at_once_read_the_shared_blocks_and_each_gets_its_own_tokens(served):
    for name, pair in served["together"].items():
        assert pair["warm"]["tokens"] == pair["cold"]["tokens"], name
