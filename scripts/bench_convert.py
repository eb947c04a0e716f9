"""Benchmark `kimi-k2-neuron convert` on a synthetic FP8 checkpoint with Kimi-K2's real expert shapes.

    python scripts/bench_convert.py [--layers 6] [--experts 20] [--shard-gb 1.0] [--workers 2] [--warm] [--keep]

Builds (under /tmp, deleted afterwards) a blockwise-FP8 checkpoint: hidden 7168, expert width 2048, `--experts`
routed experts + 1 shared per layer, a shrunken attention and vocabulary, split into ~1 GB shards that cut
layers wherever they fall (as the real 62 shards do). Expert codes come from quantizing Gaussian weights with
amax -> 448 per 128x128 block, like DeepSeek's quantizer, so most blocks need the +-240 rescale.

Then, in one run, each phase in its own process:
1. raw read: every tensor of every shard read with safetensors (get_tensor, then every byte touched);
2. the conversion (`python -m kimi_k2_neuron.cli convert SRC DST --experts fp8-blockwise`), with its peak RSS
   and its CPU time (user + system of the whole process, all threads) from wait4();
3. for context, a plain sequential read() of the same files, and a plain copy of them (copied in the kernel, as
   cp does, then fsync: what any converter that leaves durable output pays in I/O alone);
4. the start-up alone (`kimi_k2_neuron.cli.load_converter()`, the convert command's imports): the fixed part of the
   conversion's wall and CPU time, reported so that the per-GB cost of a 1 TB conversion can be read off.
Prints CPU seconds per GB converted (goal <= 1.2), the conversion's speed over the plain copy's (goal >= 0.8) and
over the raw read, peak RSS / largest shard (goal <= 1.6), plus a JSON line.

Cold page cache by default: before each phase the benchmark's own files (source and outputs) are synced and
evicted with POSIX_FADV_DONTNEED, so every phase reads from disk (nothing else on the machine is evicted, no root
needed; `fincore` shows those files at 0 resident pages afterwards). `--warm` leaves the cache alone (after the
build, the source is then read from memory).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kimi_k2_neuron.arguments import fail, integer, number
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.interrupts import run_command
from kimi_k2_neuron.launch import script_parser

H, I = 7168, 2048
_RAW_READ = r"""
import sys, time, torch
from pathlib import Path
from safetensors import safe_open
t0, n = time.perf_counter(), 0
for f in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    with safe_open(str(f), "pt") as h:
        for k in h.keys():
            t = h.get_tensor(k)
            t.view(torch.uint8).max()  # touch every byte
            n += t.numel() * t.element_size()
print(n, time.perf_counter() - t0)
"""
_SEQ_READ = r"""
import sys, time
from pathlib import Path
t0, n = time.perf_counter(), 0
for f in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    with open(f, "rb", buffering=0) as fh:
        while b := fh.read(16 << 20):
            n += len(b)
