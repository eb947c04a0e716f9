"""The ASGI middleware (neuron/vllm_api.py) around a stand-in app: what reaches vLLM, what is answered 400 before it,
what passes untouched. Through vLLM's real server: test/nxdi_cpu/test_vllm_contract.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.neuron import vllm_api
from kimi_k2_neuron.tiny.tokenizer_files import CHAT_TEMPLATES, write_tiny_tokenizer


class App:
    """Records what it was given; answers 200 with the body it read."""

    def __init__(self):
        self.seen = []
        self.state = None

    async def __call__(self, scope, receive, send):
        message = await receive()
        self.seen.append((scope, message["body"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": message["body"]})


def call(middleware, app, path: str, body: bytes, pieces: int = 1, method: str = "POST"):
    cut = max(1, len(body) // pieces)
    messages = [{"type": "http.request", "body": body[i:i + cut], "more_body": i + cut < len(body)}
                for i in range(0, len(body), cut)] or [{"type": "http.request", "body": b"", "more_body": False}]
    sent = []

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "app": app,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    asyncio.run(middleware(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A middleware over App, vLLM's state naming a tokenizer folder with the given release's template."""
    monkeypatch.delenv(vllm_api.CONTRACT_ENV, raising=False)

    def make(release: str):
        folder = tmp_path / release
        write_tiny_tokenizer(folder, chat_template=CHAT_TEMPLATES[release])
        app = App()
        app.state = SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(tokenizer=str(folder))))
        return vllm_api.KimiApi(app), app
    return make


def test_chat_requests_are_rewritten_and_their_length_header_follows(served):
    middleware, app = served("k2.6")
    body = json.dumps({"model": "kimi", "messages": [{"role": "user", "content": "hi"}],
                       "thinking": {"type": "disabled"}}).encode()
    status, echoed = call(middleware, app, "/v1/chat/completions", body, pieces=3)
    assert status == 200
    got = json.loads(echoed)
    assert got["chat_template_kwargs"] == {"thinking": False} and got["temperature"] == 0.6  # K2.6: contract on
    headers = dict(app.seen[0][0]["headers"])
    assert int(headers[b"content-length"]) == len(echoed)


def test_refusals_are_400_in_vllms_error_shape_before_vllm(served):
    middleware, app = served("k2.7")
    body = json.dumps({"model": "kimi", "messages": [{"role": "user", "content": "hi"}], "top_p": 0.8}).encode()
    status, answer = call(middleware, app, "/v1/chat/completions", body)
    assert status == 400 and app.seen == []
    assert json.loads(answer) == {"error": {"message": "top_p: only 0.95 is allowed for this model (Kimi's API "
                                                       "contract) (got 0.8)", "type": "BadRequestError",
                                            "param": None, "code": 400}}


def test_other_routes_and_unreadable_bodies_pass_untouched(served):
    middleware, app = served("k2")
    for path, body, method in (("/v1/completions", b'{"prompt": "x", "top_p": 0.1}', "POST"),
                               ("/v1/chat/completions", b"not json", "POST"), ("/v1/models", b"", "GET")):
        status, echoed = call(middleware, app, path, body, method=method)
        assert (status, echoed) == (200, body)


def test_the_contract_follows_the_template_unless_the_environment_says(served, monkeypatch):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": 1.5}).encode()
    for release, env, status in (("k2", None, 200), ("k2.6", None, 400), ("k2", "on", 400), ("k2.7", "off", 200)):
        if env:
            monkeypatch.setenv(vllm_api.CONTRACT_ENV, env)
        middleware, app = served(release)
        assert call(middleware, app, "/v1/chat/completions", body)[0] == status, (release, env)
        monkeypatch.delenv(vllm_api.CONTRACT_ENV, raising=False)
    monkeypatch.setenv(vllm_api.CONTRACT_ENV, "maybe")
    with pytest.raises(KimiInputError, match="KIMI_K2_CONTRACT='maybe': expected on, off or auto"):
        vllm_api.KimiApi(App())


def test_structured_outputs_are_served_as_the_vllm_config_allows(served, monkeypatch):
    """The middleware reads once whether the server holds replies to grammars (vllm_request.grammar_refusal: the
    worker, the backend, xgrammar, the model's logits): refused with the reason where not, passed where so; on
    /v1/completions too, whose body otherwise passes as it came."""
    import importlib.metadata

    from kimi_k2_neuron.neuron import vllm_request

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.1.29")
    monkeypatch.delenv(vllm_request.COMPILED_ARTIFACTS_ENV, raising=False)
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"regex": "a+"}})
    completion = json.dumps({"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}})
    middleware, app = served("k2")  # vLLM's state without the worker (nor any of it)
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        status, answer = call(middleware, app, path, body.encode())
        assert status == 400 and "serve with --worker-cls kimi_k2_neuron.neuron.vllm_worker.KimiNeuronWorker" in \
            json.loads(answer)["error"]["message"]
    middleware, app = served("k2")
    app.state.vllm_config.parallel_config = SimpleNamespace(worker_cls=vllm_request.WORKER_CLS)
    app.state.vllm_config.structured_outputs_config = SimpleNamespace(backend="xgrammar")
    app.state.vllm_config.speculative_config = None
    status, echoed = call(middleware, app, "/v1/chat/completions", chat.encode())
    assert status == 200 and json.loads(echoed)["structured_outputs"] == {"regex": "a+"}
    assert call(middleware, app, "/v1/completions", completion.encode()) == (200, completion.encode())
