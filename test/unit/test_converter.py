"""The converter (convert/): every source x target on tiny checkpoints, the NxD layout and +-240 invariant, logit
drift through the CPU runner, kill-and-resume byte identity, --verify, and one-line errors for bad input (the FP8 byte
math itself: test_nxd_fp8.py; the command line: test_cli.py)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import blake3
import pytest
import torch
from checkpoint_edits import scramble_data
from safetensors.torch import load_file, save_file

from kimi_k2_neuron import cli
from kimi_k2_neuron.checkpoint.shards import ShardedCheckpoint
from kimi_k2_neuron.checkpoint.source import WeightSource
from kimi_k2_neuron.convert import writer
from kimi_k2_neuron.convert.converter import MANIFEST, convert
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats import SCHEMES, layout
from kimi_k2_neuron.formats.record import CONVERSION_KEY, ConversionRecord
from kimi_k2_neuron.formats.scheme import NXD_TYPE, scheme_for
from kimi_k2_neuron.interrupts import PARTIAL_SUFFIX
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.runtime.chat import prompt_ids
from kimi_k2_neuron.runtime.runner import CpuRunner
from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer

SOURCES = ("fp8", "int4", "bf16")
COMBOS = [(s, t) for s in SOURCES for t in SCHEMES]
INDEX = "model.safetensors.index.json"
ROWS = [[5, 17, 300, 42, 9, 77, 123, 200, 11, 3, 260, 99]]
MOE_LAYERS = (1, 2)  # tiny: 3 layers, first_k_dense_replace 1


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _not_finished(d: Path):
    """Nothing a loader would take for a checkpoint, and no temp files."""
    if d.exists():
        assert not (d / "config.json").exists() and not (d / INDEX).exists()
        assert not list(d.glob(f"*{PARTIAL_SUFFIX}"))


# ------------------------------------------------------------------------------------------ layout and values


@pytest.mark.parametrize("source,scheme", COMBOS)
def test_layout_matches_nxd(converted, tiny, source, scheme):
    dst, res = converted[(source, scheme)]
    cfg = WeightSource(tiny[source]).cfg
    e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    rec = json.loads((dst / "config.json").read_text())[CONVERSION_KEY]
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())
    nxd = rec["nxd"]
    assert rec["experts"] == scheme and rec["source_format"] == source and rec["fp8_max"] == 240.0
    assert nxd["quantization_type"] == NXD_TYPE[scheme] and nxd["quantization_dtype"] == "f8e4m3"
    block = None if scheme == "fp8-per-channel" else tuple(nxd["quantization_block_size"])
    if block is not None:
        assert nxd["quantization_block_axis"] == [1, 2]
        assert block == ((32, 1) if source == "int4" else (32, 32))
    with ShardedCheckpoint(dst) as ck:
        keys = ck.keys()
        assert not [k for k in keys if ".mlp.experts." in k or "scale_inv" in k or "weight_packed" in k]
        for L in MOE_LAYERS:
            gu, dn = layout.gate_up_key(L), layout.down_key(L)
            for key, shape in ((gu, (e, h, 2 * i)), (dn, (e, i, h))):
                info = ck.info(key)
                assert info.dtype == torch.float8_e4m3fn and info.shape == shape
                sinfo = ck.info(layout.scale_key(key))
                want = (e, 1, shape[2]) if block is None else (e, shape[1] // block[0], shape[2] // block[1])
                assert sinfo.dtype == torch.float32 and sinfo.shape == want
            for name in ("weight", "e_score_correction_bias"):  # the router: float32, under its HF names
                assert ck.info(f"{layout.layer_prefix(L)}mlp.gate.{name}").dtype == torch.float32
        for k in keys:
            dt = ck.info(k).dtype
            if dt == torch.float8_e4m3fn:  # the +-240 invariant, on every stored FP8 value
                mag = ck.get(k).view(torch.uint8) & 0x7F
                assert int(mag.max()) <= 0x77, k
            elif not (k.endswith(".scale") or ".mlp.gate." in k):  # the router is float32
                assert dt == torch.bfloat16, k
    assert res.files == 5 and res.skipped == 0


def test_fp8_blockwise_keeps_expert_values(converted, tiny):
    """fp8 -> fp8-blockwise: every expert weight dequantizes to the source's value, except the counted
    subnormal-tail codes of halved blocks."""
    dst, res = converted[("fp8", "fp8-blockwise")]
    a, b = WeightSource(tiny["fp8"]), WeightSource(dst)
    names = [n for n in a.names() if ".mlp.experts." in n]
    changed = sum(int((a.get(n, torch.float32) != b.get(n, torch.float32)).sum()) for n in names)
    assert res.stats.rescaled > 0 and changed <= res.stats.inexact
    assert res.stats.inexact < 1e-3 * sum(b.ckpt.info(n).nbytes // 4 for n in names)
    assert res.summary.endswith(f"inexact codes {res.stats.inexact}; experts exact but for those codes (the "
                                f"subnormal tail, rounded to nearest even); 3 source tensors ignored by name")


def test_int4_blockwise_is_lossless(converted, tiny):
    dst, res = converted[("int4", "fp8-blockwise")]
    a, b = WeightSource(tiny["int4"]), WeightSource(dst)
    for n in [n for n in a.names() if ".mlp.experts." in n]:
        assert torch.equal(a.get(n, torch.float32), b.get(n, torch.float32)), n
    assert res.stats.rescaled == 0 and res.stats.sq_err == 0
    assert "inexact codes 0; experts exact; " in res.summary


def _drift(src_dir, dst_dir, dtype):
    ref = CpuRunner(src_dir, dtype=dtype).logits(ROWS, prefill_len=8)
    out = CpuRunner(dst_dir, dtype=dtype).logits(ROWS, prefill_len=8)
    per_pos = ((out - ref).abs().amax(-1) / ref.abs().max())[0]
    return float(per_pos.max()), float(per_pos.median())


@pytest.mark.slow
@pytest.mark.parametrize("source,scheme", COMBOS)
def test_logit_drift(converted, tiny, source, scheme):
    """CpuRunner(DST) vs CpuRunner(SRC). Exact expert paths must agree within 1e-3 of max |logit| in bf16 (the
    dtype NxDI runs, in which the BF16-stored non-expert weights are what the source dequantizes to as well);
    re-rounding paths report their drift (printed; -s to see it)."""
    dst, res = converted[(source, scheme)]
    bf16_max, bf16_med = _drift(tiny[source], dst, torch.bfloat16)
    f32_max, f32_med = _drift(tiny[source], dst, torch.float32)
    print(f"\nDRIFT {source:>4} -> {scheme:<15} bf16 max {bf16_max:.2e} median {bf16_med:.2e} | "
          f"fp32 max {f32_max:.2e} median {f32_med:.2e} | weights rel-rms "
          f"{(res.stats.sq_err / res.stats.sq_ref) ** 0.5 if res.stats.sq_ref else 0:.3g}")
    if (source, scheme) in (("fp8", "fp8-blockwise"), ("int4", "fp8-blockwise")):
        assert bf16_max <= 1e-3
        assert f32_max <= (1e-6 if source == "int4" else 2e-2)  # fp32: only the BF16 non-expert rounding
    else:  # FP8 re-rounding (~2.5 % rms per weight); the max includes a routing flip on the tiny model
        assert bf16_med < 0.08 and f32_med < 0.08 and f32_max < 0.4


@pytest.mark.parametrize("source", ["fp8", "int4"])
def test_exact_paths_fp32_drift_beyond_bf16_storage(converted, tiny, source):
    """The fp32 drift of test_logit_drift comes only from storing non-expert weights in BF16 (which the issue
    asks for): give the source runner that same rounding and the exact expert paths agree within 1e-3 of max
    |logit| in fp32 too (measured ~4e-7 for fp8, 0 for int4)."""
    ref_runner = CpuRunner(tiny[source], dtype=torch.float32)
    with torch.no_grad():
        for name, p in ref_runner.model.named_parameters():
            if ".mlp.experts." not in name and ".mlp.gate." not in name:  # the router stays fp32 in DST
                p.copy_(p.to(torch.bfloat16))
    ref = ref_runner.logits(ROWS, prefill_len=8)
    out = CpuRunner(converted[(source, "fp8-blockwise")][0], dtype=torch.float32).logits(ROWS, prefill_len=8)
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-3


def _as_k25(src: Path, dst: Path) -> None:
    """The INT4 tiny checkpoint laid out as Kimi-K2.5 stores it: config under text_config (quantization_config on
    top), tensors under `language_model.`, plus a vision tower and projector in a shard of their own."""
    dst.mkdir()
    index = json.loads((src / INDEX).read_text())["weight_map"]
    weight_map = {}
    for shard in sorted(set(index.values())):
        tensors = load_file(src / shard)
        save_file({"language_model." + k: v for k, v in tensors.items()}, str(dst / shard), metadata={"format": "pt"})
        weight_map.update({"language_model." + k: shard for k in tensors})
    vision = {"vision_tower.blocks.0.attn.qkv.weight": torch.randn(48, 16).to(torch.bfloat16),
              "mm_projector.proj.0.weight": torch.randn(192, 64).to(torch.bfloat16)}
    save_file(vision, str(dst / "model-vision.safetensors"), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(vision, "model-vision.safetensors"))
    (dst / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    text = json.loads((src / "config.json").read_text())
    cfg = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
           "quantization_config": text.pop("quantization_config"), "text_config": text,
           "vision_config": {"hidden_size": 16}}
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():  # tokenizer and friends
        if f.suffix != ".safetensors" and f.name not in (INDEX, "config.json"):
            shutil.copy(f, dst / f.name)


def test_k25_layout_serves_its_language_model(converted, tiny, tmp_path):
    """Kimi-K2.5's language model reads and converts like K2-Thinking; its vision tower and projector are set
    aside by name and counted."""
    k25 = tmp_path / "k25"
    _as_k25(tiny["int4"], k25)
    want = CpuRunner(tiny["int4"]).logits(ROWS, prefill_len=8)
    assert torch.equal(CpuRunner(k25).logits(ROWS, prefill_len=8), want)
    src = WeightSource(k25)
    assert sorted(k for k in src.ignored if not k.endswith("inv_freq")) == ["mm_projector.proj.0.weight",
                                                                          "vision_tower.blocks.0.attn.qkv.weight"]
    res = convert(k25, tmp_path / "k25-neuron", "fp8-blockwise", progress=False)
    assert "source tensors ignored by name" in res.summary
    record = ConversionRecord.read(tmp_path / "k25-neuron")
    assert record.raw["ignored_source_tensors"] == len(src.ignored)
    plain = converted[("int4", "fp8-blockwise")][0]
    assert torch.equal(CpuRunner(tmp_path / "k25-neuron").logits(ROWS, prefill_len=8),
                       CpuRunner(plain).logits(ROWS, prefill_len=8))


@pytest.mark.parametrize("release", ["k2.6", "k2.7"])
def test_k26_and_k27_checkpoints_convert_plan_and_generate(converted, tiny, tmp_path, capsys, release):
    """Kimi-K2.6 and K2.7-Code in their layout (make-tiny --layout): the same language model as the tiny INT4
    checkpoint of the same seed, so its logits, raw and converted, are that checkpoint's (checked against
    transformers in test_model_vs_transformers); plan reads the converted one; generate stops on both of Kimi's end
    tokens and, for K2.7, samples as its generation config asks unless --greedy."""
    from kimi_k2_neuron.tiny.checkpoint import make_tiny

    raw = make_tiny(tmp_path / release, layout=release, seed=0)
    want = CpuRunner(tiny["int4"]).logits(ROWS, prefill_len=8)
    assert torch.equal(CpuRunner(raw).logits(ROWS, prefill_len=8), want)
    res = convert(raw, tmp_path / "neuron", "fp8-blockwise", progress=False)
    assert "source tensors ignored by name" in res.summary
    plain = converted[("int4", "fp8-blockwise")][0]
    assert torch.equal(CpuRunner(tmp_path / "neuron").logits(ROWS, prefill_len=8),
                       CpuRunner(plain).logits(ROWS, prefill_len=8))
    assert cli.main(["plan", "--model", str(tmp_path / "neuron"), "--tp", "1", "--seq-len", "64",
                     "--moe-prefill", "torch", "--json"]) == 0
    capsys.readouterr()
    args = ["generate", "--model", str(tmp_path / "neuron"), "--prompt", "Hi", "--max-new-tokens", "4", "--json"]
    assert cli.main(args + ["--greedy"]) == 0
    greedy = json.loads(capsys.readouterr().out)["tokens"]
    tok = KimiTokenizer.from_dir(raw)  # the release's template (it opens <think>) on the plain checkpoint's runner
    stops = tok.stop_ids(KimiK2Config.from_file(raw).eos_token_ids)
    assert stops == {tok.token_to_id("[EOS]"), tok.token_to_id("<|im_end|>")}
    assert greedy == CpuRunner(plain).generate(prompt_ids(tok, ["Hi"]), 4, stop_ids=stops).tokens
    if release == "k2.7":
        assert cli.main(args) == 0
        out = capsys.readouterr()
        assert "sampling as the checkpoint's generation_config.json asks (temperature 1.0, top_p 0.95)" in out.err
        assert json.loads(out.out)["tokens"] != greedy


def test_experts_split_across_shards_and_accounting(converted, tiny):
    index = json.loads((tiny["fp8"] / INDEX).read_text())["weight_map"]
    shards = {f for k, f in index.items() if k.startswith("model.layers.1.mlp.experts.")}
    assert len(shards) == 2  # the tiny maker cuts layer 1's experts across two files
    src = WeightSource(tiny["fp8"])
    assert src.ignored and all(k.endswith("rotary_emb.inv_freq") for k in src.ignored)
    dst_keys = set(json.loads((converted[("fp8", "fp8-blockwise")][0] / INDEX).read_text())["weight_map"])
    assert not [k for k in dst_keys if "inv_freq" in k]


# ------------------------------------------------------------------------------------------ NxD sharding


def _nxd_local_scale_shape(local_w: tuple, block: tuple, partition_dim: int) -> tuple:
    """The per-rank scale shape NxD's _setup_for_scale builds for blockwise (quantization_layers.py:271-299)."""
    shape = list(local_w)
    for axis, size in zip((1, 2), block):
        if local_w[axis] < size:
            assert axis == partition_dim
            shape[axis] = 1
        else:
            shape[axis] = local_w[axis] // size
    return tuple(shape)


