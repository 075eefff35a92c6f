"""Checkpoint manifests (sha256 of every file) and their transfer to/from MinIO.

Layout in object storage: ``s3://BUCKET/RUN/VERSION:06d/`` holding the HF safetensors,
config, tokenizer files and ``manifest.json``. The manifest is uploaded last, so a
prefix without ``manifest.json`` is an unfinished upload and is ignored.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete or does not match its manifest."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(ckpt_dir: Path, *, run: str, version: int, parent_version: int | None, base_model: str,
                   step: int, trained_offsets: dict[str, int], metrics: dict[str, float]) -> dict:
    """Hash every file of ``ckpt_dir`` (except the manifest) and write ``manifest.json``."""
    ckpt_dir = Path(ckpt_dir)
    files = {p.name: sha256_file(p) for p in sorted(ckpt_dir.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {
        "run": run, "version": version, "parent_version": parent_version, "base_model": base_model,
        "step": step, "trained_offsets": dict(trained_offsets), "metrics": dict(metrics), "files": files,
    }
    (ckpt_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def verify_manifest(ckpt_dir: Path) -> dict:
    """Return the manifest of ``ckpt_dir`` after checking every listed file's sha256.

    Raises :class:`CheckpointError` naming the file when the manifest is missing or
    unreadable, a listed file is missing, or a hash differs.
    """
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: manifest missing")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest: {exc}") from exc
    if not files:
        raise CheckpointError(f"{path}: manifest lists no files")
    for name, expected in files.items():
        f = ckpt_dir / name
        if not f.is_file():
            raise CheckpointError(f"{ckpt_dir}: file {name} listed in manifest is missing")
        actual = sha256_file(f)
        if actual != expected:
            raise CheckpointError(f"{ckpt_dir}: sha256 mismatch for {name}: manifest {expected}, file {actual}")
    return manifest


def manifest_sha256(ckpt_dir: Path) -> str:
    return sha256_file(Path(ckpt_dir) / MANIFEST)


# ---- object storage (plumbing) ------------------------------------------------------

def make_client(settings):
    """A minio client for ``settings`` (infra.settings.Settings)."""
    from minio import Minio

    return Minio(settings.minio_endpoint, access_key=settings.minio_access_key,
                 secret_key=settings.minio_secret_key.get_secret_value(), secure=False)


def checkpoint_uri(bucket: str, run: str, version: int) -> str:
    return f"s3://{bucket}/{run}/{version:06d}/"


def parse_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> ``("bucket", "a/b/")``."""
    if not uri.startswith("s3://"):
        raise CheckpointError(f"not an s3:// uri: {uri!r}")
    bucket, _, prefix = uri[5:].partition("/")
    if not bucket or not prefix:
        raise CheckpointError(f"uri needs a bucket and a prefix: {uri!r}")
    return bucket, prefix.rstrip("/") + "/"


def upload_checkpoint(client, ckpt_dir: Path, uri: str) -> None:
    """Upload every file of ``ckpt_dir`` under ``uri``; ``manifest.json`` goes last."""
    bucket, prefix = parse_uri(uri)
    if not client.bucket_exists(bucket):
        client.make_bucket(bucket)
    ckpt_dir = Path(ckpt_dir)
    names = sorted(p.name for p in ckpt_dir.iterdir() if p.is_file() and p.name != MANIFEST)
    for name in names + [MANIFEST]:
        client.fput_object(bucket, prefix + name, str(ckpt_dir / name))


def download_checkpoint(client, uri: str, dest: Path) -> dict:
    """Download the checkpoint at ``uri`` into ``dest`` and return its verified manifest.

    Files land in ``dest.partial`` first and are renamed into place only after
    :func:`verify_manifest` passes; on failure the partial directory is removed and
    :class:`CheckpointError` is raised (``dest`` is left untouched).
    """
    bucket, prefix = parse_uri(uri)
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        objs = [o for o in client.list_objects(bucket, prefix=prefix) if not o.is_dir]
        if not any(o.object_name == prefix + MANIFEST for o in objs):
            raise CheckpointError(f"{uri}: no {MANIFEST} (upload unfinished or wrong uri)")
        for o in objs:
            name = o.object_name[len(prefix):]
            if "/" in name:
                continue
            client.fget_object(bucket, o.object_name, str(tmp / name))
        manifest = verify_manifest(tmp)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return manifest


def latest_version_in_store(client, bucket: str, run: str) -> int | None:
    """Highest version under ``bucket/run/`` whose manifest exists (None when none)."""
    if not client.bucket_exists(bucket):
        return None
    best = None
    for o in client.list_objects(bucket, prefix=f"{run}/"):
        name = o.object_name[len(run) + 1:].strip("/")
        if name.isdigit():
            try:
                client.stat_object(bucket, f"{run}/{name}/{MANIFEST}")
            except Exception:
                continue
            best = max(best or 0, int(name))
    return best
