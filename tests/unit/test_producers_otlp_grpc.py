"""OTLP/gRPC in the bridge (producers/otlp_grpc.py): the real Python gRPC exporter against the
bridge app served in-process (uvicorn and the grpc.aio receiver its lifespan starts, both on
127.0.0.1:0), Kafka replaced by the recording sink of test_producers_bridge.py. The same spans
exported over gRPC and over OTLP/HTTP protobuf give the same records; the bearer token, the
body bound, bad bodies and Kafka's refusals are answered with gRPC status codes."""
from __future__ import annotations

import asyncio
import os
import socket
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
import uvicorn
import uvloop
from google.protobuf.any_pb2 import Any as PbAny
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spanrl.producers import bridge, otlp_grpc
from spanrl.producers.kafka import KafkaUnavailable, Topics
from spanrl.schemas import codec
from tests.unit.test_producers_bridge import RecordingSink, otlp_with_name

TOKEN = "s3cret-token"


@pytest.fixture(autouse=True)
def _no_exporter_environment(monkeypatch):
    """The exporters read OTEL_EXPORTER_OTLP_* when an argument is not given."""
    for name in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_COMPRESSION", "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
                 "OTEL_EXPORTER_OTLP_INSECURE", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(bridge, "now_ms", lambda: 1_700_000_000_000)  # the dead letters' time


def finished_spans():
    """An agent span with an LLM call (token ids, log-probs) and a reward inside it, an
    orphan (no rollout id) and a span whose rollout id is over the limit (a dead letter), as
    the SDK hands them to an exporter."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource({"service.name": "agent", "spanrl.agent_name": "solver"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("grpc-test")
    ids = {"spanrl.rollout_id": "r1", "spanrl.attempt_id": "0"}
    with tracer.start_as_current_span("agent.solve", attributes=ids):
        with tracer.start_as_current_span("chat smollm2", attributes={
                **ids, "spanrl.sequence_id": 0, "gen_ai.request.model": "smollm2",
                "spanrl.llm.prompt_token_ids": [1, 0, 9690], "spanrl.llm.completion_token_ids": [17, 2],
                "spanrl.llm.completion_logprobs": [-0.25, 0.0], "spanrl.llm.policy_version": 3}):
            pass
        with tracer.start_as_current_span("spanrl.reward", attributes={**ids, "spanrl.reward.value": 0.75}):
            pass
    with tracer.start_as_current_span("orphan"):
        pass
    with tracer.start_as_current_span("bad id", attributes={"spanrl.rollout_id": "x" * 200}):
        pass
    provider.shutdown()
    return memory.get_finished_spans()


@asynccontextmanager
async def served(app):
    """``app`` on uvicorn at 127.0.0.1:0 in the running loop, its lifespan included (which
    starts the gRPC receiver); yields (HTTP port, gRPC port)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("the app did not start (uvicorn logged why)")
        await asyncio.sleep(0.02)
    try:
        yield server.servers[0].sockets[0].getsockname()[1], app.state.grpc_port
    finally:
        server.should_exit = True
        await task


def app_for(sink, **kw):
    return bridge.create_app(sink, claim_client=object(), payload_bucket="b", grpc_address="127.0.0.1:0", **kw)


def run(coro, loop: str = "asyncio"):
    """``coro`` in a fresh asyncio or uvloop loop (``uvicorn.run``, the bridge's ``main``, picks uvloop)."""
    factory = uvloop.new_event_loop if loop == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


