"""The sequence-sharded latent cache (`--kv-shard sequence`, NxDI's flash-decoding layout) through the real NxD/NxDI in
NxD's CPU mode: NxDI's flash_decoding_enabled / num_cores_per_group, its get_cache_size cache, its mask_util masks
and its context-encoding write; NxD's initialize_kv_group and CPU-mode collectives over gloo; our context-encoding
filter, decode through MLAttention.attend_sharded and the K-only decode write (base.py).

- Logits: two rows prefilling different lengths in one context-encoding call (one per row under continuous
  batching), then one token per token-generation call for more than 3 x TP steps (every rank owns several decoded
  tokens), at TP=2 and TP=4 (one KV group of all ranks, and two groups of 2) against NxDI's replicated cache at TP=1
  (float32, 1e-4 of max |logit|), and transformers on an exact conversion (1e-3); the logits command and greedy
  generation end to end.
- The cache: each rank's real buffers (kv_mgr.past_key_values) after the run are [B, 1, S/G + 128, latent] with the
  1-wide V slot, and rank r's slot j equals the TP=1 cache at position j * G + r % G of every row.
- The graphs: traced at TP=1 only (G=1), as test_xla_trace.py traces. The collectives are gloo's, not Neuron's.
"""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from nxdi_support import cpu_options, oracle_logits, rel_err, replicated_run, stand_in_device_ops
from safetensors.torch import load_file, save_file
from test_xla_trace import torch_fill_prefix  # noqa: F401  (the fixture; importing it also enables the sync log)

from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.neuron import KimiK2InferenceConfig, contract
from kimi_k2_neuron.neuron.spec import FD_RESERVED_SLOTS, RunSpec
from kimi_k2_neuron.nxdi_cpu import backend, xla_trace
from kimi_k2_neuron.placement import Layout
from kimi_k2_neuron.runtime.runner import CpuRunner

# rows of 20 and 17 tokens prefilling 7 and 4, then 13 teacher-forced decode steps each (>= 3 x TP at TP=4)
ROWS = [[5, 17, 300, 42, 256, 9, 77, 123, 8, 511, 33, 2, 90, 61, 400, 7, 12, 250, 19, 3],
        [400, 3, 3, 3, 260, 100, 44, 18, 301, 5, 6, 70, 88, 140, 9, 27, 11]]
PREFILL = [7, 4]

pytestmark = pytest.mark.fp8_selective_cpu


def _dump_job(rank: int, o, rows, prefill, out_dir: str):
    """backend._logits_job, plus this rank's cache buffers as the model holds them."""
    app = backend.build(o, seq_len=max(len(r) for r in rows), batch=len(rows))
    logits = (_one_row_prefills if o.spec.continuous_batching else backend.teacher_forced_logits)(app, rows, prefill)
    mgr = app.token_generation_model.model.kv_mgr
    rank_util = app.token_generation_model.model.rank_util.get_rank()
    cache = {f"kv{i}": t.data.clone() for i, t in enumerate(mgr.past_key_values)}
    save_file({**cache, "rank_util": rank_util.clone()}, f"{out_dir}/rank{rank}.safetensors")
    return logits


def _one_row_prefills(app, rows, prefill):
    """NxDI's continuous batching as vllm-neuron drives it: each row prefilled alone into its seq_id's cache line
    (the last row first), then all rows decoded together, teacher-forced. Logits [B, T, V] where computed (each
    prefill's last position, every decoded one), NaN elsewhere."""
    out = torch.full((len(rows), max(map(len, rows)), app.config.vocab_size), float("nan"))
    with torch.no_grad():
        for r in reversed(range(len(rows))):
            ids = torch.tensor([rows[r][:prefill[r]]])
            got = app.forward(input_ids=ids, attention_mask=torch.ones_like(ids),
                              position_ids=torch.arange(prefill[r])[None], seq_ids=torch.tensor([r]))
            out[r, prefill[r] - 1] = got.logits[0, -1].float()
        cur = torch.tensor(prefill)
        for step in range(max(len(row) - k for row, k in zip(rows, prefill))):
            tok = torch.tensor([[row[k + step] if k + step < len(row) else 0] for row, k in zip(rows, prefill)])
            mask = (torch.arange(int(cur.max()))[None] < cur[:, None]).long()
            got = app.forward(input_ids=tok, attention_mask=mask, position_ids=cur[:, None],
                              seq_ids=torch.arange(len(rows)))
            for r, (row, k) in enumerate(zip(rows, prefill)):
                if k + step < len(row):
                    out[r, k + step] = got.logits[r, -1].float()
            cur = cur + 1
    return out


