"""Pure conversion: OTLP/HTTP request (protobuf or JSON) -> spanrl Span / Reward / dead-letter records.

Both encodings decode to one ``ExportTraceServiceRequest`` message, so the same spans give
the same records whichever the exporter sent. No I/O here; :mod:`spanrl.producers.bridge`
does the HTTP and Kafka plumbing.
"""
from __future__ import annotations

import base64
import json
import math
import re
import zlib
from dataclasses import dataclass

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan

from spanrl.core import ids, production
from spanrl.producers import instrument as keys

#: the OTLP/HTTP media types (OTLP spec, "OTLP/HTTP": "Binary Protobuf Encoding", "JSON
#: Protobuf Encoding"); the answer is encoded as the request was
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
MEDIA_TYPES = (PROTOBUF, JSON)
#: the most characters of a JSON parser's message an error detail keeps
JSON_ERROR_MAX = 300


class OtlpError(ValueError):
    """The request body cannot be used; ``status`` is the HTTP code to answer."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail


@dataclass
class Converted:
    """One span's outcome: a Span record (and Reward), or a dead-letter reason.

    ``orphan``: the span carries no rollout id but a valid trace id; ``span`` is its record
    with ``rollout_id = attempt_id = ""``, for the ``orphan-spans`` topic keyed by
    ``span["trace_id"]`` (the stream app joins it by trace id, stream_jobs/joining.py)."""

    rollout_id: str | None
    span: dict | None = None
    reward: dict | None = None
    dead_reason: str | None = None
    dead_detail: str = ""
    raw: bytes = b""  # the protobuf Span, kept for the dead-letter payload
    record_to: str | None = None  # "eval": an evaluation episode's span (spanrl.record_to)
    orphan: bool = False


def media_type(content_type: str | None) -> str:
    """The media type of a ``Content-Type`` header value, lower case, parameters dropped
    (``"Application/JSON; charset=utf-8"`` -> ``"application/json"``; None -> ``""``)."""
    return (content_type or "").split(";")[0].strip().lower()


def decode_request(body: bytes, content_encoding: str | None = None, max_bytes: int = 8 << 20,
                   content_type: str = PROTOBUF) -> ExportTraceServiceRequest:
    """Decode an OTLP/HTTP body: ``content_type`` one of :data:`MEDIA_TYPES` (a media type,
    see :func:`media_type`), ``content_encoding`` gzip or identity, at most ``max_bytes``
    after gunzip. Raises only :class:`OtlpError` (400/413/415)."""
    if content_type not in MEDIA_TYPES:
        raise OtlpError(415, f"unsupported Content-Type {content_type!r} ({PROTOBUF} or {JSON})")
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "gzip":
        body = _gunzip(body, max_bytes)
    elif encoding not in ("", "identity"):
        raise OtlpError(415, f"unsupported Content-Encoding {content_encoding!r} (gzip or identity)")
    if not body:
        raise OtlpError(400, "empty body")
    if content_type == JSON:
        return parse_json_request(body)
    request = ExportTraceServiceRequest()
    try:
        consumed = request.ParseFromString(body)
    except (DecodeError, RuntimeError, ValueError, TypeError) as exc:
        raise OtlpError(400, f"not an ExportTraceServiceRequest: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the C/upb parser may raise anything on garbage
        raise OtlpError(400, f"not an ExportTraceServiceRequest: {type(exc).__name__}: {exc}") from exc
    if consumed is not None and consumed != len(body):
        raise OtlpError(400, "trailing bytes after ExportTraceServiceRequest")
    return request


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON (proto3 JSON writes a double's NaN / Infinity as a string)")


def parse_json_request(body: bytes) -> ExportTraceServiceRequest:
    """An OTLP/JSON body (UTF-8 JSON, OTLP spec "JSON Protobuf Encoding") as the message
    the same spans sent as protobuf decode to.

    The proto3 JSON mapping (``google.protobuf.json_format``) with OTLP's exceptions: trace
    and span ids are hex (:func:`hex_ids_to_base64`); fields and enum names it does not know
    are ignored ("OTLP/JSON receivers MUST ignore message fields with unknown names"; an
    unknown enum name reads as 0); 64-bit integers as decimal strings or numbers ("either
    numbers or strings are accepted when decoding"). Accepted beyond what OTLP senders must
    write, as proto3 JSON parsers do: the proto's snake_case names besides lowerCamelCase,
    enum names besides integers. Null is the field's default; a double's NaN / Infinity are
    the strings ``"NaN"`` / ``"Infinity"`` (the bare tokens are not JSON: refused). Raises
    only :class:`OtlpError` (400), naming the field where the parser does."""
    try:
        obj = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise OtlpError(400, f"OTLP/JSON body is not UTF-8: {exc.reason} at byte {exc.start}") from exc
    except (ValueError, RecursionError) as exc:
        raise OtlpError(400, f"not JSON: {_parse_error_detail(str(exc))}") from exc
    if not isinstance(obj, dict):
        raise OtlpError(400, f"an OTLP/JSON ExportTraceServiceRequest is an object, got {type(obj).__name__}")
    obj = hex_ids_to_base64(obj)
    request = ExportTraceServiceRequest()
    try:
        json_format.ParseDict(obj, request, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise OtlpError(400, f"not an ExportTraceServiceRequest: {_parse_error_detail(str(exc))}") from exc
    except Exception as exc:  # noqa: BLE001 - RecursionError on deep kvlists, the upb setters on odd values
        raise OtlpError(400, f"not an ExportTraceServiceRequest: {type(exc).__name__}: "
                             f"{_parse_error_detail(str(exc))}") from exc
    return request


_PARSE_STEP = re.compile(r"Failed to parse (\w+) field: ")


def _parse_error_detail(message: str) -> str:
    """json_format's message with its chain of ``Failed to parse X field:`` (one per level)
    as a dotted path in front (``resourceSpans.scopeSpans.spans.startTimeUnixNano: ...``),
    at most :data:`JSON_ERROR_MAX` characters, cut in the middle (a long value sits there;
    the path is at either end)."""
    fields = []
    while (m := _PARSE_STEP.match(message)) is not None:
        fields.append(m.group(1))
        message = message[m.end():]
    message = message.rstrip(".")
    if fields:
        message = f"{'.'.join(fields)}: {message}"
    if len(message) <= JSON_ERROR_MAX:
        return message
    half = JSON_ERROR_MAX // 2
    return f"{message[:half]} ... {message[-half:]}"


#: the hex-encoded id fields of OTLP/JSON traces: (JSON name, proto name, bytes)
_SPAN_IDS = (("traceId", "trace_id", 16), ("spanId", "span_id", 8), ("parentSpanId", "parent_span_id", 8))
_LINK_IDS = _SPAN_IDS[:2]
_HEX = re.compile(r"[0-9a-fA-F]*")


def hex_ids_to_base64(request: dict) -> dict:
    """An OTLP/JSON ExportTraceServiceRequest (parsed JSON) with its trace and span ids in
    base64, as the proto3 JSON parser expects for ``bytes`` fields.

    OTLP spec, "OTLP/HTTP" > "JSON Protobuf Encoding": "traceId and spanId byte arrays are
    represented as case-insensitive hex-encoded strings; they are not base64-encoded as is
    defined in the standard Protobuf JSON Mapping". Here: ``traceId`` (32 hex digits),
    ``spanId`` and ``parentSpanId`` (16) of every span, ``traceId`` / ``spanId`` of its
    links, under either name (lowerCamelCase or snake_case); ``parentSpanId``, which the
    spec's sentence does not name, is a span id too (the JavaScript exporter writes it in
    hex, tests/fixtures/otlp_json_js). ``""`` or null stays as it is
    (the field's default, as an absent field in protobuf); other ``bytes`` (``bytesValue``)
    are base64 as proto3 JSON says. Anything not shaped like a request is left for the
    parser to refuse. Pure: returns new dicts along the id paths, the rest shared.
    Raises :class:`OtlpError` (400) naming the field, e.g.
    ``resourceSpans[0].scopeSpans[0].spans[1].traceId``, for an id of other characters or
    length (protobuf's decoder takes any length; an OTLP/JSON id must be the hex of 16 / 8 bytes)."""

    def ids(message: dict, where: str, fields: tuple) -> dict:
        out = dict(message)
        for json_name, proto_name, size in fields:
            for name in (json_name, proto_name):
                if out.get(name) not in (None, ""):
                    out[name] = _hex_id_to_base64(out[name], f"{where}.{name}", size)
        return out

    def span(message: dict, where: str) -> dict:
        return _each(ids(message, where, _SPAN_IDS), ("links",), where, lambda link, w: ids(link, w, _LINK_IDS))

    def scope_spans(message: dict, where: str) -> dict:
        return _each(message, ("spans",), where, span)

    def resource_spans(message: dict, where: str) -> dict:
        return _each(message, ("scopeSpans", "scope_spans"), where, scope_spans)

    return _each(request, ("resourceSpans", "resource_spans"), "", resource_spans)


def _each(message: dict, names: tuple[str, ...], where: str, convert) -> dict:
    """``message`` with ``convert(item, path)`` applied to each object of its lists ``names``."""
    out = dict(message)
    for name in names:
        items = out.get(name)
        if isinstance(items, list):
            path = f"{where}.{name}" if where else name
            out[name] = [convert(x, f"{path}[{i}]") if isinstance(x, dict) else x for i, x in enumerate(items)]
    return out


def _hex_id_to_base64(value: object, where: str, size: int) -> str:
    if not isinstance(value, str) or len(value) != 2 * size or not _HEX.fullmatch(value):
        got = json.dumps(value)[:40] + (f" ({len(value)} characters)" if isinstance(value, str) else "")
        raise OtlpError(400, f"{where} must be {2 * size} hex digits (OTLP/JSON ids are hex, not base64), got {got}")
    return base64.b64encode(bytes.fromhex(value)).decode()


def _gunzip(body: bytes, max_bytes: int) -> bytes:
    d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(body, max_bytes + 1)
    except zlib.error as exc:
        raise OtlpError(400, f"bad gzip body: {exc}") from exc
    if len(out) > max_bytes:
        raise OtlpError(413, f"decompressed body over {max_bytes} bytes")
    if not d.eof:
        raise OtlpError(400, "truncated gzip body")
    return out


def any_value(v: AnyValue) -> object:
    """An OTLP AnyValue as a plain Python value (bytes as base64 text)."""
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return array_value(v.array_value.values)
    if which == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return base64.b64encode(v.bytes_value).decode()
    return getattr(v, which)


_NUMBER_KINDS = ("int_value", "double_value")


def array_value(values) -> list:
    """The items of an OTLP ArrayValue (repeated AnyValue) as plain Python values.

    Fast path for the arrays that dominate an LLM span (token ids: all ``int_value``;
    log-probs: all ``double_value``): read the first item's kind for every item at once, then
    confirm the kind only of items that read as 0 (an item of another kind reads as 0 there;
    a non-zero value can only come from the kind itself). Otherwise, item by item
    (:func:`any_value`). Same result either way; ~4x less time for a 640-token span, where
    the item-by-item path was 28-35 % of the bridge's CPU (docs/measured/benchmarks-archive.md)."""
    if not values:
        return []
    kind = values[0].WhichOneof("value")
    if kind in _NUMBER_KINDS:
        out = [x.int_value for x in values] if kind == "int_value" else [x.double_value for x in values]
        if all(out) or all(values[i].WhichOneof("value") == kind for i, o in enumerate(out) if not o):
            return out
    return [any_value(x) for x in values]


def stringify(value: object) -> str:
    """Attribute value for the Span record: strings as is, anything else JSON (NaN as NaN)."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


#: OpenInference's ``openinference.span.kind`` (OpenInference semantic conventions, "Span
#: Kinds") -> spanrl's kind; its other kinds (CHAIN, RETRIEVER, EMBEDDING, RERANKER,
#: GUARDRAIL, EVALUATOR) fall through to the name / gen_ai.* rules
OPENINFERENCE_KINDS = {"LLM": "llm", "TOOL": "tool", "AGENT": "agent"}


def span_kind(name: str, attrs: dict[str, object]) -> str:
    """llm | tool | reward | agent | other, from the span name, OpenInference's
    ``openinference.span.kind`` (:data:`OPENINFERENCE_KINDS`) and gen_ai.* attributes."""
    lname = name.lower()
    op = str(attrs.get("gen_ai.operation.name", ""))
    if name == keys.REWARD_SPAN:
        return "reward"
    oi_kind = OPENINFERENCE_KINDS.get(str(attrs.get("openinference.span.kind", "")).upper())
    if oi_kind is not None:
        return oi_kind
    if op == "execute_tool" or lname.startswith("tool") or any(k.startswith("gen_ai.tool.") for k in attrs):
        return "tool"
    if op in ("invoke_agent", "create_agent") or lname.startswith("agent"):
        return "agent"
    if lname.startswith(("chat", "llm")) or any(k.startswith("gen_ai.") for k in attrs):
        return "llm"
    return "other"


_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}

#: OTel attributes that carry an LLM call's exact token data (first key found wins). The
#: bare ``prompt_token_ids`` / ``response_token_ids`` are the keys Agent Lightning's
#: tracer and adapter use, so spans instrumented for it train here unchanged.
LLM_PROMPT_IDS = ("spanrl.llm.prompt_token_ids", "prompt_token_ids")
LLM_COMPLETION_IDS = ("spanrl.llm.completion_token_ids", "response_token_ids")
LLM_LOGPROBS = ("spanrl.llm.completion_logprobs",)
LLM_POLICY_VERSION = "spanrl.llm.policy_version"
_LLM_KEYS = frozenset(LLM_PROMPT_IDS + LLM_COMPLETION_IDS + LLM_LOGPROBS + (LLM_POLICY_VERSION,))


def _first(attrs: dict[str, object], keys: tuple[str, ...]) -> object:
    for k in keys:
        if k in attrs:
            return attrs[k]
    return None


def llm_from_attrs(attrs: dict[str, object], span_id: str) -> dict | None:
    """The ``llm`` record of an OTel LLM span that carries token ids as int-array attributes
    (``spanrl.llm.*`` or Agent Lightning's keys), else None. Logprobs are taken as given (the
    assembler dead-letters a call whose logprobs do not match its completion tokens)."""
    prompt, completion = _first(attrs, LLM_PROMPT_IDS), _first(attrs, LLM_COMPLETION_IDS)
    if not isinstance(completion, list) or not isinstance(prompt, list):
        return None
    if not set(map(type, prompt)) | set(map(type, completion)) <= {int}:  # ints, not bools (C speed)
        return None
    logprobs = _first(attrs, LLM_LOGPROBS)
    if not isinstance(logprobs, list):
        logprobs = []
    elif not set(map(type, logprobs)) <= {float}:
        logprobs = [float(x) for x in logprobs if isinstance(x, (int, float)) and not isinstance(x, bool)]
    model = attrs.get("gen_ai.response.model") or attrs.get("gen_ai.request.model") or ""
    request_id = attrs.get("gen_ai.response.id")
    return {
        "model": model if isinstance(model, str) else stringify(model),
        "policy_version": _as_int(attrs.get(LLM_POLICY_VERSION)) or 0,
        "prompt_token_ids": prompt,
        "completion_token_ids": completion,
        "completion_logprobs": logprobs,
        "temperature": 1.0, "top_p": 1.0, "max_tokens": None, "finish_reason": None,
        "request_id": request_id if isinstance(request_id, str) else span_id,
    }


def _as_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


#: Attributes that name the agent a span belongs to, in the order they are trusted: spanrl's
#: own (``rollout_context(agent_name=...)``), the OpenTelemetry GenAI semantic conventions
#: (``gen_ai.agent.name``: AutoGen core, OpenLLMetry), OpenInference's ``agent.name`` and
#: ``graph.node.id`` (its OpenAI Agents SDK and AutoGen AgentChat instrumentations set both
#: to the agent's name on the agent's span).
AGENT_NAME_KEYS = (keys.AGENT_NAME, "gen_ai.agent.name", "agent.name", "graph.node.id")


def span_agent_name(attrs: dict[str, object], resource_attrs: dict[str, object] | None = None) -> str | None:
    """The agent name a span carries, or None: the first non-empty string of
    :data:`AGENT_NAME_KEYS` (span attributes, then ``spanrl.agent_name`` of the resource),
    else the LangGraph node of OpenInference's LangChain instrumentation (its ``metadata``
    attribute is the run's metadata as JSON; LangGraph puts ``langgraph_node`` there, on the
    node's span and on every run inside it, the chat model's included). Names starting with
    ``__`` (LangGraph's ``__start__``) are not agents. Pure."""
    for key in AGENT_NAME_KEYS:
        v = attrs.get(key)
        if isinstance(v, str) and v:
            return v
    v = (resource_attrs or {}).get(keys.AGENT_NAME)
    if isinstance(v, str) and v:
        return v
    meta = attrs.get("metadata")
    if isinstance(meta, str) and "langgraph_node" in meta:
        try:
            node = json.loads(meta).get("langgraph_node")
        except (ValueError, AttributeError):
            return None
        if isinstance(node, str) and node and not node.startswith("__"):
            return node
    return None


#: attributes of the OTel ``exception`` event a span keeps (OTel semantic conventions,
#: "Exceptions"; the stacktrace stays out: size), and the most characters of each
EXCEPTION_EVENT_KEYS = ("exception.type", "exception.message")
EXCEPTION_TEXT_MAX = 500


def exception_attributes(pb: PbSpan) -> dict[str, object]:
    """``exception.type`` / ``exception.message`` of the span's last event named
    ``exception`` (how OTel SDKs record an exception: ``Span.record_exception``), each cut to
    :data:`EXCEPTION_TEXT_MAX` characters; ``{}`` without one. The span record has no events,
    so these two become span attributes (AIR's ``exception`` / ``timeout`` facts,
    stream_jobs/air.py). Pure."""
    for event in reversed(pb.events):
        if event.name == "exception":
            attrs = {kv.key: any_value(kv.value) for kv in event.attributes if kv.key in EXCEPTION_EVENT_KEYS}
            return {k: (v[:EXCEPTION_TEXT_MAX] if isinstance(v, str) else v) for k, v in attrs.items()}
    return {}


def orphan_refusal(trace_id: bytes, kind: str, record_to: object) -> str | None:
    """Why a span without a rollout id cannot wait on ``orphan-spans`` to join a rollout by
    its trace (dead-letter ``no_rollout_id`` at once), or None when it can. It cannot with an
    invalid trace id (not 16 bytes, or all zero: W3C Trace Context s3.2.2.3), as a reward
    (a reward names its rollout; emit_reward outside rollout_context() is refused already),
    nor as an evaluation span (``spanrl.record_to=eval``: nothing joins on the eval topics)."""
    if len(trace_id) != 16 or not any(trace_id):
        return "and no valid trace id to join a rollout by"
    if kind == "reward":
        return "and a reward must name its rollout"
    if record_to == "eval":
        return "and evaluation spans are not joined by trace"
    return None


def id_refusal(rollout_id: str, attempt_id: str, task_id: object) -> tuple[str, str] | None:
    """(what, why) when a span's ids break the limits of spanrl/core/ids.py, else None:
    ``rollout_id`` (``spanrl.rollout_id``; ``""``: an orphan, not checked), ``attempt_id``
    (``spanrl.attempt_id`` as text; not checked for an orphan) and ``task_id`` (the
    ``spanrl.task_id`` attribute a production call carries, spanrl/core/production.py; None:
    absent, anything else as :func:`stringify` writes it into the record). ``what`` is
    ``"rollout"`` when the rollout id itself is bad (the dead letter cannot be keyed by
    it), else ``"attempt"`` / ``"task"``. Pure."""
    checks = [(ids.TASK, production.TASK_ID, None if task_id is None else stringify(task_id))]
    if rollout_id:
        checks = [(ids.ROLLOUT, keys.ROLLOUT_ID, rollout_id), (ids.ATTEMPT, keys.ATTEMPT_ID, attempt_id), *checks]
    for kind, key, value in checks:
        why = None if value is None else ids.problem(kind, value)
        if why is not None:
            return kind, f"{key} {why}"
    return None


def convert_span(pb: PbSpan, resource_attrs: dict[str, object]) -> Converted:
    """One OTLP span -> Span record (+ Reward for a reward span), an orphan Span record
    (no rollout id, a valid trace id: :func:`orphan_refusal`; ``Converted.orphan``) or a
    dead-letter reason (``invalid_id``: :func:`id_refusal`)."""
    attrs = {kv.key: any_value(kv.value) for kv in pb.attributes}
    attrs = {**exception_attributes(pb), **attrs}  # the span's own attributes win
    raw = pb.SerializeToString()

    def lookup(key: str) -> object:
        return attrs.get(key, resource_attrs.get(key))

    rollout_id = lookup(keys.ROLLOUT_ID)
    kind = span_kind(pb.name, attrs)
    record_to = lookup(keys.RECORD_TO)
    orphan = not isinstance(rollout_id, str) or not rollout_id
    if orphan:
        why = orphan_refusal(pb.trace_id, kind, record_to)
        if why is not None:
            return Converted(None, dead_reason="no_rollout_id",
                             dead_detail=f"span {pb.name!r} has no {keys.ROLLOUT_ID} attribute, {why}", raw=raw)
        rollout_id = attempt_id = ""  # filled in when the stream app joins it by trace id
    else:
        attempt = lookup(keys.ATTEMPT_ID)
        attempt_id = "0" if attempt is None else (attempt if isinstance(attempt, str) else stringify(attempt))
    bad_id = id_refusal(rollout_id, attempt_id, lookup(production.TASK_ID))
    if bad_id is not None:  # never a Kafka key: the dead letter of a bad rollout id has none
        what, why = bad_id
        return Converted(None if what == ids.ROLLOUT else rollout_id or None, dead_reason=ids.INVALID_ID,
                         dead_detail=f"span {pb.name!r}: {why}", raw=raw,
                         record_to=record_to if record_to == "eval" else None)
    seq = _as_int(lookup(keys.SEQUENCE_ID))
    agent = span_agent_name(attrs, resource_attrs)
    llm = llm_from_attrs(attrs, pb.span_id.hex()) if kind == "llm" else None
    span = {
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "sequence_id": -1 if seq is None else seq,
        "trace_id": pb.trace_id.hex(),
        "span_id": pb.span_id.hex(),
        "parent_span_id": pb.parent_span_id.hex() or None,
        "name": pb.name,
        "kind": kind,
        "source": "otlp",
        "start_time_unix_nano": pb.start_time_unix_nano,
        "end_time_unix_nano": pb.end_time_unix_nano,
        "status_code": _STATUS.get(pb.status.code, "UNSET"),
        "agent_name": agent if isinstance(agent, str) else None,
        # token data lives once, in ``llm`` (not again as JSON text in the attribute map)
        "attributes": {k: stringify(v) for k, v in attrs.items() if llm is None or k not in _LLM_KEYS},
        "llm": llm,
        "payload_ref": None,
    }
    if orphan:
        return Converted(None, span=span, raw=raw, orphan=True)
    out = Converted(rollout_id, span=span, raw=raw, record_to=record_to if record_to == "eval" else None)
    if kind == "reward":
        try:
            out.reward = reward_from_attrs(rollout_id, attempt_id, attrs, pb.end_time_unix_nano or pb.start_time_unix_nano)
        except ValueError as exc:
            return Converted(rollout_id, dead_reason="invalid_reward", dead_detail=str(exc), raw=raw,
                             record_to=out.record_to)
    return out


def _finite(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def reward_from_attrs(rollout_id: str, attempt_id: str, attrs: dict[str, object], time_unix_nano: int) -> dict:
    """Reward record from a ``spanrl.reward`` span's attributes; ValueError if unusable."""
    if keys.REWARD_VALUE not in attrs:
        raise ValueError(f"reward span without {keys.REWARD_VALUE}")
    final = attrs.get(keys.REWARD_FINAL, True)
    name = attrs.get(keys.REWARD_NAME, "reward")
    span_id = attrs.get(keys.REWARD_SPAN_ID)
    return {
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "value": _finite(attrs[keys.REWARD_VALUE], keys.REWARD_VALUE),
        "final": final if isinstance(final, bool) else str(final).lower() == "true",
        "name": name if isinstance(name, str) else stringify(name),
        "span_id": span_id if isinstance(span_id, str) else None,
        "timestamp_ms": time_unix_nano // 1_000_000,
        "components": {k[len(keys.REWARD_COMPONENT):]: _finite(v, k)
                       for k, v in attrs.items() if k.startswith(keys.REWARD_COMPONENT)},
    }


def convert_request(request: ExportTraceServiceRequest) -> list[Converted]:
    """Every span of the request, in order."""
    out: list[Converted] = []
    for rs in request.resource_spans:
        resource_attrs = {kv.key: any_value(kv.value) for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            for pb in ss.spans:
                out.append(convert_span(pb, resource_attrs))
    return out
