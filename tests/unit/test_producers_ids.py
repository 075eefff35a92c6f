"""Bounds on rollout, attempt and task ids (spanrl/core/ids.py, issue 23 item 5): every id the
project and its examples generate passes; the rule and its messages; property tests over the
validator and over each entry point's parsing (proxy path and headers, bridge spans, rewards
and rollout ends), in-process, Kafka and vLLM unreachable (every case here is answered before
either is asked)."""
from __future__ import annotations

import re
import uuid
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan

from spanrl.core import ids, production
from spanrl.core.edge import BadRequest
from spanrl.producers import bridge, otlp, proxy
from spanrl.producers.kafka import Sink, Topics
from tests.unit.test_producers_bridge import RecordingSink  # Kafka that acks at once

#: the rule restated as a regular expression, to check the validator against
ROLLOUT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
TASK_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
# text near the rule's edges: its characters, some that are not in it, and any other
ID_ALPHABET = st.sampled_from("aZ09._:-/|@ %\x00\u00e9\u2603") | st.characters(codec="utf-8")
near_ids = st.text(ID_ALPHABET, min_size=0, max_size=140) | st.text("ab-", min_size=126, max_size=130)


def test_every_id_the_project_generates_passes():
    from examples.math_agent import tasks as math_tasks
    from examples.rag_agent import tasks as rag_tasks
    from examples.sql_agent import tasks as sql_tasks
    from spanrl.producers.runner import make_task

    rollouts = [uuid.uuid4().hex, production.mint_rollout_id(), "chat-42", f"js-{uuid.uuid4().hex[:12]}"]
    tasks = [make_task({"q": 1})["task_id"], math_tasks.task_id(1000, 199), "faq/refunds",
             f"partition-{uuid.uuid4().hex[:6]}-t3"]  # infra/chaos.py's
    tasks += [t["task_id"] for t in math_tasks.load_arith_tasks(0, 30) + [
        t for name in math_tasks.BALANCED_SETS for t in math_tasks.load_balanced_tasks(name, 0, 30)]]
    tasks += [t["task_id"] for db in ("chinook", "world") for t in sql_tasks.pool(db)]
    tasks += [t["task_id"] for t in rag_tasks.all_tasks()]
    assert {"arith_word-0-12", "sql-chinook-tracks_of_artist-121", "gsm_symbolic-1000-199"} <= set(tasks)
    assert any(t.startswith("rag-city_capital-city:") for t in tasks)
    assert [r for r in rollouts if not ids.is_valid(ids.ROLLOUT, r)] == []
    assert [a for a in map(str, range(20)) if not ids.is_valid(ids.ATTEMPT, a)] == []
    assert [t for t in tasks if not ids.is_valid(ids.TASK, t)] == []
    # a task label may name a rollout (a production call without one is a group of one)
    assert [r for r in rollouts if not ids.is_valid(ids.TASK, r)] == []


RULE = "rollout ids are 1-128 characters of A-Z a-z 0-9 . _ : -, the first a letter or digit"


@pytest.mark.parametrize("value, why", [
    ("x" * 10_000, f"is 10000 characters; {RULE}"),
    ("x" * 129, f"is 129 characters; {RULE}"),
    ("", f"is empty; {RULE}"),
    ("-r", f"starts with '-'; {RULE}"),
    (".", f"starts with '.'; {RULE}"),
    ("r|a0", f"has the character '|' at position 1; {RULE}"),
    ("r/1", f"has the character '/' at position 1; {RULE}"),
    ("r 1", f"has the character ' ' at position 1; {RULE}"),
    ("r\x00", f"has the character '\\x00' at position 1; {RULE}"),
    ("caf\u00e9", f"has the character '\u00e9' at position 3; {RULE}"),
    ("r\ud800", f"has the character '\\ud800' at position 1; {RULE}"),  # a lone surrogate (JSON "\ud800")
    (42, f"is not a string (int); {RULE}"),
])
def test_problem_names_the_limit_without_echoing_the_value(value, why):
    assert ids.problem(ids.ROLLOUT, value) == why


