"""Claim-check for records above a topic's size limit (DESIGN.md, "Large payloads").

A span whose encoded record would not fit its topic (``Topic.max_message_bytes`` less
:data:`CLAIM_MARGIN_BYTES`) is put whole, as the encoded Avro record, into MinIO under a
content-addressed key, and Kafka gets a small span carrying only its identity and
``payload_ref`` (Enterprise Integration Patterns, "Claim Check")::

    key = <topic>/<rollout_id, url-quoted>/<sha256 of the record>.avro
    ref = s3://<bucket>/<key>

The same record always lands on the same key, so a retried request rewrites the same
object. A reader (the stream app) fetches the object, checks its sha256 against the key
and that it is the span the small record names, and decodes it; any failure is a
:class:`ClaimError` (dead-letter reason ``claim_unresolved``).

Used by the OTLP bridge, the LLM proxy (``check_in``) and the stream app (``resolve_claim``).
MinIO calls are blocking (minio client); the async functions run them in a thread.
"""
from __future__ import annotations

import asyncio
import hashlib
import io
import re
import time
from dataclasses import dataclass
from urllib.parse import quote

from spanrl.schemas import codec
from spanrl.schemas.topics import Topic

#: kept free below a topic's max.message.bytes: the record's key and batch framing, and
#: a dead letter that carries the record as its payload (dead-letter has the same limit)
CLAIM_MARGIN_BYTES = 64 * 1024
CLAIM_UNRESOLVED = "claim_unresolved"
SCHEME = "s3://"
#: S3 error codes that retrying cannot fix
_PERMANENT = frozenset({"NoSuchKey", "NoSuchBucket", "InvalidBucketName", "AccessDenied"})
_REF = re.compile(r"s3://(?P<bucket>[^/]+)/(?P<key>.+/(?P<sha256>[0-9a-f]{64})\.avro)")
#: span fields a small (claim) record keeps; the rest is in the object
_IDENTITY = ("rollout_id", "attempt_id", "sequence_id", "trace_id", "span_id", "parent_span_id",
             "name", "kind", "source", "start_time_unix_nano", "end_time_unix_nano", "status_code",
             "agent_name")


class ClaimError(ValueError):
    """A claim reference that cannot be resolved (malformed, missing object, wrong
    content); ``reason`` is the dead-letter code ``claim_unresolved``."""

    reason = CLAIM_UNRESOLVED


class ClaimStoreUnavailable(RuntimeError):
    """MinIO could not be reached or refused a write (producers answer 503)."""


