"""Avro codec: round trips for every record type, schema errors, backward compatibility."""
import json
import math
import shutil

import pytest

from spanrl.schemas import codec
from spanrl.schemas.codec import SchemaError, SchemaRegistry, decode, encode
from spanrl.schemas import topics as T

TRANSITION = {
    "rollout_id": "r1", "attempt_id": "0", "span_id": "ab" * 8, "task_id": "t1", "group_size": 4,
    "sequence_id": 3, "call_index": 1, "rollout_transition_count": 2, "agent_name": "math-agent",
    "model": "policy", "policy_version": 2, "prompt_token_ids": [1, 2, 3], "completion_token_ids": [4, 5],
    "behaviour_logprobs": [-0.5, -1.25], "episode_return": 1.0, "reward": 1.0, "credit_rule": "identical",
    "status": "succeeded",
}

RECORDS = {
    "span": {
        "rollout_id": "r1", "attempt_id": "0", "sequence_id": 0, "trace_id": "0" * 32, "span_id": "1" * 16,
        "parent_span_id": None, "name": "chat.completions", "kind": "llm", "source": "proxy",
        "start_time_unix_nano": 1, "end_time_unix_nano": 2, "status_code": "OK", "agent_name": "a",
        "attributes": {"gen_ai.request.model": "policy"},
        "llm": {"model": "policy", "policy_version": 0, "prompt_token_ids": [1, 2], "completion_token_ids": [3],
                "completion_logprobs": [-0.25], "temperature": 1.0, "top_p": 1.0, "max_tokens": 16,
                "finish_reason": "stop", "request_id": "req-1"},
        "payload_ref": None,
    },
    "reward": {"rollout_id": "r1", "attempt_id": "0", "value": 0.9, "final": True, "name": "reward",
               "span_id": None, "timestamp_ms": 5, "components": {"correct": 1.0, "format": 0.0}},
    "rollout": {"rollout_id": "r1", "attempt_id": "0", "task_id": "t1", "status": "succeeded", "group_size": 4,
                "runner_id": "w", "timestamp_ms": 7, "error": None},
    "task": {"task_id": "t1", "payload": json.dumps({"q": "1+1"}), "group_size": 4, "timeout_s": 30.0,
             "created_ms": 1},
    "transition": TRANSITION,
    "sample": {"transition": TRANSITION, "advantage": 0.5, "group_id": "t1/0", "group_rollouts": 4,
               "group_mean": 0.5, "group_std": 0.5},
    "checkpoint": {"run": "default", "version": 1, "uri": "s3://b/default/000001/", "step": 1,
                   "parent_version": 0, "manifest_sha256": "f" * 64, "created_ms": 9, "metrics": {"loss": 0.1}},
    "dead_letter": {"reason": "schema_error", "detail": "x", "stage": "assembler", "source_topic": "spans",
                    "source_partition": 0, "source_offset": 12, "rollout_id": None, "task_id": None,
                    "payload": b"\x00\x01", "timestamp_ms": 3},
    "trace_link": {"trace_id": "9d" * 16, "rollout_id": "r1", "attempt_id": "0", "span_id": "2" * 16,
                   "parent_span_id": "3" * 16, "timestamp_ms": 11},
}


