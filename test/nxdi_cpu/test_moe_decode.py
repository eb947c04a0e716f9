"""The token-generation MoE path the shell runs (--moe-decode, RunSpec.moe_decode), through the real NxD in CPU mode
at TP=2: nxd_moe.KimiExpertMLPs calls NxD's public forward_selective_loading or forward_all_experts where NxD's own
forward picks by its threshold (NXDI_CONTRACT.md: moe-decode). Each path gives the other's greedy tokens, and its
logits within float32 rounding: the two paths sum the same expert outputs in another order (selective loading its
top-k, all-experts every expert, the unchosen at affinity 0), so the margins of the greedy picks are held to many
times that difference, and equality is not a lucky seed. Where the planner's model departs from NxD's threshold,
compile_and_save.py --dry-run saves the model's path; the all-experts path at Kimi's real per-rank shapes is
test_real_shapes.py's. NxD's EP decode (forward_all_experts_EP) does not run in CPU mode (NXD_CPU_MODE.md:
cpu-mode-limits): trn2 runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from nxdi_support import REPO, cpu_options, rel_err

from kimi_k2_neuron.neuron import contract, moe_decode
from kimi_k2_neuron.neuron.spec import RUN_SPEC_KEY
from kimi_k2_neuron.nxdi_cpu import backend

pytestmark = pytest.mark.fp8_selective_cpu

# four ragged rows of the tiny model (8 experts, top 3): NxD's threshold takes all-experts at batch 4 (4 x 3 >= 8)
ROWS = [[5, 17, 300, 42, 256, 9], [400, 3, 3], [72, 101, 108, 108, 111], [1, 2]]
NEW_TOKENS = 6


def _generate_then_score(rank: int, o, rows, new_tokens):
    """Greedy tokens of `rows` (on-device sampling off: the host's argmax of NxDI's logits), then the teacher-forced
    logits of each row followed by its tokens, prefilled to its prompt and decoded one token a step; the MoE paths
    taken."""
    from kimi_k2_neuron.neuron.serving import Decoding, generate_ids
    from kimi_k2_neuron.neuron.spec import GREEDY

    seq_len = max(map(len, rows)) + new_tokens
    app = backend.build(o, seq_len=seq_len, batch=len(rows))
    paths = backend.MoEPaths(app)
    out = generate_ids(app, rows, set(), Decoding(new_tokens, GREEDY, ()))
    full = [r + g for r, g in zip(rows, out)]
    logits = backend.teacher_forced_logits(app, full, [len(r) for r in rows])
    return out, logits, paths.report()


@pytest.fixture(scope="module")
def runs(converted):
    model = converted[("fp8", "fp8-blockwise")]
    got = {}
    for path in ("selective", "all-experts"):
        o = backend.prepare(cpu_options(model=str(model), tp=2, moe_decode=path), 16, len(ROWS))
        got[path] = backend.run(o, _generate_then_score, ROWS, NEW_TOKENS)
    return got


def test_each_path_is_the_one_nxd_ran(runs):
    for path, (_, _, report) in runs.items():
        assert f"token_generation_model: {path}" in report, report


def test_the_paths_give_the_same_greedy_tokens_and_logits_within_float32_rounding(runs):
    (sel_tokens, sel, _), (all_tokens, every, _) = runs["selective"], runs["all-experts"]
    assert sel_tokens == all_tokens
    decoded = [slice(len(r), len(r) + NEW_TOKENS) for r in ROWS]
    diff = max(float((sel[i, s] - every[i, s]).abs().max()) for i, s in enumerate(decoded))
    assert max(rel_err(sel[i, s], every[i, s]) for i, s in enumerate(decoded)) < 1e-5
    for i, s in enumerate(decoded):  # each greedy pick (the logits before it) won by far more than the paths differ
        picks = sel[i, s.start - 1:s.stop - 1]
        top2 = picks.topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 100 * diff, (i, diff)


def test_nxds_own_threshold_runs_where_no_path_is_given(converted):
    """On CPU (no trn2 time model) the shell leaves NxD its own choice: selective loading at batch 2 (2 x 3 < 8)."""
    o = backend.prepare(cpu_options(model=str(converted[("fp8", "fp8-blockwise")]), tp=1), 8, 2)
    app = backend.build(o, 8, 2)
    spec = contract.run_spec(app.config)
    assert spec.moe_decode is None and moe_decode.choose(app.config.core_config(), spec) == "selective"
    experts = [m for w in app.models for m in w.model.modules() if type(m).__name__ == "KimiExpertMLPs"]
    assert experts and {m.decode_path for m in experts} == {"selective"}


def test_compile_dry_run_saves_the_planners_path_where_nxds_threshold_differs(tiny, tmp_path, env):
    """Kimi-K2-Instruct-0905 at TP=64, --for-vllm (one sequence a prefill), batch 40: the planner's model has
    all-experts faster (every expert read once against 40 x 8 selective loads and the per-token loop), where NxD's
    threshold (40 x 8 < 384) takes selective loading; the dry run prints the choice with both times and saves it.
    (The folder: Kimi's config.json beside the tiny checkpoint's tokenizer files, which --for-vllm's printed vllm
    serve command reads.)"""
    model = tmp_path / "k2"
    model.mkdir()
    for f in tiny["fp8"].iterdir():
        if not f.name.endswith(".safetensors") and f.name not in ("config.json", "model.safetensors.index.json"):
            (model / f.name).write_bytes(f.read_bytes())
    (model / "config.json").write_text((REPO / "test/data/configs/kimi-k2-instruct-0905.json").read_text())
    r = subprocess.run([sys.executable, str(REPO / "scripts/compile_and_save.py"), "--model", str(model), "--out",
                        str(tmp_path / "out"), "--tp", "64", "--batch", "40", "--for-vllm", "--dry-run"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got[RUN_SPEC_KEY]["moe_decode"] == "all-experts" == got["moe_paths"]["token_generation"]["path"]
    assert got["plan"]["decode_path"] == "all-experts" and got["plan"]["decode"]["flops_ms"] > 0
    why = got["moe_decode_choice"]
    assert why.startswith("all-experts, the planner's choice") and "NxD's own threshold would take selective" in why
    r = subprocess.run([sys.executable, str(REPO / "scripts/compile_and_save.py"), "--model", str(model), "--out",
                        str(tmp_path / "out"), "--tp", "64", "--batch", "40", "--for-vllm", "--moe-decode",
                        "selective", "--dry-run"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)[RUN_SPEC_KEY]["moe_decode"] == "selective"


def test_a_reload_runs_the_saved_path(converted, tmp_path):
    """NxDI's save and load keep the run spec, its moe_decode with it: the reloaded config builds the same path."""
    from kimi_k2_neuron.neuron.modeling import KimiK2InferenceConfig

    o = backend.prepare(cpu_options(model=str(converted[("fp8", "fp8-blockwise")]), moe_decode="all-experts"), 8, 2)
    app = backend.application(o, 8, 2)
    app.config.save(str(tmp_path))
    again = KimiK2InferenceConfig.load(str(tmp_path))
    assert contract.run_spec(again).moe_decode == "all-experts"
