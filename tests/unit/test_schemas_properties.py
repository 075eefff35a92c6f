"""Property tests of the Avro codec (spanrl.schemas.codec) with records drawn from the schemas.

For any record of a schema's shape: ``encode`` then ``decode`` gives the record back
(``float`` fields as float32, Avro 1.11 spec "Primitive Types"), or ``encode`` raises
``SchemaError`` with a reason; never another exception. For any bytes, ``decode`` returns
a record or raises ``SchemaError``.

Not drawn: numbers of the wrong kind inside arrays and maps (e.g. 1.5 or 2**40 in
``prompt_token_ids``): fastavro truncates them and the codec checks scalars only, to keep
long token id lists cheap; producers put ints there themselves.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spanrl.schemas import codec

TYPES = ("span", "reward", "transition")
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
#: values of the wrong kind for most fields (None: the field is left out)
WRONG = {
    "missing": None,
    "lone_surrogate": st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2),  # no UTF-8 for it
    "int_over_32_bits": st.integers(min_value=2**31, max_value=2**80),
    "int_under_32_bits": st.integers(min_value=-(2**80), max_value=-(2**31) - 1),
    "fraction": st.floats(width=64).filter(lambda x: not x.is_integer()),
    "float": st.floats(width=64), "bool": st.booleans(), "text": st.text(max_size=3), "none": st.none(),
    "bytes": st.binary(max_size=4), "list": st.lists(st.integers(), max_size=2),
    "dict": st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
}
RANGE = {"int": (-(2**31), 2**31 - 1), "long": (-(2**63), 2**63 - 1)}
UNREADABLE = object()  # expected() of a value the field cannot hold: equal to nothing decoded
#: Avro full name -> the newest schema version of that record type (what encode writes)
VERSIONS = {name: codec.latest_version(record_type) for record_type, name in codec.RECORD_NAMES.items()}
FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def schema(record_type: str) -> dict:
    return codec.DEFAULT.versions(record_type)[codec.latest_version(record_type)]


def values(avro) -> st.SearchStrategy:
    """Values of the Avro type ``avro`` (a parsed fastavro schema): any text but lone
    surrogates, ints over the whole int/long range, any floats (NaN, inf, huge)."""
    if isinstance(avro, list):  # union, e.g. ["null", "string"]
        return st.one_of([values(t) for t in avro])
    if isinstance(avro, dict):
        kind = avro["type"]
        if kind == "record":
            return st.fixed_dictionaries({f["name"]: values(f["type"]) for f in avro["fields"]
                                          if f["name"] != "schema_version"})
        if kind == "array":
            return st.lists(values(avro["items"]), max_size=4)
        if kind == "map":
            return st.dictionaries(st.text(max_size=8), values(avro["values"]), max_size=3)
        return values(kind)
    return {
        "null": st.none(), "boolean": st.booleans(), "string": st.text(max_size=12), "int": INT32,
        "long": INT64, "float": st.floats(width=64), "double": st.floats(width=64),
    }[avro]


def broken_records(record_type: str, kind: str) -> st.SearchStrategy:
    """Records of ``record_type`` with one field (top level or in ``llm``) replaced by a
    ``WRONG[kind]`` value, or left out (a defaulted field then comes back as its default)."""
    sch = schema(record_type)

    @st.composite
    def broken(draw):
        rec = dict(draw(values(sch)))
        target, fields = rec, sch["fields"]
        if rec.get("llm") is not None and draw(st.booleans()):
            rec["llm"] = target = dict(rec["llm"])
            [llm] = [t for t in next(f for f in fields if f["name"] == "llm")["type"] if t != "null"]
            fields = llm["fields"]
        name = draw(st.sampled_from([f["name"] for f in fields if f["name"] != "schema_version"]))
        if WRONG[kind] is None:
            del target[name]
        else:
            target[name] = draw(WRONG[kind])
        return rec

    return broken()


def expected(avro, value):
    """What should come back for ``value`` written as ``avro`` (float fields as float32)."""
    if isinstance(avro, list):
        if value is None:
            return None
        [avro] = [t for t in avro if t != "null"]
    if isinstance(avro, dict):
        kind = avro["type"]
        if kind == "record":  # a missing field comes back as its default; the version is the writer's (newest)
            version = VERSIONS.get(avro.get("name"), 1)
            return {f["name"]: version if f["name"] == "schema_version" else expected(f["type"], value.get(f["name"], f.get("default")))
                    for f in avro["fields"]}
        if kind == "array":
            return [expected(avro["items"], v) for v in value] if isinstance(value, list) else UNREADABLE
        if kind == "map":
            return {k: expected(avro["values"], v) for k, v in value.items()} if isinstance(value, dict) else UNREADABLE
        avro = kind
    if avro == "float":
        with np.errstate(over="ignore"):
            return float(np.float32(value))
    if avro == "double":
        return float(value)
    if avro in RANGE:  # 3.0 reads back as 3; 1.5 or 2**40 in an int has nothing to read back
        lo, hi = RANGE[avro]
        if isinstance(value, float) and not value.is_integer() or not lo <= value <= hi:
            return UNREADABLE
        return int(value)
    if avro == "boolean" and not isinstance(value, bool):
        return UNREADABLE
    return value


def same(a, b) -> bool:
    """Equality where NaN equals NaN and types must match (1 is not True, 1.0 is not 1)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return type(a) is type(b) and a == b


