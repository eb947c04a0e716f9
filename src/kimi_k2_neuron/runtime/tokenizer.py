"""Kimi-K2's tokenizer, loaded from its files without running checkpoint code.

Kimi ships no ``tokenizer.json``; HF can only load it through ``tokenization_kimi.py`` with
``trust_remote_code=True``. That class is a thin wrapper around a ``tiktoken.Encoding``, so we build the same
Encoding from the same data:

* ``tiktoken.model``: one ``<base64 bytes> <rank>`` line per base token; ``num_base = len(ranks)``.
* ``tokenizer_config.json``: ``added_tokens_decoder`` names some of the 256 special slots
  ``[num_base, num_base + 256)``; unnamed slots are ``<|reserved_token_{id}|>``. Also ``bos_token``,
  ``eos_token`` and usually ``chat_template``.
* ``chat_template.jinja`` (optional) overrides the config's template, as in HF.

kimi_k2_neuron.tiny.tokenizer_files writes the same format for tiny test checkpoints.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path

import jinja2
import tiktoken
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kimi_k2_neuron.errors import KimiInputError

VOCAB_NAME = "tiktoken.model"
CONFIG_NAME = "tokenizer_config.json"
TEMPLATE_NAME = "chat_template.jinja"

# Real Kimi-K2 has 163584 base tokens, so its specials start here; tiny tokenizers keep each special at the
# same offset from their own num_base (tiny.tokenizer_files.tiny_special_id).
KIMI_SPECIAL_BASE = 163584
NUM_SPECIAL_SLOTS = 256

# Pre-tokenizer regex of Kimi-K2's TikTokenTokenizer.pat_str (tokenization_kimi.py), verbatim: Han runs split
# from other letters, English contractions kept on the word, digits in groups of at most three.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# tiktoken panics on >400k-char inputs and recurses deeply on long runs of (non-)whitespace (tiktoken
# issue #195); Kimi's encode() splits at these sizes, and so do we, to get the same ids.
_MAX_ENCODE_CHARS = 400_000
_MAX_SAME_KIND_RUN = 25_000


def _read_ranks(path: Path) -> dict[bytes, int]:
    """Parse tiktoken.model. Same format as ``tiktoken.load.load_tiktoken_bpe``, which we don't call because it
    caches local files in a temp dir keyed by path only, so a rewritten file at the same path loads stale."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:  # wrong field count, bad base64 (binascii.Error) or non-integer rank
            raise KimiInputError(
                f"{path}: line {lineno}: expected '<base64 token> <integer rank>', got {line[:60]!r}"
            ) from None
    if not ranks:
        raise KimiInputError(f"{path}: expected at least one '<base64 token> <rank>' line, found none")
    # Specials are numbered from len(ranks), so base ranks must be exactly 0..len-1 with no repeats.
    if set(ranks.values()) != set(range(len(ranks))):
        raise KimiInputError(f"{path}: expected ranks 0..{len(ranks) - 1}, each once (one line per distinct token)")
    return ranks


def _read_text(path: Path) -> str:
    """A tokenizer file's UTF-8 text; bytes that are not UTF-8 are one line naming the file and where."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KimiInputError(f"{path}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}); expected "
                             f"the file in UTF-8, as Kimi's releases ship it") from None


def _config_template(config: dict, path: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or HF's multi-template form [{"name": "default", "template":
    ...}, ...] (its default one); None without one."""
    given = template = config.get("chat_template")
    if isinstance(template, list) and all(isinstance(t, dict) for t in template):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is not None and not isinstance(template, str):
        raise KimiInputError(f"{path}: field chat_template: expected a string or a list of {{\"name\", \"template\"}} "
                             f"objects, got {json.dumps(given)[:60]}")
    return template


def _token_content(value: object, field: str, path: Path) -> str:
    # HF writes special tokens either as a string or as a serialized AddedToken {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise KimiInputError(f"{path}: field {field!r}: expected a token string or {{'content': ...}}, got {value!r}")
    return value


