"""Rollout assembly: spans + rewards + lifecycle events of one rollout -> transitions.

Pure state logic (no Faust). One state dict per ``rollout_id``, plain JSON so it can
live in a Faust table; the bulky token ids of usable LLM calls live in a separate
``store`` mapping (a dict: in the app, the worker's memory, with no changelog) so that a
table update does not rewrite every call's tokens. A store value is compact bytes
(:func:`encode_call`: int32 token ids, float32 log-probs), written once per call. Each
call in the state keeps its span's position (``at``), so the store can always be rebuilt
from the spans topic: an attempt that could end now but lacks token data (the worker that
consumed its calls stopped, or lost the partition to a rebalance) is listed by
:func:`missing_reads`, the app re-reads those spans into the store and then advances; a
call that cannot be read back ends its attempt ``spans_missing``.

An attempt (``attempt_id``) of a rollout is assembled on its own. Inputs may arrive in
any order. An attempt ends, exactly once, in one of:

- **emitted**: it has a terminal lifecycle status (succeeded | failed | timeout) AND a
  final reward R, AND its inputs are known to be consumed (:func:`inputs_consumed`):
  Kafka does not order records across the spans/rewards/rollouts topics, so a call's span
  may be consumed after the reward. A terminal event that says ``inputs_acked`` (the
  runner publishes it only after Kafka acknowledged every span and reward of the attempt)
  gets an *inputs bound* from the app: the end offsets of the spans and rewards partitions
  the rollout lives on, read when the event was consumed. Every input of the attempt lies
  below them, so the attempt is complete once the worker has processed those partitions
  up to the bound (``positions``: next offset to process per input topic). Without a bound
  (an event from another producer, an agent with spans of its own exporter that the runner
  cannot flush) or without positions (just after a restart), the old wall-clock rule
  applies: ``settle_s`` after both were present. Calls arriving later are dead-lettered
  ``late_span``
  -> one transition per selected call, in call order, each credited by
  the credit rule (LightningRL, arXiv 2508.03680 s3.3.2: identical credit, reward R);
  with zero selected calls -> one dead letter ``no_llm_calls`` instead.
- **no reward**: terminal status but no final reward within ``reward_timeout_s`` of
  the terminal event -> the attempt is *parked* (late rewards, below); no final reward
  within ``reward_window_s`` -> dead letter ``no_reward_before_window``. With
  ``reward_window_s <= reward_timeout_s`` (no window) it is dead-lettered at
  ``reward_timeout_s`` instead: ``no_reward_before_timeout`` (succeeded) or
  ``rollout_failed_no_reward`` (failed/timeout). We wait for failed attempts too,
  since an evaluator may score a failed run (e.g. R=0) and the reward topic is not
  ordered with the rollouts topic.
- **timeout**: no terminal lifecycle event within ``rollout_timeout_s`` of the
  attempt's last input -> dead letter ``rollout_timeout``; ``unknown_rollout`` when the
  attempt never had a lifecycle event nor a selected call (e.g. a reward for a rollout
  id no runner announced: a typo, or an evaluator scoring another run's rollout).

A *production* attempt (an agent no runner launched: its calls reach the proxy's plain
``/v1`` routes, spanrl/core/production.py) begins at its first call, whose span gives its task
and group size (:func:`production_begin`), and, having no runner to send a terminal event,
ends at its first final reward, at an explicit end (a lifecycle event from the bridge) or
``production_idle_s`` after its last input (:func:`production_end`); from there on it is
finished like any attempt.

Calls: spans with ``kind == "llm"`` recorded by the LLM proxy (``source == "proxy"``) or
carrying token data (``llm`` set), ordered by ``(sequence_id, span_id)``, or by their span
records' offsets when two proxy processes numbered them (spanrl/core/call_order.py). Every other span
(the agent framework's own telemetry, via the bridge) is kept as a *link* (its parent span
id and the agent name it carries), so that when the attempt ends each call's agent is
resolved (:func:`resolve_agent`): the name the call itself carries (the proxy's
``x-spanrl-agent`` header, an explicit override), else the nearest ancestor span, through
the call's W3C trace parent, that names an agent (a LangGraph node, an Agents SDK agent, an
AutoGen agent; ``spanrl.producers.otlp.span_agent_name``), else *unresolved*. Selected calls are
those whose agent the config's :class:`AgentSelector` selects (no selector: every call,
unresolved ones included; with one: unresolved calls are never selected). Every ended
attempt also yields one *call account* (schemas/avro/call_account.v1.avsc): each call, its
resolved agent, how it was resolved and whether it trained. Such a span without ``llm`` or with no
completion token ids -> dead letter ``missing_token_ids`` for that span alone (the other
calls still train); completion logprobs not one per token -> ``logprobs_mismatch``; call
data over ``max_call_bytes`` -> ``oversize``.
A span re-delivered with the same ``span_id`` counts once.

AIR (intermediate rewards, :mod:`spanrl.stream_jobs.air`): a non-call span that states a
fact (a tool span's status, an exception, a time-out, a validator's verdict) is also kept
as ``facts[span_id] = [start_ns, fact, ...]``, and each call keeps its end time
(``end_ns``); when the attempt emits, :func:`build_transitions` gives every fact span's
reward (the credit rule's AIR rules) to the call that caused it, and the credit rule adds
it to that call's credit (``intermediate_reward`` of the transition).

Late rewards (a human rating, a slow judge: the final reward comes hours after the end).
State fields this part keeps (other parts: leave them be):

- ``calls[span_id]["at"]``: ``[topic, partition, offset]`` of the span record the call came
  from (the claim record for a claim-checked span), given to :func:`add_span` as ``at``;
  absent for a call added without one (such a call keeps its token data until the end).
- ``parked_ms``: when the attempt was parked (None: not parked). Parking
  (:func:`park`) deletes the token data of every call with an ``at`` from the store;
  a call that arrives while parked is recorded without it.
- ``ended_event_ms``: the ``timestamp_ms`` of the terminal lifecycle event (the
  producer's clock), for :func:`reward_delay_ms`.

When the final reward of a parked attempt comes, :func:`missing_reads` lists its selected
calls, the app re-reads them from the spans topic (stream_jobs/app.py,
stream_jobs/spans_reader.py), turns each into its store value with :func:`restore_call`
and advances: the transitions are then exactly those an on-time reward gives, with
``late_reward`` true and ``reward_delay_ms``; no settle wait (its spans were consumed
long before). A selected call that could not be re-read (its record deleted by the
topic's retention, or no longer the span it was) -> dead letter ``late_spans_missing``
for the whole attempt (its transitions would not be those of an on-time reward).
"""
from __future__ import annotations

