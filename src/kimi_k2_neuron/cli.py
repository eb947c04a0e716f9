"""The `kimi-k2-neuron` command: make-tiny, logits, generate, convert, plan, demo, trace-cpu.

Bad input (files, tensors, config fields, arguments) ends with a one-line `error: ...` and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from .errors import KimiInputError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _parse_rows(text: str) -> list[list[int]]:
    try:
        rows = [[int(t) for t in row.split(",") if t.strip()] for row in text.split(";")]
    except ValueError:
        raise KimiInputError(f'--input-ids {text!r}: expected comma-separated integers, rows separated by ";"')
    return rows


def cmd_make_tiny(a) -> int:
    from .checkpoint.tiny import make_tiny

    out = make_tiny(a.out, quant=a.quant, shards=a.shards, seed=a.seed)
    print(f"wrote tiny {a.quant} checkpoint to {out}")
    return 0


def cmd_logits(a) -> int:
    from safetensors.torch import save_file

    from .runtime.runner import CpuRunner

    rows = _parse_rows(a.input_ids)
    if a.tp < 1:
        raise KimiInputError(f"--tp {a.tp}: expected a positive number of CPU ranks")
    if a.tp == 1:
        runner = CpuRunner(a.model, dtype=DTYPES[a.dtype], layer_streamed=a.layer_streamed, progress=True)
        logits = runner.logits(rows, a.prefill_len)
    else:
        from .runtime.tp import tp_logits

        _check_tp_divides(a.model, a.tp)
        logits = tp_logits(a.model, rows, a.prefill_len, a.tp, DTYPES[a.dtype], a.layer_streamed)
    save_file({"logits": logits.contiguous()}, a.out)
    print(f"wrote logits {list(logits.shape)} to {a.out}")
    return 0


def _check_tp_divides(model_dir, tp: int) -> None:
    from .config import KimiK2Config

    cfg = KimiK2Config.from_file(model_dir)
    dims = {"num_attention_heads": cfg.num_attention_heads, "vocab_size": cfg.vocab_size,
            "intermediate_size": cfg.intermediate_size, "moe_intermediate_size": cfg.moe_intermediate_size}
    for name, n in dims.items():
        if n % tp:
            raise KimiInputError(f"--tp {tp}: config.json field {name}={n} is not divisible by {tp}")


def _load_tokenizer(model_dir):
    from .runtime.tokenizer import KimiTokenizer

    return KimiTokenizer.from_dir(model_dir)


def cmd_generate(a) -> int:
    from .runtime.runner import CpuRunner
    from .runtime.sampling import SamplingParams

    runner = CpuRunner(a.model, dtype=DTYPES[a.dtype], layer_streamed=a.layer_streamed, progress=True)
    tok = None
    if a.prompt is not None:
        tok = _load_tokenizer(a.model)
        text = tok.apply_chat_template([{"role": "user", "content": a.prompt}]) if a.chat else a.prompt
        prompts = [tok.encode(text)]
    else:
        prompts = _parse_rows(a.input_ids)
    params = SamplingParams() if a.greedy else SamplingParams(a.temperature, a.top_k, a.top_p)
    stop = set(runner.cfg.eos_token_ids)
    if tok is not None or (Path(a.model) / "tiktoken.model").exists():
        stop = (tok or _load_tokenizer(a.model)).stop_ids(list(runner.cfg.eos_token_ids))
    res = runner.generate(prompts, a.max_new_tokens, params, stop_ids=stop, seed=a.seed)
    texts = [tok.decode(t) for t in res.tokens] if tok is not None else None
    if a.json:
        print(json.dumps({"tokens": res.tokens, "text": texts, "prefill_seconds": res.prefill_seconds,
                          "decode_tokens_per_second": res.decode_tokens_per_second}))
    else:
        for i, t in enumerate(res.tokens):
            print(texts[i] if texts else ",".join(map(str, t)))
        print(f"prefill {res.prefill_seconds * 1e3:.1f} ms, decode {res.decode_tokens_per_second:.1f} tokens/s",
              file=sys.stderr)
    return 0


def _cache_dir() -> Path:
    root = os.environ.get("KIMI_K2_NEURON_CACHE") or Path.home() / ".cache" / "kimi-k2-neuron"
    return Path(root)


def cmd_demo(a) -> int:
    from .checkpoint.tiny import make_tiny
    from .runtime.runner import CpuRunner
    from .runtime.sampling import SamplingParams

    model_dir = _cache_dir() / "tiny-fp8"
    if not (model_dir / "config.json").exists():
        make_tiny(model_dir, quant="fp8")
        print(f"made a tiny FP8 Kimi-K2-format checkpoint in {model_dir}")
    runner = CpuRunner(model_dir)
    tok = _load_tokenizer(model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello, Kimi!"}])
    ids = tok.encode(prompt)
    res = runner.generate([ids], a.max_new_tokens, SamplingParams(), stop_ids=tok.stop_ids(runner.cfg.eos_token_ids))
    print(f"prompt: {len(ids)} tokens; generated {len(res.tokens[0])} tokens (random weights, so no sense): "
          f"{res.tokens[0]}")
    print(f"CPU float32: prefill {res.prefill_seconds * 1e3:.1f} ms, decode {res.decode_tokens_per_second:.1f} "
          f"tokens/s")
    rows = [ids + res.tokens[0]]
    t0 = time.perf_counter()
    ours = runner.logits(rows, prefill_len=len(ids))
    try:
        from .reference import hf_logits, hf_model
    except ImportError as e:
        print(f"skipped the transformers comparison ({e.name} missing): pip install 'kimi-k2-neuron[test]'")
        return 0
    ref = hf_logits(hf_model(model_dir), rows, prefill_len=len(ids))
    diff = (ours - ref).abs().max().item()
    print(f"max |logit difference| vs transformers DeepseekV3ForCausalLM over {ref.shape[1]} positions "
          f"(prefill + teacher-forced decode): {diff:.3e} (max |logit| {ref.abs().max().item():.2f}; "
          f"{time.perf_counter() - t0:.1f} s)")
    return 0


def cmd_plan(a) -> int:
    from .config import KimiK2Config
    from .convert.layout import read_record
    from .plan import format_plan, plan, plan_json, recorded_block

    cfg = KimiK2Config.from_file(Path(a.model) / "config.json" if a.model else a.config)
    block = recorded_block(read_record(a.model) if a.model else None, a.experts)
    p = plan(cfg, a.tp, a.ep, a.lnc, a.seq_len, a.batch, a.experts, kv_slots=a.kv_slots, block=block,
             router_dtype=a.router_dtype)
    print(plan_json(p) if a.json else format_plan(p))
    return 0 if p.fits else 1


def cmd_convert(a) -> int:
    from .convert.converter import convert

    res = convert(a.src, a.dst, experts=a.experts, workers=a.workers, verify=a.verify)
    print(res.summary)
    return 0


def cmd_trace_cpu(a) -> int:
    """One NxDI submodel traced with torch_xla on its CPU device (neuron/xla_trace.py); exit 0 clean, 1 not."""
    try:
        import torch_xla  # noqa: F401

        from .neuron import cpu, xla_trace
    except ImportError as e:
        raise KimiInputError(f"trace-cpu needs NxD, NxDI and torch_xla importable: {str(e).splitlines()[0]}")
    model = cpu.CpuOptions(model=a.model, experts=a.experts, tp=a.tp, dtype=a.dtype)
    with xla_trace.stdout_to_stderr():
        report = xla_trace.trace(xla_trace.TraceOptions(model, a.submodel, a.seq_len, a.batch))
    print(report.to_json() if a.json else report.format())
    return 0 if report.clean else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kimi-k2-neuron", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("make-tiny", help="write a tiny random checkpoint in a real Kimi-K2 storage format")
    s.add_argument("out")
    s.add_argument("--quant", choices=["fp8", "int4", "bf16"], default="fp8")
    s.add_argument("--shards", type=int, default=3)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=cmd_make_tiny)

    s = sub.add_parser("logits", help="logits at every position (prefill, then teacher-forced decode)")
    s.add_argument("--model", required=True)
    s.add_argument("--input-ids", required=True, help='e.g. "1,2,3;4,5,6" (rows separated by ;)')
    s.add_argument("--prefill-len", type=int, default=None, help="positions below this come from one prefill")
    s.add_argument("--out", required=True, help="output .safetensors with `logits` float32 [B, S, V]")
    _model_opts(s)
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel CPU ranks")
    s.set_defaults(fn=cmd_logits)

    s = sub.add_parser("generate", help="generate on CPU")
    s.add_argument("--model", required=True)
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--input-ids")
    s.add_argument("--chat", action="store_true", help="wrap --prompt in the checkpoint's chat template")
    s.add_argument("--max-new-tokens", type=int, default=32)
    s.add_argument("--greedy", action="store_true", help="(default when no --temperature is given)")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true")
    _model_opts(s)
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser("convert", help="convert a Kimi-K2 checkpoint once into the Neuron-ready FP8 expert layout")
    s.add_argument("src", help="FP8 blockwise, compressed-tensors INT4 or BF16 Kimi-K2 checkpoint directory")
    s.add_argument("dst", help="output directory (new, empty, or an interrupted conversion to resume)")
    s.add_argument("--experts", required=True, choices=["fp8-blockwise", "fp8-per-channel"],
                   help="NxD scale layout of the routed experts")
    s.add_argument("--workers", type=int, default=1, help="threads converting experts in parallel")
    s.add_argument("--verify", action="store_true", help="re-hash finished files (and redo any that differ)")
    s.set_defaults(fn=cmd_convert)

    s = sub.add_parser("demo", help="make a tiny FP8 checkpoint, generate from it, compare with transformers")
    s.add_argument("--max-new-tokens", type=int, default=16)
    s.set_defaults(fn=cmd_demo)

    s = sub.add_parser("plan", help="will it fit? HBM per logical core on trn2.48xlarge, roofline TPOT bound "
                                    "(exit 0 fits, 1 does not)")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory (reads DIR/config.json)")
    src.add_argument("--config", help="a config.json file")
    s.add_argument("--tp", type=int, required=True, help="tensor-parallel degree (ranks = logical cores used)")
    s.add_argument("--ep", type=int, default=1, help="expert parallelism inside the tp ranks: experts split ep "
                                                     "ways, each expert tp/ep ways (NxDI moe_ep_degree)")
    s.add_argument("--lnc", type=int, default=2, help="physical cores per logical core (trn2 default 2)")
    s.add_argument("--seq-len", type=int, required=True)
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--experts", required=True, choices=["fp8-blockwise", "fp8-per-channel", "bf16"],
                   help="routed-expert storage on device")
    s.add_argument("--kv-slots", type=int, default=1,
                   help="1: our latent-only cache manager (default); 2: NxDI's stock KVCacheManager, which adds a "
                        "same-width dead V slot")
    s.add_argument("--router-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="fp32: this port's router (default); bf16 models ports that cast it (the DeepSeek-V3 contrib)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_plan)

    s = sub.add_parser("trace-cpu", help="trace one NxDI submodel with torch_xla on the XLA CPU device, as NxD traces "
                                         "it for neuronx-cc (exit 0: one clean graph, 1: not)")
    s.add_argument("--model", required=True, help="checkpoint directory (a raw one is converted once)")
    s.add_argument("--experts", choices=["fp8-blockwise", "fp8-per-channel"], default=None)
    s.add_argument("--tp", type=int, default=1)
    s.add_argument("--submodel", required=True, choices=["context", "token"])
    s.add_argument("--seq-len", type=int, default=16)
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="bfloat16: the device dtype")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_trace_cpu)
    return p


def _model_opts(s):
    s.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    s.add_argument("--layer-streamed", action="store_true", help="load one decoder layer at a time")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except KimiInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
