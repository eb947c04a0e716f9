"""The run spec travels one way, through the real NxDI on CPU: the spec a compiled folder's config is saved with
reloads equal (==) to the one that built it, every field, the draft's facts included, through NxDI's own save and
load of neuron_config.json (what compile() writes, after the application has completed the draft); a NeuronConfig
field edited beside it is named; and the rules run once per build: a flag build, a reload, a vLLM start-up (the
request vllm-neuron builds from vLLM's flags: test_vllm_serving.py counts it in vLLM's own engine)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from kimi_k2_neuron import arguments
from kimi_k2_neuron.checkpoint.draft import read_draft
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.convert import ensure_converted
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats.record import ConversionRecord
from kimi_k2_neuron.launch import run_spec
from kimi_k2_neuron.neuron import contract, rules
from kimi_k2_neuron.neuron.modeling import KimiK2InferenceConfig, KimiK2ServingRequest, NeuronKimiK2ForCausalLM
from kimi_k2_neuron.neuron.spec import RUN_SPEC_KEY, DraftSpec, RunSpec, Sampling
from kimi_k2_neuron.placement import Layout
from kimi_k2_neuron.tiny.checkpoint import make_tiny
from kimi_k2_neuron.tiny.draft_checkpoint import make_tiny_draft


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A converted tiny target of 7 layers (an EAGLE3 target) and a tiny draft for it."""
    root = tmp_path_factory.mktemp("run-spec")
    raw = make_tiny(root / "raw", quant="fp8", shards=2, seed=1, config_overrides={"num_hidden_layers": 7})
    target, record = ensure_converted(raw, "fp8-blockwise", root=root / "converted")
    return target, record, make_tiny_draft(root / "draft", raw, seed=2)


@pytest.fixture
def rules_checks(monkeypatch):
    """The specs rules.check sees, in order."""
    seen, real = [], rules.check

    def counted(cfg, spec):
        seen.append(spec)
        return real(cfg, spec)

    monkeypatch.setattr(rules, "check", counted)
    return seen


def _specs(models):
    """Every RunSpec field away from its default as far as the rules allow at the tiny shapes: one with a draft, one
    with a prefill chunk over the sequence-sharded cache (a draft takes no chunk), one with prefix caching (which
    takes neither a draft nor the sequence-sharded cache)."""
    target, record, draft = models
    cfg = KimiK2Config.from_file(target)
    base = dict(tp=2, lnc=1, seq_len=64, max_context_length=32, batch=2, scheme=record.scheme, checkpoint=str(target),
                moe_prefill="torch", dtype="float32", extra={"on_cpu": True})
    with_draft = RunSpec(**base, sampling=Sampling(global_topk=64), output_logits=True, continuous_batching=True,
                         layout=Layout(kv_group=2, shard_attn_a=True, shard_router=True), moe_decode="selective",
                         draft=DraftSpec(path=str(draft), speculation_length=3, checkpoint=read_draft(draft, cfg)))
    chunked = RunSpec(**{**base, "max_context_length": None}, sampling=Sampling(on_device=False, global_topk=8),
                      layout=Layout(kv_group=2, prefill_chunk=16, chunk_group=1), moe_decode="all-experts")
    # vLLM's prefix caching: the block layout, its pool and block size, chunks through the block table
    blocks = RunSpec(**{**base, "max_context_length": None}, continuous_batching=True, prefix_caching=True,
                     block_size=16, num_blocks=12, layout=Layout(prefill_chunk=32))
    return cfg, {"draft": with_draft, "chunk": chunked, "blocks": blocks}


