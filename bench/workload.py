"""The one synthetic OTLP workload both systems receive (imported by both venvs).

Per rollout: ``llm_calls`` LLM spans (name ``openai.chat.completion``, gen_ai.* attributes,
``prompt_token_ids`` / ``response_token_ids`` int arrays - the keys Agent Lightning's
adapter reads and spanrl's bridge maps - plus ``spanrl.llm.completion_logprobs``), ``tools``
tool spans and one reward span carrying both reward encodings (``spanrl.reward.value`` and
``agentlightning.reward.0.*``). Rollout/attempt ids are stamped with both systems' keys, so
the same spans (same sizes, same attributes) go to both; only the id values differ.

Spans are built with the OpenTelemetry SDK beforehand (not timed) and sent with the
standard ``OTLPSpanExporter`` (OTLP/HTTP protobuf), as an agent's BatchSpanProcessor would.
Only needs opentelemetry-sdk + opentelemetry-exporter-otlp-proto-http.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


@dataclass(frozen=True)
class Shape:
    llm_calls: int = 5
    tools: int = 2
    prompt_tokens: int = 512
    completion_tokens: int = 128
    vocab: int = 49152  # SmolLM2's vocabulary

    @property
    def spans_per_rollout(self) -> int:
        return self.llm_calls + self.tools + 1


def _provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    mem = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "bench-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(mem))
    return provider, mem


def rollout_spans(rollout_id: str, attempt_id: str, reward: float, shape: Shape, seed: int,
                  t0_ns: int = 1_700_000_000_000_000_000) -> list[ReadableSpan]:
    """The spans of one rollout, in emission order (reward last)."""
    rng = random.Random(seed)
    provider, mem = _provider()
    tracer = provider.get_tracer("bench")
    ids = {"spanrl.rollout_id": rollout_id, "spanrl.attempt_id": attempt_id, "spanrl.agent_name": "solver",
           "agentlightning.rollout_id": rollout_id, "agentlightning.attempt_id": attempt_id}
    order = ["llm"] * shape.llm_calls
    for i in range(shape.tools):  # a tool call after each of the first llm calls
        order.insert(2 * i + 1, "tool")
    t = t0_ns
    for seq, kind in enumerate(order):
        attrs: dict = {**ids, "spanrl.sequence_id": seq}
        if kind == "llm":
            completion = [rng.randrange(shape.vocab) for _ in range(shape.completion_tokens)]
            attrs.update({
                "gen_ai.system": "openai", "gen_ai.operation.name": "chat",
                "gen_ai.request.model": "policy", "gen_ai.response.model": "policy",
                "gen_ai.response.id": f"chatcmpl-{rollout_id}-{seq}",
                "gen_ai.usage.input_tokens": shape.prompt_tokens,
                "gen_ai.usage.output_tokens": shape.completion_tokens,
                "prompt_token_ids": [rng.randrange(shape.vocab) for _ in range(shape.prompt_tokens)],
                "response_token_ids": completion,
                "spanrl.llm.completion_logprobs": [round(-rng.random() * 3, 4) for _ in completion],
            })
            name, dur = "openai.chat.completion", 400_000_000
        else:
            attrs.update({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "calculator"})
            name, dur = "tool.calculator", 5_000_000
        span = tracer.start_span(name, attributes=attrs, start_time=t)
        span.end(end_time=t + dur)
        t += dur + 1_000_000
    span = tracer.start_span("spanrl.reward", start_time=t, attributes={
        **ids, "spanrl.sequence_id": len(order), "spanrl.reward.value": reward, "spanrl.reward.final": True,
        "agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": reward})
    span.end(end_time=t + 1000)
    spans = list(mem.get_finished_spans())
    provider.shutdown()
    return spans


def reward_of(i: int) -> float:
    return float(i % 2)


def exporter(endpoint: str, headers: dict[str, str] | None = None):
    """The standard OTLP/HTTP protobuf exporter (uncompressed, like the SDK's default);
    ``headers``: spanrl's bridge wants the agent token (:func:`agent_headers`)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint, timeout=30, headers=headers)


def agent_headers() -> dict[str, str]:
    """The stack's agent token as a bearer header (the variable, else the state directory)."""
    from spanrl.core.edge import bearer_headers
    from spanrl.core.settings import get_settings

    return bearer_headers(get_settings().auth_token)


def export_ok(exp, spans: list[ReadableSpan]) -> None:
    from opentelemetry.sdk.trace.export import SpanExportResult

    if exp.export(spans) is not SpanExportResult.SUCCESS:
        raise RuntimeError(f"OTLP export of {len(spans)} spans failed")


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (Linux /proc), seconds."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_peak_rss_mb(pid: int) -> float:
    """Peak resident set size (VmHWM) of a process, MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class RolloutPool:
    """Prebuilt rollouts re-stamped with fresh ids, for runs too long to build up front.

    ``size`` template rollouts (seeds 0..size-1, reward ``reward_of(seed)``) are built once with
    :func:`rollout_spans`; :meth:`spans` returns template ``i % size`` as new ``ReadableSpan``
    objects with the given rollout/attempt ids (both systems' keys), a fresh
    ``gen_ai.response.id`` and fresh random trace/span ids. The token-id lists are shared (not
    copied), so memory stays that of ``size`` rollouts (~ 50 KB each) whatever the run length.
    With an even ``size``, rollout ``i`` gets ``reward_of(i)`` as in the burst.
    """

    _ID_KEYS = ("spanrl.rollout_id", "agentlightning.rollout_id")
    _ATTEMPT_KEYS = ("spanrl.attempt_id", "agentlightning.attempt_id")

    def __init__(self, shape: Shape, size: int = 64):
        self.shape, self.size = shape, size
        self.templates = [rollout_spans(f"tmpl-{i}", "0", reward_of(i), shape, seed=i) for i in range(size)]
        self._rng = random.Random(0x5EED)

    def spans(self, i: int, rollout_id: str, attempt_id: str) -> list[ReadableSpan]:
        from opentelemetry.trace import SpanContext, TraceFlags

        out = []
        for s in self.templates[i % self.size]:
            attrs = dict(s.attributes)
            for k in self._ID_KEYS:
                attrs[k] = rollout_id
            for k in self._ATTEMPT_KEYS:
                attrs[k] = attempt_id
            if "gen_ai.response.id" in attrs:
                attrs["gen_ai.response.id"] = f"chatcmpl-{rollout_id}-{attrs['spanrl.sequence_id']}"
            ctx = SpanContext(self._rng.getrandbits(128) or 1, self._rng.getrandbits(64) or 1, is_remote=False,
                              trace_flags=TraceFlags(TraceFlags.SAMPLED))
            out.append(ReadableSpan(name=s.name, context=ctx, parent=None, resource=s.resource, attributes=attrs,
                                    events=s.events, links=s.links, kind=s.kind, status=s.status,
                                    start_time=s.start_time, end_time=s.end_time,
                                    instrumentation_scope=s.instrumentation_scope))
        return out
