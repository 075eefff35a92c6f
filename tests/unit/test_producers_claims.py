"""Claim-check pure parts (spanrl/core/claims.py): keys, references, small records, checks."""
import asyncio

import pytest

from spanrl.core import claims
from spanrl.schemas import codec
from spanrl.schemas.topics import Topic

SHA_ABC = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # sha256(b"abc")


def span(**over):
    return {"rollout_id": "r/1 x", "attempt_id": "a0", "sequence_id": 4, "trace_id": "t" * 32,
            "span_id": "s1", "parent_span_id": "p1", "name": "chat", "kind": "llm", "source": "proxy",
            "start_time_unix_nano": 10, "end_time_unix_nano": 20, "status_code": "OK",
            "agent_name": "solver", "attributes": {"big": "x" * 100},
            "llm": {"model": "policy", "policy_version": 2, "prompt_token_ids": [1, 2],
                    "completion_token_ids": [3], "completion_logprobs": [-0.5], "request_id": "q"},
            "payload_ref": None, **over}


def test_content_key_is_topic_quoted_rollout_and_sha256():
    assert claims.content_key("spans", "r/1 x", b"abc") == f"spans/r%2F1%20x/{SHA_ABC}.avro"
    assert claims.content_key("spans", "r/1 x", b"abc") == claims.content_key("spans", "r/1 x", b"abc")
    assert claims.content_key("spans", "r/1 x", b"abd") != claims.content_key("spans", "r/1 x", b"abc")


def test_parse_ref():
    ref = f"s3://spanrl-payloads/spans/r%2F1/{SHA_ABC}.avro"
    c = claims.parse_ref(ref, "spanrl-payloads")
    assert c == claims.Claim("spanrl-payloads", f"spans/r%2F1/{SHA_ABC}.avro", SHA_ABC)
    assert c.ref == ref
    for bad in ("", "s3://b/spans/r/abc.avro", f"http://b/spans/r/{SHA_ABC}.avro",
                f"s3://b/{SHA_ABC}.avro", f"s3://b/spans/r/{SHA_ABC}.json"):
        with pytest.raises(claims.ClaimError):
            claims.parse_ref(bad)
    with pytest.raises(claims.ClaimError, match="expected 'spanrl-payloads'"):
        claims.parse_ref(f"s3://spanrl-checkpoints/spans/r/{SHA_ABC}.avro", "spanrl-payloads")


def test_fits_leaves_the_margin():
    limit = 1_000_000
    assert claims.fits(limit - claims.CLAIM_MARGIN_BYTES, limit)
    assert not claims.fits(limit - claims.CLAIM_MARGIN_BYTES + 1, limit)


def test_claim_span_keeps_identity_only_and_encodes():
    small = claims.claim_span(span(), "s3://b/k")
    assert small == {**span(), "attributes": {}, "llm": None, "payload_ref": "s3://b/k"}
    assert codec.decode("span", codec.encode("span", small))["payload_ref"] == "s3://b/k"


def test_verify_and_check_claimed():
    c = claims.Claim("b", f"spans/r/{SHA_ABC}.avro", SHA_ABC)
    assert claims.verify(c, b"abc") == b"abc"
    with pytest.raises(claims.ClaimError, match="sha256 mismatch"):
        claims.verify(c, b"abd")
    full = span()
    small = claims.claim_span(full, "s3://b/k")
    assert claims.check_claimed(small, full) is full
    with pytest.raises(claims.ClaimError, match="span_id"):
        claims.check_claimed(small, span(span_id="other"))
    assert claims.ClaimError("x").reason == "claim_unresolved"


class FakeStore:
    """Records put_object calls (the MinIO side is covered by the integration test)."""

    def __init__(self):
        self.objects = {}

    def put_object(self, bucket, key, data, length, content_type):
        self.objects[(bucket, key)] = data.read(length)


def test_check_in_small_record_passes_large_record_is_claimed():
    topic = Topic("spans", "rollout_id", "span", 4, max_message_bytes=claims.CLAIM_MARGIN_BYTES + 1000)
    store = FakeStore()
    small_value = codec.encode("span", span())
    assert asyncio.run(claims.check_in(store, "bkt", topic, "r/1 x", span(), small_value)) is small_value
    assert store.objects == {}
    big = span(attributes={"big": "x" * 2000})
    value = codec.encode("span", big)
    out = asyncio.run(claims.check_in(store, "bkt", topic, "r/1 x", big, value))
    key = claims.content_key("spans", "r/1 x", value)
    assert store.objects == {("bkt", key): value}
    assert codec.decode("span", out) == {**claims.claim_span(big, f"s3://bkt/{key}"), "schema_version": 2}
    assert claims.fits(len(out), topic.max_message_bytes)


def test_put_claim_store_error_is_unavailable():
    class Down:
        def put_object(self, *a, **k):
            raise ConnectionRefusedError("no minio")

    with pytest.raises(claims.ClaimStoreUnavailable, match="no minio"):
        asyncio.run(claims.put_claim(Down(), "b", "spans", "r", b"abc"))
