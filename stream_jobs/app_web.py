"""The stream worker's web pages (Faust's web server): ``/spanrl/counters/``,
``/spanrl/held/``, ``/metrics`` and ``/spanrl/health/``. What they answer is computed by
the pure functions here (:func:`counters_json`, :func:`partitions_held`,
:func:`rollout_held`, :func:`health`); :class:`WebViews` registers the pages.
"""
from __future__ import annotations

from typing import Any

from spanrl.core import metrics as prom
from spanrl.stream_jobs import assembly
from spanrl.stream_jobs.agent_assemble import Assembler
from spanrl.stream_jobs.agent_group import Grouper
from spanrl.stream_jobs.app_context import AppContext, WorkerCounters
from spanrl.stream_jobs.faust_patches import changelog_writes


def counters_json(m: WorkerCounters, calls_held: int, transitions_held: int) -> dict:
    """``/spanrl/counters/``: the worker's counters, and what it holds in memory now."""
    counters = m.counters
    return {
        "spans_in": counters["spans_in"], "rewards_in": counters["rewards_in"],
        "rollout_events_in": counters["rollout_events_in"],
        "transitions_out": counters["transitions_out"], "samples_out": counters["samples_out"],
        "dead_letters_out": dict(m.dead_reasons),
        "call_accounts_out": counters["call_accounts_out"],
        "calls_by_agent": {f"{agent}|{how}": n for (agent, how), n in sorted(m.agent_counts.items())},
        "trace_links_out": counters["trace_links_out"], "trace_links_in": counters["trace_links_in"],
        "orphans_in": counters["orphans_in"], "spans_joined": counters["spans_joined"],
        "inputs_bounds_read": counters["inputs_bounds_read"], "emitted_by": dict(m.emitted_by),
        # late rewards: attempts parked (this process), parked calls re-read, late emissions,
        # and the call store's size now (what the worker holds in memory of token data)
        "attempts_parked": counters["attempts_parked"], "spans_reread": counters["spans_reread"],
        "late_rewards_emitted": counters["late_rewards_emitted"], "calls_held": calls_held,
        "transitions_held": transitions_held,
        "transitions_reread": counters["transitions_reread"],
        # finished states deleted by the count bound (SPANRL_STREAM_RETAIN_MAX) before their time
        "rollouts_evicted": counters["rollouts_evicted"], "tasks_evicted": counters["tasks_evicted"],
    }


def partitions_held(a: Assembler) -> dict[str, dict]:
    """Per partition: the emission rule's positions, rollouts waiting for them, the tick
    index (scanned, live keys, finished keys due), the finished rollout states the count bound
    tracks and the calls' token data held."""
    parts = sorted(set(a.positions) | set(a.waiting) | set(a.calls))
    return {str(p): {
        "positions": a.positions.get(p), "waiting": len(a.waiting.get(p, ())),
        "index_scanned": a.index.scanned(p),
        **dict(zip(("index_live", "index_due"), a.index.size(p))), "calls_held": len(a.calls.get(p, ())),
        "rollouts_finished": a.finished.count(p),
    } for p in parts}


def tables_held(tables: dict[str, Any]) -> dict[str, int]:
    """``/spanrl/held/``'s ``tables``: states each table holds in this worker's memory now
    (its active and standby partitions), by table name."""
    return {name: len(table) for name, table in tables.items()}


def rollout_held(a: Assembler, rid: str) -> dict | None:
    """One rollout's state and where the worker has it (None: no state)."""
    state = a.rollouts.get(rid)
    if state is None:
        return None
    return {
        "partition": state["partition"],
        "attempts": {aid: {k: at.get(k) for k in ("status", "done", "ready_ms", "ended_ms", "parked_ms",
                                                  "inputs_bound", "last_ms")}
                     | {"calls": len(at["calls"]), "rewards": len(at["rewards"])}
                     for aid, at in state["attempts"].items()},
        "awaiting_inputs": assembly.awaiting_inputs(state),
        "waiting": rid in a.waiting.get(state["partition"], ()),
        "index_live": rid in a.index._live.get(state["partition"], ()),
        "index_due_at": a.index._due.get(state["partition"], {}).get(rid),
        "tick_due": a.expiry(state),
    }


