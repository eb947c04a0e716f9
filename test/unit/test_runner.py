"""The CPU runner: rows at their own positions, stop ids, the layer-streamed mode, and every request it refuses from
config.json alone (ids, positions, prefill length), in one line."""

import re

import pytest
import torch
from checkpoint_edits import EMBED, NORM, SHARD1, edit_config, edit_tensor, scramble_data, set_element, set_field

from kimi_k2_neuron import cli
from kimi_k2_neuron.runtime.runner import CpuRunner

ROW = [5, 17, 300, 42, 256, 9, 77, 123, 8, 511, 30, 31]
ROWS = [[5, 17, 300, 42, 256, 9, 77, 123, 8, 511], [400, 3, 3, 3, 260, 100, 2, 90, 91, 92]]


def test_batch_rows_at_different_positions(tiny):
    """Rows with prompts of different lengths decode together; each must equal its own batch-1 run."""
    r = CpuRunner(tiny["int4"])
    prompts = [ROW[:3], ROW[:9], ROW[2:7]]
    batched = r.generate(prompts, max_new_tokens=6)
    for p, toks in zip(prompts, batched.tokens):
        assert toks == r.generate([p], max_new_tokens=6).tokens[0]
    # And the decode logits themselves, for rows at positions 3 and 9 in one batch:
    solo = [r.logits([p + [1, 2]], prefill_len=len(p))[0, -2:] for p in prompts[:2]]
    cache = r.new_cache(2, 12)
    for i, p in enumerate(prompts[:2]):
        r.forward(torch.tensor([p]), torch.arange(len(p))[None], cache.rows(i, i + 1))
    steps = []
    for k, tok in enumerate([1, 2]):
        pos = torch.tensor([[3 + k], [9 + k]])
        steps.append(r.forward(torch.tensor([[tok], [tok]]), pos, cache.layers))
    both = torch.cat(steps, 1)
    for i in range(2):
        assert (both[i] - solo[i]).abs().max() / solo[i].abs().max() < 1e-5


