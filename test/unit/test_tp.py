"""CPU tensor parallelism (runtime/tp.py): the same decoder code sharded over 2 or 4 CPU ranks (gloo) gives the
single-rank logits, also with q_a/kv_a and the router split across the ranks; a TP that does not divide the model is
refused."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from kimi_k2_neuron.cli import main
from kimi_k2_neuron.model.router import NoAuxTcRouter
from kimi_k2_neuron.parallel import ParallelContext
from kimi_k2_neuron.runtime.ranks import run_ranks
from kimi_k2_neuron.runtime.runner import CpuRunner
from kimi_k2_neuron.testing.transformers_oracle import hf_logits, hf_model

ROWS = [[5, 17, 300, 42, 256, 9], [400, 3, 3, 260, 100, 2]]


def test_cli_logits_tp2_equals_tp1(tiny_dirs, tmp_path):
    out = tmp_path / "tp2.safetensors"
    assert main(["logits", "--model", str(tiny_dirs["int4"]), "--input-ids", "5,17,300,42,256,9;400,3,3,260,100,2",
                 "--prefill-len", "3", "--tp", "2", "--out", str(out)]) == 0
    tp2 = load_file(out)["logits"]
    tp1 = CpuRunner(tiny_dirs["int4"]).logits(ROWS, 3)
    assert tp2.shape == tp1.shape
    assert (tp2 - tp1).abs().max() / tp1.abs().max() < 1e-5


def test_tp_that_does_not_divide_is_refused(tiny_dirs, tmp_path, capsys):
    rc = main(["logits", "--model", str(tiny_dirs["fp8"]), "--input-ids", "1,2", "--tp", "3",
               "--out", str(tmp_path / "x.safetensors")])
    assert rc == 2 and "num_attention_heads=4 is not divisible by 3" in capsys.readouterr().err


# -- q_a/kv_a and the router split across the ranks (--shard-attn-a, --shard-router) ------------------------------

@pytest.fixture(scope="module")
def hf_fp8(tiny_dirs):
    return hf_model(tiny_dirs["fp8"])


@pytest.mark.parametrize("tp", [2, 4])
def test_cli_logits_with_sharded_attn_a_and_router_equal_tp1_and_transformers(tiny_dirs, hf_fp8, tmp_path, tp):
    """Each rank computes its rows of q_a/kv_a and its experts' router logits, all-gathered: the logits are the
    single rank's (float32, 1e-4) and transformers' DeepseekV3 (1e-3, as test_model_vs_transformers)."""
    out = tmp_path / f"tp{tp}.safetensors"
    assert main(["logits", "--model", str(tiny_dirs["fp8"]), "--input-ids", "5,17,300,42,256,9;400,3,3,260,100,2",
                 "--prefill-len", "3", "--tp", str(tp), "--shard-attn-a", "--shard-router", "--out", str(out)]) == 0
    got = load_file(out)["logits"]
    want = CpuRunner(tiny_dirs["fp8"]).logits(ROWS, 3)
    assert (got - want).abs().max() / want.abs().max() < 1e-4
    ref = hf_logits(hf_fp8, ROWS, 3)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-3


def _record_routing(rank, tp, model_dir, out_dir):
    """A rank of test_the_sharded_router_selects_the_same_experts_on_every_rank: each router call's (weights, ids)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    try:
        runner = CpuRunner(model_dir, ctx=ParallelContext(tp, rank, shard_router=True))
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
def test_the_sharded_router_selects_the_same_experts_on_every_rank(tiny_dirs, hf_fp8, tmp_path, tp):
    """Each rank holds 8 / tp of the 8 experts' router rows; the gathered float32 logits make every rank's choice
    and combine weights bitwise the same, and for every token of every call the chosen experts are those of the
    replicated router at TP=1 and of transformers' DeepseekV3TopkRouter (same prompt, same prefill/decode calls)."""
    run_ranks(_record_routing, tp, args=(tp, str(tiny_dirs["fp8"]), str(tmp_path)))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(tp)]
    single = CpuRunner(tiny_dirs["fp8"])
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
    from kimi_k2_neuron.testing.tiny_checkpoint import tiny_config_dict

    cfg = KimiK2Config.from_dict(tiny_config_dict("bf16"))
    check_weight_sharding(cfg, 4, True, True)  # 160, 96 + 16 and 8 split 4 ways
    one_line_error(lambda: check_weight_sharding(dataclasses.replace(cfg, q_lora_rank=150), 4, True, False),
                   "--shard-attn-a --tp 4: config.json field q_lora_rank=150 is not divisible by 4")
    one_line_error(lambda: check_weight_sharding(dataclasses.replace(cfg, n_routed_experts=6), 4, False, True),
                   "--shard-router --tp 4: config.json field n_routed_experts=6 is not divisible by 4")
    check_weight_sharding(dataclasses.replace(cfg, n_routed_experts=6), 4, True, False)  # only what is split
