"""Checkpoint manifests: sha256 of each file; verification accepts good, refuses tampered/missing."""
from __future__ import annotations

import json

import pytest

from spanrl.trainer import checkpoint


def _ckpt(tmp_path):
    d = tmp_path / "000001"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"weights" * 100)
    (d / "config.json").write_text('{"a": 1}')
    (d / "tokenizer.json").write_text("{}")
    m = checkpoint.write_manifest(d, run="r", version=1, parent_version=0, base_model="base", step=3,
                                  trained_offsets={"samples:0": 17}, metrics={"loss": 0.5})
    return d, m


def test_manifest_contents_and_verify_ok(tmp_path):
    d, m = _ckpt(tmp_path)
    assert set(m["files"]) == {"model.safetensors", "config.json", "tokenizer.json"}
    assert m["files"]["config.json"] == checkpoint.sha256_file(d / "config.json")
    got = checkpoint.verify_manifest(d)
    assert got == json.loads((d / "manifest.json").read_text())
    assert got["trained_offsets"] == {"samples:0": 17} and got["version"] == 1 and got["parent_version"] == 0


def test_verify_rejects_tampered_file(tmp_path):
    d, _ = _ckpt(tmp_path)
    (d / "model.safetensors").write_bytes(b"evil" * 100)
    with pytest.raises(checkpoint.CheckpointError, match="sha256 mismatch for model.safetensors"):
        checkpoint.verify_manifest(d)


def test_verify_rejects_missing_file_and_missing_manifest(tmp_path):
    d, _ = _ckpt(tmp_path)
    (d / "tokenizer.json").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="tokenizer.json .*missing"):
        checkpoint.verify_manifest(d)
    (d / "manifest.json").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="manifest missing"):
        checkpoint.verify_manifest(d)


def test_uri_helpers():
    assert checkpoint.checkpoint_uri("b", "run1", 7) == "s3://b/run1/000007/"
    assert checkpoint.parse_uri("s3://b/run1/000007/") == ("b", "run1/000007/")
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.parse_uri("http://x/y")


# ---- offsets: consumed ranges, the chain check, where a run starts -------------------

def _m(version, parent, consumed, trained=None):
    return {"version": version, "parent_version": parent, "consumed_offsets": consumed,
            "trained_offsets": trained if trained is not None else {k: v[1] for k, v in consumed.items()}}


def test_manifest_records_consumed_offsets(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"w")
    m = checkpoint.write_manifest(d, run="r", version=2, parent_version=1, base_model="b", step=2,
                                  trained_offsets={"samples:0": 9}, metrics={},
                                  consumed_offsets={"samples:0": [4, 9]})
    assert m["consumed_offsets"] == {"samples:0": [4, 9]}
    assert json.loads((d / "manifest.json").read_text())["consumed_offsets"] == {"samples:0": [4, 9]}


def test_consumed_ranges():
    assert checkpoint.consumed_ranges({"s:0": 3, "s:1": 7}, {"s:1": 7, "s:0": 10}) == {"s:0": [3, 10], "s:1": [7, 7]}
    with pytest.raises(ValueError, match="s:1: no starting offset"):
        checkpoint.consumed_ranges({"s:0": 3}, {"s:0": 4, "s:1": 0})
    with pytest.raises(ValueError, match="s:0: offset went backwards 5 -> 4"):
        checkpoint.consumed_ranges({"s:0": 5}, {"s:0": 4})


def test_offset_chain_sound():
    chain = [_m(1, 0, {"s:0": [3, 10], "s:1": [0, 4]}), _m(2, 1, {"s:0": [10, 12], "s:1": [4, 4]}),
             _m(3, 2, {"s:0": [12, 20], "s:1": [4, 9]})]
    assert checkpoint.check_offset_chain(list(reversed(chain)), start={"s:0": 3, "s:1": 0}) == []
    assert checkpoint.check_offset_chain(chain) == []
    assert checkpoint.check_offset_chain([]) == []


