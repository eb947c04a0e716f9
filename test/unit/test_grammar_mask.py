"""vLLM's grammar bitmask on the host's logits, Kimi's special tokens kept structural (runtime/grammar_mask.py): the
unpacking against numpy's own bit order, and each rule on the tiny tokenizer's vocabulary. xgrammar's masks for real
grammars, and a random model held to them through vLLM: test/nxdi_cpu/test_grammar.py, test_vllm_structured*.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kimi_k2_neuron.runtime import grammar_mask
from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer
from kimi_k2_neuron.tiny.tokenizer_files import write_tiny_tokenizer


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(folder)
    return KimiTokenizer.from_dir(folder)


@pytest.fixture(scope="module")
def special(kimi):
    return grammar_mask.SpecialTokens.of_kimi(kimi, kimi.vocab_size)


def mask_of(vocab: int, ids) -> torch.Tensor:
    row = torch.zeros(vocab, dtype=torch.bool)
    row[list(ids)] = True
    return row


def test_unpack_is_numpys_little_endian_bit_order():
    rng = np.random.default_rng(0)
    words = rng.integers(-2**31, 2**31, size=(3, 5), dtype=np.int64).astype(np.int32)
    want = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little").astype(bool)[:, :150]
    assert torch.equal(grammar_mask.unpack(torch.from_numpy(words), 150), torch.from_numpy(want))
    wide = grammar_mask.unpack(torch.from_numpy(words), 170)  # past the words: not allowed
    assert torch.equal(wide[:, :160], torch.from_numpy(np.unpackbits(words.view(np.uint8), axis=1,
                                                                     bitorder="little").astype(bool)))
    assert not wide[:, 160:].any()


def test_specials_and_what_spells_them(kimi, special):
    assert special.special.nonzero().min().item() == kimi.num_base_tokens and special.eos == kimi.eos_id
    marker = kimi.token_to_id("<|tool_call_end|>")
    spelled = [kimi.encoding.decode_single_token_bytes(t) for t in special.spellers[marker].nonzero().flatten()]
    assert spelled and all(b"<|tool_call_end|>".startswith(p) and len(p) < 17 for p in spelled)
    assert b"<" in spelled


def test_inside_text_special_tokens_and_stops_are_dropped(kimi, special):
    """A JSON string's position: xgrammar allows every text token, `<|im_end|>` and the markers included."""
    im_end, call_end = kimi.token_to_id("<|im_end|>"), kimi.token_to_id("<|tool_call_end|>")
    text = range(32, 127)
    row = mask_of(kimi.vocab_size, [*text, im_end, call_end, kimi.token_to_id("<think>")])
    got = grammar_mask.allowed(row, special, stops={kimi.eos_id, im_end})
    assert torch.equal(got, mask_of(kimi.vocab_size, text))


def test_where_the_grammar_writes_a_marker_its_token_writes_it(kimi, special):
    """After a call's arguments the grammar's text is `<|tool_call_end|>`: its token or '<' (its first byte)."""
    call_end, less = kimi.token_to_id("<|tool_call_end|>"), kimi.encode("<")[0]
    row = mask_of(kimi.vocab_size, [call_end, less])
    assert torch.equal(grammar_mask.allowed(row, special, stops=()), mask_of(kimi.vocab_size, [call_end]))
    section_end, call_begin = kimi.token_to_id("<|tool_calls_section_end|>"), kimi.token_to_id("<|tool_call_begin|>")
    row = mask_of(kimi.vocab_size, [section_end, call_begin, less])  # another call, or the section's end
    assert torch.equal(grammar_mask.allowed(row, special, stops=()), mask_of(kimi.vocab_size,
                                                                             [section_end, call_begin]))
    a = kimi.encode("a")[0]
    row = mask_of(kimi.vocab_size, [call_end, less, a])  # text where '<' is text too: text only
    assert torch.equal(grammar_mask.allowed(row, special, stops=()), mask_of(kimi.vocab_size, [less, a]))


def test_where_the_grammar_may_end_every_stop_token_may(kimi, special):
    im_end = kimi.token_to_id("<|im_end|>")
    got = grammar_mask.allowed(mask_of(kimi.vocab_size, [kimi.eos_id]), special, stops={kimi.eos_id, im_end})
    assert torch.equal(got, mask_of(kimi.vocab_size, [kimi.eos_id, im_end]))
    got = grammar_mask.allowed(mask_of(kimi.vocab_size, [kimi.eos_id, 44]), special, stops={im_end})
    assert torch.equal(got, mask_of(kimi.vocab_size, [44, kimi.eos_id, im_end]))  # ',' or the end


def test_an_open_row_is_left_alone_and_apply_masks_by_row(kimi, special):
    vocab = kimi.vocab_size
    assert grammar_mask.allowed(torch.ones(vocab, dtype=torch.bool), special, stops=()) is None
    words = -(-vocab // 32)
    bitmask = torch.full((2, words), -1, dtype=torch.int32)  # row 0 open (reasoning), row 1: '{' only
    bitmask[1] = 0
    bitmask[1, 123 // 32] = 1 << (123 % 32)
    logits = torch.randn(3, vocab)
    before = logits.clone()
    grammar_mask.apply(logits, [0, 2], bitmask, [(), ()], special)  # logits row 1: no grammar
    assert torch.equal(logits[:2], before[:2])
    assert torch.isinf(logits[2]).sum() == vocab - 1 and logits[2, 123] == before[2, 123]