async def raw_export(port: int, body: bytes, metadata=(), compression=None) -> bytes:
    """One Export call with ``body`` as the request's bytes (no client-side checks)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(f"/{otlp_grpc.SERVICE}/{otlp_grpc.METHOD}")
        return await call(body, metadata=metadata, compression=compression, timeout=10)


async def refusal(port: int, body: bytes, metadata=(), compression=None) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await raw_export(port, body, metadata, compression)
    return exc.value


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_grpc_and_http_protobuf_exports_of_the_same_spans_give_the_same_records(loop):
    spans = finished_spans()
    sinks = {"grpc": RecordingSink(Topics.with_prefix("t-")), "http": RecordingSink(Topics.with_prefix("t-"))}

    async def go():
        results = {}
        for way, sink in sinks.items():
            app = app_for(sink)
            async with served(app) as (http_port, grpc_port):
                exporter = (GrpcExporter(endpoint=f"http://127.0.0.1:{grpc_port}", insecure=True) if way == "grpc"
                            else HttpExporter(endpoint=f"http://127.0.0.1:{http_port}/v1/traces"))
                results[way] = await asyncio.to_thread(exporter.export, spans)
                exporter.shutdown()
                status = app.state.metrics.copy()
            results[way + "_status"] = status
        return results

    results = run(go(), loop)
    assert results["grpc"] == results["http"] == SpanExportResult.SUCCESS
    assert sinks["grpc"].sent == sinks["http"].sent
    assert [(topic, key) for topic, key, _ in sinks["grpc"].sent] == [
        ("t-spans", "r1"), ("t-spans", "r1"), ("t-rewards", "r1"), ("t-spans", "r1"),
        ("t-orphan-spans", next(format(s.context.trace_id, "032x") for s in spans if s.name == "orphan")),
        ("t-dead-letter", None)]
    llm = codec.decode("span", sinks["grpc"].sent[0][2])
    assert (llm["name"], llm["agent_name"], llm["llm"]["prompt_token_ids"], llm["llm"]["completion_logprobs"],
            llm["llm"]["policy_version"]) == ("chat smollm2", "solver", [1, 0, 9690], [-0.25, 0.0], 3)
    dead = codec.decode("dead_letter", sinks["grpc"].sent[-1][2])
    assert (dead["reason"], dead["rollout_id"]) == ("invalid_id", None)
    assert dead["detail"].startswith("span 'bad id': spanrl.rollout_id is 200 characters; rollout ids are 1-128")
    g, h = results["grpc_status"], results["http_status"]
    assert (g["requests"], g["grpc_requests"], g["spans"], g["orphan_spans"], g["rewards"],
            g["dead_letter.invalid_id"]) == (1, 1, 3, 1, 1, 1)
    assert (h["requests"], h.get("grpc_requests", 0), h["spans"]) == (1, 0, 3)


def test_grpc_answers_partial_success_as_the_http_route_does():
    """The answer is the same ExportTraceServiceResponse: dead-lettered spans counted in
    ``partial_success`` (OTLP spec, "Partial Success")."""
    req = ExportTraceServiceRequest()
    s = req.resource_spans.add().scope_spans.add().spans
    ok = s.add(trace_id=b"\1" * 16, span_id=b"\2" * 8, name="tool.search")
    ok.attributes.append(KeyValue(key="spanrl.rollout_id", value=AnyValue(string_value="r1")))
    bad = s.add(trace_id=b"\1" * 16, span_id=b"\3" * 8, name="tool.search")
    bad.attributes.append(KeyValue(key="spanrl.rollout_id", value=AnyValue(string_value="r 1")))
    s.add(trace_id=b"\0" * 16, span_id=b"\4" * 8, name="no trace")

    async def go():
        async with served(app_for(RecordingSink(Topics()))) as (_, port):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await TraceServiceStub(channel).Export(req, timeout=10)

    answer = run(go())
    assert isinstance(answer, ExportTraceServiceResponse)
    assert (answer.partial_success.rejected_spans, answer.partial_success.error_message) == (
        2, "dead-lettered: invalid_id=1, no_rollout_id=1")


def test_grpc_needs_the_bearer_token_when_one_is_set():
    spans = finished_spans()
    body = b"not read: refused before it is decoded"
    sink = RecordingSink(Topics())
    app = app_for(sink, credentials=TOKEN)

    async def go():
        async with served(app) as (_, port):
            missing = await refusal(port, body)
            wrong = await refusal(port, body, (("authorization", "Bearer nope"),))
            other_scheme = await refusal(port, body, (("authorization", f"Basic {TOKEN}"),))
            endpoint = f"http://127.0.0.1:{port}"
            good = GrpcExporter(endpoint=endpoint, insecure=True, headers={"authorization": f"Bearer {TOKEN}"})
            bad = GrpcExporter(endpoint=endpoint, insecure=True, headers={"authorization": "Bearer nope"})
            results = [await asyncio.to_thread(e.export, spans) for e in (good, bad)]
            for e in (good, bad):
                e.shutdown()
            return missing, wrong, other_scheme, results

    missing, wrong, other_scheme, results = run(go())
    assert [e.code() for e in (missing, wrong, other_scheme)] == [grpc.StatusCode.UNAUTHENTICATED] * 3
    assert missing.details() == ("missing_token: this route needs 'Authorization: Bearer <token>' (the agent or "
                                 "administrator token: SPANRL_AUTH_TOKEN / SPANRL_ADMIN_TOKEN, or the stack's "
                                 "state_dir/secrets)")
    assert wrong.details() == "invalid_token: the bearer token is not one this service accepts"
    assert other_scheme.details().startswith("missing_token: ")
    assert results == [SpanExportResult.SUCCESS, SpanExportResult.FAILURE]  # UNAUTHENTICATED: no retry
    m = app.state.metrics
    assert (m["grpc_requests"], m["grpc_UNAUTHENTICATED"], m["missing_token"], m["invalid_token"], m["requests"]) == (
        5, 4, 2, 2, 1)
    assert len(sink.sent) == 6  # the good export's records only


def test_grpc_refuses_bodies_over_the_limit_and_bodies_that_are_not_otlp():
    """The bridge's ``max_body_bytes`` bounds a gRPC message too, compressed ones by their
    decompressed size: RESOURCE_EXHAUSTED ``body_too_large`` (over twice the bound gRPC
    itself refuses it, before reading it whole); a body decode_request refuses is
    INVALID_ARGUMENT with its reason, as the HTTP route's 400."""
    def request(padding: int) -> bytes:
        req = ExportTraceServiceRequest()
        s = req.resource_spans.add().scope_spans.add().spans.add(trace_id=b"\1" * 16, span_id=b"\2" * 8, name="n")
        s.attributes.append(KeyValue(key="spanrl.rollout_id", value=AnyValue(string_value="r1")))
        if padding:  # "a" * n gzips to a few dozen bytes
            s.attributes.append(KeyValue(key="padding", value=AnyValue(string_value="a" * padding)))
        return req.SerializeToString()

    sink = RecordingSink(Topics())
    app = app_for(sink, max_body_bytes=1000)
    over, far_over = request(1200), request(2500)
    assert 1000 < len(over) < 2000 < len(far_over)

    async def go():
        async with served(app) as (_, port):
            accepted = await raw_export(port, request(0))
            refused = [await refusal(port, body, compression=c) for body in (over, far_over)
                       for c in (None, grpc.Compression.Gzip)]
            utf8 = await refusal(port, otlp_with_name(b"N\xff\xfeE"))
            garbage = await refusal(port, b"\xff\xff\xff")
            return accepted, refused, utf8, garbage

    accepted, refused, utf8, garbage = run(go())
    assert ExportTraceServiceResponse.FromString(accepted) == ExportTraceServiceResponse()
    assert [e.code() for e in refused] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 4
    assert [e.details() for e in refused[:2]] == [
        f"body_too_large: message of {len(over)} bytes (decompressed) over 1000 bytes"] * 2
    assert refused[2].details() == f"SERVER: Received message larger than max ({len(far_over)} vs. 2000)"
    assert "larger than max" in refused[3].details()  # gRPC's own answers (the wording varies by path)
    assert (utf8.code(), garbage.code()) == (grpc.StatusCode.INVALID_ARGUMENT,) * 2
    assert utf8.details().startswith("invalid_otlp: not an ExportTraceServiceRequest")
    assert garbage.details().startswith("invalid_otlp: not an ExportTraceServiceRequest")
    m = app.state.metrics
    assert (m["grpc_RESOURCE_EXHAUSTED"], m["body_too_large"], m["grpc_INVALID_ARGUMENT"], m["invalid_otlp"],
            m["grpc_requests"], m["spans"]) == (2, 2, 2, 2, 5, 1)
    assert len(sink.sent) == 1