def test_offset_chain_gap_overlap_and_start():
    chain = [_m(1, 0, {"s:0": [5, 10]}), _m(2, 1, {"s:0": [12, 15]}), _m(3, 2, {"s:0": [13, 20]})]
    assert checkpoint.check_offset_chain(chain, start={"s:0": 3}) == [
        "v1 s:0: gap, offsets [3, 5) after the run's start never trained",
        "v2 s:0: gap, offsets [10, 12) after v1 never trained",
        "v3 s:0: overlap, offsets [13, 15) trained again after v2",
    ]
    assert checkpoint.check_offset_chain([_m(1, 0, {"s:0": [2, 4]})], start={"s:0": 3}) == [
        "v1 s:0: overlap, offsets [2, 3) trained again after the run's start"]


def test_offset_chain_versions_and_fields():
    chain = [
        _m(1, 0, {"s:0": [0, 4]}),
        _m(3, 1, {"s:0": [4, 6]}),                       # v2 missing, parent says 1
        _m(4, 2, {"s:0": [6, 5]}, trained={"s:0": 5}),   # backwards; parent should be 3
        {"version": 5, "parent_version": 4, "trained_offsets": {"s:0": 5}},  # old manifest
        _m(6, 5, {"s:0": [5, 8], "s:1": [2, 3]}, trained={"s:0": 9, "s:1": 3, "s:2": 1}),
        _m(7, 6, {"s:1": [3, 3]}),
    ]
    assert checkpoint.check_offset_chain(chain, start={"s:0": 0, "s:9": 1}) == [
        "v1 s:9: in the start marker but not consumed",
        "v3: follows v1, missing v2",
        "v4 s:0: range [6, 5] runs backwards",
        "v4: parent_version 2, expected 3",
        "v5: no consumed_offsets",
        "v5 s:0: in trained_offsets but not in consumed_offsets",
        "v5 s:0: missing (parent v4 trained it to 5)",
        "v6 s:0: consumed to 8 but trained_offsets says 9",
        "v6 s:2: in trained_offsets but not in consumed_offsets",
        "v6 s:1: new partition starting at 2, parent v5 has no offset for it",
        "v7 s:0: missing (parent v6 trained it to 9)",
        "v7 s:2: missing (parent v6 trained it to 1)",
    ]
    assert checkpoint.check_offset_chain([_m(2, 1, {"s:0": [0, 1]}), _m(2, 1, {"s:0": [1, 2]})]) == [
        "v2: duplicate version", "v2: parent_version 1, expected 2"]
    assert checkpoint.check_offset_chain([_m(1, 0, {"s:0": [0, 1]}), _m(5, 4, {"s:0": [1, 2]})]) == [
        "v5: follows v1, missing v2..v4", "v5: parent_version 4, expected 1"]


def test_start_positions():
    keys = ["s:0", "s:1", "s:2"]
    # checkpoint first, then the start marker, then "earliest" for a partition the marker does not know
    assert checkpoint.start_positions(keys, {"s:0": 10}, {"s:0": 2, "s:1": 5}) == \
        {"s:0": 10, "s:1": 5, "s:2": "earliest"}
    # a new run (no checkpoint, no marker): the configured start decides
    assert checkpoint.start_positions(keys[:2], {}, None) == {"s:0": "configured", "s:1": "configured"}
    # a run restarted before its first checkpoint: the marker, not the configured start
    assert checkpoint.start_positions(keys[:1], {}, {"s:0": 7}) == {"s:0": 7}
    assert checkpoint.start_positions(keys[:1], {"s:0": 3}, None) == {"s:0": 3}


# ---- retries -------------------------------------------------------------------------

