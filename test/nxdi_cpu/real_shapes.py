"""Test helpers of the real-shape tier (test_real_shapes.py): which NxD/NxDI functions run, the nkilib kernel entry
NxD calls at Kimi's shapes, and the jobs the TP=2 ranks run. Test infrastructure: nothing here is product code.

Kimi-K2's per-rank shapes at TP=64 (test/data/configs, never restated here): hidden 7168, one attention head, q_lora
1536, latent 512 + 64, 384 routed experts of 2048 / 64 = 32 columns, vocab 163840 / 64 = 2560.
"""

from __future__ import annotations

import sys

import torch

# nkilib's bwmm_shard_on_block, as aws-neuron/nki-library d2ad3a5 declares it (src/nkilib_src/nkilib/core/moe/
# moe_cte/bwmm_shard_on_block.py:71-96): its parameters in order; the first seven have no default.
BWMM_SHARD_ON_BLOCK_PARAMS = (
    "hidden_states", "expert_affinities_masked", "gate_up_proj_weight", "down_proj_weight", "block_size",
    "token_position_to_id", "block_to_expert", "gate_and_up_proj_bias", "down_proj_bias", "gate_up_proj_scale",
    "down_proj_scale", "down_activations", "activation_function", "skip_dma", "compute_dtype",
    "is_tensor_update_accumulating", "expert_affinities_scaling_mode", "n_block_per_iter", "gate_clamp_upper_limit",
    "gate_clamp_lower_limit", "up_clamp_upper_limit", "up_clamp_lower_limit", "block_sharding_strategy")
BWMM_REQUIRED = BWMM_SHARD_ON_BLOCK_PARAMS[:7]


def shard_on_block_problems(kw: dict, tokens: int, hidden: int, experts: int, columns: int, block: int,
                            blocks: int) -> list[str]:
    """What the kernel's signature and asserts (same file) say of the arguments NxD passes it, at these shapes:
    [T, H] bf16 hidden (no extra row with the token skip mode), [T * E, 1] affinities, gate_up [E, H, 2, I] (4-D,
    l.1387-1389), down [E, I, H] with I % 16 == 0 (l.1308-1312), int32 [N * B] token positions and [N] experts,
    PING_PONG (l.184-189), no scales (NxD dequantized them) and no bias; accumulation of top_k > 1 experts."""
    out = [f"unknown parameter {k}" for k in kw if k not in BWMM_SHARD_ON_BLOCK_PARAMS]
    out += [f"missing {k}" for k in BWMM_REQUIRED if k not in kw]

    def want(name, shape, dtype):
        t = kw.get(name)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
            out.append(f"{name}: {got}, expected {shape} {dtype}")

    bf16, i32 = torch.bfloat16, torch.int32
    want("hidden_states", (tokens, hidden), bf16)
    want("expert_affinities_masked", (tokens * experts, 1), bf16)
    want("gate_up_proj_weight", (experts, hidden, 2, columns), bf16)
    want("down_proj_weight", (experts, columns, hidden), bf16)
    want("token_position_to_id", (blocks * block,), i32)
    want("block_to_expert", (blocks,), i32)
    if columns % 16:
        out.append(f"I = {columns} is not a multiple of 16")
    checks = {"block_size": block, "is_tensor_update_accumulating": True, "gate_up_proj_scale": None,
              "down_proj_scale": None, "gate_and_up_proj_bias": None, "down_proj_bias": None}
    out += [f"{k}={kw.get(k)!r}, expected {v!r}" for k, v in checks.items() if kw.get(k) != v]
    named = {"block_sharding_strategy": "PING_PONG", "activation_function": "SiLU"}
    out += [f"{k}={kw.get(k)!r}, expected {v}" for k, v in named.items() if getattr(kw.get(k), "name", None) != v]
    if not getattr(kw.get("skip_dma"), "skip_token", False):
        out.append(f"skip_dma={kw.get('skip_dma')!r}: expected the token skip mode")
    return out


class NxdCalls:
    """The functions of NxD's and NxDI's MoE, sampling, operators, KV cache and dequantization code that run inside
    the block while a watched model's forward runs (`watch`), in first-call order, and what each last returned:
    sys.setprofile watches them, nothing is replaced. `paused` stops recording (while a test stand-in stands for a
    kernel)."""

    WATCHED = ("/modules/moe/", "/generation/sampling", "/operators/", "/kvcache/", "/quantization/dequantize")

    def __init__(self):
        self.calls: list[str] = []
        self.returned: dict[str, object] = {}
        self.paused = False
        self._depth = 0  # watched forwards running

    def watch(self, *models) -> list:
        """Record only inside these models' forwards (not the host code around them); returns the hook handles."""
        def enter(*_):
            self._depth += 1

        def leave(*_):
            self._depth -= 1

        return [h for m in models for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]

    def _profile(self, frame, event, arg):
        if self.paused or self._depth == 0 or event not in ("call", "return"):
            return
        path = frame.f_code.co_filename
        if "neuronx_distributed" not in path or not any(w in path for w in self.WATCHED):
            return
        name = frame.f_code.co_qualname
        if event == "call" and name not in self.calls:
            self.calls.append(name)
        elif event == "return" and isinstance(arg, (bool, int, str, type(None))):
            self.returned[name] = arg

    def __enter__(self):
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


