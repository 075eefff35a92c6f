"""OpenTelemetry setup for Python agents: rollout stamping, rewards, flush.

An agent process calls :func:`instrument` once; every span started inside
:func:`rollout_context` carries ``spanrl.rollout_id``, ``spanrl.attempt_id``,
``spanrl.sequence_id`` (per-attempt counter from 0) and ``spanrl.agent_name``, and is
exported over OTLP/HTTP (protobuf) to the bridge, which writes it to Kafka.
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
from dataclasses import dataclass, field
from typing import Iterator

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from pydantic import SecretStr

from spanrl.core.edge import bearer_headers
from spanrl.core.production import PRODUCTION_ATTEMPT
from spanrl.producers import seeding

# spanrl attribute keys (the bridge reads the same names)
ROLLOUT_ID = "spanrl.rollout_id"
ATTEMPT_ID = "spanrl.attempt_id"
SEQUENCE_ID = "spanrl.sequence_id"
AGENT_NAME = "spanrl.agent_name"
RECORD_TO = "spanrl.record_to"  # "eval": the bridge records the span on the evaluation topics
REWARD_SPAN = "spanrl.reward"
REWARD_VALUE = "spanrl.reward.value"
REWARD_FINAL = "spanrl.reward.final"
REWARD_NAME = "spanrl.reward.name"
REWARD_SPAN_ID = "spanrl.reward.span_id"
REWARD_COMPONENT = "spanrl.reward.component."


@dataclass
class RolloutState:
    """The rollout an attempt's spans belong to, and its sequence counter."""

    rollout_id: str
    attempt_id: str
    agent_name: str | None = None
    _seq: Iterator[int] = field(default_factory=itertools.count, repr=False)
    record_to: str | None = None  # "eval": an evaluation episode (spans.eval, rewards.eval)
    #: the attempt's sampling seed (producers/seeding.py); None: requests carry no seed
    sampling_seed: int | None = None
    _calls: Iterator[int] = field(default_factory=itertools.count, repr=False)

    def next_sequence_id(self) -> int:
        return next(self._seq)  # atomic under the GIL

    def next_call_seed(self) -> int | None:
        """The seed of the attempt's next LLM request (:func:`seeding.call_seed`), or None
        without a sampling seed."""
        if self.sampling_seed is None:
            return None
        return seeding.call_seed(self.sampling_seed, next(self._calls))


_current: contextvars.ContextVar[RolloutState | None] = contextvars.ContextVar("spanrl_rollout", default=None)
_provider: TracerProvider | None = None


def current_rollout() -> RolloutState | None:
    """The rollout of the calling context, or None outside :func:`rollout_context`."""
    return _current.get()


@contextlib.contextmanager
def rollout_context(rollout_id: str, attempt_id: str, agent_name: str | None = None,
                    record_to: str | None = None, sampling_seed: int | None = None) -> Iterator[RolloutState]:
    """Stamp spans started inside with this rollout; the sequence restarts at 0 per entry.

    Entering again with the same (rollout_id, attempt_id) only to change ``agent_name``
    (a sub-agent) keeps the running sequence counter. ``record_to="eval"``: an evaluation
    episode; the bridge records its spans on the evaluation topics, never the training ones.
    ``sampling_seed``: the attempt's seed (producers/seeding.py); each LLM request made inside
    (through a client :func:`propagate_trace_context` patched) carries its call's seed.
    """
    if record_to not in (None, "eval"):
        raise ValueError(f"record_to must be None or 'eval', got {record_to!r}")
    outer = _current.get()
    if outer is not None and (outer.rollout_id, outer.attempt_id) == (rollout_id, attempt_id):
        state = RolloutState(rollout_id, attempt_id, agent_name or outer.agent_name, outer._seq,
                             record_to or outer.record_to,
                             outer.sampling_seed if sampling_seed is None else sampling_seed, outer._calls)
    else:
        state = RolloutState(rollout_id, attempt_id, agent_name, record_to=record_to, sampling_seed=sampling_seed)
    token = _current.set(state)
    try:
        yield state
    finally:
        _current.reset(token)


