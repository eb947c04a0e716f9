"""nxdi_cpu/backend.py: the NxDI model in NxD's CPU mode (NxDI's context-encoding and token-generation submodels, its
model wrappers, KV cache manager, sampler and generation adapter, NxD's parallel, quantized and MoE layers) against the
core's CPU runner on the same converted checkpoint, and against transformers where the conversion is exact.

- Logits: two rows of different lengths, each prefilling its first PREFILL tokens in one context-encoding call (or
  its whole length, right-padded as NxDI pads), then teacher-forced one token per token-generation call, each row at
  its own position.
- MoE paths: backend.MoEPaths names the ExpertMLPsV2 path NxD really takes (checked with spies on NxD's methods, in test
  code only); the blockwise prefill path, which NxD runs in torch on CPU and with the NKI kernel on trn2, is covered.
  FP8 selective loading needs NxD's CPU indexing fix (conftest.py).
- Generation: NxDI's HuggingFaceGenerationAdapter and on-device sampler (its CPU branches) at TP=2 pick the argmax of
  the full logits the model computes. On device the sampler takes vocab-sharded logits and gathers its top-k/argmax
  across ranks with torch-neuronx ops; its CPU branches have no distributed path, so in CPU mode the model's lm_head
  gathers the vocabulary first (base.py, init_model). Without that gather the TP=2 tokens come from one rank's
  half of the vocabulary (seen: row 1's first token differed). The sharded path itself awaits trn2.
- Ranks: tensor parallelism through NxD's real parallel layers over gloo (separate processes,
  kimi_k2_neuron.runtime.ranks; rank 0's logits come back), and NxD's real pre-sharding. The collectives are gloo's,
  not Neuron's: this checks sharding and the model's use of NxD's layers, not the device's collectives.
"""

import dataclasses
import subprocess
import sys
from unittest import mock

import pytest
import torch
from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2
from nxdi_support import cpu_options, oracle_logits, rel_err
from safetensors import safe_open

from kimi_k2_neuron.neuron import rules
from kimi_k2_neuron.neuron.spec import Sampling
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.nxdi_cpu import backend
from kimi_k2_neuron.runtime.runner import CpuRunner

ROWS = [[5, 17, 300, 42, 256, 9, 77, 123, 8, 511], [400, 3, 3, 3, 260, 100]]
PREFILL = 4
COMBOS = [(q, s) for q in ("fp8", "int4", "bf16") for s in ("fp8-blockwise", "fp8-per-channel")]

pytestmark = pytest.mark.fp8_selective_cpu


# -- teacher-forced logits ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def apps(converted):
    """One NxDI CPU model per (source, scheme), built once: float32, TP=1, batch 2, seq_len of the longest row."""
    cache = {}

    def get(q, scheme, dtype="float32"):
        key = (q, scheme, dtype)
        if key not in cache:
            o = cpu_options(model=str(converted[(q, scheme)]), dtype=dtype)
            cache[key] = backend.build(o, seq_len=max(map(len, ROWS)), batch=len(ROWS))
        return cache[key]
    return get


def core_rows(ckpt, prefill, dtype=torch.float32):
    runner = CpuRunner(ckpt, dtype=dtype)
    return [runner.logits([r], min(prefill, len(r)) if prefill else None)[0] for r in ROWS]


@pytest.mark.parametrize("prefill", [PREFILL, None], ids=["prefill4+decode", "ragged-prefill"])
@pytest.mark.parametrize("q,scheme", COMBOS)
def test_nxdi_cpu_logits_equal_the_core_runner(apps, converted, q, scheme, prefill):
    got = backend.teacher_forced_logits(apps(q, scheme), ROWS, prefill)
    assert got.shape == (2, 10, 512) and torch.isnan(got[1, 6:]).all() and not torch.isnan(got[0]).any()
    for r, want in enumerate(core_rows(converted[(q, scheme)], prefill)):
        assert rel_err(got[r, :len(ROWS[r])], want) < 1e-4, f"row {r}"


@pytest.mark.parametrize("q", ["int4", "fp8"])
def test_exact_conversions_match_transformers(apps, tiny, q, tmp_path):
    """INT4 -> fp8-blockwise is lossless; FP8 -> fp8-blockwise keeps the codes, and the converted checkpoint stores the
    non-expert weights in BF16, so the oracle gets that same rounding (a no-op for the INT4 checkpoint's BF16)."""
    got = backend.teacher_forced_logits(apps(q, "fp8-blockwise"), ROWS, PREFILL)
    ref = oracle_logits(tiny[q], ROWS, PREFILL, bf16_non_experts=True, tmp_path=tmp_path)
    for r, want in enumerate(ref):
        assert rel_err(got[r, :len(ROWS[r])], want) < 1e-3, f"row {r}"


