"""The requests test_vllm_structured.py (on-device sampling) and test_vllm_structured_cpu.py (vLLM's sampler on the
host) send to one `vllm serve` each, and what each reply must be: replies held to a schema through vLLM 0.13 ->
this package's worker (neuron/vllm_worker.py) -> vllm-neuron 0.2.0 -> the NxDI model in NxD's CPU mode, with Kimi's
middleware and parsers. Test infrastructure; the cases are structured_cases.py's.
"""

from __future__ import annotations

import json
import shlex
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import structured_cases as cases
import vllm_support as vs
from kimi_slow_tokenizer import write_slow_tokenizer

from kimi_k2_neuron.neuron.vllm_request import STRUCTURED_OUTPUTS_CONFIG, WORKER_CLS
from kimi_k2_neuron.runtime import tool_calls as grammar

SERVE_LEN = 1024  # the byte-level tiny tokenizer: a chat with the two tools declared is ~730 tokens
BATCH = 2
ASK = [{"role": "user", "content": "Answer in JSON."}]
NO_THINKING = {"chat_template_kwargs": {"thinking": False}}  # the prompt ends <think></think>: the answer at once


def serve(model: Path, tokenizer_dir: Path, root: Path, env: dict | None = None,
          neuron_override: dict | None = None) -> vs.Server:
    """`vllm serve` as compile_and_save prints it for vLLM (the worker, xgrammar without free whitespace, the
    middleware, both parsers), over Kimi's kind of tokenizer (a slow one) with tokenizer_dir's chat template."""
    tokenizer = write_slow_tokenizer(tokenizer_dir, root / "slow-tokenizer")
    parsers = str(vs.REPO / "src/kimi_k2_neuron/neuron/vllm_parsers.py")
    extra = ("--middleware", "kimi_k2_neuron.neuron.vllm_api.KimiApi", "--chat-template-content-format", "string",
             "--reasoning-parser-plugin", parsers, "--reasoning-parser", "kimi_k2_neuron", "--trust-remote-code",
             "--worker-cls", WORKER_CLS, "--structured-outputs-config", json.dumps(STRUCTURED_OUTPUTS_CONFIG))
    server = vs.Server(model, tokenizer, vs.child_env(vs.write_dists(root / "dists"), **(env or {})),
                       root / "serve.log", SERVE_LEN, BATCH, extra, neuron_override)
    try:
        server.wait_ready(900)
    except BaseException:
        server.stop()
        raise
    return server


def compile_for_vllm(model: Path, root: Path, *flags: str) -> tuple[Path, list[str]]:
    """scripts/compile_and_save.py --for-vllm of `model` at the servers' shape (NEFFs aside, as test_vllm_serving.py
    compiles): (the folder, the `vllm serve` flags it prints)."""
    from test_vllm_serving import run_child

    out = root / "compiled"
    argv = ["--model", str(model), "--out", str(out), "--tp", "1", "--seq-len", str(SERVE_LEN), "--batch", str(BATCH),
            "--moe-prefill", "torch", "--for-vllm", *flags]
    r, _ = run_child("compile", {"argv": argv}, vs.child_env(vs.write_dists(root / "dists")), root)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, shlex.split(r.stdout.split("serve it with vLLM (docs/vllm.md):\n", 1)[1].replace("\\\n", " "))


def chat(messages=None, **fields) -> dict:
    return {"model": "kimi", "messages": messages or [dict(m) for m in ASK], "temperature": 1.0, **fields}


def reply(server: vs.Server, body: dict, stream: bool) -> tuple[dict, str | None]:
    """(the message, finish_reason) of a request, a stream put back together as a client does."""
    status, got = server.call(body, stream)
    assert status == 200, (body, got)
    if not stream:
        return got["choices"][0]["message"], got["choices"][0]["finish_reason"]
    message, calls, finish = {"content": "", "reasoning_content": ""}, {}, None
    for chunk in got:
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            message["content"] += delta.get("content") or ""
            message["reasoning_content"] += delta.get("reasoning_content") or delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or ():
                slot = calls.setdefault(call["index"], {"id": None, "function": {"name": None, "arguments": ""}})
                slot["id"] = slot["id"] or call.get("id")
                function = call.get("function") or {}
                slot["function"]["name"] = slot["function"]["name"] or function.get("name")
                slot["function"]["arguments"] += function.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish


