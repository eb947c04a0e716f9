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


# -- a reply as a person reads it (ReplyPrinter): markers in words, streamed as at once ------------------------------

REPLY = ("<think>The user wants the weather.</think>Let me check."
         "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
         '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
SHOWN = ('[thinking] The user wants the weather. [/thinking]\nLet me check.\n[tool call 0: get_weather] '
         '{"city": "Paris"}\n')


def _streamed(text: str, stops=(), step: int = 1) -> str:
    from kimi_k2_neuron.runtime.chat import ReplyPrinter

    out: list[str] = []
    printer = ReplyPrinter(out.append, stops)
    for end in range(step, len(text) + step, step):
        printer.update(text[:end])
    printer.update(text, final=True)
    return "".join(out)


def test_a_reply_shows_its_reasoning_and_tool_calls_in_words():
    from kimi_k2_neuron.runtime.chat import display_text

    assert display_text(REPLY) == SHOWN
    assert display_text("plain answer") == "plain answer"
    # the reasoning a thinking model's prompt opened (it ended with <think>)
    assert display_text("hmm</think>yes", opened=True) == "[thinking] hmm [/thinking]\nyes"


def test_streamed_in_any_pieces_it_reads_as_the_whole():
    for step in (1, 2, 7, 1000):
        assert _streamed(REPLY, step=step) == SHOWN


def test_a_stop_string_is_never_shown_even_across_pieces():
    text = "It is sunny. END and more"
    for step in (1, 3):
        assert _streamed(text, stops=["END"], step=step) == "It is sunny. "
        assert _streamed(text, stops=["NOPE"], step=step) == text


def test_a_character_still_incomplete_waits():
    from kimi_k2_neuron.runtime.chat import ReplyPrinter

    out: list[str] = []
    printer = ReplyPrinter(out.append)
    printer.update("caf\ufffd")  # the first byte of é decoded so far
    assert "".join(out) == "caf"
    printer.update("café!", final=True)
    assert "".join(out) == "café!"