def test_the_hooks_self_check_allows_one_rounding_of_the_dtype_and_no_more():
    """backend.check_hooked_logits: two matmuls of the same hidden state round differently by at most one unit in
    the last place of the dtype (bf16's 2^-7 relative), which it takes at every batch (a 1e-4 bound refused it:
    trace-cpu at batch 4 in bf16, issue 41); another row's logits, or a bf16 result checked as float32, are refused."""
    g = torch.Generator().manual_seed(0)
    nxdi = (torch.randn(4, 2560, generator=g) * 4).to(torch.bfloat16).float()  # one rank's vocabulary at TP 64
    ulp = torch.ldexp(torch.ones(()), torch.frexp(nxdi).exponent - 8)  # bf16 keeps 8 significant bits
    one_ulp_off = nxdi + ulp * (torch.rand(nxdi.shape, generator=g) < 0.5)
    assert torch.equal(one_ulp_off.to(torch.bfloat16).float(), one_ulp_off) and (one_ulp_off != nxdi).any()
    backend.check_hooked_logits(one_ulp_off, nxdi, torch.bfloat16)
    backend.check_hooked_logits(nxdi, nxdi, torch.float32)
    for wrong, dtype in ((nxdi.roll(1, 0), torch.bfloat16), (one_ulp_off, torch.float32)):
        with pytest.raises(RuntimeError, match="the hook read the wrong tensor"):
            backend.check_hooked_logits(wrong, nxdi, dtype)


def test_bfloat16_at_tp1_is_close_to_float32(apps, converted):
    """bf16 is a sanity bound, not parity: a near-tie routing decision can flip in bf16 (as the core's bf16 test)."""
    got = backend.teacher_forced_logits(apps("fp8", "fp8-blockwise", "bfloat16"), ROWS, PREFILL)
    for r, want in enumerate(core_rows(converted[("fp8", "fp8-blockwise")], PREFILL)):
        ours = got[r, :len(ROWS[r])]
        assert (ours - want).abs().median() / want.abs().max() < 2e-2
        assert (ours.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def test_a_decode_mask_that_covers_the_current_slot_changes_the_logits(apps):
    """The KIMI contrib's harness sent ones(pos + 1) as the decode mask, attending the stale cache slot at pos
    (nxdi_contracts.md §5.5.2); NxDI's TKG mask is [0, pos) and the current token is attended as the active part."""
    app = apps("fp8", "fp8-blockwise")
    rows = [r[:PREFILL] for r in ROWS]
    ids, mask, pos = backend.padded_prefill(rows, [PREFILL, PREFILL])

    def decode(width):
        app.forward(input_ids=ids, attention_mask=mask, position_ids=pos, seq_ids=torch.arange(2))
        step = torch.full((2, 1), PREFILL)
        out = app.forward(input_ids=torch.tensor([[11], [12]]), attention_mask=torch.ones(2, width, dtype=torch.long),
                          position_ids=step, seq_ids=torch.arange(2))
        return out.logits.float()

    right, wrong = decode(PREFILL), decode(PREFILL + 1)
    assert rel_err(wrong, right) > 1e-3
    want = torch.stack([backend.teacher_forced_logits(app, [r + [t]], PREFILL)[0, PREFILL]
                        for r, t in zip(rows, (11, 12))])
    assert rel_err(right[:, -1], want) < 1e-5


@pytest.mark.parametrize("scheme", ["fp8-blockwise", "fp8-per-channel"])
def test_continuous_batching_writes_each_sequence_into_its_seq_ids_cache_line(apps, converted, scheme):
    """NxDI's continuous batching as vllm-neuron runs it (ctx_batch_size 1): each row prefilled alone into the cache
    line its seq_id names, row 1 first, which also decodes a step alone (NxDI's wrapper fills the batch with the free
    line 0 and sorts it); then both rows decode together, each at its own position, in seq_id order (as vllm-neuron
    sorts them); then row 0 alone once row 1 has ended. The latent cache's 1-wide V slot takes NxDI's writes by
    seq_id as they are. Every logit equals the batch run's (teacher_forced_logits, both rows prefilled together).
    Padding rows write into the free lines they stand for, which each position's own write precedes every read of."""
    want = backend.teacher_forced_logits(apps("fp8", scheme), ROWS, PREFILL)
    o = cpu_options(model=str(converted[("fp8", scheme)]), continuous_batching=True)
    app = backend.build(o, seq_len=max(map(len, ROWS)), batch=len(ROWS))
    assert app.neuron_config.is_continuous_batching and app.context_encoding_model.config.neuron_config.batch_size == 1
    got = {}

    def call(rows: list[int], start: list[int], width: int = 1):
        ids = torch.tensor([ROWS[r][s:s + width] for r, s in zip(rows, start)])
        pos = torch.tensor([list(range(s, s + width)) for s in start])
        mask = (torch.arange(max(start) + width if width > 1 else max(start))[None]
                < torch.tensor(start)[:, None] + (width if width > 1 else 0)).long()
        out = app.forward(input_ids=ids, attention_mask=mask, position_ids=pos, seq_ids=torch.tensor(rows))
        for i, (r, s) in enumerate(zip(rows, start)):
            got[(r, s + width - 1)] = out.logits[i, -1].float()

    with torch.no_grad():
        call([1], [0], PREFILL)
        call([1], [PREFILL])
        call([0], [0], PREFILL)
        call([0, 1], [PREFILL, PREFILL + 1])
        for position in range(PREFILL + 1, len(ROWS[0])):
            call([0], [position])
    assert len(got) == len(ROWS[0]) + len(ROWS[1]) - 2 * (PREFILL - 1)
    for (r, position), logits in got.items():
        assert rel_err(logits, want[r, position]) < 1e-4, (r, position)


# -- which of NxD's MoE paths ran --------------------------------------------------------------------------------------

METHODS = {"forward_all_experts": "all-experts", "forward_selective_loading": "selective",
           "forward_blockwise": "blockwise", "forward_all_experts_EP": "all-experts-ep"}


def _rows(n, lengths):
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, 512, (k,), generator=g).tolist() for k in lengths]


