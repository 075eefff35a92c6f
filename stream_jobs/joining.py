"""Trace join: spans that carry no rollout id join the rollout attempt of a proxy call of
their trace. Pure state logic (no Faust), like :mod:`spanrl.stream_jobs.assembly`.

An agent instrumented only by its framework's own OpenTelemetry instrumentation (an
OpenInference or OTel GenAI instrumentor with a plain TracerProvider, no spanrl
``rollout_context``) sends spans without ``spanrl.rollout_id``. Its HTTP client sends the W3C
``traceparent`` of the span a request is made in, and the LLM proxy records that trace id
(and the parent span id) on its span of the call, which it made under a per-rollout URL.
So the trace id names the rollout attempt, but only the proxy's record says which one.

Why in the stream app, not in the bridge: the bridge sees one OTLP request at a time and
holds no state, and the two halves arrive in no fixed order (the proxy produces its span
before it answers; the OTel SDK exports spans in batches once they end, the framework's
LLM span after the call, its agent span later still). Joining two streams by a key, with a
bounded wait, is a stream job, and the app already has exactly-once state and timeouts.

Plumbing (stream_jobs/app.py): the bridge writes such spans to ``orphan-spans`` keyed by
trace id (``rollout_id = attempt_id = ""``); the assembler, for every proxy call on
``spans`` that came with a trace parent, writes a trace link (:func:`trace_link`,
schemas/avro/trace_link.v1.avsc) to ``<app_id>-trace-links`` keyed by trace id. Both topics
have the same partition count, so the worker that owns a trace id gets both (Faust
co-partitioning); the joined spans it writes to ``spans`` (keyed by rollout id) in the same
transaction as its state and input offsets.

State of one trace id (plain JSON, a Faust table value)::

    {"trace_id", "partition",
     "attempts": [[rollout_id, attempt_id], ...],   # linked, least recently first
     "parents": {span_id: [rollout_id, attempt_id]}, # the spans proxy calls were made in
     "waiting": {span_id: {"since_ms", "offset"}},  # orphans with no attempt yet
     "settled": [span_id, ...],                     # joined or dead-lettered
     "last_ms"}

The waiting spans' records (bytes as read from ``orphan-spans``) live in a ``store``
(:func:`store_key`), as the assembler keeps call tokens apart from its state.

Rules (each orphan joins exactly one attempt, :func:`attempt_of`):
- an orphan that is the parent of a linked call (the span the request was made in: the
  framework's LLM span) joins that call's attempt;
- any other orphan of a trace with linked calls joins the attempt linked most recently
  (one trace is usually one agent run; a trace that outlives many rollouts, e.g. a service
  loop under one root span, then puts each span with the rollout of its time, never every
  span into every rollout);
- an orphan of a trace with none waits; the first link releases every waiting span, in
  arrival (offset) order;
- a span still waiting ``orphan_timeout_s`` after it arrived -> dead letter
  ``no_rollout_id`` (stage ``joiner``; payload: its ``orphan-spans`` record, source offset);
- a re-delivered orphan (same span id) changes nothing, nor does a link that tells nothing
  new (same attempt as the latest, same parent);
- ``attempts``, ``parents`` and ``settled`` keep their newest :data:`MAX_REMEMBERED` entries
  (a long trace stays small; ``settled`` only guards against re-delivery, which happens
  within a recovery window, and a re-joined span keeps its span id);
- a state with nothing waiting expires ``retain_s`` after its last input.

A joined span (:func:`joined_span`) is context, never a call: the proxy's record of the
same call, with its exact token ids, is the training data, so an OTel LLM span describing
it must not become a second transition (nor a ``missing_token_ids`` dead letter: the
assembler keeps an ``otlp`` span without ``llm`` as a link). It keeps its span id, so that
a re-emission after a crash is the same span to the assembler (counted once).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import MutableMapping

from spanrl.core import response_ids
from spanrl.core import dead_letters as dl
from spanrl.core.settings import StreamSettings
from spanrl.schemas import codec

#: attribute of a joined span: its rollout came from the trace join, not from the agent
JOINED_BY = "spanrl.joined_by"
#: attribute of a joined span whose orphan record was a claim (oversize): the full record
ORPHAN_PAYLOAD_REF = "spanrl.orphan_payload_ref"
#: newest entries kept of a trace's attempts, call parents and settled span ids
MAX_REMEMBERED = 256


@dataclass(frozen=True)
class JoinConfig:
    """orphan_timeout_s: how long an orphan waits for a link before ``no_rollout_id``: longer
    than the app may lag behind ``spans`` (a trace link is written when the assembler reads
    the proxy's span; after a restart that may be minutes, in its backlog; the join's own
    tick clock, stream_jobs/clock.py, only sees the join's inputs); orphan_topic: the topic
    orphans are read from (``source_topic`` of those dead letters)."""

    orphan_timeout_s: float = StreamSettings.default("orphan_timeout_s")
    orphan_topic: str = StreamSettings.default("orphan_spans_topic")


@dataclass
class JoinOutcome:
    """What an update produced: joined span records (for ``spans``, key rollout_id) and
    dead-letter records; ``changed``: the state must be written back."""

    spans: list[dict] = field(default_factory=list)
    dead_letters: list[dict] = field(default_factory=list)
    changed: bool = False


def valid_trace_id(trace_id: str | None) -> bool:
    """32 lower-case hex characters, not all zero (W3C Trace Context s3.2.2.3)."""
    return (isinstance(trace_id, str) and len(trace_id) == 32 and set(trace_id) != {"0"}
            and all(c in "0123456789abcdef" for c in trace_id))


def trace_link(span: dict, now_ms: int) -> dict | None:
    """The trace link (trace_link.v1) of a decoded span of ``spans``: for a proxy call that
    came with a trace context (``source == "proxy"`` and a parent span id: the proxy took
    both from the request's ``traceparent``; without one its trace id is random), else None."""
    if span.get("source") != "proxy" or not span.get("parent_span_id") or not valid_trace_id(span.get("trace_id")):
        return None
    return {"schema_version": 1, "trace_id": span["trace_id"], "rollout_id": span["rollout_id"],
            "attempt_id": span["attempt_id"], "span_id": span["span_id"],
            "parent_span_id": span["parent_span_id"], "timestamp_ms": int(now_ms)}


def new_state(trace_id: str, partition: int | None = None) -> dict:
    """Empty state of one trace id. ``partition``: the Kafka partition it lives on (app use)."""
    return {"trace_id": trace_id, "partition": partition, "attempts": [], "parents": {}, "waiting": {},
            "settled": [], "last_ms": None}


def attempt_of(state: dict, span_id: str) -> list[str] | None:
    """``[rollout_id, attempt_id]`` an orphan ``span_id`` of this trace joins: the attempt of
    the call it is the parent of, else the most recently linked attempt, else None (wait)."""
    return state["parents"].get(span_id) or (state["attempts"][-1] if state["attempts"] else None)


def _remember(items: list, item) -> None:
    """Append ``item`` (moved to the end if present), keeping the newest MAX_REMEMBERED."""
    if item in items:
        items.remove(item)
    items.append(item)
    del items[:-MAX_REMEMBERED]


def store_key(trace_id: str, span_id: str) -> str:
    """Key of one waiting span's record in the store."""
    return f"{trace_id}|{span_id}"


def joined_span(span: dict, rollout_id: str, attempt_id: str, response_id: str | None = None) -> dict:
    """The orphan ``span`` (decoded span.v1) as a span of attempt ``(rollout_id,
    attempt_id)``: those two set, everything else kept (span id, parent, agent name,
    attributes) but ``llm`` (context, never a call: module doc), plus attribute
    :data:`JOINED_BY` = ``"trace"``, or ``"response_id"`` for a span that named its attempt
    through a minted response id ``response_id`` (kept in ``response_ids.JOINED_RESPONSE_ID``: the
    assembler links the call of that id to this span, spanrl/core/response_ids.py). A claim record
    (``payload_ref``) becomes a plain
    small span with the reference in attribute :data:`ORPHAN_PAYLOAD_REF`: its identity
    fields, all a link needs, are in the small record, and the full record in MinIO stays
    the orphan's (its rollout id is empty, so it is not the joined span's claim)."""
    attributes = {**(span.get("attributes") or {}), JOINED_BY: "response_id" if response_id else "trace"}
    if response_id:
        attributes[response_ids.JOINED_RESPONSE_ID] = response_id
    if span.get("payload_ref"):
        attributes[ORPHAN_PAYLOAD_REF] = span["payload_ref"]
    return {**span, "rollout_id": rollout_id, "attempt_id": attempt_id, "attributes": attributes,
            "llm": None, "payload_ref": None}


def _touch(state: dict, now_ms: int) -> None:
    state["last_ms"] = now_ms if state["last_ms"] is None else max(state["last_ms"], now_ms)


def add_orphan(state: dict, span: dict, raw: bytes, offset: int | None, store: MutableMapping,
               now_ms: int, config: JoinConfig = JoinConfig()) -> JoinOutcome:
    """One span of ``orphan-spans`` (``span`` decoded, ``raw`` its record as read, at
    ``offset``): joined at once to its attempt (:func:`attempt_of`), or, while the trace
    has none, kept waiting in ``store``."""
    out = JoinOutcome()
    sid = span["span_id"]
    if sid in state["waiting"] or sid in state["settled"]:
        return out  # re-delivered
    response_id = response_ids.from_attributes(span.get("attributes"))
    named = response_ids.attempt_of(response_id)
    if named is not None:  # the framework's LLM span of a proxy call: it names its attempt itself
        known = state["parents"].get(sid)
        if known is not None and known != list(named):
            _touch(state, now_ms)
            _remember(state["settled"], sid)
            out.changed = True
            out.dead_letters.append(dl.dead_letter(
                dl.AMBIGUOUS_JOIN, dl.JOINER, now_ms, payload=raw, source_topic=config.orphan_topic,
                source_partition=state["partition"], source_offset=offset,
                detail=f"span {sid} of trace {state['trace_id']}: its response id names attempt "
                       f"{named[1]} of rollout {named[0]}, its traceparent links attempt {known[1]} of "
                       f"rollout {known[0]}; not joined to either"))
            return out
        out = add_link(state, {"rollout_id": named[0], "attempt_id": named[1], "parent_span_id": sid},
                       store, now_ms)
    _touch(state, now_ms)
    out.changed = True
    attempt = attempt_of(state, sid)
    if attempt is not None:
        out.spans.append(joined_span(span, *attempt, response_id=response_id))
        _remember(state["settled"], sid)
        return out
    state["waiting"][sid] = {"since_ms": int(now_ms), "offset": offset}
    store[store_key(state["trace_id"], sid)] = raw
    return out


def add_link(state: dict, link: dict, store: MutableMapping, now_ms: int) -> JoinOutcome:
    """One trace link (decoded trace_link.v1): its attempt becomes the most recent one and
    its call's parent span is remembered; every waiting span is released, in arrival order,
    to its attempt (:func:`attempt_of`)."""
    out = JoinOutcome()
    attempt, parent = [link["rollout_id"], link["attempt_id"]], link["parent_span_id"]
    if state["attempts"][-1:] == [attempt] and state["parents"].get(parent) == attempt:
        return out  # another call of the latest attempt in the same span, or a re-delivered link
    _touch(state, now_ms)
    out.changed = True
    _remember(state["attempts"], attempt)
    state["parents"].pop(parent, None)
    state["parents"][parent] = attempt  # dicts keep insertion order: the oldest go first
    for old in list(state["parents"])[:-MAX_REMEMBERED]:
        del state["parents"][old]
    for sid in sorted(state["waiting"], key=lambda s: (state["waiting"][s]["offset"] or 0, s)):
        raw = store.pop(store_key(state["trace_id"], sid))
        out.spans.append(joined_span(codec.decode("span", raw), *attempt_of(state, sid)))
        _remember(state["settled"], sid)
    state["waiting"] = {}
    return out


def advance(state: dict, store: MutableMapping, config: JoinConfig, now_ms: int) -> JoinOutcome:
    """Dead-letter ``no_rollout_id`` every span that waited ``orphan_timeout_s`` or more at
    ``now_ms`` (in arrival order), with its record as payload. Call periodically."""
    out = JoinOutcome()
    tid = state["trace_id"]
    due = sorted((sid for sid, w in state["waiting"].items()
                  if now_ms - w["since_ms"] >= config.orphan_timeout_s * 1000),
                 key=lambda s: (state["waiting"][s]["offset"] or 0, s))
    for sid in due:
        w = state["waiting"].pop(sid)
        out.dead_letters.append(dl.dead_letter(
            dl.NO_ROLLOUT_ID, dl.JOINER, now_ms, payload=store.pop(store_key(tid, sid), None),
            source_topic=config.orphan_topic, source_partition=state["partition"], source_offset=w["offset"],
            detail=f"span {sid} of trace {tid} has no spanrl.rollout_id, and no LLM proxy call of its trace "
                   f"came within {config.orphan_timeout_s:g}s (a call joins a trace when its HTTP request "
                   f"carries the W3C traceparent)"))
        _remember(state["settled"], sid)
        out.changed = True
    return out


def expired(state: dict, now_ms: int, retain_s: float) -> bool:
    """True when nothing waits and the last input came ``retain_s`` ago or more: the state
    can be deleted (a later orphan of the trace then waits for a link again)."""
    return not state["waiting"] and state["last_ms"] is not None and now_ms - state["last_ms"] >= retain_s * 1000
