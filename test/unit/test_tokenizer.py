"""KimiTokenizer on tiny Kimi-format files; oracles are plain tiktoken, HF's chat-template renderer and literals."""

import base64
import json
import os
from pathlib import Path

import pytest
import tiktoken
import tiktoken.load

from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.runtime.tokenizer import KIMI_PAT_STR, KIMI_SPECIAL_BASE, KimiTokenizer
from kimi_k2_neuron.tiny.tokenizer_files import tiny_special_id, write_tiny_tokenizer

NUM_BASE = 300
SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
CHAT = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"}]


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    write_tiny_tokenizer(tmp_path, num_base_tokens=NUM_BASE)
    return tmp_path


@pytest.fixture
def tok(tiny_dir: Path) -> KimiTokenizer:
    return KimiTokenizer.from_dir(tiny_dir)


@pytest.mark.parametrize(
    "text",
    [
        "Hello world, it's 2025!\n\n  tabs\there",
        "naïve café — ünïcödé",  # 2- and 3-byte UTF-8
        "你好，世界！Kimi 模型",  # Han runs are their own pre-tokens
        "emoji 🚀👍🏽 mix",  # 4-byte UTF-8 and a modifier sequence
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < NUM_BASE for i in ids)  # plain text never produces special ids
    assert tok.decode(ids) == text


def test_vocab_and_special_ids(tok):
    assert tok.vocab_size == NUM_BASE + 256
    assert (tok.bos_id, tok.eos_id) == (NUM_BASE, NUM_BASE + 1)
    # Offsets from Kimi's real table: <|im_end|> 163586, <|im_middle|> 163601, <think> 163606, [PAD] 163839.
    assert tok.token_to_id("<|im_end|>") == NUM_BASE + 2 == tiny_special_id(163586, NUM_BASE)
    assert tok.token_to_id("<|im_middle|>") == NUM_BASE + 17
    assert tok.token_to_id("<think>") == NUM_BASE + 22
    assert tok.token_to_id("[PAD]") == NUM_BASE + 255
    assert tok.token_to_id(f"<|reserved_token_{NUM_BASE + 5}|>") == NUM_BASE + 5  # 163589 is unnamed
    assert tok.token_to_id("no such token") is None
    assert tiny_special_id(KIMI_SPECIAL_BASE, 163584) == 163584


def test_specials_encode_to_ids_only_when_allowed(tok):
    text = "[BOS]<|im_user|>hi<|im_end|>"
    assert tok.encode(text) == [NUM_BASE, NUM_BASE + 3, ord("h"), ord("i"), NUM_BASE + 2]
    as_text = tok.encode(text, allow_special=False)
    assert all(i < NUM_BASE for i in as_text) and tok.decode(as_text) == text


def test_decode_skip_special_keeps_tool_markers(tok):
    ids = tok.encode("<|im_assistant|>ok<|tool_call_begin|><think>[EOS]")
    assert tok.decode(ids) == "<|im_assistant|>ok<|tool_call_begin|><think>[EOS]"
    assert tok.decode(ids, skip_special=True) == "ok<|tool_call_begin|><think>"


def test_stop_ids(tok):
    """Both of Kimi's ends, [EOS] (163585) and <|im_end|> (163586), whichever one config.json names (K2 and K2.5
    say [EOS], K2-Thinking and K2.6 <|im_end|>), plus what it names."""
    assert tok.stop_ids(tok.eos_id) == {NUM_BASE + 1, NUM_BASE + 2}
    assert tok.stop_ids(NUM_BASE + 2) == {NUM_BASE + 1, NUM_BASE + 2}
    assert tok.stop_ids([7, NUM_BASE + 2]) == {7, NUM_BASE + 1, NUM_BASE + 2}
    assert tok.stop_ids(None) == {NUM_BASE + 1, NUM_BASE + 2}


def test_chat_template_two_messages(tok):
    body = (
        SYSTEM
        + "<|im_user|>user<|im_middle|>Hello<|im_end|>"
        + "<|im_assistant|>assistant<|im_middle|>Hi there<|im_end|>"
    )
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False) == body
    assert tok.apply_chat_template(CHAT) == body + "<|im_assistant|>assistant<|im_middle|>"


def test_chat_template_explicit_system_and_ids(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"}]
    prompt = tok.apply_chat_template(messages)
    expected = "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Q<|im_end|>"
    assert prompt == expected + "<|im_assistant|>assistant<|im_middle|>"
    ids = tok.encode(prompt)
    assert ids[0] == tiny_special_id(163594, NUM_BASE)  # <|im_system|>
    assert ids[-1] == tiny_special_id(163601, NUM_BASE)  # <|im_middle|>


def test_chat_template_matches_hf_renderer(tok):
    # HF's own renderer (what trust_remote_code users get) on the same template, including tool calls.
    from transformers.utils.chat_template_utils import render_jinja_template

    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    call = {"id": "functions.get:0", "type": "function", "function": {"name": "get", "arguments": {"q": "<&>"}}}
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "functions.get:0", "content": "sunny"},
    ]
    ours = tok.apply_chat_template(messages, tools=tools)
    hf, _ = render_jinja_template(
        [messages], tools=tools, chat_template=tok.chat_template, add_generation_prompt=True,
        bos_token="[BOS]", eos_token="[EOS]",
    )
    assert ours == hf[0]
    assert '<|tool_call_argument_begin|>{"q": "<&>"}<|tool_call_end|>' in ours
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get:0\nsunny<|im_end|>" in ours


