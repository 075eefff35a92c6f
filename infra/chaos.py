"""``make chaos``: SIGKILL each component mid-run, restart it, and prove nothing was lost or
duplicated (issue 3). Writes ``results/chaos.json`` (and a table on the console).

For each fault (in separate runs on one stack): publish a workload of known size (``tasks``
tasks x ``group_size`` rollouts x ``calls`` LLM calls, known rewards; infra/chaos_workload.py)
to its own tasks topic, start the runner process, wait until a fraction of the calls were
acknowledged, SIGKILL the component's process group, restart it after ``down_s`` and time
its recovery. Components the fault took down with it are restarted too and reported.
Tasks whose attempts failed during the fault get make-up runs (same task id) so the
workload completes. Then wait until the stream jobs and the trainer have caught up and
account (infra/ledger.py) from what Kafka holds (read_committed):

- calls acknowledged by the proxy -> exactly one transition, or dead-lettered with a reason;
- transitions -> exactly one sample (or a grouper dead letter); advantages recomputed;
- every 2xx the client got (calls, bridge spans, rewards) is in Kafka;
- the trainer: checkpoint manifests chain without gaps or overlaps and its trained
  offsets reach the last sample of the run.

``trainer_rank``: the trainer is restarted as two data-parallel ranks (``SPANRL_TRAINER_RANKS=2``,
trainer/ranks.py) and only rank 1 is SIGKILLed, mid-update; DeepSpeed's launcher takes the
group down, the group is restarted (two ranks) and resumes at its last checkpoint; afterwards
the one-rank trainer comes back for the next faults.

The stack is (re)started with short timeouts (``CHAOS_ENV``) and a fresh trainer run.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import httpx

from spanrl.core.settings import (CLUSTER_LAYOUT, Settings, StreamSettings, TrainerConfig, check_environment, child_env, get_settings,
                                  set_env, update_env)
from spanrl.infra import ledger, storage
from spanrl.infra.admin import admin_headers, request_training
from spanrl.infra.chaos_workload import AckLog
from spanrl.infra.replay import end_offsets, read_records
from spanrl.infra.stack import ROOT, Stack, kafka_node_names, replica_names, stop_process_group
from spanrl.producers.kafka import Topics, create_topics
from spanrl.producers.runner import publish_tasks
from spanrl.schemas import codec
from spanrl.schemas import topics as T
from spanrl.trainer import checkpoint

#: fault name -> stack component it kills ("runner" is the workload's own process; the cluster
#: faults' broker is chosen when they strike: :func:`cluster_victim`)
FAULTS: dict[str, str] = {
    "worker": "stream", "trainer": "trainer", "trainer_rank": "trainer", "bridge": "bridge", "proxy": "proxy", "runner": "runner",
    "kafka": "kafka", "minio": "minio", "vllm": "vllm",
    "kafka_broker": "a broker that is not the active controller", "kafka_controller": "the active KRaft controller",
    "stream_replica": "the last of the stream workers (its partitions move to the others)",
}
#: faults of the cluster layout (settings.CLUSTER_LAYOUT: 3 brokers, 2 stream workers, 2 bridges;
#: the stack restarted as one after the other faults unless it already is one); spanrl's other
#: services must go on without a restart
CLUSTER_FAULTS = ("kafka_broker", "kafka_controller", "stream_replica")
#: environment of the stack during chaos: timeouts short enough that a killed attempt is
#: dead-lettered within the run, checkpoints every update, small batches
CHAOS_ENV = {
    **StreamSettings.env(reward_timeout_s="15", rollout_timeout_s="30", group_timeout_s="30",
                         # late rewards: an attempt without one parks at 15 s and is dead-lettered at 25 s
                         reward_window_s="25", settle_s="2",
                         # a SIGKILLed worker's partitions move after 10 s, not Faust's 60 s
                         stream_session_timeout_s="10"),
    # the recipe's settings (TrainerConfig's defaults: recipe default), updates cut as the samples
    # come (stream batching: min_batch samples or 5 s idle) so that faults land mid-update
    **TrainerConfig.env(batching="stream", min_batch="12", idle_flush_s="5", checkpoint_every="1",
                        # a full run publishes ~35 versions of ~0.5 GB: keep the weights of the newest 4
                        # only (every manifest stays, so the offset chain is still checked end to end)
                        keep_published="4"),
}


@dataclass
class ChaosConfig:
    """faults: names from FAULTS, in order; tasks x group_size rollouts of ``calls`` calls per fault;
    kill_at: fraction of the run's calls acknowledged before the kill; down_s: seconds the
    component stays dead (MinIO longer, so a checkpoint upload meets the outage)."""

    faults: tuple[str, ...] = tuple(FAULTS)
    tasks: int = 6
    group_size: int = 4
    calls: int = 3
    pace_s: float = 0.5
    concurrency: int = 4
    kill_at: float = 0.35
    down_s: dict = field(default_factory=lambda: {"minio": 20.0, "kafka": 5.0, "kafka_broker": 15.0,
                                                  "kafka_controller": 15.0, "stream_replica": 15.0})
    default_down_s: float = 3.0
    settle_timeout_s: float = 300.0
    makeup_rounds: int = 3
    out_dir: Path = Path("results")
    restart_stack: bool = True  # False: keep a running (chaos-started) stack and its run


# ------------------------------------------------------------------------- Kafka reads
def _decode_all(record: str, rows) -> list[dict]:
    out = []
    for p, off, _, value in rows:
        try:
            out.append({**codec.decode(record, value), "_partition": p, "_offset": off})
        except codec.SchemaError:
            pass  # not ours to account (the stream job dead-letters undecodable input)
    return out


@dataclass
class Snapshot:
    """What Kafka holds for one fault run, decoded and filtered to its rollouts."""

    events: list[dict]
    calls: list[dict]
    spans: list[dict]
    rewards: list[dict]
    transitions: list[dict]
    samples: list[dict]
    dead_letters: list[dict]


async def snapshot(s: Settings, task_ids: set[str], start: dict[str, dict[int, int]]) -> Snapshot:
    b = s.kafka_bootstrap
    events = [e for e in _decode_all("rollout", await read_records(b, T.ROLLOUTS.name, start[T.ROLLOUTS.name]))
              if e["task_id"] in task_ids]
    rids = {e["rollout_id"] for e in events}
    spans = [x for x in _decode_all("span", await read_records(b, T.SPANS.name, start[T.SPANS.name]))
             if x["rollout_id"] in rids]
    rewards = [x for x in _decode_all("reward", await read_records(b, T.REWARDS.name, start[T.REWARDS.name]))
               if x["rollout_id"] in rids]
    transitions = [x for x in _decode_all("transition", await read_records(
        b, T.TRANSITIONS.name, start[T.TRANSITIONS.name])) if x["rollout_id"] in rids]
    samples = [x for x in _decode_all("sample", await read_records(b, T.SAMPLES.name, start[T.SAMPLES.name]))
               if x["transition"]["rollout_id"] in rids]
    dead = []
    for d in _decode_all("dead_letter", await read_records(b, T.DEAD_LETTER.name, start[T.DEAD_LETTER.name])):
        if d.get("payload") and d.get("stage") == "grouper":
            try:
                d["transition"] = codec.decode("transition", d["payload"])
                d["rollout_id"] = d["rollout_id"] or d["transition"]["rollout_id"]
            except codec.SchemaError:
                pass
        if d.get("rollout_id") in rids:
            dead.append(d)
    calls = [x for x in spans if x["kind"] == "llm" and x.get("source") == "proxy"]
    return Snapshot(events, calls, spans, rewards, transitions, samples, dead)


# ------------------------------------------------------------------------- processes
class RunnerProcess:
    """The workload's runner (python -m spanrl.infra.chaos_workload) in its own process group."""

    def __init__(self, stack: Stack, tasks_topic: str, ack_log: Path, cfg: ChaosConfig):
        self.stack, self.tasks_topic, self.ack_log, self.cfg = stack, tasks_topic, ack_log, cfg
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.stack.logs / "chaos-runner.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spanrl.infra.chaos_workload", "--tasks-topic", self.tasks_topic,
             "--ack-log", str(self.ack_log), "--calls", str(self.cfg.calls), "--pace", str(self.cfg.pace_s),
             "--concurrency", str(self.cfg.concurrency)],
            cwd=ROOT, env=child_env(self.stack.service_env()), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout_s) if self.proc else 0
        except subprocess.TimeoutExpired:
            stop_process_group(self.proc, 10)
            return None


