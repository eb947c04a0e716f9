"""The time model counts the collectives the code issues: one decode step of the NxDI model in NxD's CPU mode at TP=2
(and with the long-context layout), every torch.distributed collective each rank issues counted, against
neuron/timing.py's list for the same run (its sampler as NxD's CPU mode runs it: lm_head gathers the vocabulary, the
sampler then runs locally)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from nxdi_support import cpu_options

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.nxdi_cpu import backend
from kimi_k2_neuron.placement import Layout

pytestmark = pytest.mark.fp8_selective_cpu

# NxD's CPU-mode reduce-scatter is gloo's reduce then scatter (NXD_CPU_MODE.md's comm functions): one collective,
# counted at its reduce
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast")


def _count_decode_step(rank: int, o, rows):
    """The collectives one decode step (the token-generation submodel, every row one token) issues on this rank."""
    dist = torch.distributed
    app = backend.build(o, seq_len=max(map(len, rows)) + 2, batch=len(rows))
    ids, mask, pos = backend.padded_prefill(rows, [len(r) for r in rows])
    seq_ids = torch.arange(len(rows))
    with torch.no_grad():
        backend._forward(app, ids, mask, pos, seq_ids)  # the prefill, not counted
        counts = {}
        originals = {name: getattr(dist, name) for name in COLLECTIVES}

        def counting(name):
            def call(*args, **kwargs):
                counts[name] = counts.get(name, 0) + 1
                return originals[name](*args, **kwargs)
            return call

        for name in COLLECTIVES:  # test-only: this process's torch.distributed, to count its calls
            setattr(dist, name, counting(name))
        try:
            cur = torch.tensor([len(r) for r in rows])
            step_mask = (torch.arange(int(cur.max()))[None] < cur[:, None]).long()
            backend._forward(app, torch.tensor([[r[-1]] for r in rows]), step_mask, cur[:, None], seq_ids)
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
    return counts


@pytest.mark.parametrize("layout", [Layout(), Layout(kv_group=2, shard_attn_a=True, shard_router=True)],
                         ids=["replicated", "sharded"])
def test_a_decode_step_issues_the_collectives_the_time_model_counts(per_channel, layout):
    from kimi_k2_neuron.neuron.timing import Port, decode_collectives

    rows = [[5, 17, 300, 42], [400, 3, 3, 260]]
    o = backend.prepare(cpu_options(per_channel, tp=2, layout=layout), 6, len(rows))
    counts = backend.run(o, _count_decode_step, rows)
    cfg = KimiK2Config.from_file(per_channel)
    spec = dataclasses.replace(backend.request_spec(o, 6, len(rows)), sampling=dataclasses.replace(
        o.spec.sampling, on_device=False))  # NxD's CPU mode gathers the logits in lm_head and samples locally
    modelled = decode_collectives(cfg, spec, Port(sampler="host"))
    assert sum(counts.values()) == sum(c.count for c in modelled), (counts, [(c.what, c.count) for c in modelled])