import json
import math
import re
import struct
import sys
from array import array
from dataclasses import dataclass, field
from typing import MutableMapping

from spanrl.core import call_order, production, response_ids
from spanrl.core import dead_letters as dl
from spanrl.core.settings import StreamSettings
from spanrl.stream_jobs import air
from spanrl.stream_jobs.credit import CreditRule, InvalidReward, episode_return, parse_credit_rule
from spanrl.stream_jobs.ticking import TickIndex

TERMINAL = frozenset({"succeeded", "failed", "timeout"})
EMITTED = "emitted"
DEAD = "dead_letter"
MAX_LINK_DEPTH = 64  # ancestors walked to find a call's agent (a cycle or a deep tree ends it)
TRANSITION_VERSION = 2  # schemas/avro/transition.v2.avsc: reward_delay_ms, late_reward


@dataclass(frozen=True)
class AgentSelector:
    """Which agents' calls train: exact ``names``, or a regular expression ``pattern``
    (``re.fullmatch``). An unresolved agent (None) is never selected."""

    names: frozenset[str] | None = None
    pattern: str | None = None

    def __post_init__(self):
        if (self.names is None) == (self.pattern is None):
            raise ValueError("give exactly one of names, pattern")
        if self.pattern is not None:
            re.compile(self.pattern)  # re.error for a bad expression

    def selects(self, agent: str | None) -> bool:
        if agent is None:
            return False
        if self.names is not None:
            return agent in self.names
        return re.fullmatch(self.pattern, agent) is not None

    def describe(self) -> str:
        return f"re:{self.pattern}" if self.pattern is not None else ",".join(sorted(self.names))


def parse_train_agents(text: str | None) -> AgentSelector | None:
    """``SPANRL_TRAIN_AGENTS``: empty/None -> None (every call trains); ``re:EXPR`` -> a
    regular expression matched against the whole agent name; else a comma-separated list
    of names (``write_query,rewrite_query``). Raises ValueError for a bad expression or a
    list with no name."""
    text = (text or "").strip()
    if not text:
        return None
    if text.startswith("re:"):
        try:
            return AgentSelector(pattern=text[3:])
        except re.error as exc:
            raise ValueError(f"SPANRL_TRAIN_AGENTS: bad regular expression {text[3:]!r}: {exc}") from exc
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise ValueError(f"SPANRL_TRAIN_AGENTS: no agent name in {text!r}")
    return AgentSelector(names=names)


def selects(agents: AgentSelector | None, agent: str | None) -> bool:
    """Whether a call of ``agent`` (None: unresolved) trains under ``agents`` (None: all)."""
    return agents is None or agents.selects(agent)


def describe_selection(agents: AgentSelector | None) -> str:
    return "all" if agents is None else agents.describe()


def resolve_agent(call: dict, links: dict[str, list]) -> tuple[str | None, str]:
    """(agent name, how) of one call: ``(name, "call")`` when the call carries a name (the
    proxy's ``x-spanrl-agent`` header, or the span's own attributes); else walk the trace
    from the call's parent span through ``links`` (span_id -> [parent_span_id, agent name
    or None], the attempt's other spans) and return ``(name, "telemetry")`` for the nearest
    span that names an agent; else ``(None, "unresolved")`` (no trace parent, a parent
    never received, or no named ancestor within :data:`MAX_LINK_DEPTH`). Pure."""
    if call.get("agent_name"):
        return call["agent_name"], "call"
    sid, seen = call.get("parent"), set()
    while sid and sid not in seen and len(seen) < MAX_LINK_DEPTH:
        seen.add(sid)
        link = links.get(sid)
        if link is None:
            break
        if link[1]:
            return link[1], "telemetry"
        sid = link[0]
    return None, "unresolved"


@dataclass(frozen=True)
class AssemblyConfig:
    """credit_rule: credit per call; agents: the agents whose calls train (an
    :class:`AgentSelector`; a set of names is taken as ``AgentSelector(names=...)``; None: all);
    reward_timeout_s / rollout_timeout_s / reward_window_s: see the module doc; max_call_bytes: a call
    whose store value (:func:`encode_call`) is larger is dead-lettered ``oversize``
    (None: no limit; the app sets it so that its transition fits the topic)."""

    credit_rule: CreditRule = field(default_factory=lambda: parse_credit_rule("identical"))
    agents: AgentSelector | frozenset[str] | None = None
    reward_timeout_s: float = StreamSettings.default("reward_timeout_s")
    rollout_timeout_s: float = StreamSettings.default("rollout_timeout_s")
    settle_s: float = StreamSettings.default("settle_s")
    max_call_bytes: int | None = None
    #: a production rollout's idle end (:func:`production_end`)
    production_idle_s: float = StreamSettings.default("production_idle_s")
    #: late rewards: how long after its end a parked attempt still takes its final reward
    reward_window_s: float = StreamSettings.default("reward_window_s")

    def __post_init__(self):
        if self.agents is not None and not isinstance(self.agents, AgentSelector):
            object.__setattr__(self, "agents", AgentSelector(names=frozenset(self.agents)))


