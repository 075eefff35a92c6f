"""What runs leave on disk, and taking it away again.

Every published checkpoint of SmolLM2-135M is ~0.5 GB (fp32 safetensors) and exists up to
three times: in MinIO (``s3://spanrl-checkpoints/RUN/VERSION/``), as the trainer's working
copy (``cache/trainer/RUN``) and as the reloader's download (``cache/checkpoints/RUN``).
Within a run both local copies and the store are pruned (``keep_local``, ``keep_store``);
across runs nothing is deleted without being asked, because a run's checkpoints are what
``spanrl eval RUN:VERSION`` and ``--train-from`` need. ``spanrl runs`` lists them,
``spanrl clean PATTERN`` deletes them, and ``make test`` deletes the runs it created.

MinIO refuses every write once its drive is nearly full (``XMinioStorageFull``: "Storage
backend has reached its minimum free drive threshold"), so the commands that write
checkpoints check the free space first (:func:`free_space_problem`).
"""
from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

GIB = 1024 ** 3

# Free space the commands need before they start (bytes), measured on this project's runs:
# `make test` peaks at ~4 GiB of checkpoints while its tests clean up after themselves,
# the main job at ~3 GiB (keep_local 2 in two places + MinIO keep_store 3 + one pin).
NEEDED_FREE = {"test": 6 * GIB, "demo": 5 * GIB, "chaos": 5 * GIB}


def select_runs(runs: list[str], patterns: list[str], protect: set[str] | frozenset = frozenset()) -> list[str]:
    """The runs matching any shell-style ``patterns`` (``fnmatch``: ``test-*``,
    ``evaltest-?????????``, an exact name), minus ``protect`` (the run the stack serves),
    sorted. Raises ValueError for no patterns or an empty one (nothing is deleted by
    default)."""
    if not patterns or any(not p.strip() for p in patterns):
        raise ValueError("give at least one non-empty run name or pattern")
    return sorted(r for r in set(runs) if r not in protect and any(fnmatch.fnmatchcase(r, p) for p in patterns))


def free_space_problem(paths: list[Path], needed_bytes: int) -> str | None:
    """None when the filesystem of every existing path in ``paths`` (the nearest existing
    parent of each) has at least ``needed_bytes`` free; else a sentence saying where, how
    much is free and how to make room."""
    seen = set()
    for p in paths:
        p = Path(p)
        while not p.exists() and p != p.parent:
            p = p.parent
        usage = shutil.disk_usage(p)
        if (key := (usage.total, p.stat().st_dev)) in seen:
            continue
        seen.add(key)
        if usage.free < needed_bytes:
            return (f"{p}: {usage.free / GIB:.1f} GiB free, {needed_bytes / GIB:.0f} GiB needed "
                    f"(MinIO refuses writes on a nearly full drive). `spanrl runs` lists the runs' "
                    f"checkpoints and their sizes; `spanrl clean 'PATTERN'` deletes them.")
    return None
