"""The sequence-sharded latent cache (`--kv-shard sequence`, NxDI's flash-decoding layout) through the real NxD/NxDI in
NxD's CPU mode: NxDI's flash_decoding_enabled / num_cores_per_group, its get_cache_size cache, its mask_util masks
and its context-encoding write; NxD's initialize_kv_group and CPU-mode collectives over gloo; our context-encoding
filter, decode through MLAttention.attend_sharded and the K-only decode write (modeling.py).

- Logits: two rows prefilling different lengths in one context-encoding call, then one token per token-generation
  call for more than 3 x TP steps (every rank owns several decoded tokens), at TP=2 and TP=4 (one KV group of all
  ranks, and two groups of 2) against NxDI's replicated cache at TP=1 (float32, 1e-4 of max |logit|).
- The cache: each rank's real buffers (kv_mgr.past_key_values) after the run are [B, 1, S/G + 128, latent] with the
  1-wide V slot, and rank r's slot j equals the TP=1 cache at position j * G + r % G of every row.
The collectives are gloo's, not Neuron's; tracing is not covered here.
"""

import dataclasses

import pytest
import torch
from nxdi_support import rel_err
from safetensors.torch import load_file, save_file

from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.neuron import KimiK2InferenceConfig, contract
from kimi_k2_neuron.nxdi_cpu import backend

# rows of 20 and 17 tokens prefilling 7 and 4, then 13 teacher-forced decode steps each (>= 3 x TP at TP=4)
ROWS = [[5, 17, 300, 42, 256, 9, 77, 123, 8, 511, 33, 2, 90, 61, 400, 7, 12, 250, 19, 3],
        [400, 3, 3, 3, 260, 100, 44, 18, 301, 5, 6, 70, 88, 140, 9, 27, 11]]
PREFILL = [7, 4]

pytestmark = pytest.mark.fp8_selective_cpu


def _dump_job(rank: int, o, rows, prefill, out_dir: str):
    """backend._logits_job, plus this rank's cache buffers as the model holds them."""
    app = backend.build(o, seq_len=max(len(r) for r in rows), batch=len(rows))
    logits = backend.teacher_forced_logits(app, rows, prefill)
    mgr = app.token_generation_model.model.kv_mgr
    rank_util = app.token_generation_model.model.rank_util.get_rank()
    cache = {f"kv{i}": t.data.clone() for i, t in enumerate(mgr.past_key_values)}
    save_file({**cache, "rank_util": rank_util.clone()}, f"{out_dir}/rank{rank}.safetensors")
    return logits


@pytest.fixture(scope="module")
def ckpt(converted):
    return str(converted[("fp8", "fp8-per-channel")])  # its scales shard 4 ways; blockwise only 2


@pytest.fixture(scope="module")
def replicated(ckpt, tmp_path_factory):
    """TP=1, NxDI's replicated cache: the logits and the cache."""
    out = tmp_path_factory.mktemp("tp1")
    o = backend.prepare(backend.CpuOptions(model=ckpt), max(map(len, ROWS)), len(ROWS))
    logits = backend.run(o, _dump_job, ROWS, PREFILL, str(out))
    return logits, load_file(out / "rank0.safetensors")


@pytest.mark.parametrize("tp,g", [(2, 2), (4, 4), (4, 2)], ids=["tp2", "tp4", "tp4-two-groups"])
def test_the_sharded_cache_gives_the_replicated_logits_and_holds_every_gth_position(ckpt, replicated, tmp_path,
                                                                                      tp, g):
    want, full = replicated
    o = backend.prepare(backend.CpuOptions(model=ckpt, tp=tp, kv_group=g), max(map(len, ROWS)), len(ROWS))
    got = backend.run(o, _dump_job, ROWS, PREFILL, str(tmp_path))
    for r, row in enumerate(ROWS):
        assert rel_err(got[r, :len(row)], want[r, :len(row)]) < 1e-4, f"row {r}"
    seq_len = backend.cache_length(o, max(map(len, ROWS)))
    slots = contract.cache_slots(seq_len, contract.LayoutOptions(kv_group=g))
    assert slots == seq_len // g + contract.FD_RESERVED_SLOTS
    latent = full["kv0"].shape[-1]
    for rank in range(tp):
        cache = load_file(tmp_path / f"rank{rank}.safetensors")
        assert cache["rank_util"].tolist() == [rank]  # SPMDRank, the rank a traced graph reads
        k = rank % g
        for layer in range(len(full) // 2):
            kc, vc = cache[f"kv{2 * layer}"], cache[f"kv{2 * layer + 1}"]
            assert kc.shape == (len(ROWS), 1, slots, latent) and vc.shape == (len(ROWS), 1, slots, 1)
            for b, row in enumerate(ROWS):
                positions = torch.arange(k, len(row), g)
                torch.testing.assert_close(kc[b, 0, :len(positions)], full[f"kv{2 * layer}"][b, 0, positions],
                                           rtol=1e-5, atol=1e-5 * full[f"kv{2 * layer}"].abs().max().item())
