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
