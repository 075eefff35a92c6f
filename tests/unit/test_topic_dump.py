"""Topic dumps (spanrl/infra/topic_dump.py) and the archived log committed as a fixture:
tests/fixtures/archived/topic_dump.jsonl, two rollouts of one task as Kafka records written
with the framing (0x53 + 2-byte version) and schema versions before the Confluent wire
format (span v1, reward v1, rollout v1), read by today's decoder."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from spanrl.infra.topic_dump import DumpRecord, parse_dump, shifted
from spanrl.schemas import codec, decode
from spanrl.schemas import topics as T

ARCHIVE = Path(__file__).parents[1] / "fixtures" / "archived" / "topic_dump.jsonl"


def test_the_archived_log_is_in_the_old_framing_and_decodes():
    records = parse_dump(ARCHIVE.read_text())
    assert [(r.topic, r.key, r.timestamp_ms) for r in records] == [
        ("rollouts", b"r-archive-0", 1764547200000), ("spans", b"r-archive-0", 1764547200600),
        ("rewards", b"r-archive-0", 1764547200700), ("rollouts", b"r-archive-0", 1764547200800),
        ("rollouts", b"r-archive-1", 1764547210000), ("spans", b"r-archive-1", 1764547210600),
        ("rewards", b"r-archive-1", 1764547210700), ("rollouts", b"r-archive-1", 1764547210800)]
    assert all(r.headers == () for r in records)
    assert {r.value[:3] for r in records} == {bytes([codec.LEGACY_MAGIC, 0, 1])}  # every one v1, framed 0x53
    by_topic = {t.name: t for t in T.TRAINING_INPUTS}
    decoded = [decode(by_topic[r.topic].record, r.value) for r in records]
    assert [(d["rollout_id"], d.get("status")) for d in decoded if "status" in d] == [
        ("r-archive-0", "started"), ("r-archive-0", "succeeded"), ("r-archive-1", "started"),
        ("r-archive-1", "succeeded")]
    assert {d["task_id"] for d in decoded if "task_id" in d} == {"t-archive"}
    assert [d["value"] for d in decoded if "value" in d] == [1.0, 0.0]
    spans = [d for d in decoded if "llm" in d]
    assert [s["llm"]["completion_token_ids"] for s in spans] == [[36, 2], [37, 2]]  # "4<|im_end|>", "5<|im_end|>"
    assert len(spans[0]["llm"]["prompt_token_ids"]) == 42 and spans[0]["llm"]["tokenizer"] is None  # span v2 default
    assert all(s["llm"]["policy_version"] == 0 and s["schema_version"] == 1 for s in spans)


def test_a_record_round_trips_through_a_line():
    r = DumpRecord("spans", b"k", b"\x00\x01", 5, (("h", b"\xff"),))
    assert r.line() == '{"topic": "spans", "key": "k", "timestamp_ms": 5, "headers": [["h", "ff"]], "value_hex": "0001"}'
    assert parse_dump(r.line() + "\n\n" + DumpRecord("x", None, b"", 0).line()) == [r, DumpRecord("x", None, b"", 0)]


@pytest.mark.parametrize("line,error", [
    ('{"topic": "spans", "key": "k", "timestamp_ms": 5}', "dump line 1: KeyError: 'value_hex'"),
    ('{"topic": "", "key": "k", "timestamp_ms": 5, "value_hex": ""}', "dump line 1: ValueError: topic must be"),
    ('{"topic": "s", "key": "k", "timestamp_ms": -1, "value_hex": ""}', "dump line 1: ValueError: topic must be"),
    ('{"topic": "s", "key": 3, "timestamp_ms": 1, "value_hex": ""}', "dump line 1: ValueError: topic must be"),
    ('{"topic": "s", "key": "k", "timestamp_ms": 1, "value_hex": "zz"}', "dump line 1: ValueError: non-hexadecimal"),
    ("not json", "dump line 1: JSONDecodeError"),
])
def test_malformed_lines_are_refused_with_the_line(line, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        parse_dump(line)


def test_shifted_keeps_order_and_spacing():
    records = [DumpRecord("a", None, b"", 100), DumpRecord("b", None, b"", 250), DumpRecord("c", None, b"", 175)]
    assert [r.timestamp_ms for r in shifted(records, 10_000)] == [9_850, 10_000, 9_925]
    assert shifted([], 5) == []
