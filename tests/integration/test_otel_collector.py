"""An agent that already exports to an OpenTelemetry Collector reaches spanrl through it.

The real Collector (the upstream components, built by infra/bootstrap.sh with the Collector
Builder from infra/otelcol/builder-config.yaml) runs infra/otelcol/collector.yaml as shipped:
the agent (tests/fixtures/otlp_env_agent.py: the OTel SDK configured by ``OTEL_*`` only, no
spanrl code) exports OTLP/gRPC to the Collector's 4317 role, and the Collector fans every
span out to a bridge from this checkout (OTLP/HTTP protobuf, gzip, with the bridge's bearer
token) and to the user's own OTLP/HTTP backend (here a small receiver in this module that
decodes what it is sent). Both must get the same spans, with the same ids.
"""
from __future__ import annotations

import gzip
import os
import secrets
import socket
import subprocess
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from spanrl.core.edge import bearer_headers
from spanrl.infra.stack import Stack
from tests.integration.services import S, free_port, of_rollout, own_topics, read_topic, start_service, stop
from tests.integration.services import topic_prefix as _prefix
from tests.integration.test_otlp_grpc import run_agent

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "infra" / "otelcol" / "collector.yaml"
COLLECTOR = S.cache_dir / "bin" / "otelcol-spanrl"


class OwnBackend:
    """The user's own tracing backend: an OTLP/HTTP protobuf receiver that keeps every span
    it is sent as ``(name, hex span id, attributes)``."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, dict]] = []
        self.requests = 0
        backend = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest.FromString(body)
                backend.requests += 1
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        for sp in ss.spans:
                            attrs = {a.key: a.value.string_value for a in sp.attributes}
                            backend.spans.append((sp.name, sp.span_id.hex(), attrs))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer((S.host, 0), Handler)
        self.url = f"http://{S.host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def _wait_listening(port: int, proc: subprocess.Popen, log: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the Collector exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with socket.create_connection((S.host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"the Collector did not listen on {port} in {timeout_s}s:\n{log.read_text()[-3000:]}")


def _start_collector(bridge_url: str, token: str, own_url: str, log: Path) -> tuple[subprocess.Popen, int]:
    """The Collector running the shipped config against ``bridge_url`` with ``token`` and the
    user's backend ``own_url``, on ports of its own; returns it and its gRPC port once it listens."""
    grpc_port, http_port = free_port(), free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL")},
           "SPANRL_BRIDGE_URL": bridge_url, "SPANRL_AUTH_TOKEN": token, "OWN_OTLP_ENDPOINT": own_url,
           "OTELCOL_GRPC_ENDPOINT": f"{S.host}:{grpc_port}", "OTELCOL_HTTP_ENDPOINT": f"{S.host}:{http_port}"}
    with open(log, "w") as out:
        proc = subprocess.Popen([str(COLLECTOR), f"--config={CONFIG}"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_listening(grpc_port, proc, log)
    except BaseException:
        stop(proc)
        raise
    return proc, grpc_port


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    """Kafka, a bridge on topics of its own with a token, the user's backend, and the
    Collector between them, running the shipped config."""
    assert COLLECTOR.exists(), f"{COLLECTOR} is missing: `make bootstrap` builds it (infra/otelcol/)"
    Stack(S).start("kafka")
    token = "otelcol-" + secrets.token_urlsafe(16)
    own = OwnBackend()
    with own_topics("otelcol") as topics:
        bridge, bridge_url = start_service("spanrl.producers.bridge", "--topic-prefix", _prefix(topics),
                                           env={"SPANRL_AUTH_TOKEN": token})
        log = tmp_path_factory.mktemp("otelcol") / "collector.log"
        try:
            proc, grpc_port = _start_collector(bridge_url, token, own.url, log)
            try:
                yield {"topics": topics, "bridge_url": bridge_url, "token": token, "own": own, "log": log,
                       "grpc": f"http://{S.host}:{grpc_port}", "proc": proc}
            finally:
                stop(proc)
        finally:
            stop(bridge)
            own.close()


def test_the_collector_fans_an_agents_export_out_to_spanrl_and_to_the_users_backend(collector):
    rid = f"otelcol-{uuid.uuid4().hex[:12]}"
    done = run_agent(rid, collector["grpc"], None)  # the agent knows only the Collector, no token
    assert done.returncode == 0, done.stderr

    topics = collector["topics"]
    spans = of_rollout(read_topic(topics.spans, lambda rs: len(of_rollout(rs, rid)) >= 3, 20), rid)
    by_name = {s["name"]: s for s in spans}
    assert sorted(by_name) == ["agent.solve", "spanrl.reward", "tool.search"], collector["log"].read_text()[-3000:]
    assert by_name["agent.solve"]["agent_name"] == "solver"
    assert by_name["tool.search"]["parent_span_id"] == by_name["agent.solve"]["span_id"]
    rewards = of_rollout(read_topic(topics.rewards, lambda rs: bool(of_rollout(rs, rid)), 10), rid)
    assert [(r["value"], r["attempt_id"]) for r in rewards] == [(0.5, "0")]

    own = collector["own"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len([s for s in own.spans if s[2].get("spanrl.rollout_id") == rid]) < 3:
        time.sleep(0.2)
    theirs = {name: sid for name, sid, attrs in own.spans if attrs.get("spanrl.rollout_id") == rid}
    assert theirs == {name: s["span_id"] for name, s in by_name.items()}

    status = httpx.get(collector["bridge_url"] + "/status", headers=bearer_headers(collector["token"])).json()
    assert status["spans"] >= 3 and status.get("invalid_token", 0) == 0


def test_a_collector_with_the_wrong_token_gets_nothing_into_spanrl(collector, tmp_path):
    """The same config with a wrong SPANRL_AUTH_TOKEN: the bridge refuses (401), the Collector
    logs the refused export, the user's backend still gets the spans, Kafka gets none."""
    own, topics = collector["own"], collector["topics"]
    log = tmp_path / "collector.log"
    proc, grpc_port = _start_collector(collector["bridge_url"], "not-the-token", own.url, log)
    try:
        rid = f"otelcol-{uuid.uuid4().hex[:12]}"
        assert run_agent(rid, f"http://{S.host}:{grpc_port}", None).returncode == 0
        mine = lambda: [s for s in own.spans if s[2].get("spanrl.rollout_id") == rid]  # noqa: E731
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and ("401" not in log.read_text() or len(mine()) < 3):
            time.sleep(0.2)
        assert "401" in log.read_text(), log.read_text()[-3000:]
        assert len(mine()) == 3
        assert not of_rollout(read_topic(topics.spans, lambda rs: False, 3), rid)
        status = httpx.get(collector["bridge_url"] + "/status", headers=bearer_headers(collector["token"])).json()
        assert status["invalid_token"] >= 1
    finally:
        stop(proc)