@pytest.fixture(scope="module")
def replicated(per_channel, tmp_path_factory):
    """TP=1, NxDI's replicated cache: the logits and the cache."""
    return replicated_run(per_channel, _dump_job, ROWS, PREFILL, tmp_path_factory.mktemp("tp1"))


@pytest.mark.parametrize("tp,g,cb", [(2, 2, False), (4, 4, False), (4, 2, False), (2, 2, True)],
                         ids=["tp2", "tp4", "tp4-two-groups", "tp2-continuous-batching"])
def test_the_sharded_cache_gives_the_replicated_logits_and_holds_every_gth_position(per_channel, replicated,
                                                                                      tmp_path, tp, g, cb):
    """cb: NxDI's continuous batching, each row's prefill written at its seq_id (the flash-decoding CTE write at a
    cache line, NXDI_CONTRACT.md: fd-cte-filter)."""
    want, full = replicated
    o = cpu_options(model=per_channel, tp=tp, layout=Layout(kv_group=g), continuous_batching=cb)
    o = backend.prepare(o, max(map(len, ROWS)), len(ROWS))
    got = backend.run(o, _dump_job, ROWS, PREFILL, str(tmp_path))
    for r, (row, k) in enumerate(zip(ROWS, PREFILL)):
        computed = ~got[r, :len(row), 0].isnan()  # every position, or each prefill's last under continuous batching
        assert int(computed.sum()) == (len(row) - k + 1 if cb else len(row))
        assert rel_err(got[r, :len(row)][computed], want[r, :len(row)][computed]) < 1e-4, f"row {r}"
    seq_len = backend.padded_seq_len(o, max(map(len, ROWS)))
    slots = RunSpec(seq_len=seq_len, layout=Layout(kv_group=g)).cache_slots
    assert slots == seq_len // g + FD_RESERVED_SLOTS
    latent = full["kv0"].shape[-1]
    for rank in range(tp):
        cache = load_file(tmp_path / f"rank{rank}.safetensors")
        assert cache["rank_util"].tolist() == [rank]  # SPMDRank, the rank a traced graph reads
        k = rank % g
        for layer in range(len(full) // 2):
            kc, vc = cache[f"kv{2 * layer}"], cache[f"kv{2 * layer + 1}"]
            assert kc.shape == (len(ROWS), 1, slots, latent) and vc.shape == (len(ROWS), 1, slots, 1)
            # every rank was a non-owner at some decode step: NxDI's garbage slot took that token (and the logits
            # above show no mask exposed it)
            assert kc[:, 0, -1].abs().amax() > 0
            for b, row in enumerate(ROWS):
                positions = torch.arange(k, len(row), g)
                torch.testing.assert_close(kc[b, 0, :len(positions)], full[f"kv{2 * layer}"][b, 0, positions],
                                           rtol=1e-5, atol=1e-5 * full[f"kv{2 * layer}"].abs().max().item())


def test_the_sharded_cache_matches_transformers_on_an_exact_conversion(converted, tiny, tmp_path):
    """INT4 -> fp8-blockwise is lossless (test_backend.py's exact conversion): TP=2, G=2 against transformers'
    DeepseekV3 within 1e-3 of max |logit|."""
    o = cpu_options(model=str(converted[("int4", "fp8-blockwise")]), tp=2,
                           layout=Layout(kv_group=2))
    got, _ = backend.logits(o, ROWS, 7)
    for r, want in enumerate(oracle_logits(tiny["int4"], ROWS, 7, bf16_non_experts=True, tmp_path=tmp_path)):
        assert rel_err(got[r, :len(ROWS[r])], want) < 1e-3, f"row {r}"


def test_the_logits_command_runs_the_sharded_cache_end_to_end(per_channel, tmp_path):
    """`kimi-k2-neuron logits --backend nxdi-cpu --tp 2 --kv-shard sequence`, in a user's environment, against the
    core runner (an independent implementation)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NXD_CPU_MODE")}
    out = tmp_path / "l.safetensors"
    ids = ";".join(",".join(map(str, r)) for r in ROWS)
    r = subprocess.run([sys.executable, "-m", "kimi_k2_neuron.cli", "logits", "--backend", "nxdi-cpu", "--tp", "2",
                        "--kv-shard", "sequence", "--model", per_channel, "--input-ids", ids, "--prefill-len", "7",
                        "--out", str(out)], capture_output=True, text=True, env={**env, "KIMI_K2_NEURON_CACHE":
                                                                                  str(tmp_path / "cache")},
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = load_file(out)["logits"], CpuRunner(per_channel).logits(ROWS, 7)
    for i, row in enumerate(ROWS):
        assert rel_err(got[i, :len(row)], want[i, :len(row)]) < 1e-4, f"row {i}"


@pytest.mark.parametrize("submodel,chunk,batch", [("context", None, 2), ("token", None, 2), ("chunk", 4, 1)])
def test_the_flash_decoding_graphs_trace_clean_at_one_rank(per_channel, torch_fill_prefix,  # noqa: F811
                                                           submodel, chunk, batch):
    """At TP=1 (G=1: torch_xla's CPU device runs one process) the flash-decoding submodels trace to one clean graph
    equal to eager: NxDI's mask_util masks and 128-slot window, the garbage-slot K write, the CTE filter indexed by
    SPMDRank's tensor and attend_sharded's arithmetic, with identity collectives; the chunk submodel's owned entries,
    masks over the rank's slots and write at p // G (chunked_prefill.py). TP > 1: test_xla_trace.py's refusal says
    what it would take. The chunk's write is NxDI's dynamic_update_slice, an xla_hlo_call the tier stands in."""
    stand_in_device_ops()
    o = cpu_options(model=per_channel, dtype="float32", layout=Layout(prefill_chunk=chunk),
                           flash_decoding_one_rank=True)
    r = xla_trace.trace(xla_trace.TraceOptions(o, submodel, seq_len=16, batch=batch))
    assert r.stopped is None and r.clean, r.format()
    assert r.max_rel_diff_vs_eager < 1e-5 and r.argmax_equal, r.format()


# -- the config through NxDI's save and load; refusals ---------------------------------------------------------------

def _serving(ckpt, kv_group=4, seq_len=64):
    from kimi_k2_neuron.config import KimiK2Config
    from kimi_k2_neuron.formats.record import ConversionRecord

    cfg = KimiK2Config.from_file(ckpt)
    opts = dict(tp=4, lnc=None, seq_len=seq_len, scheme=ConversionRecord.of(cfg).scheme, checkpoint=ckpt,
                moe_prefill="torch", layout=Layout(kv_group=kv_group),
                dtype="float32", extra={"on_cpu": True})
    return KimiK2InferenceConfig.for_serving(cfg, RunSpec(**opts))


def test_the_kv_group_survives_nxdis_save_and_load(per_channel, tmp_path):
    """G is our config attribute, which NxDI saves with the config; add_derived_config sets num_cores_per_group
    from it again on reload, and NxDI's cache manager sizes each rank's cache from that."""
    from neuronx_distributed_inference.models.config import MoENeuronConfig

    config = _serving(per_channel)
    config.save(str(tmp_path))
    again = KimiK2InferenceConfig.load(str(tmp_path))
    for c in (config, again):
        got = (c.num_cores_per_group, contract.run_spec(c).layout.kv_group, c.neuron_config.flash_decoding_enabled)
        assert got == (4, 4, True)
    assert isinstance(again.neuron_config, MoENeuronConfig)
    plain = _serving(per_channel, kv_group=1)
    assert (plain.num_cores_per_group, plain.neuron_config.flash_decoding_enabled) == (1, False)


@pytest.mark.parametrize("edit,needle", [
    ({"kimi_k2_run_spec": {"layout": {"kv_group": 3}}}, "neuron_config.json field kimi_k2_run_spec (as the flags "
     "would ask): --kv-group 3: must divide --tp 4 (a KV group is G adjacent ranks)"),
    ({"neuron_config": {"max_length": 66}}, "unsupported NeuronConfig settings for Kimi-K2: max_length=66 (not a "
     "multiple of kimi_k2_run_spec.layout.kv_group=4)"),
    ({"neuron_config": {"speculation_length": 2}}, "speculation_length=2 (the run spec kimi_k2_run_spec implies 0)"),
    ({"neuron_config": {"flash_decoding_enabled": False}},
     "flash_decoding_enabled=False (the run spec kimi_k2_run_spec implies True)"),
    # NxDI itself refuses k_cache_transposed and attn_block_tkg_nki_kernel_enabled with flash decoding, by an
    # assertion when the NeuronConfig is built, before our check (models/config.py:525-540)
])
def test_a_reloaded_sharded_config_is_checked_again(per_channel, tmp_path, edit, needle):
    """A neuron_config.json edited by hand: its spec through the rules, each NeuronConfig field it derives compared."""
    import json

    _serving(per_channel).save(str(tmp_path))
    path = tmp_path / "neuron_config.json"
    saved = json.loads(path.read_text())
    saved["neuron_config"].update(edit.get("neuron_config", {}))
    saved["kimi_k2_run_spec"]["layout"].update(edit.get("kimi_k2_run_spec", {}).get("layout", {}))
    path.write_text(json.dumps(saved))
    with pytest.raises(KimiInputError) as e:
        KimiK2InferenceConfig.load(str(tmp_path))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_reloaded_kv_group_that_is_no_group_size_is_refused(per_channel, tmp_path):
    """kv_group is an int, 1 the replicated cache: a null (or anything else) is named, not guessed."""
    import json

    _serving(per_channel).save(str(tmp_path))
    path = tmp_path / "neuron_config.json"
    saved = json.loads(path.read_text())
    saved["kimi_k2_run_spec"]["layout"]["kv_group"] = None
    path.write_text(json.dumps(saved))
    with pytest.raises(KimiInputError) as e:
        KimiK2InferenceConfig.load(str(tmp_path))
    assert str(e.value) == ("neuron_config.json field kimi_k2_run_spec.layout.kv_group: expected an integer, got None")


@pytest.mark.parametrize("over,needle", [
    (dict(tp=4, layout=Layout(kv_group=3)), "--kv-group 3: must divide --tp 4"),
    (dict(tp=2, layout=Layout(kv_group=4)), "--kv-group 4: must divide --tp 2"),
])
def test_layouts_the_sharded_cache_cannot_run_are_refused_before_any_rank_starts(per_channel, over, needle):
    with pytest.raises(KimiInputError) as e:
        backend.prepare(cpu_options(model=per_channel, **over), 20, 2)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_seq_len_the_group_does_not_divide_is_refused(per_channel):
    with pytest.raises(KimiInputError, match="--seq-len 66: with --kv-shard sequence must be a multiple of "
                                             "--kv-group 4") as e:
        _serving(per_channel, seq_len=66)
    assert "\n" not in str(e.value)


def test_the_cpu_harness_rounds_its_cache_up_to_a_multiple_of_the_group(per_channel):
    o = cpu_options(model=per_channel, tp=4, layout=Layout(kv_group=4))
    assert [backend.padded_seq_len(o, n) for n in (17, 20, 21)] == [20, 20, 24]
    assert backend.padded_seq_len(dataclasses.replace(o, spec=dataclasses.replace(o.spec, layout=Layout())), 17) == 17


def test_generation_with_the_sharded_cache_gives_the_replicated_tokens(per_channel):
    """NxDI's generation adapter and on-device sampler (greedy) over the sharded cache at TP=2: the tokens of the
    replicated cache at TP=1, prompts of different lengths."""
    g = backend.Generation(rows=[ROWS[0][:9], ROWS[1][:5]], stop_ids=(), max_new_tokens=7)
    sharded, _ = backend.generate(cpu_options(model=per_channel, tp=2,
                                                     layout=Layout(kv_group=2)), g)
    replicated, _ = backend.generate(cpu_options(model=per_channel), g)
    assert sharded == replicated and [len(r) for r in sharded] == [7, 7]
