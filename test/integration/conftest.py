"""Fixtures for the trn2 tests: a compiled, loaded Kimi-K2 (full model or mini model) and its CPU golden.

Environment:
  full model (trn2.48xlarge):
    KIMI_K2_COMPILED     folder from scripts/compile_and_save.py (compile with --output-logits for the parity test)
    KIMI_K2_CHECKPOINT   converted checkpoint (default: the one recorded in the compiled folder)
    KIMI_K2_GOLDEN       .safetensors of CPU golden logits; computed (layer-streamed, hours for the 1T model) and
                         written there if the file does not exist yet (a progress bar with the ETA goes to stderr:
                         run pytest with -s to watch it)
    KIMI_K2_TPOT_MAX_MS  fail the TPOT test above this p50 decode latency (without it the TPOT is only reported)
  mini model (any Neuron instance with >= KIMI_K2_MINI_TP logical cores):
    KIMI_K2_MINI=1       make a tiny FP8 checkpoint, convert it, compile it at TP=KIMI_K2_MINI_TP (default 2),
                         batch 2, seq_len 128, in a temporary folder (LNC: KIMI_K2_MINI_LNC, else the platform's)
Without the Neuron SDK or a Neuron device every test here is skipped with the reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

PROMPT_IDS_SEED = 0


def _why_not_runnable() -> str | None:
    try:
        from kimi_k2_neuron.neuron.sdk import missing_neuron_packages
    except ImportError as e:  # the package import itself names the missing SDK packages
        return str(e)
    missing = missing_neuron_packages()
    if missing:
        return "Neuron SDK packages missing: " + ", ".join(missing)
    if not any(Path("/dev").glob("neuron*")):
        return "no Neuron device (/dev/neuron*): needs a Trainium instance"
    if not os.environ.get("KIMI_K2_COMPILED") and os.environ.get("KIMI_K2_MINI") != "1":
        return "set KIMI_K2_COMPILED (full model) or KIMI_K2_MINI=1 (mini model); see test/integration/conftest.py"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _why_not_runnable()
    if reason is None:
        return
    for item in items:
        if "integration" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=reason))


@dataclass
class Served:
    app: object  # NeuronKimiK2ForCausalLM, loaded
    cfg: object  # KimiK2Config
    checkpoint: Path
    compiled: Path
    mini: bool
    tokenizer: object | None  # None for the mini model (random weights; its prompts are token ids)


@pytest.fixture(scope="session")
def served(tmp_path_factory) -> Served:
    from kimi_k2_neuron.launch import set_fp8_env

    set_fp8_env()  # before the SDK import below
    from kimi_k2_neuron.config import KimiK2Config
    from kimi_k2_neuron.neuron.serving import load_compiled, read_compiled_record
    from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer

    if os.environ.get("KIMI_K2_MINI") == "1":
        compiled, checkpoint = _compile_mini(tmp_path_factory.mktemp("mini"))
        tokenizer = None
    else:
        compiled = Path(os.environ["KIMI_K2_COMPILED"])
        checkpoint = Path(os.environ.get("KIMI_K2_CHECKPOINT") or read_compiled_record(compiled)["checkpoint"])
        tokenizer = KimiTokenizer.from_dir(checkpoint)
    app = load_compiled(compiled, checkpoint)
    return Served(app, KimiK2Config.from_file(checkpoint), checkpoint, compiled, tokenizer is None, tokenizer)


def _compile_mini(root: Path) -> tuple[Path, Path]:
    from kimi_k2_neuron.config import KimiK2Config
    from kimi_k2_neuron.tiny.checkpoint import make_tiny
    from kimi_k2_neuron.convert import convert
    from kimi_k2_neuron.formats.record import ConversionRecord
    from kimi_k2_neuron.neuron.serving import compile_model
    from kimi_k2_neuron.neuron.spec import RunSpec

    raw = make_tiny(root / "tiny-fp8", quant="fp8")
    checkpoint = root / "tiny-neuron"
    convert(raw, checkpoint, "fp8-per-channel", progress=False)
    tp = int(os.environ.get("KIMI_K2_MINI_TP", "2"))
    lnc = int(os.environ["KIMI_K2_MINI_LNC"]) if os.environ.get("KIMI_K2_MINI_LNC") else None  # None: platform's
    # --moe-prefill torch: the tiny model's hidden size is below NxD's prefill kernels' (moe_paths)
    cfg = KimiK2Config.from_file(checkpoint)
    spec = RunSpec(tp=tp, lnc=lnc, seq_len=128, max_context_length=64, batch=2,
                   scheme=ConversionRecord.of(cfg).scheme, checkpoint=str(checkpoint), output_logits=True,
                   moe_prefill="torch")
    compile_model(cfg, checkpoint, root / "compiled", spec)
    return root / "compiled", checkpoint


@pytest.fixture(scope="session")
def golden(served):
    """(rows, CPU golden logits [B, S, V], PREFILL): prefill of the first PREFILL tokens, then teacher-forced
    decode of the rest."""
    from safetensors.torch import load_file, save_file

    from kimi_k2_neuron.runtime.runner import CpuRunner

    rows = golden_rows(served)
    path = Path(os.environ.get("KIMI_K2_GOLDEN") or served.compiled / "golden_logits.safetensors")
    if path.is_file():
        saved = load_file(str(path))
        if saved["ids"].tolist() == rows:
            return rows, saved["logits"], PREFILL
    # The converted checkpoint, read by the core (its FP8 experts dequantized exactly), so the comparison measures
    # the Neuron computation and not the conversion. Layer-streamed: one decoder layer in memory at a time. For the
    # 1T model each of the 1 + DECODE passes streams ~1 TB: the progress bar (stderr, run pytest with -s to see it)
    # counts decoder layers over all passes and shows the throughput and the ETA.
    runner = CpuRunner(served.checkpoint, dtype=torch.float32, layer_streamed=not served.mini, progress=True)
    logits = runner.logits(rows, prefill_len=PREFILL)
    save_file({"ids": torch.tensor(rows), "logits": logits.contiguous()}, str(path))
    return rows, logits, PREFILL


PREFILL = 6  # prompt tokens; the rest of each row is teacher-forced through the decode graph
DECODE = 6


def golden_rows(served) -> list[list[int]]:
    """Token ids for the parity test, one row per compiled batch row (rows differ so batch mixing would show)."""
    batch = served.app.neuron_config.max_batch_size
    if served.tokenizer is None:
        g = torch.Generator().manual_seed(PROMPT_IDS_SEED)
        return torch.randint(0, 256, (batch, PREFILL + DECODE), generator=g).tolist()
    texts = ["The capital of France is Paris, and the capital of Germany is Berlin. The capital of Italy is",
             "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +"]
    rows = [served.tokenizer.encode(t)[: PREFILL + DECODE] for t in texts]
    return (rows * batch)[:batch]