class RefusingSink(RecordingSink):
    """Kafka that never acks (the Sink raises KafkaUnavailable after its send timeout)."""

    async def produce_raw(self, items) -> None:
        raise KafkaUnavailable("Kafka did not acknowledge within 15.0 s")


class HeldSink(RecordingSink):
    """Kafka whose acks wait until ``release`` is set: the records stay in flight."""

    def __init__(self, topics):
        super().__init__(topics)
        self.release = asyncio.Event()

    async def produce_raw(self, items) -> None:
        await self.release.wait()
        await super().produce_raw(items)


def retry_delay(exc: grpc.aio.AioRpcError) -> tuple[float, float]:
    """The retry delay of both trailers (rich error model's Status, the bare RetryInfo)."""
    trailers = dict(exc.trailing_metadata())
    status = status_pb2.Status.FromString(trailers[otlp_grpc.STATUS_DETAILS_KEY])
    assert (status.code, status.message) == (exc.code().value[0], exc.details())
    [detail] = status.details
    info = error_details_pb2.RetryInfo()
    assert detail.Unpack(info)
    bare = error_details_pb2.RetryInfo.FromString(trailers[otlp_grpc.RETRY_INFO_KEY])
    return (info.retry_delay.seconds + info.retry_delay.nanos / 1e9,
            bare.retry_delay.seconds + bare.retry_delay.nanos / 1e9)


