"""Capacity projection: measured CPU cost per span -> cores per service and partitions.

    python -m spanrl.infra.capacity --from bench/results/latest-sustained.json --spans-per-s 100000

The model (CPU accounting only, no queueing): a service that spends
``c`` CPU µs per span needs ``rate × c × 1e-6`` cores to keep up with ``rate`` spans/s,
divided by the utilisation you are willing to run at. A Faust worker is one
single-threaded process (one core at most), so workers = whole worker cores, and every
co-partitioned topic needs at least that many partitions (Faust docs, "Workers": each
partition is consumed by one worker of the group; a worker without a partition idles).
The Kafka broker's cost measured on one broker without replication is multiplied by the
replication factor (each follower appends the same bytes and the leader serves its fetch:
an upper-bound estimate, not measured here).

The figures come from a benchmark's JSON (the sustained run's ``bench/results/latest-sustained.json``
or a burst ``latest.json``; :func:`costs_from_bench` names the fields read) or from flags.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

#: the services the projection names; ``worker`` decides the partition count
BRIDGE, WORKER, KAFKA = "bridge", "worker", "kafka"
SERVICES = (BRIDGE, WORKER, KAFKA)
#: other names the benchmark may give the same service
ALIASES = {"broker": KAFKA, "kafka_broker": KAFKA, "stream": WORKER, "faust": WORKER}


class CostsMissing(ValueError):
    """The benchmark JSON (and the flags) do not give a figure the projection needs."""


@dataclass(frozen=True)
class Costs:
    """Measured costs of one workload.

    us_per_span: CPU µs per span offered, per service (``bridge``, ``worker``, ``kafka``, ...);
    spans_per_rollout / transitions_per_rollout: the workload's shape (spans in, transitions
    out per rollout); source: where the figures came from (a path, ``flags``).
    """

    us_per_span: Mapping[str, float]
    spans_per_rollout: float
    transitions_per_rollout: float
    source: str = "flags"


@dataclass(frozen=True)
class Projection:
    """What a target rate needs. cores: fractional cores per service at the utilisation;
    processes: whole cores (= processes for the single-threaded worker and bridge);
    partitions: minimum partition count of the rollout-keyed topics; brokers: Kafka brokers
    (None when the broker's cost was not measured)."""

    spans_per_s: float
    rollouts_per_s: float
    transitions_per_s: float
    utilisation: float
    replication_factor: int
    cores: dict[str, float]
    processes: dict[str, int]
    partitions: int | None
    brokers: int | None
    notes: list[str] = field(default_factory=list)


# ---- maths ------------------------------------------------------------------------------

def cores_needed(us_per_span: float, spans_per_s: float, utilisation: float = 1.0) -> float:
    """Cores a service needs: ``spans_per_s × us_per_span × 1e-6 / utilisation``.

    us_per_span: CPU µs spent per span (≥ 0); spans_per_s: offered rate (≥ 0);
    utilisation: the busy fraction each core may reach, in (0, 1].
    Raises ValueError for a negative cost or rate or a utilisation outside (0, 1].
    """
    if us_per_span < 0 or spans_per_s < 0:
        raise ValueError(f"cost {us_per_span} µs/span and rate {spans_per_s} spans/s must be >= 0")
    if not 0 < utilisation <= 1:
        raise ValueError(f"utilisation {utilisation} must be in (0, 1]")
    return spans_per_s * us_per_span * 1e-6 / utilisation


def whole_cores(cores: float) -> int:
    """Cores rounded up to whole processes, at least 1; 1e-9 of float noise is forgiven
    (``100000 × 1500e-6`` is 150.00000000000003, which is 150 cores, not 151)."""
    return max(1, math.ceil(cores - 1e-9))


def min_partitions(workers: int) -> int:
    """Minimum partition count of the co-partitioned rollout topics for ``workers`` Faust
    workers: one partition per worker (a partition is consumed by one member of the
    consumer group, so partitions < workers leaves workers idle). A multiple of the worker
    count keeps their load equal; more leaves room to add workers without re-partitioning.
    Raises ValueError for workers < 1."""
    if workers < 1:
        raise ValueError(f"workers {workers} must be >= 1")
    return workers


def kafka_brokers(broker_cores: float, replication_factor: int, cores_per_broker: int) -> int:
    """Brokers for ``broker_cores`` of broker work: whole brokers of ``cores_per_broker``
    cores, and never fewer than the replication factor (each replica on its own broker).
    Raises ValueError for replication_factor < 1 or cores_per_broker < 1."""
    if replication_factor < 1 or cores_per_broker < 1:
        raise ValueError(f"replication factor {replication_factor} and cores per broker {cores_per_broker} must be >= 1")
    return max(replication_factor, math.ceil(broker_cores / cores_per_broker - 1e-9))


def project(costs: Costs, spans_per_s: float, utilisation: float = 1.0, replication_factor: int = 1,
            cores_per_broker: int = 8) -> Projection:
    """Cores per service, partitions and brokers for ``spans_per_s`` spans/s.

    The broker's per-span cost (measured at replication factor 1) is scaled by
    ``replication_factor``. Services without a measured cost are left out (a note says so).
    Raises ValueError from the functions above, or when the workload shape is not positive.
    """
    if costs.spans_per_rollout <= 0 or costs.transitions_per_rollout < 0:
        raise ValueError(f"spans per rollout {costs.spans_per_rollout} must be > 0, "
                         f"transitions per rollout {costs.transitions_per_rollout} >= 0")
    cores: dict[str, float] = {}
    for name, us in costs.us_per_span.items():
        scale = replication_factor if name == KAFKA else 1
        cores[name] = cores_needed(us * scale, spans_per_s, utilisation)
    processes = {name: whole_cores(c) for name, c in cores.items()}
    notes = [f"{name}: not measured" for name in SERVICES if name not in cores]
    partitions = min_partitions(processes[WORKER]) if WORKER in processes else None
    brokers = kafka_brokers(cores[KAFKA], replication_factor, cores_per_broker) if KAFKA in cores else None
    rollouts_per_s = spans_per_s / costs.spans_per_rollout
    return Projection(spans_per_s, rollouts_per_s, rollouts_per_s * costs.transitions_per_rollout, utilisation,
                      replication_factor, cores, processes, partitions, brokers, notes)


# ---- the benchmark's JSON -----------------------------------------------------------------

def _canonical(name: str) -> str:
    return ALIASES.get(name, name)


def _candidates(doc: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Where a spanrl result may sit in the benchmark JSON, most specific first."""
    out = []
    for path in (("sustained", "spanrl"), ("sustained",), ("spanrl", "sustained"), ("spanrl",), ()):
        node: Any = doc
        for key in path:
            node = node.get(key) if isinstance(node, Mapping) else None
        if isinstance(node, Mapping):
            out.append(node)
    return out


def service_costs(processes: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """CPU µs per span per service from a sustained run's per-process figures: processes named
    SERVICE or SERVICE<n> (``bridge0``, ``bridge1``, ``worker0``, ``kafka``) are summed per
    service; the broker's ``cpu_us_per_span_minus_idle`` (its idle CPU taken out) is preferred
    when present and not negative (a negative one comes from an idle sample taken while the
    broker was still busy, e.g. just after a restart: the raw figure is used then); other processes (the load generator ``client``) are left out."""
    out: dict[str, float] = {}
    for name, fig in processes.items():
        service = _canonical(name.rstrip("0123456789"))
        if service not in SERVICES or not isinstance(fig, Mapping):
            continue
        us = fig.get("cpu_us_per_span_minus_idle")
        if us is None or us < 0:  # an idle sample taken while the broker was busy (just restarted): unusable
            us = fig.get("cpu_us_per_span")
        if us is not None:
            out[service] = out.get(service, 0.0) + float(us)
    return out


def _sustained_side(doc: Mapping[str, Any], source: str, side: int) -> Costs | None:
    """The costs of run ``side`` of a sustained result (``spanrl``: a list of runs, one per
    worker/bridge count, as ``bench.sustained`` writes it), or None for other layouts."""
    sides = doc.get("spanrl")
    if not isinstance(sides, list) or not sides:
        return None
    index = side % len(sides)
    run = sides[index]
    us = service_costs(run.get("processes") or {})
    rollouts = run.get("rollouts")
    spr = (doc.get("workload") or {}).get("spans_per_rollout") or (run["spans"] / rollouts if rollouts else None)
    tpr = run["expected_transitions"] / rollouts if rollouts and "expected_transitions" in run else None
    missing = [n for n, v in (("processes[].cpu_us_per_span", us), ("spans_per_rollout", spr),
                              ("transitions_per_rollout", tpr)) if not v and v != 0]
    if missing:
        raise CostsMissing(f"{source}: run {index}: no {', '.join(missing)}")
    label = f"{source} (run {index}: {run.get('workers', '?')} workers, {run.get('bridges', '?')} bridges)"
    return Costs(us, float(spr), float(tpr), label)


def costs_from_bench(doc: Mapping[str, Any], source: str = "bench", side: int = -1) -> Costs:
    """The costs in a benchmark result (``bench/results/*.json``).

    A sustained result (``spanrl`` is a list of runs, ``bench.sustained``): run ``side``
    (default the last, the scale-out run), see :func:`service_costs`; spans per rollout from
    ``workload.spans_per_rollout``, transitions per rollout = ``expected_transitions /
    rollouts``. Otherwise, in the first of ``sustained.spanrl``, ``sustained``,
    ``spanrl.sustained``, ``spanrl``, top level that has them:
    - ``cpu_us_per_span``: {service: µs} (``broker`` is read as ``kafka``), else derived
      from ``runs``: the median over runs of ``cpu_s[service] / spans × 1e6`` (the burst
      benchmark's fields);
    - ``spans_per_rollout`` / ``transitions_per_rollout``, else ``spans`` / ``transitions``
      of the runs divided by ``params.rollouts``.
    Raises CostsMissing naming what is absent.
    """
    sustained = _sustained_side(doc, source, side)
    if sustained is not None:
        return sustained
    us: dict[str, float] = {}
    spr = tpr = None
    for node in _candidates(doc):
        if not us and isinstance(node.get("cpu_us_per_span"), Mapping):
            us = {_canonical(k): float(v) for k, v in node["cpu_us_per_span"].items() if v is not None}
        runs = [r for r in node.get("runs", ()) if isinstance(r, Mapping) and r.get("spans")]
        if not us and runs and all(isinstance(r.get("cpu_s"), Mapping) for r in runs):
            names = set().union(*(r["cpu_s"] for r in runs))
            us = {_canonical(n): statistics.median(r["cpu_s"][n] / r["spans"] * 1e6 for r in runs if n in r["cpu_s"])
                  for n in sorted(names)}
        rollouts = (node.get("params") or {}).get("rollouts")
        if spr is None:
            spr = node.get("spans_per_rollout") or (
                statistics.median(r["spans"] / rollouts for r in runs) if runs and rollouts else None)
        if tpr is None:
            tpr = node.get("transitions_per_rollout") or (
                statistics.median(r.get("expected_transitions", r.get("transitions", 0)) / rollouts for r in runs)
                if runs and rollouts else None)
    missing = [n for n, v in (("cpu_us_per_span (or runs[].cpu_s)", us), ("spans_per_rollout", spr),
                              ("transitions_per_rollout", tpr)) if not v and v != 0]
    if missing:
        raise CostsMissing(f"{source}: no {', '.join(missing)}")
    return Costs(us, float(spr), float(tpr), source)


def merge_flags(base: Costs | None, us_flags: Mapping[str, float | None], spans_per_rollout: float | None,
                transitions_per_rollout: float | None) -> Costs:
    """``base`` (from the JSON, or None) with every flag that was given put over it.
    Raises CostsMissing when the workload shape is given by neither."""
    us = dict(base.us_per_span) if base else {}
    us.update({k: v for k, v in us_flags.items() if v is not None})
    spr = spans_per_rollout if spans_per_rollout is not None else (base.spans_per_rollout if base else None)
    tpr = transitions_per_rollout if transitions_per_rollout is not None else (
        base.transitions_per_rollout if base else None)
    if spr is None or tpr is None:
        raise CostsMissing("give --spans-per-rollout and --transitions-per-rollout (or --from a bench JSON)")
    changed = base is None or us != dict(base.us_per_span) or spr != base.spans_per_rollout \
        or tpr != base.transitions_per_rollout
    source = "flags" if base is None else (base.source + " + flags" if changed else base.source)
    return Costs(us, spr, tpr, source)


# ---- CLI ----------------------------------------------------------------------------------

def render(p: Projection, costs: Costs) -> None:
    """Print the projection as a rich table."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"cores for {p.spans_per_s:,.0f} spans/s")
    for col in ("service", "CPU µs/span (measured)", "cores", "whole cores = processes"):
        t.add_column(col, justify="left" if col == "service" else "right")
    for name in sorted(p.cores):
        t.add_row(name, f"{costs.us_per_span[name]:,.0f}", f"{p.cores[name]:,.1f}", str(p.processes[name]))
    c = Console()
    c.print(f"{p.spans_per_s:,.0f} spans/s = {p.rollouts_per_s:,.0f} rollouts/s -> {p.transitions_per_s:,.0f} "
            f"transitions/s; utilisation {p.utilisation:.0%}, replication factor {p.replication_factor}")
    c.print(t)
    c.print(f"partitions of spans/rewards/rollouts (>= workers): {p.partitions if p.partitions else 'n/a'}; "
            f"Kafka brokers: {p.brokers if p.brokers else 'n/a'}; costs from {costs.source}")
    if KAFKA in p.cores:
        c.print(f"kafka cores include replication x{p.replication_factor} (estimate: the µs were measured on one "
                "unreplicated broker)")
    for n in p.notes:
        c.print(f"[yellow]{n}[/yellow]")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="source", type=Path,
                    help="a bench result JSON (bench/results/latest-sustained.json, or a burst latest.json)")
    ap.add_argument("--run", type=int, default=-1, help="which run of a sustained result (default: the last)")
    ap.add_argument("--spans-per-s", type=float, default=100_000.0)
    for name in SERVICES:
        ap.add_argument(f"--{name}-us", type=float, help=f"CPU µs per span of the {name} (over the JSON's)")
    ap.add_argument("--spans-per-rollout", type=float)
    ap.add_argument("--transitions-per-rollout", type=float)
    ap.add_argument("--utilisation", type=float, default=0.7, help="busy fraction per core to plan for")
    ap.add_argument("--replication-factor", type=int, default=3)
    ap.add_argument("--cores-per-broker", type=int, default=8)
    ap.add_argument("--json", action="store_true", help="print the projection as JSON")
    a = ap.parse_args(argv)
    try:
        base = costs_from_bench(json.loads(a.source.read_text()), str(a.source), a.run) if a.source else None
        costs = merge_flags(base, {n: getattr(a, f"{n}_us") for n in SERVICES}, a.spans_per_rollout,
                            a.transitions_per_rollout)
        p = project(costs, a.spans_per_s, a.utilisation, a.replication_factor, a.cores_per_broker)
    except (OSError, json.JSONDecodeError, ValueError) as exc:
        print(f"capacity: {exc}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({"costs": {"us_per_span": dict(costs.us_per_span), "spans_per_rollout": costs.spans_per_rollout,
                                    "transitions_per_rollout": costs.transitions_per_rollout, "source": costs.source},
                          "projection": p.__dict__}, indent=1))
    else:
        render(p, costs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
