"""Avro encoding of spanrl records on Kafka.

Wire format of every record value (what Kafka stores): the Confluent wire format
(Confluent Schema Registry docs, "Wire format"), which Kafka Connect's AvroConverter,
Flink's ``avro-confluent``, ksqlDB, kcat ``-s value=avro`` and confluent-kafka's
``AvroDeserializer`` read::

    byte 0      magic 0x00
    bytes 1..4  writer schema id, unsigned big-endian (the schema registry's id)
    bytes 5..   Avro binary body written with ``<record>.v<version>.avsc``

The ids are committed in ``avro/registry_ids.json`` (``"<record>.v<N>": id``, append-only:
a new schema takes the next id); the stack registers every schema in id order into an
empty registry, which then assigns exactly these ids (spanrl/core/schema_registry.py checks
it), so encoding needs no registry call. Records written before this format keep reading:
magic ``0x53`` ('S') + a 2-byte writer schema version (:data:`LEGACY_MAGIC`).

The reader resolves the writer schema against the newest schema of the record type
(Avro schema resolution, Avro 1.11 spec "Schema Resolution"), so data written by an
older version keeps reading as long as new fields carry defaults. Compatibility
rule: a new version may add fields with defaults, never remove or retype one. A schema id
this checkout does not know (a newer writer's) is fetched once through
:attr:`SchemaRegistry.resolver` when one is installed and read into the newest local
version the same way.
"""
from __future__ import annotations

import io
import json
import numbers
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import fastavro

AVRO_DIR = Path(__file__).parent / "avro"
#: the committed schema ids: ``{"<record>.v<N>": id}``
IDS_FILE = "registry_ids.json"
#: Confluent wire format: magic 0, 4-byte big-endian schema id
MAGIC = 0
_HEADER = struct.Struct(">BI")
#: the framing before the Confluent one: magic 0x53, 2-byte schema version
LEGACY_MAGIC = 0x53
_LEGACY_HEADER = struct.Struct(">BH")

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
    "call_account": "spanrl.CallAccount",
    "trace_link": "spanrl.TraceLink",
}
#: record types another record type refers to by name, per version of the referring type:
#: record type -> {its version: {dependency: the dependency's version}}. Each version names
#: the version it was written with, so that records written before the dependency evolved
#: keep decoding (sample v1 embeds transition v1; sample v2, transition v2).
_DEPENDS = {"sample": {1: {"transition": 1}, 2: {"transition": 2}}}
#: Avro 1.11 spec "Primitive Types": int is 32-bit, long 64-bit signed
_INT_RANGE = {"int": (-(2**31), 2**31 - 1), "long": (-(2**63), 2**63 - 1)}


