"""OTLP/gRPC receiver of the bridge: ``opentelemetry.proto.collector.trace.v1.TraceService/Export``.

The bridge serves it beside its HTTP server, in the same asyncio loop (``grpc.aio``), on its
own port (``SPANRL_BRIDGE_GRPC_PORT``, the role of OTLP's 4317; spanrl/core/settings.py). A request
goes through the same function as an OTLP/HTTP protobuf body (``export`` of
producers/bridge.py: :func:`spanrl.producers.otlp.decode_request`, then the same records to
Kafka), so the same spans give the same records either way, with the same bearer token
(metadata ``authorization: Bearer <token>``) and the same limits (the body size, the
in-flight bound).

The method's request is taken as raw bytes, not through the generated
``trace_service_pb2_grpc.add_TraceServiceServicer_to_server``: with that, gRPC parses the
message itself and answers a body it cannot parse ``UNKNOWN`` ("Unexpected <class
'google.protobuf.message.DecodeError'>: ...", grpcio 1.85 aio), where the OTLP spec wants the
non-retryable ``INVALID_ARGUMENT``; here ``decode_request`` parses it and refuses it as it
refuses an HTTP body. The body bound
(``--max-body-bytes``) holds for a message after gRPC undid its compression: the bridge
refuses a larger one ``RESOURCE_EXHAUSTED`` ``body_too_large`` (counted, the limit named);
gRPC's own ``grpc.max_receive_message_length``, :data:`CORE_LIMIT_FACTOR` times the bound,
stops larger ones before they are read whole (also decompressed ones: "Decompressed message
larger than max"; gRPC's answer, not counted).

Refusals (OTLP specification, "OTLP/gRPC Response" > "Failures" and "OTLP/gRPC Throttling",
https://opentelemetry.io/docs/specs/otlp/#failures): the status of :func:`grpc_code` with the
message ``<reason>: <detail>`` (the bridge's reason code first, as in its HTTP answers);
for a refusal that a retry may pass (Kafka did not ack, the in-flight buffer is full, the
claim store is down) ``UNAVAILABLE`` with a ``google.rpc.RetryInfo`` delay
(:func:`retry_trailers`), as the HTTP answer's ``Retry-After``. Accepted requests are
answered as over HTTP: an ``ExportTraceServiceResponse`` whose ``partial_success`` counts
the dead-lettered spans.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

import grpc
from google.protobuf.duration_pb2 import Duration
from google.protobuf.any_pb2 import Any as PbAny
from google.rpc import error_details_pb2, status_pb2
from grpc import aio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from pydantic import SecretStr

from spanrl.core.edge import BadRequest, Credentials, as_credentials, authorize
from spanrl.producers import edge

log = logging.getLogger("spanrl.bridge.grpc")

#: ``opentelemetry.proto.collector.trace.v1.TraceService`` and its one method
SERVICE = trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"].full_name
METHOD = "Export"
#: the bridge's HTTP statuses as gRPC status codes (OTLP spec, "Failures": INVALID_ARGUMENT
#: is not retryable, UNAVAILABLE is; RESOURCE_EXHAUSTED is retryable only with RetryInfo,
#: and a body over the limit carries none; UNAUTHENTICATED for a missing or wrong token)
GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    503: grpc.StatusCode.UNAVAILABLE,
}
#: trailing metadata of the rich error model (google.rpc.Status, its ``details`` holding a
#: RetryInfo), which the OTLP spec names; the Python OTLP exporter (1.45) reads a RetryInfo
#: under the second key instead (opentelemetry/exporter/otlp/proto/grpc/exporter.py), so both
STATUS_DETAILS_KEY = "grpc-status-details-bin"
RETRY_INFO_KEY = "google.rpc.retryinfo-bin"
#: gRPC's own message bound, as a multiple of the bridge's body bound (see the module doc)
CORE_LIMIT_FACTOR = 2


def grpc_code(status: int) -> grpc.StatusCode:
    """The gRPC status code of one of the bridge's HTTP refusal statuses (:data:`GRPC_CODES`);
    ``INTERNAL`` for any other (none is expected: the bridge refuses with those only)."""
    return GRPC_CODES.get(status, grpc.StatusCode.INTERNAL)


def retry_trailers(code: grpc.StatusCode, message: str, retry_after_s: float) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata that asks the client to retry after ``retry_after_s`` seconds (>= 0):
    ``grpc-status-details-bin`` = a ``google.rpc.Status`` (``code``, ``message``, one
    ``google.rpc.RetryInfo`` in ``details``; gRPC's rich error model) and
    ``google.rpc.retryinfo-bin`` = the RetryInfo alone. Raises ValueError for a negative delay."""
    if retry_after_s < 0:
        raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s}")
    seconds = int(retry_after_s)
    info = error_details_pb2.RetryInfo(retry_delay=Duration(seconds=seconds,
                                                            nanos=round((retry_after_s - seconds) * 1e9)))
    detail = PbAny()
    detail.Pack(info)
    status = status_pb2.Status(code=code.value[0], message=message, details=[detail])
    return (STATUS_DETAILS_KEY, status.SerializeToString()), (RETRY_INFO_KEY, info.SerializeToString())


