"""neuron/vllm_request.py: vllm-neuron's request as a RunSpec (the package's one reverse mapping), what the latent
cache cannot serve refused in one line, and precompiled artifacts compared with the request as two RunSpecs."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from kimi_k2_neuron.neuron import contract, rules
from kimi_k2_neuron.neuron import vllm_request as vllm_request_
from kimi_k2_neuron.neuron.spec import DraftSpec, Sampling
from kimi_k2_neuron.placement import Layout

from specs import PER_CHANNEL, kimi_cfg, per_channel


def vllm_request(**over) -> SimpleNamespace:
    """The NeuronConfig fields vllm-neuron 0.2.0 sets from vLLM's flags (emulated; the real one, built by the plugin
    itself, is test/nxdi_cpu/test_vllm_serving.py's), for --tensor-parallel-size 64 --max-num-seqs 4
    --max-model-len 2048."""
    fields = dict(tp_degree=64, batch_size=4, ctx_batch_size=1, seq_len=2048, max_context_length=2048,
                  torch_dtype=torch.bfloat16, logical_nc_config=2, moe_ep_degree=1, is_continuous_batching=True,
                  max_batch_size=4, on_device_sampling_config=SimpleNamespace(
                      dynamic=True, do_sample=False, top_k=1, top_p=1.0, temperature=1.0, global_topk=256),
                  is_prefix_caching=False, is_block_kv_layout=False, is_chunked_prefill=False, on_cpu=False,
                  quantized=False, output_logits=False, enable_fused_speculation=False, speculation_length=0,
                  enable_eagle_speculation=False)
    return SimpleNamespace(**{**fields, **over})


def per_channel_record(scheme=PER_CHANNEL):
    from kimi_k2_neuron.formats.record import LAYOUT_VERSION, ConversionRecord

    nxd = scheme.nxd(kimi_cfg().moe_intermediate_size)
    return ConversionRecord.from_json({"layout_version": LAYOUT_VERSION, "experts": scheme.name, "nxd": nxd},
                                      "config.json")


def test_a_vllm_request_compiles_the_contracts_model_at_the_requests_shape():
    r = vllm_request_.run_spec(kimi_cfg(), vllm_request(), per_channel_record(), "/c")
    kw = contract.neuron_config_kwargs(kimi_cfg(), r)
    # the request's shape, NxDI's continuous batching as vllm-neuron runs it
    assert (kw["tp_degree"], kw["batch_size"], kw["seq_len"], kw["max_context_length"]) == (64, 4, 2048, 2048)
    assert kw["is_continuous_batching"] is True and kw["ctx_batch_size"] == 1
    assert kw["tkg_batch_size"] == kw["kv_cache_batch_size"] == 4 and kw["logical_nc_config"] == 2
    # the checkpoint's experts and the contract's model, none of which the request knows
    assert kw["quantized"] is True and kw["quantization_type"] == "expert_wise_per_channel_symmetric"
    assert kw["quantized_checkpoints_path"] == "/c" and kw["cast_type"] == "as-declared"
    assert kw["router_config"] == {"act_fn": "sigmoid", "dtype": "float32"} and kw["capacity_factor"] is None
    assert kw["on_device_sampling_config"]["dynamic"] is True and kw["save_sharded_checkpoint"] is True
    assert kw["blockwise_matmul_config"]["use_shard_on_block_dynamic_while"] is True  # the trn2 default mode


def test_a_vllm_request_records_the_decode_path_the_time_model_chooses():
    """vLLM has no flag for the token-generation MoE path: the request's spec carries the one the planner's model says
    is fastest, where NxD's threshold differs too (-0905's blockwise experts, batch 40 at 1,024 tokens: all-experts
    against NxD's selective loading, 40 x 8 < 384; compile_and_save.py --for-vllm chooses the same:
    test/nxdi_cpu/test_moe_decode.py), and all-experts under EP at a batch where NxD's own forward would raise."""
    from kimi_k2_neuron.formats.scheme import converted_scheme
    from kimi_k2_neuron.neuron.moe_paths import nxd_decode_path

    blockwise = per_channel_record(converted_scheme(kimi_cfg(), "fp8-blockwise"))
    at = dict(batch_size=40, max_batch_size=40, seq_len=1024, max_context_length=1024)
    r = vllm_request_.run_spec(kimi_cfg(), vllm_request(**at), blockwise, "/c")
    assert r.moe_decode == "all-experts" != nxd_decode_path(kimi_cfg(), 40)
    ep = vllm_request_.run_spec(kimi_cfg(), vllm_request(moe_ep_degree=4), per_channel_record(), "/c")
    assert ep.moe_decode == "all-experts" != nxd_decode_path(kimi_cfg(), 4)