class SchemaError(ValueError):
    """A record could not be encoded or decoded; ``reason`` is a dead-letter code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class SchemaRegistry:
    """The versioned schemas of one directory (``<record>.v<N>.avsc`` files)."""

    def __init__(self, directory: Path = AVRO_DIR, resolver: Callable[[int], str | None] | None = None):
        """``directory``'s ``registry_ids.json`` names the schema ids (that of ``schemas/avro``
        when it has none); ``resolver(schema_id)`` returns the schema text of an id the map
        does not hold, or None (a schema registry; see :meth:`decode`)."""
        self.directory = Path(directory)
        self._versions: dict[str, dict[int, Any]] = {}
        self._around: dict[tuple, tuple] = {}
        ids_path = self.directory / IDS_FILE
        self.ids: dict[tuple[str, int], int] = parse_ids(
            (ids_path if ids_path.exists() else AVRO_DIR / IDS_FILE).read_text())
        self._by_id = {i: key for key, i in self.ids.items()}
        self.resolver = resolver
        self._fetched: dict[int, tuple[str, Any]] = {}

    def versions(self, record_type: str) -> dict[int, Any]:
        """version -> parsed schema for ``record_type``; raises SchemaError if none."""
        if record_type in self._versions:
            return self._versions[record_type]
        if record_type not in RECORD_NAMES:
            raise SchemaError("schema_error", f"unknown record type {record_type!r}")
        versions: dict[int, Any] = {}
        for path in self.directory.glob(f"{record_type}.v*.avsc"):
            m = re.fullmatch(rf"{record_type}\.v(\d+)\.avsc", path.name)
            if not m:
                continue
            raw = json.loads(path.read_text())
            named: dict[str, Any] = {}
            deps = _DEPENDS.get(record_type, {})
            if deps and int(m.group(1)) not in deps:
                raise SchemaError("schema_error", f"{path.name}: codec._DEPENDS names no dependency versions for it")
            for dep, dep_version in deps.get(int(m.group(1)), {}).items():
                fastavro.parse_schema(self._raw(dep, dep_version), named_schemas=named)
            versions[int(m.group(1))] = fastavro.parse_schema(json.loads(path.read_text()), named_schemas=named)
        if not versions:
            raise SchemaError("schema_error", f"no .avsc for {record_type!r} in {self.directory}")
        self._versions[record_type] = versions
        return versions

    def _raw(self, record_type: str, version: int) -> dict:
        return json.loads((self.directory / f"{record_type}.v{version}.avsc").read_text())

    def latest_version(self, record_type: str) -> int:
        """Newest schema version of ``record_type`` (e.g. ``"span"``)."""
        return max(self.versions(record_type))

    def schema_id(self, record_type: str, version: int) -> int:
        """The schema id of ``<record_type>.v<version>`` (``registry_ids.json``); SchemaError if none."""
        try:
            return self.ids[(record_type, version)]
        except KeyError:
            raise SchemaError("schema_error", f"{record_type} v{version} has no schema id in "
                                              f"{IDS_FILE}") from None

    def registry_schema(self, record_type: str, version: int) -> str:
        """The text a schema registry holds for ``<record_type>.v<version>``: the .avsc with
        the record types it names (``_DEPENDS``) written inline where first used, since a
        registry's reader parses each schema alone; compact JSON."""
        return json.dumps(inline_schema(self._raw(record_type, version), {
            RECORD_NAMES[dep]: self._raw(dep, dep_version)
            for dep, dep_version in _DEPENDS.get(record_type, {}).get(version, {}).items()}),
            separators=(",", ":"))

    def encode(self, record_type: str, record: dict, version: int | None = None) -> bytes:
        """Encode ``record`` as ``record_type`` (newest schema unless ``version``).

        Returns the 5-byte header (magic 0, schema id) + Avro body. Raises :class:`SchemaError` (reason ``schema_error``)
        when the record does not match the schema.
        """
        versions = self.versions(record_type)
        version = max(versions) if version is None else version
        if version not in versions:
            raise SchemaError("schema_error", f"{record_type} has no schema version {version}")
        schema_id = self.schema_id(record_type, version)
        record = {**record, "schema_version": version}
        _check_scalars(versions[version], record, record_type)
        buf = io.BytesIO()
        buf.write(_HEADER.pack(MAGIC, schema_id))
        try:
            fastavro.schemaless_writer(buf, versions[version], record, strict_allow_default=True)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            raise SchemaError("schema_error", f"{record_type} v{version}: {exc}") from exc
        return buf.getvalue()

    def encode_around(self, record_type: str, record: dict, field: str, encoded: bytes) -> bytes | None:
        """:meth:`encode` of ``record`` (newest schema) whose record-typed ``field`` is given as
        ``encoded``, bytes :meth:`encode` wrote for that field's record type: Avro writes a
        record as its fields' encodings one after another (Avro 1.11 spec, "Binary
        Encoding": records), so the result is the header, the fields before ``field``, the
        body of ``encoded`` and the fields after it - byte for byte what :meth:`encode`
        writes for the decoded record, without decoding and encoding it again (a sample's
        transition: ~160 us of 2.4 KB of token ids). None when ``encoded`` is not of the
        version the schema embeds (then decode it and use :meth:`encode`); SchemaError as
        :meth:`encode` for the other fields."""
        version = self.latest_version(record_type)
        key = (record_type, version, field)
        parts = self._around.get(key)
        if parts is None:
            raw = self._raw(record_type, version)
            names = [f["name"] for f in raw["fields"]]
            dep = _DEPENDS.get(record_type, {}).get(version, {})
            nested = next(((t, v) for t, v in dep.items()
                           if field in names and raw["fields"][names.index(field)]["type"] == RECORD_NAMES.get(t)), None)
            if nested is None:
                raise SchemaError("schema_error", f"{record_type} v{version}: {field} is not a nested spanrl record")
            i = names.index(field)

            def sub(fields: list, name: str):
                return fastavro.parse_schema({"type": "record", "name": name, "fields": fields}, named_schemas={})
            parts = self._around[key] = (nested, sub(raw["fields"][:i], "Before"), sub(raw["fields"][i + 1:], "After"))
        (nested_type, nested_version), before, after = parts
        if len(encoded) < _HEADER.size or \
                _HEADER.unpack_from(encoded, 0) != (MAGIC, self.ids.get((nested_type, nested_version))):
            return None
        record = {**record, "schema_version": version}
        buf = io.BytesIO()
        buf.write(_HEADER.pack(MAGIC, self.schema_id(record_type, version)))
        try:
            for schema in (before, after):
                fields = {f["name"] for f in schema["fields"]}
                part = {k: v for k, v in record.items() if k in fields}
                _check_scalars(schema, part, record_type)
                fastavro.schemaless_writer(buf, schema, part, strict_allow_default=True)
                if schema is before:
                    buf.write(memoryview(encoded)[_HEADER.size:])
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            raise SchemaError("schema_error", f"{record_type} v{version}: {exc}") from exc
        return buf.getvalue()

    def decode(self, record_type: str, data: bytes) -> dict:
        """Decode bytes written by :meth:`encode` (or by the 0x53 framing before it) into the
        newest schema of ``record_type``.

        The writer schema: the local version the id names (``registry_ids.json``); an id
        not there is asked of :attr:`resolver` once (then cached) and must be a schema of
        this record's Avro name. Raises :class:`SchemaError` with reason ``schema_error`` for
        a wrong header, an unknown schema id or version, an id of another record type, a
        body that does not parse or trailing bytes.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) < 1:
            raise SchemaError("schema_error", "empty record")
        magic = data[0]
        versions = self.versions(record_type)
        if magic == MAGIC:
            if len(data) < _HEADER.size:
                raise SchemaError("schema_error", "record shorter than the 5-byte header")
            schema_id = _HEADER.unpack_from(data, 0)[1]
            key = self._by_id.get(schema_id)
            if key is None:
                label, writer = f"schema id {schema_id}", self._fetch(record_type, schema_id)
            elif key[0] != record_type or key[1] not in versions:
                raise SchemaError("schema_error", f"schema id {schema_id} is {key[0]} v{key[1]}, not a {record_type}")
            else:
                label, writer = f"v{key[1]}", versions[key[1]]
            size = _HEADER.size
        elif magic == LEGACY_MAGIC:
            if len(data) < _LEGACY_HEADER.size:
                raise SchemaError("schema_error", "record shorter than the 3-byte header")
            version = _LEGACY_HEADER.unpack_from(data, 0)[1]
            writer = versions.get(version)
            if writer is None:
                raise SchemaError("schema_error", f"{record_type} has no schema version {version}")
            label, size = f"v{version}", _LEGACY_HEADER.size
        else:
            raise SchemaError("schema_error", f"bad magic byte 0x{magic:02x}")
        body = bytes(data[size:])
        buf = io.BytesIO(body)
        try:
            record = fastavro.schemaless_reader(buf, writer, versions[max(versions)])
        except Exception as exc:  # fastavro raises many types on corrupt input
            raise SchemaError("schema_error", f"{record_type} {label}: {type(exc).__name__}: {exc}") from exc
        if buf.tell() != len(body):
            raise SchemaError("schema_error", f"{record_type} {label}: trailing bytes after record")
        return record

    def _fetch(self, record_type: str, schema_id: int) -> Any:
        """The parsed writer schema of an id not in the local map, from :attr:`resolver`."""
        if schema_id not in self._fetched:
            text = self.resolver(schema_id) if self.resolver is not None else None
            if text is None:
                raise SchemaError("schema_error", f"unknown schema id {schema_id}")
            try:
                raw = json.loads(text)
                name, space = raw["name"], raw.get("namespace")
                self._fetched[schema_id] = (f"{space}.{name}" if space and "." not in name else name,
                                            fastavro.parse_schema(raw, named_schemas={}))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise SchemaError("schema_error", f"schema id {schema_id}: not an Avro record schema: {exc}") from exc
        name, schema = self._fetched[schema_id]
        if name != RECORD_NAMES[record_type]:
            raise SchemaError("schema_error", f"schema id {schema_id} is {name}, not a {record_type}")
        return schema


def parse_ids(text: str) -> dict[tuple[str, int], int]:
    """``registry_ids.json`` (``{"<record>.v<N>": id}``) as ``{(record, N): id}``; ValueError
    for a malformed name, a non-positive id or an id given twice."""
    out: dict[tuple[str, int], int] = {}
    for name, schema_id in json.loads(text).items():
        m = re.fullmatch(r"([a-z_]+)\.v(\d+)", name)
        if not m or not isinstance(schema_id, int) or isinstance(schema_id, bool) or schema_id < 1:
            raise ValueError(f"{IDS_FILE}: bad entry {name!r}: {schema_id!r}")
        out[(m.group(1), int(m.group(2)))] = schema_id
    if len(set(out.values())) != len(out):
        raise ValueError(f"{IDS_FILE}: an id is given twice")
    return out


def inline_schema(schema: Any, named: Mapping[str, Any]) -> Any:
    """``schema`` (parsed JSON) with each reference to a name of ``named`` replaced by that
    schema at its first use (Avro 1.11 spec, "Names": a name may be used once defined), so
    that the result parses alone."""
    done: set[str] = set()

    def walk(node: Any) -> Any:
        if isinstance(node, str) and node in named and node not in done:
            done.add(node)
            return walk(named[node])
        if isinstance(node, list):
            return [walk(n) for n in node]
        if isinstance(node, dict):
            return {k: walk(v) if k in ("type", "fields", "items", "values") else v for k, v in node.items()}
        return node
    return walk(schema)


def _check_scalars(avro: Any, value: Any, where: str) -> None:
    """Raise SchemaError for a value that fastavro would write changed instead of refusing:
    a non-bool in a boolean field (it writes the truthiness: None -> false), a fractional
    number in an int/long field (truncated: 1.5 -> 1) or one out of the type's range, a
    text or a mapping in an array, a non-mapping in a map field (``""`` -> empty), an int
    array item out of range. Walks records and nullable unions; the items of arrays and
    maps are not type-checked (cost: token id lists), so 1.5 in an int array is written 1."""
    if isinstance(avro, list):
        if value is None:
            return
        branches = [t for t in avro if t != "null"]
        if len(branches) != 1:
            return
        avro = branches[0]
    if isinstance(avro, dict):
        if avro.get("type") == "record":
            if isinstance(value, dict):
                for f in avro["fields"]:
                    if f["name"] in value:
                        _check_scalars(f["type"], value[f["name"]], f"{where}.{f['name']}")
            return
        if avro.get("type") == "array":
            if isinstance(value, (str, bytes, bytearray, Mapping)) or not hasattr(value, "__iter__"):
                raise SchemaError("schema_error", f"{where}: array field got {type(value).__name__}")
            if isinstance(avro["items"], str) and avro["items"] in _INT_RANGE and hasattr(value, "__len__") \
                    and len(value):  # min/max: C speed
                lo, hi = _INT_RANGE[avro["items"]]
                try:
                    inside = bool(lo <= min(value) and max(value) <= hi)
                except (TypeError, ValueError):  # not all numbers: fastavro refuses them itself
                    return
                if not inside:
                    raise SchemaError("schema_error", f"{where}: an item is out of the {avro['items']} range")
        if avro.get("type") == "map" and not isinstance(value, Mapping):
            raise SchemaError("schema_error", f"{where}: map field got {type(value).__name__}")
        avro = avro.get("type")
    if avro == "boolean" and not isinstance(value, bool):
        raise SchemaError("schema_error", f"{where}: boolean field got {type(value).__name__} {value!r:.40}")
    if avro in _INT_RANGE and isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        if not float(value).is_integer():
            raise SchemaError("schema_error", f"{where}: {avro} field got the non-integer {value!r:.40}")
        value = int(value)
    if avro in _INT_RANGE and isinstance(value, numbers.Integral):
        lo, hi = _INT_RANGE[avro]
        if not lo <= value <= hi:
            raise SchemaError("schema_error", f"{where}: {value} out of the {avro} range")


DEFAULT = SchemaRegistry()


def latest_version(record_type: str) -> int:
    """Newest schema version of ``record_type`` in ``schemas/avro``."""
    return DEFAULT.latest_version(record_type)


def encode(record_type: str, record: dict, version: int | None = None) -> bytes:
    """Encode with the default registry (``schemas/avro``); see :meth:`SchemaRegistry.encode`."""
    return DEFAULT.encode(record_type, record, version)


def encode_around(record_type: str, record: dict, field: str, encoded: bytes) -> bytes | None:
    """:meth:`SchemaRegistry.encode_around` with the default registry."""
    return DEFAULT.encode_around(record_type, record, field, encoded)


def decode(record_type: str, data: bytes) -> dict:
    """Decode with the default registry (``schemas/avro``); see :meth:`SchemaRegistry.decode`."""
    return DEFAULT.decode(record_type, data)
