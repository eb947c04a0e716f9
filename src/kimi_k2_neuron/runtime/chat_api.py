"""Kimi's chat-completions contract applied to an OpenAI request, SDK-free: what Moonshot's API (and its vendor
verifier, Kimi-Vendor-Verifier) refuses, fixes or renames before a request reaches the model. neuron/vllm_api.py runs
it in front of vLLM's server; docs/vllm.md lists each rule with the verifier test it answers.

`kimi_request(body, facts)` returns the request to serve, or raises ApiError (HTTP 400) with one line naming the
field. `ChatFacts.of(tokenizer)` reads what a checkpoint's chat template does with thinking, by rendering it.

- Thinking: Kimi's own `thinking: {"type": "enabled"|"disabled", "keep": "all"|null}` becomes the template's
  `chat_template_kwargs` `thinking` and `preserve_thinking` (the open-weight templates' names); a thinking-only
  checkpoint (Kimi-K2.7-Code: its template opens <think> either way) refuses thinking off rather than ignore it.
- The fixed sampling parameters (`contract`; Moonshot's API fixes them for K2.5 and later, docs/vllm.md says why it
  is on for those checkpoints by default): temperature within [0, 1] (default 1.0 thinking, 0.6 not), top_p 0.95,
  presence and frequency penalty 0, n 1; any other value is refused as the official API refuses it.
- Replies held to a schema: response_format json_object and json_schema (name and schema required, strict a
  boolean) and vLLM's structured_outputs pass to vLLM where the server applies its grammar (`facts.grammars`: None,
  neuron/vllm_worker.py), else are refused with the reason; json_schema with strict false is a JSON object whose
  structure is not enforced, as Kimi's API words it (json_object); vLLM 0.13 ignores the old guided_* fields, so
  they are refused. Presence and frequency penalties are refused (vllm-neuron's sampler gets temperature, top_k
  and top_p).
- tool_choice: `auto` or `none` without tools is a plain chat (vLLM refuses `auto` without tools); `required`
  needs tools. The prompt forces `required` and a named function: the request continues an assistant message that
  opens the tool section (and, for a named function, the call), which the parsers (neuron/vllm_parsers.py) read as
  the state the output starts in; where grammars are applied, the rest is held to the tools' parameters inside
  Kimi's markers (runtime/tool_grammar.py), in place of any response_format.
- A tool result must name its call (tool_call_id). History tool-call ids become `functions.NAME:IDX` (IDX counting
  the conversation's calls), in the assistant messages and the tool results that answer them, as Moonshot's API
  renames them: Kimi copies the ids it reads.
- prompt_cache_key (Kimi's: a session's stable key) is accepted and taken out: the engine finds cached blocks by
  the prompt's own prefix (vLLM's block hashes, docs/vllm.md), and a router in front of several engines reads the key
  for session affinity before this runs.
- The detokenizer's spaces around special tokens are off (spaces_between_special_tokens false unless set), and a
  stream reports its usage (stream_options.include_usage), as Kimi's API always does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from kimi_k2_neuron.runtime import tool_grammar
from kimi_k2_neuron.runtime.tool_calls import (ARGUMENT_BEGIN, CALL_BEGIN, FUNCTION_PREFIX, SECTION_BEGIN,
                                               THINK_OPEN)

# Moonshot's fixed values (platform.kimi.ai, "Model Parameter Reference": kimi-k2.5 and kimi-k2.6)
THINKING_TEMPERATURE, INSTANT_TEMPERATURE, TOP_P = 1.0, 0.6, 0.95
# vLLM 0.11's fields, which 0.13 no longer reads: a reply would not be held to them
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
          "guided_whitespace_pattern", "structural_tag")
NO_GRAMMAR = "no vLLM configuration was read to tell whether the server applies vLLM's grammar"


class ApiError(ValueError):
    """A request the contract refuses: HTTP 400, one line."""


@dataclass(frozen=True)
class ChatFacts:
    """What a checkpoint's chat template does with thinking."""
    opens_thinking: bool = False  # the generation prompt ends with <think> by default (K2.5+)
    thinking_only: bool = False  # ... whatever `thinking` says (K2.7-Code)
    contract: bool = False  # the fixed sampling parameters apply (default: on where the prompt opens <think>)
    grammars: str | None = NO_GRAMMAR  # None: the server holds replies to vLLM's grammars; else why it cannot

    @classmethod
    def of(cls, tokenizer, contract: bool | None = None) -> "ChatFacts":
        """Render a one-line chat with thinking on and off (a KimiTokenizer, or anything with its
        apply_chat_template)."""
        chat = [{"role": "user", "content": "."}]

        def opens(**kwargs) -> bool:
            return tokenizer.apply_chat_template(chat, add_generation_prompt=True, **kwargs).endswith(THINK_OPEN)

        default, off = opens(), opens(thinking=False)
        return cls(default, default and off, default if contract is None else contract)


