"""The grammars a reply is held to, on xgrammar alone (no engine): the tiny checkpoints' slow tokenizer (Kimi's kind)
read as byte-level text, the host's mask (runtime/grammar_mask.py) against xgrammar's own masking, the forced tool
calls' grammars (runtime/tool_grammar.py) and the middleware's json_object accepting what Kimi's API means and nothing
else, and a random "model" (random logits) held to each of structured_cases.py's 50 schemas and to the tool grammars:
every reply parses and validates. Through vLLM's server: test_vllm_structured*.py. Needs xgrammar 0.1.29 or later
(scripts/build_nxdi_cpu_tier.sh installs it; vLLM 0.13 pins 0.1.27, which reads Kimi's tokenizer as raw text).
"""

from __future__ import annotations

import importlib.metadata
import json
import sys

import pytest
import torch

xgr = pytest.importorskip("xgrammar", reason="xgrammar is not installed here (scripts/build_nxdi_cpu_tier.sh)")

import structured_cases as cases  # noqa: E402
from kimi_slow_tokenizer import write_slow_tokenizer  # noqa: E402

from kimi_k2_neuron.neuron.vllm_request import XGRAMMAR_MIN  # noqa: E402
from kimi_k2_neuron.runtime import grammar_mask, tool_calls, tool_grammar  # noqa: E402
from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer  # noqa: E402
from kimi_k2_neuron.tiny.tokenizer_files import CHAT_TEMPLATES, write_tiny_tokenizer  # noqa: E402

VERSION = importlib.metadata.version("xgrammar")
if tuple(int(p) for p in VERSION.split(".")[:3]) < XGRAMMAR_MIN:
    pytest.skip(f"xgrammar {VERSION} reads Kimi's tokenizer as raw text; rebuild the tier "
                f"(scripts/build_nxdi_cpu_tier.sh installs 0.1.29)", allow_module_level=True)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(the slow transformers tokenizer vLLM serves, KimiTokenizer) over the tiny K2.6 tokenizer files."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(root / "k2.6", chat_template=CHAT_TEMPLATES["k2.6"])
    slow = write_slow_tokenizer(root / "k2.6", root / "slow")
    sys.path.insert(0, str(slow))
    return AutoTokenizer.from_pretrained(str(slow), trust_remote_code=True), KimiTokenizer.from_dir(root / "k2.6")


@pytest.fixture(scope="module")
def compiler(tokenizers):
    """xgrammar's compiler as vLLM 0.13's backend builds it (TokenizerInfo.from_huggingface at the model's vocab)."""
    hf, kimi = tokenizers
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=kimi.vocab_size)
    return xgr.GrammarCompiler(info), info


def test_xgrammar_reads_kimis_tokenizer_as_byte_level_text(compiler, tokenizers):
    """Kimi's tokenizer spells each token's bytes in GPT-2's alphabet (' ' is 'Ġ'); xgrammar from 0.1.29 decodes
    them (xgrammar #484), and its one stop token is the tokenizer's eos."""
    _, info = compiler
    _, kimi = tokenizers
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL and info.stop_token_ids == [kimi.eos_id]
    assert info.decoded_vocab[kimi.encode(" ")[0]] == b" " and info.decoded_vocab[kimi.encode("\n")[0]] == b"\n"
    marker = kimi.token_to_id("<|tool_call_begin|>")
    assert info.decoded_vocab[marker] == b"<|tool_call_begin|>"  # a marker is text to it


def test_unpacked_masks_are_xgrammars_own(compiler, tokenizers):
    """xgrammar's apply_token_bitmask_inplace and ours give -inf at the same places."""
    _, info = compiler
    words = -(-info.vocab_size // 32)
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, words), dtype=torch.int32, generator=generator)
    logits = torch.randn(4, info.vocab_size)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask)
    ours = logits.masked_fill(~grammar_mask.unpack(bitmask, info.vocab_size), float("-inf"))
    assert torch.equal(torch.isinf(theirs), torch.isinf(ours)) and torch.equal(theirs, ours)


def accepts(compiled, ids: list[int]) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return all(matcher.accept_token(t) for t in ids) and matcher.is_terminated()


