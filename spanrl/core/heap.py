"""What the C heap (glibc malloc) of this process holds: in use, free but kept, mmapped.

A resident set that grows can be live memory (a leak) or memory malloc keeps after it was
freed. glibc gives each thread that allocates its own arena (up to 8 x cores of them), and an
arena keeps what was freed in it for the next allocation of that thread; torch's CPU tensors
come from malloc. :func:`malloc_totals` tells the two apart (the trainer logs it with every
update; bench/soak.py fits its trend).
"""
from __future__ import annotations

import ctypes

MIB = 1024 * 1024


class _Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (malloc.h, glibc >= 2.33), every field a size_t."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL(None)  # this process's own symbols, the C library's among them
        libc.mallinfo2.restype = _Mallinfo2
        return libc
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33
        return None


_LIBC = _libc()


def malloc_totals() -> dict | None:
    """This process's malloc heap, summed over its arenas (glibc ``mallinfo2``), in MiB:
    ``in_use_mib`` (allocated, not freed: ``uordblks``), ``free_held_mib`` (freed and kept in
    the arenas: ``fordblks``), ``mmapped_mib`` (large blocks mapped one by one: ``hblkhd``),
    ``arena_mib`` (what the arenas took from the system: ``arena``). None where the C library
    has no ``mallinfo2`` (not glibc, or glibc < 2.33). Python objects count too (pymalloc
    takes its arenas from malloc)."""
    if _LIBC is None:
        return None
    m = _LIBC.mallinfo2()
    return {"in_use_mib": round(m.uordblks / MIB, 1), "free_held_mib": round(m.fordblks / MIB, 1),
            "mmapped_mib": round(m.hblkhd / MIB, 1), "arena_mib": round(m.arena / MIB, 1)}
