"""neuron/spec.py: the RunSpec saved as JSON reads back equal, field by field, the draft's facts included; a saved
spec that is not one is refused in one line naming the field; the flags are the spec's fields, with its defaults. The
spec as a real compiled folder saves it (NxDI's save and load): test/nxdi_cpu/test_run_spec.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from pathlib import Path

import pytest

from kimi_k2_neuron import arguments
from kimi_k2_neuron.checkpoint.draft import MLA, Eagle3Draft, MlaDims
from kimi_k2_neuron.formats.scheme import ExpertScheme
from kimi_k2_neuron.launch import run_spec
from kimi_k2_neuron.neuron import spec as spec_module
from kimi_k2_neuron.neuron.spec import FLAGS, DraftSpec, RunSpec, Sampling
from kimi_k2_neuron.placement import Layout

FACTS = Eagle3Draft(path="/d", hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, vocab_size=512, rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=4096,
                    has_embedding=False, kind=MLA, draft_vocab_size=128, mla=MlaDims(24, 16, 8, 8, 8), fc_norm=True,
                    norm_output=True, aux_convention="output", mapped=True, raw={"x": 1},
                    stored={"fc.weight": "midlayer.fc.weight"})
# every field away from its default, nested ones too
EVERY_FIELD = RunSpec(
    tp=64, ep=4, lnc=1, seq_len=4096, max_context_length=2048, batch=48,
    scheme=ExpertScheme("fp8-blockwise", (32, 32)), checkpoint="/c",
    sampling=Sampling(on_device=False, do_sample=True, top_k=5, top_p=0.5, temperature=0.7, global_topk=64),
    output_logits=True, moe_prefill="torch", moe_decode="all-experts", continuous_batching=True,
    layout=Layout(kv_group=16, prefill_chunk=1024, shard_attn_a=True, shard_router=True, chunk_group=4),
    draft=DraftSpec(path="/d", speculation_length=6, checkpoint=FACTS), dtype="float32",
    prefix_caching=True, block_size=16, num_blocks=300, extra={"on_cpu": True})


def _leaves(obj, prefix=""):
    """(dotted field name, value) of every field, nested dataclasses walked."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def test_every_field_is_away_from_its_default():
    """So the round trip below checks every field (a new field without a value here fails this test)."""
    default = dict(_leaves(RunSpec(draft=DraftSpec(path=None, checkpoint=None))))
    same = [name for name, value in _leaves(EVERY_FIELD) if name in default and default[name] == value]
    assert same == []


def test_the_spec_reads_back_equal_through_json_field_by_field():
    saved = json.loads(json.dumps(EVERY_FIELD.to_json()))  # as NxDI writes and reads neuron_config.json
    back = RunSpec.from_json(saved)
    assert back == EVERY_FIELD
    assert dict(_leaves(back)) == {k: v for k, v in _leaves(EVERY_FIELD) if not k.endswith((".raw", ".stored"))} | {
        "draft.checkpoint.raw": {}, "draft.checkpoint.stored": {}}  # what the draft folder holds is read again
    assert RunSpec.from_json(RunSpec().to_json()) == RunSpec()


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d.update(tp="64"), "kimi_k2_run_spec.tp: expected an integer, got '64'"),
    (lambda d: d.update(tp=True), "kimi_k2_run_spec.tp: expected an integer, got True"),
    (lambda d: d.update(shard_heads=True), "kimi_k2_run_spec: expected an object with fields among"),
    (lambda d: d["layout"].update(kv_group=4, chunk_group=3),
     "kimi_k2_run_spec.layout.chunk_group 3: must be an integer dividing the KV group 4"),
    (lambda d: d["scheme"].update(block=[32]), "kimi_k2_run_spec.scheme.block: expected a list of 2, got [32]"),
    (lambda d: d.update(draft=[]), "kimi_k2_run_spec.draft: expected an object with fields among"),
    (lambda d: d.update(extra=[]), "kimi_k2_run_spec.extra: expected an object, got []"),
])
def test_a_saved_spec_that_is_not_one_is_refused_naming_its_field(edit, needle, one_line_error):
    saved = json.loads(json.dumps(EVERY_FIELD.to_json()))
    edit(saved)
    one_line_error(lambda: RunSpec.from_json(saved), needle)