def kill_component(stack: Stack, name: str) -> None:
    """SIGKILL a stack component's whole process group (no grace, no cleanup)."""
    pid = stack._pid(name)
    if pid is None:
        raise RuntimeError(f"{name} is not running")
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while stack._pid(name) is not None and time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)


def quorum_leader(describe_status: str) -> int:
    """The active controller's node id from ``kafka-metadata-quorum describe --status``'s
    output (its ``LeaderId:`` line). Raises ValueError when there is none."""
    for line in describe_status.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "LeaderId" and value.strip().isdigit():  # -1: no leader elected
            return int(value)
    raise ValueError(f"no LeaderId in the quorum's status:\n{describe_status[-2000:]}")


def active_controller(stack: Stack, timeout_s: float = 60.0) -> int:
    """The node id of the cluster's active controller, asked of the controllers themselves
    (Kafka's MetadataQuorumCommand over ``--bootstrap-controller``)."""
    s = stack.s
    libs = f"{s.cache_dir / f'kafka-{s.kafka_version}' / 'libs'}/*"
    controllers = ",".join(f"{s.host}:{p}" for p in s.kafka_controller_ports)
    out = subprocess.run(["java", "-cp", libs, "org.apache.kafka.tools.MetadataQuorumCommand",
                          "--bootstrap-controller", controllers, "describe", "--status"],
                         capture_output=True, text=True, timeout=timeout_s)
    return quorum_leader(out.stdout + out.stderr)


