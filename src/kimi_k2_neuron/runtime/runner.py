"""The CPU runner: load a checkpoint (in memory, or one layer at a time), compute logits, generate.

Layer-streamed mode lets the real 1T checkpoint produce golden logits on a big-RAM CPU host: each decoder layer is
loaded, run and freed (peak about one layer plus embeddings and KV cache), with logits equal to in-memory mode's.
Every pass streams ~1 TB, so requests show a bar over decoder-layer passes. Requests are checked against config.json
alone, so the CLI refuses them before it loads anything.
"""

from __future__ import annotations

import numbers
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from ..checkpoint.source import WeightSource
from ..config import KimiK2Config
from ..errors import KimiInputError
from ..model.model import KimiK2ForCausalLM
from ..parallel import SINGLE, ParallelContext
from ..progress import bar as progress_bar
from ..weights import check_against_config, load_weights
from . import DTYPE_NAMES
from .kv_cache import LatentCache
from .memory import prefill_chunk
from .sampling import SamplingParams, sample

_TOP_LEVEL = ("model.embed_tokens.", "model.norm.", "lm_head.")


DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per row, stop token included when one was hit
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens the decode steps gave the rows (each row's first came from prefill); a row that has stopped
        still rides along in the batch but adds none."""
        n = sum(max(len(t) - 1, 0) for t in self.tokens)
        return n / self.decode_seconds if self.decode_seconds > 0 else float("nan")


class CpuRunner:
    def __init__(self, model_dir, dtype: torch.dtype = torch.float32, layer_streamed: bool = False,
                 progress: bool = False, ctx: ParallelContext = SINGLE, cfg: KimiK2Config | None = None,
                 prefill_chunk: int | None = None):
        """`cfg`: model_dir's config.json as the caller already read it (else read here). `prefill_chunk`: tokens
        per prefill call (None: a prompt in one call)."""
        if prefill_chunk is not None and prefill_chunk < 1:
            raise KimiInputError(f"--prefill-chunk {prefill_chunk}: expected an integer >= 1")
        self.ctx, self.prefill_chunk = ctx, prefill_chunk
        self.source = WeightSource(model_dir, cfg)
        self.cfg, self.dtype, self.layer_streamed, self.progress = self.source.cfg, dtype, layer_streamed, progress
        self._bar = progress_bar(disable=True)  # the running request's bar (_passes); a no-op outside requests
        check_against_config(self.source)  # before the model config.json describes is allocated
        if layer_streamed:
            self._check_streamable_names()
            with torch.device("meta"):
                self.model = KimiK2ForCausalLM(self.cfg, dtype, ctx)
            for prefix in _TOP_LEVEL:
                self.model.get_submodule(prefix[:-1]).to_empty(device="cpu")
                load_weights(self.model, self.source, prefix)
        else:
            self.model = KimiK2ForCausalLM(self.cfg, dtype, ctx)
            load_weights(self.model, self.source, progress=progress)

    def _check_streamable_names(self) -> None:
        """In-memory loading checks all names at once; streaming checks per layer, so check the rest here."""
        layer_prefixes = tuple(f"model.layers.{i}." for i in range(self.cfg.num_hidden_layers))
        stray = [n for n in self.source.names() if not n.startswith(_TOP_LEVEL + layer_prefixes)]
        if stray:
            raise KimiInputError(f"{self.source.dir}: tensor(s) the model has no place for: {', '.join(stray[:4])}")

    @contextmanager
    def _stream_layer(self, idx: int):
        layer = self.model.model.layers[idx]
        layer.to_empty(device="cpu")
        try:
            load_weights(self.model, self.source, f"model.layers.{idx}.")
            yield
        finally:
            layer.to("meta")  # frees the layer's weights

    def new_cache(self, batch: int, max_len: int) -> LatentCache:
        """This rank's cache: its share of a sequence-sharded one (ctx.kv_group > 1), else all of it."""
        return LatentCache(self.cfg, batch, max_len, self.dtype, self.ctx.kv_group, self.ctx.kv_rank())

    @contextmanager
    def _around_layer(self, idx: int):
        """Entered around each decoder layer: loads and frees it in layer-streamed mode, and ticks the bar."""
        with self._stream_layer(idx) if self.layer_streamed else nullcontext():
            yield
        self._bar.update()

    @contextmanager
    def _passes(self, what: str, passes: int):
        """The bar of one request of `passes` forward passes, counted in decoder layers."""
        n = self.cfg.num_hidden_layers
        desc = f"{what}: {passes} pass{'es' * (passes != 1)} x {n} layers"
        self._bar = progress_bar(total=passes * n, unit="layer", desc=desc, disable=not self.progress, leave=False)
        try:
            yield
        finally:
            self._bar.close()
            self._bar = progress_bar(disable=True)

    def forward(self, ids, positions, cache_layers, absorbed=None) -> torch.Tensor:
        return self.model(ids, positions, cache_layers, absorbed=absorbed, layer_hook=self._around_layer)

    def prefill(self, ids, positions, cache_layers) -> list[torch.Tensor]:
        """The logits of a prefill of ids/positions [B, K], in calls of prefill_chunk tokens (one call without)."""
        n = self._chunk(*ids.shape) or max(1, ids.shape[1])  # a prefill of 0 tokens is no call
        return [self.forward(ids[:, c:c + n], positions[:, c:c + n], cache_layers) for c in range(0, ids.shape[1], n)]

    def prefill_last(self, ids, positions, cache_layers) -> torch.Tensor:
        """The last position's logits [B, V] of a prefill: each call's other logits freed as the next one runs (a
        125k-token prompt's [S, V] float32 logits of Kimi-K2 would take 82 GB)."""
        n = self._chunk(*ids.shape) or max(1, ids.shape[1])
        last = None
        for c in range(0, ids.shape[1], n):
            last = self.forward(ids[:, c:c + n], positions[:, c:c + n], cache_layers)[:, -1].clone()
        return last

    def prefill_calls(self, k: int, rows: int = 1) -> int:
        n = self._chunk(rows, k)
        return 0 if k == 0 else 1 if n is None else -(-k // n)

    def _chunk(self, rows: int, tokens: int) -> int | None:
        """prefill_chunk, or when it is None the chunk that keeps one call's attention within the memory available
        (runtime/memory.py). Ranks are given theirs by the parent, which decides once for all of them."""
        if self.prefill_chunk is not None or self.ctx.tp_size > 1:
            return self.prefill_chunk
        return prefill_chunk(self.cfg.num_attention_heads, rows, tokens, None).chunk

    def logits(self, rows: list[list[int]], prefill_len: int | None = None) -> torch.Tensor:
        """Float32 logits [B, S, V]: positions < prefill_len from prefill, the rest teacher-forced through decode;
        rows of different lengths run one at a time, NaN past their end (as `--backend nxdi-cpu`)."""
        check_logits_request(self.cfg, rows, prefill_len)
        if len({len(r) for r in rows}) > 1:
            out = torch.full((len(rows), max(map(len, rows)), self.cfg.vocab_size), float("nan"))
            for i, r in enumerate(rows):
                out[i, :len(r)] = self.logits([r], None if prefill_len is None else min(prefill_len, len(r)))[0]
            return out
        ids = torch.tensor(rows)
        b, s = ids.shape
        k = s if prefill_len is None else prefill_len
        cache = self.new_cache(b, s)
        pos = torch.arange(s).expand(b, s)
        with self._passes("logits", self.prefill_calls(k, b) + s - k):
            out = self.prefill(ids[:, :k], pos[:, :k], cache.layers)
            out += [self.forward(ids[:, t:t + 1], pos[:, t:t + 1], cache.layers) for t in range(k, s)]
        return torch.cat(out, dim=1)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams = SamplingParams(),
                 stop_ids: set[int] = frozenset(), seed: int = 0,
                 stop_when: Callable[[list[int]], bool] | None = None,
                 on_token: Callable[[int, int], None] | None = None) -> GenerationResult:
        """Prompts may differ in length: each row is prefilled on its own, then all rows decode together, each
        at its own position. A row ends at a token in `stop_ids`, or once stop_when(its new tokens) is true.
        on_token(row, token) is called with each new token as it is made (for streaming, and for what an
        interrupt keeps)."""
        check_generate_request(self.cfg, prompts, max_new_tokens)
        with self._passes("generate", sum(self.prefill_calls(len(p)) for p in prompts) + max_new_tokens - 1):
            return self._generate(prompts, max_new_tokens, params, stop_ids, seed, stop_when, on_token)

    def _generate(self, prompts, max_new_tokens, params, stop_ids, seed, stop_when, on_token) -> GenerationResult:
        gen = torch.Generator().manual_seed(seed)
        lens = torch.tensor([len(p) for p in prompts])
        cache = self.new_cache(len(prompts), int(lens.max()) + max_new_tokens)
        t0 = time.perf_counter()
        last = torch.stack([self.prefill_last(torch.tensor([p]), torch.arange(len(p))[None], cache.rows(i, i + 1))[0]
                            for i, p in enumerate(prompts)])
        t1 = time.perf_counter()
        outs, done, steps = [[] for _ in prompts], [False] * len(prompts), 0
        positions = lens.clone()
        for step in range(max_new_tokens):
            tok = sample(last, params, gen)
            for i, t in enumerate(tok.tolist()):
                if not done[i]:
                    outs[i].append(t)
                    if on_token is not None:
                        on_token(i, t)
                    done[i] = t in stop_ids or (stop_when is not None and stop_when(outs[i]))
            if all(done) or step == max_new_tokens - 1:
                break
            last = self.forward(tok[:, None], positions[:, None], cache.layers)[:, -1]
            positions += 1
            steps += 1
        return GenerationResult(outs, t1 - t0, time.perf_counter() - t1, steps)


def check_rows(cfg: KimiK2Config, rows: list[list[int]]) -> None:
    """Token-id rows a forward pass takes: each non-empty, integer ids inside config.json's vocabulary."""
    if not rows or any(len(r) == 0 for r in rows):
        raise KimiInputError("input ids: every row needs at least one token")
    v = cfg.vocab_size
    kind = next((t for r in rows for t in r if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
    if kind is not None:
        raise KimiInputError(f"input ids: token {kind!r} is a {type(kind).__name__}, expected an integer id")
    bad = [t for r in rows for t in r if not 0 <= t < v]
    if bad:
        raise KimiInputError(f"input ids: token {bad[0]} is outside the vocabulary [0, {v}) of config.json")


def check_logits_request(cfg: KimiK2Config, rows: list[list[int]], prefill_len: int | None) -> None:
    """What CpuRunner.logits refuses, from config.json alone."""
    check_rows(cfg, rows)
    s = max(len(r) for r in rows)
    k = s if prefill_len is None else prefill_len
    if not 0 <= k <= s:
        raise KimiInputError(f"--prefill-len {k} must be between 0 and the sequence length {s}")
    _check_positions(cfg, s, f"input ids: rows of {s} tokens")


def check_generate_request(cfg: KimiK2Config, prompts: list[list[int]], max_new_tokens: int) -> None:
    """What CpuRunner.generate refuses, from config.json alone."""
    check_rows(cfg, prompts)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise KimiInputError(f"--max-new-tokens {max_new_tokens!r}: expected an integer >= 1")
    longest = max(len(p) for p in prompts)
    _check_positions(cfg, longest + max_new_tokens,
                     f"--max-new-tokens {max_new_tokens}: a prompt of {longest} tokens + {max_new_tokens} new tokens")


def _check_positions(cfg: KimiK2Config, needed: int, what: str) -> None:
    # YaRN stretches RoPE to max_position_embeddings and no further: past it the model runs, but nothing says its
    # output still makes sense, so refuse rather than run silently.
    if needed > cfg.max_position_embeddings:
        raise KimiInputError(f"{what} need {needed} positions, expected at most max_position_embeddings="
                             f"{cfg.max_position_embeddings} of config.json")