def test_task_ids_may_hold_a_slash_and_check_raises_bad_request_naming_the_place():
    assert ids.problem(ids.TASK, "faq/refunds") is None
    assert ids.problem(ids.TASK, "/faq") == (
        "starts with '/'; task ids are 1-128 characters of A-Z a-z 0-9 . _ : - /, the first a letter or digit")
    assert ids.check(ids.ATTEMPT, "1", "attempt_id") == "1"
    with pytest.raises(BadRequest) as exc:
        ids.check(ids.ATTEMPT, "a b", "attempt_id")
    assert (exc.value.status, exc.value.reason, exc.value.param, exc.value.detail) == (
        400, "invalid_id", "attempt_id", "attempt_id has the character ' ' at position 1; "
        "attempt ids are 1-128 characters of A-Z a-z 0-9 . _ : -, the first a letter or digit")
    with pytest.raises(KeyError):
        ids.problem("span", "x")


@given(near_ids)
def test_the_validator_is_the_rule(value):
    assert ids.is_valid(ids.ROLLOUT, value) == ids.is_valid(ids.ATTEMPT, value) == bool(ROLLOUT_RE.fullmatch(value))
    assert ids.is_valid(ids.TASK, value) == bool(TASK_RE.fullmatch(value))
    why = ids.problem(ids.ROLLOUT, value)
    assert why is None or (len(why) < 160 and (len(value) < 20 or value not in why))  # never echoed


@given(st.one_of(st.none(), st.integers(), st.floats(), st.binary(), st.lists(st.text())))
def test_anything_not_a_string_is_refused(value):
    assert ids.problem(ids.TASK, value).startswith("is not a string (")


# ------------------------------------------------------------------ entry points
@given(near_ids, near_ids)
def test_production_headers_take_exactly_the_valid_ids(rollout, task):
    headers = {production.ROLLOUT_HEADER: rollout, production.TASK_HEADER: task}
    ok = ids.is_valid(ids.ROLLOUT, rollout.strip()) and ids.is_valid(ids.TASK, task.strip())
    try:
        got = production.production_rollout(headers)
    except BadRequest as exc:
        assert not ok and (exc.status, exc.reason) == (400, "invalid_rollout_header")
        assert exc.param == (production.ROLLOUT_HEADER if not ids.is_valid(ids.ROLLOUT, rollout.strip())
                             else production.TASK_HEADER)
        assert exc.detail.startswith(exc.param + " ") and "1-128 characters" in exc.detail
    else:
        assert ok and (got.rollout_id, got.task_id) == (rollout.strip(), task.strip())


def span_with(**attrs) -> PbSpan:
    pb = PbSpan(trace_id=b"\1" * 16, span_id=b"\2" * 8, name="tool.search")
    pb.attributes.extend(KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in attrs.items())
    return pb


@given(near_ids.filter(bool), near_ids, st.none() | near_ids)
def test_bridge_spans_with_a_bad_id_are_dead_letters_never_keyed_by_it(rollout, attempt, task):
    attrs = {"spanrl.rollout_id": rollout, "spanrl.attempt_id": attempt}
    if task is not None:
        attrs["spanrl.task_id"] = task
    c = otlp.convert_span(span_with(**attrs), {})
    bad = [k for k, v in ((ids.ROLLOUT, rollout), (ids.ATTEMPT, attempt), (ids.TASK, task))
           if v is not None and not ids.is_valid(k, v)]
    if not bad:
        assert (c.dead_reason, c.rollout_id, c.span["rollout_id"], c.span["attempt_id"]) == (
            None, rollout, rollout, attempt)
    else:
        assert (c.dead_reason, c.span, c.raw) == ("invalid_id", None, span_with(**attrs).SerializeToString())
        assert c.rollout_id == (None if bad[0] == ids.ROLLOUT else rollout)
        key = {ids.ROLLOUT: "spanrl.rollout_id", ids.ATTEMPT: "spanrl.attempt_id", ids.TASK: "spanrl.task_id"}[bad[0]]
        assert c.dead_detail.startswith(f"span 'tool.search': {key} ")


def test_bridge_span_ids_from_the_resource_and_of_other_types_are_checked_as_text():
    c = otlp.convert_span(span_with(), {"spanrl.rollout_id": "r1", "spanrl.attempt_id": "a 0"})
    assert (c.dead_reason, c.rollout_id) == ("invalid_id", "r1")
    pb = span_with(**{"spanrl.rollout_id": "r1"})
    pb.attributes.append(KeyValue(key="spanrl.attempt_id", value=AnyValue(int_value=3)))
    pb.attributes.append(KeyValue(key="spanrl.task_id", value=AnyValue(int_value=7)))
    c = otlp.convert_span(pb, {})
    assert (c.dead_reason, c.span["attempt_id"], c.span["attributes"]["spanrl.task_id"]) == (None, "3", "7")
    orphan = otlp.convert_span(span_with(**{"spanrl.attempt_id": "not checked: no rollout"}), {})
    assert orphan.orphan and orphan.dead_reason is None
    assert otlp.convert_span(span_with(**{"spanrl.task_id": "a|b"}), {}).dead_reason == "invalid_id"  # orphans too