class ShardOnBlockEntry:
    """Test-only stand-in for nkilib's bwmm_shard_on_block where NxD calls it, `_bwmm_shard_on_block_nki_call[grid]
    (**kwargs)` (blockwise.py:238): the kernel cannot run here (it needs a NeuronCore), so this records the arguments,
    pauses the spy, and computes NxD's own torch blockwise path (ExpertMLPsV2.torch_blockwise_matmul_inference) for
    the first block only, in the kernel's output layout [T, 2, H]. The graph around the kernel then traces at real
    shapes without ~445 unrolled block bodies per MoE layer; its MoE output is one block's, not the whole prefill's."""

    def __init__(self, spy: NxdCalls):
        self.spy, self.calls, self.module = spy, [], None

    def hook(self, module, _args):  # a forward pre-hook on each ExpertMLPsV2: the module the kernel runs for
        self.module = module

    def __getitem__(self, grid):
        def kernel(**kw):
            self.calls.append({"grid": grid, **kw})
            self.spy.paused = True
            try:
                hidden, block = kw["hidden_states"], kw["block_size"]
                tokens, experts = hidden.shape[0], kw["expert_affinities_masked"].shape[0] // hidden.shape[0]
                one = self.module.torch_blockwise_matmul_inference(
                    block, 1, hidden, kw["expert_affinities_masked"].view(tokens, experts),
                    kw["token_position_to_id"][:block].long(), kw["block_to_expert"][:1].long())
                return torch.stack([one, torch.zeros_like(one)], dim=1)
            finally:
                self.spy.paused = False
        return kernel


# -- jobs of the TP=2 ranks (module-level: ranks are spawned processes) ---------------------------------------------

def logits_and_calls(rank: int, o, rows: list[list[int]], prefill_len: int):
    """cpu.teacher_forced_logits at o.tp ranks, the MoE path report, and the NxD functions rank 0 ran."""
    from kimi_k2_neuron.nxdi_cpu import backend

    app = backend.build(o, seq_len=max(map(len, rows)), batch=len(rows))
    paths = backend.MoEPaths(app)
    spy = NxdCalls()
    spy.watch(*(w.model for w in app.models))
    with spy:
        logits = backend.teacher_forced_logits(app, rows, prefill_len)
    return logits, paths.report(), spy.calls, spy.returned


class _TorchTopK:
    """Test-only stand-in for torch_neuronx's TopK custom call (an XLA op, which needs XLA tensors)."""

    @staticmethod
    def apply(tensor, k, dim=-1):
        return torch.topk(tensor, k, dim=dim)


class _TorchRotatedTopK:
    """Test-only stand-in for nkilib's rotated top-k kernel as NxD calls it, nki_topk[lnc](t, k, sorted_flag)
    (NxD operators/topk.py:14-23): the k largest along the last dim, values and indices."""

    def __getitem__(self, lnc):
        return lambda t, k, sorted_flag=False: torch.topk(t, k, dim=-1, sorted=sorted_flag)


def _replace_device_only_sampling_ops() -> None:
    """In this (rank) process, NxD's and NxDI's device-only sampling ops become their torch equivalents: nkilib's
    top-k and cumsum kernels, torch_neuronx's TopK custom call and NxDI's xla_hlo_call random draw. What stays NxD's
    and NxDI's own: the top-k over each rank's vocabulary shard, the all-gathers of values and indices over the TP
    group (gloo here), the shard offsets, the global top-k, the temperature, top-p and multinomial arithmetic."""
    import neuronx_distributed.operators.topk  # noqa: F401 -- loaded, to replace two of its names
    import neuronx_distributed_inference.modules.generation.sampling as sampling

    topk = sys.modules["neuronx_distributed.operators.topk"]  # the package re-exports the function under this name
    topk.TopK, topk.nki_topk = _TorchTopK, _TorchRotatedTopK()
    sampling.nki_cumsum = lambda t, axis: torch.cumsum(t, dim=axis)
    sampling.rand_like = torch.rand_like


def device_sampler_greedy(rank: int, o, rows: list[list[int]], steps: int):
    """The trn2 sampler configuration at o.tp ranks: on-device sampling as compile_and_save sets it (greedy through
    NxDI's dynamic sampler, top_k 1) over vocab-sharded logits (on_cpu off, so lm_head does not gather and NxDI's
    Sampler runs NxD's distributed top-k over the TP group), with output_logits to read the gathered logits too.
    NxD's and NxDI's device-only ops in that path are replaced in this process (_replace_device_only_sampling_ops,
    test code). -> ((sampled tokens, logits) per step, lm_head gathers?, the sampler's class)."""
    from kimi_k2_neuron.neuron.spec import GREEDY
    from kimi_k2_neuron.nxdi_cpu import backend

    _replace_device_only_sampling_ops()
    app = backend.application(o, max(map(len, rows)) + steps, len(rows), GREEDY, on_cpu=False).to_cpu()
    lm_head = app.context_encoding_model.model.lm_head
    ids, mask, pos = backend.padded_prefill(rows, [len(r) for r in rows])
    seq_ids = torch.arange(len(rows))
    out, got = app.forward(input_ids=ids, attention_mask=mask, position_ids=pos, seq_ids=seq_ids), []
    cur = torch.tensor([len(r) for r in rows])
    for step in range(steps + 1):
        tokens = out.tokens.reshape(len(rows), -1)[:, -1]
        got.append((tokens.clone(), out.logits.float().reshape(len(rows), -1, out.logits.shape[-1])[:, -1].clone()))
        if step == steps:
            break
        step_mask = (torch.arange(int(cur.max()))[None] < cur[:, None]).long()  # [0, pos) of each row
        out = app.forward(input_ids=tokens[:, None], attention_mask=step_mask, position_ids=cur[:, None],
                          seq_ids=seq_ids)
        cur = cur + 1
    return got, lm_head.gather_output, type(app.context_encoding_model.model.sampler).__name__
