"""ShardedCheckpoint: round-trips over a small multi-shard checkpoint, and one-line errors for each bad shard, header
or index (what a user loading a broken download sees: the runner reports these same errors)."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from kimi_k2_neuron.checkpoint.shards import ShardedCheckpoint, TensorInfo

S1 = "model-00001-of-00002.safetensors"
S2 = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        S1: {
            "model.embed_tokens.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
            "model.layers.0.mlp.experts.0.up_proj.weight": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
            "model.layers.0.mlp.experts.0.up_proj.weight_scale_inv": torch.rand(1, 1, generator=g),
        },
        S2: {
            "model.norm.weight": torch.randn(4, generator=g),
            "model.layers.0.positions": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        },
    }


def _write(tmp_path, tensors, weight_map=None):
    for shard, ts in tensors.items():
        save_file(ts, str(tmp_path / shard), metadata={"format": "pt"})
    if weight_map is None:
        weight_map = {name: shard for shard, ts in tensors.items() for name in ts}
    (tmp_path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path


@pytest.fixture
def ckpt_dir(tmp_path):
    return _write(tmp_path, _tensors())


def test_round_trip(ckpt_dir):
    expected = {n: t for ts in _tensors().values() for n, t in ts.items()}
    with ShardedCheckpoint(ckpt_dir) as ck:
        assert ck.keys() == sorted(expected)
        assert ck.shard_names() == [S1, S2]
        assert ck.keys_in_shard(S2) == ["model.layers.0.positions", "model.norm.weight"]
        assert ck.unindexed == []
        assert ck.total_bytes == sum(t.numel() * t.element_size() for t in expected.values())
        for name, want in expected.items():
            assert name in ck
            info = ck.info(name)
            nbytes = want.numel() * want.element_size()
            assert info == TensorInfo(name, info.shard, want.dtype, tuple(want.shape), nbytes)
            got = ck.get(name)
            assert got.dtype == want.dtype and got.shape == want.shape
            # float8 has no eq kernel on every build; compare raw bytes.
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert "missing" not in ck
    assert ck._handles == {}


def test_single_file_without_index(tmp_path):
    save_file({"a": torch.ones(2, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    ck = ShardedCheckpoint(tmp_path)
    assert ck.keys() == ["a"] and ck.shard_names() == ["model.safetensors"]
    assert torch.equal(ck.get("a"), torch.ones(2, dtype=torch.bfloat16))
    ck.close()


def test_unindexed_tensors_are_hidden(tmp_path):
    tensors = _tensors()
    weight_map = {name: shard for shard, ts in tensors.items() for name in ts if name != "model.norm.weight"}
    ck = ShardedCheckpoint(_write(tmp_path, tensors, weight_map))
    assert ck.unindexed == ["model.norm.weight"]
    assert "model.norm.weight" not in ck


def test_truncated_shard(ckpt_dir, one_line_error):
    path = ckpt_dir / S2
    data = path.read_bytes()
    path.write_bytes(data[:-5])
    one_line_error(lambda: ShardedCheckpoint(ckpt_dir), S2, "truncated", str(len(data)), str(len(data) - 5))


def test_shard_truncated_inside_header(ckpt_dir, one_line_error):
    path = ckpt_dir / S1
    path.write_bytes(path.read_bytes()[:40])
    one_line_error(lambda: ShardedCheckpoint(ckpt_dir), S1, "truncated inside its header", "the file has 40")


def test_missing_shard(ckpt_dir, one_line_error):
    (ckpt_dir / S2).unlink()
    one_line_error(lambda: ShardedCheckpoint(ckpt_dir), INDEX, S2, "does not exist")


def test_index_names_tensor_absent_from_shard(tmp_path, one_line_error):
    tensors = _tensors()
    weight_map = {name: shard for shard, ts in tensors.items() for name in ts}
    weight_map["model.norm.weight"] = S1
    _write(tmp_path, tensors, weight_map)
    one_line_error(lambda: ShardedCheckpoint(tmp_path), S1, "model.norm.weight", INDEX, "not in the shard")


def test_malformed_index_json(ckpt_dir, one_line_error):
    (ckpt_dir / INDEX).write_text('{"weight_map": {"a": ')
    one_line_error(lambda: ShardedCheckpoint(ckpt_dir), INDEX, "not valid JSON", "line 1")


def test_index_without_weight_map(ckpt_dir, one_line_error):
    (ckpt_dir / INDEX).write_text('{"metadata": {}}')
    one_line_error(lambda: ShardedCheckpoint(ckpt_dir), INDEX, "weight_map")


def test_corrupt_header(ckpt_dir, one_line_error):
    path = ckpt_dir / S1
    data = path.read_bytes()
    path.write_bytes(b"\xde\xad\xbe\xef\x00\x11\x22\x33garbage" + data[15:])
    one_line_error(lambda: ShardedCheckpoint(ckpt_dir), S1, "corrupt header", "expected an 8-byte little-endian length")


def test_index_points_outside_the_checkpoint(tmp_path, one_line_error):
    tensors = _tensors()
    weight_map = {name: shard for shard, ts in tensors.items() for name in ts}
    weight_map["model.norm.weight"] = "../" + S2
    _write(tmp_path, tensors, weight_map)
    one_line_error(lambda: ShardedCheckpoint(tmp_path), INDEX, "model.norm.weight", "expected a bare file name")


def test_header_with_invalid_json(ckpt_dir, one_line_error):
    path = ckpt_dir / S1
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    path.write_bytes(data[:9] + b"!" * (header_len - 1) + data[8 + header_len :])
    one_line_error(lambda: ShardedCheckpoint(ckpt_dir), S1, "corrupt header", "JSON")


def test_unknown_dtype(tmp_path, one_line_error):
    header = json.dumps({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    one_line_error(lambda: ShardedCheckpoint(tmp_path), "model.safetensors", "x", "C64")


def test_empty_directory(tmp_path, one_line_error):
    one_line_error(lambda: ShardedCheckpoint(tmp_path), str(tmp_path), "no checkpoint", INDEX, "model.safetensors")


def test_get_unknown_name(ckpt_dir, one_line_error):
    with ShardedCheckpoint(ckpt_dir) as ck:
        one_line_error(lambda: ck.get("model.layers.99.nope"), "model.layers.99.nope", str(ckpt_dir))


def test_threads_reaching_a_shard_together_open_it_once(ckpt_dir, monkeypatch):
    """The converter's workers read the same new shard at once: one mmap handle and one descriptor pair, all closed
    by close() (without the lock each thread opened its own, and all but one leaked)."""
    import os
    import threading
    import time

    from kimi_k2_neuron.checkpoint import shards

    real_open, real_safe_open = os.open, shards.safe_open

    def slow(fn):
        def opener(*a, **kw):
            time.sleep(0.05)  # every thread is past the "not open yet" check before the first one finishes
            return fn(*a, **kw)
        return opener

    before = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(shards.os, "open", slow(real_open))
    monkeypatch.setattr(shards, "safe_open", slow(real_safe_open))
    ckpt = ShardedCheckpoint(ckpt_dir)
    name = "model.layers.0.mlp.experts.0.up_proj.weight"
    want = _tensors()[S1][name].view(torch.uint8).reshape(-1)
    got, start = [], threading.Barrier(8)

    def reader():
        start.wait()
        buf = torch.empty(3 * 4096, dtype=torch.uint8)
        got.append((ckpt.get(name).view(torch.uint8).reshape(-1).clone(), ckpt.read_bytes([name], buf).clone()))

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(torch.equal(a, want) and torch.equal(b, want) for a, b in got)
    assert len(ckpt._handles) == 1 and len(ckpt._read_fds) == 1
    ckpt.close()
    monkeypatch.undo()
    assert set(os.listdir("/proc/self/fd")) <= before