def cluster_victim(fault: str, nodes: list[str], leader: int, workers: list[str] = ("stream",)) -> str:
    """The component a cluster fault kills: ``kafka_controller`` the active controller's node
    (node ids are 1-based positions in ``nodes``), ``kafka_broker`` the last node that is not,
    ``stream_replica`` the last of ``workers`` (ValueError if it is the only one)."""
    if fault == "kafka_controller":
        return nodes[leader - 1]
    if fault == "kafka_broker":
        return [n for i, n in enumerate(nodes) if i + 1 != leader][-1]
    if fault == "stream_replica":
        if len(workers) < 2:
            raise ValueError(f"stream_replica needs two stream workers or more, the stack has {list(workers)}")
        return list(workers)[-1]
    raise ValueError(f"{fault} is not a cluster fault ({', '.join(CLUSTER_FAULTS)})")


#: the trainer of the ``trainer_rank`` fault: two data-parallel ranks (trainer/ranks.py)
TWO_RANKS = TrainerConfig.env(ranks="2")


def kill_trainer_rank(stack: Stack, rank: int, timeout_s: float = 120.0) -> float:
    """SIGKILL one rank of the running trainer group (its other ranks and DeepSpeed's launcher
    are left alone) and wait until the whole group has exited; returns the seconds that took.
    Raises RuntimeError when the trainer is not running with that rank or outlives the timeout."""
    from spanrl.trainer import ranks

    pid = stack._pid("trainer")
    pids = ranks.rank_processes(pid) if pid else {}
    if rank not in pids:
        raise RuntimeError(f"the trainer has no rank {rank} (ranks: {sorted(pids)}): is SPANRL_TRAINER_RANKS > {rank}?")
    t0 = time.monotonic()
    os.kill(pids[rank], signal.SIGKILL)
    while stack._pid("trainer") is not None:
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"the trainer group outlived rank {rank} by {timeout_s:.0f}s")
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.2)
    return time.monotonic() - t0