def _fail(field: str, expected: str, got=None) -> None:
    shown = "" if got is None else f" (got {got!r})"
    raise ApiError(f"{field}: {expected}{shown}")


def _number(body: dict, name: str):
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        _fail(name, "expected a number", value)
    return value


def kimi_request(body: dict, facts: ChatFacts) -> dict:
    """The request to serve (a copy), or ApiError."""
    body = copy.deepcopy(body)
    thinking = _thinking(body, facts)
    _structured(body, facts.grammars)
    _refuse_penalties(body)
    if facts.contract:
        _fixed_sampling(body, thinking)
    _tool_choice(body, facts.grammars)
    _check_tool_results(body)
    _rename_tool_call_ids(body)
    _prompt_cache_key(body)
    body.setdefault("spaces_between_special_tokens", False)
    if body.get("stream") and body.get("stream_options") is None:
        body["stream_options"] = {"include_usage": True}
    return body


def other_request(body: dict, facts: ChatFacts) -> None:
    """A request to another endpoint that takes vLLM's structured outputs (/v1/completions): ApiError where the
    server applies no grammar, as for a chat."""
    _structured(copy.deepcopy(body), facts.grammars)


def _prompt_cache_key(body: dict) -> None:
    """Accepted and dropped: vLLM would log it as an ignored field on every request."""
    key = body.pop("prompt_cache_key", None)
    if key is not None and not isinstance(key, str):
        _fail("prompt_cache_key", "expected a string", key)


def _thinking(body: dict, facts: ChatFacts) -> bool:
    """Kimi's `thinking` field as the template's kwargs; whether this request thinks."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        _fail("chat_template_kwargs", "expected an object", kwargs)
    if "thinking" in body and isinstance(body["thinking"], (dict, type(None))):
        kimi = body.pop("thinking") or {}
        kind = kimi.get("type", "enabled")
        if kind not in ("enabled", "disabled"):
            _fail("thinking.type", "expected 'enabled' or 'disabled'", kind)
        keep = kimi.get("keep")
        if keep not in (None, "all"):
            _fail("thinking.keep", "expected 'all' or null", keep)
        kwargs.setdefault("thinking", kind == "enabled")
        if keep == "all":
            kwargs.setdefault("preserve_thinking", True)
    thinking = kwargs.get("thinking", facts.opens_thinking)
    if not isinstance(thinking, bool):
        _fail("chat_template_kwargs.thinking", "expected true or false", thinking)
    if facts.thinking_only and not thinking:
        _fail("thinking", "this checkpoint thinks always (its chat template opens <think> either way); expected "
                          "thinking enabled or left out")
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    return thinking or facts.thinking_only


def _structured(body: dict, refusal: str | None) -> None:
    """response_format checked as Kimi's API checks it; what asks for a grammar refused where none is applied."""
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            _fail("response_format.type", "expected 'text', 'json_object' or 'json_schema'", kind)
        if kind == "json_schema":
            _check_json_schema(response_format.get("json_schema"))
        if kind == "text":
            body.pop("response_format")  # vLLM would make an empty grammar of it
        elif refusal:
            _fail(f"response_format {kind}", f"not served here: {refusal}; refused rather than ignored")
        elif kind == "json_schema" and response_format["json_schema"].get("strict") is False and \
                response_format["json_schema"]["schema"].get("type", "object") == "object":
            body["response_format"] = {"type": "json_object"}  # Kimi's API: a JSON object, its structure free
    for name in GUIDED:
        if body.get(name) is not None:
            _fail(name, "not read by vLLM 0.13, which would ignore it; use structured_outputs")
    if body.get("structured_outputs") is not None:
        if not isinstance(body["structured_outputs"], dict):
            _fail("structured_outputs", "expected an object", body["structured_outputs"])
        if refusal:
            _fail("structured_outputs", f"not served here: {refusal}; refused rather than ignored")