def replies(server: vs.Server, jobs: list[tuple[dict, bool]]) -> list[tuple[dict, str | None]]:
    """(body, streamed) jobs, two requests in flight at a time (a batch of two: rows of both kinds mixed)."""
    with ThreadPoolExecutor(BATCH) as pool:
        return list(pool.map(lambda job: reply(server, *job), jobs))


def both_ways(server: vs.Server, bodies: list[dict]) -> list[tuple[dict, str | None]]:
    """Each body streamed and not."""
    return replies(server, [(body, stream) for body in bodies for stream in (False, True)])


def check_schemas(server: vs.Server, streamed: int, **fields) -> None:
    """The 50 json_schema strict requests, every other one streamed (from schema `streamed`, 0 or 1: the two
    modules take one each, so each schema is served both ways): each reply parses and validates, ended by the model
    where the grammar let it (finish_reason stop)."""
    jobs = [(chat(**cases.schema_request(schema), **NO_THINKING, **fields), k % 2 == streamed)
            for k, (_, schema) in enumerate(cases.SCHEMAS)]
    for k, (message, finish) in enumerate(replies(server, jobs)):
        kind, schema = cases.SCHEMAS[k]
        assert finish == "stop", (kind, schema, message, finish)
        try:
            cases.check(message["content"], schema)
            # one line, as Kimi's API answers (KVV's test_response_format_with counts newlines and tabs)
            assert "\n" not in message["content"] and "\t" not in message["content"], "not compact"
        except Exception as e:
            raise AssertionError(f"{kind} {'streamed' if jobs[k][1] else 'not streamed'}: {message['content']!r} "
                                 f"against {json.dumps(schema)}: {e}") from e


def check_formats(server: vs.Server, **fields) -> None:
    """json_object a JSON object, a regex and a choice matched, streamed and not."""
    # json_object greedy: any object, whose keys a random model, sampling, writes as long as it likes
    bodies = [chat(response_format={"type": "json_object"}, max_tokens=cases.BUDGET, **{**NO_THINKING, **fields,
                                                                                        "temperature": 0.0}),
              chat(structured_outputs={"regex": cases.REGEX}, max_tokens=32, **NO_THINKING, **fields),
              chat(structured_outputs={"choice": cases.CHOICES}, max_tokens=16, **NO_THINKING, **fields)]
    got = both_ways(server, bodies)
    for message, finish in got[:2]:
        assert finish == "stop" and isinstance(json.loads(message["content"]), dict), message
    for message, finish in got[2:4]:
        assert finish == "stop", message
        cases.check_regex(message["content"])
    for message, finish in got[4:]:
        assert finish == "stop" and message["content"] in cases.CHOICES, message


def check_tool_calls(server: vs.Server, **fields) -> None:
    """tool_choice required (one call or several) and a named function, streamed and not: the reply's calls, read
    by the kimi_k2_neuron parser, each with Kimi's id `functions.NAME:IDX` (IDX counting on from the conversation's
    calls) and arguments that validate against the function's parameters. (Several calls may run past the budget:
    the parser drops a call the end cut short and reports the whole ones before it.)"""
    history = [{"role": "user", "content": "Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18"}, {"role": "user", "content": "News?"}]
    bodies = [chat(tools=cases.TOOLS, tool_choice="required", max_tokens=cases.TOOL_BUDGET, **fields),
              chat(history, tools=cases.TOOLS, tool_choice="required", parallel_tool_calls=False,
                   max_tokens=cases.BUDGET, **fields),
              chat(history, tools=cases.TOOLS, tool_choice={"type": "function", "function": {"name": "search"}},
                   max_tokens=cases.BUDGET, **fields)]
    got = both_ways(server, bodies)
    for k, (message, finish) in enumerate(got):
        calls = message.get("tool_calls") or []
        assert calls and not (message.get("content") or "").strip(), (k, message, finish)
        if k >= 2:
            assert len(calls) == 1, message
        for call in calls:
            name = call["function"]["name"]
            assert name in cases.PARAMETERS and (k // 2 != 2 or name == "search"), call
            cases.check(call["function"]["arguments"], cases.PARAMETERS[name])
        if k % 2:  # streamed: the parser's ids (a non-streamed reply's are vLLM 0.13's own: docs/tool_calls.md)
            first = 0 if k < 2 else 1
            assert [c["id"] for c in calls] == [f"{grammar.FUNCTION_PREFIX}{c['function']['name']}:{first + i}"
                                                for i, c in enumerate(calls)], calls
