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
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(100 * storage.GIB, 97 * storage.GIB, 3 * storage.GIB))
    assert storage.free_space_problem([tmp_path / "not" / "yet"], 2 * storage.GIB) is None
    problem = storage.free_space_problem([tmp_path / "not" / "yet", tmp_path], 6 * storage.GIB)
    assert problem.startswith(f"{tmp_path}: 3.0 GiB free, 6 GiB needed") and "spanrl clean" in problem
