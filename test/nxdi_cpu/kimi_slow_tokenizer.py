"""A transformers slow tokenizer over the tiny checkpoint's tiktoken files: test infrastructure for `vllm serve`.

The real checkpoints ship Moonshot's tokenization_kimi.py, a slow (Python) PreTrainedTokenizer over tiktoken that
vLLM loads with --trust-remote-code. A slow tokenizer takes another path through vLLM than a fast one: its
SlowIncrementalDetokenizer joins added tokens (Kimi's markers, <think>) to the text around them with a space unless
the request sets spaces_between_special_tokens false. This class gives the tiny checkpoints that path, so that the
server tests see what a real checkpoint's replies go through. Its ids are KimiTokenizer's (tiktoken ranks, Kimi's
special slots); each base token's string is its bytes in GPT-2's byte-to-unicode alphabet, as byte-level BPE
tokenizers spell them, so that a token list turns back into bytes.

`write_slow_tokenizer(model, out)` writes a tokenizer folder for `vllm serve --tokenizer`: the checkpoint's tokenizer
files, an auto_map naming this class and a two-line module that imports it (this folder is on the vLLM child's
PYTHONPATH).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from transformers import PreTrainedTokenizer
from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

from kimi_k2_neuron.runtime.tokenizer import CONFIG_NAME, TEMPLATE_NAME, VOCAB_NAME, KimiTokenizer

SHIM = "tokenization_tiny_kimi.py"


class TinyKimiTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": VOCAB_NAME}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, **kwargs):
        self.kimi = KimiTokenizer.from_dir(Path(vocab_file).parent)
        encoding = self.kimi.encoding
        self._to_char = bytes_to_unicode()
        self._to_byte = {c: b for b, c in self._to_char.items()}
        self._tokens = {rank: "".join(self._to_char[b] for b in encoding.decode_single_token_bytes(rank))
                        for rank in range(self.kimi.num_base_tokens)}
        self._specials = {self.kimi.token_to_id(name): name for name in encoding.special_tokens_set}
        self._tokens.update(self._specials)
        self._ids = {token: i for i, token in self._tokens.items()}
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return self.kimi.num_base_tokens

    def get_vocab(self) -> dict[str, int]:
        return dict(self._ids)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        # transformers has cut the text at its added tokens already; what is left is plain text
        return [self._tokens[i] for i in self.kimi.encode(text, allow_special=False)]

    def _convert_token_to_id(self, token: str) -> int:
        return self._ids.get(token, self._ids.get(self.unk_token))

    def _convert_id_to_token(self, index: int) -> str:
        return self._tokens.get(index, self.unk_token)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        data = bytearray()
        for token in tokens:
            data += token.encode() if token in self._ids and self._ids[token] in self._specials else bytes(
                self._to_byte[c] for c in token)
        return data.decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        out = Path(save_directory) / ((filename_prefix + "-" if filename_prefix else "") + VOCAB_NAME)
        src = Path(self.vocab_file) if hasattr(self, "vocab_file") else None
        if src is not None and src.resolve() != out.resolve():
            shutil.copy(src, out)
        return (str(out),)


def write_slow_tokenizer(model: Path, out: Path) -> Path:
    """A tokenizer folder whose AutoTokenizer (with trust_remote_code) is TinyKimiTokenizer over model's files."""
    out.mkdir(parents=True, exist_ok=True)
    for name in (VOCAB_NAME, TEMPLATE_NAME):
        if (model / name).is_file():
            shutil.copy(model / name, out / name)
    config = json.loads((model / CONFIG_NAME).read_text())
    # every special slot the tiny config leaves unnamed, as the real tokenizer_config.json lists them: special, so
    # that skip_special_tokens drops them as KimiTokenizer.decode(skip_special=True) does
    kimi = KimiTokenizer.from_dir(model)
    for i in range(kimi.num_base_tokens, kimi.vocab_size):
        config["added_tokens_decoder"].setdefault(str(i), {
            "content": f"<|reserved_token_{i}|>", "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True})
    named = {config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if isinstance(config.get(k), str)}
    config["additional_special_tokens"] = [t["content"] for _, t in sorted(config["added_tokens_decoder"].items(),
                                                                            key=lambda kv: int(kv[0]))
                                           if t["special"] and t["content"] not in named]
    config.update(tokenizer_class="TinyKimiTokenizer",
                  auto_map={"AutoTokenizer": [f"{SHIM[:-3]}.TinyKimiTokenizer", None]})
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out / SHIM).write_text('"""The tiny checkpoints\' slow tokenizer (test/nxdi_cpu/kimi_slow_tokenizer.py)."""\n'
                            "from kimi_slow_tokenizer import TinyKimiTokenizer  # noqa: F401\n")
    return out
