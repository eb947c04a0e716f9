"""A prefill chunk's attention over the sequence-sharded cache (issue 27), counted as the code runs it: MLAttention.
attend_chunk at Kimi-K2's real per-rank shapes (TP=64: one head, kv_lora_rank 512, rope 64, 1,024-token chunk, KV
group 64) on one process, through a ParallelContext that records each collective it is asked for (and answers as if
every rank held this rank's data: shapes, not numbers). What it records is what the planner counts
(mla.chunk_collectives via timing.chunk_merge), and the peak of the tensors it keeps alive is what hbm.py's
"prefill chunk attention" row charges. The numbers themselves are tested against the replicated one-shot run on
real ranks: test_tp.py (gloo) and test/nxdi_cpu/test_chunk_submodel.py (NxD's collectives)."""

from __future__ import annotations

import dataclasses
import json
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.formats.scheme import ExpertScheme
from kimi_k2_neuron.model.mla import CHUNK_QUERY_TILE, MLAttention
from kimi_k2_neuron.neuron.fit import plan
from kimi_k2_neuron.neuron.spec import RunSpec
from kimi_k2_neuron.neuron.timing import chunk_merge
from kimi_k2_neuron.parallel import ParallelContext
from kimi_k2_neuron.placement import Layout

KIMI = Path(__file__).resolve().parents[1] / "data" / "configs" / "kimi-k2-instruct-0905.json"
TP, G, N = 64, 64, 1024
BLOCKWISE = ExpertScheme("fp8-blockwise", (32, 32))  # as convert writes it (test_fit.py)
SEQ = 16384  # a short context keeps the CPU run to seconds; the counts scale with it by the same formula


@dataclasses.dataclass(frozen=True)
class Recording(ParallelContext):
    """Every collective as (what, ranks, bytes: an all-gather's output, a reduce-scatter's input)."""

    seen: list = dataclasses.field(default_factory=list, compare=False)

    def kv_rank(self):
        return torch.tensor(5)  # any group rank: the shapes do not depend on it

    def gather_chunk_heads(self, x, chunk_group, dim=1):
        if chunk_group == 1:
            return x
        out = torch.cat([x] * chunk_group, dim=dim)
        self.seen.append(("gather heads", chunk_group, out.nbytes))
        return out

    def gather_chunk_cache(self, x, chunk_group):
        pool = self.kv_group // chunk_group
        if pool == 1:
            return x
        out = torch.cat([x] * pool, dim=1)
        self.seen.append(("gather cache", pool, out.nbytes))
        return out

    def max_over_chunk_group(self, x, chunk_group):
        if chunk_group > 1:
            self.seen.append(("max", chunk_group, x.nbytes))
        return x

    def reduce_scatter_chunk_heads(self, x, chunk_group):
        if chunk_group == 1:
            return x
        self.seen.append(("reduce-scatter", chunk_group, x.nbytes))
        h = x.shape[1] // chunk_group
        return x.narrow(1, 0, h).clone()


class PeakLive(TorchDispatchMode):
    """The peak bytes of the storages ops allocate while it is on, each counted until it is freed; storages that
    existed before (inputs, weights, and views of them) are not counted."""

    def __init__(self, before):
        super().__init__()
        self.live = self.peak = 0
        self.storages = {t.untyped_storage().data_ptr() for t in before}
        self.before = set(self.storages)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.storages:
                    self.storages.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key, nbytes):
        self.storages.discard(key)
        self.live -= nbytes


def run_chunk(chunk_group=None, kv_group=G):
    """attend_chunk of one rank at Kimi's TP=64 shapes, bf16, before o_proj -> (its heads' context, the collectives
    it asked for, the peak bytes of what it built)."""
    cfg = KimiK2Config.from_file(KIMI)
    layout = Layout(kv_group=kv_group, prefill_chunk=N, chunk_group=chunk_group)
    spec = RunSpec(tp=TP, seq_len=SEQ, layout=layout, scheme=BLOCKWISE)
    ctx = Recording(tp_size=TP, layout=layout)
    torch.manual_seed(0)
    with torch.device("meta"):
        attn = MLAttention(cfg, torch.bfloat16, ctx)
    attn.kv_b_proj.weight = torch.nn.Parameter(torch.randn(attn.kv_b_proj.weight.shape, dtype=torch.bfloat16) * .05,
                                               requires_grad=False)
    attn.o_proj = torch.nn.Identity()  # its output is the layer's activation, which the calibrated scratchpad holds
    q_nope = torch.randn(1, attn.n_heads, N, attn.nope, dtype=torch.bfloat16)
    q_pe = torch.randn(1, attn.n_heads, N, attn.rope, dtype=torch.bfloat16)
    past = torch.randn(1, spec.cache_slots, cfg.latent_dim, dtype=torch.bfloat16)
    entries = torch.randn(1, N, cfg.latent_dim, dtype=torch.bfloat16)
    positions = torch.arange(SEQ - N, SEQ)[None]  # the last chunk
    with torch.no_grad(), PeakLive([attn.kv_b_proj.weight, q_nope, q_pe, past, entries, positions]) as mode:
        out = attn.attend_chunk(q_nope, q_pe, past, entries, positions, CHUNK_QUERY_TILE)
    return cfg, spec, out, ctx.seen, mode.peak