def test_each_flag_sets_a_spec_field_and_defaults_to_the_specs_own():
    hints = typing.get_type_hints(RunSpec)
    for flag in FLAGS:
        if flag.field is None:
            continue
        head = flag.field.split(".")[0]
        assert head in hints, flag.name
        if flag.kind == "switch":
            assert flag.spec_default is False, flag.name
    p = argparse.ArgumentParser()
    arguments.add_spec_args(p)
    a = p.parse_args([])
    assert (a.tp, a.seq_len, a.batch, a.moe_prefill, a.global_topk) == (1, 1024, 1, None, 256)
    assert run_spec(a) == RunSpec()  # nothing given: the spec's own defaults
    # the defaults the parser shows without holding them (not given differs from given as the default)
    helps = {action.dest: action.help for action in p._actions}
    assert helps["speculation_length"].endswith("(default: 4)") and a.speculation_length is None


def test_no_moe_prefill_is_the_kernels_mode_where_it_runs_the_shapes(tiny):
    """Without --moe-prefill a flag build takes RunSpec.prefill_mode's choice: the kernel's at Kimi's shapes, torch
    at a tiny model's (whose hidden size no kernel takes), never a refusal of a flag the user did not give."""
    from kimi_k2_neuron.config import KimiK2Config

    p = argparse.ArgumentParser()
    arguments.add_spec_args(p)
    kimi = KimiK2Config.from_file(Path(__file__).parents[1] / "data" / "configs" / "kimi-k2-instruct-0905.json")
    assert run_spec(p.parse_args(["--tp", "64"]), kimi).moe_prefill == "shard-on-block"
    assert run_spec(p.parse_args(["--tp", "2"]), KimiK2Config.from_file(tiny["fp8"])).moe_prefill == "torch"
    assert run_spec(p.parse_args(["--tp", "64", "--moe-prefill", "torch"]), kimi).moe_prefill == "torch"


def test_a_new_field_is_one_flag_entry_and_its_use(monkeypatch):
    """The mechanism a new setting takes: a Flag in spec.FLAGS naming its field; the parser and run_spec follow."""
    extra = spec_module.Flag("--output-logits-too", "output_logits", "sampler", "the same field, another name",
                             kind="switch")
    monkeypatch.setattr(spec_module, "FLAGS", (*FLAGS, extra))
    p = argparse.ArgumentParser()
    arguments.add_spec_args(p, "sampler")
    assert run_spec(p.parse_args(["--output-logits-too"])).output_logits is True


def test_a_flag_a_backend_does_not_take_is_refused_naming_where_it_is(one_line_error):
    where = {spec_module.CORE: "--backend core", spec_module.CPU: "--backend nxdi-cpu"}
    p = argparse.ArgumentParser()
    arguments.add_spec_args(p, where=where)
    args = p.parse_args(["--tp", "2", "--kv-shard", "none"])
    arguments.check_spec_flags(args, spec_module.CPU, where)
    one_line_error(lambda: arguments.check_spec_flags(args, spec_module.CORE, where),
                   "--tp 2: only with --backend nxdi-cpu (the core runner generates in one process")
    # --kv-shard none asks for what the core runner does anyway; a compiled folder's settings are unknown: strict
    arguments.check_spec_flags(p.parse_args(["--kv-shard", "none"]), spec_module.CORE, where)
    one_line_error(lambda: arguments.check_spec_flags(p.parse_args(["--kv-shard", "none"]), "compiled",
                                                      {spec_module.CPU: "--cpu"}, "its own", strict=True),
                   "--kv-shard none: only with --cpu (its own)")
