"""Checkpoint manifests (sha256 of every file), the offset chain between them, the run's
start marker, their transfer to/from MinIO, and retries with backoff.

Layout in object storage: ``s3://BUCKET/RUN/VERSION:06d/`` holding the HF safetensors,
config, tokenizer files and ``manifest.json`` (a LoRA run: the adapter's
``adapter_model.safetensors`` and ``adapter_config.json`` and the manifest; trainer/lora.py),
plus ``s3://BUCKET/RUN/start.json`` (where the run began reading samples). The manifest is uploaded last, so a prefix without
``manifest.json`` is an unfinished upload and is ignored.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import logging
import shutil
from pathlib import Path
from typing import Awaitable, Callable, TypeVar

from spanrl.core import credentials
from spanrl.core.disk import tree_bytes

log = logging.getLogger("spanrl.checkpoint")

MANIFEST = "manifest.json"
#: the trainer's signature of the manifest's bytes (spanrl/core/credentials.py), beside it;
#: not listed in the manifest, uploaded before it
SIGNATURE = "manifest.sig"
#: the release gate's decision, written beside a manifest (trainer/gate.py); not a checkpoint file
GATE_RECORD = "gate.json"
START_MARKER = "start.json"
T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete or does not match its manifest; ``reason``: a reason code
    (``no_manifest``, ``bad_manifest``, ``file_missing``, ``sha256_mismatch``, ``unsigned``,
    ``bad_signature``, ``unlisted_file``, ``no_signing_key``; ``unverified`` otherwise)."""

    def __init__(self, detail: str, reason: str = "unverified"):
        super().__init__(detail)
        self.reason = reason


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(ckpt_dir: Path, *, run: str, version: int, parent_version: int | None, base_model: str,
                   step: int, trained_offsets: dict[str, int], metrics: dict[str, float],
                   consumed_offsets: dict[str, list[int]] | None = None, staleness: dict | None = None,
                   adapter: dict | None = None) -> dict:
    """Hash every file of ``ckpt_dir`` (except the manifest) and write ``manifest.json``.

    ``trained_offsets``: ``{"TOPIC:P": next offset}`` the weights have trained up to;
    ``consumed_offsets``: ``{"TOPIC:P": [from, to]}`` the half-open offset range this
    version trained on since its parent (see :func:`consumed_ranges`); ``staleness``: the
    staleness bound and what it did since the parent (``lag_histogram`` of the samples
    trained, ``refused``, ``kept``; trainer/staleness.py), written when given; ``adapter``:
    the checkpoint is a LoRA adapter of ``base_model``, not full weights
    (``{"kind": "lora", "rank", "alpha", "dropout", "target_modules"}``, trainer/lora.py),
    written when given (a manifest without it: full weights, as before LoRA).
    """
    ckpt_dir = Path(ckpt_dir)
    files = {p.name: sha256_file(p) for p in sorted(ckpt_dir.iterdir())
             if p.is_file() and p.name not in (MANIFEST, SIGNATURE)}
    manifest = {
        "run": run, "version": version, "parent_version": parent_version, "base_model": base_model,
        "step": step, "trained_offsets": dict(trained_offsets),
        "consumed_offsets": {k: list(v) for k, v in (consumed_offsets or {}).items()},
        "metrics": dict(metrics), "files": files,
    }
    if staleness is not None:
        manifest["staleness"] = staleness
    if adapter is not None:
        manifest["adapter"] = adapter
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
        raise CheckpointError(f"{path}: manifest missing", "no_manifest")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest: {exc}", "bad_manifest") from exc
    if not files:
        raise CheckpointError(f"{path}: manifest lists no files", "bad_manifest")
    for name, expected in files.items():
        f = ckpt_dir / name
        if "/" in name or not f.is_file():
            raise CheckpointError(f"{ckpt_dir}: file {name} listed in manifest is missing", "file_missing")
        actual = sha256_file(f)
        if actual != expected:
            raise CheckpointError(f"{ckpt_dir}: sha256 mismatch for {name}: manifest {expected}, file {actual}",
                                  "sha256_mismatch")
    return manifest


