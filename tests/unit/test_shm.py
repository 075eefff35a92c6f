"""spanrl/core/shm.py and the stack's record / release of a component's /dev/shm segments: a
real process that maps a ``multiprocessing.shared_memory`` segment (as vLLM's message queues
do) and is SIGKILLed leaves it behind; the stack removes it when it stops or restarts the
component, and never one a live process maps."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from spanrl.core import shm

HOLDER = r'''
import sys, time
from multiprocessing import resource_tracker, shared_memory
seg = shared_memory.SharedMemory(create=True, size=1 << 20)
resource_tracker.unregister(seg._name, "shared_memory")  # as a SIGKILLed tracker would: no cleanup
print(seg.name, flush=True)
time.sleep(600)
'''


def start_holder() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    return proc, proc.stdout.readline().strip()


def kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_fake_proc_tree(tmp_path):
    """maps / stat parsing on a hand-made /proc: pgid from field 5, '(deleted)' stripped."""
    for pid, pgrp, line in ((10, 10, "7f00-7f10 rw-s 0 00:1a 5 /dev/shm/psm_aa"),
                            (11, 10, "7f00-7f10 rw-s 0 00:1a 6 /dev/shm/ds_x (deleted)"),
                            (12, 12, "7f00-7f10 r-xp 0 08:01 7 /usr/lib/libc.so")):
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "maps").write_text(line + "\n")
        (d / "stat").write_text(f"{pid} (a (b) c) S 1 {pgrp} {pgrp} 0 -1\n")
    (tmp_path / "self").mkdir()
    assert shm.process_group_of(tmp_path / "11") == 10
    assert shm.process_group_of(tmp_path / "99") is None
    assert shm.group_segments(10, tmp_path) == {"psm_aa", "ds_x"}
    assert shm.group_segments(12, tmp_path) == set()
    assert shm.mapped_segments(tmp_path) == {"psm_aa", "ds_x"}
    assert shm.group_alive(10, tmp_path) and shm.group_alive(12, tmp_path) and not shm.group_alive(99, tmp_path)
    (tmp_path / "12" / "stat").write_text("12 (x) Z 1 12 12 0 -1\n")  # exited, not reaped
    assert not shm.group_alive(12, tmp_path)


def test_release_unmapped_keeps_what_a_live_process_maps():
    proc, name = start_holder()
    try:
        assert name in shm.group_segments(proc.pid)
        assert shm.release_unmapped([name, "psm_not_there"]) == (0, 0)  # mapped: kept
        assert (shm.SHM_DIR / name).exists()
        kill(proc)
        assert (shm.SHM_DIR / name).exists()  # the leak a SIGKILL leaves
        assert shm.release_unmapped([name]) == (1, 1 << 20)
        assert not (shm.SHM_DIR / name).exists()
    finally:
        if proc.poll() is None:
            kill(proc)
        (shm.SHM_DIR / name).unlink(missing_ok=True)


def test_stack_releases_a_killed_components_segments(tmp_path):
    """Stack.record_segments after a component is healthy, Stack.release_segments on stop and
    before the next start (the path of a chaos SIGKILL)."""
    from spanrl.core.settings import Settings
    from spanrl.infra.stack import Stack

    stack = Stack(Settings(state_dir=tmp_path))
    proc, name = start_holder()
    try:
        assert stack.record_segments("vllm", proc.pid) == {name}
        assert stack.release_segments("vllm") == (0, 0)  # alive: nothing removed, still recorded
        assert (stack.shm / "vllm").read_text() == f"{name}\n"
        kill(proc)
        time.sleep(0.1)
        assert stack.release_segments("vllm") == (1, 1 << 20)
        assert not (shm.SHM_DIR / name).exists() and not (stack.shm / "vllm").exists()
        assert stack.release_segments("vllm") == (0, 0)  # nothing recorded any more
    finally:
        if proc.poll() is None:
            kill(proc)
        (shm.SHM_DIR / name).unlink(missing_ok=True)


def test_a_killed_component_not_yet_reaped_is_not_running(tmp_path):
    """A component SIGKILLed while the process that started it has not reaped it is a zombie:
    os.kill(pid, 0) still succeeds. The stack must see it as not running (else ``start`` would
    wait for the health of a dead process; seen in make test after the worker fault)."""
    from spanrl.core.settings import Settings
    from spanrl.infra.stack import Stack

    stack = Stack(Settings(state_dir=tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        stack.pids.mkdir(parents=True)
        (stack.pids / "stream.pid").write_text(str(proc.pid))
        assert stack.running("stream")
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{proc.pid}/stat").read_text().split(") ")[1][0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not stack.running("stream")  # a zombie until the wait below
    finally:
        proc.kill()
        proc.wait()
