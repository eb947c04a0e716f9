"""The `kimi-k2-neuron` command as people use it: bad arguments get one line and exit 2 before any model loads;
--version; help that shows every default; each command's documented contract (make-tiny, logits, generate with its
chat default, batches of prompts, --system and --stop, convert, demo, trace-cpu, the nxdi-cpu backend without NxD)."""

from __future__ import annotations

import argparse
import configparser
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kimi_k2_neuron
from kimi_k2_neuron import cli
from kimi_k2_neuron.neuron import sdk
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
    (["make-tiny", "{tmp}/t", "--shards", "1000"], "--shards 1000: expected 1.."),  # (it wrote 53 files for 100)
    (["make-tiny", "{tmp}/t", "--quant", "int8"], "--quant: invalid choice: 'int8'"),
    (["make-tiny", "{tmp}/t", "--layout", "k3"], "--layout: invalid choice: 'k3'"),
    (["make-tiny", "{tmp}/t", "--seed", "-1"], "--seed: expected an integer >= 0"),
    (["make-tiny", "{model}/config.json/t"], "is a file"),
    # logits
    (["logits", "--model", "{model}", "--input-ids", "1,2"], "required: --out"),
    # --input-ids: an empty token or row is refused alike (it read "1,,2" as two tokens and refused "1,2,3;")
    (["logits", "--model", "{model}", "--input-ids", "1,,2", "--out", "{tmp}/l"],
     '--input-ids: expected comma-separated integers, rows separated by ";" (row 1 has an empty token)'),
    (["generate", "--model", "{model}", "--input-ids", "1,2,3;"], "(row 2 is empty), got '1,2,3;'"),
    (["generate", "--model", "{model}", "--input-ids", "1,2;,3"], "(row 2 has an empty token)"),
    # the prefill bucket is the chunk: the flag named is the one given (it said --max-context-length)
    (["plan", "--model", "{model}", "--tp", "2", "--prefill-chunk", "2048", "--seq-len", "1024"],
     "--prefill-chunk 2048: expected 1..--seq-len 1024"),
    # the long-context flags (generate: --prefill-chunk only)
    (["logits", "--model", "{model}", "--input-ids", "1,2", "--out", "{tmp}/l", "--tp", "4", "--kv-shard",
      "sequence", "--kv-group", "3"], "--kv-group 3: must divide --tp 4"),
    (["logits", "--model", "{model}", "--input-ids", "1,2", "--out", "{tmp}/l", "--tp", "2", "--kv-group", "2"],
     "--kv-group 2: only with --kv-shard sequence"),
    # the core generates in one process: the advice names the backend that runs ranks (it said --tp 2, refused next)
    (["generate", "--model", "{model}", "--input-ids", "1,2", "--kv-shard", "sequence"],
     "--kv-shard sequence: only with --backend nxdi-cpu (the core runner generates in one process; give --backend nxdi-cpu --tp N"),
    (["generate", "--model", "{model}", "--input-ids", "1,2", "--shard-router"],
     "--shard-router: only with --backend nxdi-cpu (the core runner generates in one process; give --backend nxdi-cpu --tp N"),
    (["generate", "--model", "{model}", "--input-ids", "1,2", "--tp", "2", "--shard-attn-a"],
     "--tp 2: only with --backend nxdi-cpu (the core runner generates in one process; give --backend nxdi-cpu --tp N"),
    (["logits", "--model", "{model}", "--input-ids", "1,2", "--out", "{tmp}/l", "--kv-shard", "rows"],
     "--kv-shard: invalid choice: 'rows'"),
    (["logits", "--model", "{model}", "--input-ids", "1,2", "--out", "{tmp}/l", "--prefill-chunk", "0"],
     "--prefill-chunk: expected an integer >= 1, got '0'"),
    (["trace-cpu", "--model", "{model}", "--submodel", "chunk"], "--submodel chunk: needs --prefill-chunk N"),
    (["trace-cpu", "--model", "{model}", "--submodel", "chunk", "--prefill-chunk", "8"],
     "--submodel chunk: needs --prefill-chunk N with N < --seq-len / 2"),
    (["logits", "--model", "{model}", "--input-ids", "1,2", "--out", "{tmp}/l", "--backend", "nxdi-cpu", "--tp", "4",
      "--kv-shard", "sequence", "--kv-group", "3"], "--kv-group 3: must divide --tp 4"),
    (["logits", "--model", "{model}", "--input-ids", "1,2", "--out", "{tmp}/l", "--backend", "nxdi-cpu",
      "--shard-router"], "--shard-router: splits a layer across ranks; give --tp 2 or more"),
    # a layout that would split nothing is refused, not silently replicated
    (["logits", "--model", "{model}", "--input-ids", "1,2", "--out", "{tmp}/l", "--kv-shard", "sequence"],
     "--kv-shard sequence: a KV group of 1 rank holds the whole cache"),
    (["logits", "--model", "{model}", "--input-ids", "1,2", "--out", "{tmp}/l", "--tp", "4", "--kv-shard", "sequence",
      "--kv-group", "1"], "--kv-shard sequence: a KV group of 1 rank"),
    (["logits", "--model", "{model}", "--input-ids", "1,2", "--out", "{tmp}/l", "--shard-attn-a"],
     "--shard-attn-a: splits a layer across ranks; give --tp 2 or more"),
    # what config.json decides comes before trace-cpu imports NxD and torch_xla (absent here)
    (["trace-cpu", "--model", "{model}", "--submodel", "token", "--seq-len", "200000"],
     "exceeds config.json field max_position_embeddings"),
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
    # an output onto a device node is refused, never replaced (as root, the rename made /dev/null a regular file)
    (["logits", "--model", "{model}", "--input-ids", "1,2", "--out", "/dev/null"],
     "--out /dev/null: is a character device; expected a regular file path"),
    (["make-tiny", "/dev/null"], "OUT /dev/null: expected a folder, but /dev/null is a character device"),
    (["convert", "{model}", "/dev/null/x", "--experts", "fp8-blockwise"], "but /dev/null is a character device"),
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
    # NxDI's sampler divides by the temperature in float32: one that overflows is refused, naming the smallest it takes
    (["generate", "--model", "{model}", "--prompt", "hi", "--temperature", "1e-300", "--backend", "nxdi-cpu"],
     "--temperature 1e-300: below 1e-30, the smallest NxDI's sampler takes"),
    (["generate", "--model", "{model}", "--prompt", "hi", "--temperature", "1", "--top-p", "1.5"],
     "--top-p: expected a finite number > 0 and <= 1"),
    (["generate", "--model", "{model}", "--prompt", "hi", "--temperature", "1", "--top-p", "0"], "--top-p"),
    (["generate", "--model", "{model}", "--prompt", "hi", "--temperature", "1", "--top-k", "-3"],
     "--top-k: expected an integer >= 0"),
    (["generate", "--model", "{model}", "--prompt", "hi", "--greedy", "--temperature", "0.9"],
     "--temperature: not allowed with --greedy"),
    # the rule as it is: K2.7-Code samples by default, until a sampling flag is given (it said "because greedy")
    (["generate", "--model", "{model}", "--prompt", "hi", "--top-k", "5"],
     "--top-k: needs --temperature > 0 (once a sampling flag is given, the checkpoint's generation_config.json "
     "sampling no longer applies, and without --temperature decoding is greedy and ignores --top-k)"),
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
    (["plan", "--config", "{model}/config.json", "--tp", "0", "--seq-len", "8", "--experts", "bf16"],
     "--tp: expected an integer >= 1, got '0'"),
    (["plan", "--config", "{model}/config.json", "--tp", "2", "--experts", "bf16"],
     "--seq-len: required (or --max-seq-len)"),
    (["plan", "--config", "{tmp}/nope.json", "--tp", "2", "--seq-len", "8", "--experts", "bf16"],
     "nope.json: not found (expected a config.json)"),
    (["plan", "--model", "{model}/config.json", "--tp", "2", "--seq-len", "8"],
     "--model: {model}/config.json: is a file; expected a checkpoint folder (the one holding config.json)"),
    # every command that reads a checkpoint folder names the flag given a file (a new user's slip)
    (["generate", "--model", "{model}/config.json", "--prompt", "hi"], "--model: {model}/config.json: is a file"),
    (["logits", "--model", "{model}/config.json", "--input-ids", "1,2"], "--model: {model}/config.json: is a file"),
    (["trace-cpu", "--model", "{model}/config.json"], "--model: {model}/config.json: is a file"),
    (["convert", "{model}/config.json", "{tmp}/out"], "SRC: {model}/config.json: is a file"),
    ([], "required: {make-tiny,logits,generate,convert,demo,plan,trace-cpu}"),
    # generate
    (["generate", "--model", "{model}", "--prompt", "hi", "--stop", ""], "--stop '': expected a non-empty string"),
    # convert: DST apart from SRC, or it writes among (or, redone, deletes) the files it reads
    (["convert", "{model}", "{model}/sub", "--experts", "fp8-blockwise"], "/sub: is inside SRC"),
    (["convert", "{model}", "{model}", "--experts", "fp8-blockwise"], "is SRC"),
    (["convert", "{model}", "{model}/..", "--experts", "fp8-blockwise"], "holds SRC"),
    # an empty path (an unset shell variable) is refused by its flag, not taken for the current folder (it said
    # "DST .: holds SRC", "--out .: is a directory", "config.json: config.json not found"; plan --model '': a traceback)
    (["convert", "{model}", "", "--experts", "fp8-blockwise"], "DST: expected a path, got '' (an unset shell"),
    (["convert", "", "{tmp}/c", "--experts", "fp8-blockwise"], "SRC: expected a path, got ''"),
    (["make-tiny", ""], "OUT: expected a path, got ''"),
    (["make-tiny", "{tmp}/d", "--draft-for", ""], "--draft-for: expected a path, got ''"),
    (["logits", "--model", "{model}", "--input-ids", "1,2", "--out", ""], "--out: expected a path, got ''"),
    (["generate", "--model", "", "--prompt", "hi"], "--model: expected a path, got ''"),
    (["generate", "--model", "{model}", "--prompt", "hi", "--backend", "nxdi-cpu", "--draft", " "],
     "--draft: expected a path, got ' '"),
    (["plan", "--model", "", "--tp", "2", "--seq-len", "8"], "--model: expected a path, got ''"),
    (["plan", "--config", "", "--tp", "2", "--seq-len", "8"], "--config: expected a path, got ''"),
    (["plan", "--config", "/dev/null", "--tp", "2", "--seq-len", "8"],
     "/dev/null: is a character device; expected a config.json file"),
    (["trace-cpu", "--model", "", "--submodel", "token"], "--model: expected a path, got ''"),
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


