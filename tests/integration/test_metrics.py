"""``GET /metrics`` of every spanrl service of the running stack (and vLLM's): Prometheus text
that prometheus_client's parser reads, with the named counters and histograms; every metric the
Grafana dashboard (infra/monitoring/grafana-dashboard.json) queries is exposed."""
from __future__ import annotations

import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from spanrl.core.edge import bearer_headers

from tests.unit.test_monitoring import dashboard_metric_names

pytestmark = pytest.mark.integration

#: service -> families its /metrics must have (counters without the _total suffix)
WANTED = {
    "proxy": {"spanrl_proxy_requests", "spanrl_proxy_spans", "spanrl_proxy_refusals", "spanrl_proxy_error_responses",
              "spanrl_proxy_dead_letters", "spanrl_proxy_upstream_seconds", "spanrl_proxy_kafka_ack_seconds",
              "spanrl_proxy_policy_version"},
    "bridge": {"spanrl_bridge_requests", "spanrl_bridge_spans", "spanrl_bridge_rewards", "spanrl_bridge_refusals",
               "spanrl_bridge_dead_letters", "spanrl_bridge_kafka_ack_seconds"},
    "worker": {"spanrl_worker_spans_in", "spanrl_worker_transitions_out", "spanrl_worker_samples_out",
               "spanrl_worker_dead_letters", "spanrl_worker_reward_to_transition_seconds"},
    "trainer": {"spanrl_trainer_updates", "spanrl_trainer_retries", "spanrl_trainer_skipped_samples",
                "spanrl_trainer_policy_version", "spanrl_trainer_last_loss"},
    "reloader": {"spanrl_reloader_served_version", "spanrl_reloader_reloads", "spanrl_reloader_reload_seconds"},
    "vllm": {"vllm:num_requests_running", "vllm:generation_tokens", "vllm:e2e_request_latency_seconds"},
}


def urls(s) -> dict[str, str]:
    base = f"http://{s.host}"
    return {"proxy": s.proxy_url, "bridge": s.bridge_url, "worker": f"{base}:{s.faust_web_port}",
            "trainer": f"{base}:{s.trainer_port}", "reloader": f"{base}:{s.reloader_port}", "vllm": s.vllm_url}


def scrape(url: str, headers: dict) -> list:
    r = httpx.get(url + "/metrics", headers=headers, timeout=10)
    assert r.status_code == 200, (url, r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("text/plain"), r.headers["content-type"]
    return list(text_string_to_metric_families(r.text))


def test_every_service_exposes_prometheus_metrics(stack, settings):
    # earlier tests stop and restart services (the main job restarts the trainer with its own
    # settings; CI saw the trainer's port refused here): bring every component up first
    stack.up()
    headers = bearer_headers(settings.auth_token)
    # one greedy call on the evaluation route (recorded to spans.eval, never trained on): the
    # proxy's request counter and its upstream and Kafka ack histograms move
    before = {s.name: s.value for f in scrape(settings.proxy_url, headers) for s in f.samples}
    r = httpx.post(f"{settings.proxy_url}/eval/0/rollouts/metrics-{uuid.uuid4().hex[:8]}/attempts/0/v1/chat/completions",
                   json={"model": settings.model_name, "messages": [{"role": "user", "content": "Hi"}],
                         "max_tokens": 2}, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    exposed: dict[str, set[str]] = {}
    for service, url in urls(settings).items():
        families = scrape(url, headers)
        names = {f.name for f in families}
        assert WANTED[service] <= names, (service, WANTED[service] - names)
        exposed[service] = names | {s.name for f in families for s in f.samples}
        if service == "proxy":
            after = {s.name: s.value for f in families for s in f.samples}
            assert after["spanrl_proxy_requests_total"] >= before["spanrl_proxy_requests_total"] + 1
            assert after["spanrl_proxy_eval_requests_total"] >= before["spanrl_proxy_eval_requests_total"] + 1
            assert after["spanrl_proxy_kafka_ack_seconds_count"] >= before.get("spanrl_proxy_kafka_ack_seconds_count", 0) + 1
            assert any(s.name == "spanrl_proxy_upstream_seconds_count" and s.labels == {"endpoint": "chat.completions",
                                                                                         "stream": "false"} and s.value >= 1
                       for f in families for s in f.samples)

    # the dashboard queries only what is exposed (a labelled histogram nobody observed yet has
    # its family but no samples: its _bucket/_sum/_count count as exposed through the family)
    everything = set().union(*exposed.values())
    missing = {n for n in dashboard_metric_names()
               if n not in everything and n.removesuffix("_total") not in everything
               and not any(n == fam + suffix for fam in everything for suffix in ("_bucket", "_sum", "_count"))}
    assert not missing, missing