# Tiny: 8 experts, top-3, the torch mode's block 512. Prefill of T padded tokens: all-experts while T x 3 < 512, then
# blockwise.
# Decode of B rows: selective loading while B x 3 / 8 < 1, then all experts.
CASES = {
    "short prefill, batch-2 decode": (_rows(1, [9, 6]), 4,
                                      {"context_encoding_model": {"all-experts"},
                                       "token_generation_model": {"selective"}}),
    "long prefill, batch-3 decode": (_rows(2, [180, 175, 172]), 170,
                                     {"context_encoding_model": {"blockwise"},
                                      "token_generation_model": {"all-experts"}}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reported_paths_are_the_paths_nxd_takes(converted, name):
    rows, prefill, want = CASES[name]
    ckpt = converted[("fp8", "fp8-blockwise")]
    app = backend.build(cpu_options(model=str(ckpt)), seq_len=max(map(len, rows)), batch=len(rows))
    paths = backend.MoEPaths(app)
    called = {}
    owner = {id(m): w.tag for w in app.models for m in w.model.modules() if isinstance(m, ExpertMLPsV2)}

    def spy(method):
        original = getattr(ExpertMLPsV2, method)

        def record(self, *args, **kwargs):
            called.setdefault(owner[id(self)], set()).add(METHODS[method])
            return original(self, *args, **kwargs)
        return mock.patch.object(ExpertMLPsV2, method, record)

    with spy("forward_all_experts"), spy("forward_selective_loading"), spy("forward_blockwise"):
        got = backend.teacher_forced_logits(app, rows, prefill)
    assert paths.seen == called == want
    runner = CpuRunner(ckpt)
    for r, row in enumerate(rows):
        assert rel_err(got[r, :len(row)], runner.logits([row], prefill)[0]) < 1e-4, f"row {r}"
    if "blockwise" in want["context_encoding_model"]:
        # the tiny model is below the prefill kernels' shapes: its CPU mode configures NxD's torch loop
        assert "blockwise (NxD's torch loop, --moe-prefill torch, as on trn2)" in paths.report()


# -- generation through NxDI's adapter and on-device sampler -----------------------------------------------------------

PROMPTS = [[5, 17, 300, 42, 256, 9, 77], [400, 3, 3, 260]]
NEW = 5


# sampling at the smallest temperature the rules take (NxDI's sampler divides by it in float32) is greedy's limit
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(do_sample=True),
                                      Sampling.of(rules.MIN_TEMPERATURE, 0, 1.0)],
                         ids=["greedy", "sampling-top_k-1", "sampling-at-MIN_TEMPERATURE"])
def test_on_device_sampler_at_tp2_picks_the_argmax_of_the_full_logits(converted, sampling):
    o = cpu_options(model=str(converted[("fp8", "fp8-blockwise")]), tp=2)
    g = backend.Generation(rows=PROMPTS, stop_ids=(), max_new_tokens=NEW, sampling=sampling, seed=3)
    new, report = backend.generate(o, g)
    assert "on-device sampling: NxDI's CPU branch over logits gathered in lm_head" in report
    assert [len(r) for r in new] == [NEW, NEW]
    full = [p + n for p, n in zip(PROMPTS, new)]
    logits, _ = backend.logits(cpu_options(model=o.model), full, prefill_len=None)
    for r, (p, n) in enumerate(zip(PROMPTS, new)):
        assert logits[r, len(p) - 1:len(p) - 1 + NEW].argmax(-1).tolist() == n, f"row {r}"


