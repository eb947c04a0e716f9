"""Serving through vLLM: vLLM 0.13's own engine (LLM API and OpenAI server) -> vllm-neuron 0.2.0's platform, scheduler,
model runner and loader -> NeuronKimiK2ForCausalLM in NxD's CPU mode, registered by this package's vllm.general_plugins
entry point (neuron/vllm_plugin.py), on tiny converted checkpoints. Needs the vLLM part of `bash
scripts/build_nxdi_cpu_tier.sh VENV` (scripts/nxdi_cpu_tier/vllm_on_cpu/: the CPU platform switch and what vllm-neuron
0.2.0 needs of vLLM 0.13); skips without vLLM.

vLLM runs in child processes (vllm_support.py): the product's entry point from setup.cfg, and a test plugin that
registers the product class with compile() skipped and load() building NxD's CPU mode. What vLLM's request becomes
(the model's own NeuronConfig, or a one-line refusal) is the product's, untouched. References: `generate --backend
nxdi-cpu`'s code path (nxdi_cpu.backend.generate) on the same checkpoint, bfloat16 at TP=1.

Not here: TP > 1 through vLLM (vllm-neuron drives every rank from one worker process, NxD's CPU mode needs a process
per rank; trn2 runs it), throughput (README: benchmark_serving on trn2), sampled outputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (bash scripts/build_nxdi_cpu_tier.sh VENV adds it)")
pytest.importorskip("vllm_neuron", reason="vllm-neuron is not installed here (scripts/build_nxdi_cpu_tier.sh)")

import vllm_support as vs  # noqa: E402

from nxdi_support import cpu_options

from kimi_k2_neuron.nxdi_cpu import backend  # noqa: E402
from kimi_k2_neuron.runtime.chat import prompt_ids  # noqa: E402
from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer  # noqa: E402
from kimi_k2_neuron.testing.tool_call_streams import WEATHER  # noqa: E402

PROMPTS = [[104, 105], [72, 101, 108, 108, 111, 32, 119]]  # one batch of 2 rows of different lengths
MAX_TOKENS = 8
MAX_MODEL_LEN = 64
SERVE_LEN = 384  # the tiny tokenizer is byte-level: the chat template with a tool declared is ~300 tokens
BATCH = 2

pytestmark = pytest.mark.fp8_selective_cpu


def run_child(mode: str, args: dict, env: dict, tmp_path: Path, timeout: int = 600):
    out = tmp_path / f"{mode}-{time.monotonic_ns()}.json"
    r = subprocess.run([sys.executable, str(vs.HERE / "vllm_support.py"), mode, json.dumps(args), str(out)], env=env,
                       capture_output=True, text=True, timeout=timeout)
    return r, (json.loads(out.read_text()) if out.exists() else None)


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    return vs.write_dists(tmp_path_factory.mktemp("dists"))


@pytest.fixture(scope="module")
def reference(converted):
    """Greedy tokens of `generate --backend nxdi-cpu` (backend.generate) for PROMPTS, per expert scheme."""
    got = {}

    def get(scheme):
        if scheme not in got:
            o = cpu_options(model=str(converted[("fp8", scheme)]), dtype="bfloat16")
            g = backend.Generation(rows=PROMPTS, stop_ids=(), max_new_tokens=MAX_TOKENS)
            got[scheme] = backend.generate(o, g)[0]
        return got[scheme]
    return get


@pytest.fixture(scope="module")
def precompiled(converted, dists, tmp_path_factory):
    """scripts/compile_and_save.py --for-vllm into a folder, NEFFs aside (vllm_support.compile_child); its stdout."""
    out = tmp_path_factory.mktemp("compiled") / "tiny-b2"
    argv = ["--model", str(converted[("fp8", "fp8-blockwise")]), "--out", str(out), "--tp", "1", "--seq-len",
            str(MAX_MODEL_LEN), "--batch", str(BATCH), "--moe-prefill", "torch", "--for-vllm",
            # the reference's decode path (NxD's threshold on CPU), where the planner's trn2 model would choose for the
            # tiny shapes: in bf16 the two paths sum in another order (their equality: test_moe_decode.py, float32)
            "--moe-decode", "selective"]
    r, _ = run_child("compile", {"argv": argv}, vs.child_env(dists), tmp_path_factory.mktemp("c"))
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r.stdout


def llm_env(dists: Path, tmp_path: Path, **extra) -> tuple[dict, Path]:
    events = tmp_path / "events.jsonl"
    return vs.child_env(dists, KIMI_K2_VLLM_EVENTS=events, VLLM_ENABLE_V1_MULTIPROCESSING="0", **extra), events


def llm_args(model) -> dict:
    return {"model": str(model), "max_model_len": MAX_MODEL_LEN, "max_num_seqs": BATCH, "max_tokens": MAX_TOKENS,
            "prompts": PROMPTS}


# -- compile for serving ---------------------------------------------------------------------------------------------

def test_compile_and_save_for_vllm_writes_what_the_plugins_precompiled_branch_loads(precompiled, converted):
    out, stdout = precompiled
    nc = json.loads((out / "neuron_config.json").read_text())["neuron_config"]
    assert nc["is_continuous_batching"] is True and nc["ctx_batch_size"] == 1
    assert nc["batch_size"] == nc["tkg_batch_size"] == nc["kv_cache_batch_size"] == BATCH
    assert nc["seq_len"] == nc["max_context_length"] == MAX_MODEL_LEN and nc["tp_degree"] == 1
    assert nc["on_device_sampling_config"]["dynamic"] is True and nc["save_sharded_checkpoint"] is True
    assert nc["quantized"] is True and nc["quantization_type"] == "blockwise_symmetric"
    assert (out / "weights/tp0_sharded_checkpoint.safetensors").is_file() and (out / "kimi_k2_neuron.json").is_file()
    command = stdout.split("serve it with vLLM (docs/vllm.md):\n", 1)[1]
    model = converted[("fp8", "fp8-blockwise")].resolve()
    assert command.startswith(f"NEURON_COMPILED_ARTIFACTS={out.resolve()} vllm serve {model} \\\n")
    flags = command.replace("\\\n", " ").split()
    for flag, value in (("--tensor-parallel-size", "1"), ("--max-num-seqs", str(BATCH)),
                        ("--max-model-len", str(MAX_MODEL_LEN)), ("--dtype", "bfloat16"),
                        ("--num-gpu-blocks-override", str(BATCH)), ("--tool-call-parser", "kimi_k2_neuron")):
        assert flags[flags.index(flag) + 1] == value, flag
    assert "--no-enable-prefix-caching" in flags and "--reasoning-parser" not in flags  # not a Thinking template
    for flag, value in (("--middleware", "kimi_k2_neuron.neuron.vllm_api.KimiApi"),
                        ("--chat-template-content-format", "string")):  # Kimi's API contract (test_vllm_contract)
        assert flags[flags.index(flag) + 1] == value, flag


# -- the LLM API ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["fp8-blockwise", "fp8-per-channel"])
def test_llm_api_batch_2_greedy_equals_generate(scheme, converted, reference, dists, tmp_path):
    """The plugin's compile branch: vLLM's request rebuilt by the model (compile() skipped), loaded from the
    checkpoint; two sequences prefilled one per call into their cache lines, then decoded together. The converted
    config.json says model_type kimi_k2, which vLLM and NxDI's load_pretrained_config read only through the
    AutoConfig the entry point registers."""
    env, events = llm_env(dists, tmp_path)
    r, tokens = run_child("llm", llm_args(converted[("fp8", scheme)]), env, tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    assert tokens == reference(scheme)
    assert [e["event"] for e in vs.events(events)] == ["init", "init", "compile", "load", "checkpoint_loader_fn"]


def test_the_precompiled_branch_gives_the_same_tokens(precompiled, converted, reference, dists, tmp_path):
    """NEURON_COMPILED_ARTIFACTS = the folder compile_and_save --for-vllm wrote: loaded from NxD's pre-sharded
    weights, the checkpoint's tensors never read, nothing compiled."""
    out, _ = precompiled
    env, events = llm_env(dists, tmp_path, NEURON_COMPILED_ARTIFACTS=out)
    r, tokens = run_child("llm", llm_args(converted[("fp8", "fp8-blockwise")]), env, tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    assert tokens == reference("fp8-blockwise")
    seen = vs.events(events)
    assert [e["event"] for e in seen] == ["init", "load"]
    # two configs are built, each through the rules once: the request's, and NxDI's reload of the folder's
    assert [e["event"] for e in vs.events(events, rules=True)].count("rules_check") == 2
    assert seen[0]["precompiled"] and seen[1]["presharded"] and seen[1]["path"] == str(out)


# -- registration and start-up refusals ------------------------------------------------------------------------------

def test_the_entry_point_registers_the_model_in_vllms_engine_core_process(tiny, dists, tmp_path):
    """Only the product's entry point (no test plugin), the engine core in its own process: vllm-neuron finds
    NeuronKimiK2ForCausalLM there, whose refusal of a raw checkpoint comes back from that process."""
    env = vs.child_env(vs.write_dists(tmp_path / "only-product", test_plugin=False), VLLM_ENABLE_V1_MULTIPROCESSING="1")
    r, _ = run_child("llm", llm_args(tiny["fp8"]), env, tmp_path)
    assert r.returncode != 0
    want = f"KimiInputError: serving {tiny['fp8']} with --tensor-parallel-size 1 --max-num-seqs {BATCH}"
    lines = [line for line in r.stderr.splitlines() if want in line]
    assert lines and all("EngineCore" in line for line in lines), r.stderr[-4000:]
    assert "a raw (unconverted) checkpoint; serve the converted one: kimi-k2-neuron convert" in lines[-1]


def test_startup_refusals_are_one_line_before_any_weights_load(precompiled, converted, tiny, dists, tmp_path):
    """vllm-neuron's get_neuron_model, as its model runner calls it at start-up, on vLLM configs the model cannot
    serve: each ends in one line naming the flag, before the application is constructed (nothing loaded)."""
    out, _ = precompiled
    blockwise, per_channel = (str(converted[("fp8", s)]) for s in ("fp8-blockwise", "fp8-per-channel"))
    pre = {"NEURON_COMPILED_ARTIFACTS": str(out)}
    cases = [
        ("raw checkpoint", {"model": str(tiny["fp8"])}, "a raw (unconverted) checkpoint"),
        ("prefix caching, no pool", {"engine": {"enable_prefix_caching": True, "block_size": 16}},
         "--enable-prefix-caching: give --num-gpu-blocks-override, at least"),
        ("prefix caching, contiguous folder", {"env": pre, "engine": {"enable_prefix_caching": True, "block_size": 16,
                                                                      "num_gpu_blocks_override": 8}},
         "--enable-prefix-caching, compiled without the block KV layout"),
        ("chunked prefill", {"env": {"DISABLE_NEURON_CUSTOM_SCHEDULER": "1"}, "engine": {
            "enable_chunked_prefill": True, "block_size": 16, "max_num_batched_tokens": 64,
            "additional_config": {"override_neuron_config": {"chunked_prefill_config": {"max_num_seqs": 2}}}}},
         "unset DISABLE_NEURON_CUSTOM_SCHEDULER"),
        ("float16", {"engine": {"dtype": "float16"}}, "--dtype float16: Kimi-K2 runs in bfloat16"),
        ("max_num_seqs", {"env": pre, "engine": {"max_num_seqs": 4}}, "--max-num-seqs 4 > the compiled batch 2"),
        ("max_model_len", {"env": pre, "engine": {"max_model_len": 128}},
         "--max-model-len 128 > the compiled seq_len 64"),
        ("tp", {"env": pre, "engine": {"tensor_parallel_size": 2}}, "--tensor-parallel-size 2, compiled for TP 1"),
        ("another conversion", {"env": pre, "model": per_channel}, "compiled from another conversion"),
    ]
    args = {"cases": [{"name": name, "model": blockwise, **case} for name, case, _ in cases]}
    env = vs.child_env(dists, KIMI_K2_VLLM_EVENTS=tmp_path / "events.jsonl")
    r, results = run_child("refusals", args, env, tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    for (name, _, words), got in zip(cases, results):
        assert got["error"] == "KimiInputError", (name, got)
        assert words in got["message"] and "\n" not in got["message"], (name, got["message"])
        assert got["events"] == [], (name, got["events"])  # the application was never constructed


# -- the OpenAI server ----------------------------------------------------------------------------------------------

def test_vllm_serve_answers_chat_streamed_chat_and_tools(converted, dists, tmp_path):
    model = converted[("fp8", "fp8-blockwise")]
    kimi = KimiTokenizer.from_dir(model)
    tokenizer = vs.write_hf_tokenizer(model, tmp_path / "hf-tokenizer")
    stops = sorted(kimi.stop_ids([257]))  # config.json's [EOS] and <|im_end|>, as generate stops
    prompt = prompt_ids(kimi, ["Hello, Kimi!"])[0]
    want = backend.generate(cpu_options(model=str(model), dtype="bfloat16"),
                            backend.Generation(rows=[prompt], stop_ids=tuple(stops), max_new_tokens=MAX_TOKENS))[0][0]
    events = tmp_path / "events.jsonl"
    server = vs.Server(model, tokenizer, vs.child_env(dists, KIMI_K2_VLLM_EVENTS=events), tmp_path / "serve.log",
                       SERVE_LEN, BATCH)
    try:
        server.wait_ready()
        assert [m["id"] for m in server.get("/v1/models")["data"]] == ["kimi"]
        chat = {"model": "kimi", "messages": [{"role": "user", "content": "Hello, Kimi!"}], "temperature": 0,
                "max_tokens": MAX_TOKENS, "stop_token_ids": stops, "return_token_ids": True}
        reply = server.post("/v1/chat/completions", chat)
        choice = reply["choices"][0]
        assert reply["prompt_token_ids"] == prompt  # the HF tokenizer and template render what KimiTokenizer does
        # the tokens; the text of a random tiny model's bytes is not UTF-8, which vLLM's detokenizer holds back
        assert choice["token_ids"] == want and choice["finish_reason"] in ("stop", "length")

        streamed = server.post("/v1/chat/completions", {**chat, "stream": True}, stream=True)
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed if c["choices"])
        assert text == choice["message"]["content"]

        tools = server.post("/v1/chat/completions", {**chat, "tools": [WEATHER], "tool_choice": "auto"})
        message = tools["choices"][0]["message"]
        assert message["role"] == "assistant" and isinstance(message.get("tool_calls", []), list)
        for call in message.get("tool_calls") or []:
            json.loads(call["function"]["arguments"])
        with_tools = kimi.encode(kimi.apply_chat_template([{"role": "user", "content": "Hello, Kimi!"}],
                                                          tools=[WEATHER]))
        assert tools["prompt_token_ids"] == with_tools
    finally:
        rc = server.stop()
    assert rc is not None
    inits = [e for e in vs.events(events) if e["event"] == "init"]
    assert inits and all(e["pid"] != server.proc.pid for e in inits)  # the model ran in vLLM's engine-core process