def _check_json_schema(json_schema) -> None:
    if not isinstance(json_schema, dict):
        _fail("response_format.json_schema", "expected an object with name and schema", json_schema)
    name = json_schema.get("name")
    if not isinstance(name, str) or not name:
        _fail("response_format.json_schema.name", "expected a non-empty string", name)
    if not isinstance(json_schema.get("schema"), dict):
        _fail("response_format.json_schema.schema", "expected a JSON Schema object", json_schema.get("schema"))
    strict = json_schema.get("strict")
    if strict is not None and not isinstance(strict, bool):
        _fail("response_format.json_schema.strict", "expected true or false", strict)


def _refuse_penalties(body: dict) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name) not in (None, 0):
            _fail(name, "only 0: vllm-neuron's sampler applies temperature, top_k and top_p, no penalty",
                  body[name])


def _fixed_sampling(body: dict, thinking: bool) -> None:
    """Moonshot's fixed parameters: the values its API refuses are refused; what is left out gets its value."""
    temperature = _number(body, "temperature")
    if temperature is not None and not 0 <= temperature <= 1:
        _fail("temperature", "expected 0 <= temperature <= 1 (Kimi's API contract)", temperature)
    top_p = _number(body, "top_p")
    if top_p is not None and top_p != TOP_P:
        _fail("top_p", f"only {TOP_P} is allowed for this model (Kimi's API contract)", top_p)
    n = body.get("n")
    if n not in (None, 1):
        _fail("n", "only 1 is allowed for this model (Kimi's API contract)", n)
    body.setdefault("temperature", THINKING_TEMPERATURE if thinking else INSTANT_TEMPERATURE)
    if body["temperature"] is None:
        body["temperature"] = THINKING_TEMPERATURE if thinking else INSTANT_TEMPERATURE
    if body.get("top_p") is None:
        body["top_p"] = TOP_P


def _tool_choice(body: dict, refusal: str | None) -> None:
    choice, tools = body.get("tool_choice"), body.get("tools")
    if tools is not None and not isinstance(tools, list):
        return  # vLLM's own validation answers
    if choice in ("auto", "none") and not tools:
        body.pop("tool_choice")
        body.pop("tools", None)
        return
    if choice == "required" and not tools:
        _fail("tool_choice required", "needs a non-empty tools list")
    calls = sum(len(m.get("tool_calls") or ()) for m in body.get("messages") or () if isinstance(m, dict))
    if choice == "required":
        grammar = tool_grammar.required_calls(tools, calls, parallel=body.get("parallel_tool_calls") is not False)
        _prefill(body, SECTION_BEGIN)
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in [t.get("function", {}).get("name") for t in tools or () if isinstance(t, dict)]:
            _fail("tool_choice.function.name", "expected one of the request's tools", name)
        grammar = tool_grammar.named_call(tools, name)
        _prefill(body, f"{SECTION_BEGIN}{CALL_BEGIN}{FUNCTION_PREFIX}{name}:{calls}{ARGUMENT_BEGIN}")
    else:
        return
    if refusal is None and body.get("tool_choice") == "auto":  # prefilled: the rest held to the tools' schemas
        body.pop("response_format", None)
        body["structured_outputs"] = grammar


def _prefill(body: dict, text: str) -> None:
    """Serve a forced call as tool_choice auto continuing an assistant message that opens it."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    body["tool_choice"] = "auto"
    if body.get("continue_final_message") and messages and isinstance(messages[-1], dict) and \
            messages[-1].get("role") == "assistant" and isinstance(messages[-1].get("content"), str):
        messages[-1]["content"] += text
    else:
        messages.append({"role": "assistant", "content": text})
    body["continue_final_message"], body["add_generation_prompt"] = True, False


def _check_tool_results(body: dict) -> None:
    """A tool result names the call it answers (the template writes `## Return of ID`)."""
    for i, message in enumerate(body.get("messages") or ()):
        if isinstance(message, dict) and message.get("role") == "tool" and not (
                isinstance(message.get("tool_call_id"), str) and message["tool_call_id"]):
            _fail(f"messages[{i}].tool_call_id", "a tool message needs the id of the call it answers")


def _rename_tool_call_ids(body: dict) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    renamed, count = {}, 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
            for call in message["tool_calls"]:
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    continue
                new = f"{FUNCTION_PREFIX}{function['name']}:{count}"
                count += 1
                if "id" in call:
                    renamed[call["id"]] = new  # a tool result answers the latest call of its id
                call["id"] = new
        elif message.get("role") == "tool" and message.get("tool_call_id") in renamed:
            message["tool_call_id"] = renamed[message["tool_call_id"]]