def authorization(metadata: Sequence[tuple[str, str | bytes]] | None) -> bytes | None:
    """The ``authorization`` value of a call's metadata (keys are lower case in gRPC), as
    bytes for :func:`spanrl.core.edge.check_bearer`; None without one."""
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, bytes) else value.encode()
    return None


Export = Callable[[bytes], Awaitable[bytes]]


def handler(export: Export, metrics: Counter,
            credentials: Credentials | SecretStr | str | None) -> grpc.GenericRpcHandler:
    """The ``TraceService`` handler: ``export(body)`` (the bridge's, from the raw
    ExportTraceServiceRequest bytes to the raw response; raises
    :class:`~spanrl.core.edge.BadRequest`) behind the bearer check. Counts
    ``grpc_requests``, and per refusal its reason and ``grpc_<CODE>`` (e.g.
    ``grpc_UNAUTHENTICATED``) in ``metrics``, the bridge's counters."""
    creds = as_credentials(credentials)

    async def refuse(context: aio.ServicerContext, status: int, reason: str, detail: str,
                     headers: dict[str, str] | None) -> None:
        code = grpc_code(status)
        metrics[f"grpc_{code.name}"] += 1
        metrics[reason] += 1
        message = f"{reason}: {edge.safe_detail(detail)}"
        retry_after = (headers or {}).get("Retry-After")
        trailers = retry_trailers(code, message, float(retry_after)) if retry_after is not None else ()
        await context.abort(code, message, trailers)

    async def export_call(body: bytes, context: aio.ServicerContext) -> bytes:
        metrics["grpc_requests"] += 1
        # the agent's route of the bridge: the agent or the administrator token (spanrl/core/edge.py)
        refusal = authorize(creds, "POST", "/v1/traces", authorization(context.invocation_metadata()))
        if refusal is not None:
            await refuse(context, *refusal, None)
        try:
            return await export(body)
        except BadRequest as exc:
            await refuse(context, exc.status, exc.reason, exc.detail, exc.headers)
        raise AssertionError("context.abort returned")  # it raises; never reached

    # None (de)serializers: the handler gets and returns the message's bytes
    return grpc.method_handlers_generic_handler(SERVICE, {
        METHOD: grpc.unary_unary_rpc_method_handler(export_call, request_deserializer=None, response_serializer=None)})


async def start(address: str, export: Export, metrics: Counter, credentials: Credentials | SecretStr | str | None,
                max_body_bytes: int) -> tuple[aio.Server, int]:
    """A started ``grpc.aio`` server in the running loop on ``address`` (``host:port``; port 0:
    a free one) serving :func:`handler`, gRPC's own message bound :data:`CORE_LIMIT_FACTOR` x
    ``max_body_bytes`` (``export`` applies ``max_body_bytes`` itself); returns it and the port
    it bound. Raises OSError when the address cannot be bound (a receiver that
    is silently missing would lose every exporter's spans)."""
    server = aio.server(handlers=[handler(export, metrics, credentials)],
                        options=[("grpc.max_receive_message_length", CORE_LIMIT_FACTOR * max_body_bytes),
                                 ("grpc.so_reuseport", 0)])  # a second bridge on the port fails, as HTTP's does
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio >= 1.5x raises instead of returning 0
        raise OSError(f"cannot bind the OTLP/gRPC port {address}: {exc}") from exc
    if port == 0:
        raise OSError(f"cannot bind the OTLP/gRPC port {address}")
    await server.start()
    log.info("OTLP/gRPC on %s (port %d)", address, port)
    return server, port