@dataclass
class Outcome:
    """What an update produced: transition dicts (in call order) and dead-letter dicts."""

    transitions: list[dict] = field(default_factory=list)
    dead_letters: list[dict] = field(default_factory=list)
    changed: bool = False  # the state changed and must be written back
    accounts: list[dict] = field(default_factory=list)  # call accounts of ended attempts
    #: per emitted attempt, the rule that let it out: ``inputs_bound`` | ``settle_s`` | ``late_reward``
    emitted_by: list[str] = field(default_factory=list)

    def extend(self, other: "Outcome") -> "Outcome":
        self.transitions += other.transitions
        self.dead_letters += other.dead_letters
        self.accounts += other.accounts
        self.emitted_by += other.emitted_by
        self.changed = self.changed or other.changed
        return self


def new_state(rollout_id: str, partition: int | None = None) -> dict:
    """Empty state of one rollout. ``partition``: the Kafka partition it lives on (app use)."""
    return {"rollout_id": rollout_id, "partition": partition, "attempts": {}}


def _attempt(state: dict, attempt_id: str, now_ms: int) -> dict:
    a = state["attempts"].get(attempt_id)
    if a is None:
        a = state["attempts"][attempt_id] = {
            "task_id": None, "group_size": None, "status": None, "error": None,
            "calls": {},        # span_id -> {"sequence_id", "agent_name", "parent", "end_ns"}; tokens in the store
            "links": {},        # span_id -> [parent_span_id, agent name]: the agent's other spans
            # "facts" (added by the first fact span): span_id -> [start_ns, fact, ...] (AIR, air.py)
            "bad_spans": [],    # span ids already dead-lettered
            "rewards": [],      # reward events in arrival order (value, final, name, span_id)
            "first_ms": now_ms, "last_ms": now_ms, "ended_ms": None, "ready_ms": None,
            "done": None, "done_ms": None,
        }
    a["last_ms"] = max(a["last_ms"], now_ms)
    return a


def store_key(rollout_id: str, attempt_id: str, span_id: str) -> str:
    """Key of one call's token data in the store."""
    return f"{rollout_id}|{attempt_id}|{span_id}"


CALL_FORMAT = 1
_CALL_HEAD = struct.Struct("<BqII")  # format, policy_version, prompt length P, completion length C
assert array("i").itemsize == 4 and array("f").itemsize == 4
_SWAP = sys.byteorder == "big"


def _packed(typecode: str, values) -> bytes:
    a = array(typecode, values)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def _unpacked(typecode: str, data: bytes) -> list:
    a = array(typecode)
    a.frombytes(data)
    if _SWAP:
        a.byteswap()
    return a.tolist()


def encode_call(llm: dict) -> bytes:
    """Store value of one call (an ``llm`` record of span.v1 with one log-prob per
    completion token), little-endian::

        u8 format (1) | i64 policy_version | u32 P | u32 C
        | P x i32 prompt_token_ids | C x i32 completion_token_ids
        | C x f32 completion_logprobs | model (utf-8, the rest)

    Exact for span.v1 data (Avro ``int`` ids are int32, ``float`` log-probs float32).
    Raises OverflowError for an id outside int32.
    """
    prompt, completion = llm["prompt_token_ids"], llm["completion_token_ids"]
    return b"".join((
        _CALL_HEAD.pack(CALL_FORMAT, int(llm["policy_version"]), len(prompt), len(completion)),
        _packed("i", prompt), _packed("i", completion), _packed("f", llm["completion_logprobs"]),
        llm["model"].encode()))


def decode_call(data: bytes) -> dict:
    """The call dict of a store value: model, policy_version, prompt_token_ids,
    completion_token_ids, completion_logprobs. Also reads the JSON values that
    spanrl before format 1 kept in the store (a changelog written by an older worker)."""
    if data[:1] == b"{":
        return json.loads(data)
    fmt, version, n_prompt, n_completion = _CALL_HEAD.unpack_from(data)
    if fmt != CALL_FORMAT:
        raise ValueError(f"unknown call store format {fmt}")
    p = _CALL_HEAD.size
    q = p + 4 * n_prompt
    r = q + 4 * n_completion
    e = r + 4 * n_completion
    return {"model": bytes(data[e:]).decode(), "policy_version": version,
            "prompt_token_ids": _unpacked("i", data[p:q]),
            "completion_token_ids": _unpacked("i", data[q:r]),
            "completion_logprobs": _unpacked("f", data[r:e])}


