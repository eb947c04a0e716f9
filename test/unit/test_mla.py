"""MLA: the absorbed path equals the naive one in decode and prefill, over the latent cache (one entry per token
per layer, nothing per head), and over two cache segments at once (attend_split, the Neuron decode path); the
sequence-sharded merge (attend_sharded) on one rank equals them (its collectives over ranks: test_tp.py)."""

import torch

from kimi_k2_neuron.runtime.runner import CpuRunner

ROW = [5, 17, 300, 42, 256, 9, 77, 123, 8, 511, 30, 31]


def teacher_forced(runner, ids, prefill, absorbed):
    cache = runner.new_cache(1, len(ids))
    t = torch.tensor([ids])
    pos = torch.arange(len(ids))[None]
    out = [runner.forward(t[:, :prefill], pos[:, :prefill], cache.layers, absorbed=absorbed)]
    for i in range(prefill, len(ids)):
        out.append(runner.forward(t[:, i:i + 1], pos[:, i:i + 1], cache.layers, absorbed=absorbed))
    return torch.cat(out, 1), cache


def test_absorbed_decode_equals_naive_decode(tiny):
    r = CpuRunner(tiny["fp8"])
    absorbed, cache_a = teacher_forced(r, ROW, 3, absorbed=True)
    naive, cache_n = teacher_forced(r, ROW, 3, absorbed=False)
    assert (absorbed - naive).abs().max() / naive.abs().max() < 1e-5
    # The cache is one latent entry per token per layer, kv_lora_rank + rope wide, nothing per head.
    assert cache_a.layers[0].shape == (1, len(ROW), r.cfg.kv_lora_rank + r.cfg.qk_rope_head_dim)
    torch.testing.assert_close(cache_a.layers[-1], cache_n.layers[-1])


def test_absorbed_prefill_equals_naive_prefill(tiny):
    r = CpuRunner(tiny["bf16"])
    a, _ = teacher_forced(r, ROW, len(ROW), absorbed=True)
    n, _ = teacher_forced(r, ROW, len(ROW), absorbed=False)
    assert (a - n).abs().max() / n.abs().max() < 1e-5


def _queries_and_segments(attn, seed: int, b: int, t: int, s: int):
    """Random queries of s tokens, a prior cache of t entries under a random mask, and the s active entries under a
    causal mask among themselves."""
    g = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(b, attn.n_heads, s, attn.nope, generator=g)
    q_pe = torch.randn(b, attn.n_heads, s, attn.rope, generator=g)
    prior, active = (torch.randn(b, n, attn.rank + attn.rope, generator=g) for n in (t, s))
    prior_mask = torch.rand(b, 1, s, t, generator=g) > 0.3
    active_mask = torch.ones(s, s, dtype=torch.bool).tril()[None, None].expand(b, 1, s, s)
    return q_nope, q_pe, prior, prior_mask, active, active_mask


def test_split_attention_equals_attention_over_the_concatenated_cache(tiny):
    """attend_split (prior cache in place + active entries) == attend(absorbed) over their concatenation."""
    attn = CpuRunner(tiny["bf16"]).model.model.layers[1].self_attn
    q_nope, q_pe, prior, prior_mask, active, active_mask = _queries_and_segments(attn, seed=0, b=2, t=7, s=2)
    want = attn.attend(q_nope, q_pe, torch.cat([prior, active], 1), torch.cat([prior_mask, active_mask], -1), True)
    got = attn.attend_split(q_nope, q_pe, prior, prior_mask, active, active_mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_fused_q_a_kv_a_layer_gives_the_two_projections(tiny):
    """The Neuron shell builds q_a_proj and kv_a_proj_with_mqa as one layer (ParallelContext.attention_a returning a
    single module, rows [q_a | kv_a]); MLAttention splits its output back. Same queries and latent entries as the two
    layers of the checkpoint's names."""
    from dataclasses import dataclass

    from kimi_k2_neuron.model.mla import MLAttention
    from kimi_k2_neuron.parallel import ParallelContext

    @dataclass(frozen=True)
    class Fused(ParallelContext):
        def attention_a(self, hidden, q_lora_rank, latent_dim, dtype):
            return {"fused_qkv_a_proj": self.replicated(hidden, q_lora_rank + latent_dim, dtype)}

    runner = CpuRunner(tiny["bf16"])
    two = runner.model.model.layers[1].self_attn
    fused = MLAttention(runner.cfg, torch.float32, Fused())
    state = {k: v for k, v in two.state_dict().items() if not k.startswith(("q_a_proj.", "kv_a_proj_with_mqa."))}
    state["fused_qkv_a_proj.weight"] = torch.cat([two.q_a_proj.weight, two.kv_a_proj_with_mqa.weight])
    fused.load_state_dict(state, strict=True)
    x = torch.randn(2, 5, runner.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    rope = runner.model.rotary(torch.arange(5).expand(2, 5))
    for got, want in zip(fused.project(x, rope), two.project(x, rope)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_sharded_attention_at_one_rank_is_the_absorbed_attention(tiny):
    """attend_sharded (the merge of the sequence-sharded cache: max, exp, sum, then one division) with a KV group of
    one rank, whose collectives are identities, equals the absorbed softmax attention over the same segments, for k
    queries with a causal mask among themselves, split into query tiles or not."""
    attn = CpuRunner(tiny["bf16"]).model.model.layers[1].self_attn
    q_nope, q_pe, prior, prior_mask, active, active_mask = _queries_and_segments(attn, seed=1, b=2, t=9, s=5)
    want = attn.attend_split(q_nope, q_pe, prior, prior_mask, active, active_mask)
    for tile in (None, 2):
        got = attn.attend_sharded(q_nope, q_pe, [prior, active], [prior_mask, active_mask], query_tile=tile)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    naive = attn.attend(q_nope, q_pe, torch.cat([prior, active], 1), torch.cat([prior_mask, active_mask], -1), False)
    torch.testing.assert_close(got, naive, rtol=1e-4, atol=1e-5)


def test_a_key_masked_on_every_row_of_a_segment_adds_nothing(tiny):
    """A segment this rank holds nothing visible in (early positions of a sharded cache) contributes exactly 0, not
    NaN: its scores sit at float32's lowest value and the mask zeroes their exponentials."""
    attn = CpuRunner(tiny["bf16"]).model.model.layers[1].self_attn
    g = torch.Generator().manual_seed(2)
    q_nope, q_pe = torch.randn(1, attn.n_heads, 1, attn.nope, generator=g), torch.randn(1, attn.n_heads, 1, attn.rope)
    seen, hidden = (torch.randn(1, 4, attn.rank + attn.rope, generator=g) for _ in range(2))
    ones, none = torch.ones(1, 1, 1, 4, dtype=torch.bool), torch.zeros(1, 1, 1, 4, dtype=torch.bool)
    got = attn.attend_sharded(q_nope, q_pe, [seen, hidden], [ones, none])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, attn.attend_sharded(q_nope, q_pe, [seen], [ones]), rtol=0, atol=0)
