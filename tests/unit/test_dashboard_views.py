"""The dashboard's pure parts: bounded views, summaries, waterfall, training rows, rates,
lag, auth; and its pages rendered from records fed in-process (no Kafka)."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from spanrl.core.settings import Settings
from spanrl.infra.dashboard import auth, views
from spanrl.infra.dashboard.app import create_app, safe_attributes


def _span(rid, seq, kind="llm", attempt="0", start_s=0.0, end_s=1.0, version=3, agent=None):
    llm = None if kind != "llm" else {
        "model": "policy", "policy_version": version, "prompt_token_ids": [1, 2], "completion_token_ids": [3],
        "completion_logprobs": [-0.5], "temperature": 1.0, "top_p": 1.0, "max_tokens": 4,
        "finish_reason": "stop", "request_id": "q"}
    return {"rollout_id": rid, "attempt_id": attempt, "sequence_id": seq, "trace_id": "t", "span_id": f"s{seq}",
            "parent_span_id": None, "name": f"{kind}-{seq}", "kind": kind, "source": "proxy",
            "start_time_unix_nano": int(1_000_000_000_000 * 1e6 + start_s * 1e9),
            "end_time_unix_nano": int(1_000_000_000_000 * 1e6 + end_s * 1e9), "status_code": "OK",
            "agent_name": agent, "attributes": {}, "llm": llm, "payload_ref": None}


def _event(rid, status, ms, attempt="0", task="t1"):
    return {"rollout_id": rid, "attempt_id": attempt, "task_id": task, "status": status, "group_size": 2,
            "runner_id": "runner-a", "timestamp_ms": ms, "error": "boom" if status == "failed" else None}


def _reward(rid, value, ms, final=True, attempt="0"):
    return {"rollout_id": rid, "attempt_id": attempt, "value": value, "final": final, "name": "reward",
            "span_id": None, "timestamp_ms": ms, "components": {}}


def _transition(rid, sid, reward):
    return {"rollout_id": rid, "attempt_id": "0", "span_id": sid, "task_id": "t1", "group_size": 2,
            "sequence_id": 0, "call_index": 0, "rollout_transition_count": 1, "agent_name": "solver",
            "model": "policy", "policy_version": 3, "prompt_token_ids": [1, 2], "completion_token_ids": [3],
            "behaviour_logprobs": [-0.5], "episode_return": reward, "reward": reward, "credit_rule": "identical",
            "status": "succeeded"}


def _account(rid, sid, trained=True):
    return {"rollout_id": rid, "attempt_id": "0", "task_id": "t1", "outcome": "emitted", "selection": "all",
            "calls": [{"span_id": sid, "sequence_id": 0, "agent_name": "solver", "agent_source": "call",
                       "trained": trained}], "timestamp_ms": 1_000_000_005_000}


def _fed() -> views.Views:
    v = views.Views()
    v.add("rollout", _event("r1", "started", 1_000_000_000_000))
    v.add("span", _span("r1", 0, start_s=0.5, end_s=1.5))
    v.add("span", _span("r1", 1, kind="tool", start_s=1.5, end_s=1.75))
    v.add("reward", _reward("r1", 0.25, 1_000_000_002_000, final=False))
    v.add("reward", _reward("r1", 1.0, 1_000_000_003_000))
    v.add("rollout", _event("r1", "succeeded", 1_000_000_004_000))
    v.add("transition", _transition("r1", "s0", 1.0))
    v.add("sample", {"transition": _transition("r1", "s0", 1.0), "advantage": 0.5, "group_id": "g",
                     "group_rollouts": 2, "group_mean": 0.5, "group_std": 0.5})
    v.add("call_account", _account("r1", "s0"))
    return v


def test_rollout_summary_counts_and_times():
    row = views.rollout_summary(_fed().rollouts["r1"])
    assert row == {"rollout_id": "r1", "last_ms": 1_000_000_005_000, "task_id": "t1", "runner_id": "runner-a",
                   "status": "succeeded", "attempts": 1, "attempt_statuses": {"0": "succeeded"}, "reward": 1.0,
                   "llm_calls": 1, "tool_calls": 1, "policy_versions": [3], "agents": ["solver"],
                   "duration_s": 4.0, "dead_letter_reasons": []}


def test_running_rollout_has_no_duration_and_account_only_rollout_takes_its_outcome():
    v = views.Views()
    v.add("rollout", _event("r2", "started", 10))
    v.add("call_account", {**_account("r3", "s0"), "outcome": "no_llm_calls"})
    assert views.rollout_summary(v.rollouts["r2"])["duration_s"] is None
    assert views.rollout_summary(v.rollouts["r2"])["status"] == "started"
    assert views.rollout_summary(v.rollouts["r3"])["status"] == "no_llm_calls"


def test_sample_gives_the_transition_its_advantage_and_spans_drop_logprobs():
    r = _fed().rollouts["r1"]
    assert r.transitions["s0"] == {"reward": 1.0, "episode_return": 1.0, "policy_version": 3,
                                   "agent_name": "solver", "advantage": 0.5}
    assert "completion_logprobs" not in r.spans[0]["llm"] and r.spans[0]["llm"]["completion_token_ids"] == [3]


def test_bounds_evict_oldest_rollout_and_cap_spans():
    v = views.Views(max_rollouts=2, max_spans_per_rollout=1, max_events=2)
    for rid in ("a", "b", "c"):
        v.add("span", _span(rid, 0))
        v.add("span", _span(rid, 1))
    for i in range(3):
        v.add("dead_letter", {"reason": f"x{i}", "detail": "", "stage": "assembly", "rollout_id": None,
                              "timestamp_ms": i})
    assert list(v.rollouts) == ["b", "c"] and v.evicted == 1
    assert [len(r.spans) for r in v.rollouts.values()] == [1, 1]
    assert [d["reason"] for d in v.dead_letters] == ["x1", "x2"]
    assert v.counts == {"span": 6, "dead_letter": 3}
    with pytest.raises(ValueError):
        views.Views(max_rollouts=0)
    with pytest.raises(ValueError):
        v.add("task", {})


def test_dead_letter_attaches_to_its_rollout():
    v = views.Views()
    v.add("dead_letter", {"reason": "rollout_timeout", "detail": "d", "stage": "assembly", "rollout_id": "r9",
                          "timestamp_ms": 7})
    assert views.rollout_summary(v.rollouts["r9"])["status"] == "dead-lettered"
    assert views.rollout_summary(v.rollouts["r9"])["dead_letter_reasons"] == ["rollout_timeout"]


def test_matches_filters():
    row = views.rollout_summary(_fed().rollouts["r1"])
    assert views.matches(row) and views.matches(row, runner="runner", task="t", status="succeeded", agent="solver")
    assert not views.matches(row, status="failed")
    assert not views.matches(row, agent="other")
    assert not views.matches(row, task="zz")
    assert not views.matches(row, runner="runner-b")


def test_dead_letter_matches():
    d = {"reason": "rollout_timeout", "task_id": "math-7"}
    assert views.dead_letter_matches(d) and views.dead_letter_matches(d, "math", "rollout_timeout")
    assert not views.dead_letter_matches(d, reason="no_llm_calls")
    assert not views.dead_letter_matches({**d, "task_id": None}, task="math")


def test_waterfall_orders_by_sequence_and_places_rewards():
    rows = views.waterfall(_fed().rollouts["r1"])
    assert [(x["kind"], x["sequence_id"], x["t0_s"], x["t1_s"]) for x in rows] == [
        ("llm", 0, 0.0, 1.0), ("tool", 1, 1.0, 1.25), ("reward", None, 1.5, 1.5), ("reward", None, 2.5, 2.5)]
    assert views.waterfall(views.Rollout("x")) == []


def test_training_rows_join_published_and_gate_decision():
    pub = {"run": "r", "version": 2, "uri": "u", "step": 4, "parent_version": 1, "manifest_sha256": "h",
           "created_ms": 100, "metrics": {"loss": 0.5}, "event": "published", "detail": None}
    gate = {**pub, "event": "refused", "created_ms": 200,
            "detail": json.dumps({"decision": {"accept": False, "reason": "worse"}})}
    other = {**pub, "run": "q", "version": 1}
    rows = views.training_rows([pub, gate, other], "r")
    assert rows == [{"run": "r", "version": 2, "step": 4, "published_ms": 100, "served_ms": None,
                     "refused_ms": 200, "metrics": {"loss": 0.5}, "gate": {"accept": False, "reason": "worse"},
                     "uri": "u"}]
    assert [(x["run"], x["version"]) for x in views.training_rows([pub, other])] == [("q", 1), ("r", 2)]


def test_loaded_times_take_reloads_of_the_run():
    hist = [{"version": 0, "uri": "", "reloaded": True, "at_ms": 5},
            {"version": 2, "uri": "s3://b/run1/000002/", "reloaded": True, "at_ms": 10},
            {"version": 2, "uri": "s3://b/run1/000002/", "reloaded": True, "at_ms": 30},
            {"version": 3, "uri": "s3://b/run1/000003/", "reloaded": False, "at_ms": 40},
            {"version": 4, "uri": "s3://b/other/000004/", "reloaded": True, "at_ms": 50}]
    assert views.loaded_times(hist, "run1") == {0: 5, 2: 30}


def test_rate_and_lag():
    assert views.rate_per_s([1000, 50_000, 60_000, 61_000], now_ms=61_000, window_s=60) == 3 / 60
    with pytest.raises(ValueError):
        views.rate_per_s([], 0, 0)
    assert views.consumer_lag({("spans", 0): 10, ("spans", 1): 5, ("rewards", 0): 3},
                              {("spans", 0): 7, ("spans", 1): None, ("rewards", 0): 4}) == {"spans": 8, "rewards": 0}


def test_cookie_value_and_query_without_token():
    assert auth.cookie_value("abc") == auth.cookie_value("abc") != auth.cookie_value("abd")
    assert len(auth.cookie_value("abc")) == 64 and "abc" not in auth.cookie_value("abc")
    assert auth.without_token("a=1&token=x&b=2&token=y") == "a=1&b=2"


def test_safe_attributes_hides_credential_like_keys():
    assert safe_attributes({"http.authorization": "Bearer s", "api_key": "k", "gen_ai.system": "openai"}) == {
        "http.authorization": "[hidden]", "api_key": "[hidden]", "gen_ai.system": "openai"}


@pytest.fixture
def client(tmp_path):
    report = {"policies": {"base": {"episodes": 4, "mean_reward": {"estimate": 0.25, "low": 0.0, "high": 0.5}}}}
    (tmp_path / "heldout-greedy.json").write_text(json.dumps(report))
    (tmp_path / "chaos.json").write_text(json.dumps({"faults": []}))  # not a report: left out
    (tmp_path / "summary.json").write_text(json.dumps({"heldout": {"sampled": report}}))
    s = Settings(auth_token="sekrit", base_model_dir="/nonexistent", trainer_port=1, reloader_port=1, kafka_port=1,
                 minio_port=1)
    app = create_app(s, tail=False, eval_dirs=[tmp_path, tmp_path / "missing"])
    app.state.tail.views.add("checkpoint", {"run": "r", "version": 1, "uri": "s3://b/r/000001/", "step": 1,
                                            "parent_version": 0, "manifest_sha256": "h", "created_ms": 5,
                                            "metrics": {"loss": 0.125}, "event": "published", "detail": None})
    for kind, rec in [("rollout", _event("r1", "started", 1_000_000_000_000)), ("span", _span("r1", 0)),
                      ("rollout", _event("r1", "succeeded", 1_000_000_004_000))]:
        app.state.tail.views.add(kind, rec)
    with TestClient(app) as c:
        yield c


def test_pages_need_the_token_and_a_token_link_sets_a_cookie(client):
    assert client.get("/health").status_code == 200
    r = client.get("/")
    assert r.status_code == 401 and r.text.startswith("401 missing_token")
    assert client.get("/?token=wrong").status_code == 401
    assert client.get("/", headers={"Authorization": "Bearer sekrit"}).status_code == 200
    r = client.get("/?task=t1&token=sekrit", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/?task=t1"
    assert r.cookies[auth.COOKIE] == auth.cookie_value("sekrit")
    page = client.get("/?task=t1")  # the client keeps the cookie
    assert page.status_code == 200 and 'data-rollout="r1"' in page.text and "sekrit" not in page.text


def test_rollout_page_shows_spans_without_a_tokenizer(client):
    h = {"Authorization": "Bearer sekrit"}
    page = client.get("/rollouts/r1", headers=h)
    assert page.status_code == 200 and "<svg" in page.text and "&lt;2 tokens&gt;" in page.text
    assert client.get("/rollouts/nope", headers=h).status_code == 404


def test_training_page_lists_versions_and_held_out_reports(client):
    page = client.get("/training?run=r", headers={"Authorization": "Bearer sekrit"})
    assert page.status_code == 200 and "<svg" in page.text and "0.125" in page.text
    assert "heldout-greedy.json" in page.text and "0.250 [0.000, 0.500]" in page.text
    assert "summary.json (sampled)" in page.text
    assert "chaos.json" not in page.text and "reloader status unavailable" in page.text


@pytest.fixture
def status_server():
    """A local HTTP server answering ``/status`` like the trainer (TrainerState) and the
    reloader would; returns its port."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    body = json.dumps({"run": "r", "version": 3, "step": 6, "updates": 5, "buffered": 7, "skipped": {},
                       "trained_offsets": {"samples:0": 40}, "last_metrics": {}, "last_checkpoint": None,
                       "pending_checkpoint": None, "retries": 0, "served_version": 1, "served_uri": "s3://b/r/000001/",
                       "target_version": 1, "vllm_synced": True, "pinned": None,
                       "history": [{"version": 1, "uri": "s3://b/r/000001/", "reloaded": True, "at_ms": 86_400_000}]
                       }).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/status" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_training_and_pipeline_pages_read_the_services_status(status_server, tmp_path):
    s = Settings(auth="open", base_model_dir="/nonexistent", trainer_port=status_server,
                 reloader_port=status_server, kafka_port=1, minio_port=1)
    app = create_app(s, tail=False, eval_dirs=[tmp_path])
    app.state.tail.views.add("checkpoint", {"run": "r", "version": 1, "uri": "s3://b/r/000001/", "step": 1,
                                            "parent_version": 0, "manifest_sha256": "h", "created_ms": 5,
                                            "metrics": {}, "event": "published", "detail": None})
    with TestClient(app) as c:
        page = " ".join(c.get("/training").text.split())  # default run: the one the reloader serves
        assert "<b>r v1</b> (synced)" in page and "run r v3, 5 updates, step 6, 7 samples buffered" in page
        assert "1970-01-02 00:00:00 UTC" in page  # v1 loaded by vLLM at the reloader's history time
        pipe = c.get("/pipeline")
        assert pipe.status_code == 200 and "Kafka:" in pipe.text  # no Kafka on port 1: said, not a crash