def add_span(state: dict, span: dict, store: MutableMapping, config: AssemblyConfig,
             now_ms: int, at: tuple[str, int, int] | None = None) -> Outcome:
    """Record one span (decoded span.v1). A call (see the module doc) is kept with its token
    data; any other span that names an agent or has a parent becomes a link of its
    attempt (until the attempt ends; a span with neither leaves no trace, ``changed``
    stays False); a bad call yields its dead letter. Which calls train is decided when
    the attempt ends, once the links are in. ``at``: (topic, partition, offset) of the
    span's record, kept with the call so that a parked attempt can re-read it."""
    out = Outcome()
    rid, aid, sid = span["rollout_id"], span["attempt_id"], span["span_id"]
    if span.get("kind") != "llm" or (span.get("source") != "proxy" and not span.get("llm")):
        # the agent's own telemetry (its framework's spans, its GenAI span of a call the
        # proxy recorded with tokens): not training data, but it names agents
        parent, agent = span.get("parent_span_id"), span.get("agent_name")
        facts = air.span_facts(span)  # AIR: what the span says (a tool error, ...), kept small
        if not (parent or agent or facts):
            return out
        a = state["attempts"].get(aid)
        if a is not None and (a["done"] is not None or (
                (not (parent or agent) or a.get("links", {}).get(sid) == [parent, agent])
                and (not facts or sid in a.get("facts", {})))):
            return out
        a = _attempt(state, aid, now_ms)
        if parent or agent:
            a.setdefault("links", {})[sid] = [parent, agent]
        described = (span.get("attributes") or {}).get(response_ids.JOINED_RESPONSE_ID)
        if described:  # the framework's span of the call answered with this id: the call's parent
            a.setdefault("links", {})[response_ids.LINK_PREFIX + described] = [sid, None]
        if facts:
            a.setdefault("facts", {})[sid] = [span.get("start_time_unix_nano"), *facts]
        out.changed = True
        return out
    a = _attempt(state, aid, now_ms)
    production_begin(a, span)
    out.changed = True
    if sid in a["calls"] or sid in a["bad_spans"]:
        return out  # re-delivered span: counted once
    if a["done"] is not None:
        out.dead_letters.append(dl.dead_letter(
            dl.LATE_SPAN, dl.ASSEMBLER, now_ms, rollout_id=rid, task_id=a["task_id"],
            detail=f"attempt {aid} already {a['done']}; span {sid}"))
        a["bad_spans"].append(sid)
        return out
    llm = span.get("llm")
    reason = None
    if not llm or not llm.get("completion_token_ids"):
        reason, detail = dl.MISSING_TOKEN_IDS, f"span {sid}: no llm call data / completion_token_ids"
    elif len(llm.get("completion_logprobs") or []) != len(llm["completion_token_ids"]):
        reason = dl.LOGPROBS_MISMATCH
        detail = (f"span {sid}: {len(llm.get('completion_logprobs') or [])} logprobs for "
                  f"{len(llm['completion_token_ids'])} completion tokens")
    else:
        value = encode_call(llm)
        if config.max_call_bytes is not None and len(value) > config.max_call_bytes:
            reason, detail = dl.OVERSIZE, (f"span {sid}: call data {len(value)} bytes > "
                                           f"{config.max_call_bytes} (its transition would not fit the topic)")
    if reason:
        a["bad_spans"].append(sid)
        out.dead_letters.append(dl.dead_letter(
            reason, dl.ASSEMBLER, now_ms, rollout_id=rid, task_id=a["task_id"], detail=detail))
        return out
    a["calls"][sid] = {"sequence_id": int(span["sequence_id"]), "agent_name": span.get("agent_name"),
                       "parent": span.get("parent_span_id") or response_ids.call_link(span.get("attributes")),
                       "end_ns": span.get("end_time_unix_nano")}
    if (instance := (span.get("attributes") or {}).get(call_order.INSTANCE)) is not None:
        a["calls"][sid]["instance"] = instance  # the proxy process that numbered it
    if at is not None:
        a["calls"][sid]["at"] = list(at)
    if at is None or a.get("parked_ms") is None:  # a parked attempt holds no token data
        store[store_key(rid, aid, sid)] = value
    return out


def add_reward(state: dict, reward: dict, now_ms: int) -> Outcome:
    """Record one reward event (decoded reward.v1). NaN/inf -> ``invalid_reward``."""
    out = Outcome(changed=True)
    a = _attempt(state, reward["attempt_id"], now_ms)
    value = float(reward["value"])
    if not math.isfinite(value):
        out.dead_letters.append(dl.dead_letter(
            dl.INVALID_REWARD, dl.ASSEMBLER, now_ms, rollout_id=state["rollout_id"],
            task_id=a["task_id"], detail=f"attempt {reward['attempt_id']}: value {value!r}"))
        return out
    event = {"value": value, "final": bool(reward.get("final", True)),
             "name": reward.get("name", "reward"), "span_id": reward.get("span_id"),
             "timestamp_ms": reward.get("timestamp_ms")}
    if event in a["rewards"]:
        return out  # re-delivered reward event
    if a["done"] is not None:
        out.dead_letters.append(dl.dead_letter(
            dl.LATE_REWARD, dl.ASSEMBLER, now_ms, rollout_id=state["rollout_id"],
            task_id=a["task_id"], detail=f"attempt {reward['attempt_id']} already {a['done']}"))
        return out
    a["rewards"].append(event)
    return out


def add_rollout_event(state: dict, event: dict, now_ms: int,
                      inputs_bound: dict[str, int] | None = None) -> Outcome:
    """Record one lifecycle event (decoded rollout.v2). The first terminal status wins;
    a ``started`` arriving after it does not reopen the attempt. ``inputs_bound``: input
    topic role (``spans``, ``rewards``) -> end offset of the state's partition when the
    event was consumed; kept only for a terminal event with ``inputs_acked`` (module doc)."""
    a = _attempt(state, event["attempt_id"], now_ms)
    a["task_id"] = a["task_id"] or event["task_id"]
    a["group_size"] = a["group_size"] or int(event["group_size"])
    status = event["status"]
    # an explicit end beats one production_end inferred from a reward, until the attempt is
    # emitted: the end and the rating travel on different topics, in no fixed order
    explicit_over_inferred = status in TERMINAL and a.pop("end_inferred", False) and a["done"] is None
    if a["status"] not in TERMINAL or explicit_over_inferred:
        a["status"] = status
        if status in TERMINAL:
            a["ended_ms"] = now_ms
            a["ended_event_ms"] = event.get("timestamp_ms")
            a["error"] = event.get("error")
            if event.get("inputs_acked") and inputs_bound is not None:
                a["inputs_bound"] = {role: int(o) for role, o in sorted(inputs_bound.items())}
    return Outcome(changed=True)


