"""CPU cost of one decode step of one MLA layer: absorbed vs naive attention over the latent cache.

Uses the real attention dimensions of a Kimi-K2 config.json (all heads, batch 1) with random weights, so it
measures compute and memory traffic only; no checkpoint is needed. For each context length T the latent cache
holds T+1 random entries and one new token at position T attends over all of them.

  naive:    expands all T cached latents through kv_b_proj into per-head K_nope/V (cost grows as T*heads*256*512)
  absorbed: folds kv_b_proj into the query and output, attends in the 512+64-wide latent space (grows as T*heads*576)

Example:  python scripts/bench_mla_decode.py --contexts 4096,32768 --dtype float32 --json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from kimi_k2_neuron.arguments import SEED_MAX, fail, integer, integers, path
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.interrupts import run_command
from kimi_k2_neuron.launch import host_memory_available, script_parser
from kimi_k2_neuron.runtime import DTYPE_NAMES

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "test/data/configs/kimi-k2-instruct-0905.json"



def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument("--config", type=lambda t: Path(path(t)), default=DEFAULT_CONFIG, metavar="FILE",
                   help="Kimi-K2 config.json")
    p.add_argument("--contexts", type=integers(1), default=[4096, 32768], metavar="T,T,...",
                   help="comma-separated cached lengths (default: 4096,32768)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32", help="weights/cache/compute")
    p.add_argument("--repeats", type=integer(1), default=5, metavar="N", help="timed runs per path, median reported")
    p.add_argument("--warmup", type=integer(0), default=1, metavar="N", help="untimed runs per path before timing")
    p.add_argument("--threads", type=integer(1), default=None, metavar="N",
                   help="torch.set_num_threads (default: torch's own default)")
    p.add_argument("--seed", type=integer(0, SEED_MAX), default=0, metavar="S", help="seeds weights, cache and input")
    p.add_argument("--json", action="store_true", help="also print a JSON report")
    return p


def check_memory(cfg, args) -> None:
    """The largest context's latent cache and the naive path's per-head K/V must fit in the host's available RAM:
    refused here rather than by the kernel's OOM killer mid-run."""
    elem = 4 if args.dtype == "float32" else 2
    t = max(args.contexts) + 1
    need = t * (cfg.latent_dim + cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)) * elem
    available = host_memory_available()
    if available is not None and need > available:
        raise KimiInputError(f"--contexts {max(args.contexts)}: the naive path's K/V and the latent cache need "
                             f"{need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB of RAM is available")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from kimi_k2_neuron.config import KimiK2Config

        cfg = KimiK2Config.from_file(args.config)
        check_memory(cfg, args)
    except KimiInputError as e:
        return fail(e)
    run(cfg, args)
    return 0


def build_layer(cfg, dtype, gen):
    """One MLA layer of cfg's dimensions with random weights (a kimi_k2_neuron.model.mla.MLAttention)."""
    import torch

    from kimi_k2_neuron.model.mla import MLAttention
    from kimi_k2_neuron.parallel import SINGLE

    attn = MLAttention(cfg, dtype, SINGLE)
    for name, param in attn.named_parameters():
        if name.endswith("layernorm.weight"):
            continue  # RMSNorm weights stay at ones
        # std 1/sqrt(fan_in) keeps activations O(1) through every projection, like a trained layer roughly does.
        fan_in = param.shape[1]
        w = torch.randn(param.shape, generator=gen) / math.sqrt(fan_in)
        param.data.copy_(w.to(dtype))
    return attn


def time_step(attn, x, positions, rope, cache, absorbed: bool, warmup: int, repeats: int):
    for _ in range(warmup):
        out = attn(x, positions, rope, cache, absorbed=absorbed)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = attn(x, positions, rope, cache, absorbed=absorbed)
        times.append((time.perf_counter() - t0) * 1e3)
    return out, times


def run(cfg, args) -> None:
    import torch

    from kimi_k2_neuron.model.rope import RotaryTable
    from kimi_k2_neuron.runtime.runner import DTYPES as TORCH_DTYPES

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = TORCH_DTYPES[args.dtype]
    contexts = args.contexts
    gen = torch.Generator().manual_seed(args.seed)
    attn = build_layer(cfg, dtype, gen)
    heads, nope, v_dim = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    elem = torch.empty((), dtype=dtype).element_size()

    print(f"config {args.config} | heads {heads} | q_lora {cfg.q_lora_rank} | kv_lora {cfg.kv_lora_rank} | "
          f"nope/rope/v {nope}/{cfg.qk_rope_head_dim}/{v_dim} | hidden {cfg.hidden_size}")
    print(f"dtype {args.dtype} | threads {torch.get_num_threads()} | warmup {args.warmup} | repeats {args.repeats}")
    print(f"{'context':>8} {'naive ms':>10} {'absorbed ms':>12} {'ratio':>7} {'rel diff':>9} "
          f"{'latent cache':>13} {'naive K/V':>10}")
    results = []
    with torch.inference_mode():
        for ctx in contexts:
            # The cache holds [normalized c_kv | roped k_pe]; unit-variance randoms have the right scale for both.
            cache = torch.randn(1, ctx + 1, cfg.latent_dim, generator=gen).to(dtype)
            x = torch.randn(1, 1, cfg.hidden_size, generator=gen).to(dtype)
            positions = torch.tensor([[ctx]])
            rope = RotaryTable(cfg)(positions)
            out_n, t_n = time_step(attn, x, positions, rope, cache, False, args.warmup, args.repeats)
            out_a, t_a = time_step(attn, x, positions, rope, cache, True, args.warmup, args.repeats)
            rel = ((out_n.float() - out_a.float()).abs().max() / out_n.float().abs().max()).item()
            naive_ms, abs_ms = statistics.median(t_n), statistics.median(t_a)
            # What the naive path materializes per step and the absorbed path never does: per-head K_nope and V
            # for every cached token (the kv_b_proj output), against the latent cache both paths read.
            kv_bytes = (ctx + 1) * heads * (nope + v_dim) * elem
            cache_bytes = cache.numel() * elem
            print(f"{ctx:>8} {naive_ms:>10.1f} {abs_ms:>12.1f} {naive_ms / abs_ms:>7.1f} {rel:>9.2e} "
                  f"{cache_bytes / 2**20:>10.1f} MiB {kv_bytes / 2**20:>6.0f} MiB")
            results.append(dict(context=ctx, naive_ms=naive_ms, absorbed_ms=abs_ms, ratio=naive_ms / abs_ms,
                                rel_max_abs_diff=rel, naive_runs_ms=t_n, absorbed_runs_ms=t_a,
                                latent_cache_bytes=cache_bytes, naive_kv_bytes=kv_bytes))
            del cache, out_n, out_a
    if args.json:
        report = dict(config=str(args.config), dtype=args.dtype, threads=torch.get_num_threads(),
                      torch=torch.__version__, heads=heads, kv_lora_rank=cfg.kv_lora_rank,
                      qk_nope_head_dim=nope, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=v_dim,
                      hidden_size=cfg.hidden_size, q_lora_rank=cfg.q_lora_rank, warmup=args.warmup,
                      repeats=args.repeats, seed=args.seed, results=results)
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.exit(run_command(main))
