"""spanrl/core/heap.py: malloc_totals sees memory allocated with malloc and freed again."""
import ctypes
import ctypes.util

import pytest

from spanrl.core import heap

pytestmark = pytest.mark.skipif(heap.malloc_totals() is None, reason="needs glibc >= 2.33 (mallinfo2)")


def test_malloc_totals_follow_allocations_and_frees():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallopt(-3, 64 * 1024 * 1024)  # M_MMAP_THRESHOLD: 64 KiB blocks from the heap, not mmap
    before = heap.malloc_totals()
    blocks = [libc.malloc(64 * 1024) for _ in range(320)]  # 20 MiB in use
    during = heap.malloc_totals()
    top = max(blocks)  # the highest block stays: no freed block joins the heap's top (trimmed back)
    for b in blocks:
        if b != top:
            libc.free(b)
    after = heap.malloc_totals()
    libc.free(top)
    assert during["in_use_mib"] - before["in_use_mib"] == pytest.approx(20.0, abs=1.0)
    assert during["in_use_mib"] - after["in_use_mib"] == pytest.approx(20.0 - 0.0625, abs=1.0)
    # freed and held by malloc (the blocks may first have reused memory it held before)
    assert after["free_held_mib"] - during["free_held_mib"] == pytest.approx(20.0 - 0.0625, abs=1.0)
    assert after["arena_mib"] == during["arena_mib"]  # nothing went back to the system
    assert set(after) == {"in_use_mib", "free_held_mib", "mmapped_mib", "arena_mib"}
