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
import os
import shutil
from pathlib import Path

from spanrl.core.disk import tree_bytes

GIB = 1024 ** 3

# Disk the commands use at their peak (bytes), measured on this project's runs (fresh clones,
# `df` every 5 s): `make test` 8.8 GB before MinIO's trash was purged every 20 s and passed
# tests' tmp_path deleted at once (MinIO 4.2 of it, 2.1 of that deleted objects), 7.16 GB
# (6.7 GiB) after, leaving 0.1 GB behind instead of 2.1; `make chaos` ~7 GB (two runs'
# local copies 3.8 + MinIO 3.1, four faults); the main job ~3 GiB (keep_local 2 in two places
# + MinIO's copies + one pin). MinIO's own reserve (:func:`minio_reserve`) comes on top.
NEEDED_FREE = {"test": 7 * GIB, "train": 5 * GIB, "chaos": 7 * GIB}
# MinIO refuses a write (XMinioStorageFull) unless the drive has twice the object's size free
# and more than 1 % of the drive stays free after it (minio cmd/object-api-utils.go
# ``hasSpaceFor``: ``size *= 2``, ``diskFillFraction = 0.99``); spanrl's largest object is one
# checkpoint's weights (SmolLM2-135M in float32: 0.54 GB).
MINIO_FILL_FRACTION = 0.99
# where MinIO moves deleted objects until it purges them, inside its data directory
MINIO_TRASH = Path(".minio.sys") / "tmp" / ".trash"
LARGEST_OBJECT = int(0.6 * GIB)
# Published versions of the stack's own run whose weights `make test` keeps in MinIO (the
# trainer's keep_published; a user's stack keeps all): the tests read the newest only, and
# the suite's samples make the stack's trainer publish many.
TEST_KEEP_PUBLISHED = 4

# Runs that `make test` and its tests create are written here (one name per line) before
# they make any checkpoint and struck off once deleted, so a suite that was killed, or
# crashed before its clean-up, leaves names the next `make test` deletes first
# (:func:`reclaim_scratch`); `make chaos` lists its runs too (their local copies, ~4 GB a run,
# serve no later command). Runs people make (demo, study, replay) are never listed.
SCRATCH_LEDGER = "scratch-runs.txt"


def select_runs(runs: list[str], patterns: list[str], protect: set[str] | frozenset = frozenset()) -> list[str]:
    """The runs matching any shell-style ``patterns`` (``fnmatch``: ``test-*``,
    ``evaltest-?????????``, an exact name), minus ``protect`` (the run the stack serves),
    sorted. Raises ValueError for no patterns or an empty one (nothing is deleted by
    default)."""
    if not patterns or any(not p.strip() for p in patterns):
        raise ValueError("give at least one non-empty run name or pattern")
    return sorted(r for r in set(runs) if r not in protect and any(fnmatch.fnmatchcase(r, p) for p in patterns))


def minio_reserve(total_bytes: int) -> int:
    """Bytes MinIO needs free on a drive of ``total_bytes`` beyond what is written, to accept
    the largest object: 1 % of the drive plus twice the object (see MINIO_FILL_FRACTION)."""
    return int(total_bytes * (1 - MINIO_FILL_FRACTION)) + 2 * LARGEST_OBJECT


def free_space_problem(paths: list[Path], needed_bytes: int) -> str | None:
    """None when the filesystem of every existing path in ``paths`` (the nearest existing
    parent of each) has at least ``needed_bytes`` plus :func:`minio_reserve` free; else a
    sentence saying where, how much is free and how to make room."""
    seen = set()
    for p in paths:
        p = Path(p)
        while not p.exists() and p != p.parent:
            p = p.parent
        usage = shutil.disk_usage(p)
        if (key := (usage.total, p.stat().st_dev)) in seen:
            continue
        seen.add(key)
        reserve = minio_reserve(usage.total)
        if usage.free < needed_bytes + reserve:
            return (f"{p}: {usage.free / GIB:.1f} GiB free, {(needed_bytes + reserve) / GIB:.1f} GiB needed "
                    f"({needed_bytes / GIB:.1f} written at the peak + {reserve / GIB:.1f} MinIO keeps free on "
                    f"this drive before it refuses writes). `spanrl runs` lists the runs' checkpoints and "
                    f"their sizes; `spanrl clean 'PATTERN'` deletes them.")
    return None