@pytest.mark.parametrize("over,record,needle", [
    (dict(is_prefix_caching=True, is_block_kv_layout=True, pa_block_size=32, pa_num_blocks=65), True,
     "give --num-gpu-blocks-override, at least --max-num-seqs x --max-model-len / --block-size = 256"),
    (dict(is_chunked_prefill=True, is_block_kv_layout=True, batch_size=1), True,
     "unset DISABLE_NEURON_CUSTOM_SCHEDULER"),
    (dict(torch_dtype=torch.float16), True, "--dtype float16: Kimi-K2 runs in bfloat16"),
    (dict(), False, "/c: a raw (unconverted) checkpoint; serve the converted one: kimi-k2-neuron convert /c DST"),
    (dict(ctx_batch_size=4), True, "continuous batching with a prefill batch of 4"),
    (dict(tp_degree=3), True, "num_attention_heads=64 is not divisible by 3"),
    # the prefill kernel's 128-token tiles at Kimi's shapes: refused in vLLM's words, not a silent torch loop
    (dict(seq_len=1000, max_context_length=1000), True, "--max-model-len 1000: NxD's prefill kernel at these shapes "
     "computes whole 128-token tiles; use a multiple of 128 (1024 or 896)"),
])
def test_what_a_vllm_request_cannot_get_is_refused_in_one_line(over, record, needle, one_line_error):
    one_line_error(lambda: rules.check(kimi_cfg(), vllm_request_.run_spec(
        kimi_cfg(), vllm_request(**over), per_channel_record() if record else None, "/c")), needle)


# what compile_and_save.py --for-vllm --batch 4 --seq-len 1024 saves
COMPILED = vllm_request_.for_vllm(per_channel(tp=64, batch=4, seq_len=1024, continuous_batching=True))


@pytest.mark.parametrize("request_over,compiled_over,needle", [
    (dict(batch_size=2, max_batch_size=2, seq_len=512, max_context_length=512), {}, None),  # less: NxDI pads
    (dict(batch_size=4, seq_len=1024, max_context_length=1024), {}, None),
    (dict(batch_size=8, max_batch_size=8, seq_len=1024, max_context_length=1024), {},
     "--max-num-seqs 8 > the compiled batch 4"),
    (dict(seq_len=2048, max_context_length=2048), {}, "--max-model-len 2048 > the compiled seq_len 1024"),
    (dict(seq_len=1024, max_context_length=1024), dict(max_context_length=256),
     "prompts that long need a prefill of 1024 tokens, compiled for 256"),
    (dict(tp_degree=32, seq_len=1024, max_context_length=1024), {}, "--tensor-parallel-size 32, compiled for TP 64"),
    (dict(seq_len=1024, max_context_length=1024), dict(continuous_batching=False),
     "runs NxDI's continuous batching, compiled without it (a prefill batch of 4)"),
    (dict(seq_len=1024, max_context_length=1024), dict(sampling=Sampling(on_device=False)),
     "compiled to return logits"),
])
def test_precompiled_artifacts_serve_a_request_up_to_their_compiled_shape(request_over, compiled_over, needle):
    """Two RunSpecs: the request's and the one the artifacts were compiled from (as saved with them)."""
    r = vllm_request_.run_spec(kimi_cfg(), vllm_request(**request_over), per_channel_record(), "/c")
    bad = vllm_request_.compiled_mismatches(r, dataclasses.replace(COMPILED, **compiled_over))
    assert bad == [] if needle is None else (len(bad) == 1 and needle in bad[0]), bad