@pytest.mark.parametrize("argv, words", BAD_ARGS, ids=[" ".join(a)[:60] for a, _ in BAD_ARGS])
def test_bad_arguments_get_one_line_before_any_load(argv, words, tiny, tmp_path, capsys, no_model_load,
                                                    one_line_error):
    argv = [a.format(model=tiny["fp8"], tmp=tmp_path) for a in argv]
    rc, out, err = run_cli(argv, capsys)
    one_line_error.exit(rc, err, words.replace("{model}", str(tiny["fp8"])))
    assert out == ""


def test_demo_with_an_incomplete_cached_checkpoint(monkeypatch, tmp_path, capsys, one_line_error):
    (tmp_path / "tiny-fp8").mkdir()
    (tmp_path / "tiny-fp8" / "model-00001-of-00002.safetensors").write_bytes(b"")
    monkeypatch.setenv("KIMI_K2_NEURON_CACHE", str(tmp_path))
    rc, _, err = run_cli(["demo"], capsys)
    one_line_error.exit(rc, err, "tiny-fp8: the demo's cached checkpoint is incomplete", "delete that folder")


def test_demo_with_an_impossible_cache_folder(monkeypatch, capsys, one_line_error):
    monkeypatch.setenv("KIMI_K2_NEURON_CACHE", "/proc/x")
    rc, _, err = run_cli(["demo"], capsys)
    one_line_error.exit(rc, err, "demo folder (KIMI_K2_NEURON_CACHE) /proc/x/tiny-fp8: expected a writable folder")


