"""cpu.MoEPaths names the ExpertMLPsV2 path NxD really takes (checked here with spies on NxD's methods, in test code
only), and the blockwise prefill path, which NxD runs in torch on CPU and with the NKI kernel on trn2, is covered."""

from unittest import mock

import pytest
import torch
from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2

from kimi_k2_neuron.neuron import cpu
from kimi_k2_neuron.runtime.runner import CpuRunner
from nxdi_support import rel_err

METHODS = {"forward_all_experts": "all-experts", "forward_selective_loading": "selective-loading",
           "forward_blockwise": "blockwise", "forward_all_experts_EP": "all-experts-ep"}

pytestmark = pytest.mark.fp8_selective_cpu


def _rows(n, lengths):
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, 512, (k,), generator=g).tolist() for k in lengths]


# Tiny: 8 experts, top-3, block 512. Prefill of T padded tokens: all-experts while T x 3 < 512, then blockwise.
# Decode of B rows: selective loading while B x 3 / 8 < 1, then all experts.
CASES = {
    "short prefill, batch-2 decode": (_rows(1, [9, 6]), 4,
                                      {"context_encoding_model": {"all-experts"},
                                       "token_generation_model": {"selective-loading"}}),
    "long prefill, batch-3 decode": (_rows(2, [180, 175, 172]), 170,
                                     {"context_encoding_model": {"blockwise"},
                                      "token_generation_model": {"all-experts"}}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reported_paths_are_the_paths_nxd_takes(converted, name):
    rows, prefill, want = CASES[name]
    ckpt = converted[("fp8", "fp8-blockwise")]
    app = cpu.build(cpu.CpuOptions(model=str(ckpt)), seq_len=max(map(len, rows)), batch=len(rows))
    paths = cpu.MoEPaths(app)
    called = {}
    owner = {id(m): w.tag for w in app.models for m in w.model.modules() if isinstance(m, ExpertMLPsV2)}

    def spy(method):
        original = getattr(ExpertMLPsV2, method)

        def record(self, *args, **kwargs):
            called.setdefault(owner[id(self)], set()).add(METHODS[method])
            return original(self, *args, **kwargs)
        return mock.patch.object(ExpertMLPsV2, method, record)

    with spy("forward_all_experts"), spy("forward_selective_loading"), spy("forward_blockwise"):
        got = cpu.teacher_forced_logits(app, rows, prefill)
    assert paths.seen == called == want
    runner = CpuRunner(ckpt)
    for r, row in enumerate(rows):
        assert rel_err(got[r, :len(row)], runner.logits([row], prefill)[0]) < 1e-4, f"row {r}"
    if "blockwise" in want["context_encoding_model"]:
        assert "blockwise (on trn2 the NKI blockwise kernel" in paths.report()