@dataclass(frozen=True)
class Claim:
    """A parsed reference: bucket, object key and the sha256 (hex) the object must have."""

    bucket: str
    key: str
    sha256: str

    @property
    def ref(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"


def fits(size: int, limit: int) -> bool:
    """True when a record value of ``size`` bytes may be produced to a topic whose
    ``max.message.bytes`` is ``limit`` (leaving :data:`CLAIM_MARGIN_BYTES` free)."""
    return size + CLAIM_MARGIN_BYTES <= limit


def content_key(topic: str, rollout_id: str, payload: bytes) -> str:
    """Object key of ``payload`` (an encoded record of ``topic``):
    ``<topic>/<rollout_id url-quoted, no '/'>/<sha256 hex>.avro``."""
    return f"{topic}/{quote(rollout_id, safe='')}/{hashlib.sha256(payload).hexdigest()}.avro"


def parse_ref(ref: str, bucket: str | None = None) -> Claim:
    """Parse ``s3://bucket/<topic>/<rollout>/<sha256>.avro``. With ``bucket`` given, a
    reference into another bucket is refused. Raises :class:`ClaimError`."""
    m = _REF.fullmatch(ref or "")
    if m is None:
        raise ClaimError(f"not a claim reference: {ref!r}")
    if bucket is not None and m["bucket"] != bucket:
        raise ClaimError(f"claim in bucket {m['bucket']!r}, expected {bucket!r}: {ref}")
    return Claim(m["bucket"], m["key"], m["sha256"])


def claim_span(span: dict, ref: str) -> dict:
    """The small span produced in place of ``span``: its identity fields, no attributes,
    no ``llm``, and ``payload_ref = ref`` (span.v1, schemas/avro/span.v1.avsc)."""
    small = {k: span[k] for k in _IDENTITY if k in span}
    small.update(attributes={}, llm=None, payload_ref=ref)
    return small


def verify(claim: Claim, data: bytes) -> bytes:
    """``data`` if its sha256 is the claim's; else :class:`ClaimError`."""
    actual = hashlib.sha256(data).hexdigest()
    if actual != claim.sha256:
        raise ClaimError(f"sha256 mismatch for {claim.ref}: object has {actual}")
    return data


def check_claimed(small: dict, full: dict) -> dict:
    """``full`` (the decoded object) if it is the span ``small`` stands for (same rollout,
    attempt and span id); else :class:`ClaimError`."""
    for k in ("rollout_id", "attempt_id", "span_id"):
        if full.get(k) != small.get(k):
            raise ClaimError(f"claimed span has {k}={full.get(k)!r}, the record says {small.get(k)!r}")
    return full


# ---------------------------------------------------------------- MinIO plumbing
def make_client(settings=None):
    """A minio client for ``settings`` (spanrl.core.settings.Settings; default: get_settings())."""
    from minio import Minio

    if settings is None:
        from spanrl.core.settings import get_settings

        settings = get_settings()
    return Minio(settings.minio_endpoint, access_key=settings.minio_access_key,
                 secret_key=settings.minio_secret_key.get_secret_value(), secure=False)


async def put_claim(client, bucket: str, topic: str, rollout_id: str, payload: bytes) -> str:
    """Store ``payload`` under its content key in ``bucket``; returns the reference.
    Raises :class:`ClaimStoreUnavailable` when MinIO does not take it."""
    key = content_key(topic, rollout_id, payload)

    def put() -> None:
        client.put_object(bucket, key, io.BytesIO(payload), len(payload),
                          content_type="application/avro")

    try:
        await asyncio.to_thread(put)
    except Exception as exc:  # minio raises S3Error, urllib3 errors, OSError
        raise ClaimStoreUnavailable(f"cannot store claim {bucket}/{key}: {exc!r}") from exc
    return f"{SCHEME}{bucket}/{key}"


async def check_in(client, bucket: str, topic: Topic, rollout_id: str, span: dict, value: bytes) -> bytes:
    """The value to produce for ``span`` (encoded as ``value``) to ``topic``: ``value``
    itself if it fits, else the encoded small claim record after storing ``value`` in
    MinIO. The result may still not fit (huge identity fields): callers check
    :func:`fits` again and dead-letter ``oversize``. Raises :class:`ClaimStoreUnavailable`."""
    if fits(len(value), topic.max_message_bytes):
        return value
    ref = await put_claim(client, bucket, topic.name, rollout_id, value)
    return codec.encode(topic.record, claim_span(span, ref))


async def resolve_claim(client, ref: str, bucket: str | None = None, retry_s: float = 30.0) -> bytes:
    """The verified bytes behind ``ref``. A missing object, another bucket or a sha256
    mismatch raise :class:`ClaimError` at once; MinIO being unreachable is retried for
    ``retry_s`` seconds, then raises :class:`ClaimError` too."""
    from minio.error import S3Error

    claim = parse_ref(ref, bucket)

    def get() -> bytes:
        resp = client.get_object(claim.bucket, claim.key)
        try:
            return resp.read()
        finally:
            resp.close()
            resp.release_conn()

    deadline = time.monotonic() + retry_s
    delay = 0.5
    while True:
        try:
            return verify(claim, await asyncio.to_thread(get))
        except S3Error as exc:
            if exc.code in _PERMANENT:
                raise ClaimError(f"{claim.ref}: {exc.code}") from exc
            error: Exception = exc
        except ClaimError:
            raise
        except Exception as exc:  # connection errors: MinIO down or restarting
            error = exc
        if time.monotonic() + delay > deadline:
            raise ClaimError(f"{claim.ref}: MinIO did not answer for {retry_s:g}s: {error!r}") from error
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)
