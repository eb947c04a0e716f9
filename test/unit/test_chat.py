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


def test_generation_defaults_come_from_a_generation_config_that_samples(tmp_path):
    """Kimi-K2.7-Code's generation config sets do_sample with temperature 1.0 and top_p 0.95: generate and
    run_inference sample so unless a flag says otherwise; without do_sample (K2, the tiny ones) they stay greedy."""
    import json

    import pytest

    from kimi_k2_neuron.errors import KimiInputError
    from kimi_k2_neuron.runtime.chat import generation_defaults

    path = tmp_path / "generation_config.json"
    assert generation_defaults(tmp_path) == {}
    path.write_text(json.dumps({"eos_token_id": 5, "temperature": 0.6}))
    assert generation_defaults(tmp_path) == {}
    path.write_text(json.dumps({"do_sample": True, "temperature": 1.0, "top_p": 0.95}))
    assert generation_defaults(tmp_path) == {"temperature": 1.0, "top_p": 0.95}
    for bad in ({"top_p": 0}, {"top_p": 1.5}, {"temperature": -1}, {"top_k": 2.5}, {"temperature": "hot"}):
        path.write_text(json.dumps({"do_sample": True, **bad}))
        with pytest.raises(KimiInputError, match=f"generation_config.json: field {next(iter(bad))}="):
            generation_defaults(tmp_path)
    path.write_text("{")
    with pytest.raises(KimiInputError, match="not valid JSON"):
        generation_defaults(tmp_path)