class RolloutStampProcessor(SpanProcessor):
    """Adds the rollout attributes to every span started inside a rollout context."""

    def on_start(self, span: Span, parent_context: otel_context.Context | None = None) -> None:
        state = _current.get()
        if state is None:
            return
        span.set_attribute(ROLLOUT_ID, state.rollout_id)
        span.set_attribute(ATTEMPT_ID, state.attempt_id)
        span.set_attribute(SEQUENCE_ID, state.next_sequence_id())
        if state.agent_name:
            span.set_attribute(AGENT_NAME, state.agent_name)
        if state.record_to:
            span.set_attribute(RECORD_TO, state.record_to)


def instrument(service_name: str, bridge_url: str | None = None, set_global: bool = True,
               auth_token: SecretStr | str | None = None, frameworks: bool = True) -> TracerProvider:
    """Build a TracerProvider exporting to ``bridge_url + "/v1/traces"`` (default: settings).

    ``set_global`` also installs it as OTel's global provider (only the first call in a
    process can; later calls still return a working provider used by :func:`emit_reward`).
    ``auth_token``: the bridge's bearer token (default: ``SPANRL_AUTH_TOKEN`` via settings).
    ``frameworks``: also :func:`instrument_frameworks` with this provider (the agent
    frameworks' own OpenTelemetry instrumentations, and trace context on LLM requests),
    from which spanrl learns which agent made each LLM call.

    Example: ``spanrl.instrument("my-agent")`` once at start-up of an agent process that the
    Runner does not start (a production agent); the Runner instruments its own process.
    """
    global _provider
    if bridge_url is None or auth_token is None:
        from spanrl.core.settings import get_settings

        bridge_url = bridge_url or get_settings().bridge_url
        auth_token = auth_token or get_settings().auth_token
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(RolloutStampProcessor())
    exporter = OTLPSpanExporter(endpoint=bridge_url.rstrip("/") + "/v1/traces", headers=bearer_headers(auth_token))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    if set_global:
        trace.set_tracer_provider(provider)
    _provider = provider
    if frameworks:
        instrument_frameworks(provider)
    return provider


# ---- agent frameworks' telemetry ----------------------------------------------------

#: OpenInference instrumentations spanrl turns on when their framework is installed:
#: (framework module, instrumentor module, instrumentor class, keyword arguments).
FRAMEWORK_INSTRUMENTORS = (
    ("langchain_core", "openinference.instrumentation.langchain", "LangChainInstrumentor", {}),
    # exclusive_processor: the Agents SDK's default trace processor uploads to OpenAI's
    # servers; the spans go to spanrl's bridge only.
    ("agents", "openinference.instrumentation.openai_agents", "OpenAIAgentsInstrumentor",
     {"exclusive_processor": True}),
    ("autogen_agentchat", "openinference.instrumentation.autogen_agentchat", "AutogenAgentChatInstrumentor", {}),
)
#: the instrumented frameworks and the provider each writes to (framework module -> provider)
_instrumented: dict[str, TracerProvider] = {}


def instrument_frameworks(provider: TracerProvider | None = None) -> list[str]:
    """Turn on the OpenTelemetry instrumentation of every installed agent framework of
    :data:`FRAMEWORK_INSTRUMENTORS` (OpenInference: LangChain/LangGraph, the OpenAI Agents
    SDK, AutoGen AgentChat) with ``provider`` (default: the one :func:`instrument` built),
    and :func:`propagate_trace_context`. Idempotent; returns the frameworks instrumented by
    this call. A framework instrumented before with another provider is instrumented again
    with this one (OpenTelemetry instrumentors bind one provider: a later ``instrument()`` for
    another bridge would otherwise leave the frameworks' spans going to the first). Their spans name the agent (LangGraph node, Agents SDK agent, AutoGen agent:
    ``spanrl.producers.otlp.span_agent_name``); the ``traceparent`` of each LLM request links the
    proxy's record of the call to them (``spanrl.stream_jobs.assembly.resolve_agent``)."""
    import importlib
    import importlib.util

    provider = provider or _provider or trace.get_tracer_provider()
    done = []
    for framework, module, cls, kwargs in FRAMEWORK_INSTRUMENTORS:
        if importlib.util.find_spec(framework) is None:
            continue
        if _instrumented.get(framework) is provider:
            continue
        try:
            instrumentor = getattr(importlib.import_module(module), cls)()
        except ImportError:
            continue
        if framework in _instrumented:
            instrumentor.uninstrument()
        instrumentor.instrument(tracer_provider=provider, **kwargs)
        _instrumented[framework] = provider
        done.append(framework)
    propagate_trace_context()
    return done