# -- ranks: TP over gloo, NxD's pre-sharding ---------------------------------------------------------------------------

def _tp1(opts):
    return backend.logits(dataclasses.replace(opts, spec=dataclasses.replace(opts.spec, tp=1), presharded=None), ROWS,
                          PREFILL)[0]


def _close(a, b):
    for r, row in enumerate(ROWS):
        assert rel_err(a[r, :len(row)], b[r, :len(row)]) < 1e-4, f"row {r}"


@pytest.mark.parametrize("scheme", ["fp8-blockwise", "fp8-per-channel"])
def test_tp2_equals_tp1(converted, scheme):
    o = cpu_options(model=str(converted[("fp8", scheme)]), tp=2)
    got, report = backend.logits(o, ROWS, PREFILL)
    _close(got, _tp1(o))
    assert "context_encoding_model: all-experts" in report and "token_generation_model: selective" in report


# ModelBuilder refuses a torch_neuronx without __version__ (model_builder.py:461); the nxdi-cpu import shim has none,
# a real torch-neuronx has it. Test-side only: the product never touches torch_neuronx.
PRESHARD = """
import sys, torch_neuronx
if not hasattr(torch_neuronx, "__version__"):
    torch_neuronx.__version__ = "2 (nxdi-cpu import shim)"
from kimi_k2_neuron.neuron.spec import RunSpec
from kimi_k2_neuron.nxdi_cpu import backend
backend.preshard(backend.CpuOptions(model=sys.argv[1], spec=RunSpec(tp=int(sys.argv[2]), lnc=None, moe_prefill=None)),
                 sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
"""


def _scale_shapes(weights, rank):
    with safe_open(str(weights / f"tp{rank}_sharded_checkpoint.safetensors"), "pt") as f:
        return {k.split(".mlp.")[1]: tuple(f.get_slice(k).get_shape()) for k in f.keys() if k.endswith(".scale")
                and k.startswith("layers.1.")}


# Tiny: E=8 experts, H=192, I=64. Blockwise [32, 32] scales of gate_up [E, H, 2I/tp] and down [E, I/tp, H]; per-channel
# [E, 1, out/tp] for gate_up (columns split) and [E, 1, H] for down (rows split, every output column kept).
GATE_UP, DOWN = "expert_mlps.mlp_op.gate_up_proj.scale", "expert_mlps.mlp_op.down_proj.scale"
SCALES = {
    ("fp8-blockwise", 2): {GATE_UP: (8, 6, 2), DOWN: (8, 1, 6)},
    ("fp8-per-channel", 2): {GATE_UP: (8, 1, 64), DOWN: (8, 1, 192)},
    ("fp8-per-channel", 4): {GATE_UP: (8, 1, 32), DOWN: (8, 1, 192)},
}

@pytest.mark.parametrize("scheme,tp", list(SCALES), ids=[f"{s}-tp{t}" for s, t in SCALES])
def test_presharded_ranks_give_the_tp1_logits(converted, tmp_path, scheme, tp):
    """NxD's shard_checkpoint through our shard_weights rank passes; each rank then loads its own file, strictly."""
    ckpt = converted[("fp8", scheme)]
    r = subprocess.run([sys.executable, "-c", PRESHARD, str(ckpt), str(tp), str(tmp_path), str(max(map(len, ROWS))),
                        str(len(ROWS))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    weights = tmp_path / "weights"
    assert sorted(p.name for p in weights.iterdir()) == [f"tp{i}_sharded_checkpoint.safetensors" for i in range(tp)]
    for rank in range(tp):
        assert _scale_shapes(weights, rank) == SCALES[(scheme, tp)]
    o = cpu_options(model=str(ckpt), tp=tp, presharded=str(weights))
    _close(backend.logits(o, ROWS, PREFILL)[0], _tp1(o))


def test_expert_parallelism_is_refused_on_cpu_with_the_reason(converted):
    o = cpu_options(model=str(converted[("fp8", "fp8-blockwise")]), tp=2, ep=2)
    with pytest.raises(KimiInputError, match="XLA process group's _mesh"):
        backend.logits(o, ROWS, PREFILL)


def test_bfloat16_over_gloo_is_refused(converted):
    o = cpu_options(model=str(converted[("fp8", "fp8-blockwise")]), tp=2, dtype="bfloat16")
    with pytest.raises(KimiInputError, match="gloo has no bfloat16"):
        backend.logits(o, ROWS, PREFILL)