def test_files_load_with_plain_tiktoken(tiny_dir, tok, monkeypatch):
    # Independent reader: tiktoken's own loader (cache off) and the JSON config, no code of ours but the regex.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    ranks = tiktoken.load.load_tiktoken_bpe(str(tiny_dir / "tiktoken.model"))
    decoder = json.loads((tiny_dir / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    named = {int(k): v["content"] for k, v in decoder.items()}
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(len(ranks), len(ranks) + 256)}
    plain = tiktoken.Encoding("plain", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)
    assert len(ranks) == NUM_BASE and plain.n_vocab == tok.vocab_size
    text = tok.apply_chat_template(CHAT) + "the answer: 你好 1234 it's"
    assert tok.encode(text) == plain.encode(text, allowed_special="all")


def test_chat_template_jinja_overrides_config(tiny_dir):
    (tiny_dir / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    assert KimiTokenizer.from_dir(tiny_dir).apply_chat_template(CHAT) == "[BOS]Hello"


def _one_line_error(path: Path) -> str:
    with pytest.raises(KimiInputError) as info:
        KimiTokenizer.from_dir(path)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("name", ["tiktoken.model", "tokenizer_config.json"])
def test_missing_file(tiny_dir, name):
    (tiny_dir / name).unlink()
    assert name in _one_line_error(tiny_dir)


@pytest.mark.parametrize("bad_line", [b"bm90IGEgbGluZQ==", b"!!notbase64!! 5", b"YQ== five"])
def test_malformed_vocab_line(tiny_dir, bad_line):
    path = tiny_dir / "tiktoken.model"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[3] = bad_line + b"\n"
    path.write_bytes(b"".join(lines))
    message = _one_line_error(tiny_dir)
    assert "tiktoken.model" in message and "line 4" in message


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer_config.json"])
def test_a_tokenizer_file_that_is_not_utf8_is_one_line(tiny_dir, name):
    """A template saved in Latin-1 (or a tokenizer_config.json with a stray byte): one line naming the file and the
    byte (before: a UnicodeDecodeError traceback for the template file)."""
    path = tiny_dir / name
    path.write_bytes(path.read_text().replace("\n", "\n\u00e9", 1).encode("latin-1"))  # é as one byte, 0xe9
    message = _one_line_error(tiny_dir)
    assert f"{name}: not UTF-8 text (byte 0xe9 at offset" in message, message


@pytest.mark.parametrize("template, words", [
    (["x", 5], 'field chat_template: expected a string or a list of {"name", "template"} objects, got ["x", 5]'),
    (5, "field chat_template: expected a string"),
    ([{"name": "default", "template": 5}], "field chat_template"),
])
def test_a_chat_template_field_of_another_type_is_one_line(tiny_dir, template, words):
    (tiny_dir / "chat_template.jinja").unlink(missing_ok=True)
    path = tiny_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "chat_template": template}))
    assert words in _one_line_error(tiny_dir)


@pytest.mark.parametrize("name", ["chat_template.jinja", "tiktoken.model"])
def test_a_folder_in_a_tokenizer_files_place_is_one_line(tiny_dir, name):
    path = tiny_dir / name
    path.unlink(missing_ok=True)
    path.mkdir()
    assert f"{name}: is a folder" in _one_line_error(tiny_dir)


def test_duplicate_rank(tiny_dir):
    path = tiny_dir / "tiktoken.model"
    path.write_bytes(path.read_bytes() + base64.b64encode(b"xyz") + b" 7\n")
    assert "tiktoken.model" in _one_line_error(tiny_dir)


def test_special_id_out_of_range(tiny_dir):
    path = tiny_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["added_tokens_decoder"][str(NUM_BASE + 256)] = {"content": "<|oops|>", "special": True}
    path.write_text(json.dumps(config))
    message = _one_line_error(tiny_dir)
    assert "tokenizer_config.json" in message and str(NUM_BASE + 256) in message


@pytest.mark.skipif("KIMI_TOKENIZER_DIR" not in os.environ, reason="set KIMI_TOKENIZER_DIR to a real Kimi-K2 dir")
def test_real_kimi_files():
    tok = KimiTokenizer.from_dir(os.environ["KIMI_TOKENIZER_DIR"])
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (163840, 163584, 163585)
    assert tok.stop_ids(163585) == {163585, 163586}
    assert tok.decode(tok.encode("你好, Kimi!")) == "你好, Kimi!"
