"""CPU tensor parallelism (runtime/tp.py): the same decoder code sharded over 2 or 4 CPU ranks (gloo) gives the
single-rank logits, with the latent cache replicated or sequence-sharded over KV groups (each rank of a group holds the
positions p % G == its index; attention merges over the group), also with q_a/kv_a and the router split across the
ranks; a TP that does not divide is refused (the KV group's refusals: test_cli.py).

Rows are ragged, prefilled in chunks, then fed at least 3 x TP tokens one at a time, so every rank of a group has
written decode tokens of its own."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from kimi_k2_neuron.cli import main
from kimi_k2_neuron.model.router import NoAuxTcRouter
from kimi_k2_neuron.parallel import ParallelContext
from kimi_k2_neuron.placement import Layout
from kimi_k2_neuron.runtime.ranks import run_ranks
from kimi_k2_neuron.runtime.runner import CpuRunner
from kimi_k2_neuron.tiny.transformers_oracle import hf_logits, hf_model

pytestmark = pytest.mark.slow  # every test here spawns ranks

ROWS = [[5, 17, 300, 42, 256, 9], [400, 3, 3, 260, 100, 2]]
LONG = [[5, 17, 300, 42, 256, 9, 77, 123, 8, 511, 30, 31, 2, 3, 99, 98, 97, 11, 12, 60],
        [400, 3, 3, 260, 100, 2, 90, 91, 92, 7, 8, 200, 201, 202, 13, 14, 15, 16, 17]]
CHUNK, STEPS = 2, 12  # prefills of 8 and 7 tokens (4 and 3.5 chunks), then 12 decode steps (>= 3 x TP at TP=4)


def rel_err(ours, ref):
    real = ~torch.isnan(ref)
    assert torch.equal(real, ~torch.isnan(ours))
    return ((ours - ref).abs()[real].max() / ref[real].abs().max()).item()


def test_cli_logits_tp2_equals_tp1(tiny, tmp_path):
    out = tmp_path / "tp2.safetensors"
    ids = ";".join(",".join(map(str, r)) for r in ROWS)
    assert main(["logits", "--model", str(tiny["int4"]), "--input-ids", ids, "--prefill-len", "3",
                 "--tp", "2", "--out", str(out)]) == 0
    tp2 = load_file(out)["logits"]
    tp1 = CpuRunner(tiny["int4"]).logits(ROWS, 3)
    assert (tp2 - tp1).abs().max() / tp1.abs().max() < 1e-5


def test_cli_logits_with_the_sequence_sharded_cache_at_tp2_equal_tp1_and_transformers(tiny, tmp_path):
    """`logits --tp 2 --kv-shard sequence --prefill-chunk 2` on ragged rows (each run on its own, prefilled in 3.5
    chunks, then 13 and 12 tokens through the decode path): the TP=1 replicated one-shot logits, and transformers'."""
    from kimi_k2_neuron.tiny.transformers_oracle import hf_logits, hf_model

    out = tmp_path / "tp2.safetensors"
    ids = ";".join(",".join(map(str, r)) for r in LONG)
    assert main(["logits", "--model", str(tiny["int4"]), "--input-ids", ids, "--prefill-len", "7",
                 "--tp", "2", "--kv-shard", "sequence", "--prefill-chunk", str(CHUNK), "--out", str(out)]) == 0
    tp2 = load_file(out)["logits"]
    assert rel_err(tp2, CpuRunner(tiny["int4"]).logits(LONG, 7)) < 1e-4
    hf = hf_model(tiny["int4"])
    for r, row in enumerate(LONG):
        assert rel_err(tp2[r, :len(row)], hf_logits(hf, [row], 7)[0]) < 1e-3


def ragged_batch(runner, rows):
    """Each row prefilled on its own (all but its last STEPS tokens, in the runner's chunks), then the rows fed their
    last STEPS tokens together, one at a time, each at its own position: the decode logits [B, STEPS, V] and the
    cache (this rank's part of it)."""
    cache = runner.new_cache(len(rows), max(map(len, rows)))
    starts = [len(r) - STEPS for r in rows]
    for i, (row, k) in enumerate(zip(rows, starts)):
        runner.prefill(torch.tensor([row[:k]]), torch.arange(k)[None], cache.rows(i, i + 1))
    steps = [runner.forward(torch.tensor([[r[k + t]] for r, k in zip(rows, starts)]),
                            torch.tensor([[k + t] for k in starts]), cache.layers) for t in range(STEPS)]
    return torch.cat(steps, 1), cache