def heal(stack: Stack, unhealthy_grace_s: float = 120.0) -> list[str]:
    """Restart every component whose process exited, and any that stays unhealthy for
    ``unhealthy_grace_s`` (a trainer inside a long update may answer health checks slowly);
    returns ``"name (exited)"`` / ``"name (unhealthy)"`` for each (collateral of a fault)."""
    restarted = []
    for name in stack.components:
        why = None
        if not stack.running(name):
            why = "exited"
        elif not stack.healthy(name):
            deadline = time.monotonic() + unhealthy_grace_s
            while stack.running(name) and not stack.healthy(name) and time.monotonic() < deadline:
                time.sleep(1)
            if not stack.running(name):
                why = "exited"
            elif not stack.healthy(name):
                why = "unhealthy"
        if why:
            stack.stop(name)
            stack.start(name)
            restarted.append(f"{name} ({why})")
    return restarted


def _get_json(url: str) -> dict:
    try:
        return httpx.get(url, timeout=5, headers=admin_headers(get_settings())).json()
    except (httpx.HTTPError, ValueError):
        return {}


def trainer_status(s: Settings) -> dict:
    return _get_json(f"http://{s.host}:{s.trainer_port}/status")


def manifests(s: Settings, run: str) -> list[dict]:
    """Every checkpoint manifest of ``run`` in MinIO, by version."""
    client = checkpoint.make_client(s)
    latest = checkpoint.latest_version_in_store(client, s.checkpoint_bucket, run) or 0
    out = []
    for v in range(1, latest + 1):
        try:
            resp = client.get_object(s.checkpoint_bucket, f"{run}/{v:06d}/{checkpoint.MANIFEST}")
            out.append(json.loads(resp.read()))
            resp.close()
        except Exception as exc:  # noqa: BLE001 - a missing version is a finding, not a crash
            out.append({"version": v, "missing": repr(exc)})
    return out


def trainer_problems(s: Settings, run: str, ms: list[dict]) -> list[str]:
    """Gaps/overlaps in the run's checkpoint chain, from its start marker on
    (spanrl.trainer.checkpoint.check_offset_chain over every manifest's consumed_offsets)."""
    missing = [f"v{m['version']}: manifest unreadable ({m['missing']})" for m in ms if "missing" in m]
    marker = checkpoint.read_start_marker(checkpoint.make_client(s), s.checkpoint_bucket, run)
    return missing + checkpoint.check_offset_chain([m for m in ms if "missing" not in m],
                                                   start=(marker or {}).get("offsets"))


