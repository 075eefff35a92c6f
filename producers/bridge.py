"""OTLP receiver: agent spans in, Avro Span/Reward/DeadLetter records to Kafka out.

    python -m spanrl.producers.bridge [--port P] [--grpc-port G] [--topic-prefix X] [--max-body-bytes N]

``POST /v1/traces`` takes OTLP/HTTP protobuf (``application/x-protobuf``, the Python SDK's
exporter) and OTLP/JSON (``application/json``, the JavaScript SDK's default), gzip or not;
both decode to the same records (producers/otlp.py), and the answer (an
ExportTraceServiceResponse) is encoded as the request was. OTLP/gRPC (``TraceService/Export``,
producers/otlp_grpc.py) is served on ``--grpc-port`` (``SPANRL_BRIDGE_GRPC_PORT``; 0: off) in the
same process and loop, through the same :func:`create_app` ``export``: the same records, auth
and limits, refusals as gRPC status codes.

Promise: a client that got a 2xx finds its spans in Kafka (we answer only after the
broker acknowledged every record). Spans that cannot be used go to dead-letter with a
reason code and are reported back as ``partial_success.rejected_spans``. A span without
``spanrl.rollout_id`` but with a trace id (an agent framework's own instrumentation, no
spanrl rollout context) goes to ``orphan-spans`` keyed by trace id: the stream app joins it
to the rollout of a proxy call of the same trace, or dead-letters it ``no_rollout_id`` after
``SPANRL_ORPHAN_TIMEOUT_S`` (stream_jobs/joining.py): the bridge alone cannot know which
rollout a trace belongs to, since the proxy sees the call, and its record is in Kafka. Records
waiting for acks are bounded (``SPANRL_BRIDGE_MAX_INFLIGHT_BYTES``): a request that would
go over is answered 503 ``buffer_full`` + Retry-After at once, before anything is sent.
With auth on (the default), every route but ``GET /health`` needs the agent or the
administrator token (spanrl/core/edge.py); a reward for a rollout may be posted by the agent
credential that made its calls or by the administrator (late human ratings; with one agent
token every agent holds the same credential, docs/operations.md).
"""
from __future__ import annotations

import argparse
import logging
import math
import time
from collections import Counter
from contextlib import asynccontextmanager
from typing import Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from pydantic import BaseModel, Field, SecretStr

from spanrl.core import claims, ids, production
from spanrl.core import metrics as prom
from spanrl.core.edge import BadRequest, Credentials
from spanrl.core.settings import ProducerSettings, TopicSettings, check_environment
from spanrl.producers import edge, otlp_grpc
from spanrl.producers.kafka import KafkaUnavailable, Sink, Topics, now_ms
from spanrl.producers.otlp import (
    JSON,
    MEDIA_TYPES,
    PROTOBUF,
    Converted,
    OtlpError,
    convert_request,
    decode_request,
    media_type,
)
from spanrl.schemas import codec

log = logging.getLogger("spanrl.bridge")
DEFAULT_MAX_BODY = ProducerSettings().bridge_max_body_bytes
RETRY_AFTER_S = "5"
BUFFER_RETRY_AFTER_S = "1"  # the buffer drains as fast as Kafka acks, usually in milliseconds
DEFAULT_MAX_INFLIGHT = 64 << 20
#: the bridge's plain counters (its JSON ``/status``) as Prometheus counters; every other key
#: is a status, dead-letter or refusal reason (prom.count_families)
PLAIN_COUNTERS = {
    "requests": "OTLP export requests received (HTTP and gRPC)",
    "grpc_requests": "OTLP/gRPC export requests received",
    "spans": "spans Kafka acknowledged (training and evaluation topics)",
    "orphan_spans": "spans without a rollout id sent to orphan-spans",
    "rewards": "rewards Kafka acknowledged (from spans and POST /v1/rewards)",
    "claims": "span records moved to the claim store (over the topic's size limit)",
}


