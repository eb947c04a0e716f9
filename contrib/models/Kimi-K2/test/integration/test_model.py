# SPDX-License-Identifier: Apache-2.0
"""Kimi-K2 on Neuron: a tiny Kimi-K2 compiled at TP=2, loaded, generating, and its logits against the CPU core's.

The tiny checkpoint is random and stored as Kimi-K2-Instruct is (FP8 experts in 128x128 blocks, Kimi's tokenizer
files); it is converted to the recommended fp8-blockwise layout and compiled at batch 2, seq_len 128 (prefill bucket
64), the same code path the 1T model takes at TP=64. Needs the Neuron SDK and a Neuron device with at least
KIMI_K2_TP logical cores (default 2; KIMI_K2_LNC sets the LNC, default the platform's); elsewhere every test is
skipped with the reason. The full model's tests (logit parity against a CPU golden, coherence, TPOT at TP=64) are
kimi-k2-neuron's own test/integration.

    pytest test/integration -s      # prints the logit agreement and the decode latency
"""

import os
from pathlib import Path

import pytest
import torch

from kimi_k2_neuron.launch import set_fp8_env

TP = int(os.environ.get("KIMI_K2_TP", "2"))
LNC = int(os.environ["KIMI_K2_LNC"]) if os.environ.get("KIMI_K2_LNC") else None  # None: the platform's
PREFILL = 16


def _why_not_runnable():
    set_fp8_env()  # NxDI's FP8 settings (XLA_HANDLE_SPECIAL_SCALAR, UNSAFE_FP8FNCAST), before the SDK is imported
    try:
        import modeling_kimi_k2  # noqa: F401 -- its ImportError names the missing Neuron packages
    except ImportError as e:
        return str(e)
    if not any(Path("/dev").glob("neuron*")):
        return "no Neuron device (/dev/neuron*): needs a Trainium or Inferentia2 instance"
    return None


SKIP = _why_not_runnable()
pytestmark = [pytest.mark.trn2, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(loaded application, converted checkpoint, KimiK2Config) of the tiny model."""
    from kimi_k2_neuron.tiny.checkpoint import make_tiny
    from modeling_kimi_k2 import (DEFAULT_SCHEME, ConversionRecord, KimiK2Config, RunSpec, compile_model, convert,
                                  load_compiled)

    root = tmp_path_factory.mktemp("kimi-k2-tiny")
    checkpoint = root / "converted"
    convert(make_tiny(root / "raw", quant="fp8"), checkpoint, DEFAULT_SCHEME, progress=False)
    # moe_prefill torch: the tiny model's hidden size is below NxD's prefill kernels'
    spec = RunSpec(tp=TP, lnc=LNC, seq_len=128, max_context_length=64, batch=2, checkpoint=str(checkpoint),
                   output_logits=True, scheme=ConversionRecord.read(checkpoint).scheme, moe_prefill="torch")
    # traces both submodels, compiles, pre-shards per rank
    compile_model(KimiK2Config.from_file(checkpoint), checkpoint, root / "compiled", spec)
    return load_compiled(root / "compiled", checkpoint), checkpoint, KimiK2Config.from_file(checkpoint)


def test_generates_from_prompts_of_two_lengths(served):
    from kimi_k2_neuron.neuron.serving import Decoding, generate_ids

    app, _, cfg = served
    rows = generate_ids(app, [[11, 12, 13, 14, 15], list(range(20, 29))], set(), Decoding(max_new_tokens=8))
    assert [len(r) for r in rows] == [8, 8]
    assert all(0 <= t < cfg.vocab_size for r in rows for t in r)


def test_prefill_logits_match_the_cpu_core(served):
    """The last prompt position's logits of the context-encoding graph (bf16 on Neuron) against the core's CPU runner
    in float32 on the same converted weights."""
    from kimi_k2_neuron.runtime.runner import CpuRunner

    app, checkpoint, cfg = served
    ids = torch.randint(0, cfg.vocab_size, (2, PREFILL), generator=torch.Generator().manual_seed(0))
    app.reset()
    out = app(input_ids=ids, attention_mask=torch.ones_like(ids, dtype=torch.int32),
              position_ids=torch.arange(PREFILL).expand(2, PREFILL), seq_ids=torch.arange(2))
    got = out.logits.reshape(2, -1, cfg.vocab_size)[:, -1].float()
    want = CpuRunner(checkpoint).logits(ids.tolist(), prefill_len=PREFILL)[:, -1]
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item()
    rel = ((got - want).abs().amax(-1) / want.abs().amax(-1)).max().item()
    print(f"prefill logits vs CPU: min cosine {cosine:.4f}, max |diff| / max |logit| {rel:.4f}")
    assert cosine >= 0.99 and rel <= 0.1


def test_decode_latency_is_reported(served, tmp_path):
    """Per-call latency of the token-generation graph (NxDI's benchmark_sampling), p50 <= p90 <= p99. Last in this
    file: benchmark_sampling leaves its latency hooks on the submodels."""
    from neuronx_distributed_inference.utils.benchmark import benchmark_sampling
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, top_k=1, eos_token_id=[], pad_token_id=0)
    report = benchmark_sampling(served[0], None, gen, target="all", num_runs=3,
                                benchmark_report_path=str(tmp_path / "benchmark.json"))
    tkg = report["token_generation_model"]
    print(f"tiny model, TP={TP}: TPOT p50 {tkg['latency_ms_p50']:.2f} ms, p99 {tkg['latency_ms_p99']:.2f} ms")
    assert 0 < tkg["latency_ms_p50"] <= tkg["latency_ms_p90"] <= tkg["latency_ms_p99"]