@pytest.fixture(scope="module")
def bridge_client():
    with TestClient(bridge.create_app(RecordingSink(Topics()), claim_client=object(), payload_bucket="b")) as c:
        yield c


@pytest.fixture(scope="module")
def proxy_client():
    app = proxy.create_app(Sink("127.0.0.1:1", Topics(), send_timeout_s=0.5), "http://127.0.0.1:1", "policy",
                           claim_client=object(), payload_bucket="b")
    with TestClient(app) as c:
        yield c


def path_ids() -> st.SearchStrategy[str]:
    """Ids that stay one path segment: no ``/`` (it splits the segment, whatever its escape),
    not ``.`` / ``..`` (a client collapses them), nothing that cannot be UTF-8."""
    return st.text(st.characters(codec="utf-8", exclude_characters="/"), min_size=1, max_size=140).filter(
        lambda v: v not in (".", "..")) | st.text("ab-", min_size=126, max_size=130)


SLOW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SLOW
@given(path_ids(), path_ids())
def test_proxy_path_ids_are_checked_before_anything_else(proxy_client, rollout, attempt):
    url = f"/rollouts/{quote(rollout, safe='')}/attempts/{quote(attempt, safe='')}/v1/chat/completions"
    r = proxy_client.post(url, json={"model": "other", "messages": [{"role": "user", "content": "x"}]})
    if ids.is_valid(ids.ROLLOUT, rollout) and ids.is_valid(ids.ATTEMPT, attempt):
        assert (r.status_code, r.json()["error"]["type"]) == (404, "model_not_found")  # past the ids
    else:
        error = r.json()["error"]
        assert (r.status_code, error["type"]) == (400, "invalid_id")
        assert error["param"] == ("rollout_id" if not ids.is_valid(ids.ROLLOUT, rollout) else "attempt_id")
        assert "1-128 characters" in error["message"]


def test_proxy_eval_and_messages_routes_check_the_path_ids_too(proxy_client):
    body = {"model": "other", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    long = "r" * 10_000
    for url in (f"/rollouts/{long}/attempts/0/v1/chat/completions", f"/eval/0/rollouts/{long}/attempts/0/v1/completions",
                f"/rollouts/{long}/attempts/0/v1/messages", f"/rollouts/r1/attempts/a%7C0/v1/responses"):
        r = proxy_client.post(url, json=body)
        assert (r.status_code, r.json()["error"]["type"]) == (400, "invalid_id"), url
    r = proxy_client.post("/v1/chat/completions", json=body, headers={"x-spanrl-rollout-id": long})
    assert (r.status_code, r.json()["error"]["type"], r.json()["error"]["param"]) == (
        400, "invalid_rollout_header", "x-spanrl-rollout-id")
    assert r.json()["error"]["message"].startswith("x-spanrl-rollout-id is 10000 characters; rollout ids are 1-128")


@SLOW
@given(path_ids(), near_ids, near_ids)
def test_bridge_rewards_and_rollout_ends_take_exactly_the_valid_ids(bridge_client, rollout, attempt, task):
    """Valid ids are recorded (200); a bad one is 400 ``invalid_id`` naming the field."""
    reward = bridge_client.post("/v1/rewards", json={"rollout_id": rollout, "attempt_id": attempt, "value": 1.0})
    end = bridge_client.post(f"/v1/rollouts/{quote(rollout, safe='')}/end", json={"attempt_id": attempt, "task_id": task})
    checks = [("rollout_id", ids.ROLLOUT, rollout), ("attempt_id", ids.ATTEMPT, attempt)]
    for r, fields in ((reward, checks), (end, checks + ([("task_id", ids.TASK, task)] if task else []))):
        bad = [name for name, kind, value in fields if not ids.is_valid(kind, value)]
        if not bad:
            assert (r.status_code, r.json()["status"]) == (200, "ok")
        else:
            assert (r.status_code, r.json()["error"]) == (400, "invalid_id")
            assert r.json()["detail"].startswith(f"{bad[0]} ") and "1-128 characters" in r.json()["detail"]
