"""A JavaScript agent's spans through the real bridge: the OpenTelemetry JS SDK's default
exporter (@opentelemetry/exporter-trace-otlp-http: OTLP/JSON), from Node, against a bridge
on this module's own topics; its spans land in Kafka as the Python SDK's protobuf export's
would (tests/fixtures/otlp_json_js: the pinned packages, installed by `make bootstrap`)."""
from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from spanrl.infra.stack import Stack
from tests.integration.services import S, of_rollout, own_topics, read_topic, start_service, stop
from tests.integration.services import topic_prefix as _prefix

pytestmark = pytest.mark.integration
JS = Path(__file__).resolve().parents[1] / "fixtures" / "otlp_json_js"


@pytest.fixture(scope="module")
def bridge():
    Stack(S).start("kafka")
    with own_topics("jstest") as topics:
        proc, url = start_service("spanrl.producers.bridge", "--topic-prefix", _prefix(topics))
        try:
            yield topics, url
        finally:
            stop(proc)


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_js_sdk_default_exporter_reaches_kafka(bridge, compression):
    topics, url = bridge
    assert shutil.which("node"), "Node.js is needed (installed on this machine kind)"
    assert (JS / "node_modules").is_dir(), "run `make bootstrap` (npm ci in tests/fixtures/otlp_json_js)"
    rid = f"js-{uuid.uuid4().hex[:12]}"
    done = subprocess.run(["node", "export.js", f"{url}/v1/traces", compression, rid], cwd=JS,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr  # the exporter saw a 2xx: its spans are in Kafka

    spans = of_rollout(read_topic(topics.spans, lambda rs: len(of_rollout(rs, rid)) >= 2, 10), rid)
    by_name = {s["name"]: s for s in spans}
    assert sorted(by_name) == ["agent.solve", "chat smollm2"]
    llm = by_name["chat smollm2"]
    assert (llm["kind"], llm["source"], llm["agent_name"], llm["sequence_id"]) == ("llm", "otlp", "solver", 0)
    call = llm["llm"]
    assert (call["model"], call["policy_version"]) == ("smollm2-135m", 3)
    assert (call["prompt_token_ids"], call["completion_token_ids"]) == ([1, 9690, 198, 0, 2], [17, 2767, 0])
    assert call["completion_logprobs"] == [-0.25, 0.0, -1.5]
    assert (llm["trace_id"], llm["span_id"]) == ("0af7651916cd43dd8448eb211c80319c", "00f067aa0ba902b7")
    assert llm["parent_span_id"] == "b7ad6b7169203331" == by_name["agent.solve"]["span_id"]
