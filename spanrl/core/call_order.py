"""The order of an attempt's calls, also when two proxy processes recorded them.

Each proxy process numbers an attempt's calls from 0 (``sequence_id``, producers/proxy.py
``SequenceCounter``) and stamps every span it records with its own random instance id
(:data:`INSTANCE`, a span attribute). The load balancer keeps a session on one proxy
(infra/deploy/nginx.conf), so the sequence ids order an attempt's calls; but a session moves
when its unit fails (nginx passes the call to the next unit on its hash ring) and a restarted
proxy counts from 0 again: then one attempt's calls carry sequence ids of two counters, which
collide and can order a later call first.

Such an attempt is ordered by the position of each call's span record in the spans topic
instead. The proxy answers a call only after Kafka acknowledged its span (acks=all), and all
spans of a rollout share one partition (keyed by rollout id): a call the agent made after
another one had answered was appended after it, so the partition's offsets order a
session's successive calls whichever proxy recorded them. This is Lamport's happened-before
order (Lamport 1978, "Time, clocks, and the ordering of events in a distributed system",
CACM 21(7)) with the partition's log as the one clock; calls in flight together are ordered
as Kafka appended them. No wall clock is read; the order is the same each time the records
are read again (replay, a worker restarted from its changelog).

Pure: no Kafka, no Faust. Used by stream_jobs/assembly.py.
"""
from __future__ import annotations

from typing import Mapping

#: span attribute: the random id of the proxy process that recorded the call
INSTANCE = "spanrl.proxy_instance"


def split_over_proxies(calls: Mapping[str, Mapping]) -> bool:
    """Whether the calls (span_id -> ``{"instance": ...}``) were numbered by more than one
    proxy process; calls without an instance (recorded by an agent's own telemetry, whose
    sequence ids are the agent's, or by a proxy before instances) never count as a split."""
    instances = [c.get("instance") for c in calls.values()]
    return None not in instances and len(set(instances)) > 1


def call_order(calls: Mapping[str, Mapping]) -> list[str]:
    """Span ids of an attempt's calls in call order. ``calls``: span_id -> ``{"sequence_id":
    int, "instance": str (optional), "at": [topic, partition, offset] (optional)}``.

    One proxy (the usual case): ``(sequence_id, span_id)``. Several proxies, every call's span
    record known and in one partition: ``(offset, span_id)`` (module doc). Several proxies
    but a position missing (a call added without one): ``(sequence_id, span_id)``, the best
    left."""
    if split_over_proxies(calls):
        places = {tuple(c["at"][:2]) if c.get("at") is not None else None for c in calls.values()}
        if None not in places and len(places) == 1:
            return sorted(calls, key=lambda sid: (calls[sid]["at"][2], sid))
    return sorted(calls, key=lambda sid: (calls[sid]["sequence_id"], sid))