class InflightBuffer:
    """Bytes of encoded records that wait for Kafka's acks, bounded by ``max_bytes``.

    ``try_reserve(n)`` admits ``n`` bytes when ``used + n <= max_bytes``, when nothing is in
    flight (so a request larger than the whole bound is not refused forever) and when
    ``n == 0``; the caller ``release(n)``s them once Kafka answered, acked or not. One
    event loop, no lock.
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self.used = 0

    def try_reserve(self, n: int) -> bool:
        if n and self.used and self.used + n > self.max_bytes:
            return False
        self.used += n
        return True

    def release(self, n: int) -> None:
        if n > self.used:
            raise ValueError(f"release of {n} bytes with only {self.used} in flight")
        self.used -= n


#: reason codes of decode_request's OtlpError statuses
OTLP_REASONS = {400: "invalid_otlp", 413: "body_too_large", 415: "unsupported_encoding"}


def decode(body: bytes, content_encoding: str | None, max_body_bytes: int,
           content_type: str = PROTOBUF) -> ExportTraceServiceRequest:
    """:func:`~spanrl.producers.otlp.decode_request`, its OtlpError as a
    :class:`~spanrl.core.edge.BadRequest` with the reason of :data:`OTLP_REASONS` (what
    both the HTTP route and the gRPC method answer)."""
    try:
        return decode_request(body, content_encoding, max_body_bytes, content_type)
    except OtlpError as exc:
        raise BadRequest(exc.status, OTLP_REASONS.get(exc.status, "invalid_otlp"), exc.detail) from None


class RewardIn(BaseModel):
    """POST /v1/rewards body: a reward from an evaluator that is not OTel-instrumented
    (``rollout_id`` / ``attempt_id``: the limits of spanrl/core/ids.py, checked by the route)."""

    rollout_id: str
    attempt_id: str = "0"
    value: float
    final: bool = True
    name: str = "reward"
    span_id: str | None = None
    timestamp_ms: int | None = None
    components: dict[str, float] = {}


class RolloutEndIn(BaseModel):
    """POST /v1/rollouts/{rollout_id}/end body (all optional): the explicit end of a production
    rollout (spanrl/core/production.py). ``task_id`` / ``group_size`` empty / 0: those of its calls."""

    attempt_id: str = production.PRODUCTION_ATTEMPT
    status: Literal["succeeded", "failed"] = "succeeded"
    task_id: str = ""
    group_size: int = Field(0, ge=0)
    error: str | None = None


def _dead_letter(c: Converted, stage: str = "bridge") -> dict:
    return {"reason": c.dead_reason, "detail": c.dead_detail, "stage": stage, "source_topic": None,
            "source_partition": None, "source_offset": None, "rollout_id": c.rollout_id,
            "task_id": None, "payload": c.raw, "timestamp_ms": now_ms()}


def create_app(sink: Sink, max_body_bytes: int = DEFAULT_MAX_BODY, credentials: Credentials | SecretStr | str | None = None,
               max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT, claim_client=None,
               payload_bucket: str | None = None, eval_topics: Topics | None = None,
               grpc_address: str | None = None) -> FastAPI:
    """The bridge app writing through ``sink``; ``credentials`` (None: open; spanrl/core/edge.py
    ``Credentials``, or one token for both roles) see producers/edge.py.
    ``grpc_address``: ``host:port`` of the OTLP/gRPC receiver the app starts in its lifespan
    (producers/otlp_grpc.py; port 0: a free one, in ``app.state.grpc_port``); None: none.
    ``eval_topics``: where spans stamped ``spanrl.record_to=eval`` (evaluation episodes) and
    their rewards and dead letters go (default ``Topics.evaluation()``); nothing trains on them.
    ``claim_client`` / ``payload_bucket``: where span records over the spans topic's limit go
    (spanrl/core/claims.py); default: MinIO and bucket of the settings."""
    metrics: Counter[str] = Counter()
    train_topics: Topics = sink.topics
    eval_topics = eval_topics or Topics.evaluation()
    inflight = InflightBuffer(max_inflight_bytes)
    if payload_bucket is None:
        from spanrl.core.settings import get_settings

        payload_bucket = get_settings().payload_bucket
    claim_client = claim_client or claims.make_client()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            await sink.start()
        except KafkaUnavailable as exc:  # keep serving; requests answer 503 until Kafka is back
            log.warning("%s", exc)
        server = None
        if grpc_address is not None:  # an address that cannot be bound stops the start-up
            server, app.state.grpc_port = await otlp_grpc.start(grpc_address, grpc_export, metrics, credentials,
                                                                max_body_bytes)
        try:
            yield
        finally:
            if server is not None:
                await server.stop(grace=2)
            await sink.stop()

    app = FastAPI(title="spanrl OTLP bridge", lifespan=lifespan)
    app.state.metrics = metrics
    app.state.grpc_port = None
    registry = prom.registry(lambda: [
        *prom.count_families("bridge", metrics, PLAIN_COUNTERS),
        prom.gauge("spanrl_bridge_inflight_bytes", "encoded bytes waiting for Kafka's acks", inflight.used),
        prom.gauge("spanrl_bridge_max_inflight_bytes", "bound of inflight_bytes", inflight.max_bytes)])
    ack_s = prom.latency_histogram(registry, "spanrl_bridge_kafka_ack_seconds",
                                   "time until Kafka acknowledged a request's records")

    def error(status: int, reason: str, detail: str, headers: dict | None = None) -> Response:
        """A JSON error ``{"error": reason, "detail": ...}``; counts ``http_<status>`` and ``reason``."""
        metrics[f"http_{status}"] += 1
        metrics[reason] += 1
        detail = edge.safe_detail(detail)
        return JSONResponse({"error": reason, "detail": detail}, status, headers=headers)

    edge.install_auth(app, credentials, error)
    edge.install_error_handlers(app, error)

    def refused(exc: BadRequest) -> Response:
        return error(exc.status, exc.reason, exc.detail, exc.headers)

    async def produce(items: list[tuple]) -> None:
        """Send encoded ``items`` and wait for the acks; :class:`BadRequest` 503 (+ Retry-After)
        when the in-flight buffer is full or Kafka did not ack."""
        size = sum(len(v) + len(k or "") for _, k, v in items)
        if not inflight.try_reserve(size):
            raise BadRequest(503, "buffer_full", f"{inflight.used} of {inflight.max_bytes} bytes wait for Kafka; "
                             f"this request needs {size}", headers={"Retry-After": BUFFER_RETRY_AFTER_S})
        try:
            t0 = time.perf_counter()
            await sink.produce_raw(items)
            ack_s.observe(time.perf_counter() - t0)
        except KafkaUnavailable as exc:
            raise BadRequest(503, "kafka_unavailable", str(exc), headers={"Retry-After": RETRY_AFTER_S}) from None
        finally:
            inflight.release(size)

    async def export(req: ExportTraceServiceRequest) -> ExportTraceServiceResponse:
        """Every span of a decoded export to Kafka (spans, rewards, orphans, dead letters) and
        the answer, once Kafka acked all of it: what OTLP/HTTP (both encodings) and OTLP/gRPC
        share. Raises :class:`BadRequest` 503 (claim store, buffer full, Kafka)."""
        items: list[tuple] = []
        rejected: Counter[str] = Counter()
        for c in convert_request(req):
            topics = eval_topics if c.record_to == "eval" else train_topics
            if c.span is not None:
                # an orphan (no rollout id) waits on orphan-spans, keyed by its trace id, for the
                # stream app to join it to the rollout of a proxy call of that trace
                spans, key = (topics.orphan_spans, c.span["trace_id"]) if c.orphan else (topics.spans, c.rollout_id)
                try:
                    value = codec.encode(spans.record, c.span)
                    if not claims.fits(len(value), spans.max_message_bytes):
                        try:  # claim-check: the record goes to MinIO, a small span with its ref to Kafka
                            value = await claims.check_in(claim_client, payload_bucket, spans, key, c.span, value)
                        except claims.ClaimStoreUnavailable as exc:
                            raise BadRequest(503, "claim_store_unavailable", str(exc),
                                             headers={"Retry-After": RETRY_AFTER_S}) from None
                        metrics["claims"] += 1
                    if not claims.fits(len(value), spans.max_message_bytes):
                        c = Converted(c.rollout_id, dead_reason="oversize", raw=b"", record_to=c.record_to,
                                      dead_detail=f"span claim record {len(value)} bytes > "
                                                  f"{spans.max_message_bytes - claims.CLAIM_MARGIN_BYTES}")
                    else:
                        items.append((spans, key, value))
                        if c.reward is not None:
                            items.append((topics.rewards, c.rollout_id, codec.encode(topics.rewards.record, c.reward)))
                except codec.SchemaError as exc:
                    c = Converted(c.rollout_id, dead_reason=exc.reason, dead_detail=exc.detail, raw=c.raw,
                                  record_to=c.record_to)
            if c.dead_reason is not None:
                rejected[c.dead_reason] += 1
                items.append((topics.dead_letter, c.rollout_id, codec.encode(topics.dead_letter.record, _dead_letter(c))))
        await produce(items)
        n_spans = sum(1 for t, _, _ in items if t in (train_topics.spans, eval_topics.spans))
        metrics["spans"] += n_spans
        metrics["orphan_spans"] += sum(1 for t, _, _ in items if t == train_topics.orphan_spans)
        metrics["rewards"] += sum(1 for t, _, _ in items if t in (train_topics.rewards, eval_topics.rewards))
        for reason, n in rejected.items():
            metrics[f"dead_letter.{reason}"] += n
        resp = ExportTraceServiceResponse()
        if rejected:
            resp.partial_success.CopyFrom(ExportTracePartialSuccess(
                rejected_spans=sum(rejected.values()),
                error_message="dead-lettered: " + ", ".join(f"{k}={v}" for k, v in sorted(rejected.items()))))
        return resp

    async def grpc_export(body: bytes) -> bytes:
        """The OTLP/gRPC method (producers/otlp_grpc.py): bytes of an ExportTraceServiceRequest
        (gRPC already undid its compression) -> the response's bytes. Raises BadRequest."""
        metrics["requests"] += 1
        if len(body) > max_body_bytes:
            raise BadRequest(413, "body_too_large", f"message of {len(body)} bytes (decompressed) "
                             f"over {max_body_bytes} bytes")
        return (await export(decode(body, None, max_body_bytes))).SerializeToString()

    @app.post("/v1/traces")
    async def traces(request: Request) -> Response:
        metrics["requests"] += 1
        ctype = media_type(request.headers.get("content-type"))
        if ctype not in MEDIA_TYPES:
            return error(415, "unsupported_media_type", f"Content-Type must be {PROTOBUF} (OTLP/HTTP protobuf) "
                         f"or {JSON} (OTLP/JSON), got {ctype!r}")
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > max_body_bytes:
            return error(413, "body_too_large", f"body over {max_body_bytes} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                return error(413, "body_too_large", f"body over {max_body_bytes} bytes")
        try:
            resp = await export(decode(bytes(body), request.headers.get("content-encoding"), max_body_bytes, ctype))
        except BadRequest as exc:
            return refused(exc)
        if ctype == JSON:  # proto3 JSON: {} or {"partialSuccess": {"rejectedSpans": "1", "errorMessage": ...}}
            return JSONResponse(json_format.MessageToDict(resp), 200)
        return Response(resp.SerializeToString(), 200, media_type=PROTOBUF)

    @app.post("/v1/rewards")
    async def rewards(reward: RewardIn) -> Response:
        try:
            ids.check(ids.ROLLOUT, reward.rollout_id, "rollout_id")
            ids.check(ids.ATTEMPT, reward.attempt_id, "attempt_id")
        except BadRequest as exc:
            return refused(exc)
        if not math.isfinite(reward.value) or not all(math.isfinite(v) for v in reward.components.values()):
            return error(400, "invalid_reward", "value and components must be finite numbers")
        record = reward.model_dump()
        record["timestamp_ms"] = reward.timestamp_ms or now_ms()
        try:
            value = codec.encode(train_topics.rewards.record, record)
        except codec.SchemaError as exc:  # RewardIn passed, so not expected; never a 500 though
            return error(400, exc.reason, exc.detail)
        try:
            await produce([(train_topics.rewards, reward.rollout_id, value)])
        except BadRequest as exc:
            return refused(exc)
        metrics["rewards"] += 1
        return JSONResponse({"status": "ok"})

    @app.post("/v1/rollouts/{rollout_id}/end")
    async def end_rollout(rollout_id: str, end: RolloutEndIn | None = None) -> Response:
        """A terminal lifecycle event for a rollout no runner announces (a production agent's
        conversation is over); the stream job then finishes it as a runner's."""
        end = end or RolloutEndIn()
        try:
            ids.check(ids.ROLLOUT, rollout_id, "rollout_id")
            ids.check(ids.ATTEMPT, end.attempt_id, "attempt_id")
            if end.task_id:  # "": the task of its calls
                ids.check(ids.TASK, end.task_id, "task_id")
        except BadRequest as exc:
            return refused(exc)
        value = codec.encode(train_topics.rollouts.record, {
            "rollout_id": rollout_id, "attempt_id": end.attempt_id, "task_id": end.task_id,
            "status": end.status, "group_size": end.group_size, "runner_id": "bridge",
            "timestamp_ms": now_ms(), "error": end.error})
        try:
            await produce([(train_topics.rollouts, rollout_id, value)])
        except BadRequest as exc:
            return refused(exc)
        metrics["rollout_ends"] += 1
        return JSONResponse({"status": "ok", "rollout_id": rollout_id})

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "kafka_producer_started": sink.started, "grpc_port": app.state.grpc_port}

    @app.get("/status")
    async def status() -> dict:
        """The counters as JSON (``http_<status>``, ``grpc_<CODE>``, reasons, ``dead_letter.<reason>``, ...)."""
        return {**metrics, "inflight_bytes": inflight.used, "max_inflight_bytes": inflight.max_bytes,
                "grpc_port": app.state.grpc_port}

    @app.get("/metrics")
    async def get_metrics() -> Response:
        """The same counters and the Kafka ack histogram in the Prometheus text format."""
        return Response(prom.exposition(registry), media_type=prom.CONTENT_TYPE)

    return app


