"""An agent the trainer never launched (issue 12 §2), on the real stack: the example support
service (examples/support_agent) in this process, the bridge and the proxy from this checkout
(``python -m spanrl.producers.bridge|proxy`` on free ports, the stack's vLLM behind the proxy)
and a Faust worker, all on private ``sjtest-<id>-*`` topics of the stack's Kafka. No runner, no
tasks topic, no lifecycle event: the service calls the proxy's plain ``/v1``, exports its own
OTel spans, and sends each session's reward later, from the user's rating."""
import asyncio

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from examples.support_agent.service import AGENT, create_app
from spanrl.infra.stack import Stack
from spanrl.producers import instrument as inst
from spanrl.trainer import losses
from tests.integration.test_stream_app import _counters, _private_pipeline, _read

pytestmark = pytest.mark.integration
TASK = "support/hello"


def _serve_and_rate(p, provider, model: str):
    """Users of the support service: sessions A (two turns) and B under the label, C without;
    once their spans are all on ``spans``, B's explicit end, the ratings (A up, B down, C up)
    and C rated again."""
    with TestClient(create_app(p.proxy_url, model, provider, TASK, 2, max_tokens=8)) as grouped, \
            TestClient(create_app(p.proxy_url, model, provider, max_tokens=8)) as alone:
        a = grouped.post("/ask", json={"question": "Hello, who are you?"}).json()
        a2 = grouped.post("/ask", json={"question": "And what can you do?", "session": a["session"]}).json()
        b = grouped.post("/ask", json={"question": "Hi there!"}).json()
        c = alone.post("/ask", json={"question": "Good morning."}).json()
        assert provider.force_flush(30_000)
        # 4 proxy calls + 4 invoke_agent spans joined by trace: all in before any rating
        spans = asyncio.run(_read(p.names, ("spans",), lambda g: len(g["spans"]) >= 8, 60))["spans"]
        # B's user closed the chat: an explicit end (status failed) through the bridge, the rating later
        end = httpx.post(f"{p.bridge_url}/v1/rollouts/{b['session']}/end", timeout=30,
                         json={"status": "failed", "error": "user closed the chat"})
        assert (end.status_code, end.json()) == (200, {"status": "ok", "rollout_id": b["session"]})
        ratings = [grouped.post("/feedback", json={"session": a["session"], "rating": "up"}),
                   grouped.post("/feedback", json={"session": b["session"], "rating": "down"}),
                   alone.post("/feedback", json={"session": c["session"], "rating": "up"})]
        unknown = alone.post("/feedback", json={"session": c["session"], "rating": "up"})
    return spans, (a, a2, b, c), ratings, unknown


def test_production_agent_without_runner_is_assembled_grouped_and_rewarded_late(tmp_path, settings):
    """Sessions A (two turns) and B ask under the task label ``support/hello`` (group of two),
    session C without a label (a group of one). Their spans (the proxy's records and the
    service's ``invoke_agent`` spans, joined by trace) arrive first; then B is ended through the
    bridge, and the ratings come (A up, B down, C up), ending A and C. Out come one transition per call (exact token
    ids, identical credit, agent ``support`` from the service's span), GRPO samples of the
    group of two (advantages +1 / -1) and C's sample in a group of one (advantage 0 in the
    sample, the batch baseline in the trainer), nothing dead-lettered."""
    Stack(settings).up(["kafka", "minio", "vllm"])
    before = inst._provider
    with _private_pipeline(tmp_path, SPANRL_ORPHAN_TIMEOUT_S="30") as p:
        provider = inst.instrument(AGENT, bridge_url=p.bridge_url, set_global=False, frameworks=False)
        inst.propagate_trace_context()
        try:
            spans, sessions, ratings, unknown = _serve_and_rate(p, provider, settings.model_name)
            got = asyncio.run(_read(p.names, ("transitions", "samples", "dead-letter"),
                                    lambda g: len(g["transitions"]) >= 4 and len(g["samples"]) >= 4, 90))
            counters = _counters(p.web_port)
        finally:
            provider.shutdown()
            inst._provider = before
    worker_log = (tmp_path / "worker.log").read_text(errors="replace")[-3000:]

    # the proxy minted each session's rollout id; A's second turn reused it
    a, a2, b, c = sessions
    ra, rb, rc = a["session"], b["session"], c["session"]
    assert a2["session"] == ra and len({ra, rb, rc}) == 3 and all(r.startswith("prod-") for r in (ra, rb, rc))
    assert [r.json()["reward"] for r in ratings] == [1.0, 0.0, 1.0] and unknown.status_code == 404
    calls = {s["span_id"]: s for s in spans if s["source"] == "proxy"}
    assert sorted(s["rollout_id"] for s in calls.values()) == sorted([ra, ra, rb, rc])
    assert all(s["attempt_id"] == "0" and s["attributes"]["spanrl.origin"] == "production" for s in calls.values())

    # one transition per call, in call order, with the proxy's exact token ids
    trs = sorted(got["transitions"], key=lambda t: (t["rollout_id"], t["call_index"]))
    assert len(trs) == 4, (got, worker_log)
    assert sorted((t["rollout_id"], t["call_index"], t["task_id"], t["group_size"], t["reward"], t["agent_name"])
                  for t in trs) == sorted([(ra, 0, TASK, 2, 1.0, AGENT), (ra, 1, TASK, 2, 1.0, AGENT),
                                           (rb, 0, TASK, 2, 0.0, AGENT), (rc, 0, rc, 1, 1.0, AGENT)])
    for t in trs:
        llm = calls[t["span_id"]]["llm"]
        assert (t["prompt_token_ids"], t["completion_token_ids"]) == (llm["prompt_token_ids"], llm["completion_token_ids"])
        # B's status is its explicit end's; A and C ended at their rating
        assert (t["status"], t["attempt_id"]) == ("failed" if t["rollout_id"] == rb else "succeeded", "0")

    # samples: GRPO inside the labelled group; C alone in its group
    samples = sorted(got["samples"], key=lambda s: (s["transition"]["rollout_id"], s["transition"]["call_index"]))
    assert sorted((s["transition"]["rollout_id"], s["group_id"], s["group_rollouts"], round(s["advantage"], 4))
                  for s in samples) == sorted([(ra, f"{TASK}/0", 2, 1.0), (ra, f"{TASK}/0", 2, 1.0),
                                               (rb, f"{TASK}/0", 2, -1.0), (rc, f"{rc}/0", 1, 0.0)])
    assert got["dead-letter"] == [] and counters["dead_letters_out"] == {}, worker_log
    # the trainer's advantage for this batch: C (group of one, R=1) gets the batch baseline
    # (1 - 0.75) / std(1, 1, 0, 1) = 0.25 / 0.4330; the group's samples keep +1 / -1
    adv = losses.singleton_batch_advantages(
        torch.tensor([s["advantage"] for s in samples]),
        torch.tensor([s["transition"]["episode_return"] for s in samples]),
        torch.tensor([s["group_rollouts"] for s in samples]))
    expected = {ra: 1.0, rb: -1.0, rc: 0.25 / 0.1875 ** 0.5}
    assert adv.tolist() == pytest.approx([expected[s["transition"]["rollout_id"]] for s in samples], abs=1e-4)
