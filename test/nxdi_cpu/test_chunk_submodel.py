"""neuron/chunked_prefill.py through the real NxD/NxDI in NxD's CPU mode: NxDI's context-encoding submodel at bucket N
(batch 1, continuous batching) on each row's first N tokens, then our third submodel, `chunked_prefill_model`, on each
further N tokens (NxDI's model wrapper, get_model_output, KV cache manager reads, sampler; the chunk's attention is
MLAttention.attend_chunk over the replicated latent cache, a KV group of 1), then NxDI's token generation.

- Chunked == one-shot NxDI prefill, logits and the latent cache's contents at every prompt position, for a prompt of
  3.5 chunks, at TP=1 and at TP=2 (NxD's parallel layers over gloo; rank 0's cache).
- Two ragged prompts, each longer than 2.5 chunks, then >= 6 teacher-forced decode steps each, at TP=1 and TP=2:
  == the one-shot NxDI run and the core CPU runner, within 1e-4 of the largest |logit|.
- `generate --backend nxdi-cpu --prefill-chunk N` at TP=1 and TP=2 (NxDI's adapter and on-device sampler): the core
  runner's greedy tokens.
- `trace-cpu --submodel chunk` traces one clean graph at TP=1 (tiny shapes).
- The config: the three submodels' shapes, the chunk kept through NxDI's save/load, async_mode refused in one line
  (its path bypasses the driver). The contract's refusals (N not dividing seq_len, another --max-context-length,
  N % 128 on shard-on-block) are test/unit/test_contract.py's, trace-cpu's chunk without --prefill-chunk
  test/unit/test_cli.py's.
- With the sequence-sharded cache (`--kv-shard sequence`, NxDI's flash decoding) at TP=2 (G=2) and TP=4 (G=4, and two
  groups of 2): two ragged prompts, each longer than 2.5 chunks, then >= 3 x TP decode steps == NxDI's replicated
  one-shot run at TP=1 (1e-4 of the largest |logit|); each rank's cache slot j == the TP=1 cache at position
  j * G + rank % G; a rank attending every chunk entry (each counted G times in the merge) fails that comparison;
  NxDI's generation over it, and `logits --backend nxdi-cpu --tp 2 --kv-shard sequence --prefill-chunk N`, give the
  core runner's greedy tokens and logits. The chunk's masks are NxDI's mask_util (speculation's) on the owned entries.
Not covered: the trn2 graph (neuronx-cc, NKI kernels).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from nxdi_support import cpu_options, rel_err, replicated_run, with_device_ops
from safetensors.torch import load_file, save_file

from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.neuron import contract
from kimi_k2_neuron.neuron.spec import RunSpec
from kimi_k2_neuron.nxdi_cpu import backend
from kimi_k2_neuron.parallel import stripe
from kimi_k2_neuron.placement import Layout
from kimi_k2_neuron.runtime.runner import CpuRunner

N = 8
PROMPT = [(37 * i + 11) % 500 + 5 for i in range(28)]  # 3.5 chunks
RAGGED = [[(13 * i + 7) % 500 + 3 for i in range(30)], [(29 * i + 1) % 500 + 9 for i in range(28)]]
RAGGED_PREFILL = [23, 21]  # > 2.5 chunks each, then 7 decode steps each

pytestmark = pytest.mark.fp8_selective_cpu


@pytest.fixture(scope="module")
def ckpt(converted):
    return str(converted[("fp8", "fp8-blockwise")])


def prefill_job(rank, o, rows, prefill):
    """Teacher-forced logits, then the cache NxDI shares between its submodels (K of each layer), and the number of
    chunk-submodel calls."""
    app = backend.build(o, seq_len=max(map(len, rows)), batch=len(rows))
    calls = []
    chunk = getattr(app, "chunked_prefill_model", None)
    if chunk is not None:
        chunk.model.register_forward_pre_hook(lambda *_: calls.append(1))
    logits = backend.teacher_forced_logits(app, rows, prefill)
    cache = app.token_generation_model.model.kv_mgr.past_key_values
    return logits, [p.detach().clone() for p in cache[0::2]], len(calls)


def run(ckpt, rows, prefill=None, tp=1, chunk=N):
    o = cpu_options(model=ckpt, tp=tp, layout=Layout(prefill_chunk=chunk))
    return backend.run(backend.prepare(o, max(map(len, rows)), len(rows)), prefill_job, rows, prefill)


@pytest.mark.parametrize("tp", [1, 2])
def test_chunked_prefill_equals_one_shot_logits_and_cache(ckpt, tp):
    got, got_cache, calls = run(ckpt, [PROMPT], tp=tp)
    want, want_cache, none = run(ckpt, [PROMPT], tp=tp, chunk=None)
    assert (calls, none) == (3, 0)  # chunks 1-3 through the chunk submodel, chunk 0 through the CTE
    assert rel_err(got[0], want[0]) < 1e-4
    length = len(PROMPT)
    assert got_cache[0].shape[2] == 32 and want_cache[0].shape[2] == length  # seq_len: a whole number of chunks
    for layer, (g, w) in enumerate(zip(got_cache, want_cache)):
        assert rel_err(g[:, :, :length], w[:, :, :length]) < 1e-5, f"layer {layer}"


@pytest.mark.parametrize("tp", [1, 2])
def test_ragged_chunked_prefill_then_decode_equals_one_shot_and_the_core(ckpt, converted, tp):
    assert all(p > 2.5 * N and len(r) - p >= 6 for r, p in zip(RAGGED, RAGGED_PREFILL))
    got, _, calls = run(ckpt, RAGGED, RAGGED_PREFILL, tp=tp)
    want, _, _ = run(ckpt, RAGGED, RAGGED_PREFILL, tp=tp, chunk=None)
    assert calls == 2 + 2  # rows of 23 and 21 prompt tokens: 2 chunks after the CTE's each
    runner = CpuRunner(converted[("fp8", "fp8-blockwise")])
    for r, (row, k) in enumerate(zip(RAGGED, RAGGED_PREFILL)):
        core = runner.logits([row], k)[0]
        assert rel_err(got[r, :len(row)], want[r, :len(row)]) < 1e-4, f"row {r} vs one-shot NxDI"
        assert rel_err(got[r, :len(row)], core) < 1e-4, f"row {r} vs the core runner"
    assert torch.isnan(got[1, len(RAGGED[1]):]).all()


def _cli(args, env):
    return subprocess.run([sys.executable, "-m", "kimi_k2_neuron.cli", *args], capture_output=True, text=True,
                          env=env, timeout=900)


@pytest.mark.parametrize("tp", [1, 2])
def test_generate_with_chunks_equals_the_core_runners_greedy_tokens(ckpt, env, tp):
    ids = ";".join(",".join(map(str, r)) for r in RAGGED)
    args = ["generate", "--model", ckpt, "--input-ids", ids, "--max-new-tokens", "6", "--json"]
    nxdi = _cli(args + ["--backend", "nxdi-cpu", "--prefill-chunk", str(N), "--tp", str(tp)], env)
    assert nxdi.returncode == 0, nxdi.stderr[-3000:]
    assert "chunked_prefill_model" in nxdi.stderr  # the MoE paths report names the submodel that ran
    runner = CpuRunner(ckpt)
    stops = set(runner.cfg.eos_token_ids)
    want = [runner.generate([row], 6, stop_ids=stops).tokens[0] for row in RAGGED]
    assert json.loads(nxdi.stdout)["tokens"] == want


def test_trace_cpu_traces_the_chunk_graph_clean(ckpt, env):
    """The chunk's cache write is NxDI's dynamic_update_slice, an xla_hlo_call on device: the tier stands it in
    (scripts/nxdi_cpu_tier/device_ops.py), as a Neuron SDK provides it."""
    r = _cli(["trace-cpu", "--model", ckpt, "--submodel", "chunk", "--prefill-chunk", "4", "--seq-len", "16",
              "--json"], with_device_ops({**env, "PJRT_DEVICE": "CPU"}))
    report = json.loads(r.stdout)
    assert r.returncode == 0 and report["clean"], r.stdout + r.stderr[-3000:]
    assert report["submodel"] == "chunk" and report["host_syncs"] == 0 and not report["aten_fallbacks"]
    assert report["argmax_equal"]


@pytest.mark.parametrize("submodel,flags", [("token", []), ("chunk", ["--prefill-chunk", "4"])])
def test_trace_cpu_traces_the_sequence_sharded_graphs_clean_at_one_rank(ckpt, env, submodel, flags):
    """trace-cpu --kv-shard sequence at the one rank traced here: a KV group of 1, so NxDI's flash-decoding masks, the
    128-slot reserve and the owned-slot writes are traced, without a collective (TP=2 tracing: docs/nxdi_on_cpu.md)."""
    r = _cli(["trace-cpu", "--model", ckpt, "--submodel", submodel, "--kv-shard", "sequence", "--seq-len", "16",
              "--json", *flags], with_device_ops({**env, "PJRT_DEVICE": "CPU"}))
    report = json.loads(r.stdout)
    assert r.returncode == 0 and report["clean"], r.stdout + r.stderr[-3000:]
    assert report["submodel"] == submodel and report["host_syncs"] == 0 and not report["aten_fallbacks"]
    assert report["argmax_equal"]


def test_async_mode_is_refused_with_chunks(ckpt):
    o = backend.prepare(cpu_options(model=ckpt, layout=Layout(prefill_chunk=N)), 32, 1)
    from kimi_k2_neuron.neuron.modeling import KimiK2InferenceConfig

    spec = RunSpec(tp=1, lnc=None, seq_len=32, scheme=o.record.scheme, checkpoint=o.model, moe_prefill="torch",
                   layout=Layout(prefill_chunk=N), extra={"on_cpu": True, "async_mode": True})
    with pytest.raises(KimiInputError) as info:
        KimiK2InferenceConfig.for_serving(o.config, spec)
    assert "\n" not in str(info.value) and "async_mode=True (NxDI's async path" in str(info.value)


def test_a_reloaded_config_keeps_the_chunk(ckpt, tmp_path):
    o = backend.prepare(cpu_options(model=ckpt, layout=Layout(prefill_chunk=N)), 32, 2)
    app = backend.application(o, 32, 2)
    assert [m.tag for m in app.models][-1] == "chunked_prefill_model"
    chunk_nc = app.chunked_prefill_model.neuron_config
    assert (chunk_nc.batch_size, chunk_nc.n_active_tokens, chunk_nc.buckets, chunk_nc.is_prefill_stage) == (1, N, [32],
                                                                                                          True)
    cte_nc = app.context_encoding_model.neuron_config
    assert (cte_nc.batch_size, cte_nc.max_context_length, cte_nc.buckets) == (1, N, [N])
    app.config.save(str(tmp_path))
    from kimi_k2_neuron.neuron.modeling import KimiK2InferenceConfig

    assert contract.run_spec(KimiK2InferenceConfig.load(str(tmp_path))).layout.prefill_chunk == N


# -- the sequence-sharded cache ----------------------------------------------------------------------------------------

# > 2.5 chunks of prefill each, then 13 and 12 decode steps (>= 3 x TP at TP=4)
LONG = [[(13 * i + 7) % 500 + 3 for i in range(36)], [(29 * i + 1) % 500 + 9 for i in range(33)]]
LONG_PREFILL = [23, 21]


def sharded_job(rank, o, rows, prefill, out_dir, attend_every_chunk_entry=False):
    """Teacher-forced logits and the number of chunk-submodel calls; this rank's K cache buffers saved to out_dir.
    attend_every_chunk_entry: the mutation, every rank attending all N chunk entries causally (each counted Gc times
    in attend_chunk's merge), its writes kept right."""
    from kimi_k2_neuron.model import mla

    app = backend.build(o, seq_len=max(map(len, rows)), batch=len(rows))
    calls = []
    if o.spec.layout.prefill_chunk:
        app.chunked_prefill_model.model.register_forward_pre_hook(lambda *_: calls.append(1))
    if attend_every_chunk_entry:  # attend_chunk's owner filter (the decoder layer's write filter is parallel.stripe)
        mla.stripe = lambda n, group, rank, device=None: torch.arange(n, device=device)
    logits = backend.teacher_forced_logits(app, rows, prefill)
    cache = app.token_generation_model.model.kv_mgr.past_key_values
    save_file({f"k{i}": t.data.clone() for i, t in enumerate(cache[0::2])}, f"{out_dir}/rank{rank}.safetensors")
    return logits, len(calls)


@pytest.fixture(scope="module")
def one_shot(per_channel, tmp_path_factory):
    """TP=1, NxDI's replicated cache, the whole prompt in one context-encoding call: logits and K cache."""
    out = tmp_path_factory.mktemp("one_shot")
    (logits, _), cache = replicated_run(per_channel, sharded_job, LONG, LONG_PREFILL, out)
    return logits, cache


def run_sharded(ckpt, tp, g, out_dir, mutate=False, chunk_group=None):
    o = cpu_options(model=ckpt, tp=tp, layout=Layout(kv_group=g, prefill_chunk=N, chunk_group=chunk_group))
    o = backend.prepare(o, max(map(len, LONG)), len(LONG))
    return o, backend.run(o, sharded_job, LONG, LONG_PREFILL, str(out_dir), mutate)


@pytest.mark.parametrize("tp,g,c", [(2, 2, None), (4, 4, None), (4, 2, None), (4, 4, 2), (4, 4, 4)],
                         ids=["tp2", "tp4", "tp4-two-groups", "tp4-chunk-group-2", "tp4-chunk-group-4"])
def test_chunks_over_the_sharded_cache_give_the_one_shot_logits_and_cache(per_channel, one_shot, tmp_path, tp, g, c):
    """Layout.chunk_group None: the cheaper of its candidates at these shapes (MLAttention.chunk_group); 2: NxD's
    collectives over groups the shell makes (base.mesh_group), two adjacent ranks merging after each pooled 2
    caches; 4: the merge over the whole KV group."""
    assert all(p > 2.5 * N and len(r) - p >= 3 * tp for r, p in zip(LONG, LONG_PREFILL))
    want, full = one_shot
    o, (got, calls) = run_sharded(per_channel, tp, g, tmp_path, chunk_group=c)
    assert calls == 2 + 2  # rows of 23 and 21 prompt tokens: 2 chunks after the CTE's each
    for r, row in enumerate(LONG):
        assert rel_err(got[r, :len(row)], want[r, :len(row)]) < 1e-4, f"row {r}"
    slots = backend.request_spec(o, max(map(len, LONG)), len(LONG)).cache_slots
    for rank in range(tp):
        cache = load_file(Path(tmp_path) / f"rank{rank}.safetensors")
        for layer, name in enumerate(sorted(full, key=lambda k: int(k[1:]))):
            kc, kf = cache[name], full[name]
            assert kc.shape == (len(LONG), 1, slots, kf.shape[-1])
            for b, row in enumerate(LONG):
                positions = torch.arange(rank % g, len(row), g)  # every prompt and decoded position rank r owns
                torch.testing.assert_close(kc[b, 0, :len(positions)], kf[b, 0, positions], rtol=1e-5,
                                           atol=1e-5 * kf.abs().max().item(), msg=f"rank {rank} layer {layer}")


def test_counting_every_chunk_entry_on_every_rank_is_caught(per_channel, one_shot, tmp_path):
    """The mutation the owner filter prevents: the chunk's keys visible on all G ranks are counted G times."""
    want, _ = one_shot
    _, (got, _) = run_sharded(per_channel, 2, 2, tmp_path, mutate=True)
    after_cte = [rel_err(got[r, N:len(row)], want[r, N:len(row)]) for r, row in enumerate(LONG)]
    assert min(after_cte) > 1e-2, after_cte
    for r in range(len(LONG)):  # the context-encoding call (positions < N) is untouched
        assert rel_err(got[r, :N], want[r, :N]) < 1e-4


def test_generation_with_chunks_over_the_sharded_cache_gives_the_core_runners_tokens(ckpt):
    g = backend.Generation(rows=RAGGED, stop_ids=(), max_new_tokens=6)
    o = cpu_options(model=ckpt, tp=2, layout=Layout(kv_group=2, prefill_chunk=N))
    tokens, report = backend.generate(o, g)
    runner = CpuRunner(ckpt)
    assert tokens == [runner.generate([row], 6, stop_ids=set()).tokens[0] for row in RAGGED]
    assert "chunked_prefill_model" in report


def test_the_logits_command_runs_chunks_over_the_sharded_cache_end_to_end(ckpt, env, tmp_path):
    """`kimi-k2-neuron logits --backend nxdi-cpu --tp 2 --kv-shard sequence --prefill-chunk 8`, prompts of 2.6-2.9
    chunks then 7 teacher-forced steps, against the core runner (an independent implementation)."""
    out = tmp_path / "l.safetensors"
    ids = ";".join(",".join(map(str, r)) for r in RAGGED)
    r = _cli(["logits", "--backend", "nxdi-cpu", "--tp", "2", "--kv-shard", "sequence", "--prefill-chunk", str(N),
              "--model", ckpt, "--input-ids", ids, "--prefill-len", str(RAGGED_PREFILL[0]), "--out", str(out)], env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "chunked_prefill_model" in r.stderr
    got, want = load_file(out)["logits"], CpuRunner(ckpt).logits(RAGGED, RAGGED_PREFILL[0])
    for i, row in enumerate(RAGGED):
        assert rel_err(got[i, :len(row)], want[i, :len(row)]) < 1e-4, f"row {i}"


@pytest.mark.parametrize("group", [1, 2, 4])
def test_the_sharded_chunk_masks_are_nxdis_speculation_masks_over_the_owned_entries(group):
    """NxDI's multi-token flash-decoding masks (mask_util, as for speculation; NXDI_CONTRACT.md: fd-chunk): its prior
    mask is ours, and its active mask over all N entries is ours on the owned ones and False on the others."""
    from neuronx_distributed_inference.modules.flashdecode.utils import get_cache_size, mask_util

    from kimi_k2_neuron.neuron import chunked_prefill as cp

    cache = get_cache_size(64, group)
    for start in (8, 16, 40):
        positions = torch.arange(start, start + N)[None]
        for r in range(group):
            rank = torch.tensor([r])
            active_all, prior_all = mask_util(positions, rank, group, cache)
            prior, active = cp.chunk_masks(positions, cache, group, rank)
            assert torch.equal(prior[:, 0], prior_all.bool())
            owned = stripe(N, group, r)
            assert torch.equal(active[:, 0], active_all[:, :, owned].bool())
            others = torch.ones(N, dtype=torch.bool)
            others[owned] = False
            assert not active_all[:, :, others].any()


def test_write_rows_writes_the_chunk_into_its_line_only(monkeypatch):
    """NxDI's dynamic-update-slice in CPU mode: the chunk's contiguous slots of its line, nothing else."""
    from kimi_k2_neuron.neuron import chunked_prefill as cp

    monkeypatch.setenv("NXD_CPU_MODE", "1")
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(3, 1, 16, 5, generator=g)
    update = torch.randn(1, 1, 4, 5, generator=g)
    slots = torch.tensor([[8, 9, 10, 11]])
    got = cp.write_rows(cache, update, torch.tensor([2]), slots)
    want = cache.clone()
    for j, s in enumerate(slots[0].tolist()):
        want[2, 0, s] = update[0, 0, j]
    assert torch.equal(got, want) and not torch.equal(got, cache)
