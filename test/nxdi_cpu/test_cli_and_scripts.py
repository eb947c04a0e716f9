"""The user-facing entry points of the NxDI model in NxD's CPU mode, run as a user runs them: `kimi-k2-neuron logits
| generate --backend nxdi-cpu`, scripts/run_inference.py --cpu and scripts/bench_tpot.py --cpu, on a raw tiny checkpoint
(converted first into $KIMI_K2_NEURON_CACHE), against the core CPU runner."""

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from kimi_k2_neuron.runtime.chat import cut_at_stop, display_text, prompt_ids
from kimi_k2_neuron.runtime.runner import CpuRunner
from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer
from nxdi_support import REPO, rel_err

ROWS = [[5, 17, 300, 42, 256, 9, 77, 123, 8, 511], [400, 3, 3, 3, 260, 100]]

pytestmark = pytest.mark.fp8_selective_cpu


def _run(args, env, script=None):
    cmd = [sys.executable, str(REPO / "scripts" / script)] if script else [sys.executable, "-m", "kimi_k2_neuron.cli"]
    return subprocess.run(cmd + args, capture_output=True, text=True, env=env, timeout=600)


def test_logits_at_tp2_from_a_raw_checkpoint_equal_the_core(tiny, converted, env, tmp_path):
    ids = ";".join(",".join(map(str, r)) for r in ROWS)
    r = _run(["logits", "--backend", "nxdi-cpu", "--tp", "2", "--model", str(tiny["fp8"]), "--input-ids", ids,
              "--prefill-len", "4", "--out", str(tmp_path / "l.safetensors")], env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == f"wrote logits [2, 10, 512] to {tmp_path / 'l.safetensors'}"  # library chatter: stderr
    assert "NxD MoE paths taken in CPU mode: context_encoding_model: all-experts" in r.stderr
    made = [p.name for p in (tmp_path / "cache/converted").iterdir()]
    assert any(name.startswith(f"{tiny['fp8'].name}-neuron-fp8-blockwise-") for name in made), made
    got = load_file(str(tmp_path / "l.safetensors"))["logits"]
    want = CpuRunner(converted[("fp8", "fp8-blockwise")]).logits(ROWS, 4)
    for i, row in enumerate(ROWS):
        assert rel_err(got[i, :len(row)], want[i, :len(row)]) < 1e-4
    assert torch.isnan(got[1, 6:]).all()


def test_sigterm_ends_every_rank(tiny, env, tmp_path):
    ids = ";".join([",".join(["5"] * 200)] * 2)  # long enough to still be running when signalled
    p = subprocess.Popen([sys.executable, "-m", "kimi_k2_neuron.cli", "logits", "--backend", "nxdi-cpu", "--tp", "2",
                          "--model", str(tiny["fp8"]), "--input-ids", ids, "--prefill-len", "1",
                          "--out", str(tmp_path / "l.safetensors")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    parent, deadline = psutil.Process(p.pid), time.monotonic() + 120
    children = []
    while time.monotonic() < deadline and p.poll() is None:
        children = parent.children(recursive=True)
        if sum("spawn_main" in " ".join(c.cmdline()) for c in children) == 2:
            break
        time.sleep(0.05)
    assert len(children) >= 2, "the two ranks did not start"
    p.send_signal(signal.SIGTERM)
    rc = p.wait(60)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive and rc == 128 + signal.SIGTERM
    assert p.stderr.read().rstrip().splitlines()[-1] == "error: interrupted by SIGTERM; terminated every rank"
    assert not (tmp_path / "l.safetensors").exists()


def test_generate_equals_the_core_runners_tokens(tiny, env):
    args = ["generate", "--model", str(tiny["fp8"]), "--prompt", "Hello, Kimi!", "--prompt", "Bye",
            "--max-new-tokens", "6", "--json"]
    nxdi = _run(args + ["--backend", "nxdi-cpu", "--tp", "2"], env)
    core = _run(args, env)
    assert nxdi.returncode == 0 and core.returncode == 0, nxdi.stderr[-3000:] + core.stderr[-3000:]
    got, want = json.loads(nxdi.stdout), json.loads(core.stdout)  # stdout is the JSON object alone
    assert got["tokens"] == want["tokens"] and got["text"] == want["text"] and got["backend"] == "nxdi-cpu"


@pytest.mark.parametrize("release", ["k2.6", "k2.7"])
def test_the_k26_and_k27_layouts_through_the_nxdi_shell(release, env, tmp_path):
    """Kimi-K2.6 and K2.7-Code (K2.5's layout: text_config, language_model. tensors, a vision tower; INT4 experts)
    through `generate --backend nxdi-cpu`, converted on the way: the NxDI model gives the core runner's tokens on the
    raw checkpoint; K2.7's generation config makes both sample, --greedy keeps them comparable."""
    from kimi_k2_neuron.tiny.checkpoint import make_tiny

    model = make_tiny(tmp_path / release, layout=release)
    args = ["generate", "--model", str(model), "--prompt", "Hello, Kimi!", "--max-new-tokens", "4", "--json",
            "--greedy"]
    nxdi = _run(args + ["--backend", "nxdi-cpu"], env)
    core = _run(args, env)
    assert nxdi.returncode == 0 and core.returncode == 0, nxdi.stderr[-3000:] + core.stderr[-3000:]
    assert json.loads(nxdi.stdout)["tokens"] == json.loads(core.stdout)["tokens"]


def test_generate_and_run_inference_with_the_long_context_layout_give_the_core_runners_tokens(tiny, env):
    """The layout flags end to end at TP=2 (issue 17): the sequence-sharded cache, chunked prefill and the sharded
    q_a|kv_a and router through `generate --backend nxdi-cpu`, the sharded cache through run_inference.py --cpu;
    greedy tokens equal the core runner's replicated one-shot one-process run."""
    model = tiny["fp8"]
    args = ["generate", "--model", str(model), "--prompt", "Hello, Kimi!", "--prompt", "Bye", "--max-new-tokens", "6",
            "--json"]
    # prompts of several 4-token chunks (the chat template's tokens around them)
    nxdi = _run(args + ["--backend", "nxdi-cpu", "--tp", "2", "--kv-shard", "sequence", "--prefill-chunk", "4",
                        "--shard-attn-a", "--shard-router"], env)
    core = _run(args, env)
    assert nxdi.returncode == 0 and core.returncode == 0, nxdi.stderr[-3000:] + core.stderr[-3000:]
    got, want = json.loads(nxdi.stdout), json.loads(core.stdout)
    assert got["tokens"] == want["tokens"] and got["text"] == want["text"]
    tok = KimiTokenizer.from_dir(model)
    r = _run(["--cpu", "--model", str(model), "--prompt", "Hello, Kimi!", "--max-new-tokens", "6", "--tp", "2",
              "--kv-shard", "sequence"], env, "run_inference.py")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == display_text(tok.decode(want["tokens"][0], skip_special=True)) + "\n"


def test_run_inference_cpu_is_the_runner_end_to_end(tiny, env):
    """Chat template, streamed text (one prompt), both stop ids, sampling flags: the tokens the core runner picks."""
    model = tiny["fp8"]
    tok = KimiTokenizer.from_dir(model)
    runner = CpuRunner(model)
    prompt = prompt_ids(tok, ["Hello, Kimi!"])
    stops = tok.stop_ids(runner.cfg.eos_token_ids)
    assert len(stops) == 2  # [EOS] (config.json) and <|im_end|>
    want = runner.generate(prompt, 12, stop_ids=stops).tokens[0]
    r = _run(["--cpu", "--model", str(model), "--prompt", "Hello, Kimi!", "--max-new-tokens", "12"], env,
             "run_inference.py")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == display_text(tok.decode(want, skip_special=True)) + "\n"  # streamed, then the newline
    assert "NxD CPU mode" in r.stderr and "tokens in" in r.stderr
    # greedy through the sampler's sampling branch: temperature with top-k 1 picks the argmax
    s = _run(["--cpu", "--model", str(model), "--prompt", "Hello, Kimi!", "--max-new-tokens", "12", "--temperature",
              "0.7", "--top-k", "1", "--tp", "2", "--stop", "zz"], env, "run_inference.py")
    assert s.returncode == 0, s.stderr[-3000:]
    assert s.stdout == display_text(cut_at_stop(tok.decode(want, skip_special=True), ["zz"])) + "\n"


def test_bench_tpot_cpu_writes_a_report_marked_cpu(tiny, env, tmp_path):
    r = _run(["--cpu", "--model", str(tiny["fp8"]), "--seq-len", "32", "--num-runs", "2", "--report",
              str(tmp_path / "b.json")], env, "bench_tpot.py")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["device"] == "cpu" and "not a trn2 latency" in report["note"]
    assert report["tpot_ms"]["p50"] > 0 and report["ttft_ms"]["p50"] > 0 and report["seq_len"] == 32
    assert "in NxD's CPU mode, not a trn2 number" in r.stdout


def test_bench_tpot_cpu_sweeps_context_lengths(tiny, env, tmp_path):
    """--context-lengths: one entry per length, each from a prefill of that length (one context-encoding call) and
    exactly --decode-steps token-generation calls, timed by NxDI's hooks."""
    r = _run(["--cpu", "--model", str(tiny["fp8"]), "--seq-len", "32", "--context-lengths", "8,24", "--decode-steps",
              "4", "--report", str(tmp_path / "b.json")], env, "bench_tpot.py")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["device"] == "cpu" and "not a trn2 latency" in report["note"] and report["decode_steps"] == 4
    assert [e["context_length"] for e in report["context_lengths"]] == [8, 24]
    for e in report["context_lengths"]:
        assert e["nxdi_report"]["timed_calls"] == {"context_encoding_model": 1, "token_generation_model": 4}
        assert e["tpot_ms"]["p50"] > 0 and e["ttft_ms"]["p50"] > 0
    lines = r.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["context 8", "context 24"]
    assert all("in NxD's CPU mode, not a trn2 number" in line for line in lines)


def test_bench_tpot_cpu_sweep_times_every_chunk_of_a_chunked_prefill(tiny, env, tmp_path):
    """--prefill-chunk 8: a 24-token prompt is one context-encoding call and two chunk calls, each timed (NxDI's hooks
    know only its own submodels; the chunk submodel's is ours), and prefill_ms sums them."""
    r = _run(["--cpu", "--model", str(tiny["fp8"]), "--seq-len", "32", "--prefill-chunk", "8", "--context-lengths",
              "8,24", "--decode-steps", "4", "--report", str(tmp_path / "b.json")], env, "bench_tpot.py")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["max_context_length"] == 8
    calls = [e["nxdi_report"]["timed_calls"] for e in report["context_lengths"]]
    assert calls == [{"context_encoding_model": 1, "token_generation_model": 4, "chunked_prefill_model": n}
                     for n in (0, 2)]
    longest = report["context_lengths"][1]
    assert longest["chunk_ms"]["p50"] > 0 and longest["prefill_ms"] > longest["ttft_ms"]["p50"]
    assert all("prefill " in line for line in r.stdout.strip().splitlines())


def test_bench_tpot_refuses_a_context_length_the_cache_cannot_hold(tiny, env, tmp_path):
    r = _run(["--cpu", "--model", str(tiny["fp8"]), "--seq-len", "32", "--context-lengths", "8,28", "--decode-steps",
              "4", "--report", str(tmp_path / "b.json")], env, "bench_tpot.py")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == ("error: --context-lengths 28: with --decode-steps 4 at most 27 "
                                                 "(seq_len 32, --seq-len 32, holds the prompt, the prefill's token "
                                                 "and the steps)")
    assert not (tmp_path / "b.json").exists() and not (tmp_path / "cache" / "converted").exists()


def test_a_stop_string_ends_rows_as_on_the_core(tiny, env):
    """NxDI's adapter pads a row that has finished while the other goes on: the row ends where its stop string
    completed, as on the core runner, with no pad ids after it."""
    args = ["generate", "--model", str(tiny["fp8"]), "--prompt", "Hello, Kimi!", "--prompt", "Bye",
            "--max-new-tokens", "12", "--json"]
    free = json.loads(_run(args, env).stdout)
    tok = KimiTokenizer.from_dir(tiny["fp8"])
    # a piece of row 0's text that row 1's never holds, so that row 0 ends while row 1 goes on
    pieces = (tok.decode([i], skip_special=True) for i in free["tokens"][0][:-1])
    stop = next(t for t in pieces if t.strip() and "\ufffd" not in t and t not in free["text"][1])
    core = _run(args + ["--stop", stop], env)
    nxdi = _run(args + ["--stop", stop, "--backend", "nxdi-cpu"], env)
    assert core.returncode == 0 and nxdi.returncode == 0, core.stderr[-3000:] + nxdi.stderr[-3000:]
    got, want = json.loads(nxdi.stdout), json.loads(core.stdout)
    assert len(want["tokens"][0]) < len(want["tokens"][1]) == 12
    assert got["tokens"] == want["tokens"] and got["text"] == want["text"]


@pytest.mark.parametrize("args, words", [
    (["generate", "--input-ids", "5;1,2,3"], "one-token prompt"),
    (["generate", "--input-ids", "1,2,3", "--temperature", "1", "--top-k", "300"], "--top-k 300"),
    (["logits", "--input-ids", "1,2,3", "--tp", "3", "--out", "{tmp}/l.safetensors"], "--tp 3"),
], ids=["one-token row", "top-k above the sampler's", "tp 3"])
def test_what_config_and_flags_refuse_is_refused_before_converting(tiny, env, tmp_path, args, words):
    r = _run([a.replace("{tmp}", str(tmp_path)) for a in args] + ["--backend", "nxdi-cpu", "--model",
                                                                  str(tiny["fp8"])], env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith("error: ") and words in r.stderr, r.stderr
    assert not (tmp_path / "cache" / "converted").exists()  # the raw checkpoint was not converted


@pytest.mark.parametrize("script", ["run_inference.py", "bench_tpot.py"])
def test_a_folder_compile_and_save_did_not_write_is_one_line(script, env, tmp_path):
    compiled = tmp_path / "compiled"  # the report beside it, not inside (refused first, in its own words)
    compiled.mkdir()
    flags = ["--prompt", "hi"] if script == "run_inference.py" else ["--report", str(tmp_path / "r.json")]
    r = _run(["--compiled", str(compiled), *flags], env, script)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (f"error: --compiled {compiled}: not a folder written by "
                                                 f"scripts/compile_and_save.py (no kimi_k2_neuron.json in it)")


def test_compile_dry_run_with_the_sequence_sharded_cache(tmp_path, env):
    """--kv-shard sequence at TP=64: NxDI's flash decoding on, the KV group (all 64 ranks) in the saved layout, and
    the plan's cache at 8,192 / 64 + 128 slots per rank."""
    model = tmp_path / "k2"
    model.mkdir()
    (model / "config.json").write_text((REPO / "test/data/configs/kimi-k2-instruct-0905.json").read_text())
    r = _run(["--model", str(model), "--out", str(tmp_path / "out"), "--tp", "64", "--seq-len", "8192",
              "--max-context-length", "1024", "--kv-shard", "sequence", "--dry-run"], env,
             script="compile_and_save.py")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["neuron_config"]["flash_decoding_enabled"] is True and got["neuron_config"]["seq_len"] == 8192
    assert got["kimi_k2_run_spec"]["layout"]["kv_group"] == 64 and got["plan"]["layout"]["kv_group"] == 64
    assert not (tmp_path / "out").exists()


def test_compile_dry_run_prints_the_neuron_config_and_touches_nothing(tmp_path, env):
    """A folder with only Kimi-K2-Instruct-0905's config.json: the NeuronConfig compile() would trace, as NxDI writes
    neuron_config.json, the MoE path of each submodel (the prefill on nkilib's shard-on-block kernel, decode on
    selective loading), the NKI kernels each graph calls or not with why, and the plan; no conversion, no output
    folder, nothing beside the config."""
    model = tmp_path / "k2"
    model.mkdir()
    (model / "config.json").write_text((REPO / "test/data/configs/kimi-k2-instruct-0905.json").read_text())
    r = _run(["--model", str(model), "--out", str(tmp_path / "out"), "--tp", "64", "--dry-run"], env,
             script="compile_and_save.py")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    nc = got["neuron_config"]
    assert (nc["tp_degree"], nc["seq_len"], nc["logical_nc_config"], nc["quantized"]) == (64, 1024, 2, True)
    assert nc["quantization_type"] == "blockwise_symmetric" and nc["quantization_block_size"] == [32, 32]
    bmm = nc["blockwise_matmul_config"]
    assert bmm["use_shard_on_block_dynamic_while"] is True and bmm["block_size"] == 128
    assert bmm["block_sharding_strategy"]["_name_"] == "PING_PONG"
    assert got["moe_paths"]["context_encoding"] == {"tokens": 1024, "path": "shard-on-block",
                                                   "nki_kernel": "bwmm_shard_on_block"}
    assert got["moe_paths"]["token_generation"]["path"] == "selective"
    # each NKI kernel on or off, with why: the prefill's shard-on-block kernel and the sampler's top-k and cumsum on,
    # every fused decode kernel off (neuron/kernels.py)
    kernels = {k["kernel"]: k for k in got["kernels"]}
    assert sorted(k for k, v in kernels.items() if v["on"]) == ["bwmm_shard_on_block", "cumsum", "topk (rotational)"]
    assert "445 blocks of 128 rows" in kernels["bwmm_shard_on_block"]["why"]
    for name in ("moe_block_tkg (NxD MoEFusedTKG)", "router_topk", "mlp (mlp_tkg)",
                 "attention_block_tkg / attention_tkg"):
        off = kernels[name]
        assert not off["on"] and off["submodel"] in ("token_generation", "both") and "NXDI_CONTRACT.md: " in off["why"]
    assert got["plan"]["fits"] and got["converted"] is False
    assert not (tmp_path / "out").exists() and not any("-neuron-" in p.name for p in tmp_path.iterdir())
    assert [p.name for p in model.iterdir()] == ["config.json"]


SITECUSTOMIZE = '''
import os, sys
_target, _log = os.environ["KIMI_K2_COUNT_OPENS"].split(os.pathsep)


def _hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        if os.path.realpath(os.fsdecode(args[0])) == _target:
            with open(_log, "a") as f:
                f.write(f"{os.getpid()}\\n")


sys.addaudithook(_hook)
'''


def test_one_logits_request_reads_config_json_once(converted, env, tmp_path):
    """The command, its checks, the conversion record and the ranks' builds share one read of config.json: each
    process opens it at most once, and the ranks (spawned, TP=2) not at all (they get the parsed config)."""
    ckpt = converted[("fp8", "fp8-blockwise")]
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "opens.log"
    run_env = {**env, "PYTHONPATH": f"{tmp_path / 'hook'}:{env.get('PYTHONPATH', '')}",
               "KIMI_K2_COUNT_OPENS": f"{(ckpt / 'config.json').resolve()}:{log}"}
    r = _run(["logits", "--backend", "nxdi-cpu", "--tp", "2", "--model", str(ckpt), "--input-ids", "5,17,300,42",
              "--out", str(tmp_path / "l.safetensors")], run_env)
    assert r.returncode == 0, r.stderr[-3000:]
    pids = log.read_text().split()
    assert len(pids) == 1, pids  # the command's own process, once