# ------------------------------------------------------------------------- one fault
def run_fault(stack: Stack, fault: str, cfg: ChaosConfig, say: Callable[[str], None] = print) -> dict:
    """Run the workload, inject ``fault``, recover, account. Returns the chaos.json entry."""
    s = stack.s
    if fault == "trainer_rank":  # the same run goes on with a 2-rank trainer group
        stack.stop("trainer")
        stack.start("trainer", extra_env=TWO_RANKS)
    fid = f"{fault}-{uuid.uuid4().hex[:6]}"
    tasks_topic = T.Topic(f"chaos-tasks.{fid}", "task_id", "task", 1)
    asyncio.run(create_topics(s.kafka_bootstrap, (tasks_topic,), s.kafka_replication_factor))
    watched = (T.ROLLOUTS, T.SPANS, T.REWARDS, T.TRANSITIONS, T.SAMPLES, T.DEAD_LETTER)
    start = {t.name: asyncio.run(end_offsets(s.kafka_bootstrap, t.name)) for t in watched}
    task_ids = [f"{fid}-t{i}" for i in range(cfg.tasks)]
    topics = replace(Topics(), tasks=tasks_topic)
    asyncio.run(publish_tasks([{"task_id": t, "payload": json.dumps({"n": i}), "group_size": cfg.group_size,
                                "timeout_s": 300.0} for i, t in enumerate(task_ids)], s.kafka_bootstrap, topics))
    ack_log = stack.state / "chaos" / f"{fid}.jsonl"
    runner = RunnerProcess(stack, tasks_topic.name, ack_log, cfg)
    t0 = time.monotonic()
    runner.start()
    planned = cfg.tasks * cfg.group_size * cfg.calls
    component = FAULTS[fault]
    updates0 = trainer_status(s).get("updates", 0)

    # wait for the moment to strike
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        calls = sum(1 for a in AckLog.read(ack_log) if a["kind"] == "call")
        if fault == "trainer_rank":  # one rank of a 2-rank group, mid-update
            if trainer_status(s).get("in_update"):
                time.sleep(1.0)
                break
        elif component in ("trainer", "minio"):
            st = trainer_status(s)
            if st.get("buffered", 0) > 0 or st.get("updates", 0) > updates0:
                time.sleep(2.0)
                break
        elif calls >= cfg.kill_at * planned:
            break
        if runner.proc.poll() is not None and component != "runner":
            break
        time.sleep(0.5)
    cluster: dict = {}
    if fault in CLUSTER_FAULTS:
        leader = active_controller(stack)
        component = cluster_victim(fault, kafka_node_names(s.kafka_brokers), leader,
                                   replica_names("stream", s.stream_workers))
        cluster["controller_before"] = leader
    acked_at_kill = sum(1 for a in AckLog.read(ack_log) if a["kind"] == "call")
    say(f"{fault}: SIGKILL {component} after {acked_at_kill}/{planned} acknowledged calls")
    t_kill = time.monotonic()
    group_exit_s = None
    if component == "runner":
        runner.kill()
    elif fault == "trainer_rank":
        group_exit_s = kill_trainer_rank(stack, 1)
        say(f"{fault}: SIGKILL rank 1; the trainer group exited after {group_exit_s:.1f}s")
    else:
        kill_component(stack, component)
    down_until = time.monotonic() + cfg.down_s.get(fault, cfg.default_down_s)
    while time.monotonic() < down_until:  # cluster faults: the pipeline goes on without the broker
        if (fault in CLUSTER_FAULTS and "first_ack_after_kill_s" not in cluster
                and sum(1 for a in AckLog.read(ack_log) if a["kind"] == "call") > acked_at_kill):
            cluster["first_ack_after_kill_s"] = round(time.monotonic() - t_kill, 1)
            say(f"{fault}: a call acknowledged {cluster['first_ack_after_kill_s']}s after the kill, "
                f"{component} still down")
        time.sleep(0.2)
    if fault in CLUSTER_FAULTS:
        cluster["controller_while_down"] = active_controller(stack)
    if component == "minio":  # stay down until a checkpoint upload met the outage (or 120 s)
        retries0, until = trainer_status(s).get("retries", 0), time.monotonic() + 120
        while trainer_status(s).get("retries", 0) == retries0 and time.monotonic() < until:
            time.sleep(1)
        say(f"{fault}: trainer retried {trainer_status(s).get('retries', 0) - retries0} MinIO operations")
    if component == "runner":
        runner.start()
    else:
        stack.start(component, extra_env=TWO_RANKS if fault == "trainer_rank" else None)
    recovery_s = time.monotonic() - t_kill
    collateral = heal(stack)
    say(f"{fault}: {component} healthy again after {recovery_s:.1f}s"
        + (f"; also restarted: {', '.join(collateral)}" if collateral else ""))

    # let the runner finish, then make up failed attempts so the workload completes
    runner.wait(600)
    makeups = 0
    for _ in range(cfg.makeup_rounds):
        snap = asyncio.run(snapshot(s, set(task_ids), start))
        short = _short_tasks(snap.events, task_ids, cfg.group_size)
        if not short:
            break
        makeups += sum(short.values())
        say(f"{fault}: make-up attempts: {sum(short.values())} over {len(short)} tasks")
        asyncio.run(publish_tasks([{"task_id": t, "payload": json.dumps({"n": task_ids.index(t)}),
                                    "group_size": n, "timeout_s": 300.0} for t, n in short.items()],
                                  s.kafka_bootstrap, topics))
        runner.start()
        runner.wait(600)

    # wait for the stream jobs and the trainer to catch up, then account
    deadline = time.monotonic() + cfg.settle_timeout_s
    while True:
        snap = asyncio.run(snapshot(s, set(task_ids), start))
        acc = ledger.account(calls=snap.calls, events=snap.events, transitions=snap.transitions,
                             samples=snap.samples, dead_letters=snap.dead_letters, rewards=snap.rewards,
                             spans=snap.spans, acked=AckLog.read(ack_log))
        last_sample = max((x["_offset"] for x in snap.samples), default=None)
        status = trainer_status(s)
        trained = status.get("trained_offsets", {}).get(f"{T.SAMPLES.name}:0", 0)
        caught_up = last_sample is None or trained > last_sample
        if acc.ok and not caught_up and status.get("batching") == "barrier" \
                and status.get("train_until", {}).get(f"{T.SAMPLES.name}:0", 0) <= last_sample:
            # a barrier trainer (the test stack's) trains only when asked: every sample so far
            request_training(s, {0: last_sample + 1})
        if (acc.ok and caught_up) or time.monotonic() > deadline:
            break
        collateral += heal(stack)
        time.sleep(3)
    settled_s = time.monotonic() - t_kill
    ms = manifests(s, s.run)
    tp = trainer_problems(s, s.run, ms)
    entry = {
        "fault": fault, "component": component, "run_id": fid,
        "planned_calls": planned, "acknowledged_at_kill": acked_at_kill,
        "expected": acc.calls_acknowledged, "produced": acc.transitions, "missing": acc.missing,
        "duplicated": acc.duplicated + acc.samples_duplicated, "dead_lettered": acc.dead_lettered,
        "recovery_s": round(recovery_s, 1), "settled_s": round(settled_s, 1),
        **({"group_exit_s": round(group_exit_s, 1)} if group_exit_s is not None else {}),
        "also_restarted": collateral, "makeup_attempts": makeups,
        "trainer": {"caught_up": caught_up, "trained_offset": trained, "last_sample_offset": last_sample,
                    "versions": len(ms), "problems": tp},
        "account": acc.to_dict(), "wall_s": round(time.monotonic() - t0, 1),
    }
    if fault in CLUSTER_FAULTS:
        cluster["controller_after"] = active_controller(stack)
        cluster["killed"] = component
        # every bridge took spans (the workload spreads rollouts over them by id)
        cluster["spans_per_bridge"] = dict(sorted(Counter(a.get("bridge", s.bridge_url) for a in AckLog.read(ack_log)
                                                          if a["kind"] == "span").items()))
        entry["cluster"] = cluster
        # spanrl's services went on: none of them was restarted by heal()
        entry["services_restarted"] = [c for c in collateral if not c.startswith("kafka")]
    entry["ok"] = acc.ok and caught_up and not tp and not entry.get("services_restarted")
    if fault == "trainer_rank":  # the next faults meet the usual one-rank trainer
        stack.stop("trainer")
        stack.start("trainer")
    return entry


