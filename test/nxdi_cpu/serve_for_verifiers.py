"""Serve a tiny checkpoint through vLLM 0.13 + vllm-neuron 0.2.0 in NxD's CPU mode as test_vllm_contract.py does, for
Moonshot's vendor verifiers (docs/vllm.md, "The vendor verifiers"): the product's middleware and parsers, a slow
tokenizer as Kimi's is, the chat template of one release. Test infrastructure, run by hand:

    PYTHONPATH=src PJRT_DEVICE=CPU $VENV/bin/python test/nxdi_cpu/serve_for_verifiers.py ROOT MAX_MODEL_LEN RELEASE URLFILE \
        [REPLY_TOKENS]

ROOT gets the tiny FP8 checkpoint (made and converted once) and the logs; URLFILE the server's URL once it answers;
RELEASE is a make-tiny layout (k2, k2-thinking, k2.5, k2.6, k2.7). A random model never stops, so every reply is cut
at REPLY_TOKENS tokens, 8 unless given (a generation config with max_new_tokens, vLLM's server-wide cap). The
server holds replies to grammars as compile_and_save prints it (the worker, xgrammar: docs/vllm.md, "Structured
outputs"). It listens on 127.0.0.1 and runs until SIGTERM, which stops the server's process group.
"""

import json
import signal
import sys
import time
from pathlib import Path

import vllm_support as vs
from kimi_slow_tokenizer import write_slow_tokenizer

from kimi_k2_neuron.convert import convert
from kimi_k2_neuron.neuron.vllm_request import STRUCTURED_OUTPUTS_CONFIG, WORKER_CLS
from kimi_k2_neuron.tiny.checkpoint import make_tiny
from kimi_k2_neuron.tiny.tokenizer_files import CHAT_TEMPLATES, write_tiny_tokenizer

REPLY_TOKENS = 8


def main(root: Path, max_len: int, release: str, urlfile: Path, reply_tokens: int = REPLY_TOKENS) -> None:
    root.mkdir(parents=True, exist_ok=True)
    model = root / "neuron"
    if not model.exists():
        convert(make_tiny(root / "raw", quant="fp8", seed=0), model, "fp8-blockwise", progress=False)
    write_tiny_tokenizer(root / f"tok-{release}", chat_template=CHAT_TEMPLATES[release])
    tokenizer = write_slow_tokenizer(root / f"tok-{release}", root / f"slow-{release}")
    generation = root / "generation"
    generation.mkdir(exist_ok=True)
    config = json.loads((model / "generation_config.json").read_text())
    (generation / "generation_config.json").write_text(json.dumps({**config, "max_new_tokens": reply_tokens}))
    parsers = str(vs.REPO / "src/kimi_k2_neuron/neuron/vllm_parsers.py")
    # the reasoning parser where the template writes <think>, as compile_and_save's printed command has it
    thinking = ("--reasoning-parser-plugin", parsers, "--reasoning-parser", "kimi_k2_neuron") if "<think>" in \
        CHAT_TEMPLATES[release] else ()
    extra = ("--middleware", "kimi_k2_neuron.neuron.vllm_api.KimiApi", "--chat-template-content-format", "string",
             *thinking, "--trust-remote-code", "--generation-config", str(generation), "--worker-cls", WORKER_CLS,
             "--structured-outputs-config", json.dumps(STRUCTURED_OUTPUTS_CONFIG))
    server = vs.Server(model, tokenizer, vs.child_env(vs.write_dists(root / "dists")), root / f"serve-{release}.log",
                       max_len, 2, extra)
    signal.signal(signal.SIGTERM, lambda *_: (server.stop(), sys.exit(0)))
    server.wait_ready(600)
    urlfile.write_text(server.url)
    print("serving", server.url, flush=True)
    while server.proc.poll() is None:
        time.sleep(2)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), *map(int, sys.argv[5:6]))
