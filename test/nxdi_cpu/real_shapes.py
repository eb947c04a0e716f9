"""Test helpers of the real-shape tier (test_real_shapes.py): which NxD/NxDI functions run, the nkilib kernel entry
NxD calls at Kimi's shapes, and the jobs the TP=2 ranks run. Test infrastructure: nothing here is product code.

Kimi-K2's per-rank shapes at TP=64 (test/data/configs, never restated here): hidden 7168, one attention head, q_lora
1536, latent 512 + 64, 384 routed experts of 2048 / 64 = 32 columns, vocab 163840 / 64 = 2560.
"""

from __future__ import annotations

import sys
import types

import torch
from nki_kernels import kernel_problems, moe_cte_reference, reference, translate

# What Kimi's prefill needs of the arguments NxD passes bwmm_shard_on_block that the kernel itself does not assert
# (its own asserts and static bounds run in nki_kernels.kernel_problems): name -> (expected, why). Shapes and values
# are checked against the model's T, H, E, I and NxD's block count in shard_on_block_problems.
SHARD_ON_BLOCK_INTENT = {
    "block_size": (128, "the mode's block (moe_paths.MODES)"),
    "compute_dtype": ("bfloat16", "the I/O dtype: NxD passes torch_to_nki_dtype(hidden_states.dtype) (blockwise.py:254)"
                                  "; another makes the kernel's SBUF copies and PE matmuls run in it"),
    "skip_dma": ((True, False), "the mode's skip_dma_token and NxD's default skip_dma_weight (moe_paths.MODES, NxD "
                                "model_utils.py:95): -1 rows skipped, every block's weights loaded"),
    "is_tensor_update_accumulating": (True, "top-8: each token's 8 expert outputs add up (without it the kernel "
                                            "writes each block's rows over the earlier experts')"),
    "expert_affinities_scaling_mode": ("POST_SCALE", "Kimi weights each expert's output; PRE_SCALE scales the input "
                                                     "of a nonlinear MLP"),
    "activation_function": ("SiLU", "Kimi's experts are SwiGLU: silu(gate) * up"),
    "block_sharding_strategy": ("PING_PONG", "the kernel's only strategy (bwmm_shard_on_block.py:184)"),
    "n_block_per_iter": (1, "unused by bwmm_shard_on_block at d2ad3a5 (only its signature names it, l.90): NxD passes "
                            "none; another value asks for a blocking the kernel does not do"),
    "gate_and_up_proj_bias": (None, "Kimi's experts have no bias"),
    "down_proj_bias": (None, "Kimi's experts have no bias"),
    "gate_up_proj_scale": (None, "NxD dequantizes the FP8 experts to bf16 before the kernel (NXDI_CONTRACT.md: "
                                 "kernel-dequantizes)"),
    "down_proj_scale": (None, "NxD dequantizes the FP8 experts to bf16 before the kernel"),
    "down_activations": (None, "inference: no activations kept for a backward pass"),
    "gate_clamp_upper_limit": (None, "Kimi's SwiGLU is unclamped"),
    "gate_clamp_lower_limit": (None, "Kimi's SwiGLU is unclamped"),
    "up_clamp_upper_limit": (None, "Kimi's SwiGLU is unclamped"),
    "up_clamp_lower_limit": (None, "Kimi's SwiGLU is unclamped"),
}
SHARD_ON_BLOCK_DEFAULTS = {"n_block_per_iter": 1}  # the kernel's signature defaults NxD leaves out


def _plain(value):
    """An argument as SHARD_ON_BLOCK_INTENT states it: enums and records by name, dtypes by their NKI name."""
    if hasattr(value, "skip_token"):
        return (bool(value.skip_token), bool(value.skip_weight))
    if isinstance(value, (torch.dtype, torch.Tensor)):
        return value
    return getattr(value, "name", value)


