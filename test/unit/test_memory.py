"""runtime/memory.py: a prompt whose attention would not fit in one prefill call is prefilled in chunks that do, in
every CPU path of the core (in memory, --layer-streamed, the --tp ranks, generate), or refused up front (the NxDI
model, whose graphs are built per bucket), decided by an estimate against the memory the process may have."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from kimi_k2_neuron.runtime import memory
from kimi_k2_neuron.tiny.transformers_oracle import hf_logits, hf_model

# Under `ulimit -v` of LIMIT, a prefill of TOKENS tokens of the tiny model (4 heads) in one call does not fit: today's
# main ended in a traceback (DefaultCPUAllocator: can't allocate memory) for the first parametrisation below.
TOKENS = 4000
LIMIT = 1700 * 2**20  # the --tp 2 ranks, which split the heads, each under TP2_LIMIT
TP2_LIMIT = 1300 * 2**20
ROW = [5 + i % 200 for i in range(TOKENS)]


def _cli(*argv: str) -> subprocess.CompletedProcess:
    limit = TP2_LIMIT if "--tp" in argv else LIMIT
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    return subprocess.run([sys.executable, "-m", "kimi_k2_neuron.cli", *argv], capture_output=True, text=True,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, hard)), timeout=600)


@pytest.fixture(scope="module")
def reference(tiny):
    """transformers' DeepseekV3ForCausalLM logits of ROW (no memory limit in this process)."""
    return hf_logits(hf_model(tiny["fp8"]), [ROW])[0]


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--layer-streamed"], ["--tp", "2"]], ids=["in-memory", "layer-streamed", "tp2"])
def test_a_prompt_too_long_for_one_call_is_prefilled_in_chunks(tiny, tmp_path, reference, flags):
    out = tmp_path / "l.safetensors"
    res = _cli("logits", "--model", str(tiny["fp8"]), "--input-ids", ",".join(map(str, ROW)), "--out", str(out),
               *flags)
    assert res.returncode == 0, res.stderr[-2000:]
    note = [line for line in res.stderr.splitlines() if line.startswith("note: a prefill of 4000 tokens")]
    assert len(note) == 1 and "--prefill-chunk N sets it" in note[0], res.stderr
    ours = load_file(out)["logits"][0]
    assert (ours - reference).abs().max() < 1e-3 * reference.abs().max()


@pytest.mark.slow
def test_generate_prefills_a_long_prompt_in_chunks(tiny, reference):
    res = _cli("generate", "--model", str(tiny["fp8"]), "--input-ids", ",".join(map(str, ROW)),
               "--max-new-tokens", "1", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "note: a prefill of 4000 tokens in one call" in res.stderr
    assert json.loads(res.stdout)["tokens"] == [[int(reference[-1].argmax())]]


def test_the_nxdi_model_refuses_a_prefill_that_cannot_fit_before_any_work(tiny, tmp_path, one_line_error):
    """NxDI's context encoding attends its whole bucket in one call; nothing can chunk it behind the user's back."""
    res = _cli("logits", "--backend", "nxdi-cpu", "--model", str(tiny["fp8"]), "--input-ids",
               ",".join(map(str, ROW)), "--out", str(tmp_path / "l"))
    one_line_error.exit(res.returncode, res.stderr, "prefill: the attention of 4000 tokens over 4000 in one call",
                        "GiB available; give --prefill-chunk")
    assert not (tmp_path / "l").exists()


def test_a_given_chunk_that_cannot_fit_is_refused_naming_one_that_does(tiny, tmp_path, one_line_error):
    res = _cli("logits", "--model", str(tiny["fp8"]), "--input-ids", ",".join(map(str, ROW)),
               "--prefill-chunk", "4000", "--out", str(tmp_path / "l"))
    line = one_line_error.exit(res.returncode, res.stderr, "--prefill-chunk 4000: a chunk's attention over a prompt "
                                                           "of 4000 tokens needs ~1.0 GiB, more than half")
    fits = int(line.rsplit("--prefill-chunk ", 1)[1].split()[0])
    assert 1 <= fits < 4000


# -- the decision, at given memory ---------------------------------------------------------------------------------

GIB = 2**30


def test_one_call_while_it_fits_in_half_the_memory():
    need = memory.attention_bytes(64, 1, 8192, 8192)  # Kimi-K2's 64 heads, an 8K prompt: 68 GiB
    assert memory.prefill_chunk(64, 1, 8192, None, available=2 * need).chunk is None
    plan = memory.prefill_chunk(64, 1, 8192, None, available=2 * need - 1)
    assert plan.chunk == 4096 and "8192 tokens in one call would take ~68.0 GiB" in plan.note


def test_the_chunk_is_the_largest_power_of_two_that_fits():
    avail = 64 * GIB  # budget 32 GiB: 17 B x 64 heads x 131072 keys = 136 MiB a query -> 240 queries -> 128
    plan = memory.prefill_chunk(64, 1, 131072, None, available=avail)
    assert plan.chunk == 128
    assert memory.attention_bytes(64, 1, 128, 131072) <= avail / 2 < memory.attention_bytes(64, 1, 256, 131072)


def test_a_given_chunk_is_kept_if_it_fits_the_same_share(one_line_error):
    need = memory.attention_bytes(4, 1, 1000, 1000)
    assert memory.prefill_chunk(4, 1, 1000, 1000, available=2 * need).chunk == 1000
    one_line_error(lambda: memory.prefill_chunk(4, 1, 1000, 1000, available=2 * need - 2),
                   "--prefill-chunk 1000", "more than half", "--prefill-chunk 512 fits")


def test_the_address_space_limit_counts_per_rank():
    """`ulimit -v` bounds each process: ranks that split the heads get that much each."""
    script = ("import resource; from kimi_k2_neuron.runtime import memory;"
              "resource.setrlimit(resource.RLIMIT_AS, (2**32, resource.getrlimit(resource.RLIMIT_AS)[1]));"
              "one, four = memory._address_space_left(), memory.available_bytes(4);"
              "print(one < 2**32, four == min(b for b in (memory._meminfo_available(), 4 * one) if b))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True"]


def test_the_runner_chunks_on_its_own_when_nobody_chose(tiny, monkeypatch):
    """CpuRunner used as a library (prefill_chunk None) takes the same decision per request."""
    from kimi_k2_neuron.runtime.runner import CpuRunner

    runner = CpuRunner(tiny["fp8"])
    seen = []
    forward = runner.forward
    monkeypatch.setattr(runner, "forward", lambda ids, *a, **k: seen.append(ids.shape[1]) or forward(ids, *a, **k))
    monkeypatch.setattr(memory, "available_bytes", lambda ranks=1: 2 * memory.attention_bytes(4, 1, 40, 100))
    out = runner.logits([ROW[:100]])
    assert seen == [32, 32, 32, 4]
    assert torch.equal(out.isfinite(), torch.ones_like(out, dtype=torch.bool))
