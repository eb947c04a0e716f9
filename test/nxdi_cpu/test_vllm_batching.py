"""Continuous batching through vLLM as users load it: `vllm serve` (vLLM 0.13's scheduler and OpenAI server ->
vllm-neuron 0.2.0's continuous-batching scheduler and model runner -> NeuronKimiK2ForCausalLM in NxD's CPU mode, on a
tiny converted checkpoint; vllm_support.py), one server for the module, compiled batch 4.

- Ten streamed requests of ragged prompt and output lengths, more than the compiled batch: six sent at once, each
  later one when an earlier one has finished, so they arrive, are prefilled one per step between the running decodes,
  and finish at different steps; each gives, token for token, what it gives sent alone to the same server (the
  compiled batch pads every decode step to the same shape, so a row's arithmetic is the same whoever shares it).
  None is lost: the ones beyond the four cache lines wait in vLLM's queue.
- scripts/bench_serving.py's machinery against this server: measured output tok/s, TTFT and TPOT percentiles at
  concurrencies up to past the compiled batch, the planner's modelled figures beside each, in a report that says its
  numbers say nothing of trn2.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (bash scripts/build_nxdi_cpu_tier.sh VENV adds it)")
pytest.importorskip("vllm_neuron", reason="vllm-neuron is not installed here (scripts/build_nxdi_cpu_tier.sh)")

import vllm_support as vs  # noqa: E402

pytestmark = [pytest.mark.fp8_selective_cpu, pytest.mark.slow]  # one vllm serve for the module, minutes on CPU

BATCH, MAX_MODEL_LEN = 4, 128
LENGTHS = [5, 17, 9, 33, 3, 26, 12, 40, 7, 21]  # prompt tokens
OUTPUTS = [12, 5, 20, 8, 16, 3, 24, 10, 6, 14]  # tokens to generate
AT_ONCE = 6  # sent together; request AT_ONCE + k when request k has finished


@pytest.fixture(scope="module")
def server(converted, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    model = converted[("fp8", "fp8-blockwise")]
    tokenizer = vs.write_hf_tokenizer(model, tmp / "hf-tokenizer")
    s = vs.Server(model, tokenizer, vs.child_env(vs.write_dists(tmp / "dists")), tmp / "serve.log", MAX_MODEL_LEN,
                  BATCH)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def _prompt(i: int) -> list[int]:
    return [(37 * i + 11 * j) % 250 + 3 for j in range(LENGTHS[i])]


def _complete(server, i: int, stream: bool) -> tuple[list[int], int]:
    """Request i greedy: (its new token ids, the streamed chunks that carried tokens)."""
    body = {"model": "kimi", "prompt": _prompt(i), "max_tokens": OUTPUTS[i], "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if not stream:
        return server.post("/v1/completions", body)["choices"][0]["token_ids"], 0
    chunks = server.post("/v1/completions", {**body, "stream": True}, stream=True)
    carried = [c["choices"][0]["token_ids"] for c in chunks if c["choices"] and c["choices"][0].get("token_ids")]
    return [t for ids in carried for t in ids], len(carried)


def test_ragged_concurrent_streams_give_their_tokens_alone_and_none_is_lost(server):
    got, lock, in_flight, peak, errors = {}, threading.Lock(), [0], [0], []
    done = [threading.Event() for _ in LENGTHS]

    def request(i: int):
        if i >= AT_ONCE:
            done[i - AT_ONCE].wait(600)  # arrives when an earlier request has finished
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        try:
            got[i] = _complete(server, i, stream=True)
        except Exception as e:  # noqa: BLE001 -- reported below, with the request
            errors.append((i, repr(e)))
        finally:
            with lock:
                in_flight[0] -= 1
            done[i].set()

    threads = [threading.Thread(target=request, args=(i,)) for i in range(len(LENGTHS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    assert not errors, errors
    assert sorted(got) == list(range(len(LENGTHS)))  # none lost
    assert peak[0] > BATCH  # more requests in flight than cache lines: vLLM queued the rest
    for i, (tokens, chunks) in got.items():
        assert len(tokens) == OUTPUTS[i] and chunks >= 1, (i, tokens)
    alone = {i: _complete(server, i, stream=False)[0] for i in range(len(LENGTHS))}  # one at a time
    assert {i: tokens for i, (tokens, _) in got.items()} == alone


def test_the_serving_benchmark_reports_measured_and_modelled_figures(server, converted, tmp_path, env):
    report = tmp_path / "serve.json"
    config = converted[("fp8", "fp8-blockwise")] / "config.json"
    args = [sys.executable, str(vs.REPO / "scripts/bench_serving.py"), "--url", server.url, "--served-model", "kimi",
            "--concurrency", "1,4,6", "--input-tokens", "24", "--output-tokens", "8", "--num-prompts", "6",
            "--device", "cpu", "--report", str(report), "--config", str(config), "--tp", "1", "--seq-len",
            str(MAX_MODEL_LEN), "--batch", str(BATCH), "--moe-prefill", "torch"]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(report.read_text())
    assert got["device"] == "cpu" and "says nothing of trn2" in got["note"]
    assert [run["concurrency"] for run in got["runs"]] == [1, 4, 6]
    for run in got["runs"]:
        m, model = run["measured"], run["modelled"]
        assert m["requests"] == 6 and m["output_tokens"] == 6 * 8 and m["output_tok_s"] > 0
        for key in ("ttft_s", "tpot_ms", "itl_ms"):
            assert m[key]["p50"] <= m[key]["p90"] <= m[key]["p99"], (key, m[key])
        assert model["clients"] == run["concurrency"] and model["output_tok_s"] > 0 and model["tpot_ms"] > 0
    assert got["runs"][-1]["modelled"]["queued"] == 6 - BATCH and "ttft_mean_s" in got["runs"][-1]["modelled"]
    assert r.stdout.strip().endswith(f"wrote {report}")

    # the agentic shape: sessions whose turns resend the conversation so far
    agentic = [*args[:args.index("--concurrency")], "--concurrency", "2", "--workload", "agentic", "--input-tokens",
               "16", "--turns", "2", "--turn-tokens", "8", "--output-tokens", "4", "--num-prompts", "4", "--device",
               "cpu", "--report", str(report)]
    r = subprocess.run(agentic, capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    run = json.loads(report.read_text())["runs"][0]
    assert run["measured"]["requests"] == 4 and run["modelled"] is None


@pytest.mark.parametrize("flags, words", [
    (["--concurrency", "0"], "--concurrency: expected comma-separated integers >= 1"),
    (["--workload", "agentic", "--num-prompts", "5"], "--num-prompts 5: an agentic run is whole sessions"),
])
def test_the_benchmark_refuses_bad_flags_in_one_line(flags, words, server, tmp_path, env):
    r = subprocess.run([sys.executable, str(vs.REPO / "scripts/bench_serving.py"), "--url", server.url,
                        "--served-model", "kimi", "--report", str(tmp_path / "r.json"), *flags],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"error: {r.stderr.strip()[7:]}"]
    assert words in r.stderr and not (tmp_path / "r.json").exists()
