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

from producers.edge import bearer_headers

# spanrl attribute keys (the bridge reads the same names)
ROLLOUT_ID = "spanrl.rollout_id"
ATTEMPT_ID = "spanrl.attempt_id"
SEQUENCE_ID = "spanrl.sequence_id"
AGENT_NAME = "spanrl.agent_name"
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

    def next_sequence_id(self) -> int:
        return next(self._seq)  # atomic under the GIL


_current: contextvars.ContextVar[RolloutState | None] = contextvars.ContextVar("spanrl_rollout", default=None)
_provider: TracerProvider | None = None


def current_rollout() -> RolloutState | None:
    """The rollout of the calling context, or None outside :func:`rollout_context`."""
    return _current.get()


@contextlib.contextmanager
def rollout_context(rollout_id: str, attempt_id: str, agent_name: str | None = None) -> Iterator[RolloutState]:
    """Stamp spans started inside with this rollout; the sequence restarts at 0 per entry.

    Entering again with the same (rollout_id, attempt_id) only to change ``agent_name``
    (a sub-agent) keeps the running sequence counter.
    """
    outer = _current.get()
    if outer is not None and (outer.rollout_id, outer.attempt_id) == (rollout_id, attempt_id):
        state = RolloutState(rollout_id, attempt_id, agent_name or outer.agent_name, outer._seq)
    else:
        state = RolloutState(rollout_id, attempt_id, agent_name)
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


def instrument(service_name: str, bridge_url: str | None = None, set_global: bool = True,
               auth_token: SecretStr | str | None = None) -> TracerProvider:
    """Build a TracerProvider exporting to ``bridge_url + "/v1/traces"`` (default: settings).

    ``set_global`` also installs it as OTel's global provider (only the first call in a
    process can; later calls still return a working provider used by :func:`emit_reward`).
    ``auth_token``: the bridge's bearer token (default: ``SPANRL_AUTH_TOKEN`` via settings).
    """
    global _provider
    if bridge_url is None or auth_token is None:
        from infra.settings import get_settings

        bridge_url = bridge_url or get_settings().bridge_url
        auth_token = auth_token or get_settings().auth_token
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(RolloutStampProcessor())
    exporter = OTLPSpanExporter(endpoint=bridge_url.rstrip("/") + "/v1/traces", headers=bearer_headers(auth_token))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    if set_global:
        trace.set_tracer_provider(provider)
    _provider = provider
    return provider


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
                **components: float) -> None:
    """Emit a ``spanrl.reward`` span in the current rollout (the bridge makes it a Reward).

    ``final=True``: the episode return R; ``False``: an intermediate reward, optionally
    tied to the call ``span_id``. ``components`` are named parts of the value.
    Raises ValueError for NaN/inf, RuntimeError outside :func:`rollout_context`.
    """
    check_reward(value, components)
    if _current.get() is None:
        raise RuntimeError("emit_reward() called outside rollout_context()")
    attrs: dict[str, object] = {REWARD_VALUE: float(value), REWARD_FINAL: bool(final), REWARD_NAME: name}
    if span_id is not None:
        attrs[REWARD_SPAN_ID] = span_id
    attrs.update({REWARD_COMPONENT + k: float(v) for k, v in components.items()})
    with _tracer().start_as_current_span(REWARD_SPAN, attributes=attrs):
        pass


def flush(timeout_millis: int = 30_000) -> bool:
    """Export every finished span now; True when the export completed in time."""
    provider = _provider or trace.get_tracer_provider()
    force = getattr(provider, "force_flush", None)
    return bool(force(timeout_millis)) if force else True
