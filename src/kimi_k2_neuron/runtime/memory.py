"""A prefill's attention memory against the memory the process can have, and the prefill chunk that keeps one within
the other: the rule of every CPU path (README, "Long prompts").

A prefill call of N query tokens over T cached tokens holds attention scores for every row, head, query and key at
once: SCORE_BYTES each at the peak, so memory grows with the square of a prompt sent in one call. When that
estimate for one call is more than SHARE of the memory available, the prompt is prefilled in chunks of the largest
power of two that fits (each chunk attends to the cache written so far: the same logits, to float rounding); a
--prefill-chunk the user gives is kept if it fits the same share, else refused, naming the largest that does.
Stdlib only, so that the CLI decides before it loads anything.
"""

from __future__ import annotations

import math
import os
import resource
from dataclasses import dataclass
from pathlib import Path

from ..errors import KimiInputError

# Peak bytes per score element of one prefill call (rows x heads x queries x keys): the float32 sum of the two
# score products, its scaled copy, the masked copy and the softmax output live at once, plus the boolean mask.
# Measured on the tiny model (4 heads): peak RSS minus RSS after loading, over 4 * S^2 elements: 17.3 (float32) and
# 13.2 (bfloat16) at S = 4000, 18.2 and 16.0 at S = 2000 (the rest there is the linear part: logits, activations).
SCORE_BYTES = 17
# The share of the available memory one call's attention may take: the rest is for the weights, the KV cache, the
# activations and the logits.
SHARE = 0.5
GiB = 2**30


def attention_bytes(heads: int, rows: int, queries: int, keys: int) -> int:
    """Peak memory of the attention scores of one prefill call, all heads of all ranks together (a rank of a KV
    group holds its heads x G gathered queries over its 1/G of the keys: the same total)."""
    return SCORE_BYTES * heads * rows * queries * keys


def available_bytes(ranks: int = 1) -> int | None:
    """What the host lets this command have now: MemAvailable, capped by a cgroup's memory limit and by the address
    space left under `ulimit -v` (per process, so times the ranks that share the work). None where nothing says."""
    limits = [_meminfo_available(), _cgroup_left()]
    left = _address_space_left()
    if left is not None:
        limits.append(left * ranks)
    known = [b for b in limits if b is not None]
    return min(known) if known else None


@dataclass(frozen=True)
class PrefillChunk:
    chunk: int | None  # tokens per prefill call; None: the whole prompt in one call
    note: str | None = None  # why a chunk was chosen, for stderr


def prefill_chunk(heads: int, rows: int, tokens: int, given: int | None, ranks: int = 1,
                  available: int | None = None) -> PrefillChunk:
    """The prefill chunk for `rows` prompts of `tokens` tokens prefilled together, such that one call's attention
    takes at most SHARE of the available memory: `given` (--prefill-chunk) if it does (else refused, naming the
    largest that does), else one call if that does, else the largest power of two that does. `available`: bytes
    (default: now)."""
    available = available_bytes(ranks) if available is None else available
    if available is None or tokens <= 1:
        return PrefillChunk(given)
    budget = int(available * SHARE)
    if given is not None:
        need = attention_bytes(heads, rows, min(given, tokens), tokens)
        if need > budget:
            fits = _largest_chunk(heads, rows, tokens, budget)
            raise KimiInputError(f"--prefill-chunk {given}: a chunk's attention over a prompt of {tokens} tokens "
                                 f"needs ~{need / GiB:.1f} GiB, more than half the {available / GiB:.1f} GiB "
                                 f"available; " + (f"--prefill-chunk {fits} fits" if fits else
                                                   "not even one token per call fits"))
        return PrefillChunk(given)
    need = attention_bytes(heads, rows, tokens, tokens)
    if need <= budget:
        return PrefillChunk(None)
    chunk = _largest_chunk(heads, rows, tokens, budget)
    if chunk is None:
        per_token = attention_bytes(heads, rows, 1, tokens)
        raise KimiInputError(f"input: a prompt of {tokens} tokens needs ~{per_token / GiB:.1f} GiB of attention per "
                             f"prefilled token, more than half the {available / GiB:.1f} GiB available; use a bigger "
                             f"host or a shorter prompt")
    return PrefillChunk(chunk, f"note: a prefill of {tokens} tokens in one call would take ~{need / GiB:.1f} GiB for "
                               f"attention, more than half the {available / GiB:.1f} GiB available: prefilling "
                               f"{chunk} tokens per call (--prefill-chunk N sets it)")


def check_one_call(heads: int, rows: int, queries: int, keys: int, what: str, ranks: int = 1) -> None:
    """Refuses a call whose attention would take more than SHARE of the available memory, where nothing can chunk it
    for the user (the NxDI model's graphs are built per bucket: --prefill-chunk builds a chunk submodel)."""
    available = available_bytes(ranks)
    need = attention_bytes(heads, rows, queries, keys)
    if available is None or need <= available * SHARE:
        return
    fits = _largest_chunk(heads, rows, keys, int(available * SHARE))
    raise KimiInputError(f"{what}: the attention of {queries} tokens over {keys} in one call needs ~{need / GiB:.1f} "
                         f"GiB (an estimate), more than half the {available / GiB:.1f} GiB available; give "
                         + (f"--prefill-chunk {fits} or less" if fits else "a shorter prompt or a bigger host"))


def _largest_chunk(heads: int, rows: int, keys: int, budget: int) -> int | None:
    per_query = attention_bytes(heads, rows, 1, keys)
    if per_query > budget:
        return None
    return min(2 ** int(math.log2(budget // per_query)), keys)


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_left() -> int | None:
    """A memory limit of this process's cgroup (v2 memory.max, v1 memory.limit_in_bytes) minus its usage."""
    for limit, usage in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes",
                                                             "memory/memory.usage_in_bytes")):
        try:
            cap = Path("/sys/fs/cgroup", limit).read_text().strip()
            used = int(Path("/sys/fs/cgroup", usage).read_text())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < 2**60:  # v1 says "no limit" with a huge number
            return max(int(cap) - used, 0)
    return None


def _address_space_left() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        status = Path(f"/proc/{os.getpid()}/status").read_text()
        size = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmSize:"))
    except (OSError, ValueError, StopIteration):
        return None
    return max(soft - size, 0)
