"""Runs' disk use: selecting runs to delete, the local directories of a run, deleting them,
the free-space check (infra/storage.py, trainer/checkpoint.py). The MinIO side runs against
the real store in tests/integration/test_trainer_service.py."""
from __future__ import annotations

import shutil
from collections import namedtuple

import pytest

from spanrl.infra import storage
from spanrl.trainer import checkpoint


def test_select_runs_matches_patterns_and_protects_the_served_run():
    runs = ["test-20261201-093718", "test-20261201-080413", "demo-20261201-070743", "evaltest-0a3a2b7b",
            "trtest-1da7df76"]
    assert storage.select_runs(runs, ["test-*"]) == ["test-20261201-080413", "test-20261201-093718"]
    assert storage.select_runs(runs, ["test-*"], protect={"test-20261201-093718"}) == ["test-20261201-080413"]
    assert storage.select_runs(runs, ["*test-*"]) == ["evaltest-0a3a2b7b", "test-20261201-080413",
                                                      "test-20261201-093718", "trtest-1da7df76"]
    assert storage.select_runs(runs, ["demo-20261201-070743", "nothing"]) == ["demo-20261201-070743"]
    assert storage.select_runs(runs, ["Test-*"]) == []  # case-sensitive, as run names are
    with pytest.raises(ValueError):
        storage.select_runs(runs, [])
    with pytest.raises(ValueError):
        storage.select_runs(runs, [" "])


def test_local_run_dirs_and_invalid_names(tmp_path):
    assert checkpoint.local_run_dirs(tmp_path, "r1") == [tmp_path / "trainer" / "r1", tmp_path / "checkpoints" / "r1",
                                                         tmp_path / "checkpoints" / "pinned" / "r1"]
    for bad in ["", ".", "..", "a/b", "pinned", "a\\b"]:
        with pytest.raises(ValueError):
            checkpoint.local_run_dirs(tmp_path, bad)


def _files(root, sizes: dict[str, int]):
    for rel, n in sizes.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * n)


def test_list_and_delete_runs_locally(tmp_path):
    _files(tmp_path, {"trainer/a/000001/model.safetensors": 100, "trainer/a/000002/model.safetensors": 50,
                      "checkpoints/a/000002/model.safetensors": 50, "checkpoints/pinned/a/000001/m": 7,
                      "checkpoints/pinned/b/000003/m": 9, "trainer/c/000001/m": 1, "models/base/m": 1000})
    runs = checkpoint.list_runs(None, "bucket", tmp_path)
    assert runs == {"a": {"store_bytes": 0, "store_objects": 0, "local_bytes": 207},
                    "b": {"store_bytes": 0, "store_objects": 0, "local_bytes": 9},
                    "c": {"store_bytes": 0, "store_objects": 0, "local_bytes": 1}}
    removed = checkpoint.delete_run(None, "bucket", tmp_path, "a")
    assert removed == {"run": "a", "store_objects": 0, "store_bytes": 0, "local_bytes": 207}
    assert set(checkpoint.list_runs(None, "bucket", tmp_path)) == {"b", "c"}
    assert (tmp_path / "models" / "base" / "m").exists() and (tmp_path / "checkpoints" / "pinned" / "b").exists()
    assert checkpoint.delete_run(None, "bucket", tmp_path, "a")["local_bytes"] == 0  # idempotent


def test_free_space_problem(tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(100 * storage.GIB, 95 * storage.GIB, 5 * storage.GIB))
    # MinIO's reserve on a 100 GiB drive: 1 GiB (1 %) + 2 x 0.6 GiB (the largest object, twice)
    assert storage.minio_reserve(100 * storage.GIB) == storage.GIB + 2 * int(0.6 * storage.GIB)
    assert storage.free_space_problem([tmp_path / "not" / "yet"], int(2.7 * storage.GIB)) is None
    problem = storage.free_space_problem([tmp_path / "not" / "yet", tmp_path], 3 * storage.GIB)
    assert problem.startswith(f"{tmp_path}: 5.0 GiB free, 5.2 GiB needed (3.0 written at the peak + 2.2 MinIO")
    assert "spanrl clean" in problem