def sign_manifest(ckpt_dir: Path, key: bytes) -> str:
    """Write :data:`SIGNATURE`: the HMAC-SHA256 of ``manifest.json``'s bytes keyed by ``key``
    (spanrl/core/credentials.py :func:`sign`); returns it."""
    ckpt_dir = Path(ckpt_dir)
    signature = credentials.sign(key, (ckpt_dir / MANIFEST).read_bytes())
    (ckpt_dir / SIGNATURE).write_text(signature + "\n")
    return signature


def verify_signature(ckpt_dir: Path, key: bytes) -> None:
    """Raise :class:`CheckpointError` unless ``ckpt_dir`` (whose files :func:`verify_manifest`
    checked) is what the key's holder signed: ``unsigned`` (no :data:`SIGNATURE`),
    ``bad_signature`` (another key, or the manifest changed after signing) or
    ``unlisted_file`` (a file the manifest does not list: vLLM would load any
    ``*.safetensors`` of the directory)."""
    ckpt_dir = Path(ckpt_dir)
    sig = ckpt_dir / SIGNATURE
    if not sig.is_file():
        raise CheckpointError(f"{ckpt_dir}: no {SIGNATURE} (an unsigned checkpoint)", "unsigned")
    if not credentials.verify(key, (ckpt_dir / MANIFEST).read_bytes(), sig.read_text()):
        raise CheckpointError(f"{ckpt_dir}: {SIGNATURE} does not match the manifest under this stack's key",
                              "bad_signature")
    listed = set(json.loads((ckpt_dir / MANIFEST).read_text())["files"]) | {MANIFEST, SIGNATURE}
    extra = sorted(p.name for p in ckpt_dir.iterdir() if p.name not in listed)
    if extra:
        raise CheckpointError(f"{ckpt_dir}: files the manifest does not list: {extra}", "unlisted_file")


def manifest_sha256(ckpt_dir: Path) -> str:
    return sha256_file(Path(ckpt_dir) / MANIFEST)


# ---- offset bookkeeping (pure) --------------------------------------------------------

def consumed_ranges(before: dict[str, int], after: dict[str, int]) -> dict[str, list[int]]:
    """``{"TOPIC:P": [from, to]}``: the half-open offset ranges between two
    ``trained_offsets`` snapshots (``before`` = the parent's or the run's start offsets).

    Every partition of ``after`` gets a range (``[x, x]`` when nothing was consumed).
    Raises ValueError naming the partition when ``before`` lacks it or ``after`` is
    behind ``before`` (offsets never move backwards within a run).
    """
    out = {}
    for key in sorted(after):
        if key not in before:
            raise ValueError(f"{key}: no starting offset")
        if after[key] < before[key]:
            raise ValueError(f"{key}: offset went backwards {before[key]} -> {after[key]}")
        out[key] = [before[key], after[key]]
    return out


def _range_problem(where: str, key: str, expected_from: int, got_from: int, what: str) -> str | None:
    if got_from > expected_from:
        return f"{where} {key}: gap, offsets [{expected_from}, {got_from}) after {what} never trained"
    if got_from < expected_from:
        return f"{where} {key}: overlap, offsets [{got_from}, {expected_from}) trained again after {what}"
    return None