def wants_inputs_bound(state: dict, event: dict) -> bool:
    """Whether the app should read an inputs bound for this lifecycle event: it is the
    first terminal event of its attempt and says ``inputs_acked``."""
    a = state["attempts"].get(event["attempt_id"])
    return (bool(event.get("inputs_acked")) and event["status"] in TERMINAL
            and (a is None or a["status"] not in TERMINAL))


def inputs_consumed(bound: dict[str, int] | None, positions: dict[str, int] | None) -> bool | None:
    """Whether every input below ``bound`` has been processed.

    bound: input topic role -> end offset (exclusive) of the attempt's partition, read
    after the attempt's terminal event was consumed; since its producer had every span
    and reward of the attempt acknowledged before it sent that event, they all lie below.
    positions: role -> next offset the worker will process on that partition (one past
    the last record it handled). The spans/rewards topics have only non-transactional
    writers, so their offsets are contiguous records (no commit markers): position >= bound
    means every record below bound was handled.

    Returns True / False, or None when it cannot be told (no bound, or a role without a
    known position, e.g. no record of that partition handled since the worker started).
    """
    if bound is None or positions is None:
        return None
    known = True
    for role, end in bound.items():
        pos = positions.get(role)
        if pos is None:
            known = False
        elif pos < end:
            return False
    return True if known else None


def advance(state: dict, store: MutableMapping, config: AssemblyConfig, now_ms: int,
            positions: dict[str, int] | None = None) -> Outcome:
    """Finish every attempt that can be finished at ``now_ms`` (see module doc).
    ``positions``: input topic role -> next offset the worker processes on the state's
    partition (:func:`inputs_consumed`); None: unknown.

    Call after each input and periodically. Marks finished attempts ``done`` (so a
    second call emits nothing) and removes their calls from ``store``.
    """
    out = Outcome()
    for aid in sorted(state["attempts"]):
        a = state["attempts"][aid]
        if a["done"] is not None:
            continue
        out.changed = production_end(a, config, now_ms) or out.changed
        out.extend(_advance_attempt(state["rollout_id"], aid, a, store, config, now_ms, positions))
    return out


def awaiting_inputs(state: dict) -> dict[str, int] | None:
    """The inputs bound that attempts of this state wait for before they can be emitted
    (per role the highest over such attempts), or None when none waits: the app
    re-advances the state once its partition's positions pass it."""
    need: dict[str, int] = {}
    for a in state["attempts"].values():
        bound = a.get("inputs_bound")
        if a["done"] is None and bound and a["status"] in TERMINAL and a.get("parked_ms") is None:
            for role, end in bound.items():
                need[role] = max(end, need.get(role, end))
    return need or None


def production_begin(a: dict, span: dict) -> bool:
    """Begin a production rollout (an agent no runner launched, spanrl/core/production.py) at a
    call whose span the proxy marked ``spanrl.origin=production``: the attempt takes the span's
    task label and group size (unless a lifecycle event gave them) and is marked
    ``production``, so that :func:`production_end` may end it. Returns whether the span was such
    a call; other spans change nothing."""
    found = production.rollout_from_span(span.get("attributes"))
    if found is None:
        return False
    a["production"] = True
    a["task_id"] = a["task_id"] or found[0]
    a["group_size"] = a["group_size"] or found[1]
    return True


def production_end(a: dict, config: AssemblyConfig, now_ms: int) -> bool:
    """End a production attempt that has no terminal lifecycle event (no runner sends one): at
    its first final reward (a user's rating ends the episode), or ``production_idle_s`` after its
    last input (status ``succeeded``, error ``idle``; the reward may still come within
    ``reward_timeout_s``). An explicit end is an ordinary lifecycle event (the bridge's
    ``POST /v1/rollouts/{rollout_id}/end``). Sets ``status``/``ended_ms`` as
    :func:`add_rollout_event` would; returns whether it ended the attempt."""
    if not a.get("production") or a["status"] in TERMINAL:
        return False
    if any(r["final"] for r in a["rewards"]):
        a["status"], a["error"] = "succeeded", None
        a["end_inferred"] = True  # an explicit end that comes before the emission overrides it
    elif now_ms - a["last_ms"] >= config.production_idle_s * 1000:
        a["status"], a["error"] = "succeeded", f"idle {config.production_idle_s:g}s"
    else:
        return False
    a["ended_ms"] = now_ms
    return True


