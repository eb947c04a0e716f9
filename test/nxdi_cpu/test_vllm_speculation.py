"""Speculative decoding through vLLM (issue 29): vLLM 0.13's `--speculative-config '{"method": "eagle", "model":
DRAFT, "num_speculative_tokens": 4}'` -> vllm-neuron 0.2.0's fused-speculation request (enable_fused_speculation,
enable_eagle_speculation, speculation_length 4), its draft config built with our config class and its
FusedSpecNeuronConfig without a draft class (NXDI_CONTRACT.md: vllm-spec-config) -> our model's own fused EAGLE3
speculation (neuron/fused_spec.py) in NxD's CPU mode, on a tiny 7-layer converted checkpoint and the tiny Llama
drafts (full vocabulary; reduced with d2t).
vLLM runs in child processes (vllm_support.py; test_vllm_serving.py has the rest of the serving tier); NxD's
device-only Argmax is stood in (scripts/nxdi_cpu_tier/device_ops.py).

Reference, exact: the same fused graphs driven outside vLLM by `generate --backend nxdi-cpu --draft`'s loop, bfloat16
at TP=1, the cache exactly vLLM's max_model_len long, one sequence per prefill as vLLM's requests make it: the verify's
own MoE path and rounding, so any machine gives both the same tokens. Not the tokens without a draft: in bfloat16 the
verify's K tokens take NxD's all-experts MoE path and decode the selective one, the same math rounded in another
order, and where two router scores tie within that rounding the two pick different experts, after which the outputs
differ by more than any tolerance on the logits bounds (seen on CPU: 2 of 4 random tiny checkpoints within 8 tokens,
seed 1 among them, which this module uses on purpose). That speculation gives the target's own greedy tokens is
checked where it is exact: float32, test_speculation.py, for every draft layout.

Not here: the MLA drafts (vLLM 0.13's registry has no Eagle3DeepseekV2ForCausalLM: VLLM_LAYOUTS), the precompiled
branch with a draft (compile_and_save --for-vllm --draft writes it; its request checks are unit-tested), TP > 1
through vLLM, sampled outputs (the fused step's sampling branch does not run on CPU).
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (bash ../shared/nxdi-cpu/vllm/setup.sh VENV adds it)")
pytest.importorskip("vllm_neuron", reason="vllm-neuron is not installed here (../shared/nxdi-cpu/vllm/setup.sh)")

import vllm_support as vs  # noqa: E402
from nxdi_support import cpu_options, stand_in_device_ops, with_device_ops  # noqa: E402
from test_vllm_serving import BATCH, MAX_MODEL_LEN, MAX_TOKENS, PROMPTS, llm_args, llm_env, run_child  # noqa: E402

from kimi_k2_neuron.checkpoint.draft import read_draft  # noqa: E402
from kimi_k2_neuron.config import KimiK2Config  # noqa: E402
from kimi_k2_neuron.convert import convert  # noqa: E402
from kimi_k2_neuron.neuron.spec import DraftSpec  # noqa: E402
from kimi_k2_neuron.nxdi_cpu import backend  # noqa: E402
from kimi_k2_neuron.tiny import DRAFT_LAYOUTS  # noqa: E402
from kimi_k2_neuron.tiny.checkpoint import make_tiny  # noqa: E402
from kimi_k2_neuron.tiny.draft_checkpoint import make_tiny_draft  # noqa: E402

K = 4
# The layouts vLLM 0.13 takes: its model registry has no MLA EAGLE3 draft (Eagle3DeepseekV2ForCausalLM), which it
# refuses when it builds the draft's ModelConfig, before vllm-neuron or this plugin sees the request
VLLM_LAYOUTS = tuple(layout for layout in DRAFT_LAYOUTS if "mla" not in layout)
pytestmark = pytest.mark.fp8_selective_cpu


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A converted 7-layer tiny target (vLLM serves converted checkpoints) and a tiny draft of each layout vLLM
    takes."""
    root = tmp_path_factory.mktemp("vllm-speculation")
    # seed 1: in bfloat16 a router near-tie flips an expert between the verify and decode within 8 tokens (the module
    # docstring): the reference must not depend on there being none
    raw = make_tiny(root / "raw", quant="fp8", shards=2, seed=1, config_overrides={"num_hidden_layers": 7})
    convert(raw, root / "target", "fp8-blockwise", progress=False)
    return root / "target", {layout: make_tiny_draft(root / layout, root / "target", seed=4, layout=layout)
                             for layout in VLLM_LAYOUTS}


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    return vs.write_dists(tmp_path_factory.mktemp("dists"))


def speculative(draft) -> dict:
    return {"method": "eagle", "model": str(draft), "num_speculative_tokens": K}


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
def test_llm_api_with_a_speculative_config_gives_the_fused_graphs_greedy_tokens(layout, models, dists, tmp_path):
    """The plugin's compile branch with a draft: the fused model built from vLLM's request (compile() skipped),
    prefilled one sequence per call, then fused steps for both rows: the tokens the same fused graphs give outside
    vLLM (the module docstring)."""
    target, draft = models[0], models[1][layout]
    stand_in_device_ops()
    spec = DraftSpec(path=str(draft), speculation_length=K,
                     checkpoint=read_draft(draft, KimiK2Config.from_file(target)))
    new = MAX_MODEL_LEN - max(map(len, PROMPTS)) - K  # our cache: max_model_len positions, as vLLM's
    o = cpu_options(model=str(target), dtype="bfloat16", draft=spec, continuous_batching=True)
    want, _ = backend.generate(o, backend.Generation(rows=PROMPTS, stop_ids=(), max_new_tokens=new))
    want = [row[:MAX_TOKENS] for row in want]
    env, events = llm_env(dists, tmp_path)
    r, tokens = run_child("llm", {**llm_args(target), "speculative_config": speculative(draft)}, with_device_ops(env),
                          tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    assert tokens == want
    load = next(e for e in vs.events(events) if e["event"] == "load")
    assert load["draft"] == str(draft)  # the fused model served it


def test_a_draft_the_target_cannot_take_is_refused_in_one_line_at_startup(models, dists, tmp_path):
    """vllm-neuron builds the draft's config with our config class: a draft of another hidden size is refused there,
    in one line naming the draft's field, before the application is constructed."""
    target, draft = models[0], models[1]["eagle3"]
    bad = tmp_path / "bad-draft"
    shutil.copytree(draft, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_size": config["hidden_size"] * 2}))
    case = {"name": "hidden", "model": str(target), "engine": {"speculative_config": speculative(bad),
                                                                "max_model_len": MAX_MODEL_LEN,
                                                                "max_num_seqs": BATCH}}
    env = vs.child_env(dists, KIMI_K2_VLLM_EVENTS=tmp_path / "events.jsonl")
    r, results = run_child("refusals", {"cases": [case]}, env, tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    got = results[0]
    assert got["error"] == "KimiInputError", got
    assert f"--speculative-config model {bad}" in got["message"] and "hidden_size=" in got["message"], got
    assert "\n" not in got["message"] and got["events"] == []
