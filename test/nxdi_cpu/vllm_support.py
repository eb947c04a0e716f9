"""vLLM 0.13 through vllm-neuron 0.2.0 driving NeuronKimiK2ForCausalLM in NxD's CPU mode: test infrastructure of
test_vllm_serving.py (needs the vLLM part of `bash scripts/build_nxdi_cpu_tier.sh VENV`, whose plugins,
scripts/nxdi_cpu_tier/vllm_on_cpu/, make the public plugin run on vLLM 0.13 without Neuron devices).

vLLM runs in child processes that find their plugins through entry points on PYTHONPATH (nothing is installed):
- `kimi_k2_neuron`: a .dist-info whose entry points are setup.cfg's, so the product's own vllm.general_plugins entry
  point (neuron/vllm_plugin.py) is what vLLM loads, as from an installed package;
- `kimi_k2_neuron_cpu_test` (this module's register()): CpuKimiK2ForCausalLM into MODEL_TYPES, the registered class
  with compile() skipped (no ModelBuilder trace, no neuronx-cc on CPU) and load() building NxD's CPU mode (to_cpu;
  from NxD's pre-sharded files in a folder that holds them). It keeps everything else of the product class, the
  config vllm-neuron's request turns into included; it logs what vLLM called to $KIMI_K2_VLLM_EVENTS.

`python vllm_support.py llm|refusals|compile ARGS_JSON OUT_JSON` is the child: LLM(...).generate on token ids,
vllm-neuron's get_neuron_model (what its model runner calls at start-up) on configs that must be refused, or
scripts/compile_and_save.py with NxDI's compile() minus its trace.
"""

from __future__ import annotations

import configparser
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TEST_DIST = "kimi_k2_neuron_cpu_test"
EVENTS_ENV = "KIMI_K2_VLLM_EVENTS"


# -- the plugins' distributions -------------------------------------------------------------------------------------

def write_dists(where: Path, test_plugin: bool = True) -> Path:
    """`where` with the package's .dist-info (setup.cfg's entry points) and, if asked, the test plugin's: a folder
    for PYTHONPATH. importlib.metadata takes the first distribution of a name on sys.path, so an installed
    kimi-k2-neuron's own entry points are shadowed by setup.cfg's."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    name, version = cfg["metadata"]["name"], cfg["metadata"]["version"]
    entry_points = "".join(f"[{group}]\n{value.strip()}\n\n" for group, value in cfg["options.entry_points"].items())
    _dist(where, name.replace("-", "_"), version, entry_points)
    if test_plugin:
        _dist(where, TEST_DIST, "0.0.0", f"[vllm.general_plugins]\n{TEST_DIST} = vllm_support:register\n")
    return where


def _dist(where: Path, name: str, version: str, entry_points: str) -> None:
    info = where / f"{name}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(entry_points)


def child_env(dists: Path, **extra) -> dict:
    """The environment of a vLLM child: the dists and this folder first on PYTHONPATH (the tier's src stays), no
    torch.distributed variables of this process, NxD CPU mode off until the model sets it."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NXD_CPU_MODE",
                        "NEURON_COMPILED_ARTIFACTS")}
    path = [str(dists), str(HERE), str(REPO / "src"), env.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(p for p in path if p), PJRT_DEVICE="CPU", KIMI_K2_VLLM_NEURON_ON_CPU="1",
               TOKENIZERS_PARALLELISM="false")
    env.update({k: str(v) for k, v in extra.items()})
    return env


# -- the test plugin (runs inside vLLM's processes) ---------------------------------------------------------------

def register() -> None:
    from neuronx_distributed_inference.utils.constants import MODEL_TYPES

    from kimi_k2_neuron.neuron.vllm_plugin import MODEL_TYPE_KEYS

    for model, task in MODEL_TYPE_KEYS:
        MODEL_TYPES.setdefault(model, {})[task] = cpu_class()
    _count_rules_checks()


