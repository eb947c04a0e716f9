"""A tiny tokenizer in Kimi-K2's format, for tiny test checkpoints (make-tiny, the tests).

The same files KimiTokenizer reads (tiktoken.model, tokenizer_config.json, chat_template.jinja): 256 byte tokens
(plus optional two-byte merges) and Kimi's special tokens at the same offsets from ``num_base`` as in the real
tokenizer, so ``tiny_special_id`` maps any real special id to its tiny twin.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.runtime.tokenizer import (CONFIG_NAME, KIMI_SPECIAL_BASE, NUM_SPECIAL_SLOTS, TEMPLATE_NAME,
                                              VOCAB_NAME)

# Kimi-K2 (incl. Thinking / K2.5) special tokens: (real id, content, HF "special" flag). The tool-call markers
# and <think>/</think> are not "special" so that decode(skip_special=True) keeps them for output parsers.
KIMI_SPECIAL_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (163584, "[BOS]", True),
    (163585, "[EOS]", True),
    (163586, "<|im_end|>", True),
    (163587, "<|im_user|>", True),
    (163588, "<|im_assistant|>", True),
    (163590, "<|start_header_id|>", True),
    (163591, "<|end_header_id|>", True),
    (163593, "[EOT]", True),
    (163594, "<|im_system|>", True),
    (163595, "<|tool_calls_section_begin|>", False),
    (163596, "<|tool_calls_section_end|>", False),
    (163597, "<|tool_call_begin|>", False),
    (163598, "<|tool_call_argument_begin|>", False),
    (163599, "<|tool_call_end|>", False),
    (163601, "<|im_middle|>", True),
    (163602, "<|media_begin|>", True),
    (163603, "<|media_content|>", True),
    (163604, "<|media_end|>", True),
    (163605, "<|media_pad|>", True),
    (163606, "<think>", False),
    (163607, "</think>", False),
    (163838, "[UNK]", True),
    (163839, "[PAD]", True),
)

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

# The real template streams Kimi-K2-Instruct's turn format: <|im_{role}|>{name}<|im_middle|>{content}<|im_end|>,
# with no newlines between turns and a default system turn when the first message is not a system one.
_HEAD = """\
{#- Kimi-K2's chat format for tiny checkpoints (THINKING): same markers, role names and default system prompt.
    Simplified: list-valued content keeps only its text parts (the real one emits media markers for images),
    and tool results are '## Return of {id}' plus a newline and the content, as in the Thinking template. -#}
"""
_TURNS = """\
{%- macro render_content(message) -%}
{%- if message['content'] is string -%}{{ message['content'] }}
{%- elif message['content'] is not none -%}
{%- for part in message['content'] if part.get('type') == 'text' %}{{ part['text'] }}{% endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages %}{% if message['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor -%}
{%- for message in messages -%}
{%- if loop.first and message['role'] != 'system' -%}
<|im_system|>system<|im_middle|>""" + DEFAULT_SYSTEM_PROMPT + """<|im_end|>
{%- endif -%}
{%- set role_name = message.get('name') or message['role'] -%}
{%- if message['role'] == 'user' -%}
<|im_user|>{{ role_name }}<|im_middle|>
{%- elif message['role'] == 'assistant' -%}
<|im_assistant|>{{ role_name }}<|im_middle|>
THINK_BLOCK{%- else -%}
<|im_system|>{{ role_name }}<|im_middle|>
{%- endif -%}
{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
{{ render_content(message) }}<|tool_calls_section_begin|>
{%- for tool_call in message['tool_calls'] -%}
{%- set args = tool_call['function']['arguments'] -%}
<|tool_call_begin|>{{ tool_call['id'] }}<|tool_call_argument_begin|>
{%- if args is string %}{{ args }}{% else %}{{ args | tojson }}{% endif -%}
<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- elif message['role'] == 'tool' -%}
## Return of {{ message['tool_call_id'] }}
{{ render_content(message) }}
{%- else -%}
{{ render_content(message) }}
{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>GENERATION
{%- endif -%}
"""


# An assistant turn of a thinking checkpoint opens with its reasoning (see CHAT_TEMPLATES).
_THINK_BLOCK = """\
{%- set reasoning = message.get('reasoning_content') or message.get('reasoning') or '' -%}
{%- if preserve_thinking or loop.index0 > ns.last_user -%}<think>{{ reasoning }}</think>
{%- else -%}<think></think>{%- endif -%}
"""


def _template(thinking: str, settings: str = "", generation: str = "") -> str:
    return (_HEAD.replace("(THINKING)", thinking) + settings
            + _TURNS.replace("THINK_BLOCK", _THINK_BLOCK if settings else "").replace("GENERATION", generation))


# Kimi-K2-Instruct / -0905: no reasoning.
TINY_CHAT_TEMPLATE = _template("(Instruct)")
# What the tiny templates of the thinking checkpoints do (the real templates were not read here; this is what their
# model cards and Moonshot's API describe): every assistant turn opens with <think>REASONING</think>, the reasoning
# kept (rendered back) for the turns after the last user message, which an agentic turn's tool calls need, and for
# all turns with preserved thinking; earlier turns get an empty <think></think>.
CHAT_TEMPLATES = {
    "k2": TINY_CHAT_TEMPLATE,
    # Kimi-K2-Thinking: always thinks, and writes <think> itself after the generation prompt.
    "k2-thinking": _template("(Thinking)", "{%- set preserve_thinking = preserve_thinking | default(false) -%}\n"),
    # Kimi-K2.5 and K2.6: `thinking` (default true) opens <think> in the generation prompt or closes it at once;
    # `preserve_thinking` (default false; Moonshot's API: thinking.keep "all") renders every turn's reasoning.
    "k2.6": _template("(K2.5, K2.6)", "{%- set thinking = thinking | default(true) -%}\n"
                      "{%- set preserve_thinking = preserve_thinking | default(false) -%}\n",
                      "{%- if thinking %}<think>{% else %}<think></think>{% endif -%}"),
    # Kimi-K2.7-Code: thinking only, preserved thinking always on; the kwargs change nothing.
    "k2.7": _template("(K2.7-Code: thinking only, preserved thinking)",
                      "{%- set thinking = true -%}\n{%- set preserve_thinking = true -%}\n", "<think>"),
}
CHAT_TEMPLATES["k2.5"] = CHAT_TEMPLATES["k2.6"]


def tiny_special_id(real_id: int, num_base_tokens: int) -> int:
    """Map a real Kimi special id (e.g. 163586 ``<|im_end|>``) to the same slot after ``num_base_tokens``."""
    offset = real_id - KIMI_SPECIAL_BASE
    if not 0 <= offset < NUM_SPECIAL_SLOTS:
        raise KimiInputError(
            f"special token id {real_id}: expected one in "
            f"[{KIMI_SPECIAL_BASE}, {KIMI_SPECIAL_BASE + NUM_SPECIAL_SLOTS})"
        )
    return num_base_tokens + offset


def write_tiny_tokenizer(out_dir: str | Path, num_base_tokens: int = 256, chat_template: str = TINY_CHAT_TEMPLATE) -> None:
    """Write tiktoken.model, tokenizer_config.json and chat_template.jinja for a tiny Kimi-format tokenizer.

    Base tokens are the 256 single bytes (rank = byte value), then deterministic two-byte merges of common
    ASCII pairs up to ``num_base_tokens``. Kimi's special tokens sit at ``tiny_special_id(real_id)``, so the
    vocabulary is ``num_base_tokens + 256`` like the real one.
    """
    merges = _tiny_merges()
    if not 256 <= num_base_tokens <= 256 + len(merges):
        raise KimiInputError(f"num_base_tokens {num_base_tokens}: expected 256..{256 + len(merges)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokens = [bytes([b]) for b in range(256)] + merges[: num_base_tokens - 256]
    lines = [f"{base64.b64encode(token).decode('ascii')} {rank}\n" for rank, token in enumerate(tokens)]
    (out / VOCAB_NAME).write_text("".join(lines), encoding="ascii")
    added = {
        str(tiny_special_id(real_id, num_base_tokens)): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for real_id, content, special in KIMI_SPECIAL_TOKENS
    }
    config = {
        "added_tokens_decoder": added,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "chat_template": chat_template,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / TEMPLATE_NAME).write_text(chat_template, encoding="utf-8")


def _tiny_merges() -> list[bytes]:
    """Two-byte ASCII tokens in a fixed order: frequent English bigrams first, then ' '+letter, then all
    letter pairs. Every merge joins two single bytes, so tiktoken's BPE can reach each of them."""
    lower = "abcdefghijklmnopqrstuvwxyz"
    candidates = ["th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "es", "or", "te", "ed", "is", "it"]
    candidates += [" " + c for c in lower + lower.upper()]
    candidates += [a + b for a in lower for b in lower]
    candidates += [a + b for a in lower.upper() for b in lower]
    return [token.encode("ascii") for token in dict.fromkeys(candidates)]
