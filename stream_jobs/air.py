"""AIR: intermediate rewards from the span facts of an attempt (pure; no Faust, no Kafka).

Agent Lightning (arXiv 2508.03680) s3.4.2: "AIR converts system monitoring signals (e.g.
tool-call return status) into intermediate rewards". Here a *fact* is what one span that
is not an LLM call says about the run (:func:`span_facts`); a *rule* gives a fact a reward
(``SPANRL_AIR_RULES``, :func:`parse_air_rules`); the reward goes to the LLM call that caused
the span (:func:`cause_of`); the credit rule (stream_jobs/credit.py) combines each call's
intermediate reward with the episode's final return R.

Facts (:data:`FACTS`), read from the span record the bridge writes (schemas/avro/span.v1):

- ``tool_error`` / ``tool_ok``: a tool span (``kind == "tool"``: GenAI ``execute_tool``,
  OpenInference ``TOOL``, a name starting with ``tool``) whose status is / is not ERROR;
- ``exception``: a span that recorded an exception (OTel semantic conventions,
  "Exceptions": an event named ``exception``; the bridge copies its ``exception.type`` to
  the span's attributes) or has an ``exception.type`` attribute;
- ``timeout``: a span whose ``error.type`` or ``exception.type`` names a time-out
  (contains ``timeout``, any case: ``TimeoutError``, ``httpx.ReadTimeout``, ``timeout``);
- ``verdict_pass`` / ``verdict_fail``: a validator's verdict, attribute ``spanrl.verdict``
  = ``pass|true|1`` / ``fail|false|0`` (:data:`VERDICT_ATTR`).

Which call caused a span: the **nearest preceding LLM call in time**, the call of the
attempt with the latest end time at or before the span's start (ties: the later
``(sequence_id, span_id)``). Not the trace parent: in every framework instrumentation
(OpenInference, the GenAI conventions) a tool span is a sibling of the LLM span under the
agent's span, never its child, so the parent names no call. Not the sequence order: the
proxy numbers an attempt's calls and the agent's OTel SDK numbers its spans with two
separate counters (producers/proxy.py, producers/instrument.py), which do not compare.
Time does: the proxy ends a call's span before it answers, and the agent runs the tool
only after it has the answer. The proxy's clock and the agent's must agree to within the
time between an answer and the tool's start (same host, or NTP); a span that starts before
every call ended (a check of the input) has no cause and rewards no call.

Each span gives at most one reward: that of the **first rule, in the order written**,
whose fact the span has (a failed tool span that timed out has ``tool_error``,
``exception`` and ``timeout``; ``timeout:-0.5,tool_error:-0.1`` gives it -0.5, and a
tool error that is no time-out -0.1). A call's intermediate reward is the sum over the
spans it caused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

TOOL_ERROR, TOOL_OK, EXCEPTION, TIMEOUT = "tool_error", "tool_ok", "exception", "timeout"
VERDICT_PASS, VERDICT_FAIL = "verdict_pass", "verdict_fail"
FACTS = (TOOL_ERROR, TOOL_OK, EXCEPTION, TIMEOUT, VERDICT_PASS, VERDICT_FAIL)
#: a validator's verdict on the run so far (an attribute the agent or an evaluator sets on its span)
VERDICT_ATTR = "spanrl.verdict"
_PASS, _FAIL = frozenset({"pass", "true", "1"}), frozenset({"fail", "false", "0"})


def span_facts(span: dict) -> list[str]:
    """The facts (:data:`FACTS`, in that order) of one decoded span record that is not an
    LLM call; ``[]`` for a span that says nothing AIR uses. Pure."""
    attrs = span.get("attributes") or {}
    facts = []
    if span.get("kind") == "tool":
        facts.append(TOOL_ERROR if span.get("status_code") == "ERROR" else TOOL_OK)
    exc_type = attrs.get("exception.type") or ""
    if exc_type:
        facts.append(EXCEPTION)
    if "timeout" in f"{attrs.get('error.type') or ''} {exc_type}".lower():
        facts.append(TIMEOUT)
    verdict = str(attrs.get(VERDICT_ATTR, "")).strip().lower()
    if verdict in _PASS:
        facts.append(VERDICT_PASS)
    elif verdict in _FAIL:
        facts.append(VERDICT_FAIL)
    return facts


@dataclass(frozen=True)
class AirRules:
    """Parsed ``SPANRL_AIR_RULES``: ``(fact, reward)`` pairs in the order written."""

    rules: tuple[tuple[str, float], ...]

    def describe(self) -> str:
        """The rules as written in transitions (``air_rules``): ``fact:reward,...``."""
        return ",".join(f"{fact}:{value:g}" for fact, value in self.rules)

    def span_reward(self, facts: list[str]) -> float | None:
        """Reward of a span with ``facts``: the first rule whose fact it has, else None."""
        for fact, value in self.rules:
            if fact in facts:
                return value
        return None


def finite_number(text: str, what: str) -> float:
    """``float(text)``; ValueError ``"<what>: 'text' is not a number"`` or ``"...: must be
    finite"`` (NaN, infinities) otherwise."""
    try:
        x = float(text)
    except ValueError:
        raise ValueError(f"{what}: {text.strip()!r} is not a number") from None
    if not math.isfinite(x):
        raise ValueError(f"{what}: must be finite, got {text.strip()!r}")
    return x