def shard_on_block_problems(kw: dict, cfg, tokens: int, blocks: int, grid: int = 2) -> list[str]:
    """Everything wrong with one bwmm_shard_on_block call for Kimi's prefill of `tokens` tokens: the kernel's own
    checks (nki_kernels.kernel_problems, traced for each program of the LNC=2 grid), the shapes and dtypes the model
    needs (T = tokens rows, no padding row with the token skip mode; [T * E, 1] affinities; gate_up [E, H, 2, I];
    down [E, I, H]; int32 [N * B] token positions and [N] experts, N = NxD's block count), SHARD_ON_BLOCK_INTENT, and,
    where the tensors hold values, the block maps: each a valid index, every routed (token, expert) pair in exactly
    one row of a block of that expert."""
    out = kernel_problems("bwmm_shard_on_block", kw, grid=grid)
    h, e, i = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    block = SHARD_ON_BLOCK_INTENT["block_size"][0]
    bf16, i32 = torch.bfloat16, torch.int32
    shapes = {"hidden_states": ((tokens, h), bf16), "expert_affinities_masked": ((tokens * e, 1), bf16),
              "gate_up_proj_weight": ((e, h, 2, i), bf16), "down_proj_weight": ((e, i, h), bf16),
              "token_position_to_id": ((blocks * block,), i32), "block_to_expert": ((blocks,), i32)}
    for name, (shape, dtype) in shapes.items():
        t = kw.get(name)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
            out.append(f"{name}: {got}, expected {shape} {dtype}")
    for name, (want, why) in SHARD_ON_BLOCK_INTENT.items():
        got = _plain(kw.get(name, SHARD_ON_BLOCK_DEFAULTS.get(name)))
        if got != want:
            out.append(f"{name}={got!r}, expected {want!r}: {why}")
    if not out and kw["token_position_to_id"].device.type != "meta":
        out += _block_map_problems(kw, cfg, tokens, block)
    return out


