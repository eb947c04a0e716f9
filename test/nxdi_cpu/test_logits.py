"""Logits of the NxDI model in NxD's CPU mode (NxDI's context-encoding and token-generation submodels, its model
wrappers and KV cache manager, NxD's parallel and quantized layers and MoE) against the core's CPU runner on the same
converted checkpoint, and against transformers where the conversion is exact.

Two rows of different lengths: each prefills its first PREFILL tokens in one context-encoding call (or its whole
length, right-padded as NxDI pads), then is teacher-forced one token per token-generation call, each row at its own
position. MoE paths covered here: all-experts prefill (T x top_k < block 512) and selective-loading decode (FP8 there
needs NxD's CPU indexing fix, conftest.py).
"""

import pytest
import torch

from nxdi_support import oracle_logits, rel_err
from kimi_k2_neuron.neuron import cpu
from kimi_k2_neuron.runtime.runner import CpuRunner

ROWS = [[5, 17, 300, 42, 256, 9, 77, 123, 8, 511], [400, 3, 3, 3, 260, 100]]
PREFILL = 4
COMBOS = [(q, s) for q in ("fp8", "int4", "bf16") for s in ("fp8-blockwise", "fp8-per-channel")]

pytestmark = pytest.mark.fp8_selective_cpu


@pytest.fixture(scope="module")
def apps(converted):
    """One NxDI CPU model per (source, scheme), built once: float32, TP=1, batch 2, seq_len of the longest row."""
    cache = {}

    def get(q, scheme, dtype="float32"):
        key = (q, scheme, dtype)
        if key not in cache:
            o = cpu.CpuOptions(model=str(converted[(q, scheme)]), dtype=dtype)
            cache[key] = cpu.build(o, seq_len=max(map(len, ROWS)), batch=len(ROWS))
        return cache[key]
    return get


def core_rows(ckpt, prefill, dtype=torch.float32):
    runner = CpuRunner(ckpt, dtype=dtype)
    return [runner.logits([r], min(prefill, len(r)) if prefill else None)[0] for r in ROWS]


@pytest.mark.parametrize("prefill", [PREFILL, None], ids=["prefill4+decode", "ragged-prefill"])
@pytest.mark.parametrize("q,scheme", COMBOS)
def test_nxdi_cpu_logits_equal_the_core_runner(apps, converted, q, scheme, prefill):
    got = cpu.teacher_forced_logits(apps(q, scheme), ROWS, prefill)
    assert got.shape == (2, 10, 512) and torch.isnan(got[1, 6:]).all() and not torch.isnan(got[0]).any()
    for r, want in enumerate(core_rows(converted[(q, scheme)], prefill)):
        assert rel_err(got[r, :len(ROWS[r])], want) < 1e-4, f"row {r}"


@pytest.mark.parametrize("q", ["int4", "fp8"])
def test_exact_conversions_match_transformers(apps, tiny, q, tmp_path):
    """INT4 -> fp8-blockwise is lossless; FP8 -> fp8-blockwise keeps the codes, and the converted checkpoint stores the
    non-expert weights in BF16, so the oracle gets that same rounding (a no-op for the INT4 checkpoint's BF16)."""
    got = cpu.teacher_forced_logits(apps(q, "fp8-blockwise"), ROWS, PREFILL)
    ref = oracle_logits(tiny[q], ROWS, PREFILL, bf16_non_experts=True, tmp_path=tmp_path)
    for r, want in enumerate(ref):
        assert rel_err(got[r, :len(ROWS[r])], want) < 1e-3, f"row {r}"


def test_bfloat16_at_tp1_is_close_to_float32(apps, converted):
    """bf16 is a sanity bound, not parity: a near-tie routing decision can flip in bf16 (as the core's bf16 test)."""
    got = cpu.teacher_forced_logits(apps("fp8", "fp8-blockwise", "bfloat16"), ROWS, PREFILL)
    for r, want in enumerate(core_rows(converted[("fp8", "fp8-blockwise")], PREFILL)):
        ours = got[r, :len(ROWS[r])]
        assert (ours - want).abs().median() / want.abs().max() < 2e-2
        assert (ours.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def test_a_decode_mask_that_covers_the_current_slot_changes_the_logits(apps):
    """The KIMI contrib's harness sent ones(pos + 1) as the decode mask, attending the stale cache slot at pos
    (nxdi_contracts.md §5.5.2); NxDI's TKG mask is [0, pos) and the current token is attended as the active part."""
    app = apps("fp8", "fp8-blockwise")
    rows = [r[:PREFILL] for r in ROWS]
    ids, mask, pos = cpu.padded_prefill(rows, [PREFILL, PREFILL])

    def decode(width):
        app.forward(input_ids=ids, attention_mask=mask, position_ids=pos, seq_ids=torch.arange(2))
        step = torch.full((2, 1), PREFILL)
        out = app.forward(input_ids=torch.tensor([[11], [12]]), attention_mask=torch.ones(2, width, dtype=torch.long),
                          position_ids=step, seq_ids=torch.arange(2))
        return out.logits.float()

    right, wrong = decode(PREFILL), decode(PREFILL + 1)
    assert rel_err(wrong, right) > 1e-3
    want = torch.stack([cpu.teacher_forced_logits(app, [r + [t]], PREFILL)[0, PREFILL]
                        for r, t in zip(rows, (11, 12))])
    assert rel_err(right[:, -1], want) < 1e-5