@pytest.mark.parametrize("argv", [
    ["convert", "{model}", "/proc/nope", "--experts", "fp8-blockwise"],
    ["generate", "--model", "{model}", "--prompt", "hi", "--temperature", "nan"],
], ids=["convert to /proc", "generate nan temperature"])
def test_the_real_process_prints_no_traceback(argv, tiny, one_line_error):
    argv = [a.format(model=tiny["fp8"]) for a in argv]
    r = subprocess.run([sys.executable, "-m", "kimi_k2_neuron.cli", *argv], capture_output=True, text=True)
    one_line_error.exit(r.returncode, r.stderr, "error: ")


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


# -- make-tiny, logits, convert, demo, trace-cpu -----------------------------------------------------------------------

def test_make_tiny_cli_and_refuses_existing(tmp_path, capsys):
    out = tmp_path / "t"
    assert cli.main(["make-tiny", str(out), "--quant", "int4", "--shards", "4", "--seed", "3"]) == 0
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert cli.main(["make-tiny", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli.main(["make-tiny", str(tmp_path / "k27"), "--layout", "k2.7"]) == 0
    assert "wrote a tiny k2.7 checkpoint (int4)" in capsys.readouterr().out
    assert "text_config" in json.loads((tmp_path / "k27" / "config.json").read_text())


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is importable here")
def test_trace_cpu_without_torch_xla_is_a_one_line_error(tiny, capsys):
    assert cli.main(["trace-cpu", "--model", str(tiny["fp8"]), "--submodel", "token"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: trace-cpu needs NxD, NxDI and torch_xla") and "torch_xla" in err.split(":", 2)[2]
    assert "bash scripts/build_nxdi_cpu_tier.sh VENV" in err and err.count("\n") == 1


def test_logits_cli_contract(tiny, tmp_path):
    out = tmp_path / "l.safetensors"
    assert cli.main(["logits", "--model", str(tiny["fp8"]), "--input-ids", "1,2,3,4;5,6,7,8", "--prefill-len", "2",
                 "--out", str(out)]) == 0
    logits = load_file(out)["logits"]
    assert logits.dtype == torch.float32 and logits.shape == (2, 4, 512)
    assert torch.equal(logits, CpuRunner(tiny["fp8"]).logits([[1, 2, 3, 4], [5, 6, 7, 8]], 2))


def test_cli_convert(tiny, tmp_path, capsys):
    assert cli.main(["convert", str(tiny["bf16"]), str(tmp_path / "o"), "--experts", "fp8-per-channel"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "bf16 -> fp8-per-channel" in out and "GB/s" in out
    assert cli.main(["convert", str(tiny["bf16"]), str(tmp_path / "o2"), "--experts", "fp8-blockwise",
                     "--workers", "0"]) == 2


def test_convert_says_at_once_when_the_tokenizer_is_missing(tiny, tmp_path, capsys):
    src = Path(shutil.copytree(tiny["fp8"], tmp_path / "src"))
    assert cli.main(["convert", str(src), str(tmp_path / "o"), "--experts", "fp8-blockwise"]) == 0
    assert capsys.readouterr().err == ""
    (src / "tiktoken.model").unlink()
    assert cli.main(["convert", str(src), str(tmp_path / "o2"), "--experts", "fp8-blockwise"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"note: {src} has no tiktoken.model: "), err


def test_a_damaged_demo_cache_names_the_folder_and_the_fix(tiny, tmp_path, monkeypatch, capsys, one_line_error):
    monkeypatch.setenv("KIMI_K2_NEURON_CACHE", str(tmp_path))
    cached = Path(shutil.copytree(tiny["fp8"], tmp_path / "tiny-fp8"))
    shard = sorted(cached.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])  # a download or disk fault cut it short
    rc, _, err = run_cli(["demo"], capsys)
    one_line_error.exit(rc, err, shard.name, f"the demo's cached checkpoint {cached} is damaged",
                        "delete that folder and the demo makes it again")


@pytest.mark.slow
def test_demo_runs_and_matches_transformers(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KIMI_K2_NEURON_CACHE", str(tmp_path))
    assert cli.main(["demo", "--max-new-tokens", "4"]) == 0
    text = capsys.readouterr().out
    assert "tokens/s" in text
    diff = float(text.split("max |logit difference| vs transformers")[1].split(": ")[1].split()[0])
    assert diff < 1e-3


# -- generate ----------------------------------------------------------------------------------------------------------

def test_generate_cli_json(tiny, capsys):
    assert cli.main(["generate", "--model", str(tiny["fp8"]), "--prompt", "hello", "--chat", "--max-new-tokens",
                     "4", "--temperature", "0.7", "--top-k", "50", "--top-p", "0.9", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 1 <= len(out["tokens"][0]) <= 4 and isinstance(out["text"][0], str)


@pytest.mark.slow
def test_generate_with_the_long_context_flags_gives_the_same_tokens(tiny, capsys):
    """`generate --prefill-chunk 2` prefills the 5-token prompt in 3 calls: the tokens of the one-shot prefill."""
    want = generate_json(capsys, tiny["fp8"], "--input-ids", "5,17,300,42,256")["tokens"]
    got = generate_json(capsys, tiny["fp8"], "--input-ids", "5,17,300,42,256", "--prefill-chunk", "2")["tokens"]
    assert got == want and len(got[0]) == 6


@pytest.fixture(scope="module")
def fp8(tiny):
    """The tiny FP8 checkpoint, its runner and tokenizer (loaded once for this module)."""
    d = tiny["fp8"]
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


# -- --backend nxdi-cpu without NxD ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", [
    [sys.executable, "-m", "kimi_k2_neuron.cli", "logits", "--backend", "nxdi-cpu", "--input-ids", "1,2", "--out",
     "{tmp}/l.safetensors"],
    [sys.executable, "-m", "kimi_k2_neuron.cli", "generate", "--backend", "nxdi-cpu", "--input-ids", "1,2"],
    [sys.executable, str(REPO / "scripts/run_inference.py"), "--cpu", "--prompt", "hi"],
    [sys.executable, str(REPO / "scripts/bench_tpot.py"), "--cpu"],
], ids=["logits", "generate", "run_inference", "bench_tpot"])
def test_nxdi_cpu_without_nxd_is_one_line_naming_what_is_missing_and_the_setup(tiny, tmp_path, cmd):
    if not sdk.missing_neuron_packages():
        pytest.skip("NxD/NxDI are importable here")
    cmd = [c.replace("{tmp}", str(tmp_path)) for c in cmd] + ["--model", str(tiny["fp8"])]
    r = subprocess.run(cmd, capture_output=True, text=True)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("error: "), r.stderr
    assert "neuronx-distributed-inference" in err[0] and "docs/nxdi_on_cpu.md" in err[0]
    assert "bash scripts/build_nxdi_cpu_tier.sh VENV" in err[0]


@pytest.mark.parametrize("cmd, words", [
    ([sys.executable, "-m", "kimi_k2_neuron.cli", "logits", "--backend", "nxdi-cpu", "--input-ids", "1,2", "--out",
      "{tmp}/l.safetensors", "--tp", "3"], "--tp 3"),
    ([sys.executable, "-m", "kimi_k2_neuron.cli", "generate", "--backend", "nxdi-cpu", "--input-ids", "1,2", "--tp",
      "3"], "--tp 3"),
    ([sys.executable, "-m", "kimi_k2_neuron.cli", "generate", "--backend", "nxdi-cpu", "--input-ids", "1,2", "--tp",
      "2", "--dtype", "bfloat16"], "gloo has no bfloat16"),
    ([sys.executable, "-m", "kimi_k2_neuron.cli", "trace-cpu", "--submodel", "token", "--tp", "3"], "--tp 3"),
    ([sys.executable, str(REPO / "scripts/run_inference.py"), "--cpu", "--prompt", "hi", "--tp", "3"], "--tp 3"),
    ([sys.executable, str(REPO / "scripts/bench_tpot.py"), "--cpu", "--tp", "3"], "--tp 3"),
    ([sys.executable, str(REPO / "scripts/bench_tpot.py"), "--cpu", "--seq-len", "200000"],
     "--seq-len 200000: exceeds config.json field max_position_embeddings"),
], ids=["logits", "generate", "generate bf16", "trace-cpu", "run_inference", "bench_tpot", "bench_tpot seq-len"])
def test_what_config_json_refuses_comes_before_nxd_is_imported(tiny, tmp_path, cmd, words, one_line_error):
    """The tiny config's 4 heads do not split 3 ways: one line, and (with NxD importable or not) none of NxD's import
    output, nor its absence, before it."""
    cmd = [c.replace("{tmp}", str(tmp_path)) for c in cmd] + ["--model", str(tiny["fp8"])]
    r = subprocess.run(cmd, capture_output=True, text=True)
    one_line_error.exit(r.returncode, r.stderr, words)


# -- what a command writes: never its own input, the modes a plain write gets, a full disk in one line ---------------

@pytest.mark.parametrize("inside", ["config.json", "model-00001-of-00003.safetensors", "new.safetensors"])
def test_logits_never_writes_into_the_checkpoint_it_reads(ckpt, tmp_path, capsys, inside, one_line_error):
    model = ckpt("fp8")
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    link = tmp_path / "through-a-link"
    link.symlink_to(model)
    for out in (model / inside, link / inside):
        rc, _, err = run_cli(["logits", "--model", str(link if out.parent == model else model), "--input-ids", "1,2",
                              "--out", str(out)], capsys)
        one_line_error.exit(rc, err, f"--out {out}: is inside --model", "which this command reads")
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


def _full_disk(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize("command", ["make-tiny", "logits", "demo"])
def test_a_full_disk_is_one_line(command, tiny, tmp_path, monkeypatch, capsys, one_line_error):
    """safetensors reports ENOSPC as its own SafetensorError (seen on a 100 KiB tmpfs: a 3-line traceback ending in
    "No space left on device (os error 28)"); every command that writes one says so in one line, and leaves no file."""
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", _full_disk)
    monkeypatch.setenv("KIMI_K2_NEURON_CACHE", str(tmp_path / "cache"))
    argv, where = {"make-tiny": (["make-tiny", str(tmp_path / "t")], tmp_path / "t"),
                   "logits": (["logits", "--model", str(tiny["fp8"]), "--input-ids", "1,2", "--out",
                               str(tmp_path / "l.safetensors")], tmp_path / "l.safetensors"),
                   "demo": (["demo"], tmp_path / "cache" / "tiny-fp8")}[command]
    rc, out, err = run_cli(argv, capsys)
    one_line_error.exit(rc, err, f"{where}: cannot write (disk full)")
    assert not where.exists() and not [p for p in where.parent.iterdir() if p.name.startswith(f".{where.name}")]


def test_make_tiny_with_a_full_disk_in_a_plain_write(tmp_path, monkeypatch, capsys, one_line_error):
    import errno

    real = Path.write_text

    def write_text(self, *args, **kwargs):
        if self.name == "config.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    rc, _, err = run_cli(["make-tiny", str(tmp_path / "t")], capsys)
    one_line_error.exit(rc, err, f"{tmp_path / 't'}: cannot write (disk full)")


@pytest.mark.parametrize("umask", [0o002, 0o022, 0o077])
def test_outputs_get_the_modes_a_plain_write_gets(umask, tiny, tmp_path, capsys):
    """safetensors creates its files 0600, and a temporary folder is 0700: the outputs of make-tiny and logits had
    those modes whatever the umask; now as `touch` and `mkdir` would make them."""
    old = os.umask(umask)
    try:
        assert run_cli(["make-tiny", str(tmp_path / "t")], capsys)[0] == 0
        assert run_cli(["logits", "--model", str(tiny["fp8"]), "--input-ids", "1,2", "--out",
                        str(tmp_path / "l.safetensors")], capsys)[0] == 0
    finally:
        os.umask(old)
    assert (tmp_path / "t").stat().st_mode & 0o777 == 0o777 & ~umask
    for f in [*(tmp_path / "t").iterdir(), tmp_path / "l.safetensors"]:
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f


# -- the last tracebacks: a broken chat template, a seed past 64 bits, links that lead nowhere ------------------------

def test_a_chat_template_that_does_not_parse_is_one_line(ckpt, capsys, one_line_error):
    model = ckpt("fp8")
    (model / "chat_template.jinja").write_text("{{ messages[0]['content'] }}\n{% if %}\n")
    rc, out, err = run_cli(["generate", "--model", str(model), "--prompt", "hi"], capsys)
    one_line_error.exit(rc, err, f"{model / 'chat_template.jinja'}: the chat template does not parse (line 2: ",
                        "expected a Jinja template")
    assert out == ""


@pytest.mark.parametrize("argv", [["generate", "--model", "{model}", "--prompt", "hi", "--temperature", "1"],
                                  ["make-tiny", "{tmp}/t"]], ids=["generate", "make-tiny"])
def test_a_seed_past_64_bits_is_refused(argv, tiny, tmp_path, capsys, one_line_error):
    """torch.Generator.manual_seed takes an unsigned 64-bit seed (it raised 'Overflow when unpacking long long')."""
    argv = [a.format(model=tiny["fp8"], tmp=tmp_path) for a in argv]
    rc, _, err = run_cli([*argv, "--seed", str(2**64)], capsys)
    one_line_error.exit(rc, err, "--seed: expected an integer >= 0 and <= 18446744073709551615, got "
                                 "'18446744073709551616'")


def test_the_largest_seed_samples(tiny, capsys):
    rc, out, _ = run_cli(["generate", "--model", str(tiny["fp8"]), "--input-ids", "1,2", "--temperature", "1",
                          "--max-new-tokens", "2", "--seed", str(2**64 - 1)], capsys)
    assert rc == 0 and len(out.strip().split(",")) == 2


@pytest.mark.parametrize("argv, words", [
    (["convert", "{model}", "{tmp}/dangling", "--experts", "fp8-blockwise"],
     "DST {tmp}/dangling: {tmp}/dangling is a symbolic link to {tmp}/nowhere, which does not exist"),
    (["make-tiny", "{tmp}/dangling/t"], "OUT {tmp}/dangling/t: {tmp}/dangling is a symbolic link to {tmp}/nowhere"),
    (["convert", "{tmp}/loop", "{tmp}/dst", "--experts", "fp8-blockwise"], "SRC {tmp}/loop: a symbolic link loop"),
    (["logits", "--model", "{tmp}/loop", "--input-ids", "1", "--out", "{tmp}/l"], "{tmp}/loop: a symbolic link loop"),
    (["plan", "--model", "{tmp}/loop", "--tp", "1", "--seq-len", "8"], "{tmp}/loop: a symbolic link loop"),
    (["logits", "--model", "{model}", "--input-ids", "1", "--out", "{tmp}/loop/l"],
     "{tmp}/loop is a symbolic link loop"),
], ids=["convert DST dangling", "make-tiny OUT under a dangling link", "convert SRC loop", "logits --model loop",
        "plan --model loop", "logits --out in a loop"])
def test_links_that_lead_nowhere_are_one_line(argv, words, tiny, tmp_path, capsys, one_line_error):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop")
    argv = [a.format(model=tiny["fp8"], tmp=tmp_path) for a in argv]
    rc, out, err = run_cli(argv, capsys)
    one_line_error.exit(rc, err, words.format(tmp=tmp_path))
    assert not (tmp_path / "nowhere").exists() and not (tmp_path / "dst").exists()


@pytest.mark.parametrize("argv", [
    ["generate", "--model", "moonshotai/Kimi-K2-Instruct", "--prompt", "hi"],
    ["logits", "--model", "moonshotai/Kimi-K2-Instruct", "--input-ids", "1", "--out", "{tmp}/l"],
    ["plan", "--model", "moonshotai/Kimi-K2-Instruct", "--tp", "64", "--seq-len", "1024"],
    ["convert", "moonshotai/Kimi-K2-Instruct", "{tmp}/dst", "--experts", "fp8-blockwise"],
], ids=["generate", "logits", "plan", "convert"])
def test_a_hub_model_id_says_how_to_download_it(argv, tmp_path, monkeypatch, capsys, one_line_error):
    monkeypatch.chdir(tmp_path)  # where no moonshotai/ folder is
    rc, _, err = run_cli([a.format(tmp=tmp_path) for a in argv], capsys)
    one_line_error.exit(rc, err, "moonshotai/Kimi-K2-Instruct: no such folder; it looks like a Hugging Face model id",
                        "`hf download moonshotai/Kimi-K2-Instruct --local-dir DIR`")


def test_a_missing_local_folder_is_no_hub_id(tmp_path, monkeypatch, capsys, one_line_error):
    """owner/name whose owner is a folder here is a typo of a local path, not a Hub id; an absolute one too."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conv").mkdir()
    for model in ("conv/k2x", str(tmp_path / "data" / "Kimi-K2-Instruct")):
        rc, _, err = run_cli(["plan", "--model", model, "--tp", "2", "--seq-len", "64"], capsys)
        one_line_error.exit(rc, err, f"{model}: config.json not found (no such folder)")
        assert "Hugging Face" not in err


# -- plain words first: NxD's names only after them, in parentheses ----------------------------------------------------

# what a serving user does not know: kernel, function and class names of NxD/NxDI/nkilib
NXD_NAMES = ("bwmm_shard_on_block", "blockwise_mm", "get_cache_size", "mock_distributed", "moe_ep_degree",
             "KVCacheManager", "flash-decoding", "nkilib")


def _bare(text: str) -> list[str]:
    """The NxD names in `text` outside parentheses, and a text that opens with NxD's words."""
    found, depth = [], 0
    if text.startswith(("NxD", "nkilib")):
        found.append(f"opens with NxD: {text[:60]!r}")
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        for name in NXD_NAMES:
            if text.startswith(name, i) and depth == 0:
                found.append(f"{name} in {text[max(0, i - 40):i + 40]!r}")
    return found


def _help_texts():
    texts = []
    parsers = [cli.build_parser()]
    for script in ("compile_and_save", "run_inference", "bench_tpot"):
        spec = importlib.util.spec_from_file_location(f"_help_{script}", REPO / "scripts" / f"{script}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        parsers.append(module.build_parser())
    while parsers:
        p = parsers.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.values())
            elif action.help:
                texts.append(f"{p.prog} {'/'.join(action.option_strings)}: " + action.help)
    return texts


def test_help_speaks_plain_words_first_and_nxd_names_in_parentheses():
    assert not [b for text in _help_texts() for b in _bare(text.split(": ", 1)[1])]


def test_the_readme_too():
    lines = [line for line in (REPO / "README.md").read_text().splitlines() if "NXDI_CONTRACT.md" not in line]
    assert not [b for line in lines for b in _bare(line.lstrip("#| "))]