def main(argv: list[str] | None = None) -> None:
    from spanrl.core.edge import service_credentials
    from spanrl.core.settings import get_settings

    check_environment()
    s = get_settings()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default=s.host)
    p.add_argument("--port", type=int, default=s.bridge_port)
    p.add_argument("--grpc-port", type=int, default=s.bridge_grpc_port,
                   help="OTLP/gRPC port (SPANRL_BRIDGE_GRPC_PORT); 0: no gRPC receiver")
    p.add_argument("--kafka-bootstrap", default=s.kafka_bootstrap)
    p.add_argument("--topic-prefix", default=TopicSettings().topic_prefix)
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY)
    p.add_argument("--max-inflight-bytes", type=int, default=s.bridge_max_inflight_bytes)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    topics = Topics.with_prefix(a.topic_prefix) if a.topic_prefix else Topics()
    eval_topics = Topics.with_prefix(a.topic_prefix, Topics.evaluation()) if a.topic_prefix else None
    app = create_app(Sink(a.kafka_bootstrap, topics, send_timeout_s=s.kafka_send_timeout_s), a.max_body_bytes,
                     credentials=service_credentials(s, "bridge", log), max_inflight_bytes=a.max_inflight_bytes, eval_topics=eval_topics,
                     grpc_address=f"{a.host}:{a.grpc_port}" if a.grpc_port else None)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