def test_backoff_schedule():
    assert [checkpoint.backoff_s(a) for a in range(8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert checkpoint.backoff_s(10**6) == 30.0
    assert [checkpoint.backoff_s(a, base_s=0.1, cap_s=0.25, factor=3) for a in range(3)] == \
        [0.1, 0.25, 0.25]
    with pytest.raises(ValueError):
        checkpoint.backoff_s(-1)


def test_is_transient():
    import httpx
    import urllib3
    from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError
    from minio.error import S3Error, ServerError

    def s3(code, status):
        return S3Error(urllib3.HTTPResponse(status=status), code, "m", "/r", "id", "host")

    transient = [s3("XMinioServerNotInitialized", 503), s3("InternalError", 500), s3("SlowDown", 400),
                 ServerError("bad gateway", 502), urllib3.exceptions.MaxRetryError(None, "/x", "refused"),
                 urllib3.exceptions.ProtocolError("reset"), KafkaConnectionError("down"), KafkaTimeoutError(),
                 httpx.ConnectError("refused"), ConnectionRefusedError(), TimeoutError(), OSError(28, "no space")]
    permanent = [checkpoint.CheckpointError("sha256 mismatch"), s3("NoSuchKey", 404), s3("AccessDenied", 403),
                 s3("NoSuchBucket", 503), FileNotFoundError("x"), PermissionError("x"), ValueError("bug"),
                 KeyError("bug")]
    assert [checkpoint.is_transient(e) for e in transient] == [True] * len(transient)
    assert [checkpoint.is_transient(e) for e in permanent] == [False] * len(permanent)


def test_retry_until_success_and_refusals():
    import asyncio

    calls, seen = [], []

    async def flaky():
        calls.append(1)
        if len(calls) < 4:
            raise ConnectionRefusedError("minio down")
        return "done"

    async def run(fn, **kw):
        return await checkpoint.retry(fn, what="upload", base_s=0.001, cap_s=0.004,
                                      on_retry=lambda a, d, e: seen.append((a, d, type(e).__name__)), **kw)

    assert asyncio.run(run(flaky)) == "done"
    assert seen == [(1, 0.001, "ConnectionRefusedError"), (2, 0.002, "ConnectionRefusedError"),
                    (3, 0.004, "ConnectionRefusedError")]

    async def corrupt():
        raise checkpoint.CheckpointError("sha256 mismatch for model.safetensors")

    seen.clear()
    with pytest.raises(checkpoint.CheckpointError, match="sha256 mismatch"):
        asyncio.run(run(corrupt))
    assert seen == []  # a bad checkpoint is never retried

    async def stopped_during_backoff():
        stop = asyncio.Event()

        async def down():
            stop.set()  # stop() while the first attempt fails
            raise ConnectionRefusedError("down")

        return await run(down, stop=stop)

    seen.clear()
    with pytest.raises(checkpoint.Stopped, match="upload: stopped after 1 failed attempts"):
        asyncio.run(stopped_during_backoff())
    assert seen == [(1, 0.001, "ConnectionRefusedError")]


def test_prune_local_keeps_the_newest_and_protected(tmp_path):
    from spanrl.trainer.checkpoint import prune_local

    run = tmp_path / "run"
    for v in (1, 2, 3, 4, 5):
        (run / f"{v:06d}").mkdir(parents=True)
    (run / "000006.partial").mkdir()
    gone = prune_local(run, keep=2, protect={run / "000001"})
    assert [p.name for p in gone] == ["000002", "000003"]
    assert sorted(p.name for p in run.iterdir()) == ["000001", "000004", "000005", "000006.partial"]
    assert prune_local(run, keep=0) == [] and prune_local(tmp_path / "absent", keep=2) == []


def test_weights_to_prune_keeps_the_newest():
    from spanrl.trainer.checkpoint import weights_to_prune

    assert weights_to_prune([3, 1, 2, 5, 4], keep=2) == [1, 2, 3]
    assert weights_to_prune([1, 2], keep=4) == [] and weights_to_prune([1, 2], keep=0) == []


def test_resume_plan_follows_the_store_not_announcements_of_deleted_checkpoints():
    from spanrl.trainer.train import resume_plan

    assert resume_plan(None, None) == (0, False, None)        # a new run: the base model
    assert resume_plan(4, 4) == (4, False, None)              # the usual restart
    assert resume_plan(3, 4) == (4, True, None)               # uploaded, never announced: announce it
    assert resume_plan(None, 2) == (2, True, None)
    assert resume_plan(7, None) == (0, False, 7)              # `spanrl clean` deleted the run's objects
    assert resume_plan(7, 3) == (3, False, 7)                 # some deleted: resume what is left
