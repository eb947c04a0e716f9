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


def _count_sampler(rank: int, o, rows):
    """The collectives NxDI's on-device sampler issues in one decode step, as trn2 runs it: vocab-sharded logits
    (on_cpu off), NxDI's dynamic sampler with its default rotated top-k (top_k_kernel_enabled), NxD's distributed
    top-k over the TP group (gloo here); the device-only kernels stood in for by nki-library's references
    (real_shapes.SamplerKernels). -> (collective name -> count, each one's gathered elements, the kernel calls)."""
    from real_shapes import _replace_device_only_sampling_ops

    from kimi_k2_neuron.neuron.spec import GREEDY

    dist = torch.distributed
    kernels = _replace_device_only_sampling_ops()
    app = backend.application(o, max(map(len, rows)) + 2, len(rows), GREEDY, on_cpu=False).to_cpu()
    sampler = app.token_generation_model.model.sampler
    ids, mask, pos = backend.padded_prefill(rows, [len(r) for r in rows])
    seq_ids = torch.arange(len(rows))
    counting, counts, shapes = [False], {}, []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counter(name):
        def call(*args, **kwargs):
            if counting[0]:
                counts[name] = counts.get(name, 0) + 1
                first = args[0]  # all_gather's output list, or the output tensor (the input of a reduce)
                shapes.append(sum(t.numel() for t in first) if isinstance(first, (list, tuple)) else first.numel())
            return originals[name](*args, **kwargs)
        return call

    with torch.no_grad():
        out = app.forward(input_ids=ids, attention_mask=mask, position_ids=pos, seq_ids=seq_ids)
        handles = [sampler.register_forward_pre_hook(lambda *_: counting.__setitem__(0, True)),
                   sampler.register_forward_hook(lambda *_: counting.__setitem__(0, False))]
        for name in COLLECTIVES:  # test-only: this process's torch.distributed, to count its calls
            setattr(dist, name, counter(name))
        try:
            cur = torch.tensor([len(r) for r in rows])
            step_mask = (torch.arange(int(cur.max()))[None] < cur[:, None]).long()
            app.forward(input_ids=out.tokens.reshape(len(rows), -1)[:, -1:], attention_mask=step_mask,
                        position_ids=cur[:, None], seq_ids=seq_ids)
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
            for h in handles:
                h.remove()
    return counts, shapes, [c["kernel"] for c in kernels.calls]


def test_the_sampler_issues_the_collectives_the_time_model_counts(converted):
    """NxDI's default on trn2, counted: 2 all-gathers over the TP group, the candidates' values and indices, each
    [batch, tp x global_topk]: the model's (timing._sampler_collectives: not the three-stage cascade's 6 over groups of
    4, which runs only with NxDI's top-k kernel off)."""
    from kimi_k2_neuron.neuron.timing import THIS_PORT, decode_collectives

    rows = [[5, 17, 300, 42], [400, 3, 3, 260]]
    model = converted[("fp8", "fp8-blockwise")]  # vocab 512: 256 a rank at TP=2, as global_topk 256 needs
    o = backend.prepare(cpu_options(str(model), tp=2), 6, len(rows))
    counts, shapes, kernels = backend.run(o, _count_sampler, rows)
    cfg = KimiK2Config.from_file(model)
    spec = dataclasses.replace(backend.request_spec(o, 6, len(rows)), lnc=2)
    (modelled,) = [c for c in decode_collectives(cfg, spec, THIS_PORT) if "top-k" in c.what]
    assert sum(counts.values()) == modelled.count == 2, counts
    # each the gathered [batch, tp x k]: the model's group and bytes (4-byte values and indices)
    assert modelled.group == 2 and shapes == [len(rows) * 2 * 256] * 2
    assert modelled.bytes == shapes[0] * 4
    assert kernels[:2] == ["topk", "topk"]  # the rotated kernel on the shard, then on the gathered candidates