def _advance_attempt(rid: str, aid: str, a: dict, store: MutableMapping,
                     config: AssemblyConfig, now_ms: int, positions: dict[str, int] | None = None) -> Outcome:
    out = Outcome()

    def dead(reason: str, detail: str, trained: frozenset = frozenset()) -> Outcome:
        out.changed = True
        out.dead_letters.append(dl.dead_letter(
            reason, dl.ASSEMBLER, now_ms, rollout_id=rid, task_id=a["task_id"],
            detail=f"attempt {aid}: {detail}"))
        out.accounts.append(call_account(rid, aid, a, reason, trained, config, now_ms))
        _finish(rid, aid, a, store, DEAD, now_ms)
        return out

    if a["status"] not in TERMINAL:
        if now_ms - a["last_ms"] >= config.rollout_timeout_s * 1000:
            if a["task_id"] is None and a["status"] is None and not a["calls"]:
                return dead(dl.UNKNOWN_ROLLOUT, f"no lifecycle event and no llm call within "
                            f"{config.rollout_timeout_s:g}s; {len(a['rewards'])} rewards dropped")
            return dead(dl.ROLLOUT_TIMEOUT, f"no terminal lifecycle event within "
                        f"{config.rollout_timeout_s:g}s; {len(a['calls'])} llm calls dropped")
        return out
    try:
        R = episode_return(a["rewards"])
    except InvalidReward as exc:  # add_reward already filters these; kept for safety
        return dead(dl.INVALID_REWARD, str(exc))
    if R is None:
        wait = no_reward_wait(now_ms - a["ended_ms"], config, a["status"])
        if wait == "timeout":
            reason = dl.NO_REWARD_BEFORE_TIMEOUT if a["status"] == "succeeded" else dl.ROLLOUT_FAILED_NO_REWARD
            return dead(reason, f"status {a['status']}, no final reward within "
                        f"{config.reward_timeout_s:g}s; {len(a['calls'])} llm calls dropped")
        if wait == "window":
            return dead(dl.NO_REWARD_BEFORE_WINDOW, f"status {a['status']}, no final reward within "
                        f"{config.reward_window_s:g}s (the reward window); {len(a['calls'])} llm calls dropped")
        if wait == "park" and a.get("parked_ms") is None:
            park(rid, aid, a, store, now_ms)
            out.changed = True
        return out
    if a.get("parked_ms") is not None:  # a late reward: no settle wait, the spans came long ago
        chosen = selected_calls(a, config.agents)
        missing = [sid for sid in chosen if store_key(rid, aid, sid) not in store]
        if missing:
            delay = reward_delay_ms(a)
            return dead(dl.LATE_SPANS_MISSING, f"final reward {'late' if delay is None else f'{delay} ms after the end'}, but "
                        f"{len(missing)} of {len(chosen)} parked calls could not be re-read from spans "
                        f"(deleted by retention, or no longer the span recorded): {', '.join(missing[:8])}")
        return _emit(rid, aid, a, R, store, config, now_ms, out, dead, "late_reward")
    if a["ready_ms"] is None:
        a["ready_ms"] = now_ms
        out.changed = True
    consumed = inputs_consumed(a.get("inputs_bound"), positions)
    if consumed is False:
        return out  # some of its spans/rewards may be unread yet: never emit early
    if consumed is None and now_ms - a["ready_ms"] < config.settle_s * 1000:
        return out
    chosen = selected_calls(a, config.agents)
    missing = [sid for sid in chosen if store_key(rid, aid, sid) not in store]
    if missing:  # the app re-read them (missing_reads) and some could not be read back
        return dead(dl.SPANS_MISSING, f"{len(missing)} of {len(chosen)} calls' token data were lost with a "
                    f"worker and could not be re-read from spans (deleted by retention, or no longer the "
                    f"span recorded): {', '.join(missing[:8])}")
    return _emit(rid, aid, a, R, store, config, now_ms, out, dead, "inputs_bound" if consumed else "settle_s")


def _emit(rid: str, aid: str, a: dict, R: float, store: MutableMapping, config: AssemblyConfig,
          now_ms: int, out: Outcome, dead, rule: str) -> Outcome:
    """The end of an attempt with return R: its transitions (or ``no_llm_calls``); ``rule``:
    what let it out (``inputs_bound`` | ``settle_s`` | ``late_reward``, :attr:`Outcome.emitted_by`)."""
    resolved = resolved_agents(a)
    chosen = selected_calls(a, config.agents, resolved)
    if not chosen:
        excluded = len(a["calls"])
        return dead(dl.NO_LLM_CALLS, f"status {a['status']}, return {R!r}, no selected llm call"
                    + (f" ({excluded} calls of agents not selected by {describe_selection(config.agents)})"
                       if excluded else ""))
    out.transitions = build_transitions(rid, aid, a, R, store, config.credit_rule, chosen, resolved)
    mark_late(out.transitions, a)
    out.accounts.append(call_account(rid, aid, a, EMITTED, frozenset(chosen), config, now_ms, resolved))
    out.emitted_by.append(rule)
    out.changed = True
    _finish(rid, aid, a, store, EMITTED, now_ms)
    return out


def no_reward_wait(waited_ms: int, config: AssemblyConfig, status: str = "succeeded") -> str:
    """What an ended attempt without a final reward, ``waited_ms`` after its terminal event,
    does: ``"wait"`` (< reward_timeout_s), ``"park"`` (reward_timeout_s <= waited <
    reward_window_s: token data out of the store, spans re-read if the reward comes),
    ``"window"`` (>= reward_window_s: dead letter ``no_reward_before_window``); with
    ``reward_window_s <= reward_timeout_s`` (no window) ``"timeout"`` at reward_timeout_s
    (the dead letters before late rewards). Only a ``succeeded`` attempt is parked: a failed
    or timed-out one that no evaluator scored within reward_timeout_s is dead-lettered then
    (``rollout_failed_no_reward``), as before late rewards: a rating comes for an episode
    that completed, and a run's accounting should not wait a week for its failures. Pure."""
    if config.reward_window_s <= config.reward_timeout_s or status != "succeeded":
        return "timeout" if waited_ms >= config.reward_timeout_s * 1000 else "wait"
    if waited_ms >= config.reward_window_s * 1000:
        return "window"
    return "park" if waited_ms >= config.reward_timeout_s * 1000 else "wait"