def _call_context() -> otel_context.Context | None:
    """The OTel context an outgoing LLM request belongs to: the innermost LangChain run's
    span when OpenInference's LangChain instrumentation tracks one, else the current span."""
    if "langchain_core" in _instrumented:
        try:
            import langchain_core.runnables.config  # noqa: F401 - get_current_span reads it
            from openinference.instrumentation.langchain import get_current_span

            lc_span = get_current_span()
        except Exception:  # noqa: BLE001 - telemetry must never fail the agent's request
            lc_span = None
        if lc_span is not None and lc_span.get_span_context().is_valid:
            return trace.set_span_in_context(lc_span)
    if trace.get_current_span().get_span_context().is_valid:
        return otel_context.get_current()
    return None


def _with_traceparent(send):
    import functools

    from opentelemetry.propagate import inject

    @functools.wraps(send)
    def wrapper(client, request, *args, **kwargs):
        if "traceparent" not in request.headers and (ctx := _call_context()) is not None:
            inject(request.headers, context=ctx)
        state = _current.get()
        if state is not None and state.sampling_seed is not None and seeding.SEED_HEADER not in request.headers \
                and request.method == "POST":
            request.headers[seeding.SEED_HEADER] = str(state.next_call_seed())
        return send(client, request, *args, **kwargs)

    wrapper.__spanrl_traceparent__ = True
    return wrapper


def propagate_trace_context() -> list[str]:
    """Make every request of ``httpx`` and ``httpx2`` clients (``httpx2`` is the HTTP
    client of openai>=3, so of LangChain's ChatOpenAI, the Agents SDK and AutoGen) carry a
    W3C ``traceparent`` of the span the request is made in (:func:`_call_context`), unless
    the request has one already. Patches ``Client.send`` / ``AsyncClient.send`` of both
    (the coroutine's request headers are set before it is awaited); idempotent; returns
    the patched ``module.Class`` names.

    Two gaps upstream, reported as follows:

    *opentelemetry-python-contrib*: "No instrumentation for httpx2. openai>=3 (and with it
    langchain-openai, openai-agents, autogen-ext) sends its requests with httpx2;
    opentelemetry-instrumentation-httpx patches only httpx, so these requests carry no
    traceparent and a server cannot join its spans to the client's trace."

    *openinference-instrumentation-langchain*: "OpenInferenceTracer does not attach the
    span of a run to the OpenTelemetry context (deliberately, see the comment in
    ``_start_trace``), so an HTTP request a chat model makes inside a LangGraph node is not
    a child of the node's or the model's span; a propagator injects the surrounding
    context instead. ``get_current_span()`` exposes the run's span; propagating it needs
    code like this."
    """
    import importlib

    patched = []
    for module in ("httpx", "httpx2"):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        for cls_name in ("Client", "AsyncClient"):
            cls = getattr(mod, cls_name)
            if not getattr(cls.send, "__spanrl_traceparent__", False):
                cls.send = _with_traceparent(cls.send)
            patched.append(f"{module}.{cls_name}")
    return patched


def ensure_instrumented(service_name: str, bridge_url: str | None = None,
                        auth_token: SecretStr | str | None = None) -> TracerProvider:
    """The provider :func:`instrument` built in this process, else a new one (installed as
    the global provider, with the frameworks' instrumentations) -- what a runner calls so
    that agents it runs are traced without code of their own. Idempotent. An agent that
    called :func:`instrument` itself (its own bridge, service name) keeps that provider."""
    if _provider is not None:
        return _provider
    return instrument(service_name, bridge_url, set_global=True, auth_token=auth_token)


