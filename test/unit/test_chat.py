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


def test_a_generation_config_that_says_nothing_readable_is_one_line(tmp_path, one_line_error):
    """A generation config that is no JSON object, whose do_sample is no boolean, or a folder in its place, is refused
    (before: K2.7-Code's do_sample "true" decoded greedily without a word); top_p 0 is refused naming the range it
    is outside, (0, 1] (before: "expected a number in [0.0, 1.0]", which holds 0)."""
    import json

    from kimi_k2_neuron.runtime.chat import generation_defaults

    path = tmp_path / "generation_config.json"
    for text, words in (("[1, 2]", "generation_config.json: expected a JSON object, got list"),
                        ('"sample"', "expected a JSON object, got str"),
                        ('{"do_sample": "true", "temperature": 1.0}', "field do_sample='true', expected true or false"),
                        ('{"do_sample": 1}', "field do_sample=1, expected true or false"),
                        ('{"do_sample": true, "top_p": 0}', "field top_p=0, expected a number > 0 and <= 1"),
                        ('{"do_sample": true, "top_k": -1}', "field top_k=-1, expected an integer >= 0"),
                        ('{"do_sample": true, "temperature": 1e999}', "field temperature=inf")):
        path.write_text(text)
        one_line_error(lambda: generation_defaults(tmp_path), words)
    path.unlink()
    path.mkdir()
    one_line_error(lambda: generation_defaults(tmp_path), "generation_config.json: is a folder; expected a JSON file")
    path.rmdir()
    path.symlink_to(tmp_path / "gone.json")
    one_line_error(lambda: generation_defaults(tmp_path), "is a symbolic link to")
    path.unlink()
    path.write_text(json.dumps({"do_sample": False, "temperature": "ignored: not sampling"}))
    assert generation_defaults(tmp_path) == {}