def check_offset_chain(manifests: list[dict], start: dict[str, int] | None = None) -> list[str]:
    """Problems in the lineage of one run's checkpoints; ``[]`` when the chain is sound.

    ``manifests``: the manifests of consecutive versions of one run (any order; e.g.
    versions 1..n). ``start``: the offsets of the run's start marker
    (``start.json["offsets"]``), checked against the first version's ``from``.

    Sound means: versions are consecutive, each names the previous one as
    ``parent_version``; each ``consumed_offsets`` range ``[from, to]`` has
    ``from <= to`` and ``to == trained_offsets`` of the same version; and the ranges tile
    the samples partitions with no gap or overlap: each version's ``from`` equals its
    parent's ``to`` (the first version's equals ``start``), per partition, and no
    partition appears or disappears along the way. Every problem is one string naming
    the version and partition.
    """
    problems: list[str] = []
    chain = sorted(manifests, key=lambda m: m["version"])
    prev = None
    for m in chain:
        v = f"v{m['version']}"
        consumed = m.get("consumed_offsets")
        trained = m.get("trained_offsets") or {}
        if not consumed:
            problems.append(f"{v}: no consumed_offsets")
            consumed = {}
        for key, (lo, hi) in sorted(consumed.items()):
            if lo > hi:
                problems.append(f"{v} {key}: range [{lo}, {hi}] runs backwards")
            if trained.get(key) != hi:
                problems.append(f"{v} {key}: consumed to {hi} but trained_offsets says {trained.get(key)}")
        for key in sorted(set(trained) - set(consumed)):
            problems.append(f"{v} {key}: in trained_offsets but not in consumed_offsets")
        if prev is None:
            for key in sorted(start or {}):
                if key not in consumed:
                    problems.append(f"{v} {key}: in the start marker but not consumed")
                else:
                    p = _range_problem(v, key, start[key], consumed[key][0], "the run's start")
                    if p:
                        problems.append(p)
        else:
            pv = f"v{prev['version']}"
            if m["version"] == prev["version"]:
                problems.append(f"{v}: duplicate version")
            elif m["version"] != prev["version"] + 1:
                lo, hi = prev["version"] + 1, m["version"] - 1
                problems.append(f"{v}: follows {pv}, missing " + (f"v{lo}" if lo == hi else f"v{lo}..v{hi}"))
            if m.get("parent_version") != prev["version"]:
                problems.append(f"{v}: parent_version {m.get('parent_version')}, expected {prev['version']}")
            prev_trained = prev.get("trained_offsets") or {}
            for key in sorted(set(prev_trained) | set(consumed)):
                if key not in consumed:
                    problems.append(f"{v} {key}: missing (parent {pv} trained it to {prev_trained[key]})")
                elif key not in prev_trained:
                    problems.append(f"{v} {key}: new partition starting at {consumed[key][0]}, "
                                    f"parent {pv} has no offset for it")
                else:
                    p = _range_problem(v, key, prev_trained[key], consumed[key][0], pv)
                    if p:
                        problems.append(p)
        prev = m
    return problems


def start_positions(keys: list[str], trained_offsets: dict[str, int],
                    marker_offsets: dict[str, int] | None) -> dict[str, int | str]:
    """Where the trainer starts reading each samples partition ``"TOPIC:P"``.

    - the checkpoint's ``trained_offsets`` when it has the partition;
    - else the run's start marker (``start.json``), written before the run first consumed;
    - else, when a marker exists, ``"earliest"``: the partition did not exist when the
      run began, so every record in it is newer than the run's start;
    - else ``"configured"``: a new run; ``TrainerConfig.start`` decides (earliest |
      latest) and the resolved offsets must be written to the marker before consuming.
    """
    out: dict[str, int | str] = {}
    for key in keys:
        if key in trained_offsets:
            out[key] = int(trained_offsets[key])
        elif marker_offsets is not None and key in marker_offsets:
            out[key] = int(marker_offsets[key])
        elif marker_offsets is not None:
            out[key] = "earliest"
        else:
            out[key] = "configured"
    return out


# ---- retries (pure schedule + async helper) -------------------------------------------

class Stopped(RuntimeError):
    """The service was asked to stop while an operation was being retried."""


def backoff_s(attempt: int, base_s: float = 0.5, cap_s: float = 30.0, factor: float = 2.0) -> float:
    """Seconds to wait before retry number ``attempt + 1``: ``base_s * factor**attempt``,
    at most ``cap_s`` (attempt 0 -> 0.5, 1 -> 1, 2 -> 2, ... 6+ -> 30 with the defaults).
    Raises ValueError for a negative attempt."""
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    return min(cap_s, base_s * factor ** min(attempt, 64))