def _close(a, b):
    """Equality with float32 tolerance (Avro 'float' fields)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return math.isclose(a, b, rel_tol=1e-6)
    return a == b


#: record types whose newest schema is past v1, and the fields that version added (with defaults)
LATE_DEFAULTS = {"reward_delay_ms": None, "late_reward": False}
AIR_DEFAULTS = {"intermediate_reward": 0.0, "air_rules": ""}
#: span v2: the call's content and tokenizer identity, inside ``llm``
LLM_V2_DEFAULTS = {"input_messages": None, "output_messages": None, "request": None, "tokenizer": None,
                   "tokenizer_sha256": None}
NEWER = {"span": (2, {}), "checkpoint": (2, {"event": "published", "detail": None}),
         "transition": (2, {**AIR_DEFAULTS, **LATE_DEFAULTS}), "sample": (2, {}),
         "rollout": (2, {"inputs_acked": False})}


@pytest.mark.parametrize("record_type", sorted(RECORDS))
def test_round_trip(record_type):
    data = encode(record_type, RECORDS[record_type])
    version, added = NEWER.get(record_type, (1, {}))
    assert data[:5] == bytes([codec.MAGIC]) + codec.DEFAULT.schema_id(record_type, version).to_bytes(4, "big")
    back = decode(record_type, data)
    assert back["schema_version"] == version
    back.pop("schema_version")
    expected = {**RECORDS[record_type], **added}
    if record_type == "sample":
        back["transition"].pop("schema_version")  # the embedded record's own field
        expected["transition"] = {**TRANSITION, **NEWER["transition"][1]}
    if record_type == "span":
        expected["llm"] = {**expected["llm"], **LLM_V2_DEFAULTS}
    assert _close(expected, back)


def _v1_registry(tmp_path) -> SchemaRegistry:
    """The schemas as they were before any v2 of the record types (what old data was written with)."""
    for f in codec.AVRO_DIR.glob("*.v1.avsc"):
        shutil.copy(f, tmp_path / f.name)
    return SchemaRegistry(tmp_path)


def test_v1_transitions_and_samples_read_with_late_reward_defaults(tmp_path):
    """Transitions and samples written before late rewards (v1, a sample holding a v1
    transition) read as on time with an unknown delay; a v1 writer schema stays v1 inside."""
    old = _v1_registry(tmp_path)
    tr = decode("transition", old.encode("transition", TRANSITION))
    assert (tr["schema_version"], tr["reward_delay_ms"], tr["late_reward"]) == (1, None, False)
    assert _close({**TRANSITION, **LATE_DEFAULTS, **AIR_DEFAULTS},
                  {k: v for k, v in tr.items() if k != "schema_version"})
    old_sample = old.encode("sample", RECORDS["sample"])
    assert old_sample == encode("sample", RECORDS["sample"], version=1)  # sample v1 keeps transition v1
    back = decode("sample", old_sample)
    assert back["schema_version"] == 1 and back["advantage"] == 0.5
    assert (back["transition"]["reward_delay_ms"], back["transition"]["late_reward"]) == (None, False)
    assert back["transition"]["completion_token_ids"] == [4, 5]
    late = decode("sample", encode("sample", {**RECORDS["sample"], "transition": {
        **TRANSITION, "reward_delay_ms": 7_200_000, "late_reward": True}}))
    assert (late["schema_version"], late["transition"]["reward_delay_ms"], late["transition"]["late_reward"]) == (
        2, 7_200_000, True)


def test_v1_transitions_and_samples_read_with_air_defaults():
    """Records written before AIR (transition v1, sample v1 embedding transition v1) decode
    into v2 with intermediate_reward 0 and no AIR rules; a v2 record keeps its values."""
    old_t = encode("transition", TRANSITION, version=1)
    assert old_t[:5] == b"\x00\x00\x00\x00\x07"  # Confluent framing, transition v1 = schema id 7
    back = decode("transition", old_t)
    assert (back["intermediate_reward"], back["air_rules"], back["schema_version"]) == (0.0, "", 1)
    old_s = encode("sample", RECORDS["sample"], version=1)
    back = decode("sample", old_s)
    assert back["schema_version"] == 1 and back["advantage"] == 0.5
    assert (back["transition"]["intermediate_reward"], back["transition"]["air_rules"]) == (0.0, "")
    assert back["transition"]["episode_return"] == 1.0 and back["transition"]["completion_token_ids"] == [4, 5]
    air = {**TRANSITION, "reward": 0.9, "intermediate_reward": -0.1, "air_rules": "tool_error:-0.1"}
    got = decode("sample", encode("sample", {**RECORDS["sample"], "transition": air}))["transition"]
    assert (got["reward"], got["intermediate_reward"], got["air_rules"]) == (0.9, -0.1, "tool_error:-0.1")


def test_checkpoint_v1_records_read_as_published():
    """Announcements written before the release gate (v1) read as event=published."""
    old = encode("checkpoint", RECORDS["checkpoint"], version=1)
    assert old[:5] == b"\x00\x00\x00\x00\x0b"  # checkpoint v1 = schema id 11
    back = decode("checkpoint", old)
    assert back["event"] == "published" and back["detail"] is None and back["schema_version"] == 1
    gate = decode("checkpoint", encode("checkpoint", {**RECORDS["checkpoint"], "event": "refused", "detail": "{}"}))
    assert (gate["event"], gate["detail"], gate["schema_version"]) == ("refused", "{}", 2)


def test_every_topic_names_a_known_record():
    for topic in T.ALL:
        assert topic.record in codec.RECORD_NAMES
        assert topic.config()["compression.type"] == "zstd"
    assert len({t.name for t in T.ALL}) == len(T.ALL)


def test_missing_required_field_is_schema_error():
    bad = dict(RECORDS["reward"])
    del bad["rollout_id"]
    with pytest.raises(SchemaError) as err:
        encode("reward", bad)
    assert err.value.reason == "schema_error"


@pytest.mark.parametrize("data", [b"", b"S", b"X\x00\x01abc", b"S\x00\x09abc", b"S\x00\x01\xff\xff\xff\xff\xff\xff",
                                  b"\x00", b"\x00\x00\x00\x03", b"\x00\x00\x00\x00\x63abc", b"\x00\x00\x00\x00\x01abc",
                                  b"\x00\x00\x00\x00\x03\xff\xff\xff\xff\xff\xff"])
def test_corrupt_bytes_are_schema_errors(data):
    with pytest.raises(SchemaError):
        decode("reward", data)


def test_trailing_bytes_rejected():
    with pytest.raises(SchemaError, match="trailing"):
        decode("reward", encode("reward", RECORDS["reward"]) + b"\x00")


def test_old_data_reads_with_a_newer_schema(tmp_path):
    """Backward compatibility: a v2 that adds a defaulted field still reads v1 records."""
    for f in codec.AVRO_DIR.glob("*.avsc"):
        shutil.copy(f, tmp_path / f.name)
    v2 = json.loads((tmp_path / "reward.v1.avsc").read_text())
    v2["fields"].append({"name": "evaluator", "type": "string", "default": "unknown"})
    (tmp_path / "reward.v2.avsc").write_text(json.dumps(v2))
    ids = json.loads((codec.AVRO_DIR / codec.IDS_FILE).read_text())
    (tmp_path / codec.IDS_FILE).write_text(json.dumps({**ids, "reward.v2": max(ids.values()) + 1}))
    old = SchemaRegistry(codec.AVRO_DIR).encode("reward", RECORDS["reward"])
    new_registry = SchemaRegistry(tmp_path)
    back = new_registry.decode("reward", old)
    assert back["evaluator"] == "unknown" and back["value"] == 0.9 and back["schema_version"] == 1
    assert new_registry.decode("reward", new_registry.encode("reward", {**RECORDS["reward"], "evaluator": "e"}))["evaluator"] == "e"


@pytest.mark.parametrize("record_type,field,value,detail", [
    ("reward", "final", None, "reward.final: boolean field got NoneType None"),      # fastavro: false
    ("reward", "final", "no", "reward.final: boolean field got str 'no'"),           # fastavro: true
    ("transition", "group_size", 2.5, "transition.group_size: int field got the non-integer 2.5"),  # 2
    ("transition", "group_size", 2**31, "transition.group_size: 2147483648 out of the int range"),
    ("transition", "sequence_id", -(2**63) - 1, "transition.sequence_id: -9223372036854775809 out of the long range"),
    ("transition", "prompt_token_ids", [1, 2**31], "transition.prompt_token_ids: an item is out of the int range"),
    ("transition", "prompt_token_ids", "", "transition.prompt_token_ids: array field got str"),  # fastavro: []
    ("reward", "components", [], "reward.components: map field got list"),                    # fastavro: {}
])
def test_encode_refuses_what_fastavro_would_write_changed(record_type, field, value, detail):
    base = TRANSITION if record_type == "transition" else RECORDS[record_type]
    with pytest.raises(SchemaError) as err:
        encode(record_type, {**base, field: value})
    assert (err.value.reason, err.value.detail) == ("schema_error", detail)


def test_encode_takes_integral_numbers_of_other_types():
    import numpy as np

    rec = {**TRANSITION, "group_size": np.int64(4), "call_index": 1.0, "prompt_token_ids": np.array([7, 8])}
    back = decode("transition", encode("transition", rec))
    assert (back["group_size"], back["call_index"], back["prompt_token_ids"]) == (4, 1, [7, 8])


def test_encode_around_writes_what_encode_writes_without_decoding_the_nested_record():
    from spanrl.schemas import codec as c

    t = {"rollout_id": "r", "attempt_id": "0", "span_id": "s", "task_id": "t", "group_size": 4, "sequence_id": 1,
         "call_index": 0, "rollout_transition_count": 5, "agent_name": None, "model": "m", "policy_version": 3,
         "prompt_token_ids": list(range(512)), "completion_token_ids": [7, 0, 9], "behaviour_logprobs": [-0.5, 0.0, -1.25],
         "episode_return": 1.0, "reward": 0.5, "credit_rule": "identical", "status": "succeeded",
         "late_reward": True, "reward_delay_ms": 42, "intermediate_reward": -0.1, "air_rules": "tool_error:-0.1"}
    rest = {"advantage": -0.75, "group_id": "t/3", "group_rollouts": 8, "group_mean": 0.25, "group_std": 0.5}
    record = c.encode("transition", t)
    assert c.encode_around("sample", rest, "transition", record) == c.encode("sample", {**rest, "transition": t})
    # a transition of another version than the sample embeds: not around it (decode + encode instead)
    v1 = {k: v for k, v in t.items() if k not in ("late_reward", "reward_delay_ms", "intermediate_reward", "air_rules")}
    assert c.encode_around("sample", rest, "transition", c.encode("transition", v1, version=1)) is None
    assert c.encode_around("sample", rest, "transition", b"") is None
    with pytest.raises(c.SchemaError):
        c.encode_around("sample", {**rest, "group_rollouts": 1.5}, "transition", record)  # checked as encode does
    with pytest.raises(c.SchemaError):
        c.encode_around("sample", rest, "advantage", record)  # not a nested record
