"""Dead-letter reason codes of the stream jobs and the record builder.

A dead-letter record (schemas/avro/dead_letter.v1.avsc) says what could not be used
and why; nothing is dropped silently.
"""
from __future__ import annotations

# --- assembler (stage "assembler") ---
SCHEMA_ERROR = "schema_error"                  # input bytes did not decode
CLAIM_UNRESOLVED = "claim_unresolved"          # span's payload_ref: object missing, wrong sha256 or span
OVERSIZE = "oversize"                          # call/transition too large for its topic
MISSING_TOKEN_IDS = "missing_token_ids"        # llm span without `llm` or with no completion ids
LOGPROBS_MISMATCH = "logprobs_mismatch"        # completion_logprobs not one per completion token
INVALID_REWARD = "invalid_reward"              # reward value NaN or infinite
NO_LLM_CALLS = "no_llm_calls"                  # ended rollout with a reward but no selected call
NO_REWARD_BEFORE_TIMEOUT = "no_reward_before_timeout"   # succeeded, no final reward in time
ROLLOUT_FAILED_NO_REWARD = "rollout_failed_no_reward"   # failed/timeout, no final reward in time
NO_REWARD_BEFORE_WINDOW = "no_reward_before_window"     # parked attempt, no final reward within the reward window
LATE_SPANS_MISSING = "late_spans_missing"      # late final reward, but a parked call's span could not be re-read
SPANS_MISSING = "spans_missing"                # a call's token data left with a stopped worker and its span could not be re-read
ROLLOUT_TIMEOUT = "rollout_timeout"            # no terminal lifecycle event in time
UNKNOWN_ROLLOUT = "unknown_rollout"            # timed out having seen no lifecycle event and no llm call
LATE_SPAN = "late_span"                        # llm call of an attempt already emitted/dead-lettered
LATE_REWARD = "late_reward"                    # reward for an attempt already emitted/dead-lettered
# --- joiner (stage "joiner") ---
NO_ROLLOUT_ID = "no_rollout_id"                # orphan span: no proxy call of its trace in time
AMBIGUOUS_JOIN = "ambiguous_join"              # orphan span whose response id and traceparent name different attempts
# --- grouper (stage "grouper") ---
GROUP_INCOMPLETE = "group_incomplete"          # rollout still incomplete when its group closed
SUPERSEDED_ATTEMPT = "superseded_attempt"      # another attempt of the same rollout is in the group
GROUP_CLOSED = "group_closed"                  # transition of a rollout whose group already closed
TRANSITIONS_MISSING = "transitions_missing"    # a waiting transition left with a stopped worker and could not be re-read
# --- trainer (stage "trainer") ---
STALE_SAMPLE = "stale_sample"                  # behaviour version lags the trained one by > max_staleness

ASSEMBLER = "assembler"
GROUPER = "grouper"
JOINER = "joiner"
TRAINER = "trainer"


def dead_letter(
    reason: str,
    stage: str,
    now_ms: int,
    *,
    detail: str = "",
    rollout_id: str | None = None,
    task_id: str | None = None,
    payload: bytes | None = None,
    source_topic: str | None = None,
    source_partition: int | None = None,
    source_offset: int | None = None,
) -> dict:
    """A DeadLetter record dict (schemas/avro/dead_letter.v1.avsc)."""
    return {
        "schema_version": 1,
        "reason": reason,
        "detail": detail,
        "stage": stage,
        "source_topic": source_topic,
        "source_partition": source_partition,
        "source_offset": source_offset,
        "rollout_id": rollout_id,
        "task_id": task_id,
        "payload": payload,
        "timestamp_ms": int(now_ms),
    }