def test_forced_calls_and_json_object_accept_what_they_mean_and_nothing_else(compiler, tokenizers):
    """required: whole calls, `functions.NAME:IDX` counting on from the conversation's calls, then the section's end
    and the end of the reply (arguments with any whitespace: a structural tag's JSON Schema takes no whitespace
    option in xgrammar 0.1.29); named: the function's parameters; json_object (vLLM's {"type": "object"}): any
    object."""
    comp, _ = compiler
    _, kimi = tokenizers
    end = [kimi.eos_id]

    def ids(text: str) -> list[int]:
        return kimi.encode(text) + end

    required = comp.compile_structural_tag(tool_grammar.required_calls(cases.TOOLS, 2)["structural_tag"])
    call = '<|tool_call_begin|>functions.{}:{}<|tool_call_argument_begin|>{}<|tool_call_end|>'
    good = call.format("get_weather", 2, '{"city":"paris"}') + call.format("search", 3, '{"query":"x","top_k":3}')
    assert accepts(required, ids(good + "<|tool_calls_section_end|>"))
    assert kimi.token_to_id("<|tool_call_begin|>") in kimi.encode(good)  # the markers are single tokens here
    for bad in (call.format("get_weather", 0, '{"city":"paris"}'),  # IDX not the conversation's next
                call.format("get_weather", 2, '{"city":"Paris"}'),  # against the parameters' pattern
                call.format("get_weather", 2, '{"city":"paris","x":1}'),  # an undeclared argument
                call.format("nope", 2, '{}'), ""):
        assert not accepts(required, ids(bad + "<|tool_calls_section_end|>")), bad
    assert not accepts(required, ids(good))  # the section must end
    one = comp.compile_structural_tag(tool_grammar.required_calls(cases.TOOLS, 2, parallel=False)["structural_tag"])
    assert accepts(one, ids(call.format("search", 2, '{"query":"x"}') + "<|tool_calls_section_end|>"))
    assert not accepts(one, ids(good + "<|tool_calls_section_end|>"))
    named = comp.compile_json_schema(json.dumps(tool_grammar.named_call(cases.TOOLS, "search")["json"]),
                                     any_whitespace=False)
    # vLLM's disable_any_whitespace: xgrammar's one-line separators ", " and ": ", no other whitespace
    assert accepts(named, ids('{"query": "x", "top_k": 3}')) and not accepts(named, ids('{"city": "x"}'))
    assert not accepts(named, ids('{"query":"x"}')) and not accepts(named, ids('{"query": "x",\n"top_k": 3}'))
    anything = comp.compile_json_schema('{"type": "object"}', any_whitespace=False)  # vLLM's json_object
    assert accepts(anything, ids("{}")) and accepts(anything, ids('{"city": "x", "n": [1, {"a": null}]}'))
    assert not accepts(anything, ids("[1]")) and not accepts(anything, ids('"x"'))


def sample(compiled, kimi, special, vocab: int, generator, stops=(), budget: int = cases.BUDGET) -> str:
    """A random model's reply under the grammar: random logits masked as the worker masks them, sampled."""
    matcher, out = xgr.GrammarMatcher(compiled), []
    stop_ids = {kimi.eos_id, *stops}
    for _ in range(budget):
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        matcher.fill_next_token_bitmask(bitmask)
        logits = torch.randn(1, vocab, generator=generator) * 4
        grammar_mask.apply(logits, [0], bitmask, [stop_ids], special)
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=generator))
        if token in stop_ids:
            return kimi.decode(out)
        assert matcher.accept_token(token), token
        out.append(token)
    raise AssertionError(f"no end within {budget} tokens: {kimi.decode(out)!r}")


def test_a_random_model_held_to_each_grammar_writes_what_it_asks(compiler, tokenizers):
    """Random logits, masked: each of the 50 schemas' replies parses, validates and ends within the schema's longest
    text, and every forced call's arguments validate against its function's parameters, the calls read by the
    parser."""
    comp, info = compiler
    _, kimi = tokenizers
    special = grammar_mask.SpecialTokens.of_kimi(kimi, info.vocab_size)
    generator = torch.Generator().manual_seed(0)
    im_end = kimi.token_to_id("<|im_end|>")
    for kind, schema in cases.SCHEMAS:  # each within its longest text (the budget the server tests give it)
        compiled = comp.compile_json_schema(json.dumps(schema), any_whitespace=False)
        text = sample(compiled, kimi, special, info.vocab_size, generator, stops=(im_end,),
                      budget=cases.longest(schema) + 1)
        cases.check(text, schema)
    required = comp.compile_structural_tag(tool_grammar.required_calls(cases.TOOLS, 0)["structural_tag"])
    for _ in range(10):  # up to four calls, their arguments with any whitespace: a longer budget
        text = sample(required, kimi, special, info.vocab_size, generator, stops=(im_end,), budget=800)
        parsed = tool_calls.parse(text, tools=cases.TOOLS, prefill=tool_calls.SECTION_BEGIN)
        assert parsed.calls and not parsed.content, text
        for k, call in enumerate(parsed.calls):
            assert call.id == f"functions.{call.name}:{k}"
            cases.check(call.arguments, cases.PARAMETERS[call.name])
    regex = comp.compile_regex(cases.REGEX)
    cases.check_regex(sample(regex, kimi, special, info.vocab_size, generator))