def _block_map_problems(kw: dict, cfg, tokens: int, block: int) -> list[str]:
    """The values the tracer cannot see: the weight DMAs run with oob_mode.error without the weight skip
    (bwmm_shard_on_block.py:1348, 1454), so every block names an expert < E; token rows are < T or -1 (padding, skipped
    by the token skip mode's oob_mode.skip); each of a token's top-k experts (its nonzero affinities) has the token in
    exactly one row of one of its blocks."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    b2e, rows = kw["block_to_expert"].long(), kw["token_position_to_id"].long()
    out = []
    if b2e.min() < 0 or b2e.max() >= e:
        out.append(f"block_to_expert: values {int(b2e.min())}..{int(b2e.max())}, expected 0..{e - 1}")
    if rows.min() < -1 or rows.max() >= tokens:
        out.append(f"token_position_to_id: values {int(rows.min())}..{int(rows.max())}, expected -1..{tokens - 1}")
    if out:
        return out
    expert_of_row = b2e.repeat_interleave(block)
    real = rows >= 0
    placed = torch.zeros(tokens, e, dtype=torch.long)
    placed.index_put_((rows[real], expert_of_row[real]), torch.ones(int(real.sum()), dtype=torch.long),
                      accumulate=True)
    routed = kw["expert_affinities_masked"].view(tokens, e) != 0
    if not torch.equal(placed, routed.long()):
        bad = (placed != routed.long()).any(1).nonzero().flatten()
        out.append(f"token_position_to_id/block_to_expert: {len(bad)} token(s) (first {int(bad[0])}) not placed "
                   f"exactly once with each expert of nonzero affinity")
    if not torch.equal(routed.sum(1), torch.full((tokens,), k)):
        out.append(f"expert_affinities_masked: tokens with other than top_k={k} nonzero affinities")
    return out


def as_meta(kw: dict) -> dict:
    """The call with its large tensors as meta tensors (shape and dtype only: what the kernel's checks read); the
    block maps and the affinities keep their values."""
    keep = ("token_position_to_id", "block_to_expert", "expert_affinities_masked")
    return {k: v.to("meta") if isinstance(v, torch.Tensor) and k not in keep else v for k, v in kw.items()}


def split_call(call: dict) -> tuple[int, int, dict]:
    """A recorded call -> (grid, MoE layer, the kernel's keyword arguments)."""
    kw = dict(call)
    return int(kw.pop("grid")), kw.pop("layer"), kw


def reference_output(kw: dict, cfg, grid: int = 2) -> torch.Tensor:
    """nkilib's moe_cte_torch_ref (the golden its device tests hold bwmm_shard_on_block to) on exactly these
    arguments (NxD's enums and records by name as the sources' own), as the kernel returns it: [T, 2, H] when
    accumulating top_k > 1 experts (NxD keeps [:, 0], blockwise.py:259-262)."""
    args = {k: translate(v) for k, v in kw.items()}
    return moe_cte_reference(lnc_degree=grid, top_k=cfg.num_experts_per_tok, **args)["output"]


def token_subset(kw: dict, keep: list[int]) -> dict:
    """The same call for the tokens `keep` only (renumbered 0..len-1): their rows of hidden_states and the
    affinities, and the blocks holding any of them, with the other tokens' rows padding (-1). A call of the same
    layout with fewer blocks, for checks that compute nki-library's reference many times."""
    tokens = kw["hidden_states"].shape[0]
    experts = kw["expert_affinities_masked"].shape[0] // tokens
    block = kw["block_size"]
    renumber = torch.full((tokens + 1,), -1, dtype=torch.long)
    renumber[torch.tensor(keep)] = torch.arange(len(keep))
    rows = renumber[kw["token_position_to_id"].long()].view(-1, block)  # -1 stays -1 (index tokens: the pad)
    used = (rows >= 0).any(1)
    return {**kw, "hidden_states": kw["hidden_states"][keep],
            "expert_affinities_masked": kw["expert_affinities_masked"].view(tokens, experts)[keep].reshape(-1, 1),
            "token_position_to_id": rows[used].flatten().to(torch.int32),
            "block_to_expert": kw["block_to_expert"][used]}


def core_routed_experts(ckpt, layer: int):
    """The model's own math for a MoE layer's routed experts: the core's MoE (model/moe.py: the noaux_tc router,
    then each token through its top-k experts, weighted), float32, this layer's weights read from the converted
    checkpoint by the core's loader, the shared expert left out (the kernel computes only the routed ones)."""
    from kimi_k2_neuron.checkpoint.source import WeightSource
    from kimi_k2_neuron.model.model import KimiK2ForCausalLM
    from kimi_k2_neuron.weights import load_weights

    source = WeightSource(ckpt)
    with torch.device("meta"):
        model = KimiK2ForCausalLM(source.cfg, torch.float32)
    moe = model.model.layers[layer].mlp
    moe.to_empty(device="cpu")
    load_weights(model, source, f"model.layers.{layer}.mlp.")
    moe.shared_experts = None
    return moe


def moe_difference(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    """max |got - want| / max |want| and the RMS ratio, over [T, H]."""
    d = (got.float() - want.float())
    return {"max_rel": float(d.abs().max() / want.abs().max()),
            "rms_rel": float(d.pow(2).mean().sqrt() / want.float().pow(2).mean().sqrt())}


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
    (**kwargs)` (blockwise.py:238), in a traced graph: it records the arguments (with the MoE layer they are for) for
    the tests, which check them against the kernel's own asserts and compute nki-library's torch reference on them
    once the trace is done (`cpu_calls`). Inside the graph it pauses the spy and computes NxD's own torch blockwise
    path (ExpertMLPsV2.torch_blockwise_matmul_inference) for the first block only, in the kernel's output layout
    [T, 2, H], so the graph around the kernel traces at real shapes without ~445 unrolled block bodies per MoE layer
    (the reference, a Python loop over the blocks reading their experts' ids, cannot be traced); the next layer's
    input is therefore not the real one."""

    def __init__(self, spy: NxdCalls, layers: dict | None = None):
        self.spy, self.calls, self.module, self.layers = spy, [], None, layers or {}

    def hook(self, module, _args):  # a forward pre-hook on each ExpertMLPsV2: the module the kernel runs for
        self.module = module

    def cpu_calls(self) -> list[dict]:
        """The recorded calls on the host, after the traced graph has run (torch_xla materialized them with it)."""
        return [{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in c.items()} for c in self.calls]

    def __getitem__(self, grid):
        def kernel(**kw):
            self.calls.append({"grid": grid, "layer": self.layers.get(self.module), **kw})
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


class SamplerKernels:
    """Test-only stand-ins for the nkilib kernels NxD's and NxDI's on-device sampler calls, each where it is called:
    the rotated top-k `nki_topk[lnc](t, k, sorted_flag)` (NxD operators/topk.py:14-23), `nki_cumsum(t, axis=1)` (NxDI
    sampling.py:70) and the cascaded max `nki_max[2](t)` (NxD operators/argmax.py:124). Each call is recorded with its
    arguments' shapes and dtypes and the kernel's own checks on them (nki_kernels.kernel_problems), and returns
    nki-library's torch reference on exactly those arguments (topk/torch_ref.py, cumsum/cumsum_torch.py,
    max/cascaded_max_torch.py). Their int32 indices are widened to int64 for the CPU torch ops NxD applies to them
    (torch.gather, the shard offsets), which on the device take the kernel's int32."""

    def __init__(self):
        self.calls: list[dict] = []

    def _record(self, kernel: str, tensor: torch.Tensor, grid, **scalars) -> None:
        args = {"x": tensor, "axis": scalars["axis"]} if kernel == "cumsum" else {}
        problems = kernel_problems(kernel, args or {k: v for k, v in scalars.items()}, grid=grid,
                                   args=() if args else (tensor,))
        self.calls.append({"kernel": kernel, "shape": tuple(tensor.shape), "dtype": str(tensor.dtype).split(".")[-1],
                           "grid": grid, **scalars, "problems": problems})

    def topk(self, lnc):
        def call(t, k, sorted_flag=True):
            self._record("topk", t, lnc, k=k, sorted_flag=sorted_flag)
            config = types.SimpleNamespace(topk_config=types.SimpleNamespace(k=k, sorted=sorted_flag))
            out = reference("topk")(t, config)
            return out["topk_values"], out["topk_indices"].long()
        return call

    def cumsum(self, t, axis):
        self._record("cumsum", t, None, axis=axis)
        return reference("cumsum")(t, axis)["output_0"]

    def cascaded_max(self, grid):
        def call(t):
            self._record("cascaded_max", t, grid)
            out = reference("cascaded_max")(t)
            return out["max_values"], out["max_indices"].long()
        return call


class _TorchTopK:
    """Test-only stand-in for torch_neuronx's TopK custom call (an XLA op, which needs XLA tensors; no nkilib
    kernel): torch.topk."""

    @staticmethod
    def apply(tensor, k, dim=-1):
        return torch.topk(tensor, k, dim=dim)


class _Subscriptable:
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn(grid)


def _replace_device_only_sampling_ops() -> SamplerKernels:
    """In this (rank) process, NxD's and NxDI's device-only sampling ops become test stand-ins: nkilib's top-k,
    cumsum and max kernels compute their nki-library references (SamplerKernels), torch_neuronx's TopK custom call
    torch.topk, NxDI's xla_hlo_call random draw torch.rand_like. What stays NxD's and NxDI's own: the top-k over each
    rank's vocabulary shard, the all-gathers of values and indices over the TP group (gloo here), the shard offsets,
    the global top-k, the temperature, top-p and multinomial arithmetic."""
    import neuronx_distributed.operators.argmax  # noqa: F401 -- loaded, to replace their kernel names
    import neuronx_distributed.operators.topk  # noqa: F401
    import neuronx_distributed_inference.modules.generation.sampling as sampling

    kernels = SamplerKernels()
    topk = sys.modules["neuronx_distributed.operators.topk"]  # the package re-exports the function under this name
    argmax = sys.modules["neuronx_distributed.operators.argmax"]
    topk.TopK, topk.nki_topk = _TorchTopK, _Subscriptable(kernels.topk)
    argmax.nki_max = _Subscriptable(kernels.cascaded_max)
    sampling.nki_cumsum = kernels.cumsum
    sampling.rand_like = torch.rand_like
    return kernels


def device_sampler_greedy(rank: int, o, rows: list[list[int]], steps: int):
    """The trn2 sampler configuration at o.tp ranks: on-device sampling as compile_and_save sets it (greedy through
    NxDI's dynamic sampler, top_k 1) over vocab-sharded logits (on_cpu off, so lm_head does not gather and NxDI's
    Sampler runs NxD's distributed top-k over the TP group), with output_logits to read the gathered logits too.
    NxD's and NxDI's device-only ops in that path are replaced in this process (_replace_device_only_sampling_ops,
    test code). -> ((sampled tokens, logits) per step, lm_head gathers?, the sampler's class, the kernel calls)."""
    from kimi_k2_neuron.neuron.spec import GREEDY
    from kimi_k2_neuron.nxdi_cpu import backend

    kernels = _replace_device_only_sampling_ops()
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
    return got, lm_head.gather_output, type(app.context_encoding_model.model.sampler).__name__, kernels.calls
