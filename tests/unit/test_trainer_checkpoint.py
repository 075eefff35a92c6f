"""Checkpoint manifests: sha256 of each file; verification accepts good, refuses tampered/missing."""
from __future__ import annotations

import json

import pytest

from trainer import checkpoint


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
