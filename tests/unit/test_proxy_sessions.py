"""The proxy's per-attempt state: sequence counters forgotten after an idle time.

The load balancer's side (every call of a session reaching one proxy) is
tests/unit/test_load_balancer.py, through a real nginx.
"""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from spanrl.core.settings import ProducerSettings, StreamSettings
from spanrl.producers import proxy
from spanrl.producers.kafka import Sink, Topics


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_counter_forgets_an_idle_attempt():
    clock = Clock()
    seq = proxy.SequenceCounter(idle_s=60.0, timer=clock)
    assert [seq.next("r1", "0") for _ in range(3)] == [0, 1, 2]
    clock.t += 30
    assert seq.next("r2", "0") == 0 and len(seq) == 2
    clock.t += 59.5  # r1 idle 89.5 s -> gone; r2 idle 59.5 s -> kept
    assert len(seq) == 1
    assert seq.next("r2", "0") == 1  # a call resets r2's idle time ...
    clock.t += 59.5
    assert seq.next("r2", "0") == 2 and len(seq) == 1  # ... so r2 counts on
    assert seq.next("r1", "0") == 0  # r1 was forgotten: it counts from 0 again
    clock.t += 60.0
    assert len(seq) == 0


def test_counter_without_idle_time_keeps_every_attempt():
    clock = Clock()
    seq = proxy.SequenceCounter(timer=clock)
    assert [seq.next("a", "0"), seq.next("a", "1"), seq.next("a", "0")] == [0, 0, 1]
    clock.t += 1e9
    assert len(seq) == 2 and seq.next("a", "0") == 2


def test_default_idle_time_outlives_the_stream_jobs_end_of_an_attempt():
    """Forgetting is safe only once the stream job has ended the attempt (a later call is a
    late span there, whatever its sequence id): the default idle time is longer than both of
    the stream job's idle ends."""
    s = StreamSettings(_env_file=None)
    assert ProducerSettings(_env_file=None).proxy_rollout_idle_s == 1800.0
    assert 1800.0 > max(s.rollout_timeout_s, s.production_idle_s) == 900.0


@pytest.mark.parametrize("bad", [0, -5])
def test_idle_time_must_be_positive(bad):
    with pytest.raises(ValidationError, match="must be > 0 s"):
        ProducerSettings(_env_file=None, proxy_rollout_idle_s=bad)


def test_status_and_metrics_count_the_attempts_held():
    app = proxy.create_app(Sink("127.0.0.1:1", Topics(), send_timeout_s=1.0), "http://127.0.0.1:1", "policy",
                           rollout_idle_s=60.0)
    client = TestClient(app)
    assert client.get("/status").json()["sequence_attempts"] == 0
    assert "spanrl_proxy_sequence_attempts 0.0" in client.get("/metrics").text


def test_a_session_moved_to_another_unit_keeps_its_call_order():
    """Two proxy processes (two policy units) write one session's spans to one log (the
    rollout's partition): two calls on the first unit, then, the unit failed, two on the
    second. Each proxy numbers from 0 and stamps its instance; the assembler, reading the
    log in order, emits the calls in the order they were made."""
    import json
    from pathlib import Path

    import httpx

    from spanrl.schemas import codec
    from tests.unit.test_call_order import assemble
    from tests.unit.test_producers_bridge import RecordingSink

    answer = json.loads((Path(__file__).parent.parent / "fixtures" / "vllm_chat_completion.json").read_text())
    log: list[tuple[str, str | None, bytes]] = []  # the rollout's partition of the spans topic
    units = []
    for _ in range(2):
        sink = RecordingSink(Topics())
        sink.sent = log
        app = proxy.create_app(sink, "http://vllm", "policy", claim_client=object(), payload_bucket="b")
        units.append(app)
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for app, calls in zip(units, (2, 2)):
        with TestClient(app) as client:
            app.state.client = httpx.AsyncClient(
                base_url="http://vllm", transport=httpx.MockTransport(lambda r: httpx.Response(200, json=answer)))
            for _ in range(calls):
                assert client.post("/v1/chat/completions", json=body,
                                   headers={"x-spanrl-rollout-id": "s1"}).status_code == 200
    spans = [codec.decode("span", value) for _, _, value in log]
    assert [s["sequence_id"] for s in spans] == [0, 1, 0, 1]
    instances = [s["attributes"]["spanrl.proxy_instance"] for s in spans]
    assert instances[0] == instances[1] != instances[2] == instances[3]
    out = assemble("s1", "0", [(s, ("spans", 0, offset)) for offset, s in enumerate(spans)])
    assert out.dead_letters == []
    assert [t["span_id"] for t in out.transitions] == [s["span_id"] for s in spans]
    assert [t["call_index"] for t in out.transitions] == [0, 1, 2, 3]