def health(app_id: str, assigned: int, rebalancing: bool, in_recovery: bool, recovered: bool) -> tuple[dict, int]:
    """``/spanrl/health/``'s body and status: 200 once partitions are assigned, no rebalance
    is under way and table recovery is done; 503 until then."""
    ready = bool(assigned) and not rebalancing and not in_recovery and recovered
    return ({"ok": ready, "app_id": app_id, "assigned_partitions": assigned,
             "rebalancing": bool(rebalancing), "in_recovery": bool(in_recovery)},
            200 if ready else 503)


def _view_function(handler):
    """A plain function calling the bound ``handler``, with its name and doc: Faust makes a
    page's View class with the function as its ``get`` (so it must bind like a function) and
    names the view after it."""
    async def view(web, request):
        return await handler(web, request)

    view.__name__ = view.__qualname__ = handler.__name__
    view.__doc__ = handler.__doc__
    return view


class WebViews:
    """The pages, as handlers bound to the context and the agents whose memory they show."""

    def __init__(self, ctx: AppContext, assembler: Assembler, grouper: Grouper):
        self.ctx, self.assembler, self.grouper = ctx, assembler, grouper

    def register(self, app) -> None:
        """Add the four pages to ``app``'s web server (view names: the handlers' names)."""
        for path, handler in (("/spanrl/counters/", self.counters_view), ("/spanrl/held/", self.held_view),
                              ("/metrics", self.metrics_view), ("/spanrl/health/", self.health_view)):
            app.page(path)(_view_function(handler))

    async def counters_view(self, web, request):
        """The worker's counters and what it holds in memory (:func:`counters_json`)."""
        return web.json(counters_json(self.ctx.metrics, sum(map(len, self.assembler.calls.values())),
                                      sum(map(len, self.grouper.stores.values()))))

    async def held_view(self, web, request):
        """What this worker holds, per partition: the emission rule's positions, rollouts
        waiting for them, the tick index (live keys, finished keys due), calls' token data.
        ``?rollout=<id>``: that rollout's state and where the worker has it (chaos forensics:
        an attempt that never left)."""
        t, writes = self.ctx.tables, changelog_writes(self.ctx.app)
        out: dict[str, Any] = {"partitions": partitions_held(self.assembler),
                               "tables": tables_held({"rollouts": t.rollouts, "groups": t.groups,
                                                      "traces": t.traces, "orphans": t.orphans}),
                               "tasks_finished": self.grouper.finished.total(),
                               # table writes since start, and the changelog records they became
                               # (one per changed key per transaction: faust_patches patch 5)
                               "changelog_writes": {"noted": writes.noted, "sent": writes.sent},
                               "retain_max": self.ctx.cfg.retain_max}
        rid = request.query.get("rollout")
        if rid:
            out["rollout"] = rollout_held(self.assembler, rid)
        return web.json(out)

    async def metrics_view(self, web, request):
        """The counters and the reward -> transition histogram, Prometheus text format."""
        return web.bytes(prom.exposition(self.ctx.metrics.registry), headers={"Content-Type": prom.CONTENT_TYPE})

    async def health_view(self, web, request):
        """200 once the worker processes records: partitions assigned, not rebalancing,
        table recovery done (Faust's web server answers long before that); 503 until then."""
        app = self.ctx.app
        assigned = len(app.consumer.assignment()) if app.consumer is not None else 0
        # recovery's state is read only when the rest says ready (as before: no Recovery made early)
        recovered = bool(assigned) and not app.rebalancing and not app.in_recovery \
            and app.tables.recovery.completed.is_set()
        body, status = health(self.ctx.cfg.app_id, assigned, app.rebalancing, app.in_recovery, recovered)
        return web.json(body, status=status)