def parse_air_rules(text: str | None) -> AirRules | None:
    """``SPANRL_AIR_RULES``: empty/None/``off``/``none`` -> None (no intermediate rewards);
    else comma-separated ``FACT:REWARD`` (e.g. ``tool_error:-0.1,timeout:-0.5``), FACT one of
    :data:`FACTS`, REWARD a finite number. Raises ValueError naming the bad part: an unknown
    fact, a missing or non-finite reward, a fact given twice, or no rule at all."""
    text = (text or "").strip()
    if text.lower() in ("", "off", "none"):
        return None
    rules, seen = [], set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        fact, sep, value = part.partition(":")
        fact = fact.strip()
        if fact not in FACTS:
            raise ValueError(f"SPANRL_AIR_RULES: unknown fact {fact!r} in {part!r}; known: {', '.join(FACTS)}")
        if not sep or not value.strip():
            raise ValueError(f"SPANRL_AIR_RULES: {part!r} has no reward; write {fact}:<number>")
        x = finite_number(value, f"SPANRL_AIR_RULES: reward of {fact}")
        if fact in seen:
            raise ValueError(f"SPANRL_AIR_RULES: fact {fact!r} given twice")
        seen.add(fact)
        rules.append((fact, x))
    if not rules:
        raise ValueError(f"SPANRL_AIR_RULES: no rule in {text!r}")
    return AirRules(tuple(rules))


def cause_of(start_ns: int | None, calls: dict[str, dict]) -> str | None:
    """Span id of the call that caused a span starting at ``start_ns``: among ``calls``
    (span_id -> {"end_ns", "sequence_id"}), the one with the latest ``end_ns <= start_ns``
    (ties: the larger ``(sequence_id, span_id)``); None when no call ended by then, or the
    span or every call has no time. Pure."""
    if start_ns is None:
        return None
    best, best_key = None, None
    for sid, call in calls.items():
        end = call.get("end_ns")
        if end is None or end > start_ns:
            continue
        key = (end, call.get("sequence_id", 0), sid)
        if best_key is None or key > best_key:
            best, best_key = sid, key
    return best


def intermediate_rewards(calls: dict[str, dict], facts: dict[str, list], order: list[str],
                         rules: AirRules | None) -> list[float]:
    """Intermediate reward of each call of ``order`` (span ids, in call order): the sum of
    the rewards (:meth:`AirRules.span_reward`) of the fact spans it caused (:func:`cause_of`
    over *all* ``calls`` of the attempt, so that a span caused by a call that does not train
    rewards no other call). ``facts``: span_id -> ``[start_ns, fact, ...]`` (the attempt
    state's fact spans). No rules -> zeros. Pure.

    Example: calls a (ended at 10), b (ended at 30); fact spans t1 [12, tool_error],
    t2 [35, tool_error], t3 [5, tool_ok]; rules ``tool_error:-0.1`` -> a: -0.1 (t1),
    b: -0.1 (t2); t3 started before any call ended: no call.
    """
    out = {sid: 0.0 for sid in order}
    if rules is None:
        return [0.0] * len(order)
    for fact_sid in sorted(facts):
        start_ns, *span_facts_ = facts[fact_sid]
        value = rules.span_reward(span_facts_)
        if value is None:
            continue
        cause = cause_of(start_ns, calls)
        if cause in out:
            out[cause] += value
    return [out[sid] for sid in order]