print(n, time.perf_counter() - t0)
"""
_BUILD = r"""
import runpy, sys
from pathlib import Path
runpy.run_path(sys.argv[1])["build"](Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
"""
_COPY = r"""
import os, shutil, sys, time
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir()
t0, n = time.perf_counter(), 0
for f in sorted(src.glob("*.safetensors")):
    shutil.copyfile(f, dst / f.name)  # in the kernel (sendfile), as cp copies; a read()/write() loop ran ~2x slower
    fd = os.open(dst / f.name, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    n += f.stat().st_size
print(n, time.perf_counter() - t0)
"""


def bench_config(layers: int, experts: int) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 8192,
        "hidden_size": H, "intermediate_size": 18432, "moe_intermediate_size": I, "num_hidden_layers": layers,
        "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": experts,
        "n_shared_experts": 1, "num_experts_per_tok": min(8, experts), "n_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.827,
        "first_k_dense_replace": 0, "moe_layer_freq": 1, "num_nextn_predict_layers": 0, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 50000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]},
    }


def tensors(cfg: dict):
    """(name, tensor) in checkpoint order; expert matrices are rolled copies of a few random ones (cheap)."""
    import torch

    from kimi_k2_neuron.quant.fp8 import quantize_blockwise

    def _fp8(shape, g):
        return quantize_blockwise(torch.randn(*shape, generator=g), (128, 128))

    g = torch.Generator().manual_seed(0)
    base = {"gate_proj": _fp8((I, H), g), "up_proj": _fp8((I, H), g), "down_proj": _fp8((H, I), g)}
    yield "model.embed_tokens.weight", torch.randn(cfg["vocab_size"], H, generator=g).to(torch.bfloat16)
    heads, qk, v = cfg["num_attention_heads"], 192, 128
    attn = {"q_a_proj": (1536, H), "q_b_proj": (heads * qk, 1536), "kv_a_proj_with_mqa": (576, H),
            "kv_b_proj": (heads * (128 + v), 512), "o_proj": (H, heads * v)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        yield p + "input_layernorm.weight", torch.ones(H, dtype=torch.bfloat16)
        yield p + "post_attention_layernorm.weight", torch.ones(H, dtype=torch.bfloat16)
        yield p + "self_attn.q_a_layernorm.weight", torch.ones(1536, dtype=torch.bfloat16)
        yield p + "self_attn.kv_a_layernorm.weight", torch.ones(512, dtype=torch.bfloat16)
        for name, shape in attn.items():
            q, s = _fp8(shape, g)
            yield p + f"self_attn.{name}.weight", q
            yield p + f"self_attn.{name}.weight_scale_inv", s
        yield p + "mlp.gate.weight", torch.randn(cfg["n_routed_experts"], H, generator=g).to(torch.bfloat16)
        yield p + "mlp.gate.e_score_correction_bias", torch.zeros(cfg["n_routed_experts"])
        for e in [*range(cfg["n_routed_experts"]), "shared"]:
            ep = p + ("mlp.shared_experts." if e == "shared" else f"mlp.experts.{e}.")
            shift = 7 * layer + (0 if e == "shared" else e + 1)
            for proj, (q, s) in base.items():
                yield ep + proj + ".weight", q.view(torch.uint8).roll(shift, 0).view(torch.float8_e4m3fn)
                yield ep + proj + ".weight_scale_inv", s.clone()
    yield "model.norm.weight", torch.ones(H, dtype=torch.bfloat16)
    yield "lm_head.weight", torch.randn(cfg["vocab_size"], H, generator=g).to(torch.bfloat16)


def build(out: Path, layers: int, experts: int, shard_bytes: float) -> None:
    from safetensors.torch import save_file

    cfg = bench_config(layers, experts)
    out.mkdir(parents=True)
    shards, cur, size = [], {}, 0
    for name, t in tensors(cfg):
        cur[name] = t.contiguous()
        size += t.numel() * t.element_size()
        if size >= shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
    if cur:
        shards.append(cur)
    weight_map = {}
    for k, ts in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(ts, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(ts, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def evict(root: Path) -> None:
    """Write back and drop from the page cache every file under root (only these files)."""
    os.sync()
    for f in root.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_child(args: list[str]) -> tuple[str, float, int, float]:
    """Run a child process; return (stdout, wall seconds, peak RSS bytes, CPU seconds user + system).

    Peak RSS is the larger of wait4()'s ru_maxrss and a 10 ms psutil poll; this parent never imports torch or
    holds tensors, so the child's RSS before exec is small. The child runs in a session of its own, so Ctrl-C
    reaches only this process, which then kills it (its files are deleted with the benchmark's folder): the
    interrupt ends with this process's one line."""
    import psutil

    t0 = time.perf_counter()
    p = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        peak, proc = 0, psutil.Process(p.pid)
        with ThreadPoolExecutor(1) as ex:
            out = ex.submit(p.stdout.read)
            while True:
                pid, status, usage = os.wait4(p.pid, os.WNOHANG)  # reaps the child itself, to get its rusage
                if pid:
                    break
                try:
                    peak = max(peak, proc.memory_info().rss)
                except psutil.Error:
                    pass
                time.sleep(0.01)
            text = out.result()
    except BaseException:
        if p.returncode is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        raise
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise KimiInputError(f"{' '.join(args[:5])}: failed with exit code {p.returncode} (its output above)")
    return text, wall, max(peak, usage.ru_maxrss * 1024), usage.ru_utime + usage.ru_stime


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument("--layers", type=integer(1), default=6, metavar="N",
                   help="decoder layers of the checkpoint (~1 GB each: at 6, the ~1.2 CPU s start-up is ~0.2 CPU s/GB)")
    p.add_argument("--experts", type=integer(1), default=20, metavar="E",
                   help="routed experts per layer (Kimi-K2 has 384; 20 keeps the checkpoint near 1 GB per layer)")
    p.add_argument("--shard-gb", type=number(0, lo_open=True), default=1.0, metavar="GB",
                   help="source shard size in GB (Kimi-K2's are ~16 GB; the shards cut layers wherever they fall)")
    p.add_argument("--workers", type=integer(1), default=2, metavar="N", help="the conversion's --workers")
    p.add_argument("--warm", action="store_true",
                   help="leave the page cache alone (default: evict the benchmark's own files before each phase)")
    p.add_argument("--keep", action="store_true", help="keep the files under /tmp (default: deleted at the end)")
    return p


def source_bytes(layers: int, experts: int) -> int:
    """The synthetic checkpoint's size, near enough for the disk check: the FP8 experts (routed and shared), the
    attention and the bf16 embedding and lm_head."""
    cfg = bench_config(layers, experts)
    expert = 3 * H * I
    attention = 1536 * H + 8 * 192 * 1536 + 576 * H + 8 * 256 * 512 + H * 8 * 128
    return layers * ((experts + 1) * expert + attention) + 2 * 2 * cfg["vocab_size"] * H


def check_disk(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < need:
        raise KimiInputError(f"{folder}: {free / 1e9:.1f} GB free, the benchmark writes {need / 1e9:.1f} GB there "
                             f"(the source, then the converted copy or the plain copy); use fewer --layers or "
                             f"--experts")


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        # the converted copy (~7% larger: non-expert weights go from FP8 to bf16) is deleted before the plain copy,
        # unless --keep
        check_disk(Path("/tmp"), int((3.1 if a.keep else 2.1) * source_bytes(a.layers, a.experts)))
        _run(a)
    except KimiInputError as e:
        return fail(e)
    return 0


def _run(a: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench_convert.", dir="/tmp"))
    try:
        src, dst = root / "src", root / "dst"
        t0 = time.perf_counter()
        run_child([sys.executable, "-c", _BUILD, __file__, str(src), str(a.layers), str(a.experts),
                   str(a.shard_gb * 1e9)])
        shard_sizes = [f.stat().st_size for f in src.glob("*.safetensors")]
        print(f"built {len(shard_sizes)} shards, {sum(shard_sizes) / 1e9:.2f} GB (largest "
              f"{max(shard_sizes) / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s", flush=True)
        os.sync()  # the build's writes must not compete with the phases below
        cold = (lambda: None) if a.warm else (lambda: evict(root))
        cold()
        raw_gbs = _gbs(run_child([sys.executable, "-c", _RAW_READ, str(src)])[0])
        cold()
        cmd = [sys.executable, "-m", "kimi_k2_neuron.cli", "convert", str(src), str(dst),
               "--experts", "fp8-blockwise", "--workers", str(a.workers)]
        load = [os.getloadavg()[0]]  # other work on the machine, reported beside the times it skews
        summary, conv_s, peak, cpu_s = run_child(cmd)
        load.append(os.getloadavg()[0])
        source_gb = sum(shard_sizes) / 1e9
        conv_gbs = source_gb / conv_s
        if not a.keep:
            shutil.rmtree(dst)
        cold()
        seq_gbs = _gbs(run_child([sys.executable, "-c", _SEQ_READ, str(src)])[0])
        cold()
        copy_gbs = _gbs(run_child([sys.executable, "-c", _COPY, str(src), str(root / "copy")])[0])
        startup = [sys.executable, "-c", "import kimi_k2_neuron.cli; kimi_k2_neuron.cli.load_converter()"]
        _, start_s, _, start_cpu = run_child(startup)
        res = {"source_gb": round(source_gb, 3), "largest_shard_gb": round(max(shard_sizes) / 1e9, 3),
               "page_cache": "warm" if a.warm else "cold (own files evicted before each phase)",
               "workers": a.workers, "raw_read_gb_s": round(raw_gbs, 3), "convert_gb_s": round(conv_gbs, 3),
               "convert_seconds": round(conv_s, 1), "convert_cpu_seconds": round(cpu_s, 2),
               "convert_cpu_seconds_per_gb": round(cpu_s / source_gb, 2),
               "startup_seconds": round(start_s, 2), "startup_cpu_seconds": round(start_cpu, 2),
               "convert_cpu_seconds_per_gb_after_startup": round((cpu_s - start_cpu) / source_gb, 2),
               "sequential_read_gb_s": round(seq_gbs, 3), "copy_gb_s": round(copy_gbs, 3),
               "throughput_ratio": round(conv_gbs / raw_gbs, 3), "convert_vs_copy": round(conv_gbs / copy_gbs, 3),
               "peak_rss_gb": round(peak / 1e9, 3), "rss_ratio": round(peak / max(shard_sizes), 3),
               "load_average_1min_before_after_convert": load, "cpus": os.cpu_count()}
        print(summary.strip())
        print(f"conversion: {conv_gbs:.3f} GB/s (wall, with process start), {res['convert_cpu_seconds_per_gb']} "
              f"CPU s/GB "
              f"(goal <= 1.2; {res['convert_cpu_seconds_per_gb_after_startup']} after the {start_cpu:.2f} CPU s of "
              f"start-up); / plain copy with fsync {copy_gbs:.3f} GB/s = {res['convert_vs_copy']:.2f} (goal >= 0.8); "
              f"/ raw safetensors read {raw_gbs:.3f} GB/s = {res['throughput_ratio']:.2f}; sequential read() "
              f"{seq_gbs:.3f} GB/s; peak RSS {peak / 1e9:.2f} GB / largest shard {max(shard_sizes) / 1e9:.2f} GB = "
              f"{res['rss_ratio']:.2f} (goal <= 1.6); page cache {res['page_cache']}; load average {load[0]:.1f} "
              f"before and {load[1]:.1f} after the conversion, {os.cpu_count()} CPUs")
        print(json.dumps(res))
        if a.keep:
            print(f"kept: the source, the converted copy and the plain copy under {root}")
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)


def _gbs(child_out: str) -> float:
    """GB/s from a timing child's "bytes seconds" line."""
    n, seconds = child_out.split()
    return int(n) / float(seconds) / 1e9


if __name__ == "__main__":
    sys.exit(run_command(main))