def test_scratch_ledger_reclaims_only_listed_unprotected_runs(tmp_path):
    _files(tmp_path, {"trainer/test-1/000001/m": 100, "checkpoints/test-1/000001/m": 40,
                      "trainer/evaltest-ab/000001/m": 30, "trainer/mine/000001/m": 500,
                      "trainer/test-2/000001/m": 8})
    for run in ["test-1", "evaltest-ab", "test-2", "gone", "test-1"]:
        storage.register_scratch(tmp_path, run)
    assert storage.scratch_runs(tmp_path) == ["test-1", "evaltest-ab", "test-2", "gone"]
    storage.forget_scratch(tmp_path, ["evaltest-ab"])  # deleted by its own test: struck off
    assert storage.scratch_runs(tmp_path) == ["test-1", "test-2", "gone"]
    assert storage.reclaim_scratch(tmp_path, protect={"test-2"}) == {"test-1": 140, "gone": 0}
    assert storage.scratch_runs(tmp_path) == ["test-2"]
    assert sorted(checkpoint.list_runs(None, "bucket", tmp_path)) == ["evaltest-ab", "mine", "test-2"]
    assert storage.reclaim_scratch(tmp_path) == {"test-2": 8} and storage.scratch_runs(tmp_path) == []
    assert storage.reclaim_scratch(tmp_path / "never-made") == {}


def test_largest_entries(tmp_path):
    _files(tmp_path, {"a/big/x": 300, "a/big/y": 200, "a/small": 10, "b/mid/z": 50})
    (tmp_path / "a" / "link").symlink_to("big")  # 3 bytes: not followed
    found = storage.largest_entries([tmp_path / "a", tmp_path / "b", tmp_path / "missing"], top=3)
    assert [(p.relative_to(tmp_path).as_posix(), n) for p, n in found] == [("a/big", 500), ("b/mid", 50),
                                                                           ("a/small", 10)]


def test_stopped_minio_trash_is_emptied(tmp_path):
    from spanrl.core.settings import Settings
    from spanrl.infra.stack import MINIO_TRASH_PURGE_INTERVAL, Stack

    st = Stack(Settings(state_dir=tmp_path))
    assert st.empty_minio_trash() == 0  # no MinIO data yet
    trash = tmp_path / "minio" / ".minio.sys" / "tmp" / ".trash"
    _files(trash, {"0a/part.1": 300, "0a/xl.meta": 20, "1b": 5})
    _files(tmp_path / "minio", {"spanrl-checkpoints/r/000001/model.safetensors/xl.meta": 9})
    st.stop("minio")  # not running: stopping it empties the trash it left
    assert trash.is_dir() and list(trash.iterdir()) == []
    assert (tmp_path / "minio" / "spanrl-checkpoints" / "r" / "000001").exists()  # live objects stay
    _files(trash, {"2c/part.1": 40})
    assert st.empty_minio_trash() == 40
    assert st.components["minio"].env["MINIO_API_DELETE_CLEANUP_INTERVAL"] == MINIO_TRASH_PURGE_INTERVAL == "20s"


def test_stale_minio_trash_of_clones_whose_minio_is_stopped(tmp_path):
    trash = ".spanrl/minio/.minio.sys/tmp/.trash"
    _files(tmp_path, {f"old-ci/{trash}/u1/part.1": 500, f"old-ci/{trash}/u2": 7, f"running/{trash}/u3/part.1": 9,
                      "old-ci/.spanrl/minio/spanrl-checkpoints/r/xl.meta": 3, "not-a-clone/x": 1})
    running = (tmp_path / "running" / ".spanrl" / "minio").resolve()
    found = storage.stale_minio_trash([tmp_path, tmp_path / "missing"], in_use={running})
    assert found == [tmp_path / "old-ci" / trash]
    assert sum(storage.empty_dir(t) for t in found) == 507
    assert found[0].is_dir() and list(found[0].iterdir()) == []
    assert (tmp_path / "old-ci/.spanrl/minio/spanrl-checkpoints/r/xl.meta").exists()  # live objects stay
    assert (tmp_path / "running" / trash / "u3" / "part.1").exists()
    assert isinstance(storage.minio_data_dirs_in_use(), set)