# -- replies held to a grammar (neuron/vllm_worker.py) -----------------------------------------------------------------

def test_a_vllm_request_returns_the_logits_a_grammar_masks_beside_the_devices_tokens():
    """With on-device sampling the served model returns the logits too (output_logits), for the steps a grammar
    constrains (neuron/vllm_worker.py); sampling on the host they are the output already; not with speculation."""
    on_device = vllm_request_.run_spec(kimi_cfg(), vllm_request(), per_channel_record(), "/c")
    assert on_device.output_logits and contract.neuron_config_kwargs(kimi_cfg(), on_device)["output_logits"]
    assert vllm_request_.unconstrained_why(on_device) is None
    host = vllm_request_.run_spec(kimi_cfg(), vllm_request(on_device_sampling_config=None), per_channel_record(),
                                  "/c")
    assert not contract.neuron_config_kwargs(kimi_cfg(), host)["output_logits"]  # lm_head gathers them already
    assert vllm_request_.unconstrained_why(host) is None
    drafted = vllm_request_.for_vllm(per_channel(tp=64, draft=DraftSpec(path="/d")))
    assert not drafted.output_logits
    assert "speculative decoding" in vllm_request_.unconstrained_why(drafted)
    assert "returns no logits to mask" in vllm_request_.unconstrained_why(per_channel(tp=64))


@pytest.mark.parametrize("compiled_over,needle", [
    (dict(output_logits=False), "compiled without the logits beside the device's tokens (output_logits)"),
    (dict(sampling=Sampling(on_device=False)), "served with --additional-config '{\"override_neuron_config\": "
                                               "{\"on_device_sampling_config\": null}}'"),
])
def test_precompiled_artifacts_serve_the_grammars_sampling_placement(compiled_over, needle):
    """compile_and_save.py --for-vllm compiles output_logits (for_vllm); a folder without them cannot hand a grammar
    its logits; one compiled for host sampling is served as such, and only so."""
    compiled = COMPILED
    r = vllm_request_.run_spec(kimi_cfg(), vllm_request(seq_len=1024, max_context_length=1024), per_channel_record(),
                               "/c")
    assert vllm_request_.compiled_mismatches(r, compiled) == []
    bad = vllm_request_.compiled_mismatches(r, dataclasses.replace(compiled, **compiled_over))
    assert len(bad) == 1 and needle in bad[0], bad
    host = vllm_request_.run_spec(kimi_cfg(), vllm_request(seq_len=1024, max_context_length=1024,
                                                           on_device_sampling_config=None), per_channel_record(), "/c")
    assert vllm_request_.compiled_mismatches(host, dataclasses.replace(compiled, sampling=Sampling(on_device=False),
                                                                       output_logits=False)) == []
    assert "the request samples on the host" in vllm_request_.compiled_mismatches(host, compiled)[0]


def serve_config(**over) -> SimpleNamespace:
    """What grammar_refusal reads of a `vllm serve`'s VllmConfig."""
    fields = dict(parallel_config=SimpleNamespace(worker_cls=vllm_request_.WORKER_CLS),
                  structured_outputs_config=SimpleNamespace(backend="xgrammar"), speculative_config=None)
    return SimpleNamespace(**{**fields, **over})


