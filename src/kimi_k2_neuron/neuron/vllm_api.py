"""Kimi's API contract in front of vLLM's OpenAI server, through vLLM's public `--middleware` option (an ASGI class
it adds with app.add_middleware): each POST to /v1/chat/completions goes through runtime.chat_api.kimi_request,
which answers HTTP 400 with one line or hands vLLM the request to serve (docs/vllm.md: the rules, and the verifier
tests they answer). Nothing of vLLM is patched.

    vllm serve MODEL ... --middleware kimi_k2_neuron.neuron.vllm_api.KimiApi

What the checkpoint's chat template does with thinking (runtime.chat_api.ChatFacts) is read once, from the tokenizer
folder vLLM serves (app.state.vllm_config), and so is whether the server holds replies to vLLM's grammars
(vllm_request.grammar_refusal: the worker, the backend, the model's logits). The fixed sampling parameters apply where
that template opens <think> (Kimi-K2.5 and later, for which Moonshot's API fixes them); KIMI_K2_CONTRACT=on|off says
otherwise. A POST to /v1/completions is checked for structured outputs only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.runtime.chat_api import ApiError, ChatFacts, kimi_request, other_request

from .vllm_request import grammar_refusal

CONTRACT_ENV = "KIMI_K2_CONTRACT"
logger = logging.getLogger(__name__)


def contract_setting() -> bool | None:
    """KIMI_K2_CONTRACT: on, off, or unset (the checkpoint decides)."""
    value = os.environ.get(CONTRACT_ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in ("on", "off"):
        raise KimiInputError(f"{CONTRACT_ENV}={value!r}: expected on, off or auto")
    return value == "on"


def facts_of(tokenizer_dir) -> ChatFacts:
    """The chat template's facts, read with KimiTokenizer (Kimi's tokenizer files, no checkpoint code runs)."""
    from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer

    contract = contract_setting()
    folder = Path(tokenizer_dir) if tokenizer_dir else None
    if folder is None or not (folder / "tiktoken.model").is_file():
        logger.warning("kimi_k2_neuron: %s holds no Kimi tokenizer; thinking is passed through as asked", folder)
        return ChatFacts(contract=bool(contract))
    return ChatFacts.of(KimiTokenizer.from_dir(folder), contract)


class KimiApi:
    """Pure ASGI middleware: chat-completion requests rewritten or refused, everything else untouched."""

    def __init__(self, app):
        self.app = app
        self._facts: ChatFacts | None = None
        contract_setting()  # a bad KIMI_K2_CONTRACT stops the server's start, not its first request

    def facts(self, scope) -> ChatFacts:
        if self._facts is None:
            state = getattr(scope.get("app"), "state", None)
            vllm_config = getattr(state, "vllm_config", None)
            facts = facts_of(getattr(getattr(vllm_config, "model_config", None), "tokenizer", None))
            if vllm_config is not None:
                facts = dataclasses.replace(facts, grammars=grammar_refusal(vllm_config))
            self._facts = facts
            logger.info("kimi_k2_neuron: Kimi API contract: %s", self._facts)
        return self._facts

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") != "POST" or not path.endswith("/completions"):
            return await self.app(scope, receive, send)
        chat = path.endswith("/chat/completions")
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay(b"".join(chunks), receive), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if isinstance(request, dict):
            try:
                if chat:
                    body = json.dumps(kimi_request(request, self.facts(scope))).encode()
                else:  # checked, passed as it came
                    other_request(request, self.facts(scope))
            except ApiError as e:
                return await _bad_request(send, str(e))
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        scope = {**scope, "headers": headers + [(b"content-length", str(len(body)).encode())]}
        return await self.app(scope, _replay(body, receive), send)


def _replay(body: bytes, receive):
    """A receive() that gives the (rewritten) body once, then whatever the client sends next (a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


async def _bad_request(send, message: str) -> None:
    """HTTP 400 in vLLM's own error shape (ErrorResponse), as Moonshot's API answers a refused parameter."""
    logger.info("kimi_k2_neuron: refused a request: %s", message)
    payload = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": None,
                                    "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