def test_chunked_prefill_equals_one_shot_prefill(tiny):
    """A 14-token prompt in calls of 4 (3.5 chunks: each attends to the cache so far and causally within itself) gives
    the one-shot prefill's logits at every position and the same cache; generation from it the same tokens."""
    one_shot, chunked = CpuRunner(tiny["int4"]), CpuRunner(tiny["int4"], prefill_chunk=4)
    ids, pos = torch.tensor([ROW + [2, 3]]), torch.arange(14)[None]
    caches = [r.new_cache(1, 14) for r in (one_shot, chunked)]
    want = one_shot.prefill(ids, pos, caches[0].layers)
    got = chunked.prefill(ids, pos, caches[1].layers)
    assert [t.shape[1] for t in got] == [4, 4, 4, 2]
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1), rtol=1e-5, atol=1e-5)
    for a, b in zip(*(c.layers for c in caches)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    prompts = [ROW, ROW[:5]]
    assert chunked.generate(prompts, 4).tokens == one_shot.generate(prompts, 4).tokens


def test_generation_stops_on_stop_ids(tiny):
    r = CpuRunner(tiny["fp8"])
    free = r.generate([ROW[:4]], max_new_tokens=8).tokens[0]
    stop = free[2]
    cut = r.generate([ROW[:4]], max_new_tokens=8, stop_ids={stop}).tokens[0]
    assert cut == free[: free.index(stop) + 1]


def test_decode_throughput_counts_only_the_tokens_rows_got():
    from kimi_k2_neuron.runtime.runner import GenerationResult

    # two decode steps: row 0 got two tokens from them, row 1 had stopped at its prefill token
    assert GenerationResult([[1, 2, 3], [4]], 0.1, 0.5, 2).decode_tokens_per_second == 4.0


def test_layer_streamed_equals_in_memory(tiny):
    mem = CpuRunner(tiny["fp8"]).logits(ROWS, 6)
    streamed = CpuRunner(tiny["fp8"], layer_streamed=True)
    layers = streamed.model.model.layers
    assert all(p.is_meta for p in layers.parameters())  # nothing resident between calls
    resident = []  # while each layer runs, how many layers hold real weights
    for layer in layers:
        layer.register_forward_pre_hook(
            lambda *_: resident.append(sum(not next(l.parameters()).is_meta for l in layers)))
    assert torch.equal(streamed.logits(ROWS, 6), mem)
    assert resident and max(resident) == 1  # peak: one decoder layer (plus embeddings, lm_head, KV cache)


def test_layer_streamed_shows_progress_with_throughput_and_eta(tiny, capsys, monkeypatch):
    from kimi_k2_neuron import progress

    monkeypatch.setattr(progress, "LOG_SECONDS", 0.0)  # capsys is a log: lines from the first second on
    r = CpuRunner(tiny["bf16"], layer_streamed=True, progress=True)
    r.logits([[1, 2, 3, 4]], prefill_len=2)  # one prefill + two decode passes over 3 layers
    err = capsys.readouterr().err
    assert re.search(r"logits: 3 passes x 3 layers: .*\d+/9 \[[0-9:]+<[0-9:?]+, *[0-9.?]+ ?layer/s\]", err), err


# -- requests refused before any work ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runner(tiny):
    return CpuRunner(tiny["int4"])


@pytest.mark.parametrize("rows, needles", [
    ([[1, 512, 3]], ["token 512", "outside the vocabulary [0, 512)", "config.json"]),
    ([[-1, 2]], ["token -1", "outside the vocabulary"]),
    ([[1], []], ["every row needs at least one token"]),
    ([], ["every row needs at least one token"]),
    ([[1, 2.0]], ["token 2.0 is a float", "expected an integer id"]),
    ([["a", 2]], ["token 'a' is a str", "expected an integer id"]),
    ([[True, 2]], ["token True is a bool", "expected an integer id"]),
], ids=["too large", "negative", "empty row", "no rows", "float", "str", "bool"])
def test_bad_input_ids(runner, rows, needles, one_line_error):
    one_line_error(lambda: runner.logits(rows), "input ids", *needles)


LIMIT = "expected at most max_position_embeddings=8 of config.json"


@pytest.mark.parametrize("call, needles", [
    (lambda r: r.logits([[1] * 9]), ["input ids: rows of 9 tokens need 9 positions", LIMIT]),
    (lambda r: r.generate([[1] * 5, [2]], 4), ["--max-new-tokens 4: a prompt of 5 tokens + 4 new tokens need 9",
                                               LIMIT]),
    (lambda r: r.generate([[1]], 0), ["--max-new-tokens 0", "expected an integer >= 1"]),
], ids=["logits", "generate", "no new tokens"])
def test_more_positions_than_the_model_has(ckpt, call, needles, one_line_error):
    d = ckpt("bf16")
    edit_config(d, set_field("max_position_embeddings", 8))
    one_line_error(lambda: call(CpuRunner(d)), *needles)


def test_bad_prefill_chunk(tiny, one_line_error):
    one_line_error(lambda: CpuRunner(tiny["int4"], prefill_chunk=0), "--prefill-chunk 0", "expected an integer")


def test_bad_prefill_len(runner, one_line_error):
    one_line_error(lambda: runner.logits([[1, 2, 3]], prefill_len=4), "--prefill-len 4", "sequence length 3")
    one_line_error(lambda: runner.logits([[1, 2, 3]], prefill_len=-1), "--prefill-len -1")


def test_bad_input_ids_streamed(tiny, one_line_error):
    r = CpuRunner(tiny["fp8"], layer_streamed=True)
    one_line_error(lambda: r.logits([[1, 2, 100_000]]), "token 100000", "outside the vocabulary")


# -- non-finite weights and activations: one line, exit 2, nothing written ---------------------------------------------


def _cli(argv, capsys) -> tuple[int, str, str]:
    """Exit code, stdout and stderr as a terminal shows them: a progress bar erased before the error (tqdm's
    leave=False rewrites its line after a carriage return) leaves nothing on screen."""
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, "\n".join(line.split("\r")[-1] for line in out.err.split("\n"))


@pytest.mark.parametrize("streamed", [[], ["--layer-streamed"]])
def test_nan_weight_stops_logits_before_any_output(ckpt, tmp_path, capsys, streamed, one_line_error):
    d = ckpt("fp8")
    edit_tensor(d, NORM, set_element(5, float("nan")))
    out = tmp_path / "logits.safetensors"
    rc, stdout, err = _cli(["logits", "--model", d, "--input-ids", "1,2,3", "--out", out, *streamed], capsys)
    one_line_error.exit(rc, err, f"{SHARD1}: tensor {NORM}", "NaN or inf")
    assert stdout == "" and not out.exists()


def test_inf_embedding_row_stops_generate_before_printing(ckpt, capsys, one_line_error):
    # Before the load check this printed 0,0,0,0 (argmax of NaN logits) with exit code 0.
    d = ckpt("bf16")
    edit_tensor(d, EMBED, set_element((7,), float("inf")))
    rc, stdout, err = _cli(["generate", "--model", d, "--input-ids", "7,8", "--max-new-tokens", "4"], capsys)
    one_line_error.exit(rc, err, f"{SHARD1}: tensor {EMBED}", "NaN or inf")
    assert stdout == ""


def test_random_bytes_over_a_shard_stop_logits(ckpt, tmp_path, capsys, one_line_error):
    d = ckpt("bf16")
    scramble_data(d, SHARD1)
    out = tmp_path / "logits.safetensors"
    rc, stdout, err = _cli(["logits", "--model", d, "--input-ids", "1,2,3", "--out", out], capsys)
    one_line_error.exit(rc, err, f"{SHARD1}: tensor ", "NaN or inf")
    assert not out.exists()


@pytest.mark.parametrize("streamed", [[], ["--layer-streamed"]])
def test_forward_pass_that_overflows_names_the_first_layer(ckpt, tmp_path, capsys, streamed, one_line_error):
    # Every weight finite, but layer 1's norm scales its input past float32's range: the layer's output is inf/NaN.
    d = ckpt("fp8")
    edit_tensor(d, NORM.replace("layers.0", "layers.1"), lambda t: torch.full_like(t, 3e38))
    out = tmp_path / "logits.safetensors"
    rc, stdout, err = _cli(["logits", "--model", d, "--input-ids", "1,2,3", "--out", out, *streamed], capsys)
    one_line_error.exit(rc, err, "model.layers.1: output went non-finite")
    assert stdout == "" and not out.exists()
    rc, stdout, err = _cli(["generate", "--model", d, "--input-ids", "1,2", "--max-new-tokens", "3"], capsys)
    one_line_error.exit(rc, err, "model.layers.1: output went non-finite")
    assert stdout == ""