def _ledger(cache_dir: Path) -> Path:
    return Path(cache_dir) / SCRATCH_LEDGER


def scratch_runs(cache_dir: Path) -> list[str]:
    """The runs in ``cache_dir``'s scratch ledger, in the order registered, each once."""
    p = _ledger(cache_dir)
    names = p.read_text().split() if p.exists() else []
    return list(dict.fromkeys(names))


def register_scratch(cache_dir: Path, run: str) -> None:
    """Write ``run`` to the scratch ledger (before it makes checkpoints)."""
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    with _ledger(cache_dir).open("a") as f:
        f.write(run + "\n")


def forget_scratch(cache_dir: Path, runs: list[str]) -> None:
    """Strike ``runs`` off the scratch ledger (after their checkpoints were deleted)."""
    left = [r for r in scratch_runs(cache_dir) if r not in set(runs)]
    p = _ledger(cache_dir)
    if p.exists():
        tmp = p.with_suffix(".tmp")
        tmp.write_text("".join(r + "\n" for r in left))
        tmp.replace(p)


def reclaim_scratch(cache_dir: Path, protect: set[str] | frozenset = frozenset()) -> dict[str, int]:
    """Delete the local checkpoint copies (``checkpoint.local_run_dirs``) of every run in the
    scratch ledger except ``protect`` (a run the running stack serves) and strike them off.
    Returns ``{run: bytes freed}``. MinIO's copies live in the stack's state directory and are
    deleted by whoever runs the stack (``spanrl clean``)."""
    from spanrl.trainer import checkpoint

    freed = {}
    for run in scratch_runs(cache_dir):
        if run in protect:
            continue
        try:
            freed[run] = checkpoint.delete_run(None, "", cache_dir, run)["local_bytes"]
        except ValueError:  # not a run name: nothing to delete
            freed[run] = 0
    forget_scratch(cache_dir, list(freed))
    return freed


def largest_entries(paths: list[Path], top: int = 8) -> list[tuple[Path, int]]:
    """The ``top`` largest direct children of the existing directories in ``paths`` (bytes,
    largest first; symbolic links not followed): what to look at when a drive is full."""
    sizes = []
    for root in paths:
        root = Path(root)
        if not root.is_dir():
            continue
        for child in root.iterdir():
            sizes.append((child, tree_bytes(child)))
    return sorted(sizes, key=lambda e: -e[1])[:top]


def minio_data_dirs_in_use() -> set[Path]:
    """The data directories of the MinIO servers running now (``minio server DIR ...`` in
    /proc/<pid>/cmdline), resolved."""
    used = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if len(args) > 2 and Path(args[0].decode(errors="replace")).name == "minio" and args[1] == b"server":
            used.add(Path(args[2].decode(errors="replace")).resolve())
    return used


def stale_minio_trash(clone_roots: list[Path], state_name: str = ".spanrl",
                      in_use: set[Path] | None = None) -> list[Path]:
    """The MinIO trash directories (``<clone>/<state_name>/minio/.minio.sys/tmp/.trash``:
    objects already deleted, which MinIO purges only while it runs) of the clones directly
    under each of ``clone_roots`` whose MinIO is not running. A clone whose stack never starts
    again keeps its trash for good (``make test`` left 2.1 GiB per run before the stack
    emptied it on stop). ``in_use``: the running MinIOs' data directories (default: asked of
    /proc, :func:`minio_data_dirs_in_use`)."""
    in_use = minio_data_dirs_in_use() if in_use is None else in_use
    found = []
    for root in clone_roots:
        for trash in sorted(Path(root).glob(f"*/{state_name}/minio/{MINIO_TRASH.as_posix()}")):
            if trash.parents[2].resolve() not in in_use:
                found.append(trash)
    return found


def empty_dir(path: Path) -> int:
    """Delete everything inside ``path`` (not ``path`` itself); bytes freed."""
    freed = 0
    for entry in Path(path).iterdir():
        freed += tree_bytes(entry)
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    return freed
