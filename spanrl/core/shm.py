"""POSIX shared-memory segments (``/dev/shm``) and which live processes map them (Linux).

Files in /dev/shm are RAM (tmpfs) that outlives the process that made them: a segment whose
creator was SIGKILLed before it unlinked the name stays until the machine reboots. Two
libraries of the stack leave them behind when killed: vLLM's shared-memory message queues
(Python's ``multiprocessing.shared_memory``, named ``psm_<hex>``, 160-240 MiB each) and
DeepSpeed's CPU all-reduce workspaces (trainer/deepspeed_patches.py). The stack records what
each component maps once it is healthy and removes those of its names that nobody maps any
more when it stops or starts it again (infra/stack.py); the trainer unlinks DeepSpeed's.
"""
from __future__ import annotations

from pathlib import Path

#: where shm_open / multiprocessing.shared_memory put segments on Linux
SHM_DIR = Path("/dev/shm")
PROC = Path("/proc")


def _maps_of(pid_dir: Path) -> set[str]:
    prefix = "/dev/shm/"  # as the kernel names a tmpfs mapping there
    try:
        text = (pid_dir / "maps").read_text()
    except OSError:  # exited while we read, or not ours to read
        return set()
    names = set()
    for line in text.splitlines():
        i = line.find(prefix)
        if i >= 0:
            names.add(line[i + len(prefix):].removesuffix(" (deleted)"))
    return names


def mapped_segments(proc: Path | None = None) -> set[str]:
    """Names (relative to /dev/shm) of the segments any live process maps now, from every
    ``/proc/<pid>/maps``; an unlinked but mapped segment appears under its old name."""
    names: set[str] = set()
    for entry in (proc or PROC).iterdir():
        if entry.name.isdigit():
            names |= _maps_of(entry)
    return names


def _stat_fields(pid_dir: Path) -> list[str] | None:
    """``/proc/<pid>/stat`` after "pid (comm) ": state, ppid, pgrp, ...; None once it exited."""
    try:
        stat = (pid_dir / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def process_group_of(pid_dir: Path) -> int | None:
    """The process group id of ``/proc/<pid>`` (field 5 of its ``stat``), None once it exited."""
    fields = _stat_fields(pid_dir)
    return int(fields[2]) if fields else None


def is_zombie(pid_dir: Path) -> bool:
    """Whether ``/proc/<pid>`` has exited but is not reaped (state ``Z``)."""
    fields = _stat_fields(pid_dir)
    return bool(fields) and fields[0] == "Z"


def group_alive(pgid: int, proc: Path | None = None) -> bool:
    """Whether a process of process group ``pgid`` still runs (zombies, exited but not reaped,
    do not count)."""
    return any(entry.name.isdigit() and process_group_of(entry) == pgid and not is_zombie(entry)
               for entry in (proc or PROC).iterdir())


def group_segments(pgid: int, proc: Path | None = None) -> set[str]:
    """Names of the /dev/shm segments the processes of process group ``pgid`` map now."""
    names: set[str] = set()
    for entry in (proc or PROC).iterdir():
        if entry.name.isdigit() and process_group_of(entry) == pgid:
            names |= _maps_of(entry)
    return names


def release_unmapped(names: set[str] | list[str], shm_dir: Path | None = None,
                     proc: Path | None = None) -> tuple[int, int]:
    """Unlink those of ``names`` that exist in ``shm_dir`` (default /dev/shm) and no live
    process maps. Returns ``(segments, bytes)`` removed."""
    shm_dir = shm_dir or SHM_DIR
    if not names or not shm_dir.is_dir():
        return 0, 0
    mapped = mapped_segments(proc)
    removed = size = 0
    for name in sorted(set(names) - mapped):
        path = shm_dir / name
        try:
            n = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        removed, size = removed + 1, size + n
    return removed, size
