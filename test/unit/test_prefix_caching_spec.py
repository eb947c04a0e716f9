"""--prefix-caching without NxD/NxDI: the flags -> RunSpec -> NxDI's block-layout NeuronConfig fields and 2D buckets,
what the rules refuse, and the planner's block pool and warm/cold turn (fit.py); vLLM's request and the precompiled
checks are test_vllm_request.py's. The model through NxDI: test/nxdi_cpu/test_prefix_caching.py (and there, NxDI's
own bucket choice against spec.prefix_caching_calls); through vLLM: test/nxdi_cpu/test_vllm_prefix_caching.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kimi_k2_neuron.arguments import Parser, add_spec_args
from kimi_k2_neuron.cli import main
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.formats.scheme import ExpertScheme, scheme_for
from kimi_k2_neuron.launch import run_spec
from kimi_k2_neuron.neuron import contract, rules
from kimi_k2_neuron.neuron.fit import TURN, plan, turn_seconds
from kimi_k2_neuron.neuron.hbm import block_bytes
from kimi_k2_neuron.neuron.spec import FLAG, DraftSpec, RunSpec, prefix_caching_buckets, prefix_caching_calls
from kimi_k2_neuron.placement import Layout

REPO = Path(__file__).resolve().parents[2]
KIMI = REPO / "test/data/configs/kimi-k2-instruct-0905.json"
PER_CHANNEL = ExpertScheme("fp8-per-channel", None)
BLOCKWISE = scheme_for("fp8-blockwise", "fp8")  # converted from Kimi's FP8 release


def kimi() -> KimiK2Config:
    return KimiK2Config.from_file(KIMI)


def cached(**opts) -> RunSpec:
    return RunSpec(**{"tp": 64, "scheme": PER_CHANNEL, "checkpoint": "/c", "prefix_caching": True, **opts})


# -- flags -> RunSpec -> NeuronConfig ---------------------------------------------------------------------------------

def parse(*argv):
    p = Parser()
    add_spec_args(p, "parallel", "shape", "layout", "cache")
    return p.parse_args(["--tp", "64", *argv])


def test_the_flags_make_the_runspecs_cache_fields(one_line_error):
    s = run_spec(parse("--prefix-caching", "--block-size", "16", "--num-blocks", "300"))
    assert (s.prefix_caching, s.block_size, s.num_blocks, s.pool_blocks) == (True, 16, 300, 300)
    plain = run_spec(parse("--prefix-caching"))
    assert (plain.block_size, plain.pool_blocks) == (32, 1024 // 32)  # one full sequence per row by default
    one_line_error(lambda: rules.check(kimi(), run_spec(parse("--block-size", "16"))),
                   "--block-size 16: only with --prefix-caching")
    # one entry each in spec.FLAGS: compile_and_save.py and plan take them, no CPU backend (vLLM's block tables)
    assert {FLAG[f].group for f in ("--prefix-caching", "--block-size", "--num-blocks")} == {"cache"}
    assert all(FLAG[f].taken == {"compile", "plan"} for f in ("--prefix-caching", "--block-size", "--num-blocks"))


def test_the_neuron_config_is_nxdis_block_layout_with_the_pool_and_2d_buckets():
    kw = contract.neuron_config_kwargs(kimi(), cached(batch=4, seq_len=8192, num_blocks=2048))
    assert kw["is_block_kv_layout"] is kw["is_prefix_caching"] is True and kw["pa_block_size"] == 32
    assert kw["pa_num_blocks"] == 2049  # vLLM's null block 0 counted, as vllm-neuron counts it
    assert kw["is_continuous_batching"] is True and kw["ctx_batch_size"] == 1 and kw["tkg_batch_size"] == 4
    assert kw["enable_bucketing"] is True and kw["token_generation_buckets"] == [8192]
    assert kw["context_encoding_buckets"] == [512, 1024, 2048, 4096, 8192] == kw["prefix_buckets"]
    assert "is_chunked_prefill" not in kw


def test_buckets_are_whole_blocks_and_follow_the_chunk():
    prefill, prefix = prefix_caching_buckets(cached(seq_len=69632, layout=Layout(prefill_chunk=2048)))
    assert prefill == [256, 512, 1024, 2048] and prefix[0] == 256 and prefix[-1] == 69632
    small = prefix_caching_buckets(cached(seq_len=400, block_size=16))
    assert all(b % 16 == 0 for b in (*small[0], *small[1])) and small[0][-1] == 400


@pytest.mark.parametrize("cached_,new,chunk,calls", [
    (0, 100, None, [(128, 0)]),  # buckets 128 .. 1024
    (0, 300, None, [(512, 0)]),  # NxDI's own choice for 257-512 positions in all
    (512, 100, None, [(128, 512)]),  # the 128-bucket recomputes 28 cached positions: 484 left -> 512
    (768, 256, None, [(256, 1024)]),  # prefix buckets 128, 256, 512, 1024
    (0, 1000, 256, [(256, 0), (256, 256), (256, 512), (256, 1024)]),  # chunks of the largest prefill bucket
    (256, 600, 256, [(256, 256), (256, 512), (128, 1024)]),
])
def test_a_turns_calls_are_nxdis_2d_buckets(cached_, new, chunk, calls):
    """The bucket rule of NxDI's model wrapper (get_target_2d_bucket_for_prefix_caching); checked against the wrapper
    itself in test/nxdi_cpu/test_prefix_caching.py."""
    spec = cached(seq_len=1024, layout=Layout(prefill_chunk=chunk))
    assert prefix_caching_calls(spec, cached_, new) == calls


@pytest.mark.parametrize("over,needle", [
    (dict(seq_len=1000), "--seq-len 1000: with --prefix-caching must be a multiple of --block-size 32"),
    (dict(batch=2, num_blocks=40), "--num-blocks 40: at least --batch 2 x --seq-len 1024 / --block-size 32 = 64"),
    (dict(layout=Layout(kv_group=4), lnc=2), "--kv-shard sequence --kv-group 4: not with --prefix-caching (NxDI's "
                                             "BlockKVCacheManager keeps whole blocks on every rank"),
    (dict(max_context_length=512), "--max-context-length 512: not with --prefix-caching"),
    (dict(seq_len=4096, layout=Layout(prefill_chunk=1040)), "--prefill-chunk 1040: must divide --seq-len 4096"),
    (dict(seq_len=4160, layout=Layout(prefill_chunk=1040)), "--prefill-chunk 1040: with --prefix-caching must be a "
                                                            "multiple of --block-size 32"),
    (dict(draft=DraftSpec(path="/d")), "--draft: not with --prefix-caching"),
])
def test_what_the_block_layout_cannot_run_is_refused_in_one_line(over, needle, one_line_error):
    one_line_error(lambda: rules.check(kimi(), cached(**over)), needle)


def emulated(spec: RunSpec, **over):
    """The NeuronConfig neuron_config_kwargs writes for `spec`, emulated (the real one: the tier)."""
    kw = contract.neuron_config_kwargs(kimi(), spec)
    fields = {k: SimpleNamespace(**v) if isinstance(v, dict) else v for k, v in kw.items()}
    fields["blockwise_matmul_config"].parallelize_token_to_block_mapping = True
    defaults = dict(moe_ep_degree=1, attention_dtype=None, async_mode=False, flash_decoding_enabled=False,
                    max_length=spec.seq_len, router_config=None, is_chunked_prefill=False)
    return SimpleNamespace(**{**defaults, **fields, **over})


def test_a_reloaded_block_layout_is_enforced_field_by_field(one_line_error):
    spec = cached(tp=8, seq_len=1024, batch=2, moe_prefill="torch")
    derived = contract.derived_fields(kimi(), spec)

    def enforce(**over):
        contract.enforce_neuron_config(emulated(spec, **over), spec, emulated(spec), derived)

    enforce()
    one_line_error(lambda: enforce(is_prefix_caching=False),
                   "is_prefix_caching=False (the run spec kimi_k2_run_spec implies True)")
    one_line_error(lambda: enforce(pa_num_blocks=33), "pa_num_blocks=33 (the run spec kimi_k2_run_spec implies 65)")
    one_line_error(lambda: enforce(is_chunked_prefill=True),
                   "is_chunked_prefill=True (NxDI's application raises NotImplementedError")


# -- the planner ------------------------------------------------------------------------------------------------------

AGENT = dict(seq_len=69632, scheme=BLOCKWISE, moe_prefill="shard-on-block", lnc=2,
             layout=Layout(prefill_chunk=2048, shard_attn_a=True, shard_router=True))


def test_the_pool_is_counted_as_built_and_a_warm_turn_is_a_fraction_of_cold():
    cfg = kimi()
    p = plan(cfg, cached(**AGENT))
    x = p.prefix
    # vLLM's blocks, its null block and NxDI's reserve, each of every layer: latent + the 1-wide V, bf16
    assert p.kv_cache.bytes == (69632 // 32 + 2) * 61 * 32 * (576 + 1) * 2 == (x.pool_blocks + 2) * x.block_bytes
    assert block_bytes(cfg, 32) == x.block_bytes and x.pool_tokens == 69632
    assert (x.cached, x.new) == TURN and x.warm_calls == ((2048, 65536),) and len(x.cold_calls) == 33
    assert x.warm_s < 0.1 * x.cold_s  # issue 37's goal, as the model gives it (printed by plan: docs/vllm.md)
    assert turn_seconds(cfg, cached(**AGENT), *TURN) == pytest.approx(x.warm_s)
    assert p.fits and any(r.kind.startswith("prefill attention over blocks") for r in p.allowance)


def test_plan_prints_the_warm_and_cold_turn_and_json_carries_them(capsys):
    args = ["plan", "--config", str(KIMI), "--tp", "64", "--seq-len", "69632", "--prefix-caching",
            "--prefill-chunk", "2048", "--shard-attn-a", "--shard-router", "--moe-prefill", "shard-on-block"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "a turn of 2,048 new tokens after 65,536 cached: warm TTFT" in out and "% of cold" in out
    assert main(args + ["--turn", "4096,512", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["prefix"]
    assert (d["cached"], d["new"], d["warm_calls"]) == (4096, 512, [[512, 4096]])
    assert d["warm_ms"] < d["cold_ms"] and d["pool_tokens"] == 69632


def test_compile_and_save_takes_prefix_caching_for_vllm_only(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "scripts/compile_and_save.py"), "--model", str(tmp_path), "--out",
                        str(tmp_path / "out"), "--tp", "1", "--prefix-caching"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == ("error: --prefix-caching: only with --for-vllm (the block "
                                                     "tables come from vLLM's scheduler)")
