"""Prometheus ``/metrics`` of spanrl's services, with the official ``prometheus-client``.

Every service already counts what it does in a plain dict (the proxy's and the bridge's
JSON ``/status``, the Faust worker's ``/spanrl/counters/``, the trainer's and the
reloader's ``/status``). Those dicts stay the one place that counts: a
:class:`CountsCollector` turns them into Prometheus families at scrape time
(:func:`count_families`, pure), so no event is counted twice. Latencies that no dict
holds are ``prometheus_client.Histogram``\\ s in the service's own registry
(:func:`latency_histogram`, buckets :data:`LATENCY_BUCKETS`).

Each app gets its own ``CollectorRegistry`` (tests build many apps in one process; the
global registry would refuse the second). :func:`exposition` renders a registry in the
Prometheus text format (:data:`CONTENT_TYPE`: prometheus-client's ``CONTENT_TYPE_LATEST``,
``text/plain; version=1.0.0`` in 0.26; names here are plain ASCII, so the body is the classic
format every Prometheus parses).

Names follow Prometheus' conventions (https://prometheus.io/docs/practices/naming/):
``spanrl_<service>_<what>_total`` for counters, ``_seconds`` for histograms of durations.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.utils import floatToGoString

#: seconds; vLLM on CPU answers in 0.1 s to minutes, a Kafka ack in milliseconds
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST

_STATUS = re.compile(r"^http_(\d{3})$")
_VLLM_STATUS = re.compile(r"^vllm_http_(\d{3})$")
_GRPC_STATUS = re.compile(r"^grpc_([A-Z_]+)$")
_DEAD = "dead_letter."


def count_families(service: str, counts: Mapping[str, int | float], plain: Mapping[str, str]) -> list[Metric]:
    """Prometheus counter families of a service's count dict (the proxy's / bridge's JSON).

    ``counts``: the service's ``Counter`` (keys as the services write them). ``plain``:
    key -> help text of the keys that are plain counters; each becomes
    ``spanrl_<service>_<key>_total`` (always present, 0 until counted). Other keys:

    - ``http_<status>`` -> ``spanrl_<service>_error_responses_total{status}``;
    - ``vllm_http_<status>`` -> ``spanrl_<service>_vllm_errors_total{status}`` (vLLM's
      non-200 answers, passed on to the client as they are);
    - ``grpc_<CODE>`` (a gRPC status code name, upper case: ``grpc_UNAUTHENTICATED``) ->
      ``spanrl_<service>_grpc_errors_total{code}`` (the bridge's OTLP/gRPC refusals);
    - ``dead_letter.<reason>`` -> ``spanrl_<service>_dead_letters_total{reason}``;
    - any other key is a refusal reason (``error()`` counts ``http_<status>`` and its
      reason; a stream's recording failure counts its reason) ->
      ``spanrl_<service>_refusals_total{reason}``.

    The labelled families are always present, empty until something is counted.
    Non-numeric values are ignored. Returns the families in that order (plain first,
    in ``plain``'s order)."""
    prefix = f"spanrl_{service}"
    out: list[Metric] = [CounterMetricFamily(f"{prefix}_{key}", text, value=float(counts.get(key, 0)))
                         for key, text in plain.items()]
    errors = CounterMetricFamily(f"{prefix}_error_responses", "error responses by HTTP status", labels=["status"])
    vllm = CounterMetricFamily(f"{prefix}_vllm_errors", "vLLM's non-200 answers by HTTP status", labels=["status"])
    dead = CounterMetricFamily(f"{prefix}_dead_letters", "records dead-lettered by reason code", labels=["reason"])
    grpc = CounterMetricFamily(f"{prefix}_grpc_errors", "gRPC error answers by status code", labels=["code"])
    refusals = CounterMetricFamily(f"{prefix}_refusals", "requests refused, by reason code", labels=["reason"])
    for key in sorted(counts):
        value = counts[key]
        if key in plain or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if m := _STATUS.match(key):
            errors.add_metric([m.group(1)], float(value))
        elif m := _VLLM_STATUS.match(key):
            vllm.add_metric([m.group(1)], float(value))
        elif m := _GRPC_STATUS.match(key):
            grpc.add_metric([m.group(1)], float(value))
        elif key.startswith(_DEAD):
            dead.add_metric([key[len(_DEAD):]], float(value))
        else:
            refusals.add_metric([key], float(value))
    return out + [errors, vllm, grpc, dead, refusals]


def labelled_counter(name: str, text: str, label: str, counts: Mapping[str, int | float]) -> CounterMetricFamily:
    """One counter family ``name{label}`` with a sample per entry of ``counts`` (sorted)."""
    family = CounterMetricFamily(name, text, labels=[label])
    for key in sorted(counts):
        family.add_metric([str(key)], float(counts[key]))
    return family


def histogram_family(name: str, text: str, values: Iterable[float],
                     buckets: tuple[float, ...] = LATENCY_BUCKETS) -> HistogramMetricFamily:
    """A histogram family built from recorded ``values`` (e.g. the reloader's ``reload_s`` of
    each history entry): cumulative counts per upper bound ``le`` (Prometheus' histogram
    semantics: an observation ``v`` is counted in every bucket with ``v <= le``), ``+Inf``
    = the number of values, ``sum`` = their sum."""
    values = [float(v) for v in values]
    cumulative = [(floatToGoString(le), sum(1 for v in values if v <= le)) for le in buckets]
    family = HistogramMetricFamily(name, text)
    family.add_metric([], buckets=[*cumulative, ("+Inf", len(values))], sum_value=sum(values))
    return family


class CountsCollector:
    """A custom collector (``prometheus_client`` calls :meth:`collect` at every scrape):
    ``families()`` returns the families, read from the service's own counters then."""

    def __init__(self, families: Callable[[], Iterable[Metric]]):
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return list(self._families())


def registry(families: Callable[[], Iterable[Metric]] | None = None) -> CollectorRegistry:
    """A registry of its own for one service app, with a :class:`CountsCollector` over
    ``families`` when given."""
    reg = CollectorRegistry(auto_describe=False)
    if families is not None:
        reg.register(CountsCollector(families))
    return reg


def latency_histogram(reg: CollectorRegistry, name: str, text: str, labels: tuple[str, ...] = ()) -> Histogram:
    """A ``Histogram`` of durations in seconds (``LATENCY_BUCKETS``) in ``reg``."""
    return Histogram(name, text, labelnames=labels, buckets=LATENCY_BUCKETS, registry=reg)


def gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=float(value))


def exposition(reg: CollectorRegistry) -> bytes:
    """The registry in the Prometheus text format (:data:`CONTENT_TYPE`)."""
    return generate_latest(reg)