def test_the_planner_counts_the_collectives_attend_chunk_asks_for():
    """At G = 64 the chunk group the model chooses is 16 (each rank pooling 4 caches); the collectives it asks for are
    timing.chunk_merge's, one by one: group sizes and bytes, in bf16 as the shell runs."""
    cfg, spec, out, seen, _ = run_chunk()
    assert out.shape == (1, N, cfg.v_head_dim) and torch.isfinite(out).all()  # this rank's head, before o_proj
    attention = seen
    counted = chunk_merge(cfg, spec, layers=1)
    assert sorted((n, b) for _, n, b in attention) == sorted((c.group, c.bytes) for c in counted for _ in range(c.count))
    assert {c.group for c in counted} == {16, 4}
    assert len(attention) == 5  # pool the cache, gather kv_b and the queries, one max, one reduce-scatter


@pytest.mark.parametrize("kv_group,chunk_group", [(G, None), (G, G), (1, None)],
                         ids=["sharded", "sharded-flat-merge", "replicated"])
def test_the_chunk_attention_row_is_what_attend_chunk_keeps_alive(kv_group, chunk_group):
    """hbm.py's "prefill chunk attention" row against the peak of the tensors attend_chunk builds (its inputs, weights
    and o_proj aside): at the chunk group the model chooses, at the flat merge over all 64 ranks, and over the
    replicated cache (one head over all of it). The row may miss small tensors (masks, maxima), not 3 %."""
    cfg, spec, _, _, peak = run_chunk(chunk_group, kv_group)
    p = plan(cfg, dataclasses.replace(spec, lnc=2, batch=1))
    row = next(r.bytes for r in p.allowance if r.kind.startswith("prefill chunk attention"))
    assert row <= peak <= 1.03 * row, (peak, row)


def test_a_1024_token_chunk_at_g64_moves_under_40_mb_a_layer(capsys):
    """Issue 27's goal, as `plan --json` reports it for Kimi-K2-Instruct-0905 at 262,144 x 8 with 1,024-token
    chunks over the cache sharded 64 ways: the last chunk's attention collectives, per layer and rank (the flat
    merge of attend_sharded moved 210 MB)."""
    from kimi_k2_neuron.cli import main

    assert main(["plan", "--config", str(KIMI), "--tp", "64", "--experts", "fp8-blockwise", "--kv-shard", "sequence",
                 "--prefill-chunk", "1024", "--seq-len", "262144", "--batch", "8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["chunk_merge_bytes"] <= 40e6
    merge = [c for c in d["chunk"]["collectives"] if "(TP)" not in c["what"]]
    assert sum(c["count"] * c["bytes"] for c in merge) == 61 * d["chunk_merge_bytes"]
    assert {c["group"] for c in merge} == {16, 4} and d["chunk"]["total_ms"] > 0


@pytest.mark.parametrize("layout, needle", [
    (dict(kv_group=64, prefill_chunk=1024, chunk_group=8),
     "kimi_k2_run_spec.layout.chunk_group 8 at --tp 64 --lnc 2: not a pair of meshes NxD lays out; use one of [64, 16]"),
    (dict(kv_group=64, chunk_group=16), "kimi_k2_run_spec.layout.chunk_group 16: only with --kv-shard sequence and --prefill"),
], ids=["no trn2 mesh", "no chunk"])
def test_chunk_groups_nxd_cannot_lay_out_are_refused(layout, needle, one_line_error):
    from kimi_k2_neuron.neuron import rules

    cfg = KimiK2Config.from_file(KIMI)
    spec = RunSpec(tp=TP, seq_len=262144, layout=Layout(**layout), scheme=BLOCKWISE)
    one_line_error(lambda: rules.check(cfg, spec), needle)


def test_a_chunk_group_must_divide_the_kv_group(one_line_error):
    one_line_error(lambda: Layout(kv_group=4, chunk_group=3), "chunk_group 3: must be an integer dividing the KV "
                                                               "group 4")
