"""The scripts without the Neuron SDK: --help for each, help text for every flag, bad flag values refused on one line
before any work (every integer flag walked, then a table of what the types alone cannot say); compile_and_save.py's
fit check (with a converted checkpoint's recorded block) and its one-line stop where the SDK is needed, its advice
when the kernel fails to compile, and run_inference.py's generation flags, read and checked as the CLI's."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kimi_k2_neuron import cli
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats.record import CONVERSION_KEY, LAYOUT_VERSION
from kimi_k2_neuron.formats.scheme import ExpertScheme, scheme_for
from kimi_k2_neuron.neuron import contract, sdk
from kimi_k2_neuron.tiny.checkpoint import tiny_config_dict

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "test/data/configs"
SCRIPTS = sorted(p.name for p in (REPO / "scripts").glob("*.py"))
PER_CHANNEL = {"quantized": True, "quantization_dtype": "f8e4m3",
               "quantization_type": "expert_wise_per_channel_symmetric", "quantization_per_channel_axis": 2,
               "valid_moe_tp_degrees": [1, 2, 4, 8, 16, 32, 64]}


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help_works_without_sdk(script):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--help"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout


# -- compile_and_save.py -----------------------------------------------------------------------------------------------

def _compile(*args, cache: Path | None = None):
    """compile_and_save.py with its own cache folder (KIMI_K2_NEURON_CACHE: where a raw --model would be converted)."""
    env = {**os.environ, "KIMI_K2_NEURON_CACHE": str(cache)} if cache is not None else None
    return subprocess.run([sys.executable, str(REPO / "scripts/compile_and_save.py"), *args], capture_output=True,
                          text=True, env=env)


def test_compile_checks_the_fit_before_anything_else(tmp_path):
    """The real Kimi config with a converted-checkpoint record and no tensors: the planner refuses TP=8."""
    raw = json.loads((CONFIGS / "kimi-k2-instruct-0905.json").read_text())
    rec = {"layout_version": LAYOUT_VERSION, "experts": "fp8-per-channel", "nxd": PER_CHANNEL}
    model = tmp_path / "model"  # --out apart from it: no command writes into the checkpoint it reads
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**raw, CONVERSION_KEY: rec}))
    r = _compile("--model", str(model), "--out", str(tmp_path / "c"), "--tp", "8")
    assert r.returncode == 2 and "does not fit" in r.stderr and "pass --force" in r.stderr, r.stderr


def test_compile_checks_its_output_folder_first(tiny, tmp_path, one_line_error):
    (tmp_path / "file").write_text("")
    r = _compile("--model", str(tiny["fp8"]), "--out", str(tmp_path / "file" / "c"), "--tp", "2",
                 cache=tmp_path / "cache")
    one_line_error.exit(r.returncode, r.stderr, "--out", "is a file")
    assert not (tmp_path / "cache").exists()  # nothing converted


def test_compile_plans_a_converted_checkpoint_with_its_recorded_block(tmp_path):
    """K2-Thinking converted to fp8-blockwise keeps one scale per INT4 group ([32, 1]); its converted config.json
    has no quantization_config any more, so only the record says so, and the fit check must use it."""
    from kimi_k2_neuron.neuron.fit import plan
    from kimi_k2_neuron.neuron.spec import RunSpec

    raw = json.loads((CONFIGS / "kimi-k2-thinking.json").read_text())
    raw.pop("quantization_config")
    nxd = scheme_for("fp8-blockwise", "int4", 32).nxd(raw["moe_intermediate_size"])
    rec = {"layout_version": LAYOUT_VERSION, "experts": "fp8-blockwise", "nxd": nxd}
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**raw, CONVERSION_KEY: rec}))
    r = _compile("--model", str(model), "--out", str(tmp_path / "c"), "--tp", "64", "--kv-shard", "none")
    want = plan(KimiK2Config.from_file(model), RunSpec(tp=64, scheme=ExpertScheme("fp8-blockwise", (32, 1))))
    assert want.summary() in r.stdout, r.stdout + r.stderr


def test_compile_without_the_sdk_stops_with_a_one_line_error(tiny, tmp_path):
    if not sdk.missing_neuron_packages():
        pytest.skip("the Neuron SDK is importable here")
    # torch: the tiny model is below the prefill kernels' shapes
    r = _compile("--model", str(tiny["fp8"]), "--out", str(tmp_path / "c"), "--tp", "2", "--moe-prefill", "torch")
    assert r.returncode == 2 and "(fits)" in r.stdout, r.stdout + r.stderr
    assert r.stderr.startswith("error: kimi_k2_neuron.neuron needs the AWS Neuron SDK"), r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--max-context-length", "16"], ["--shard-attn-a"], ["--shard-router"],
                                   ["--kv-shard", "sequence"], ["--prefill-chunk", "16"]],
                         ids=["max-context-length", "shard-attn-a", "shard-router", "kv-shard", "prefill-chunk"])
def test_compile_for_vllm_refuses_what_vllm_neuron_never_asks_for(tiny, tmp_path, one_line_error, flags):
    """vllm-neuron prefills up to --max-model-len in one call and builds the model from its own request, which carries
    no weight layout: refused before anything. (Both sampling placements are served: test_vllm_structured*.py.)"""
    r = _compile("--model", str(tiny["fp8"]), "--out", str(tmp_path / "c"), "--tp", "2", "--seq-len", "32",
                 "--moe-prefill", "torch", "--for-vllm", *flags)
    one_line_error.exit(r.returncode, r.stderr, flags[0], "not with --for-vllm")


@pytest.mark.parametrize("flag,field", [("--shard-router", "n_routed_experts=6"),
                                        ("--shard-attn-a", "q_lora_rank=162")])
def test_compile_refuses_an_uneven_weight_split_before_anything(tmp_path, one_line_error, flag, field):
    """NxD would pad the split layer, which neither the fused split nor the planner models (parallel.py)."""
    name, value = field.split("=")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**tiny_config_dict("fp8"), name: int(value)}))
    r = _compile("--model", str(model), "--out", str(tmp_path / "c"), "--tp", "4", "--moe-prefill", "torch", flag,
                 cache=tmp_path / "cache")
    one_line_error.exit(r.returncode, r.stderr, f"{flag} --tp 4: config.json field {field} is not divisible by 4")
    assert not (tmp_path / "c").exists() and not (tmp_path / "cache").exists()


def _compile_script(monkeypatch):
    """scripts/compile_and_save.py as a module; it sets the FP8 environment on import, undone after the test."""
    for name in contract.FP8_ENV:
        monkeypatch.delenv(name, raising=False)
    spec = importlib.util.spec_from_file_location("_compile_and_save", REPO / "scripts/compile_and_save.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failed_kernel_compile_prints_the_planners_fallback_advice(capsys, monkeypatch):
    script = _compile_script(monkeypatch)

    def fails(*args, **kwargs):
        raise RuntimeError("neuronx-cc: compilation failed")

    advice = "if neuronx-cc fails in the --moe-prefill shard-on-block kernel, these fit by the planner: ..."
    kernel_mode = SimpleNamespace(moe_prefill="shard-on-block")
    with pytest.raises(script._CompileFailed):  # exit code 1; the compiled folder is not renamed into place
        script._compile(fails, None, "/c", "/out", kernel_mode, "s", advice)
    err = capsys.readouterr().err
    assert "RuntimeError: neuronx-cc: compilation failed" in err  # NxDI's traceback first
    assert err.endswith("error: compiling with --moe-prefill shard-on-block failed (traceback above)\n" + advice
                        + "\n")
    with pytest.raises(RuntimeError):  # a mode with no kernel: the error as it is
        script._compile(fails, None, "/c", "/out", SimpleNamespace(moe_prefill="torch"), "s", advice)
    script._compile(lambda *a, **k: None, None, "/c", "/out", SimpleNamespace(moe_prefill="shard-on-block"), "s", advice)


# -- run_inference.py: the generation flags, checked before the Neuron SDK is imported ---------------------------------

def script_module(name: str):
    spec = importlib.util.spec_from_file_location(f"_script_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_inference_module():
    return script_module("run_inference")


@pytest.mark.parametrize("flags", [
    ["--prompt", "hi"],
    ["--prompt", "hi", "--prompt", "yo", "--no-chat", "--stop", "\n\n", "--stop", "END"],
    ["--prompt", "hi", "--system", "be brief", "--temperature", "0.7", "--top-p", "0.9", "--seed", "3"],
], ids=["defaults", "batch no-chat stops", "system sampling"])
def test_run_inference_reads_generation_flags_as_the_cli_does(flags):
    from kimi_k2_neuron.arguments import sampling_values

    script = run_inference_module().build_parser().parse_args(["--compiled", "c", *flags])
    ours = cli.build_parser().parse_args(["generate", "--model", "m", *flags])
    for key in ("prompt", "chat", "system", "stop", "seed", "greedy"):
        assert getattr(script, key) == getattr(ours, key), key
    assert sampling_values(script) == sampling_values(ours)
    assert script.max_new_tokens == ours.max_new_tokens


@pytest.mark.parametrize("flags, words", [
    (["--prompt", "hi", "--greedy", "--top-p", "0.5"], "--top-p: not allowed with --greedy"),
    (["--prompt", "hi", "--top-k", "3"], "--top-k: needs --temperature > 0"),
    (["--prompt", "hi", "--no-chat", "--system", "x"], "--system: not allowed with --no-chat"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens: expected an integer >= 1"),
    ([], "required: --prompt"),
], ids=["greedy top-p", "top-k alone", "system no-chat", "zero tokens", "no prompt"])
def test_run_inference_refuses_bad_flags_without_the_sdk(flags, words, capsys, one_line_error):
    try:
        rc = run_inference_module().main(["--compiled", "c", *flags])
    except SystemExit as e:  # argparse's own errors exit from parse_args, already printed on one line
        rc = e.code
    one_line_error.exit(rc, capsys.readouterr().err, words)


def test_bench_tpot_checks_its_report_path_before_the_benchmark(tmp_path, capsys, one_line_error):
    # Without the SDK too: the check comes before it, so a trn2 run cannot be thrown away at the end.
    rc = script_module("bench_tpot").main(["--compiled", str(tmp_path), "--report", "/nonexistent/dir/r.json"])
    one_line_error.exit(rc, capsys.readouterr().err, "--report /nonexistent/dir/r.json", "existing folder")


def test_bench_tpot_refuses_context_lengths_the_compiled_lengths_cannot_hold():
    """Each length is one prefill (at most the prefill bucket) followed by --decode-steps steps inside the cache (the
    prefill's token at L, the steps after it): L + steps + 1 <= seq_len. The compiled path checks this with its
    neuron_config before loading, --cpu with --seq-len before NxD is imported (test/nxdi_cpu)."""
    check = script_module("bench_tpot")._check_lengths
    args = SimpleNamespace(context_lengths=[1024, 8192], decode_steps=None)  # the default: 32 steps
    check(args, 8192 + 33, 8192, "the compiled c")  # both fit exactly
    with pytest.raises(KimiInputError, match=r"^--context-lengths 8192: with --decode-steps 32 at most 8159 \(seq_len "
                                             r"8192, the compiled c,"):
        check(args, 8192, 8192, "the compiled c")
    with pytest.raises(KimiInputError, match=r"^--context-lengths 8192: above the prefill bucket of 4096 tokens \(the "
                                             r"compiled c\); a one-shot prefill holds at most 4096 \(compile with "
                                             r"--prefill-chunk for longer prompts\)$"):
        check(args, 65536, 4096, "the compiled c")
    check(SimpleNamespace(context_lengths=None, decode_steps=None), 2, 2, "x")  # nothing to check without the flag


def test_the_host_check_names_the_disk_and_the_ram_it_needs(tmp_path, monkeypatch):
    """Before hours of work: free disk where --out goes for the pre-sharded weights (+10 % for the NEFFs), and host
    RAM for NxDI's load(), which reads every rank's file whole."""
    import shutil

    from kimi_k2_neuron import launch

    gib = 2**30
    p = SimpleNamespace(presharded_bytes=64 * 17 * gib, weight_bytes=17 * gib, tp=64)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=100 * gib))
    with pytest.raises(KimiInputError) as e:
        launch.check_host_resources(p, str(tmp_path / "compiled"))
    assert "100.0 GiB free on its disk, the pre-sharded weights need 1196.8 GiB (64 rank files of 17.00 GiB" in \
        str(e.value)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=2000 * gib))
    monkeypatch.setattr(launch, "host_memory_available", lambda: 512 * gib)
    with pytest.raises(KimiInputError, match="host RAM: 512.0 GiB available, NxDI's load.. reads all 64 rank files "
                                             "whole: 1088.0 GiB"):
        launch.check_host_resources(p, str(tmp_path / "compiled"))
    monkeypatch.setattr(launch, "host_memory_available", lambda: 2048 * gib)
    launch.check_host_resources(p, str(tmp_path / "compiled"))  # a trn2.48xlarge's 2 TiB


# -- every script's flags: help for each, and bad values refused on one line before any work ---------------------------

ALL_SCRIPTS = [s.removesuffix(".py") for s in SCRIPTS]


def _parser(name: str, monkeypatch):
    for env in contract.FP8_ENV:  # compile_and_save.py sets the FP8 environment before parsing
        monkeypatch.delenv(env, raising=False)
    return script_module(name).build_parser()


def _run_script(name: str, argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = script_module(name).main(argv)
    except SystemExit as e:  # argparse's own errors exit from parse_args, already printed on one line
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def _flags(parser):
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def test_every_script_is_walked():
    assert set(ALL_SCRIPTS) == {"bench_convert", "bench_drift", "bench_mla_decode", "bench_serving", "bench_tpot",
                                "check_kernels", "check_nxdi_api", "compile_and_save", "export_contrib",
                                "run_inference"}


@pytest.mark.parametrize("name", ALL_SCRIPTS)
def test_every_script_flag_has_help_that_shows_its_default(name, monkeypatch):
    p = _parser(name, monkeypatch)
    formatter = p._get_formatter()
    for action in _flags(p):
        assert action.help and action.help != argparse.SUPPRESS, (name, action.dest)
        if action.required or not action.option_strings or any(
                g.required and action in g._group_actions for g in p._mutually_exclusive_groups):
            continue
        assert "default" in formatter._get_help_string(action).lower(), (name, action.option_strings)


def _integer_flags():
    """(script, flag, lowest value) of every flag typed arguments.integer(lo)."""
    found = []
    for name in ALL_SCRIPTS:
        for a in _flags(script_module(name).build_parser()):
            kind = getattr(a.type, "__name__", "")
            if kind.startswith("integer >= "):
                found.append((name, a.option_strings[-1], kind))
    return found


INTEGER_FLAGS = _integer_flags()


@pytest.mark.parametrize("name, flag, kind", INTEGER_FLAGS, ids=[f"{n} {f}" for n, f, _ in INTEGER_FLAGS])
@pytest.mark.parametrize("bad", ["abc", "below", "1.5"])
def test_every_integer_flag_of_every_script_refuses_bad_values(name, flag, kind, bad, capsys, monkeypatch,
                                                               one_line_error):
    lo = int(kind.removeprefix("integer >= ").split()[0])  # "integer >= lo[ and <= hi]"
    value = str(lo - 1) if bad == "below" else bad
    _parser(name, monkeypatch)  # the FP8 environment restored after the test
    rc, out, err = _run_script(name, [flag, value], capsys)
    one_line_error.exit(rc, err, flag, f"expected an {kind}, got '{value}'")
    assert out == ""


# (script, argv, words the one error line must hold): what the flag types alone cannot say. {tmp}: an empty folder.
SCRIPT_BAD_ARGS = [
    ("bench_convert", ["--shard-gb", "0"], "--shard-gb: expected a finite number > 0"),
    ("bench_convert", ["--shard-gb", "nan"], "--shard-gb: expected a finite number > 0"),
    ("bench_convert", ["--layers", "100000"], "the benchmark writes"),  # the disk check, before building anything
    ("bench_convert", ["--frobnicate"], "unrecognized arguments: --frobnicate"),
    ("bench_mla_decode", ["--contexts", "abc"], "--contexts: expected comma-separated integers >= 1, got 'abc'"),
    ("bench_mla_decode", ["--contexts", "-5"], "--contexts: expected comma-separated integers >= 1, got '-5'"),
    ("bench_mla_decode", ["--contexts", "64,"], "--contexts: expected comma-separated integers >= 1"),
    ("bench_mla_decode", ["--config", "/nonexistent/config.json"],
     "/nonexistent: config.json not found (no such folder)"),
    ("bench_mla_decode", ["--dtype", "float16"], "--dtype: invalid choice: 'float16'"),
    ("bench_tpot", ["--compiled", "/nonexistent"], "--compiled /nonexistent: expected a folder"),
    ("bench_tpot", ["--compiled", "{tmp}", "--report", "{tmp}"], "is a directory, expected a file"),
    ("bench_tpot", ["--compiled", "{tmp}", "--model", "/nonexistent"], "/nonexistent: config.json not found"),
    ("bench_tpot", ["--cpu", "--model", "/nonexistent"], "/nonexistent: config.json not found"),
    ("bench_tpot", ["--compiled", "{tmp}", "--tp", "2"], "--tp 2: only with --cpu (a compiled folder has its own)"),
    ("bench_tpot", ["--compiled", "{tmp}", "--context-lengths", "abc"],
     "--context-lengths: expected comma-separated integers >= 2, got 'abc'"),
    ("bench_tpot", ["--compiled", "{tmp}", "--context-lengths", "1024,1"],
     "--context-lengths: expected comma-separated integers >= 2, got '1024,1'"),
    ("bench_tpot", ["--compiled", "{tmp}", "--context-lengths", "64,"], "--context-lengths: expected comma-separated"),
    ("bench_tpot", ["--compiled", "{tmp}", "--decode-steps", "8"], "--decode-steps: only with --context-lengths"),
    ("bench_tpot", ["--compiled", "{tmp}", "--context-lengths", "64", "--num-runs", "3"],
     "--num-runs: not with --context-lengths"),
    ("check_kernels", ["--kernels", "topk,mlp"], "--kernels topk,mlp: expected a comma-separated subset of"),
    ("check_kernels", ["--tokens", "1000"], "--tokens 1000: expected a multiple of 128"),
    ("check_kernels", ["--config", "/nonexistent.json"], "--config /nonexistent.json: not a file"),
    ("check_kernels", ["--nki-library", "{tmp}"], "expected an aws-neuron/nki-library checkout (d2ad3a5)"),
    # an output onto a device node is refused, never replaced (the atomic write's rename would replace /dev/null)
    ("check_kernels", ["--report", "/dev/null"], "--report /dev/null: is a character device"),
    ("check_kernels", ["--report", "{tmp}"], "--report {tmp}: is a directory, expected a file"),
    ("bench_tpot", ["--compiled", "{tmp}", "--report", "/dev/null"], "--report /dev/null: is a character device"),
    ("compile_and_save", ["--model", "{tmp}", "--out", "/dev/null", "--tp", "2"], "but /dev/null is a character"),
    # no command writes into the checkpoint it reads (logits --out, convert and bench_tpot --report refused it)
    ("compile_and_save", ["--model", "{tiny}", "--out", "{tiny}/compiled", "--tp", "2"],
     "--out {tiny}/compiled: is inside --model {tiny}, which this command reads"),
    ("compile_and_save", ["--model", "{tiny}", "--out", "{tiny}", "--tp", "2"], "--out {tiny}: is --model {tiny}"),
    ("bench_mla_decode", ["--config", "/dev/null"], "/dev/null: is a character device; expected a config.json file"),
    ("export_contrib", ["/dev/null"], "/dev/null: is a character device; expected a folder"),
    # an empty path (an unset shell variable) is refused by its flag
    ("export_contrib", [""], "DEST: expected a path, got ''"),
    ("compile_and_save", ["--model", "{tmp}", "--out", "", "--tp", "2"], "--out: expected a path, got ''"),
    ("bench_tpot", ["--cpu", "--model", "{tmp}", "--report", ""], "--report: expected a path, got ''"),
    ("check_kernels", ["--report", ""], "--report: expected a path, got ''"),
    ("check_nxdi_api", ["--nxdi", "", "--nxd", "{tmp}"], "--nxdi: expected a path, got ''"),
    ("bench_mla_decode", ["--config", ""], "--config: expected a path, got ''"),
    ("run_inference", ["--compiled", "", "--prompt", "hi"], "--compiled: expected a path, got ''"),
    ("check_nxdi_api", ["--nxdi", "/nonexistent", "--nxd", "/nonexistent"],
     "--nxdi /nonexistent: expected a neuronx-distributed-inference checkout"),
    ("check_nxdi_api", ["--nxdi", "{tmp}", "--nxd", "{tmp}"], "expected a neuronx-distributed-inference checkout"),
    ("check_nxdi_api", ["--nxdi", "{tmp}"], "required: --nxd"),
    ("compile_and_save", ["--model", "/nonexistent", "--out", "{tmp}/c", "--tp", "2"],
     "/nonexistent: config.json not found"),
    ("compile_and_save", ["--model", "{tmp}", "--out", "/proc/c", "--tp", "2"], "--out /proc/c: expected a writable"),
    ("compile_and_save", ["--lnc", "3"], "--lnc: invalid choice: 3"),
    ("compile_and_save", ["--experts", "int8"], "--experts: invalid choice: 'int8'"),
    ("export_contrib", ["/proc/contrib"], "DEST's folder (the export is written beside DEST, then renamed) /proc"),
    ("export_contrib", ["--check", "{tmp}"], "not an export"),
    ("run_inference", ["--compiled", "/nonexistent", "--prompt", "hi"], "--compiled /nonexistent: expected a folder"),
    ("run_inference", ["--cpu", "--model", "/nonexistent", "--prompt", "hi"], "/nonexistent: config.json not found"),
    ("run_inference", ["--cpu", "--prompt", "hi"], "--cpu: needs --model DIR"),
    ("run_inference", ["--compiled", "{tmp}", "--prompt", "hi", "--stop", ""], "--stop '': expected a non-empty"),
    ("run_inference", ["--compiled", "{tmp}", "--prompt", "hi", "--temperature", "nan"], "--temperature"),
    # a compiled folder carries its own layout; with --cpu the flags follow the CLI's rules
    ("run_inference", ["--compiled", "{tmp}", "--prompt", "hi", "--prefill-chunk", "8"],
     "--prefill-chunk 8: only with --cpu (a compiled folder has its own)"),
    ("bench_tpot", ["--compiled", "{tmp}", "--shard-router"], "--shard-router: only with --cpu"),
    ("bench_serving", ["--url", "http://127.0.0.1:9", "--served-model", "k", "--report", "{tmp}/r.json"],
     "--url http://127.0.0.1:9: no vLLM server answers there"),
    ("bench_serving", ["--url", "http://127.0.0.1:9", "--served-model", "k", "--report", "/proc/r.json"],
     "--report /proc/r.json"),
    ("bench_serving", ["--url", "http://127.0.0.1:9", "--served-model", "k", "--report", "{tmp}/r.json", "--config",
                       "/nonexistent.json"], "/nonexistent.json"),
    ("bench_serving", ["--url", "http://127.0.0.1:9", "--served-model", "k", "--report", "{tmp}/r.json",
                       "--workload", "agentic", "--num-prompts", "5"], "--num-prompts 5: an agentic run is whole"),
    ("run_inference", ["--cpu", "--model", "{tiny}", "--prompt", "hi", "--tp", "4", "--kv-shard", "sequence",
                       "--kv-group", "3"], "--kv-group 3: must divide --tp 4"),
    ("run_inference", ["--cpu", "--model", "{tiny}", "--prompt", "hi", "--shard-attn-a"],
     "--shard-attn-a: splits a layer across ranks; give --tp 2 or more"),
]


@pytest.mark.parametrize("name, argv, words", SCRIPT_BAD_ARGS,
                         ids=[f"{n} {' '.join(a)}"[:60] for n, a, _ in SCRIPT_BAD_ARGS])
def test_bad_script_arguments_get_one_line_before_any_work(name, argv, words, tmp_path, capsys, monkeypatch,
                                                           one_line_error, tiny):
    _parser(name, monkeypatch)
    rc, out, err = _run_script(name, [a.format(tmp=tmp_path, tiny=tiny["fp8"]) for a in argv], capsys)
    one_line_error.exit(rc, err, words.format(tmp=tmp_path, tiny=tiny["fp8"]))
    assert out == "" and list(tmp_path.iterdir()) == []