def _tracer() -> trace.Tracer:
    if _provider is not None:
        return _provider.get_tracer("spanrl")
    return trace.get_tracer("spanrl")


def check_reward(value: float, components: dict[str, float] | None = None) -> None:
    """Raise ValueError unless ``value`` and every component is a finite number."""
    for key, v in {"value": value, **(components or {})}.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"reward {key} must be a finite number, got {v!r}")


def emit_reward(value: float, final: bool = True, name: str = "reward", span_id: str | None = None,
                rollout_id: str | None = None, attempt_id: str = PRODUCTION_ATTEMPT,
                **components: float) -> None:
    """Emit a ``spanrl.reward`` span in the current rollout (the bridge makes it a Reward).

    ``final=True``: the episode return R; ``False``: an intermediate reward, optionally
    tied to the call ``span_id``. ``components`` are named parts of the value.
    ``rollout_id``: reward that rollout instead (e.g. later, for a production agent's rollout:
    the ``x-spanrl-rollout-id`` the proxy answered, spanrl/core/production.py; ``attempt_id``
    defaults to a production rollout's).
    Raises ValueError for NaN/inf, RuntimeError outside :func:`rollout_context` without
    ``rollout_id``.

    Example: a production agent rewards a rollout when the user's feedback arrives, by the
    ``x-spanrl-rollout-id`` the proxy answered:
    ``spanrl.emit_reward(1.0, rollout_id=rollout_id, thumbs_up=1.0)``; then :func:`flush`.
    """
    check_reward(value, components)
    if rollout_id is not None:
        with rollout_context(rollout_id, attempt_id):
            return emit_reward(value, final, name, span_id, **components)
    if _current.get() is None:
        raise RuntimeError("emit_reward() called outside rollout_context()")
    attrs: dict[str, object] = {REWARD_VALUE: float(value), REWARD_FINAL: bool(final), REWARD_NAME: name}
    if span_id is not None:
        attrs[REWARD_SPAN_ID] = span_id
    attrs.update({REWARD_COMPONENT + k: float(v) for k, v in components.items()})
    with _tracer().start_as_current_span(REWARD_SPAN, attributes=attrs):
        pass


def flush(timeout_millis: int = 30_000) -> bool:
    """Export every finished span now; True when the export completed in time.

    Example: ``spanrl.flush(timeout_millis=5_000)`` before a short-lived process exits, so
    that its rewards and spans reach the bridge."""
    provider = _provider or trace.get_tracer_provider()
    force = getattr(provider, "force_flush", None)
    return bool(force(timeout_millis)) if force else True


# ---- tool calls (facts for AIR, stream_jobs/air.py) -------------------------------------

@contextlib.contextmanager
def tool_span(name: str, arguments: str | None = None) -> Iterator[trace.Span]:
    """A span of one tool call as the OpenTelemetry GenAI conventions name it (``execute_tool
    {name}``, ``gen_ai.operation.name = execute_tool``, ``gen_ai.tool.name``, the call's
    ``gen_ai.tool.call.arguments`` cut to 1000 characters). Mark a failed call with
    :func:`tool_failed`; an exception raised inside is recorded (event ``exception``) and sets
    status ERROR, as the OTel SDK does. Its status is what AIR's ``tool_error`` /
    ``tool_ok`` facts read; without a tracer provider it records nothing."""
    attrs = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name}
    if arguments is not None:
        attrs["gen_ai.tool.call.arguments"] = arguments[:1000]
    with trace.get_tracer("spanrl.producers.instrument").start_as_current_span(
            f"execute_tool {name}", attributes=attrs) as span:
        yield span


def tool_failed(span: trace.Span, error_type: str, message: str = "") -> None:
    """Mark a tool call's span failed: status ERROR (with ``message``) and ``error.type``
    (GenAI conventions; a type naming a time-out, e.g. ``timeout``, is AIR's ``timeout`` fact)."""
    span.set_attribute("error.type", error_type)
    span.set_status(trace.Status(trace.StatusCode.ERROR, message[:500]))