def test_a_server_holds_replies_to_grammars_only_as_configured(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.1.29")
    assert vllm_request_.grammar_refusal(serve_config()) is None
    why = vllm_request_.grammar_refusal(serve_config(parallel_config=SimpleNamespace(
        worker_cls="vllm_neuron.worker.neuron_worker.NeuronWorker")))
    assert why == f"vllm-neuron's own worker applies no grammar; serve with --worker-cls {vllm_request_.WORKER_CLS}"
    why = vllm_request_.grammar_refusal(serve_config(structured_outputs_config=SimpleNamespace(backend="auto")))
    assert why.startswith("structured-output backend 'auto': serve with --structured-outputs-config")
    assert vllm_request_.grammar_refusal(serve_config(speculative_config=object())).startswith("speculative")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.1.27")  # vLLM 0.13's pin
    assert "xgrammar 0.1.27 reads Kimi's tokenizer as raw text (xgrammar #483); pip install 'xgrammar>=0.1.29'" == \
        vllm_request_.grammar_refusal(serve_config())


# -- --enable-prefix-caching: NxDI's block layout at vLLM's pool ----------------------------------------------------

# what vllm-neuron sets for --enable-prefix-caching --block-size 32 --num-gpu-blocks-override 256 (its null block
# counted into pa_num_blocks: NXDI_CONTRACT.md: vllm-block-pool)
CACHING = dict(is_prefix_caching=True, is_block_kv_layout=True, pa_block_size=32, pa_num_blocks=257)


def test_vllms_prefix_caching_request_is_the_block_layout_at_its_pool():
    r = vllm_request_.run_spec(kimi_cfg(), vllm_request(**CACHING), per_channel_record(), "/c")
    assert (r.prefix_caching, r.block_size, r.pool_blocks) == (True, 32, 256)
    rules.check(kimi_cfg(), r)
    assert contract.neuron_config_kwargs(kimi_cfg(), r)["pa_num_blocks"] == 257
    assert vllm_request_.describe(vllm_request(**CACHING)).endswith(
        "--enable-prefix-caching --block-size 32 --num-gpu-blocks-override 256")
    assert vllm_request_.cache_flags(r) == ["--enable-prefix-caching", "--block-size", "32",
                                            "--num-gpu-blocks-override", "256", "--enable-prompt-tokens-details"]
    assert vllm_request_.cache_flags(per_channel(batch=3)) == ["--no-enable-prefix-caching",
                                                               "--num-gpu-blocks-override", "3"]


@pytest.mark.parametrize("over,needle", [
    (dict(pa_num_blocks=128), "--enable-prefix-caching: give --num-gpu-blocks-override, at least --max-num-seqs x "
                              "--max-model-len / --block-size = 256"),
    (dict(is_prefix_caching=False), "a block KV layout without prefix caching"),
])
def test_what_vllms_prefix_caching_request_cannot_get_is_refused_in_one_line(over, needle, one_line_error):
    one_line_error(lambda: vllm_request_.run_spec(kimi_cfg(), vllm_request(**{**CACHING, **over}),
                                                  per_channel_record(), "/c"), needle)


# what compile_and_save.py --for-vllm --prefix-caching --batch 4 --seq-len 2048 --num-blocks 256 saves
CACHED = vllm_request_.for_vllm(per_channel(tp=64, batch=4, seq_len=2048, prefix_caching=True, num_blocks=256))


@pytest.mark.parametrize("request_over,compiled_over,needle", [
    ({}, {}, None),
    ({}, dict(layout=Layout(prefill_chunk=512)), None),  # the chunks prefill a longer prompt
    (dict(pa_num_blocks=201, batch_size=2, max_batch_size=2), {}, None),  # a smaller pool: vLLM's ids stay inside
    ({}, dict(prefix_caching=False, num_blocks=None, continuous_batching=True),
     "--enable-prefix-caching, compiled without the block KV layout"),
    (dict(is_prefix_caching=False, is_block_kv_layout=False), {}, "compiled with --prefix-caching (the block KV "
                                                                  "layout, --block-size 32), served without"),
    (dict(pa_block_size=16, pa_num_blocks=257, batch_size=2, max_batch_size=2), {},
     "--block-size 16, compiled for 32"),
    (dict(pa_num_blocks=301), {}, "--num-gpu-blocks-override 300 > the compiled pool of 256 blocks"),
])
def test_a_precompiled_folder_serves_prefix_caching_only_with_its_blocks(request_over, compiled_over, needle):
    r = vllm_request_.run_spec(kimi_cfg(), vllm_request(**{**CACHING, "seq_len": 2048, "max_context_length": 2048,
                                                           **request_over}), per_channel_record(), "/c")
    bad = vllm_request_.compiled_mismatches(r, dataclasses.replace(CACHED, **compiled_over))
    assert bad == [] if needle is None else (len(bad) == 1 and needle in bad[0]), bad
