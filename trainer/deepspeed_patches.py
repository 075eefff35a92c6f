"""Every workaround of DeepSpeed's internals the trainer needs, in one place (deepspeed 0.19).

:func:`after_init_distributed` runs right after ``deepspeed.init_distributed`` in
:func:`trainer.train.init_distributed`, after :func:`check_version`, which refuses a DeepSpeed
the workaround was not verified against. Test that fails without it:
tests/unit/test_deepspeed_patches.py (one rank and the two-rank group leave no segment in
/dev/shm after they exit; the unpatched run leaves one per rank, checked by disabling it).

1. The CPU accelerator's shared-memory all-reduce leaks one 66 MiB segment per rank per start.

   Upstream report (the one to file; no issue on the DeepSpeed tracker says it exactly):
   "CPU accelerator: every process group leaks its shm all-reduce workspace in /dev/shm.
   ``TorchBackend.__init__`` calls ``shm_comm_op.initialize(world_size, rank)`` whenever the
   ShareMemCommBuilder op loads; when ``LOCAL_SIZE`` equals the world size (DeepSpeed's
   launcher sets it, also for one rank), ``shm_initialize``
   (csrc/cpu/comm/shm.cpp) creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_
   <MASTER_PORT>_<rank>`` (sizeof(allreduce_workspace), 66 MiB) with ``shm_open(O_CREAT)``.
   ``shared_close`` (munmap + shm_unlink) exists but nothing calls it, not at
   ``destroy_process_group`` nor at exit, so each segment stays in tmpfs — in RAM — until the
   machine reboots. A launcher that picks a free MASTER_PORT per start (torchrun's default
   rendezvous, or any service restarted after a crash) adds 66 MiB × ranks of RAM per start:
   we found 141 segments, 9.1 GiB, on a 24 GiB machine after a day of tests and fault
   injection (the trainer with SPANRL_TRAINER_RANKS > 1, its tests and its chaos fault). Expected: each rank unlinks its segment once every peer has mapped it (the
   mappings stay valid), or at the latest at exit."

   The workaround does the expected: a barrier after ``init_distributed`` (every rank has
   returned from ``shm_initialize``, which maps every peer's segment before it returns), then
   each rank ``shm_unlink``\\ s its own name; the pages are freed when the last rank exits,
   also on SIGKILL. :func:`sweep_stale_segments` removes what earlier processes (before this
   patch, or killed in the microseconds between create and unlink) left behind: segments of
   this user that no live process maps and that are older than a minute.

2. Without ZeRO (stage 0) on one rank, every optimizer step first flattens every gradient into
   one buffer, "all-reduces" it over a group of one and copies it back
   (``DeepSpeedEngine.allreduce_gradients`` → ``buffered_allreduce_fallback``): for SmolLM2 a
   transient 513 MiB and two copies per step, for nothing. :func:`skip_single_rank_allreduce`
   turns the engine's ``enable_backward_allreduce`` off when the group has one rank (the
   attribute DeepSpeed's own pipeline engine turns off); with more ranks nothing changes.
   Upstream report: "stage 0 with world_size 1: allreduce_gradients still flattens and copies
   all gradients at each boundary; skip the reduction when the data-parallel group has one
   rank". Checked: tests/unit/test_trainer_memory.py (stage 0, reduction skipped, gives stage
   2's update); what it saves: trainer/README.md, "Memory" (3,559 → 3,294 MiB peak).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from spanrl.core.settings import env_value
from spanrl.core.shm import SHM_DIR, mapped_segments

log = logging.getLogger("spanrl.trainer.deepspeed_patches")

#: DeepSpeed releases (major.minor) whose shm.cpp this module was checked against
VERIFIED_VERSIONS = ("0.19",)

#: SHM_BUFFER_NAME in DeepSpeed's csrc/cpu/comm/shm.cpp
SHM_BUFFER_NAME = "deepspeed_allreduce_buffer"

#: a segment younger than this is never swept: shm_initialize creates it, then maps it
STALE_AFTER_S = 60.0


def check_version() -> str:
    """The installed DeepSpeed version. Raises RuntimeError naming it and the verified releases
    when this module was not checked against it (its segment name may have changed, or the
    leak been fixed upstream)."""
    from importlib.metadata import version

    v = version("deepspeed")
    if ".".join(v.split(".")[:2]) not in VERIFIED_VERSIONS:
        raise RuntimeError(
            f"deepspeed {v} is installed, but trainer/deepspeed_patches.py was verified against "
            f"{', '.join(VERIFIED_VERSIONS)}.x only: install one of those (pyproject.toml), or re-verify "
            f"(tests/unit/test_deepspeed_patches.py) and add {'.'.join(v.split('.')[:2])} to VERIFIED_VERSIONS")
    return v


def shm_segment_name(uid: int, master_addr: str, master_port: str | int, rank: int) -> str:
    """The name ``shm_initialize`` gives rank ``rank``'s all-reduce workspace (no leading '/'):
    ``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``, as
    csrc/cpu/comm/shm.cpp formats it (``"%s_%d_%s_%s"`` then ``"%s_%d"``)."""
    return f"{SHM_BUFFER_NAME}_{uid}_{master_addr}_{master_port}_{rank}"


def unlink_own_segment(rank: int, master_addr: str | None, master_port: str | None, shm_dir: Path = SHM_DIR) -> bool:
    """Unlink this rank's segment (call once every rank has mapped it). True when one was
    there; False when the op did not create one (no ``LOCAL_SIZE``: nothing to do) or
    MASTER_ADDR / MASTER_PORT are unset."""
    addr, port = master_addr, master_port
    if not addr or not port:
        return False
    path = shm_dir / shm_segment_name(os.getuid(), addr, port, rank)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def stale_segments(names: list[str], uid: int, mapped: set[str], ages_s: dict[str, float],
                   stale_after_s: float = STALE_AFTER_S) -> list[str]:
    """Which of ``names`` (files in /dev/shm) are leaked all-reduce workspaces: this user's
    (``deepspeed_allreduce_buffer_<uid>_...``), mapped by no live process, older than
    ``stale_after_s`` seconds (``ages_s[name]``, from the file's mtime). Sorted."""
    mine = f"{SHM_BUFFER_NAME}_{uid}_"
    return sorted(n for n in names
                  if n.startswith(mine) and n not in mapped and ages_s.get(n, 0.0) >= stale_after_s)


def sweep_stale_segments(shm_dir: Path = SHM_DIR) -> tuple[int, int]:
    """Delete the leaked segments :func:`stale_segments` finds in ``shm_dir``. Returns
    ``(segments, bytes)`` removed; a Linux-only step (nothing to do where /dev/shm or /proc
    is missing)."""
    if not shm_dir.is_dir() or not Path("/proc/self/maps").exists():  # not Linux
        return 0, 0
    now = time.time()
    ages, sizes = {}, {}
    for p in shm_dir.iterdir():
        if p.name.startswith(SHM_BUFFER_NAME):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            ages[p.name], sizes[p.name] = now - st.st_mtime, st.st_size
    removed = removed_bytes = 0
    for name in stale_segments(list(ages), os.getuid(), mapped_segments(), ages):
        try:
            (shm_dir / name).unlink()
        except FileNotFoundError:
            continue
        removed, removed_bytes = removed + 1, removed_bytes + sizes[name]
    if removed:
        log.info("removed %d leaked DeepSpeed shm segment(s), %.0f MiB, from %s", removed,
                 removed_bytes / 2**20, shm_dir)
    return removed, removed_bytes


#: False only in the test that shows the leak without the workaround
ENABLED = True


def after_init_distributed(rank: int, world: int) -> None:
    """The workaround (see the module docstring): wait until every rank has mapped every
    segment, then unlink this rank's; and sweep what earlier processes leaked."""
    import torch

    if not ENABLED:
        return
    check_version()
    if world > 1:
        torch.distributed.barrier()
    unlink_own_segment(rank, env_value("MASTER_ADDR"), env_value("MASTER_PORT"))
    if rank == 0:
        sweep_stale_segments()


def skip_single_rank_allreduce(engine) -> bool:
    """Item 2 of the module docstring: no gradient all-reduce for a ZeRO-stage-0 engine whose
    data-parallel group is this one process. Returns whether it was turned off."""
    import torch

    if not ENABLED or engine.zero_optimization_stage() != 0 or torch.distributed.get_world_size() != 1:
        return False
    engine.enable_backward_allreduce = False
    return True