def _short_tasks(events: list[dict], task_ids: list[str], group_size: int) -> dict[str, int]:
    """task_id -> attempts still needed so each task has ``group_size`` succeeded attempts."""
    ok: dict[str, set[str]] = {t: set() for t in task_ids}
    for e in events:
        if e["status"] == "succeeded" and e["task_id"] in ok:
            ok[e["task_id"]].add(e["rollout_id"])
    return {t: group_size - len(r) for t, r in ok.items() if len(r) < group_size}


# ------------------------------------------------------------------------- the whole run
def run_chaos(cfg: ChaosConfig, say: Callable[[str], None] = print) -> dict:
    """Start the stack with CHAOS_ENV and a fresh run, run every fault, write chaos.json.

    The cluster faults (:data:`CLUSTER_FAULTS`) run last, on a stack restarted with the
    cluster layout (``settings.CLUSTER_LAYOUT``: 3 Kafka brokers, 2 stream workers, 2 bridges)
    and a run of its own (the trainer's checkpoints name offsets of the other cluster's
    topics), unless the stack already has that layout."""
    check_environment()
    update_env(CHAOS_ENV)
    running_run = None if cfg.restart_stack else trainer_status(get_settings()).get("run")
    run = running_run or f"chaos-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    set_env("SPANRL_RUN", run)
    get_settings.cache_clear()
    storage.register_scratch(get_settings().cache_dir, run)  # local copies: deleted by the next make test
    phases = chaos_phases(cfg.faults, is_cluster(get_settings()))
    if not cfg.restart_stack and any(c != is_cluster(get_settings()) for c, _ in phases):
        raise RuntimeError(f"the cluster faults need the cluster layout ({CLUSTER_LAYOUT}): start the stack with "
                           f"`spanrl stack up --cluster`, or let chaos restart the stack")
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    out = cfg.out_dir / "chaos.json"
    result = {"run": run, "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
              "env": CHAOS_ENV, "faults": []}
    try:
        for cluster, faults in phases:
            if cluster != is_cluster(get_settings()):
                Stack(get_settings()).down()
                update_env(Settings.env(**{k: str(v) for k, v in CLUSTER_LAYOUT.items()}))
                set_env("SPANRL_RUN", f"{run}-cluster")
                get_settings.cache_clear()
                storage.register_scratch(get_settings().cache_dir, get_settings().run)
                say(f"restarting the stack as a cluster: {CLUSTER_LAYOUT} (run {get_settings().run})")
            stack = Stack(get_settings())
            if cfg.restart_stack:
                stack.down()
            stack.up(progress=lambda n: say(f"starting {n} …"))
            s = get_settings()
            for fault in faults:
                entry = run_fault(stack, fault, cfg, say)
                entry["layout"] = {"kafka_brokers": s.kafka_brokers, "stream_workers": s.stream_workers,
                                   "bridge_replicas": s.bridge_replicas}
                result["faults"].append(entry)
                out.write_text(json.dumps(result, indent=2))
                say(f"{fault}: {'OK' if entry['ok'] else 'FAILED'}: expected {entry['expected']}, produced "
                    f"{entry['produced']}, dead-lettered {entry['dead_lettered']}, missing {entry['missing']}, "
                    f"duplicated {entry['duplicated']}")
    finally:
        result["ok"] = bool(result["faults"]) and all(f["ok"] for f in result["faults"])
        out.write_text(json.dumps(result, indent=2))
    return result


def is_cluster(s: Settings) -> bool:
    """Whether the stack of ``s`` has the cluster layout (at least ``CLUSTER_LAYOUT``'s brokers,
    stream workers and bridges)."""
    return all(getattr(s, k) >= v for k, v in CLUSTER_LAYOUT.items())


def chaos_phases(faults: tuple[str, ...], cluster: bool) -> list[tuple[bool, tuple[str, ...]]]:
    """``[(cluster layout?, faults), ...]`` in the order they run: every fault on the stack as
    it is, except that a stack without the cluster layout runs the cluster faults after the
    others, restarted as a cluster."""
    if cluster:
        return [(True, tuple(faults))]
    single = tuple(f for f in faults if f not in CLUSTER_FAULTS)
    clustered = tuple(f for f in faults if f in CLUSTER_FAULTS)
    return [p for p in ((False, single), (True, clustered)) if p[1]]