_S3_PERMANENT = {"NoSuchKey", "NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                 "InvalidBucketName", "InvalidObjectName"}


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` is an outage worth retrying: MinIO unreachable or answering 5xx,
    Kafka unreachable/timing out, an HTTP transport error, a network ``OSError``.
    False for :class:`CheckpointError` (bad or incomplete checkpoint: refuse, never
    retry), S3 client errors (missing object, denied), local file errors and anything
    else (bugs surface)."""
    import httpx
    import urllib3.exceptions
    from aiokafka.errors import KafkaError
    from minio.error import S3Error, ServerError

    if isinstance(exc, CheckpointError):
        return False
    if isinstance(exc, S3Error):
        status = getattr(exc.response, "status", 0) or 0
        return exc.code not in _S3_PERMANENT and (status >= 500 or exc.code in {"SlowDown", "RequestTimeout"})
    if isinstance(exc, (ServerError, urllib3.exceptions.HTTPError, KafkaError, httpx.TransportError,
                        asyncio.TimeoutError, ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)):
        return False
    return isinstance(exc, OSError)


async def retry(fn: Callable[[], Awaitable[T]], *, what: str, stop: asyncio.Event | None = None,
                on_retry: Callable[[int, float, BaseException], None] | None = None,
                transient: Callable[[BaseException], bool] = is_transient,
                base_s: float = 0.5, cap_s: float = 30.0) -> T:
    """Await ``fn()`` until it succeeds, retrying transient failures after
    :func:`backoff_s` seconds (each retry logged as a warning and passed to
    ``on_retry(attempt, delay_s, exc)``, attempt from 1).

    Raises the first non-transient exception unchanged, or :class:`Stopped` when ``stop``
    is set (checked before each wait and during it).
    """
    attempt = 0
    while True:
        try:
            return await fn()
        except Exception as exc:
            if not transient(exc):
                raise
            delay = backoff_s(attempt, base_s, cap_s)
            attempt += 1
            log.warning("%s failed (attempt %d): %s: %s; retrying in %.1fs", what, attempt,
                        type(exc).__name__, exc, delay)
            if on_retry is not None:
                on_retry(attempt, delay, exc)
            if stop is None:
                await asyncio.sleep(delay)
                continue
            if stop.is_set():
                raise Stopped(f"{what}: stopped after {attempt} failed attempts") from exc
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                continue
            raise Stopped(f"{what}: stopped after {attempt} failed attempts") from exc


# ---- object storage (plumbing) ------------------------------------------------------

def prune_local(run_dir: Path, keep: int, protect: set[Path] | frozenset = frozenset()) -> list[Path]:
    """Delete the local version directories (six-digit names) of ``run_dir`` except the
    newest ``keep`` and those in ``protect``; returns what was deleted, oldest first.
    ``keep <= 0`` keeps everything. MinIO holds every published version; these are
    working copies (a SmolLM2-135M fp32 checkpoint is ~0.5 GB, and a chaos run writes ~40)."""
    run_dir = Path(run_dir)
    if keep <= 0 or not run_dir.is_dir():
        return []
    versions = sorted(p for p in run_dir.iterdir() if p.is_dir() and p.name.isdigit() and len(p.name) == 6)
    protected = {Path(p).resolve() for p in protect}
    doomed = [p for p in versions[:-keep] if p.resolve() not in protected]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def weights_to_prune(versions: list[int], keep: int) -> list[int]:
    """Versions whose weight files may go from the store: all but the newest ``keep``
    (``keep <= 0``: none). Their manifests stay, so the offset chain stays checkable."""
    return sorted(versions)[:-keep] if keep > 0 else []


def prune_store(client, bucket: str, run: str, keep: int) -> list[int]:
    """Delete the weight files (everything but ``manifest.json``) of the run's published
    versions older than the newest ``keep``; returns the versions pruned. Such a version
    can no longer be downloaded (verification fails: files missing), only its manifest
    read; resume and the reloader use the newest version only."""
    prefix = f"{run}/"
    versions = sorted({int(n) for o in client.list_objects(bucket, prefix=prefix)
                       if (n := o.object_name[len(prefix):].strip("/")).isdigit()})
    pruned = []
    for v in weights_to_prune(versions, keep):
        objs = [o.object_name for o in client.list_objects(bucket, prefix=f"{run}/{v:06d}/", recursive=True)
                if not o.object_name.endswith(("/" + MANIFEST, "/" + GATE_RECORD))]
        for name in objs:
            client.remove_object(bucket, name)
        if objs:
            pruned.append(v)
    return pruned


def make_client(settings):
    """A minio client for ``settings`` (spanrl.core.settings.Settings)."""
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
    """Upload every file of ``ckpt_dir`` under ``uri``; ``manifest.json`` goes last.

    Idempotent, so a failed upload can simply be called again: files are overwritten.
    If ``uri`` already holds a manifest (a published checkpoint), nothing is uploaded
    when it is byte-identical to ours (an earlier attempt finished; its reply was lost)
    and :class:`CheckpointError` is raised when it differs (never overwrite a published
    version).
    """
    bucket, prefix = parse_uri(uri)
    if not client.bucket_exists(bucket):
        client.make_bucket(bucket)
    ckpt_dir = Path(ckpt_dir)
    published = _read_object(client, bucket, prefix + MANIFEST)
    if published is not None:
        if published == (ckpt_dir / MANIFEST).read_bytes():
            return
        raise CheckpointError(f"{uri} already holds a different published manifest; refusing to overwrite it")
    names = sorted(p.name for p in ckpt_dir.iterdir() if p.is_file() and p.name != MANIFEST)
    for name in names + [MANIFEST]:
        client.fput_object(bucket, prefix + name, str(ckpt_dir / name))


def _read_object(client, bucket: str, name: str) -> bytes | None:
    """The object's bytes, or None when it (or the bucket) does not exist."""
    from minio.error import S3Error

    try:
        resp = client.get_object(bucket, name)
    except S3Error as exc:
        if exc.code in {"NoSuchKey", "NoSuchBucket"}:
            return None
        raise
    try:
        return resp.read()
    finally:
        resp.close()
        resp.release_conn()


def read_manifest(client, bucket: str, run: str, version: int) -> dict | None:
    """The published manifest of ``run``'s ``version`` (``s3://bucket/RUN/VERSION/manifest.json``),
    or None when there is none."""
    raw = _read_object(client, bucket, f"{run}/{version:06d}/{MANIFEST}")
    return None if raw is None else json.loads(raw)


def start_marker_name(run: str) -> str:
    return f"{run}/{START_MARKER}"


def read_start_marker(client, bucket: str, run: str) -> dict | None:
    """The run's start marker ``{"run", "offsets": {"TOPIC:P": offset}, "start",
    "created_ms"}``, or None when the run has none. Raises CheckpointError when it is
    unreadable (never guess a start: that could skip samples)."""
    raw = _read_object(client, bucket, start_marker_name(run))
    if raw is None:
        return None
    try:
        marker = json.loads(raw)
        offsets = {str(k): int(v) for k, v in marker["offsets"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"s3://{bucket}/{start_marker_name(run)}: unreadable start marker: {exc}") from exc
    return {**marker, "offsets": offsets}


def write_start_marker(client, bucket: str, run: str, marker: dict) -> None:
    """Store the run's start marker (one PUT: the object is there whole or not at all)."""
    if not client.bucket_exists(bucket):
        client.make_bucket(bucket)
    data = json.dumps(marker, indent=2, sort_keys=True).encode()
    client.put_object(bucket, start_marker_name(run), io.BytesIO(data), len(data),
                      content_type="application/json")


def write_gate_record(client, uri: str, record: dict) -> None:
    """Put the release gate's decision beside the checkpoint's manifest
    (``<uri>gate.json``; not listed in the manifest, so verification is unchanged)."""
    import io

    bucket, prefix = parse_uri(uri)
    data = json.dumps(record, indent=2, sort_keys=True).encode()
    client.put_object(bucket, prefix + GATE_RECORD, io.BytesIO(data), len(data), content_type="application/json")


def read_gate_record(client, uri: str) -> dict | None:
    """The gate's decision written beside the checkpoint at ``uri`` (None when none)."""
    bucket, prefix = parse_uri(uri)
    raw = _read_object(client, bucket, prefix + GATE_RECORD)
    return json.loads(raw) if raw is not None else None


def download_checkpoint(client, uri: str, dest: Path) -> dict:
    """Download the checkpoint at ``uri`` into ``dest`` and return its verified manifest.

    Files land in ``dest.partial`` first and are renamed into place only after
    :func:`verify_manifest` passes; on failure the partial directory is removed and
    :class:`CheckpointError` is raised (``dest`` is left untouched).
    """
    bucket, prefix = parse_uri(uri)
    with partial_dir(Path(dest)) as tmp:
        objs = [o for o in client.list_objects(bucket, prefix=prefix) if not o.is_dir]
        if not any(o.object_name == prefix + MANIFEST for o in objs):
            raise CheckpointError(f"{uri}: no {MANIFEST} (upload unfinished or wrong uri)", "no_manifest")
        for o in objs:
            name = o.object_name[len(prefix):]
            if "/" in name or name == GATE_RECORD:  # the gate's decision is not part of the checkpoint
                continue
            client.fget_object(bucket, o.object_name, str(tmp / name))
        manifest = verify_manifest(tmp)
    return manifest


@contextlib.contextmanager
def partial_dir(dest: Path):
    """Yields a fresh, empty ``dest.partial`` to write a directory into; when the block ends it
    replaces ``dest`` (one rename), when the block raises it is removed and ``dest`` is left
    untouched. So a ``dest`` that exists is complete."""
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


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


# ---- whole runs: what a run leaves on disk and in the store -------------------------

def local_run_dirs(cache_dir: Path, run: str) -> list[Path]:
    """The local directories that hold copies of ``run``'s checkpoints, existing or not:
    the trainer's working copies (``cache_dir/trainer/RUN``), the reloader's downloads
    (``cache_dir/checkpoints/RUN``) and evaluation pins (``cache_dir/checkpoints/pinned/RUN``).
    Raises ValueError for a run name that is empty or not one path component (so no
    caller can be made to delete outside these roots)."""
    if not run or run in {".", "..", "pinned"} or "/" in run or "\\" in run:
        raise ValueError(f"not a run name: {run!r}")
    cache_dir = Path(cache_dir)
    return [cache_dir / "trainer" / run, cache_dir / "checkpoints" / run, cache_dir / "checkpoints" / "pinned" / run]


def list_runs(client, bucket: str, cache_dir: Path) -> dict[str, dict]:
    """Every run that has objects under ``bucket/RUN/`` or a local directory of
    :func:`local_run_dirs`: ``{run: {"store_bytes", "store_objects", "local_bytes"}}``
    (bytes). ``client`` None: local directories only (MinIO not running)."""
    runs: dict[str, dict] = {}

    def entry(run: str) -> dict:
        return runs.setdefault(run, {"store_bytes": 0, "store_objects": 0, "local_bytes": 0})

    if client is not None and client.bucket_exists(bucket):
        for o in client.list_objects(bucket, recursive=True):
            e = entry(o.object_name.split("/", 1)[0])
            e["store_bytes"] += int(o.size or 0)
            e["store_objects"] += 1
    cache_dir = Path(cache_dir)
    for root in (cache_dir / "trainer", cache_dir / "checkpoints", cache_dir / "checkpoints" / "pinned"):
        if root.is_dir():
            for d in root.iterdir():
                if d.is_dir() and not (root.name == "checkpoints" and d.name == "pinned"):
                    entry(d.name)["local_bytes"] += tree_bytes(d)
    return runs


def delete_run(client, bucket: str, cache_dir: Path, run: str) -> dict:
    """Delete everything ``run`` left: its objects in ``bucket/RUN/`` (manifests, weights,
    start marker, gate records) and its :func:`local_run_dirs`. Returns ``{"run",
    "store_objects", "store_bytes", "local_bytes"}`` (what was removed). ``client`` None:
    local directories only. Its Kafka records (samples, announcements) stay: the log is
    the record of what happened; a trainer started again on this run name starts from the
    base model (its versions continue past the deleted ones: ``train.resume_plan``)."""
    dirs = local_run_dirs(cache_dir, run)  # validates the name first
    removed = {"run": run, "store_objects": 0, "store_bytes": 0, "local_bytes": 0}
    if client is not None and client.bucket_exists(bucket):
        for o in list(client.list_objects(bucket, prefix=f"{run}/", recursive=True)):
            client.remove_object(bucket, o.object_name)
            removed["store_objects"] += 1
            removed["store_bytes"] += int(o.size or 0)
    for d in dirs:
        removed["local_bytes"] += tree_bytes(d)
        shutil.rmtree(d, ignore_errors=True)
    return removed
