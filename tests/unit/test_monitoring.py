"""infra/monitoring/: the scrape config targets the stack's ports; the dashboard is well formed.
(That every metric the dashboard queries is exposed is checked against the running stack:
tests/integration/test_metrics.py.)"""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from spanrl.core.settings import Settings

MONITORING = Path(__file__).resolve().parents[2] / "infra" / "monitoring"
JOB_PORT = {"spanrl-proxy": "proxy_port", "spanrl-bridge": "bridge_port", "spanrl-worker": "faust_web_port",
            "spanrl-trainer": "trainer_port", "spanrl-reloader": "reloader_port", "vllm": "vllm_port"}
#: metric names in a PromQL expression: spanrl's own and vLLM's (``vllm:``)
METRIC = re.compile(r"\b(?:spanrl_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def dashboard_metric_names() -> set[str]:
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return {name for p in dash["panels"] for t in p["targets"] for name in METRIC.findall(t["expr"])}


def test_scrape_config_targets_the_default_ports():
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    host = Settings.model_fields["host"].default
    targets = {j["job_name"]: [t for c in j["static_configs"] for t in c["targets"]] for j in config["scrape_configs"]}
    assert targets == {job: [f"{host}:{Settings.model_fields[field].default}"] for job, field in JOB_PORT.items()}


def test_dashboard_panels_are_well_formed():
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    assert dash["uid"] == "spanrl-stack" and len(dash["panels"]) == 19
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for p in dash["panels"]:
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(set(refs)) == len(refs) and all(t["expr"] for t in p["targets"]), p["title"]
    names = dashboard_metric_names()
    assert "spanrl_worker_reward_to_transition_seconds_bucket" in names and "vllm:num_requests_running" in names