@pytest.mark.parametrize("which", ["draft", "chunk", "blocks"])
def test_a_compiled_folders_spec_reloads_equal_and_meets_the_rules_once(models, tmp_path, rules_checks, which):
    cfg, specs = _specs(models)
    spec = specs[which]
    app = NeuronKimiK2ForCausalLM(str(models[0]), KimiK2InferenceConfig.for_serving(cfg, spec))  # nothing traced
    assert rules_checks == [spec]  # the flag build's one
    app.config.save(str(tmp_path))  # what compile() saves
    saved = json.loads((tmp_path / "neuron_config.json").read_text())[RUN_SPEC_KEY]
    assert saved == json.loads(json.dumps(spec.to_json()))
    rules_checks.clear()
    reloaded = KimiK2InferenceConfig.load(str(tmp_path))
    back = contract.run_spec(reloaded)
    assert back == spec and rules_checks == [spec]  # the reload's one
    assert back.draft == spec.draft and (back.draft.checkpoint if back.draft else None) == (
        spec.draft.checkpoint if spec.draft else None)
    # the NeuronConfig a reload rebuilds is the one the build made, field by field
    assert contract.differing_fields(reloaded.neuron_config, app.config.neuron_config) == []


def test_a_flag_build_meets_the_rules_once(models, rules_checks):
    """launch.run_spec from the flags, then the config: one rules.check."""
    target, _, _ = models
    p = argparse.ArgumentParser()
    arguments.add_spec_args(p)
    a = p.parse_args(["--tp", "2", "--lnc", "1", "--seq-len", "64", "--moe-prefill", "torch", "--kv-shard",
                      "sequence", "--shard-router"])
    cfg = KimiK2Config.from_file(target)
    spec = run_spec(a, cfg, ConversionRecord.of(cfg), checkpoint=str(target))
    assert spec.layout == Layout(kv_group=2, shard_router=True)
    KimiK2InferenceConfig.for_serving(cfg, spec)
    assert rules_checks == [spec]


def test_a_vllm_start_up_meets_the_rules_once(models, rules_checks):
    """The request vllm-neuron 0.2.0 builds from `--tensor-parallel-size 2 --max-num-seqs 2 --max-model-len 64
    --dtype bfloat16` (NXDI_CONTRACT.md's vllm-generic-config), as it constructs the config: the application's
    NeuronConfig class, then its config class over NxDI's load_pretrained_config."""
    from neuronx_distributed_inference.models.config import OnDeviceSamplingConfig
    from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

    from kimi_k2_neuron.neuron.vllm_plugin import register

    register()  # the entry point vLLM runs: Kimi's model_type for AutoConfig
    target, record, _ = models
    request = NeuronKimiK2ForCausalLM.get_neuron_config_cls()(
        tp_degree=2, batch_size=2, ctx_batch_size=1, seq_len=64, max_context_length=64, is_continuous_batching=True,
        torch_dtype=torch.bfloat16, quantized=False, on_cpu=True,
        on_device_sampling_config=OnDeviceSamplingConfig(dynamic=True, deterministic=False))
    assert isinstance(request, KimiK2ServingRequest)
    config = NeuronKimiK2ForCausalLM.get_config_cls()(request, load_config=load_pretrained_config(str(target)))
    assert len(rules_checks) == 1
    spec = contract.run_spec(config)
    assert (spec.tp, spec.batch, spec.seq_len, spec.continuous_batching, spec.scheme) == (2, 2, 64, True,
                                                                                          record.scheme)
    assert config.neuron_config.quantized and config.neuron_config.quantized_checkpoints_path == str(target)


def test_a_neuron_config_field_edited_beside_its_spec_is_named(models, tmp_path):
    cfg, specs = _specs(models)
    KimiK2InferenceConfig.for_serving(cfg, specs["chunk"]).save(str(tmp_path))
    path = tmp_path / "neuron_config.json"
    saved = json.loads(path.read_text())
    saved["neuron_config"]["output_logits"] = True
    path.write_text(json.dumps(saved))
    with pytest.raises(KimiInputError) as e:
        KimiK2InferenceConfig.load(str(tmp_path))
    assert str(e.value) == ("unsupported NeuronConfig settings for Kimi-K2: output_logits=True (the run spec "
                            "kimi_k2_run_spec implies False)")