def _count_rules_checks() -> None:
    """An event per rules.check in this process (a test's count of the rules' runs per build: one)."""
    from kimi_k2_neuron.neuron import rules

    if getattr(rules.check, "counted", False):
        return
    real = rules.check

    def check(cfg, spec):
        event("rules_check")
        return real(cfg, spec)

    check.counted = True
    rules.check = check


def event(name: str, **fields) -> None:
    path = os.environ.get(EVENTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"event": name, "pid": os.getpid(), **fields}) + "\n")


def events(path: Path, rules: bool = False) -> list[dict]:
    """The events written to path; rules=True keeps the rules_check ones (counted by test_run_spec, left out of the
    sequence of application steps the other tests read)."""
    seen = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [e for e in seen if rules or e["event"] != "rules_check"]


_CPU_CLASS = None


def cpu_class():
    """CpuKimiK2ForCausalLM, made once (it subclasses the harness's application, the product's with to_cpu)."""
    global _CPU_CLASS
    if _CPU_CLASS is not None:
        return _CPU_CLASS
    from kimi_k2_neuron.neuron.modeling import KimiK2InferenceConfig
    from kimi_k2_neuron.nxdi_cpu.cpu_mode import CpuKimiK2ForCausalLM as Harness

    class CpuKimiK2ForCausalLM(Harness):
        def __init__(self, model_path, config=None, neuron_config=None):
            event("init", model_path=str(model_path), precompiled=config is None)
            if config is None:  # vllm-neuron's precompiled branch: the folder's config, run in NxD's CPU mode
                config = KimiK2InferenceConfig.load(model_path)
                config.neuron_config.on_cpu = True
            super().__init__(model_path, config, neuron_config)

        def compile(self, compiled_model_path, *args, **kwargs):
            event("compile", path=str(compiled_model_path))

        def load(self, compiled_model_path, *args, **kwargs):
            weights = Path(compiled_model_path) / "weights"
            event("load", path=str(compiled_model_path), presharded=weights.is_dir(),
                  draft=getattr(self.config.fused_spec_config, "draft_model_path", None))
            return self.to_cpu(str(weights) if weights.is_dir() else None)

        def checkpoint_loader_fn(self, mmap: bool = False):
            event("checkpoint_loader_fn")
            return super().checkpoint_loader_fn(mmap)

    _CPU_CLASS = CpuKimiK2ForCausalLM
    return _CPU_CLASS


# -- the tokenizer vLLM's server reads ----------------------------------------------------------------------------