def _nxd_shard(full: torch.Tensor, dim: int, stride: int, tp: int, rank: int) -> torch.Tensor:
    """NxD's create_local_weight (trace.py:678-686): chunks of dim//tp//stride, every tp-th one."""
    chunk = full.shape[dim] // tp // stride
    parts = torch.split(full, chunk, dim=dim)[rank::tp]
    return torch.cat(parts, dim=dim)


def _deq(w, s):  # NxD's blockwise dequantize: blocks inferred from the shapes (dequantize.py:43-122)
    e, a, b = w.shape
    return (w.float().view(e, s.shape[1], a // s.shape[1], s.shape[2], b // s.shape[2])
            * s[:, :, None, :, None]).view(e, a, b)


@pytest.mark.parametrize("source", ["fp8", "int4"])
def test_blockwise_scales_shard_for_every_valid_tp(converted, tiny, source):
    dst, _ = converted[(source, "fp8-blockwise")]
    rec = json.loads((dst / "config.json").read_text())[CONVERSION_KEY]["nxd"]
    block, tps = tuple(rec["quantization_block_size"]), rec["valid_moe_tp_degrees"]
    assert len(tps) >= 2
    with ShardedCheckpoint(dst) as ck:
        for key, dim, stride in ((layout.gate_up_key(1), 2, 2), (layout.down_key(1), 1, 1)):
            w, s = ck.get(key), ck.get(layout.scale_key(key))
            full = _deq(w, s)
            for tp in tps:
                for rank in range(tp):
                    lw = _nxd_shard(w.view(torch.uint8), dim, stride, tp, rank).view(torch.float8_e4m3fn)
                    ls = _nxd_shard(s, dim, stride, tp, rank)
                    assert tuple(ls.shape) == _nxd_local_scale_shape(tuple(lw.shape), block, dim)
                    assert torch.equal(_deq(lw, ls), _nxd_shard(full, dim, stride, tp, rank))
    # Kimi-K2 itself (I = 2048): one converted checkpoint serves every MoE TP up to 64.
    for src_fmt, group in (("fp8", None), ("int4", 32)):
        assert 64 in scheme_for("fp8-blockwise", src_fmt, group).nxd(2048)["valid_moe_tp_degrees"]


# ------------------------------------------------------------------------------------------ resume and verify


def _run_cli(src, dst, env=None):
    return subprocess.run([sys.executable, "-m", "kimi_k2_neuron.cli", "convert", str(src), str(dst), "--experts",
                           "fp8-blockwise"], env={**os.environ, **(env or {})}, capture_output=True, text=True)


def test_killed_midway_then_resumed_is_byte_identical(converted, tiny, tmp_path):
    ref = _files(converted[("fp8", "fp8-blockwise")][0])
    # 1) die inside the 3rd file (the hook is os._exit: no cleanup, like SIGKILL), 2) a real SIGKILL at a moment
    # chosen by the scheduler.
    dst = tmp_path / "killed"
    p = _run_cli(tiny["fp8"], dst, {writer.DIE_ENV: "1000000"})
    assert p.returncode == 75, p.stderr
    assert list(dst.glob(f"*{PARTIAL_SUFFIX}")) and not (dst / "config.json").exists()
    done = json.loads((dst / MANIFEST).read_text())["files"]
    assert 0 < len(done) < 5
    res = convert(tiny["fp8"], dst, "fp8-blockwise", progress=False)
    assert res.skipped == len(done)
    assert _files(dst) == ref

    dst2 = tmp_path / "sigkill"
    proc = subprocess.Popen([sys.executable, "-m", "kimi_k2_neuron.cli", "convert", str(tiny["fp8"]),
                             str(dst2), "--experts", "fp8-blockwise"], stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not (dst2 / MANIFEST).exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    convert(tiny["fp8"], dst2, "fp8-blockwise", progress=False)
    assert _files(dst2) == ref


def test_rerun_skips_and_verify_rehashes(converted, tiny, tmp_path):
    dst = Path(shutil.copytree(converted[("int4", "fp8-blockwise")][0], tmp_path / "d"))
    ref = _files(dst)
    res = convert(tiny["int4"], dst, "fp8-blockwise", progress=False)
    assert res.skipped == res.files == 5 and _files(dst) == ref
    victim = dst / "model-00002-of-00005.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # same size: only a re-hash notices
    victim.write_bytes(bytes(data))
    assert convert(tiny["int4"], dst, "fp8-blockwise", progress=False).redone == []
    res = convert(tiny["int4"], dst, "fp8-blockwise", verify=True, progress=False)
    assert res.redone == [victim.name] and _files(dst) == ref
    assert "1 rewritten after failing --verify" in res.summary


def test_manifest_records_blake3(converted):
    dst, _ = converted[("fp8", "fp8-blockwise")]
    manifest = json.loads((dst / MANIFEST).read_text())
    assert manifest["manifest_version"] == 2 and manifest["hash"] == "blake3" and manifest["complete"]
    for name, rec in manifest["files"].items():
        assert rec["blake3"] == blake3.blake3((dst / name).read_bytes()).hexdigest()
        assert "sha256" not in rec


def _as_v1_manifest(dst: Path) -> None:
    """Rewrite DST's manifest as version 1 wrote it: sha256 records, no hash field."""
    manifest = json.loads((dst / MANIFEST).read_text())
    manifest["manifest_version"] = 1
    del manifest["hash"]
    for name, rec in manifest["files"].items():
        del rec["blake3"]
        rec["sha256"] = hashlib.sha256((dst / name).read_bytes()).hexdigest()
    (dst / MANIFEST).write_text(json.dumps(manifest))


def test_version1_sha256_manifest_resumes_and_verifies(converted, tiny, tmp_path):
    """A DST left by a version-1 (sha256) conversion resumes: its records are kept and --verify checks them
    with sha256; a file redone gets a BLAKE3 record."""
    dst = Path(shutil.copytree(converted[("int4", "fp8-blockwise")][0], tmp_path / "d"))
    ref = _files(dst)
    _as_v1_manifest(dst)
    (dst / "config.json").unlink()  # as if the old run had been killed before its end
    res = convert(tiny["int4"], dst, "fp8-blockwise", verify=True, progress=False)
    assert res.skipped == res.files == 5 and res.redone == []
    victim = dst / "model-00003-of-00005.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    res = convert(tiny["int4"], dst, "fp8-blockwise", verify=True, progress=False)
    assert res.redone == [victim.name]
    files = json.loads((dst / MANIFEST).read_text())["files"]
    assert "blake3" in files[victim.name] and "sha256" in files["model-00002-of-00005.safetensors"]
    assert {k: v for k, v in _files(dst).items() if k != MANIFEST} == {k: v for k, v in ref.items() if k != MANIFEST}


def test_unknown_manifest_version_is_refused(converted, tmp_path, tiny, one_line_error):
    dst = Path(shutil.copytree(converted[("int4", "fp8-blockwise")][0], tmp_path / "d"))
    manifest = json.loads((dst / MANIFEST).read_text())
    manifest["manifest_version"] = 99
    (dst / MANIFEST).write_text(json.dumps(manifest))
    one_line_error(lambda: convert(tiny["int4"], dst, "fp8-blockwise", progress=False), str(dst / MANIFEST),
                   "manifest_version 99", "delete DST")


# ------------------------------------------------------------------------------------------ bad input


@pytest.fixture
def src_copy(tiny, tmp_path):
    def copy(q="fp8"):
        return Path(shutil.copytree(tiny[q], tmp_path / f"src-{q}"))
    return copy


def _rewrite(d: Path, name: str, fn):
    """Apply fn(tensors) to the shard holding `name` and save it back."""
    shard = d / json.loads((d / INDEX).read_text())["weight_map"][name]
    ts = load_file(str(shard))
    fn(ts)
    save_file(ts, str(shard), metadata={"format": "pt"})
    return shard


EXPERT = "model.layers.2.mlp.experts.5.down_proj"


def _poke(t: torch.Tensor, i: int, value) -> None:
    t.view(-1)[i] = value


def _convert_fails(one_line_error, src, dst, *needles, experts="fp8-blockwise"):
    msg = one_line_error(lambda: convert(src, dst, experts, progress=False), *needles)
    _not_finished(dst)
    return msg


def test_bad_shards(src_copy, tmp_path, one_line_error):
    d = src_copy()
    shard = d / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    _convert_fails(one_line_error, d, tmp_path / "a", "model-00002-of-00003.safetensors", "truncated")
    assert not (tmp_path / "a").exists()
    shard.unlink()
    _convert_fails(one_line_error, d, tmp_path / "b", "does not exist")
    (d / "model-00002-of-00003.safetensors").write_bytes(b"\xff" * 64)
    _convert_fails(one_line_error, d, tmp_path / "c", "corrupt header")


def test_nan_and_inf_scales(src_copy, tmp_path, one_line_error):
    d = src_copy("fp8")
    _rewrite(d, EXPERT + ".weight_scale_inv", lambda ts: _poke(ts[EXPERT + ".weight_scale_inv"], 0, float("nan")))
    _convert_fails(one_line_error, d, tmp_path / "a", EXPERT + ".weight_scale_inv", "NaN")
    assert (tmp_path / "a" / MANIFEST).exists()  # earlier layers are kept for a resume
    d4 = src_copy("int4")
    _rewrite(d4, EXPERT + ".weight_scale", lambda ts: _poke(ts[EXPERT + ".weight_scale"], 3, float("inf")))
    for i, t in enumerate(SCHEMES):
        _convert_fails(one_line_error, d4, tmp_path / f"b{i}", EXPERT + ".weight_scale", "inf", experts=t)


NORM = "model.layers.0.input_layernorm.weight"
EMBED = "model.embed_tokens.weight"
# (source format, tensor, (flat index, value) written into it, words of the one-line error)
NON_FINITE = {
    "NaN in a bf16 norm weight": ("fp8", NORM, (5, float("nan")), ["NaN or inf"]),
    "inf in an embedding row": ("bf16", EMBED, (7 * 192 + 3, float("inf")), ["NaN or inf"]),
    "NaN in an expert's bf16 weight": ("bf16", EXPERT + ".weight", (11, float("nan")), ["NaN or inf"]),
    "FP8 NaN code 0x7f in an expert": ("fp8", EXPERT + ".weight", (7, 0x7F), ["NaN FP8 codes"]),
    "FP8 NaN code 0xff in an expert": ("fp8", EXPERT + ".weight", (700, 0xFF), ["NaN FP8 codes"]),
    # gate and up are read, scanned and transposed as one matrix: the line must still name the projection
    "FP8 NaN code in an expert's up_proj": ("fp8", "model.layers.2.mlp.experts.5.up_proj.weight", (900, 0xFF),
                                            ["NaN FP8 codes"]),
    "FP8 NaN code in attention": ("fp8", "model.layers.0.self_attn.o_proj.weight", (0, 0xFF), ["NaN FP8 codes"]),
}


@pytest.mark.parametrize("case", NON_FINITE)
def test_non_finite_source_tensor_is_refused(src_copy, tmp_path, one_line_error, case):
    fmt, name, (i, value), words = NON_FINITE[case]
    d = src_copy(fmt)
    fp8 = isinstance(value, int)
    shard = _rewrite(d, name, lambda ts: _poke(ts[name].view(torch.uint8) if fp8 else ts[name], i, value))
    for k, scheme in enumerate(SCHEMES):
        _convert_fails(one_line_error, d, tmp_path / f"o{k}", f"{shard.name}: tensor {name}", *words, experts=scheme)


def test_random_bytes_over_a_shard_are_refused(src_copy, tmp_path, capsys, one_line_error):
    """Random bytes hold NaN/inf values and NaN FP8 codes: `convert` ends with one line naming a tensor of the shard
    and exit code 2, no progress bar left on screen, and DST does not look like a checkpoint."""
    d = src_copy("fp8")
    scramble_data(d, "model-00002-of-00003.safetensors")
    dst = tmp_path / "dst"
    rc = cli.main(["convert", str(d), str(dst), "--experts", "fp8-blockwise"])
    err = "\n".join(line.split("\r")[-1] for line in capsys.readouterr().err.split("\n"))  # as a terminal shows it
    msg = one_line_error.exit(rc, err, "model-00002-of-00003.safetensors: tensor ")
    assert "NaN" in msg or "positive scales" in msg, msg  # whichever bad value is read first
    _not_finished(dst)


@pytest.mark.parametrize("source, dtype", [("fp8", torch.float8_e5m2), ("fp8", torch.uint8), ("bf16", torch.int16)])
def test_expert_bytes_of_another_dtype_are_refused_by_every_scheme(src_copy, tmp_path, one_line_error, source,
                                                                   dtype):
    # Same bytes, other dtype: read as e4m3 codes (or as numbers) they would convert without a word.
    d = src_copy(source)
    name = EXPERT + ".weight"
    _rewrite(d, name, lambda ts: ts.__setitem__(name, ts[name].view(torch.uint8).view(dtype)))
    for i, scheme in enumerate(SCHEMES):
        _convert_fails(one_line_error, d, tmp_path / f"o{i}", name, str(dtype).removeprefix("torch."),
                       experts=scheme)


def test_leftover_and_missing_tensors(src_copy, tmp_path, one_line_error):
    d = src_copy("bf16")
    index = json.loads((d / INDEX).read_text())
    _rewrite(d, "model.norm.weight", lambda ts: ts.__setitem__("model.layers.1.mlp.extra.weight", torch.ones(3)))
    index["weight_map"]["model.layers.1.mlp.extra.weight"] = index["weight_map"]["model.norm.weight"]
    (d / INDEX).write_text(json.dumps(index))
    _convert_fails(one_line_error, d, tmp_path / "a", "no place", "model.layers.1.mlp.extra.weight")
    del index["weight_map"]["model.layers.1.mlp.extra.weight"]
    del index["weight_map"][EXPERT + ".weight"]
    (d / INDEX).write_text(json.dumps(index))
    _convert_fails(one_line_error, d, tmp_path / "b", "missing", EXPERT + ".weight")


def test_redoing_part_of_a_finished_conversion_unfinishes_it_until_done(converted, tiny, tmp_path,
                                                                         monkeypatch, one_line_error):
    ref = _files(converted[("fp8", "fp8-blockwise")][0])
    dst = Path(shutil.copytree(converted[("fp8", "fp8-blockwise")][0], tmp_path / "d"))
    (dst / "model-00003-of-00005.safetensors").unlink()  # lost: the rerun redoes it

    real = writer._write_bytes

    def full_for_shards(f, buf, *offset):  # the manifest still saves; the lost shard cannot be written
        if ".safetensors" in f.name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(f, buf, *offset)

    monkeypatch.setattr(writer, "_write_bytes", full_for_shards)
    _convert_fails(one_line_error, tiny["fp8"], dst, "disk full")  # and DST no longer looks like a checkpoint
    monkeypatch.undo()
    convert(tiny["fp8"], dst, "fp8-blockwise", progress=False)
    assert {k: v for k, v in _files(dst).items() if k != MANIFEST} == {k: v for k, v in ref.items() if k != MANIFEST}


def test_disk_full_then_resume(converted, tiny, tmp_path, monkeypatch, one_line_error):
    calls = {"n": 0}
    real = writer._write_bytes

    def full_after_some(f, buf, *offset):
        calls["n"] += 1
        if calls["n"] > 12:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(f, buf, *offset)

    monkeypatch.setattr(writer, "_write_bytes", full_after_some)
    dst = tmp_path / "full"
    _convert_fails(one_line_error, tiny["fp8"], dst, "disk full", str(dst))
    if (dst / MANIFEST).exists():
        assert not json.loads((dst / MANIFEST).read_text())["complete"]
    monkeypatch.setattr(writer, "_write_bytes", real)
    convert(tiny["fp8"], dst, "fp8-blockwise", progress=False)
    assert _files(dst) == _files(converted[("fp8", "fp8-blockwise")][0])


def _writes_of_a_conversion(src, tmp_path, monkeypatch) -> int:
    calls = {"n": 0}
    real = writer._write_bytes

    def counting(f, buf, *offset):
        calls["n"] += 1
        real(f, buf, *offset)

    monkeypatch.setattr(writer, "_write_bytes", counting)
    convert(src, tmp_path / "count", "fp8-blockwise", progress=False)
    monkeypatch.setattr(writer, "_write_bytes", real)
    return calls["n"]


def test_a_write_failing_anywhere_ends_in_one_line_and_resumes(converted, tiny, tmp_path, monkeypatch,
                                                              one_line_error):
    """Every write of a conversion in turn fails with a full disk: each run ends in the one `disk full` line (a
    failure while a file was being finished -- its last slab's write in flight, the last partial page, the fsync --
    once left the file's thread waiting for an item that never came, and the conversion hung), leaves no partial
    file, and a rerun gives the uninterrupted conversion's files. The run has a watchdog: a hang fails the test."""
    import threading

    want = _files(converted[("fp8", "fp8-blockwise")][0])
    real = writer._write_bytes
    total = _writes_of_a_conversion(tiny["fp8"], tmp_path, monkeypatch)
    assert total > 20
    for k in range(1, total + 1):
        calls = {"n": 0}

        def full_at_k(f, buf, *offset):
            calls["n"] += 1
            if calls["n"] == k:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(f, buf, *offset)

        dst, outcome = tmp_path / f"k{k}", {}

        def run():
            try:
                convert(tiny["fp8"], dst, "fp8-blockwise", progress=False)
            except BaseException as e:  # noqa: BLE001 -- inspected below
                outcome["error"] = e

        monkeypatch.setattr(writer, "_write_bytes", full_at_k)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(60)
        monkeypatch.setattr(writer, "_write_bytes", real)
        assert not t.is_alive(), f"the conversion hung after write {k} of {total} failed"
        assert isinstance(outcome.get("error"), KimiInputError), (k, outcome)
        one_line_error.message(str(outcome["error"]), "disk full", "free space and rerun to resume")
        _not_finished(dst)
        if k in (1, total // 2, total - 1, total):
            convert(tiny["fp8"], dst, "fp8-blockwise", progress=False)
            assert {n: b for n, b in _files(dst).items() if n != MANIFEST} == \
                {n: b for n, b in want.items() if n != MANIFEST}, k
        shutil.rmtree(dst, ignore_errors=True)


def test_an_interrupt_while_a_file_opens_leaves_no_partial_file(tmp_path, monkeypatch):
    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer.threading.Thread, "start", interrupted)
    final = tmp_path / "model-00001-of-00001.safetensors"
    with pytest.raises(KeyboardInterrupt):
        writer.ShardWriter(final, [("x", torch.bfloat16, (4,))])
    assert list(tmp_path.iterdir()) == []


def test_bad_destinations(converted, tiny, tmp_path, one_line_error):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    _convert_fails(one_line_error, tiny["fp8"], foreign, str(foreign), "not empty")
    other = Path(shutil.copytree(converted[("fp8", "fp8-per-channel")][0], tmp_path / "other"))
    (other / "config.json").unlink()
    (other / INDEX).unlink()
    _convert_fails(one_line_error, tiny["fp8"], other, MANIFEST, "experts")
    one_line_error(lambda: convert(converted[("fp8", "fp8-blockwise")][0], tmp_path / "again", "fp8-blockwise",
                                   progress=False), "already a converted checkpoint")


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_nan_code_in_a_converted_checkpoint_is_refused_at_load(converted, tmp_path, one_line_error, code):
    dst = Path(shutil.copytree(converted[("fp8", "fp8-blockwise")][0], tmp_path / "d"))
    key = layout.gate_up_key(1)
    shard = _rewrite(dst, key, lambda ts: _poke(ts[key].view(torch.uint8), 3 * 192 * 128 + 5, code))
    one_line_error(lambda: CpuRunner(dst).logits(ROWS), f"{shard.name}: tensor {key} (expert 3)", "NaN FP8 codes")


def test_same_bytes_without_o_direct(converted, tiny, tmp_path, monkeypatch):
    """Where the filesystem refuses O_DIRECT (tmpfs), reads and writes go through the page cache: same files."""
    from kimi_k2_neuron.checkpoint import shards
    monkeypatch.setattr(writer, "open_direct_file", lambda *a: None)
    monkeypatch.setattr(shards, "open_direct", lambda *a: None)
    dst = tmp_path / "buffered"
    convert(tiny["fp8"], dst, "fp8-blockwise", progress=False)
    assert _files(dst) == _files(converted[("fp8", "fp8-blockwise")][0])


@pytest.mark.parametrize("built", [True, False])
def test_a_conversion_without_the_c_kernel_says_so_first(tiny, tmp_path, monkeypatch, capsys, built):
    """On a host where setup.py found no C compiler the torch steps take ~1.6x the CPU: the user hears it before the
    run, not from a benchmark; the files are the same either way (test_nxd_fp8 holds both paths to one reference)."""
    from kimi_k2_neuron.quant import nxd_fp8

    monkeypatch.setattr(nxd_fp8, "KERNEL_BUILT", built)
    convert(tiny["fp8"], tmp_path / "d", "fp8-blockwise", progress=True)
    err = capsys.readouterr().err
    assert ("note: FP8 expert codes go through the torch steps" in err) != built, err
