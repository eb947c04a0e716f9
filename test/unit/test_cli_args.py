"""The command line as people use it: bad arguments get one line and exit 2 before any model loads; --version; help
that shows every default; generate's chat default, batches of prompts, --system and --stop; the layer progress bar.
"""

from __future__ import annotations

import argparse
import configparser
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kimi_k2_neuron
from kimi_k2_neuron import cli
from kimi_k2_neuron.runtime import runner as runner_module
from kimi_k2_neuron.runtime import tp as tp_module
from kimi_k2_neuron.runtime.chat import chat_messages, cut_at_stop
from kimi_k2_neuron.runtime.runner import CpuRunner
from kimi_k2_neuron.runtime.sampling import SamplingParams
from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer

REPO = Path(__file__).resolve().parents[2]
TOO_LONG = ",".join(["1"] * 131073)  # the tiny config's max_position_embeddings is 131072

# (argv, words the one error line must hold). {model} is a tiny FP8 checkpoint, {tmp} an empty writable folder.
BAD_ARGS = [
    ([], "the following arguments are required"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    # make-tiny
    (["make-tiny"], "required: OUT"),
    (["make-tiny", "/proc/foo"], "OUT /proc/foo: expected a writable folder"),
    (["make-tiny", "{tmp}/t", "--shards", "0"], "--shards: expected an integer >= 1, got '0'"),
    (["make-tiny", "{tmp}/t", "--quant", "int8"], "--quant: invalid choice: 'int8'"),
    (["make-tiny", "{tmp}/t", "--seed", "-1"], "--seed: expected an integer >= 0"),
    (["make-tiny", "{model}/config.json/t"], "is a file"),
    # logits
    (["logits", "--model", "{model}", "--input-ids", "1,2"], "required: --out"),
    (["logits", "--model", "{model}", "--input-ids", "1,x", "--out", "{tmp}/l"], "--input-ids: expected comma"),
    (["logits", "--model", "{model}", "--input-ids", "1,600", "--out", "{tmp}/l"], "token 600 is outside"),
    (["logits", "--model", "{model}", "--input-ids", TOO_LONG, "--out", "{tmp}/l"],
     "rows of 131073 tokens need 131073 positions, expected at most max_position_embeddings=131072"),
    (["logits", "--model", "{model}", "--input-ids", "1,2", "--prefill-len", "-1", "--out", "{tmp}/l"],
     "--prefill-len: expected an integer >= 0"),
    (["logits", "--model", "{model}", "--input-ids", "1,2", "--prefill-len", "5", "--out", "{tmp}/l"],
     "--prefill-len 5 must be between 0 and the sequence length 2"),
    (["logits", "--model", "{model}", "--input-ids", "1,2", "--out", "/nonexistent/dir/x.safetensors"],
     "--out /nonexistent/dir/x.safetensors: expected a file in an existing folder"),
    (["logits", "--model", "{model}", "--input-ids", "1,2", "--out", "{tmp}"], "is a directory, expected a file"),
    (["logits", "--model", "{model}", "--input-ids", "1,2", "--out", "/proc/x.safetensors"], "refuses new files"),
    (["logits", "--model", "{model}", "--input-ids", "1,2", "--out", "{tmp}/l", "--tp", "0"],
     "--tp: expected an integer >= 1"),
    (["logits", "--model", "{model}", "--input-ids", "1,2", "--out", "{tmp}/l", "--tp", "3"],
     "num_attention_heads=4 is not divisible by 3"),
    (["logits", "--model", "{model}", "--input-ids", "1,2", "--out", "{tmp}/l", "--dtype", "float16"],
     "--dtype: invalid choice"),
    (["logits", "--model", "{tmp}/nope", "--input-ids", "1,2", "--out", "{tmp}/l"], "config.json not found"),
    # generate: the cases the issue lists first
    (["generate", "--model", "{model}", "--prompt", "hi", "--max-new-tokens", "-5"],
     "--max-new-tokens: expected an integer >= 1, got '-5'"),
    (["generate", "--model", "{model}", "--prompt", "hi", "--temperature", "-1"],
     "--temperature: expected a finite number >= 0"),
    (["generate", "--model", "{model}", "--prompt", "hi", "--temperature", "nan"], "got 'nan'"),
    (["generate", "--model", "{model}", "--prompt", "hi", "--temperature", "1", "--top-p", "1.5"],
     "--top-p: expected a finite number > 0 and <= 1"),
    (["generate", "--model", "{model}", "--prompt", "hi", "--temperature", "1", "--top-p", "0"], "--top-p"),
    (["generate", "--model", "{model}", "--prompt", "hi", "--temperature", "1", "--top-k", "-3"],
     "--top-k: expected an integer >= 0"),
    (["generate", "--model", "{model}", "--prompt", "hi", "--greedy", "--temperature", "0.9"],
     "--temperature: not allowed with --greedy"),
    (["generate", "--model", "{model}", "--prompt", "hi", "--top-k", "5"], "--top-k: needs --temperature > 0"),
    (["generate", "--model", "{model}", "--prompt", "hi", "--temperature", "0", "--top-p", "0.9"],
     "--top-p: needs --temperature > 0"),
    (["generate", "--model", "{model}"], "one of the arguments --input-ids --prompt is required"),
    (["generate", "--model", "{model}", "--prompt", "hi", "--input-ids", "1"], "not allowed with argument"),
    (["generate", "--model", "{model}", "--prompt", "hi", "--chat", "--no-chat"], "not allowed with argument"),
    (["generate", "--model", "{model}", "--prompt", "hi", "--no-chat", "--system", "be brief"],
     "--system: not allowed with --no-chat"),
    (["generate", "--model", "{model}", "--input-ids", "1,2", "--stop", "x"], "--stop: needs --prompt"),
    (["generate", "--model", "{model}", "--input-ids", "1,600"], "token 600 is outside"),
    (["generate", "--model", "{model}", "--prompt", "hi", "--max-new-tokens", "200000"],
     "+ 200000 new tokens need"),
    (["generate", "--model", "{tmp}/nope", "--prompt", "hi"], "config.json not found"),
    # convert
    (["convert", "{model}", "{tmp}/out"], "required: --experts"),
    (["convert", "{model}", "/proc/nope", "--experts", "fp8-blockwise"], "DST /proc/nope: expected a writable"),
    (["convert", "{model}", "{tmp}/out", "--experts", "fp8-blockwise", "--workers", "0"], "--workers: expected"),
    (["convert", "{tmp}/nope", "{tmp}/out", "--experts", "fp8-blockwise"], "config.json not found"),
    # demo
    (["demo", "--max-new-tokens", "0"], "--max-new-tokens: expected an integer >= 1"),
    # plan
    (["plan", "--config", "{model}/config.json", "--tp", "0", "--seq-len", "8", "--experts", "bf16"], "--tp 0"),
    (["plan", "--config", "{model}/config.json", "--tp", "2", "--experts", "bf16"],
     "one of the arguments --seq-len --max-seq-len is required"),
    (["plan", "--config", "{tmp}/nope.json", "--tp", "2", "--seq-len", "8", "--experts", "bf16"], "not found"),
]


@pytest.fixture
def no_model_load(monkeypatch):
    """Bad arguments must be refused before any model loads: loading fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(runner_module, "CpuRunner", refuse)
    monkeypatch.setattr(tp_module, "tp_logits", refuse)


def run_cli(argv, capsys) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_one_line_error(rc: int, err: str, words: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert words in lines[0], (words, lines[0])


@pytest.mark.parametrize("argv, words", BAD_ARGS, ids=[" ".join(a)[:60] for a, _ in BAD_ARGS])
def test_bad_arguments_get_one_line_before_any_load(argv, words, tiny_dirs, tmp_path, capsys, no_model_load):
    argv = [a.format(model=tiny_dirs["fp8"], tmp=tmp_path) for a in argv]
    rc, out, err = run_cli(argv, capsys)
    assert_one_line_error(rc, err, words)
    assert out == ""


def test_demo_with_an_impossible_cache_folder(monkeypatch, capsys):
    monkeypatch.setenv("KIMI_K2_NEURON_CACHE", "/proc/x")
    rc, _, err = run_cli(["demo"], capsys)
    assert_one_line_error(rc, err, "demo folder (KIMI_K2_NEURON_CACHE) /proc/x/tiny-fp8: expected a writable folder")


@pytest.mark.parametrize("argv", [
    ["convert", "{model}", "/proc/nope", "--experts", "fp8-blockwise"],
    ["generate", "--model", "{model}", "--prompt", "hi", "--temperature", "nan"],
], ids=["convert to /proc", "generate nan temperature"])
def test_the_real_process_prints_no_traceback(argv, tiny_dirs):
    argv = [a.format(model=tiny_dirs["fp8"]) for a in argv]
    r = subprocess.run([sys.executable, "-m", "kimi_k2_neuron.cli", *argv], capture_output=True, text=True)
    assert_one_line_error(r.returncode, r.stderr, "error: ")


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    assert capsys.readouterr().out.strip() == f"kimi-k2-neuron {setup['metadata']['version']}"
    assert kimi_k2_neuron.__version__ == setup["metadata"]["version"]


def _subparsers(parser):
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def _in_required_group(parser, action) -> bool:
    return any(g.required and action in g._group_actions for g in parser._mutually_exclusive_groups)


@pytest.mark.parametrize("command", list(_subparsers(cli.build_parser())))
def test_every_option_help_shows_its_default(command):
    sub = _subparsers(cli.build_parser())[command]
    formatter = sub._get_formatter()
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction) or action.required or not action.option_strings:
            continue
        if _in_required_group(sub, action):
            continue  # one of a required choice: no default to show
        shown = formatter._expand_help(action) if action.help else ""
        assert "default" in formatter._get_help_string(action).lower() and shown, (command, action.option_strings)


def test_seed_says_what_it_seeds(capsys):
    for command in ("generate", "make-tiny"):
        assert cli.main([command, "--help"]) == 0
        assert re.search(r"--seed S\s+seeds the", capsys.readouterr().out), command


# -- generate --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8(tiny_dirs):
    """The tiny FP8 checkpoint, its runner and tokenizer (loaded once for this module)."""
    d = tiny_dirs["fp8"]
    return d, CpuRunner(d), KimiTokenizer.from_dir(d)


def generate_json(capsys, model, *flags) -> dict:
    rc = cli.main(["generate", "--model", str(model), "--max-new-tokens", "6", "--json", *flags])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


def greedy_tokens(fp8, texts) -> list[list[int]]:
    _, runner, tok = fp8
    res = runner.generate([tok.encode(t) for t in texts], 6, SamplingParams(),
                          stop_ids=tok.stop_ids(runner.cfg.eos_token_ids))
    return res.tokens


@pytest.mark.parametrize("flags, system, chat", [
    ([], None, True),
    (["--chat"], None, True),  # the old spelling of the default still works
    (["--system", "Answer in French."], "Answer in French.", True),
    (["--no-chat"], None, False),
], ids=["default chat", "--chat", "--system", "--no-chat"])
def test_generate_uses_the_chat_template_by_default(fp8, capsys, flags, system, chat):
    d, _, tok = fp8
    prompt = "What is the capital of France?"
    text = tok.apply_chat_template(chat_messages(prompt, system)) if chat else prompt
    out = generate_json(capsys, d, "--prompt", prompt, *flags)
    assert out["tokens"] == greedy_tokens(fp8, [text])


def test_several_prompts_decode_as_one_batch(fp8, capsys):
    d, _, tok = fp8
    prompts = ["hi", "a much longer prompt than the first one"]
    out = generate_json(capsys, d, "--prompt", prompts[0], "--prompt", prompts[1])
    texts = [tok.apply_chat_template(chat_messages(p)) for p in prompts]
    assert out["tokens"] == greedy_tokens(fp8, texts) and len(out["text"]) == 2
    assert cli.main(["generate", "--model", str(d), "--max-new-tokens", "2", "--prompt", "hi", "--prompt", "yo"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("### hi\n") and "\n### yo\n" in printed


def test_stop_string_ends_the_row_and_cuts_the_text(fp8, capsys):
    d, _, tok = fp8
    free = generate_json(capsys, d, "--prompt", "hi")["tokens"][0]
    stop = next(s for s in (tok.decode(free[i:i + 1]) for i in range(1, len(free))) if s)
    out = generate_json(capsys, d, "--prompt", "hi", "--stop", stop)
    k = next(i for i in range(1, len(free) + 1) if stop in tok.decode(free[:i]))
    assert out["tokens"][0] == free[:k]  # the row ended with the token that completed the stop string
    assert out["text"][0] == cut_at_stop(tok.decode(free), [stop]) and stop not in out["text"][0]


def test_cut_at_stop_takes_the_earliest():
    assert cut_at_stop("abcXdefYg", ["Y", "X"]) == "abc"
    assert cut_at_stop("abc", ["Z", ""]) == "abc"


# -- progress -------------------------------------------------------------------------------------------------------


def test_layer_streamed_shows_progress_with_throughput_and_eta(tiny_dirs, capsys):
    r = CpuRunner(tiny_dirs["bf16"], layer_streamed=True, progress=True)
    r.logits([[1, 2, 3, 4]], prefill_len=2)  # one prefill + two decode passes over 3 layers
    err = capsys.readouterr().err
    assert re.search(r"logits: 3 passes x 3 layers: .*\d+/9 \[[0-9:]+<[0-9:?]+, *[0-9.?]+ ?layer/s\]", err), err


# -- scripts/run_inference.py: the same generation flags, checked before the Neuron SDK is imported -----------------


def run_inference_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_inference", REPO / "scripts" / "run_inference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    (t1, k1, p1), (t2, k2, p2) = sampling_values(script), sampling_values(ours)
    assert (t1, p1) == (t2, p2) and (k1, k2) == ((50, 0) if t1 > 0 else (0, 0))  # top-k defaults differ on purpose


@pytest.mark.parametrize("flags, words", [
    (["--prompt", "hi", "--greedy", "--top-p", "0.5"], "--top-p: not allowed with --greedy"),
    (["--prompt", "hi", "--top-k", "3"], "--top-k: needs --temperature > 0"),
    (["--prompt", "hi", "--no-chat", "--system", "x"], "--system: not allowed with --no-chat"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens: expected an integer >= 1"),
    ([], "required: --prompt"),
], ids=["greedy top-p", "top-k alone", "system no-chat", "zero tokens", "no prompt"])
def test_run_inference_refuses_bad_flags_without_the_sdk(flags, words, capsys):
    try:
        rc = run_inference_module().main(["--compiled", "c", *flags])
    except SystemExit as e:  # argparse's own errors exit from parse_args, already printed on one line
        rc = e.code
    assert_one_line_error(rc, capsys.readouterr().err, words)