def park(rid: str, aid: str, a: dict, store: MutableMapping, now_ms: int) -> None:
    """Park an attempt: delete from ``store`` the token data of every call that knows its
    span's position (``at``); the state keeps the calls' metadata and positions."""
    a["parked_ms"] = now_ms
    for sid, call in a["calls"].items():
        if call.get("at") is not None:
            store.pop(store_key(rid, aid, sid), None)


def missing_reads(state: dict, store: MutableMapping, config: AssemblyConfig) -> dict[str, list[tuple[str, list]]]:
    """The spans to re-read before :func:`advance`: attempt_id -> [(span_id, [topic, partition,
    offset]), ...] (call order) of every unfinished attempt that could end now, a terminal
    status (or parked) and a final reward, for its calls that know their span's position
    (``at``) and whose token data are not in ``store``. Two cases: a parked attempt whose late
    reward came (its selected calls), and an attempt whose calls were handled by a worker that
    has since stopped or lost the partition (the app keeps token data in memory only; the state
    with the positions is what the changelog restores: every such call). Empty almost always."""
    wanted: dict[str, list[tuple[str, list]]] = {}
    rid = state["rollout_id"]
    for aid, a in sorted(state["attempts"].items()):
        parked = a.get("parked_ms") is not None
        if a["done"] is not None or not (parked or a["status"] in TERMINAL):
            continue
        try:
            if episode_return(a["rewards"]) is None:
                continue
        except InvalidReward:
            continue
        sids = selected_calls(a, config.agents if parked else None)
        reads = [(sid, a["calls"][sid]["at"]) for sid in sids
                 if store_key(rid, aid, sid) not in store and a["calls"][sid].get("at") is not None]
        if reads:
            wanted[aid] = reads
    return wanted


def restore_call(rid: str, aid: str, sid: str, span: dict) -> bytes | None:
    """The store value (:func:`encode_call`) of call ``sid`` of attempt ``aid`` from its
    re-read span (decoded span.v1, claim resolved): the same bytes :func:`add_span` stored.
    None when the record is not that call (another rollout, attempt or span id, or no usable
    token data), so the caller counts it missing."""
    if (span.get("rollout_id"), span.get("attempt_id"), span.get("span_id")) != (rid, aid, sid):
        return None
    llm = span.get("llm")
    if not llm or not llm.get("completion_token_ids") or \
            len(llm.get("completion_logprobs") or []) != len(llm["completion_token_ids"]):
        return None
    try:
        return encode_call(llm)
    except OverflowError:
        return None


def reward_delay_ms(a: dict) -> int | None:
    """How late the final reward R (the last ``final`` reward event) came: its ``timestamp_ms``
    minus the terminal lifecycle event's, both as their producers stamped them (so a replay
    records the same value), 0 if the reward was stamped first; None when either is unknown."""
    finals = [e for e in a["rewards"] if e.get("final", True)]
    end = a.get("ended_event_ms")
    if not finals or end is None or finals[-1].get("timestamp_ms") is None:
        return None
    return max(0, int(finals[-1]["timestamp_ms"]) - int(end))


def mark_late(transitions: list[dict], a: dict) -> None:
    """Set the late-reward fields of transition v2 on an attempt's transitions."""
    late, delay = a.get("parked_ms") is not None, reward_delay_ms(a)
    for t in transitions:
        t.update(schema_version=TRANSITION_VERSION, reward_delay_ms=delay, late_reward=late)


def resolved_agents(a: dict) -> dict[str, tuple[str | None, str]]:
    """span_id -> (agent name, how) for every call of the attempt (:func:`resolve_agent`)."""
    links = a.get("links", {})
    return {sid: resolve_agent(call, links) for sid, call in a["calls"].items()}


def selected_calls(a: dict, agents: AgentSelector | None = None,
                   resolved: dict[str, tuple[str | None, str]] | None = None) -> list[str]:
    """Span ids of an attempt's calls that train under ``agents`` (None: all), in call order
    (spanrl/core/call_order.py: sequence_id, then span_id, unless two proxies numbered them)."""
    resolved = resolved if resolved is not None else resolved_agents(a)
    return [sid for sid in call_order.call_order(a["calls"]) if selects(agents, resolved[sid][0])]


def call_account(rid: str, aid: str, a: dict, outcome: str, trained: frozenset, config: AssemblyConfig,
                 now_ms: int, resolved: dict[str, tuple[str | None, str]] | None = None) -> dict:
    """The call account (schemas/avro/call_account.v1.avsc) of an ended attempt: every
    call in call order with its resolved agent, how it was resolved (``call`` | ``telemetry``
    | ``unresolved``) and whether it became a transition; ``outcome`` is ``emitted`` or the
    attempt's dead-letter reason."""
    resolved = resolved if resolved is not None else resolved_agents(a)
    order = call_order.call_order(a["calls"])
    return {
        "schema_version": 1, "rollout_id": rid, "attempt_id": aid, "task_id": a["task_id"],
        "outcome": outcome, "selection": describe_selection(config.agents),
        "calls": [{"span_id": sid, "sequence_id": a["calls"][sid]["sequence_id"],
                   "agent_name": resolved[sid][0], "agent_source": resolved[sid][1],
                   "trained": sid in trained} for sid in order],
        "timestamp_ms": now_ms,
    }


