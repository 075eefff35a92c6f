"""trainer/deepspeed_patches.py: DeepSpeed's CPU shm all-reduce workspace no longer leaks 66 MiB
of /dev/shm (RAM) per rank per start. The subprocess test fails with the workaround disabled."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from spanrl.trainer import deepspeed_patches as dp

REPO = Path(__file__).resolve().parents[2]


def test_segment_name_as_shm_cpp_formats_it():
    assert dp.shm_segment_name(0, "127.0.0.1", 40123, 1) == "deepspeed_allreduce_buffer_0_127.0.0.1_40123_1"


def test_stale_segments_only_this_users_unmapped_old_ones():
    names = ["deepspeed_allreduce_buffer_0_127.0.0.1_1_0",   # stale
             "deepspeed_allreduce_buffer_0_127.0.0.1_2_0",   # mapped by a live process
             "deepspeed_allreduce_buffer_0_127.0.0.1_3_0",   # 10 s old: may be between create and map
             "deepspeed_allreduce_buffer_1000_127.0.0.1_4_0",  # another user's
             "psm_1766bd99"]                                  # not DeepSpeed's
    ages = {n: 3600.0 for n in names} | {names[2]: 10.0}
    assert dp.stale_segments(names, 0, {names[1]}, ages) == [names[0]]
    assert dp.stale_segments(names, 0, set(), ages, stale_after_s=5.0) == names[:3]


def test_unlink_own_segment(tmp_path):
    seg = tmp_path / dp.shm_segment_name(os.getuid(), "127.0.0.1", "5", 1)
    seg.write_bytes(b"x")
    assert not dp.unlink_own_segment(1, "127.0.0.1", None, tmp_path)  # no port: nothing
    assert not dp.unlink_own_segment(0, "127.0.0.1", "5", tmp_path)
    assert seg.exists()
    assert dp.unlink_own_segment(1, "127.0.0.1", "5", tmp_path)
    assert not seg.exists()


def test_version_check_names_the_verified_releases(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "0.99.1")
    with pytest.raises(RuntimeError, match=r"deepspeed 0\.99\.1 .* verified against 0\.19\.x"):
        dp.check_version()


INIT = r'''
import os, sys
from spanrl.trainer import deepspeed_patches
deepspeed_patches.ENABLED = sys.argv[1] == "on"
from spanrl.trainer.train import init_distributed
init_distributed()
name = deepspeed_patches.shm_segment_name(os.getuid(), os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], 0)
mapped = [line for line in open("/proc/self/maps") if name in line]
print("SEGMENT", name, "MAPPED", len(mapped) > 0)
'''


@pytest.mark.parametrize("patched", [True, False])
def test_a_trainer_process_leaves_no_segment(patched):
    """init_distributed in a fresh process, one rank as DeepSpeed's launcher starts it
    (``LOCAL_SIZE`` = world size: the condition for the shm all-reduce): its workspace is mapped
    while it runs; after it exits the file is gone — and, with the workaround off, still there
    (the leak; the test removes it). The two-rank group: test_trainer_ranks.py."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env["LOCAL_SIZE"] = "1"
    out = subprocess.run([sys.executable, "-c", INIT, "on" if patched else "off"], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("SEGMENT "))
    name, mapped = line.split()[1], line.split()[3]
    assert mapped == "True", out.stdout  # the op loaded and mapped its workspace
    left = Path("/dev/shm") / name
    try:
        assert left.exists() is not patched
    finally:
        left.unlink(missing_ok=True)
