"""Operations: memory given back after bursts, signals that must not kill the daemon, a re-exec that the working
directory cannot shadow, interrupted GGUF conversions cleaned up, early disconnects logged as info."""

from __future__ import annotations

import sys

import pytest

from mlxd.runtime.heap import HeapTrimmer, rss_bytes

linux_glibc = pytest.mark.skipif(sys.platform != "linux", reason="malloc_trim and /proc are Linux (glibc) only")


@linux_glibc
def test_the_trimmer_gives_back_what_a_burst_freed_in_the_middle_of_the_heap():
    trimmer = HeapTrimmer()
    # Blocks above pymalloc's 512 bytes come from malloc; keeping every tenth one alive leaves the freed memory in
    # the middle of the heap, where free() itself never gives it back.
    blocks = [bytes(16_000) + bytes([i % 256]) for i in range(20_000)]  # 320 MB
    kept = blocks[::10]
    grown = rss_bytes()
    del blocks
    freed = rss_bytes()
    assert grown - freed < 100 << 20  # freeing alone gave little back
    given_back = trimmer.trim_if_grown()
    assert given_back is not None and given_back > 250 << 20, given_back
    assert trimmer.trim_if_grown() is None  # nothing grew since: no second trim
    assert len(kept) == 2_000
