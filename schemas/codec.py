"""Avro encoding of spanrl records on Kafka.

Wire format of every record value (what Kafka stores)::

    byte 0      magic 0x53 ('S')
    bytes 1..2  writer schema version, unsigned big-endian
    bytes 3..   fastavro schemaless body written with ``<record>.v<version>.avsc``

The reader resolves the writer schema against the newest schema of the record type
(Avro schema resolution, Avro 1.11 spec "Schema Resolution"), so data written by an
older version keeps reading as long as new fields carry defaults. Compatibility
rule: a new version may add fields with defaults, never remove or retype one.
"""
from __future__ import annotations

import io
import json
import re
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import fastavro

AVRO_DIR = Path(__file__).parent / "avro"
MAGIC = 0x53
_HEADER = struct.Struct(">BH")

#: record type -> Avro full name
RECORD_NAMES = {
    "span": "spanrl.Span",
    "reward": "spanrl.Reward",
    "rollout": "spanrl.RolloutEvent",
    "task": "spanrl.Task",
    "transition": "spanrl.Transition",
    "sample": "spanrl.Sample",
    "checkpoint": "spanrl.CheckpointAnnouncement",
    "dead_letter": "spanrl.DeadLetter",
}
#: record types another record type refers to by name (parsed first)
_DEPENDS = {"sample": ("transition",)}


class SchemaError(ValueError):
    """A record could not be encoded or decoded; ``reason`` is a dead-letter code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class _Schemas:
    versions: dict[int, Any]  # version -> parsed schema

    @property
    def latest_version(self) -> int:
        return max(self.versions)


@lru_cache(maxsize=None)
def _load(record_type: str) -> _Schemas:
    if record_type not in RECORD_NAMES:
        raise SchemaError("schema_error", f"unknown record type {record_type!r}")
    versions: dict[int, Any] = {}
    for path in AVRO_DIR.glob(f"{record_type}.v*.avsc"):
        m = re.fullmatch(rf"{record_type}\.v(\d+)\.avsc", path.name)
        if not m:
            continue
        version = int(m.group(1))
        named: dict[str, Any] = {}
        for dep in _DEPENDS.get(record_type, ()):
            dep_schemas = _load(dep)
            fastavro.parse_schema(
                json.loads(_raw(dep, dep_schemas.latest_version)), named_schemas=named
            )
        versions[version] = fastavro.parse_schema(json.loads(path.read_text()), named_schemas=named)
    if not versions:
        raise SchemaError("schema_error", f"no .avsc for {record_type!r} in {AVRO_DIR}")
    return _Schemas(versions)


def _raw(record_type: str, version: int) -> str:
    return (AVRO_DIR / f"{record_type}.v{version}.avsc").read_text()


def latest_version(record_type: str) -> int:
    """Newest schema version of ``record_type`` (e.g. ``"span"``)."""
    return _load(record_type).latest_version


def encode(record_type: str, record: dict, version: int | None = None) -> bytes:
    """Encode ``record`` as ``record_type`` (newest schema unless ``version``).

    Returns header + Avro body. Raises :class:`SchemaError` (reason ``schema_error``)
    when the record does not match the schema.
    """
    schemas = _load(record_type)
    version = schemas.latest_version if version is None else version
    record = {**record, "schema_version": version}
    buf = io.BytesIO()
    buf.write(_HEADER.pack(MAGIC, version))
    try:
        fastavro.schemaless_writer(buf, schemas.versions[version], record, strict_allow_default=True)
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
        raise SchemaError("schema_error", f"{record_type} v{version}: {exc}") from exc
    return buf.getvalue()


def decode(record_type: str, data: bytes) -> dict:
    """Decode bytes written by :func:`encode` into the newest schema of ``record_type``.

    Raises :class:`SchemaError` with reason ``schema_error`` for a wrong header, an
    unknown writer version or a body that does not parse.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) < _HEADER.size:
        raise SchemaError("schema_error", "record shorter than the 3-byte header")
    magic, version = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise SchemaError("schema_error", f"bad magic byte 0x{magic:02x}")
    schemas = _load(record_type)
    writer = schemas.versions.get(version)
    if writer is None:
        raise SchemaError("schema_error", f"{record_type} has no schema version {version}")
    buf = io.BytesIO(bytes(data[_HEADER.size:]))
    try:
        record = fastavro.schemaless_reader(buf, writer, schemas.versions[schemas.latest_version])
    except Exception as exc:  # fastavro raises many types on corrupt input
        raise SchemaError("schema_error", f"{record_type} v{version}: {type(exc).__name__}: {exc}") from exc
    if buf.tell() != len(buf.getbuffer()):
        raise SchemaError("schema_error", f"{record_type} v{version}: trailing bytes after record")
    return record
