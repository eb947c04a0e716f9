"""Serving throughput and latency of a running `vllm serve` at a list of concurrencies, beside the planner's model.

For each concurrency C: C clients, each streaming its next request (/v1/completions, token-id prompts, greedy,
ignore_eos, return_token_ids) as soon as its last one ends, `vllm bench serve --max-concurrency C`'s closed loop, until
--num-prompts requests (at least C) have finished. Per request: TTFT (to its first streamed token), TPOT ((end - first
token) / (tokens - 1), vLLM's definition, prefill stalls included) and every inter-token gap; per concurrency: output
tokens per second (all output tokens over the wall time from the first request sent to the last token received), TTFT,
TPOT and ITL p50/p90/p99. Two Kimi-shaped workloads: chat (every request a fresh --input-tokens prompt generating
--output-tokens) and agentic (sessions whose every turn resends the conversation so far plus --turn-tokens new ones;
the next turn of a session goes out when the last one ends). Prompts are ordinary token ids (100-199, tokens in
every Kimi tokenizer), so no tokenizer is needed here.

With the configuration the server runs (--config, the model's config.json, and the flags compile_and_save.py was given:
--tp, --seq-len, --batch, --experts, the layout and MoE flags), the report carries the planner's modelled figures
beside each concurrency (`kimi-k2-neuron plan --serve`'s model: neuron/workload.py, for clients started together, as
here: each cohort prefilled back to back), so a trn2 run tests the model.
--device cpu marks a run against vLLM on CPU (NxD's CPU mode, the nxdi-cpu tier): its numbers say nothing of trn2.

Example (a trn2.48xlarge serving a folder compiled with --for-vllm --batch 8 --seq-len 9216):
  python scripts/bench_serving.py --url http://127.0.0.1:8000 --served-model /data/k2-neuron --concurrency 1,4,8 \\
      --input-tokens 8192 --output-tokens 1024 --num-prompts 32 --report serve.json \\
      --config /data/k2-neuron/config.json --tp 64 --seq-len 9216 --batch 8

Arguments are checked, and the server asked for its models, before any request is sent.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from kimi_k2_neuron.arguments import add_spec_args, check_out_file, fail, integer, integers
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.interrupts import run_command, write_atomically
from kimi_k2_neuron.launch import script_parser

FIRST_ID, ID_SPAN = 100, 100  # prompt tokens: ordinary ids of every Kimi tokenizer


def build_parser():
    p = script_parser(__doc__)
    p.add_argument("--url", required=True, help="the vllm serve base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--served-model", required=True, help="the model name the server answers to (its /v1/models)")
    p.add_argument("--concurrency", type=integers(1), default=[1, 4, 8], metavar="C,C,...",
                   help="closed-loop clients, one run each")
    p.add_argument("--workload", choices=["chat", "agentic"], default="chat",
                   help="chat: a fresh prompt a request; agentic: sessions whose turns resend the conversation so far")
    p.add_argument("--input-tokens", type=integer(1), default=8192, help="chat: prompt tokens; agentic: the "
                                                                          "first turn's")
    p.add_argument("--output-tokens", type=integer(2), default=1024, help="tokens each request generates")
    p.add_argument("--turns", type=integer(1), default=12, help="agentic: turns a session")
    p.add_argument("--turn-tokens", type=integer(1), default=3072, help="agentic: tokens each later turn adds")
    p.add_argument("--num-prompts", type=integer(1), default=None,
                   help="requests per concurrency (default: 4 x C; at least C)")
    p.add_argument("--timeout", type=integer(1), default=3600, help="seconds one request may take")
    p.add_argument("--device", choices=["trn2", "cpu"], default="trn2",
                   help="what serves: cpu marks a run on vLLM in NxD's CPU mode, whose numbers say nothing of trn2")
    p.add_argument("--seed", type=integer(0), default=0, help="seeds the prompts' token ids")
    p.add_argument("--report", required=True, metavar="FILE", help="JSON report to write")
    m = p.add_argument_group("the configuration served, for the planner's modelled figures (optional)")
    m.add_argument("--config", default=None, metavar="FILE", help="the served model's config.json (default: none, "
                                                                   "no modelled figures)")
    add_spec_args(m, "parallel", "shape", "experts", "moe", "layout",
                  tp=dict(required=False, default=64, help="tensor-parallel degree compiled"))
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        check_out_file(a.report, "--report")
        if a.workload == "agentic" and a.num_prompts is not None and a.num_prompts % a.turns:
            raise KimiInputError(f"--num-prompts {a.num_prompts}: an agentic run is whole sessions of --turns "
                                 f"{a.turns}; give a multiple of it")
        modeller = _modeller(a) if a.config else None
        _check_server(a)
    except KimiInputError as e:
        return fail(e)
    runs = []
    for c in a.concurrency:
        measured = _run(a, c)
        runs.append({"concurrency": c, "measured": measured,
                     "modelled": modeller(c) if modeller else None})
        print(f"concurrency {c}: {measured['output_tok_s']:.1f} output tok/s, TTFT p50 "
              f"{measured['ttft_s']['p50']:.3f} s, TPOT p50 {measured['tpot_ms']['p50']:.1f} ms"
              + (f" (modelled: {runs[-1]['modelled']['output_tok_s']:.1f} tok/s, TPOT "
                 f"{runs[-1]['modelled']['tpot_ms']:.1f} ms)" if modeller else ""))
    report = {"device": a.device, "url": a.url, "workload": _workload_dict(a), "runs": runs,
              "modelled_note": ("kimi-k2-neuron plan --serve's model (neuron/workload.py), an estimate"
                                if modeller else "no --config: no modelled figures"),
              **({"note": "vLLM on CPU (NxD's CPU mode): exercises the benchmark, says nothing of trn2"}
                 if a.device == "cpu" else {})}
    write_atomically(a.report, json.dumps(report, indent=2))
    print(f"wrote {a.report}")
    return 0


def _workload_dict(a) -> dict:
    if a.workload == "chat":
        return {"name": "chat", "input_tokens": a.input_tokens, "output_tokens": a.output_tokens}
    return {"name": "agentic", "first_turn_tokens": a.input_tokens, "turn_tokens": a.turn_tokens,
            "turns": a.turns, "output_tokens": a.output_tokens}


def _workload(a):
    from kimi_k2_neuron.neuron import workload

    if a.workload == "chat":
        return workload.chat(a.input_tokens, a.output_tokens)
    return workload.agentic(a.input_tokens, a.turns, a.turn_tokens, a.output_tokens)


def _modeller(a):
    """clients -> the planner's figures for the configuration the flags give (compiled with --for-vllm: continuous
    batching), or a one-line refusal now."""
    from dataclasses import replace

    from kimi_k2_neuron.config import KimiK2Config
    from kimi_k2_neuron.formats.record import ConversionRecord
    from kimi_k2_neuron.launch import run_spec
    from kimi_k2_neuron.neuron import workload
    from kimi_k2_neuron.neuron.fit import plan

    cfg = KimiK2Config.from_file(a.config)
    spec = run_spec(a, cfg, ConversionRecord.of(cfg), checkpoint=str(Path(a.config).parent), draft=None)
    spec = replace(spec, continuous_batching=spec.batch > 1)
    w = _workload(a)
    if w.seq_len > spec.seq_len:
        raise KimiInputError(f"--seq-len {spec.seq_len}: the workload needs {w.seq_len} positions a request (its "
                             f"prompt and output)")
    p = plan(cfg, spec)
    s = workload.steady_state(p, workload.workload_prefills(cfg, spec, w), w)
    return lambda clients: workload.at_concurrency(s, clients, together=True)  # this script starts them together


# -- the server ----------------------------------------------------------------------------------------------------

def _check_server(a) -> None:
    try:
        with urllib.request.urlopen(a.url.rstrip("/") + "/v1/models", timeout=30) as r:
            names = [m["id"] for m in json.loads(r.read())["data"]]
    except (OSError, ValueError, KeyError) as e:
        raise KimiInputError(f"--url {a.url}: no vLLM server answers there ({e})") from None
    if a.served_model not in names:
        raise KimiInputError(f"--served-model {a.served_model}: the server serves {', '.join(names)}")


def _stream(a, prompt: list[int]) -> tuple[list[int], list[float]]:
    """One streamed completion: its new token ids and the time each arrived."""
    body = {"model": a.served_model, "prompt": prompt, "max_tokens": a.output_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    req = urllib.request.Request(a.url.rstrip("/") + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    tokens, times = [], []
    with urllib.request.urlopen(req, timeout=a.timeout) as resp:
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                new = choice.get("token_ids") or []
                tokens += new
                times += [time.monotonic()] * len(new)
    return tokens, times


# -- one concurrency ---------------------------------------------------------------------------------------------------

def _run(a, clients: int) -> dict:
    """`clients` closed-loop clients until the run's requests are done -> the measured figures."""
    n = max(clients, a.num_prompts or 4 * clients)
    if a.workload == "agentic":
        n = -(-n // a.turns) * a.turns
    rng = random.Random(a.seed * 1_000_003 + clients)
    lock, results, errors = threading.Lock(), [], []
    todo = list(range(n // (a.turns if a.workload == "agentic" else 1)))  # requests, or sessions

    def client():
        while True:
            with lock:
                if not todo or errors:
                    return
                todo.pop()
                prompt = [FIRST_ID + rng.randrange(ID_SPAN) for _ in range(a.input_tokens)]
            for turn in range(a.turns if a.workload == "agentic" else 1):
                if turn:
                    with lock:
                        prompt = prompt + [FIRST_ID + rng.randrange(ID_SPAN) for _ in range(a.turn_tokens)]
                sent = time.monotonic()
                try:
                    tokens, times = _stream(a, prompt)
                except (OSError, ValueError) as e:
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}")
                    return
                with lock:
                    results.append((sent, tokens, times))
                prompt = prompt + tokens  # the next turn resends the reply too

    start = time.monotonic()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise KimiInputError(f"--url {a.url}: a request failed at concurrency {clients}: {errors[0]}")
    return _figures(results, start)


def _figures(results, start: float) -> dict:
    ttft = [times[0] - sent for sent, _, times in results if times]
    tpot = [(times[-1] - times[0]) / (len(times) - 1) * 1e3 for _, _, times in results if len(times) > 1]
    itl = [(b - c) * 1e3 for _, _, times in results for c, b in zip(times, times[1:])]
    end = max(times[-1] for _, _, times in results if times)
    total = sum(len(tokens) for _, tokens, _ in results)
    return {"requests": len(results), "output_tokens": total, "seconds": end - start,
            "output_tok_s": total / (end - start), "ttft_s": _percentiles(ttft), "tpot_ms": _percentiles(tpot),
            "itl_ms": _percentiles(itl)}


def _percentiles(values: list[float]) -> dict:
    """p50/p90/p99 by the nearest rank, and the mean."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    ranked = sorted(values)

    def at(q):
        return ranked[min(len(ranked) - 1, max(0, -(-q * len(ranked) // 100) - 1))]

    return {"p50": at(50), "p90": at(90), "p99": at(99), "mean": sum(ranked) / len(ranked)}


if __name__ == "__main__":
    sys.exit(run_command(main))