def write_hf_tokenizer(model: Path, out: Path) -> Path:
    """The tiny checkpoint's tiktoken tokenizer as a transformers fast tokenizer (tokenizer.json), for `vllm serve
    --tokenizer`: the same byte-level BPE ranks and merges (read by transformers' own TikTokenConverter), the same
    pre-tokenizer regex, every special token at its id (marked special as tokenizer_config.json marks it), the same
    chat template. The real checkpoints carry Moonshot's tokenization_kimi.py, which vLLM runs with
    --trust-remote-code."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from kimi_k2_neuron.runtime.tokenizer import KIMI_PAT_STR, KimiTokenizer

    kimi = KimiTokenizer.from_dir(model)
    specials = {name: kimi.token_to_id(name) for name in kimi.encoding.special_tokens_set}
    vocab, merges = TikTokenConverter(vocab_file=str(model / "tiktoken.model")).extract_vocab_merges_from_model(
        str(model / "tiktoken.model"))
    assert max(vocab.values()) < min(specials.values()), "special ids overlap the byte-level vocabulary"
    tk = Tokenizer(models.BPE({**vocab, **specials}, merges, fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    config = json.loads((model / "tokenizer_config.json").read_text())
    marked = {int(i): t.get("special", True) for i, t in config.get("added_tokens_decoder", {}).items()}
    for name, i in sorted(specials.items(), key=lambda kv: kv[1]):
        token = AddedToken(name, special=marked.get(i, True), normalized=False)
        tk.add_special_tokens([token]) if token.special else tk.add_tokens([token])
    assert {name: tk.token_to_id(name) for name in specials} == specials
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=kimi.bos_token, eos_token=kimi.eos_token,
                                   pad_token="[PAD]", unk_token="[UNK]")
    fast.chat_template = kimi.chat_template
    fast.save_pretrained(out)
    return out


# -- `vllm serve` ------------------------------------------------------------------------------------------------

class Server:
    """`vllm serve` in its own process group on a free local port; stop() ends the group and waits."""

    def __init__(self, model: Path, tokenizer: Path, env: dict, log: Path, max_model_len: int, max_num_seqs: int,
                 extra: tuple[str, ...] = (), neuron_override: dict | None = None,
                 cache=None):
        """cache: the RunSpec whose cache flags to serve with (vllm_request.cache_flags: its prefix caching, block
        size and pool); default the contiguous cache at max_num_seqs."""
        from kimi_k2_neuron.neuron.spec import RunSpec
        from kimi_k2_neuron.neuron.vllm_request import cache_flags
        from kimi_k2_neuron.runtime.ranks import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        parsers = REPO / "src/kimi_k2_neuron/neuron/vllm_parsers.py"
        cmd = [str(Path(sys.executable).parent / "vllm"), "serve", str(model), "--tokenizer", str(tokenizer),
               "--served-model-name", "kimi", "--host", "127.0.0.1", "--port", str(self.port),
               "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
               *cache_flags(cache or RunSpec(batch=max_num_seqs)), "--dtype", "bfloat16", "--enforce-eager",
               "--additional-config", json.dumps({"override_neuron_config": {"on_cpu": True,
                                                                             **(neuron_override or {})}}),
               "--enable-auto-tool-choice", "--tool-parser-plugin", str(parsers), "--tool-call-parser",
               "kimi_k2_neuron", *extra]
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited {self.proc.returncode}: {self.tail()}")
            try:
                self.get("/health")
                return
            except OSError:
                time.sleep(1)
        raise AssertionError(f"vllm serve not ready in {timeout} s: {self.tail()}")

    def tail(self) -> str:
        return Path(self.log.name).read_text()[-4000:]

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=10) as resp:
            body = resp.read()
            return json.loads(body) if body else None

    def post(self, path: str, body: dict, stream: bool = False):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            if not stream:
                return json.loads(resp.read())
            lines = [line.decode().strip() for line in resp]
        chunks = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert chunks[-1] == "[DONE]", chunks[-3:]
        return [json.loads(c) for c in chunks[:-1]]

    def call(self, body: dict, stream: bool = False) -> tuple[int, object]:
        """POST /v1/chat/completions: (HTTP status, the JSON reply or the stream's chunks) without raising on 4xx."""
        import urllib.error

        try:
            return 200, self.post("/v1/chat/completions", {**body, "stream": stream} if stream else body, stream)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.log.close()
        return self.proc.returncode


def compile_for_vllm(model: Path, out: Path, env: dict, seq_len: int, batch: int, *flags: str) -> str:
    """scripts/compile_and_save.py --for-vllm into `out` (compile_child: NEFFs aside), e.g. with flags
    ("--prefix-caching", "--block-size", "16"); -> its stdout, which ends with the `vllm serve` line."""
    argv = ["--model", str(model), "--out", str(out), "--tp", "1", "--seq-len", str(seq_len), "--batch", str(batch),
            "--moe-prefill", "torch", "--for-vllm", *flags]
    result = out.parent / f"{out.name}-compile.json"
    r = subprocess.run([sys.executable, str(HERE / "vllm_support.py"), "compile", json.dumps({"argv": argv}),
                        str(result)], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


# -- the child: vLLM itself ---------------------------------------------------------------------------------------

def llm_child(args: dict, out: str) -> None:
    """LLM(...).generate on token-id prompts, greedy, as the plugin's LLM API runs it."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=args["model"], skip_tokenizer_init=True, dtype="bfloat16", tensor_parallel_size=1,
              max_model_len=args["max_model_len"], max_num_seqs=args["max_num_seqs"],
              num_gpu_blocks_override=args["max_num_seqs"], enable_prefix_caching=False, enforce_eager=True,
              additional_config={"override_neuron_config": {"on_cpu": True}},
              speculative_config=args.get("speculative_config"))
    params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], params)
    Path(out).write_text(json.dumps([list(o.outputs[0].token_ids) for o in outs]))


def refusals_child(args: dict, out: str) -> None:
    """vllm-neuron's get_neuron_model, as its model runner calls it at start-up (NeuronxDistributedModelRunner
    .load_model), on each case's vLLM config; the error each ends with and what of the model vLLM reached."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm_neuron.worker.neuronx_distributed_model_loader import get_neuron_model

    results = []
    for case in args["cases"]:
        for k in ("NEURON_COMPILED_ARTIFACTS", "DISABLE_NEURON_CUSTOM_SCHEDULER"):
            os.environ.pop(k, None)
        os.environ.update(case.get("env", {}))
        Path(os.environ[EVENTS_ENV]).write_text("")
        result = {"name": case["name"]}
        try:
            engine = dict(skip_tokenizer_init=True, dtype="bfloat16", max_model_len=64, max_num_seqs=2,
                          enable_prefix_caching=False, enforce_eager=True)
            engine.update(case.get("engine", {}))
            vc = EngineArgs(model=case["model"], **engine).create_engine_config()
            sc = vc.scheduler_config
            if not hasattr(sc, "chunked_prefill_enabled"):
                # vLLM 0.11's name, which vllm-neuron 0.2.0 reads; its platform sets it only with its own scheduler
                # (DISABLE_NEURON_CUSTOM_SCHEDULER unset), so on 0.13 its chunked-prefill branch stops at an
                # AttributeError before the model is asked. Set from 0.13's field, as our vLLM plugin does.
                object.__setattr__(sc, "chunked_prefill_enabled", sc.enable_chunked_prefill)
            get_neuron_model(vc.model_config, vc.cache_config, vc.parallel_config, vc.scheduler_config, None,
                             vc.speculative_config, vc.additional_config or {})
            result["error"] = None
        except Exception as e:  # noqa: BLE001 -- the test reads what was raised
            result.update(error=type(e).__name__, message=str(e))
        result["events"] = [e["event"] for e in events(Path(os.environ[EVENTS_ENV]))]
        result["rules_checks"] = len(events(Path(os.environ[EVENTS_ENV]), rules=True)) - len(result["events"])
        results.append(result)
    Path(out).write_text(json.dumps(results))


def compile_child(args: dict, out: str) -> None:
    """scripts/compile_and_save.py ARGS, its compile() that of NxDI minus the ModelBuilder trace and model.pt (no
    neuronx-cc here): the config saved and NxD's pre-sharded weights written, as NxDI's compile() does after the
    trace (NXDI application_base.compile). Everything else of the script runs as on trn2."""
    import runpy

    from kimi_k2_neuron.neuron.modeling import NeuronKimiK2ForCausalLM
    from kimi_k2_neuron.nxdi_cpu import backend

    def compile_without_trace(self, compiled_model_path, debug=False, pre_shard_weights_hook=None, **kwargs):
        self.config.save(compiled_model_path)
        with backend.nxd_cpu_mode(False):  # ModelBuilder shards outside NxD's CPU mode, as on a trn2 host
            self.shard_weights(compiled_model_path, debug, pre_shard_weights_hook)

    NeuronKimiK2ForCausalLM.compile = compile_without_trace
    sys.argv = ["compile_and_save.py", *args["argv"]]
    try:
        runpy.run_path(str(REPO / "scripts/compile_and_save.py"), run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise


if __name__ == "__main__":
    mode, args_json, out_json = sys.argv[1:4]
    {"llm": llm_child, "refusals": refusals_child, "compile": compile_child}[mode](json.loads(args_json), out_json)
