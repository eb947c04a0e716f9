"""What generation shares on CPU and trn2 (runtime/chat.py): the chat messages --prompt and --system make, --stop
strings as the runner's check and as a transformers stopping criterion."""

import torch

from kimi_k2_neuron.runtime.chat import StopStrings, chat_messages, cut_at_stop


def test_cut_at_stop_takes_the_earliest():
    assert cut_at_stop("abcXdefYg", ["Y", "X"]) == "abc"
    assert cut_at_stop("abc", ["Z", ""]) == "abc"


def test_chat_messages_put_the_system_message_first():
    assert chat_messages("hi") == [{"role": "user", "content": "hi"}]
    assert chat_messages("hi", "be brief") == [{"role": "system", "content": "be brief"},
                                                {"role": "user", "content": "hi"}]


def test_stop_strings_end_a_row_from_its_new_tokens_only():
    """One rule for both callers: done() on a row's new tokens (the CPU runner), and one bool per row over input_ids
    whose new tokens start at `start` (transformers' and NxDI's generation loops)."""
    stops = StopStrings(lambda ids: "".join(chr(96 + i) for i in ids), ["cd", ""], start=2)
    assert stops.done([3, 4]) and not stops.done([4, 3])
    rows = torch.tensor([[3, 4, 1, 2], [1, 2, 3, 4], [1, 1, 3, 3]])  # "cd" only in the new tokens of row 1
    assert stops(rows).tolist() == [False, True, False]