def test_grpc_answers_unavailable_with_a_retry_delay_when_kafka_does_not_ack_or_the_buffer_is_full():
    body = ExportTraceServiceRequest()
    s = body.resource_spans.add().scope_spans.add().spans.add(trace_id=b"\1" * 16, span_id=b"\2" * 8, name="n")
    s.attributes.append(KeyValue(key="spanrl.rollout_id", value=AnyValue(string_value="r1")))
    body = body.SerializeToString()
    down = app_for(RefusingSink(Topics()))
    held = HeldSink(Topics())
    busy = app_for(held, max_inflight_bytes=10)

    async def go():
        async with served(down) as (_, port):
            kafka = await refusal(port, body)
        async with served(busy) as (_, port):
            first = asyncio.create_task(raw_export(port, body))  # waits for its acks
            while busy.state.metrics["requests"] < 1:  # then it waits in produce_raw, its bytes reserved
                await asyncio.sleep(0.01)
            full = await refusal(port, body)
            held.release.set()
            return kafka, full, await first

    kafka, full, first = run(go())
    assert (kafka.code(), kafka.details()) == (grpc.StatusCode.UNAVAILABLE,
                                               "kafka_unavailable: Kafka did not acknowledge within 15.0 s")
    assert retry_delay(kafka) == (5.0, 5.0)  # the HTTP answer's Retry-After
    assert full.code() == grpc.StatusCode.UNAVAILABLE and full.details().startswith("buffer_full: ")
    assert retry_delay(full) == (1.0, 1.0)
    assert ExportTraceServiceResponse.FromString(first) == ExportTraceServiceResponse()
    assert (down.state.metrics["grpc_UNAVAILABLE"], down.state.metrics["kafka_unavailable"]) == (1, 1)
    assert (busy.state.metrics["grpc_UNAVAILABLE"], busy.state.metrics["buffer_full"]) == (1, 1)


def test_a_grpc_port_in_use_stops_the_start_up():
    """A second bridge on a taken port fails (SO_REUSEPORT off) instead of sharing it: the
    lifespan raises, so uvicorn exits (``uvicorn.run``: exit status 3)."""
    from fastapi.testclient import TestClient

    async def second():
        first, port = await otlp_grpc.start("127.0.0.1:0", None, None, None, 1000)
        try:
            with pytest.raises(OSError, match=f"cannot bind the OTLP/gRPC port 127.0.0.1:{port}"):
                await otlp_grpc.start(f"127.0.0.1:{port}", None, None, None, 1000)
        finally:
            await first.stop(None)

    run(second())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        app = bridge.create_app(RecordingSink(Topics()), claim_client=object(), payload_bucket="b",
                                grpc_address=f"127.0.0.1:{port}")
        with pytest.raises(OSError, match=f"cannot bind the OTLP/gRPC port 127.0.0.1:{port}"):
            with TestClient(app):
                pass


# ------------------------------------------------------------------ pure parts
def test_grpc_codes_of_the_bridge_refusal_statuses():
    assert {s: otlp_grpc.grpc_code(s).name for s in (400, 401, 413, 415, 422, 503, 500)} == {
        400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 413: "RESOURCE_EXHAUSTED", 415: "INVALID_ARGUMENT",
        422: "INVALID_ARGUMENT", 503: "UNAVAILABLE", 500: "INTERNAL"}