def build_transitions(rid: str, aid: str, a: dict, R: float, store: MutableMapping,
                      rule: CreditRule, order: list[str] | None = None,
                      resolved: dict[str, tuple[str | None, str]] | None = None) -> list[dict]:
    """Transition dicts (schemas/avro/transition.v2.avsc) of an ended attempt with return R,
    one per call of ``order`` (default: every call), credited over those calls only; with
    the rule's AIR rules (``rule.air``), each call's intermediate reward from the attempt's
    fact spans (:func:`call_intermediate_rewards`) goes into its credit."""
    resolved = resolved if resolved is not None else resolved_agents(a)
    order = order if order is not None else selected_calls(a, None, resolved)
    T = len(order)
    intermediate = call_intermediate_rewards(a, order, rule)
    rewards = rule(R, T, intermediate)  # LightningRL s3.3.2: identical credit -> every call gets R (+ AIR)
    transitions = []
    for t, sid in enumerate(order):
        call = decode_call(store[store_key(rid, aid, sid)])
        transitions.append({
            "schema_version": 2,
            "rollout_id": rid,
            "attempt_id": aid,
            "span_id": sid,
            "task_id": a["task_id"],
            "group_size": int(a["group_size"]),
            "sequence_id": a["calls"][sid]["sequence_id"],
            "call_index": t,
            "rollout_transition_count": T,
            "agent_name": resolved[sid][0],
            "model": call["model"],
            "policy_version": call["policy_version"],
            "prompt_token_ids": call["prompt_token_ids"],
            "completion_token_ids": call["completion_token_ids"],
            "behaviour_logprobs": call["completion_logprobs"],
            "episode_return": R,
            "reward": rewards[t],
            "credit_rule": rule.name,
            "status": a["status"],
            "intermediate_reward": intermediate[t],
            "air_rules": rule.air_name,
        })
    return transitions


def call_intermediate_rewards(a: dict, order: list[str], rule: CreditRule) -> list[float]:
    """AIR (arXiv 2508.03680 s3.4.2): the intermediate reward of each call of ``order`` from
    the attempt's fact spans (``a["facts"]``) under ``rule.air`` (zeros without AIR rules);
    each fact span rewards the call that caused it (:func:`spanrl.stream_jobs.air.cause_of`)."""
    return air.intermediate_rewards(a["calls"], a.get("facts", {}), order, rule.air)


def _finish(rid: str, aid: str, a: dict, store: MutableMapping, how: str, now_ms: int) -> None:
    for sid in list(a["calls"]):
        store.pop(store_key(rid, aid, sid), None)
    a["done"], a["done_ms"] = how, now_ms  # calls/rewards kept: re-deliveries stay no-ops
    return None


def expires_at(state: dict, retain_s: float) -> int | None:
    """When the state may be deleted (ms): ``retain_s`` after its last attempt finished,
    once every attempt is done; None while one is not (or it has none)."""
    attempts = state["attempts"].values()
    if not attempts or any(a["done"] is None for a in attempts):
        return None
    return max(a["done_ms"] for a in attempts) + int(retain_s * 1000)


def tick_due(state: dict, config: AssemblyConfig, retain_s: float,
             positions: dict[str, int] | None = None) -> int | None:
    """When a tick next has something to do for this state (ms), for the app's tick index
    (stream_jobs/ticking.py): the earliest :func:`attempt_due` of its open attempts (None:
    every tick, when one of them needs it; ``NEVER``, -1, when none waits for a time: each
    waits for an input, or for the positions to pass its inputs bound); when all are done,
    :func:`expires_at`. Ticks visit a state only then: with thousands of rollouts in flight
    (a backlog) a tick used to advance every open one, 8 times a second (issue 11)."""
    open_ = [a for a in state["attempts"].values() if a["done"] is None]
    if not open_:
        return expires_at(state, retain_s)
    due = [attempt_due(a, config, positions) for a in open_]
    if any(d is None for d in due):
        return None
    timed = [d for d in due if d != NEVER]
    return min(timed) if timed else NEVER


#: :func:`attempt_due`: no time will change the attempt (an input will); TickIndex.NEVER
NEVER = TickIndex.NEVER


def _ms(seconds: float) -> int:
    return math.ceil(seconds * 1000)


def attempt_due(a: dict, config: AssemblyConfig, positions: dict[str, int] | None = None) -> int | None:
    """The earliest time (ms, on the clock ``advance`` is given) at which :func:`advance` may
    change the open attempt ``a`` without an input: its rollout timeout (no terminal event;
    for a production attempt also its idle end), its reward timeout (ended, no final reward:
    park or dead letter), its reward window (parked), its settle time (ended with a reward:
    the fallback when its inputs bound cannot be judged). :data:`NEVER` when only an input can
    (an ended attempt with a reward whose inputs bound ``positions`` do not pass yet: the app
    advances it when they do); None when it cannot be told (advance every tick). Pure."""
    if a.get("parked_ms") is not None:
        return a["ended_ms"] + _ms(config.reward_window_s)
    if a["status"] not in TERMINAL:
        due = a["last_ms"] + _ms(config.rollout_timeout_s)
        if a.get("production"):
            due = min(due, a["last_ms"] + _ms(config.production_idle_s))
        return due
    try:
        R = episode_return(a["rewards"])
    except InvalidReward:
        return None
    if R is None:
        return None if a["ended_ms"] is None else a["ended_ms"] + _ms(config.reward_timeout_s)
    if a["ready_ms"] is None:
        return None
    if inputs_consumed(a.get("inputs_bound"), positions) is False:
        return NEVER
    return a["ready_ms"] + _ms(config.settle_s)


def expired(state: dict, now_ms: int, retain_s: float) -> bool:
    """True when every attempt is done and the last finished ``retain_s`` ago or more:
    the state can be deleted (late inputs after that start a fresh state)."""
    t = expires_at(state, retain_s)
    return t is not None and now_ms >= t