def _read_specials(config: dict, path: Path, num_base: int) -> tuple[dict[str, int], set[int]]:
    """Return (name -> id for all 256 slots, ids whose added_tokens_decoder entry has special=false)."""
    end = num_base + NUM_SPECIAL_SLOTS
    named: dict[int, str] = {}
    not_special: set[int] = set()
    for key, entry in config.get("added_tokens_decoder", {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise KimiInputError(f"{path}: added_tokens_decoder key {key!r}: expected an integer id") from None
        if not num_base <= token_id < end:
            raise KimiInputError(
                f"{path}: added_tokens_decoder id {token_id}: expected one in [{num_base}, {end}) "
                f"(tiktoken.model has {num_base} base tokens)"
            )
        named[token_id] = _token_content(entry, f"added_tokens_decoder[{key}]", path)
        if isinstance(entry, dict) and entry.get("special") is False:
            not_special.add(token_id)
    # Same naming rule as tokenization_kimi.py: named slots keep their content, the rest are reserved.
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(num_base, end)}
    if len(specials) != NUM_SPECIAL_SLOTS:
        raise KimiInputError(f"{path}: added_tokens_decoder: expected distinct token contents, found a repeat")
    return specials, not_special


def _split_long_runs(text: str) -> Iterator[str]:
    # Pieces of at most _MAX_ENCODE_CHARS with no run of whitespace / non-whitespace longer than
    # _MAX_SAME_KIND_RUN, cut at the same places as Kimi's encode().
    for start in range(0, len(text), _MAX_ENCODE_CHARS):
        chunk = text[start : start + _MAX_ENCODE_CHARS]
        piece_start, run_len, run_is_space = 0, 0, chunk[:1].isspace()
        for i, ch in enumerate(chunk):
            if ch.isspace() != run_is_space:
                run_len, run_is_space = 1, not run_is_space
            else:
                run_len += 1
                if run_len > _MAX_SAME_KIND_RUN:
                    yield chunk[piece_start:i]
                    piece_start, run_len = i, 1
        yield chunk[piece_start:]


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # HF replaces Jinja's tojson, which HTML-escapes <, >, & and ', with plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _compile_template(source: str) -> jinja2.Template:
    # Same environment as HF apply_chat_template: sandboxed (templates come with downloaded checkpoints),
    # trim_blocks/lstrip_blocks, loop controls, and its tojson / raise_exception / strftime_now helpers.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class KimiTokenizer:
    """Kimi-K2's tiktoken tokenizer and chat template, read from a checkpoint directory."""

    def __init__(
        self,
        encoding: tiktoken.Encoding,
        num_base_tokens: int,
        not_special_ids: set[int],
        bos_token: str,
        eos_token: str,
        chat_template: str | None,
        source: str,
    ):
        self.encoding = encoding
        self.num_base_tokens = num_base_tokens
        self._not_special_ids = frozenset(not_special_ids)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self._source = source  # names the directory in error messages
        self._compiled_template: jinja2.Template | None = None
        self._template_file: str | None = None  # the file the template came from (from_dir)
        for field, token in (("bos_token", bos_token), ("eos_token", eos_token)):
            if token not in encoding.special_tokens_set:
                raise KimiInputError(f"{source}: {field} {token!r}: expected one of the special tokens")

    @classmethod
    def from_dir(cls, path: str | Path) -> KimiTokenizer:
        """Load tiktoken.model + tokenizer_config.json (+ chat_template.jinja) from a checkpoint directory."""
        path = Path(path)
        vocab_path, config_path = path / VOCAB_NAME, path / CONFIG_NAME
        for required in (vocab_path, config_path):
            if not required.is_file():
                what = "is a folder" if required.is_dir() else "file not found"
                raise KimiInputError(f"{required}: {what}; expected Kimi's tokenizer files in {path}")
        ranks = _read_ranks(vocab_path)
        try:
            config = json.loads(_read_text(config_path))
        except json.JSONDecodeError as e:
            raise KimiInputError(f"{config_path}: invalid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        if not isinstance(config, dict):
            raise KimiInputError(f"{config_path}: expected a JSON object at the top level")
        specials, not_special = _read_specials(config, config_path, len(ranks))
        encoding = tiktoken.Encoding(
            name=str(vocab_path), pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials
        )
        # tokenization_kimi.py defaults bos/eos to [BOS]/[EOS] when the config leaves them out.
        bos = _token_content(config.get("bos_token", "[BOS]"), "bos_token", config_path)
        eos = _token_content(config.get("eos_token", "[EOS]"), "eos_token", config_path)
        template_path = path / TEMPLATE_NAME
        if template_path.exists() and not template_path.is_file():
            raise KimiInputError(f"{template_path}: is a folder; expected the chat template's text (or no such file: "
                                 f"tokenizer_config.json's chat_template)")
        template = _read_text(template_path) if template_path.is_file() else _config_template(config, config_path)
        tok = cls(encoding, len(ranks), not_special, bos, eos, template, str(path))
        tok._template_file = str(template_path if template_path.is_file() else path / CONFIG_NAME)
        return tok

    @property
    def vocab_size(self) -> int:
        return self.num_base_tokens + NUM_SPECIAL_SLOTS

    @property
    def bos_id(self) -> int:
        return self.encoding.encode_single_token(self.bos_token)

    @property
    def eos_id(self) -> int:
        return self.encoding.encode_single_token(self.eos_token)

    def token_to_id(self, token: str) -> int | None:
        """Id of a special token name or of a single base token given as text; None if neither."""
        try:
            return self.encoding.encode_single_token(token)
        except KeyError:
            return None

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids for ``text``. With allow_special=False, special-token text is encoded as plain text
        (use that for untrusted user content so it cannot inject turn markers)."""
        ids: list[int] = []
        for piece in _split_long_runs(text):
            if allow_special:
                ids.extend(self.encoding.encode(piece, allowed_special="all"))
            else:
                ids.extend(self.encoding.encode(piece, disallowed_special=()))
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text for ``ids`` (invalid UTF-8 becomes U+FFFD). skip_special drops special and reserved ids but keeps
        the ones marked special=false (tool-call markers, <think>), which output parsers need."""
        ids = [int(i) for i in ids]
        if skip_special:
            ids = [i for i in ids if i < self.num_base_tokens or i in self._not_special_ids]
        return self.encoding.decode(ids)

    def stop_ids(self, config_eos_ids: int | Iterable[int] | None) -> set[int]:
        """Ids that end generation: config.json's eos_token_id(s) plus both of Kimi's end tokens, [EOS] and
        <|im_end|>, which ends every chat turn (K2 and K2.5 configs say [EOS], K2-Thinking and K2.6 <|im_end|>)."""
        if config_eos_ids is None:
            stops: set[int] = set()
        elif isinstance(config_eos_ids, int):
            stops = {config_eos_ids}
        else:
            stops = {int(i) for i in config_eos_ids}
        for token in ("[EOS]", "<|im_end|>"):
            if token in self.encoding.special_tokens_set:
                stops.add(self.encoding.encode_single_token(token))
        return stops

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None, **kwargs
    ) -> str:
        """Render ``messages`` with the checkpoint's chat template, as HF's apply_chat_template(tokenize=False)."""
        if self.chat_template is None:
            raise KimiInputError(
                f"{self._source}: no chat template; expected {TEMPLATE_NAME} or a chat_template in {CONFIG_NAME}"
            )
        if self._compiled_template is None:
            try:
                self._compiled_template = _compile_template(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                where = self._template_file or self._source
                raise KimiInputError(f"{where}: the chat template does not parse (line {e.lineno}: "
                                     f"{' '.join(str(e.message).split())}); expected a Jinja template") from None
        try:
            return self._compiled_template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **kwargs,
            )
        except jinja2.TemplateError as e:
            message = " ".join(str(e).split())
            raise KimiInputError(f"{self._source}: chat template failed: {message}") from None