def test_retry_trailers_hold_a_status_with_retry_info_and_the_bare_retry_info():
    (k1, v1), (k2, v2) = otlp_grpc.retry_trailers(grpc.StatusCode.UNAVAILABLE, "buffer_full: x", 1.25)
    assert (k1, k2) == ("grpc-status-details-bin", "google.rpc.retryinfo-bin")
    info = error_details_pb2.RetryInfo()
    info.retry_delay.seconds, info.retry_delay.nanos = 1, 250_000_000
    packed = PbAny()
    packed.Pack(info)
    assert status_pb2.Status.FromString(v1) == status_pb2.Status(code=14, message="buffer_full: x", details=[packed])
    assert error_details_pb2.RetryInfo.FromString(v2) == info
    with pytest.raises(ValueError):
        otlp_grpc.retry_trailers(grpc.StatusCode.UNAVAILABLE, "", -1)


def test_authorization_reads_the_metadata_value_as_bytes():
    assert otlp_grpc.authorization((("user-agent", "x"), ("authorization", "Bearer t"))) == b"Bearer t"
    assert otlp_grpc.authorization((("authorization", b"Bearer t"),)) == b"Bearer t"
    assert otlp_grpc.authorization((("user-agent", "x"),)) is None
    assert otlp_grpc.authorization(None) is None


# ------------------------------------------- an exporter configured by the environment only
ENV_AGENT = Path(__file__).resolve().parents[1] / "fixtures" / "otlp_env_agent.py"


def otel_env(protocol: str, endpoint: str, token: str | None) -> dict[str, str]:
    """The process environment with OTEL_* replaced by an OTLP export of traces only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
                "OTEL_EXPORTER_OTLP_PROTOCOL": protocol, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                "OTEL_SERVICE_NAME": "env-agent"})
    if token:  # W3C Baggage-like: the value percent-encoded
        env["OTEL_EXPORTER_OTLP_HEADERS"] = f"authorization=Bearer%20{token}"
    return env


def test_an_agent_configured_only_by_otel_environment_variables_exports_over_grpc():
    """``OTEL_EXPORTER_OTLP_PROTOCOL=grpc`` and the gRPC port as ``OTEL_EXPORTER_OTLP_ENDPOINT``
    (the SDK's own configurator, no spanrl code): the records of ``http/protobuf`` to the HTTP
    port; a wrong token in ``OTEL_EXPORTER_OTLP_HEADERS`` gets nothing through."""
    sinks = {way: RecordingSink(Topics()) for way in ("grpc", "http/protobuf", "wrong token")}
    apps = {way: app_for(sink, credentials=TOKEN) for way, sink in sinks.items()}

    async def agent(env):
        proc = await asyncio.create_subprocess_exec(sys.executable, str(ENV_AGENT), "env-r1", env=env,
                                                    stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode, err.decode(errors="replace")

    async def go():
        out = {}
        for way, app in apps.items():
            async with served(app) as (http_port, grpc_port):
                protocol = "http/protobuf" if way == "http/protobuf" else "grpc"
                endpoint = f"http://127.0.0.1:{http_port if protocol == 'http/protobuf' else grpc_port}"
                out[way] = await agent(otel_env(protocol, endpoint, "nope" if way == "wrong token" else TOKEN))
        return out

    out = run(go())
    assert all(rc == 0 for rc, _ in out.values()), out
    assert [len(sinks[w].sent) for w in sinks] == [4, 4, 0]
    assert [(t, k) for t, k, _ in sinks["grpc"].sent] == [("spans", "env-r1"), ("spans", "env-r1"),
                                                          ("rewards", "env-r1"), ("spans", "env-r1")]
    spans = [codec.decode("span", v) for t, _, v in sinks["grpc"].sent if t == "spans"]
    http_spans = [codec.decode("span", v) for t, _, v in sinks["http/protobuf"].sent if t == "spans"]
    assert [s["name"] for s in spans] == ["tool.search", "spanrl.reward", "agent.solve"]
    # the same records but for the ids and times of two different runs of the agent
    different = ("trace_id", "span_id", "parent_span_id", "start_time_unix_nano", "end_time_unix_nano")
    assert [{k: v for k, v in s.items() if k not in different} for s in spans] == [
        {k: v for k, v in s.items() if k not in different} for s in http_spans]
    assert apps["grpc"].state.metrics["grpc_requests"] >= 1 and "grpc_requests" not in apps["http/protobuf"].state.metrics
    assert apps["wrong token"].state.metrics["grpc_UNAUTHENTICATED"] >= 1
    assert "UNAUTHENTICATED" in out["wrong token"][1]  # the SDK logged the refusal
