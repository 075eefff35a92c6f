"""What ``make_app`` registers on the Faust app (stream_jobs/app.py), recorded from the
code before ``make_app`` was split into one unit per agent (issue 22 item 3) and asserted
since: agent names and their input topics (the order of registration decides the assignor's
co-partition groups, hence the transactional ids), table names (their changelog topics),
the timer, the signal handlers, the web pages and the app's settings."""
import pytest

from spanrl.stream_jobs.app import StreamConfig, make_app


def _receivers(signal, app) -> list[str]:
    handlers = signal._filter_receivers.get(signal._create_id(app), set())
    return sorted(getattr(h, "__name__", repr(h)) for h in handlers)


def inventory(app) -> dict:
    """Everything a worker built from ``app`` subscribes to, writes and serves."""
    return {
        "agents": [(name, a.channel.topics, a.channel.partitions, a.channel.internal,
                    a.channel.key_serializer, a.channel.value_serializer, a.concurrency,
                    a.isolated_partitions)
                   for name, a in app.agents.items()],
        "tables": [(name, t.partitions, t.key_serializer, t.value_serializer,
                    t.changelog_topic.get_topic_name(), t.default)
                   for name, t in app.tables.items()],
        "tasks": [t.__name__ for t in app._app_tasks],
        "revoked": _receivers(app.on_partitions_revoked, app),
        "shutdown": _receivers(app.on_before_shutdown, app),
        "pages": {path: v.view_name for path, v in app.web.views.items()},
        "conf": (str(app.conf.processing_guarantee), app.conf.broker_commit_interval,
                 app.conf.producer_linger, app.conf.producer_max_request_size,
                 app.conf.topic_replication_factor, app.conf.web_host, app.conf.web_port,
                 app.conf.web_bind, str(app.conf.store), app.conf.topic_allow_declare,
                 app.conf.topic_disable_leader, app.conf.Worker.__name__, [str(u) for u in app.conf.broker]),
    }


RAW = ("raw", "raw")
AGENTS = [
    ("spanrl.stream_jobs.app.assemble", ("spans", "rewards", "rollouts", "inv-rollout-ticks"), 4, True,
     *RAW, 1, False),
    ("spanrl.stream_jobs.app.group", ("transitions", "inv-group-ticks"), 4, True, *RAW, 1, False),
    ("spanrl.stream_jobs.app.join", ("orphan-spans", "inv-trace-links", "inv-join-ticks"), 4, True,
     *RAW, 1, False),
]
TABLES = [
    ("rollouts", 4, "json", "json", "inv-rollouts-changelog", None),
    ("groups", 4, "json", "json", "inv-groups-changelog", None),
    ("traces", 4, "json", "json", "inv-traces-changelog", None),
    ("orphans", 4, "json", "raw", "inv-orphans-changelog", None),
]
PAGES = {"/spanrl/counters/": "counters_view", "/spanrl/held/": "held_view", "/metrics": "metrics_view",
         "/spanrl/health/": "health_view"}
CONF = ("ProcessingGuarantee.EXACTLY_ONCE", 0.25, 0.03, 4194304, 3, "127.0.0.9", 16099, "127.0.0.9",
        "memory:", True, True, "QuietWorker", ["kafka://k.example:9092"])


def config(**kw) -> StreamConfig:
    """A config that names every address and setting the inventory reads (no environment)."""
    return StreamConfig(app_id="inv", bootstrap="k.example:9092", web_host="127.0.0.9", web_port=16099,
                        commit_interval_s=0.25, linger_s=0.03, replication_factor=3, **kw)


@pytest.mark.parametrize("join_traces", [True, False])
def test_make_app_registers_what_it_always_did(join_traces):
    app = make_app(config(join_traces=join_traces))
    assert inventory(app) == {
        "agents": AGENTS if join_traces else AGENTS[:2],  # a replay runs without the join
        "tables": TABLES,
        "tasks": ["tick"],
        "revoked": ["_forget_positions"],
        "shutdown": ["_stop_ticker"],
        "pages": PAGES,
        "conf": CONF,
    }
    assert app.spanrl_config.app_id == "inv"
