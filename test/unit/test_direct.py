"""checkpoint.direct's buffers: large ones sit on 2 MB boundaries in memory the kernel backs with huge pages (so an
O_DIRECT request carries 4 MB rather than ~0.5 MB), are unmapped once freed, and O_DIRECT reads into them return
the file's bytes."""

import gc
import os
from pathlib import Path

import pytest
import torch

from kimi_k2_neuron.checkpoint.direct import HUGE_PAGE, PAGE, aligned_empty, open_direct, pread_into

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping(addr: int) -> dict | None:
    """The /proc/self/smaps entry holding addr: {"range": (lo, hi), field: kB}, or None when unmapped."""
    entry = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            if entry is not None:
                return entry
            if lo <= addr < hi:
                entry = {"range": (lo, hi)}
        elif entry is not None and head[0].endswith(":") and len(head) >= 2 and head[1].isdigit():
            entry[head[0][:-1]] = int(head[1])
    return entry


def test_small_buffers_are_page_aligned():
    t = aligned_empty(PAGE * 3 + 5)
    assert t.dtype == torch.uint8 and t.numel() == PAGE * 3 + 5 and t.data_ptr() % PAGE == 0


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_large_buffers_sit_on_huge_pages_and_are_unmapped_when_freed():
    n = 3 * HUGE_PAGE + 12345
    t = aligned_empty(n)
    assert t.numel() == n and t.data_ptr() % HUGE_PAGE == 0
    t.fill_(7)  # first touch: the kernel picks the page size here
    assert int(t[-1]) == 7
    entry = _mapping(t.data_ptr())
    assert entry is not None
    mode = _THP.read_text() if _THP.exists() else "[never]"
    if "[never]" not in mode:  # "always" or "madvise": the advice is honoured
        assert entry.get("AnonHugePages", 0) >= 3 * HUGE_PAGE // 1024, (mode, entry)
    addr = t.data_ptr()
    del t
    gc.collect()
    after = _mapping(addr)
    assert after is None or after["range"] != entry["range"], "the buffer's mapping outlived the tensor"


def test_o_direct_reads_into_a_huge_buffer_return_the_files_bytes(tmp_path):
    data = torch.randint(0, 256, (5 * HUGE_PAGE + 3 * PAGE,), dtype=torch.uint8, generator=torch.Generator()
                         .manual_seed(0))
    f = tmp_path / "blob"
    f.write_bytes(data.numpy().tobytes())
    fd = os.open(f, os.O_RDONLY)
    direct = open_direct(f, os.O_RDONLY)
    try:
        buf = aligned_empty(4 * HUGE_PAGE + 2 * PAGE)
        for offset, nbytes in ((0, 4 * HUGE_PAGE), (PAGE + 8, 3 * HUGE_PAGE + 100), (HUGE_PAGE + 16, 12345)):
            got = pread_into(fd, direct, offset, nbytes, buf)
            assert torch.equal(got, data[offset: offset + nbytes]), (offset, nbytes)
    finally:
        os.close(fd)
        if direct is not None:
            os.close(direct)