def _round_trip_or_schema_error(record_type: str, record: dict) -> None:
    try:
        data = codec.encode(record_type, record)
    except codec.SchemaError as exc:
        assert exc.reason == "schema_error" and exc.detail
        return
    back = codec.decode(record_type, data)
    want = {**expected(schema(record_type), record), "schema_version": codec.latest_version(record_type)}
    assert same(want, back), (want, back)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
@pytest.mark.parametrize("kind", sorted(WRONG))
@pytest.mark.parametrize("record_type", TYPES)
def test_broken_records_round_trip_or_schema_error(record_type, kind, data):
    _round_trip_or_schema_error(record_type, data.draw(broken_records(record_type, kind)))


@FAST
@given(st.data())
@pytest.mark.parametrize("record_type", TYPES)
def test_well_formed_records_round_trip(record_type, data):
    """Records of the schema's shape with nothing WRONG in them always encode."""
    sch = schema(record_type)
    record = data.draw(values(sch))
    back = codec.decode(record_type, codec.encode(record_type, record))
    assert same({**expected(sch, record), "schema_version": codec.latest_version(record_type)}, back)


@FAST
@given(st.data())
@pytest.mark.parametrize("record_type", TYPES)
def test_any_bytes_decode_or_schema_error(record_type, data):
    header = bytes([codec.MAGIC]) + codec.DEFAULT.schema_id(record_type, 1).to_bytes(4, "big")
    legacy = bytes([codec.LEGACY_MAGIC, 0, 1])
    raw = data.draw(st.binary(max_size=64) | st.binary(max_size=64).map(lambda b: header + b)
                    | st.binary(max_size=64).map(lambda b: legacy + b))
    try:
        codec.decode(record_type, raw)
    except codec.SchemaError as exc:
        assert exc.reason == "schema_error"


@FAST
@given(st.data())
@pytest.mark.parametrize("record_type", TYPES)
def test_corrupted_encodings_decode_or_schema_error(record_type, data):
    """A valid encoding with bytes flipped, cut or appended: a record or SchemaError."""
    good = codec.encode(record_type, data.draw(values(schema(record_type))))
    raw = bytearray(good)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    raw = raw[:cut] + data.draw(st.binary(max_size=4))
    try:
        codec.decode(record_type, bytes(raw))
    except codec.SchemaError as exc:
        assert exc.reason == "schema_error"