def layouts(tp):
    """KV groups of all ranks and of 2, each with its prefill chunks merged over the whole group and over fewer ranks
    pooling their caches (Layout.chunk_group; 2 of 4 is no trn2 mesh, but the arithmetic is the general case)."""
    out = {}
    for g in sorted({tp, 2}):
        for c in sorted({g, 1, 2} & set(range(1, g + 1))):
            if g % c == 0:
                out[f"g{g}c{c}"] = Layout(kv_group=g, chunk_group=c)
    return out


def sharded_rank(rank, tp, model_dir, rows, out_dir):
    """One rank of a TP=`tp` run with the sequence-sharded cache, for each of layouts(tp): the ragged batch's logits
    and this rank's cache."""
    import torch.distributed as dist

    from kimi_k2_neuron.runtime.tp import cpu_context

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    out = {}
    for name, layout in layouts(tp).items():
        runner = CpuRunner(model_dir, ctx=cpu_context(tp, rank, layout), prefill_chunk=CHUNK)
        logits, cache = ragged_batch(runner, rows)
        out |= {f"{name}.logits": logits} | {f"{name}.layer{n}": t for n, t in enumerate(cache.layers)}
    save_file(out, f"{out_dir}/rank{rank}.safetensors")
    dist.destroy_process_group()


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_sharded_cache_on_a_ragged_batch(tiny, tmp_path, tp):
    """TP=2 and 4 with one KV group of all ranks (at TP=4 one head per rank, as Kimi at TP=64), and at TP=4 also two
    groups of 2 (each holding a whole copy of the sequence); each with its chunks merged over the whole group and over
    fewer ranks pooling their caches (layouts()); prefill in chunks of 2, then two rows at different
    positions decode together for 12 steps. Logits: the TP=1 replicated one-shot run's (1e-4) and transformers' row
    by row (1e-3). Cache: rank r holds exactly the positions p with p % G == r % G at slot p // G, equal to the TP=1
    cache there; slots past a row's end are never written."""
    from kimi_k2_neuron.runtime.ranks import run_ranks
    from kimi_k2_neuron.tiny.transformers_oracle import hf_logits, hf_model

    ckpt = tiny["int4"]
    run_ranks(sharded_rank, tp, args=(tp, str(ckpt), LONG, str(tmp_path)))
    ranks = [load_file(tmp_path / f"rank{r}.safetensors") for r in range(tp)]
    want, ref = ragged_batch(CpuRunner(ckpt), LONG)
    hf = hf_model(ckpt)
    for i, row in enumerate(LONG):
        assert rel_err(want[i], hf_logits(hf, [row], len(row) - STEPS)[0, -STEPS:]) < 1e-3
    for name, layout in layouts(tp).items():
        g = layout.kv_group
        assert rel_err(ranks[0][f"{name}.logits"], want) < 1e-4, name
        for r, got in enumerate(ranks):
            for n, full in enumerate(ref.layers):
                held = got[f"{name}.layer{n}"]
                assert held.shape == (len(LONG), -(-full.shape[1] // g), full.shape[2])
                positions = torch.arange(held.shape[1]) * g + r % g
                for i, row in enumerate(LONG):
                    written = positions < len(row)
                    torch.testing.assert_close(held[i, written], full[i, positions[written]], rtol=1e-4, atol=1e-5)
                    assert not held[i, ~written].any()


def test_tp_that_does_not_divide_is_refused(tiny, tmp_path, capsys):
    rc = main(["logits", "--model", str(tiny["fp8"]), "--input-ids", "1,2", "--tp", "3",
               "--out", str(tmp_path / "x.safetensors")])
    assert rc == 2 and "num_attention_heads=4 is not divisible by 3" in capsys.readouterr().err


# -- q_a/kv_a and the router split across the ranks (--shard-attn-a, --shard-router) ------------------------------

@pytest.fixture(scope="module")
def hf_fp8(tiny):
    return hf_model(tiny["fp8"])


@pytest.mark.parametrize("tp", [2, 4])
def test_cli_logits_with_sharded_attn_a_and_router_equal_tp1_and_transformers(tiny, hf_fp8, tmp_path, tp):
    """Each rank computes its rows of q_a/kv_a and its experts' router logits, all-gathered: the logits are the
    single rank's (float32, 1e-4) and transformers' DeepseekV3 (1e-3, as test_model_vs_transformers)."""
    out = tmp_path / f"tp{tp}.safetensors"
    assert main(["logits", "--model", str(tiny["fp8"]), "--input-ids", "5,17,300,42,256,9;400,3,3,260,100,2",
                 "--prefill-len", "3", "--tp", str(tp), "--shard-attn-a", "--shard-router", "--out", str(out)]) == 0
    got = load_file(out)["logits"]
    want = CpuRunner(tiny["fp8"]).logits(ROWS, 3)
    assert (got - want).abs().max() / want.abs().max() < 1e-4
    ref = hf_logits(hf_fp8, ROWS, 3)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-3


def _record_routing(rank, tp, model_dir, out_dir):
    """A rank of test_the_sharded_router_selects_the_same_experts_on_every_rank: each router call's (weights, ids)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    try:
        runner = CpuRunner(model_dir, ctx=ParallelContext(tp, rank, Layout(shard_router=True)))
        calls, shapes = _routing_calls(runner.model, NoAuxTcRouter)
        runner.logits(ROWS, 3)
        torch.save({"calls": calls, "shapes": shapes}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _routing_calls(model, router_type):
    """Forward hooks on every router of a model: the list each call's (weights, ids) goes to (the last two outputs:
    ours returns (weights, ids), transformers' (logits, weights, ids)), and each router's weight shape."""
    calls, shapes = [], []
    for module in model.modules():
        if isinstance(module, router_type):
            module.register_forward_hook(lambda _m, _x, out: calls.append([t.clone() for t in out[-2:]]))
            shapes.append(tuple(module.weight.shape))
    return calls, shapes


def _by_expert(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(-1, order), ids.gather(-1, order)


@pytest.mark.parametrize("tp", [2, 4])
def test_the_sharded_router_selects_the_same_experts_on_every_rank(tiny, hf_fp8, tmp_path, tp):
    """Each rank holds 8 / tp of the 8 experts' router rows; the gathered float32 logits make every rank's choice
    and combine weights bitwise the same, and for every token of every call the chosen experts are those of the
    replicated router at TP=1 and of transformers' DeepseekV3TopkRouter (same prompt, same prefill/decode calls)."""
    run_ranks(_record_routing, tp, args=(tp, str(tiny["fp8"]), str(tmp_path)))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(tp)]
    single = CpuRunner(tiny["fp8"])
    want, full = _routing_calls(single.model, NoAuxTcRouter)
    single.logits(ROWS, 3)
    hf, _ = _routing_calls(hf_fp8, DeepseekV3TopkRouter)
    hf_logits(hf_fp8, ROWS, 3)
    experts = single.cfg.n_routed_experts
    assert full and all(s == (experts, single.cfg.hidden_size) for s in full)
    for got in ranks:
        assert got["shapes"] == [(experts // tp, single.cfg.hidden_size)] * len(full)
        assert len(got["calls"]) == len(want) == len(hf) > 0
        for (w, ids), (w0, ids0) in zip(got["calls"], ranks[0]["calls"]):
            assert torch.equal(ids, ids0) and torch.equal(w, w0)
    for (w, ids), (w1, ids1), (w2, ids2) in zip(ranks[0]["calls"], want, hf):
        (w, ids), (w1, ids1), (w2, ids2) = _by_expert(w, ids), _by_expert(w1, ids1), _by_expert(w2, ids2)
        assert torch.equal(ids, ids1) and torch.equal(ids, ids2)
        torch.testing.assert_close(w, w1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w, w2, rtol=1e-4, atol=1e-5)


def test_a_split_that_does_not_divide_is_refused(one_line_error):
    from kimi_k2_neuron.config import KimiK2Config
    from kimi_k2_neuron.parallel import check_weight_sharding
    from kimi_k2_neuron.tiny.checkpoint import tiny_config_dict

    cfg = KimiK2Config.from_dict(tiny_config_dict("bf16"))
    check_weight_sharding(cfg, 4, True, True)  # 160, 96 + 16 and 8 split 4 ways
    one_line_error(lambda: check_weight_sharding(dataclasses.replace(cfg, q_lora_rank=150), 4, True, False),
                   "--shard-attn-a --tp 4: config.json field q_lora_rank=150 is not divisible by 4")
    one_line_error(lambda: check_weight_sharding(dataclasses.replace(cfg, n_routed_experts=6), 4, False, True),
                   "--shard-router --tp 4: config.json field n_routed_experts=6 is not divisible by 4")
    check_weight_sharding(dataclasses.replace(cfg, n_routed_experts=6), 4, True, False)  # only what is split
