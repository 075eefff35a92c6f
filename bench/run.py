"""spanrl vs Agent Lightning benchmarks; ``make bench`` runs this.

    python -m bench.run [--rollouts 100] [--runs 3] [--skip-agl] [--skip-trainer] [--skip-checkpoint] [--profile]
    python -m bench.run --mode sustained|rate ...   # bench.sustained (make bench-sustained / bench-rate)

(1) span ingestion -> training data, same OTLP workload to both systems;
(2) reward -> transition latency (spanrl) at a stated offered rate;
(3) bytes per transition on the wire vs Agent Lightning's JSON triplet;
(4) checkpoint write / publish -> serve (bench.checkpoint_reload; vLLM part only with --vllm-url);
(5) trainer tokens/s on CPU (bench.trainer_bench; GPU: bench/gpu_trainer.py).
Needs the local stack's Kafka (and MinIO for 4). Uses private ``bench-<id>-*`` topics, its own
bridge, Faust worker (own app id/port) and Agent Lightning store; removes its topics at the end.
Writes bench/results/latest.json (+ a timestamped copy) and prints a table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from spanrl.core.settings import child_env
from spanrl.infra.stack import stop_process_group as stop
from bench.workload import (Shape, agent_headers, export_ok, exporter, proc_cpu_s, proc_peak_rss_mb, reward_of,
                            rollout_spans)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited {proc.returncode} before {url} answered")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.5)
    raise RuntimeError(f"{url} not up after {timeout}s")


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


# ---- machine / versions --------------------------------------------------------------

def machine_info() -> dict:
    from importlib.metadata import version

    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    mem = next((int(l.split()[1]) // 1024 for l in open("/proc/meminfo") if l.startswith("MemTotal")), 0)
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True,
                                    text=True).stdout.strip())
    except OSError:
        rev, dirty = "?", None
    vers = {}
    for p in ("aiokafka", "faust-streaming", "fastavro", "fastapi", "uvicorn", "opentelemetry-sdk", "torch",
              "deepspeed", "transformers"):
        try:
            vers[p] = version(p)
        except Exception:  # noqa: BLE001
            vers[p] = None
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_mib": mem, "kernel": platform.release(),
            "python": platform.python_version(), "loadavg_at_start": os.getloadavg(),
            "spanrl_git": rev, "spanrl_dirty": dirty, "versions": vers,
            "note": "shared machine: the local stack (Kafka, MinIO, vLLM, services) runs beside the bench"}


# ---- (1)(2)(3) spanrl ---------------------------------------------------------------

class SpanrlSide:
    def __init__(self, args, shape: Shape):
        from spanrl.core.settings import get_settings

        self.a, self.shape = args, shape
        self.bootstrap = get_settings().kafka_bootstrap
        self.id = uuid.uuid4().hex[:8]
        self.prefix = f"bench-{self.id}-"
        self.app_id = f"bench-{self.id}-stream"
        self.names = {k: self.prefix + k for k in
                      ("spans", "rewards", "rollouts", "tasks", "dead-letter", "transitions", "samples",
                       "orphan-spans")}
        self.bridge = self.worker = None
        self.worker_env: dict[str, str] = {}  # more settings of the Faust workers (e.g. bench.soak's bound)
        self.workdir = RESULTS / "tmp" / self.id
        self.seen: dict[str, list[float]] = {}   # rollout_id -> arrival times of its transitions
        self.sizes: dict[str, list[int]] = {}    # rollout_id -> avro sizes
        self.values: dict[str, list[bytes]] = {}

    async def create_topics(self) -> None:
        import dataclasses

        from spanrl.producers.kafka import create_topics
        from spanrl.schemas import topics as T

        base = {"spans": T.SPANS, "rewards": T.REWARDS, "rollouts": T.ROLLOUTS, "tasks": T.TASKS,
                "dead-letter": T.DEAD_LETTER, "transitions": T.TRANSITIONS, "samples": T.SAMPLES,
                "orphan-spans": T.ORPHAN_SPANS}
        await create_topics(self.bootstrap, tuple(dataclasses.replace(t, name=self.names[k])
                                                  for k, t in base.items()))

    async def delete_topics(self) -> None:
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            doomed = [t for t in await admin.list_topics() if t.startswith(self.prefix)]
            if doomed:
                await admin.delete_topics(doomed)
        finally:
            await admin.close()

    async def setup(self) -> None:
        """Topics and processes up; on failure what was started is stopped and the topics removed."""
        try:
            await self.create_topics()
            self.start()
        except BaseException:
            self.stop()
            await self.delete_topics()
            raise

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.bridge_port, self.web_port = free_port(), free_port()
        self.bridge = self.start_bridge(self.bridge_port, "bridge")
        self.worker = self.start_worker(self.web_port, self.workdir, "worker")
        wait_http(f"http://127.0.0.1:{self.bridge_port}/health", 60, self.bridge)
        wait_http(f"http://127.0.0.1:{self.web_port}/spanrl/health/", 120, self.worker)

    def start_bridge(self, port: int, name: str) -> subprocess.Popen:
        """A bridge process on ``port`` writing to this run's topics; log ``<workdir>/<name>.log``."""
        env = child_env({"PYTHONPATH": str(REPO)})
        return subprocess.Popen(
            [sys.executable, "-m", "spanrl.producers.bridge", "--port", str(port), "--grpc-port", "0",
             "--topic-prefix", self.prefix],
            cwd=REPO, env=env, stdout=open(self.workdir / f"{name}.log", "wb"), stderr=subprocess.STDOUT,
            start_new_session=True)

    def start_worker(self, web_port: int, cwd: Path, name: str) -> subprocess.Popen:
        """A Faust worker of this run's app id (one consumer group) with web port ``web_port``;
        ``cwd`` holds its ``<app_id>-data`` (one per worker process); log ``<workdir>/<name>.log``."""
        env = child_env({"PYTHONPATH": str(REPO)})
        wenv = {**env, "SPANRL_STREAM_APP_ID": self.app_id, "SPANRL_FAUST_WEB_PORT": str(web_port),
                "SPANRL_SPANS_TOPIC": self.names["spans"], "SPANRL_REWARDS_TOPIC": self.names["rewards"],
                "SPANRL_ROLLOUTS_TOPIC": self.names["rollouts"],
                "SPANRL_TRANSITIONS_TOPIC": self.names["transitions"],
                "SPANRL_SAMPLES_TOPIC": self.names["samples"], "SPANRL_DEAD_LETTER_TOPIC": self.names["dead-letter"],
                "SPANRL_ORPHAN_SPANS_TOPIC": self.names["orphan-spans"], "SPANRL_SETTLE_S": str(self.a.settle_s),
                **self.worker_env}
        # None: the worker's own defaults (spanrl.stream_jobs.app.StreamConfig)
        for var, value in (("SPANRL_STREAM_TICK_S", self.a.tick_s),
                           ("SPANRL_STREAM_COMMIT_INTERVAL_S", self.a.commit_interval_s)):
            if value is not None:
                wenv[var] = str(value)
        # cwd: Faust writes <app_id>-data into the working directory
        cwd.mkdir(parents=True, exist_ok=True)
        return subprocess.Popen([sys.executable, "-m", "spanrl.stream_jobs.app", "worker", "-l", "warn"],
                                cwd=cwd, env=wenv, stdout=open(self.workdir / f"{name}.log", "wb"),
                                stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        for p in (self.bridge, self.worker):
            if p is not None and p.poll() is not None and p.returncode:
                print(f"{p.args[2]} exited {p.returncode}; logs in {self.workdir}", file=sys.stderr)
        stop(self.bridge)
        stop(self.worker)

    def pids(self) -> dict[str, int]:
        return {"bridge": self.bridge.pid, "worker": self.worker.pid}

    async def read_transitions(self, stop_evt: asyncio.Event, on_batch, clock=time.perf_counter) -> None:
        """Reads the transitions topic (read_committed, from the start) until ``stop_evt``;
        ``on_batch(now, msgs)`` for each partition's batch, ``now`` from ``clock``."""
        from aiokafka import AIOKafkaConsumer

        c = AIOKafkaConsumer(self.names["transitions"], bootstrap_servers=self.bootstrap, group_id=None,
                             auto_offset_reset="earliest", isolation_level="read_committed")
        await c.start()
        try:
            while not stop_evt.is_set():
                batch = await c.getmany(timeout_ms=100)
                now = clock()
                for msgs in batch.values():
                    on_batch(now, msgs)
        finally:
            await c.stop()

    async def consume(self, stop_evt: asyncio.Event) -> None:
        from spanrl.schemas import codec

        def on_batch(now, msgs):
            for m in msgs:
                rid = codec.decode("transition", m.value)["rollout_id"]
                self.seen.setdefault(rid, []).append(now)
                self.sizes.setdefault(rid, []).append(len(m.value))
                self.values.setdefault(rid, []).append(m.value)

        await self.read_transitions(stop_evt, on_batch)

    async def wait_for(self, rids: list[str], timeout: float) -> float:
        n = self.shape.llm_calls
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if all(len(self.seen.get(r, ())) >= n for r in rids):
                return max(self.seen[r][n - 1] for r in rids)
            if self.worker.poll() is not None:
                raise RuntimeError(f"Faust worker died; see {self.workdir}/worker.log")
            await asyncio.sleep(0.02)
        missing = sum(len(self.seen.get(r, ())) < n for r in rids)
        print(f"WARNING: {missing}/{len(rids)} rollouts without all transitions after {timeout}s "
              "(late_span dead letters? raise --settle-s)", file=sys.stderr)
        return time.perf_counter()

    def lifecycle(self, rid: str, task: str, status: str, inputs_acked: bool | None = None) -> tuple[str, bytes, bytes]:
        """A lifecycle event; a terminal one says ``inputs_acked`` ("every span and reward of this
        attempt was acked by Kafka before this event": both modes send it after the export was
        acknowledged) unless ``--no-inputs-acked`` or ``inputs_acked=False``."""
        from spanrl.schemas import codec

        # as the runner: a terminal event is sent after the rollout's spans were acknowledged
        # (--no-inputs-acked: without the flag, the worker's settle_s wait, the rule before issue 11)
        acked = status != "started" and self.a.inputs_acked and inputs_acked is not False
        return (self.names["rollouts"], rid.encode(), codec.encode("rollout", {
            "rollout_id": rid, "attempt_id": "0", "task_id": task, "status": status, "group_size": 4,
            "runner_id": "bench", "timestamp_ms": int(time.time() * 1000), "inputs_acked": acked}))

    async def run(self, profile_dir: Path | None) -> dict:
        from aiokafka import AIOKafkaProducer

        shape, a = self.shape, self.a
        await self.setup()
        stop_evt = asyncio.Event()
        consumer = asyncio.create_task(self.consume(stop_evt))
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=5)
        await producer.start()
        exp = exporter(f"http://127.0.0.1:{self.bridge_port}/v1/traces", agent_headers())
        out: dict = {"params": {"rollouts": a.rollouts, "runs": a.runs, "batch_rollouts": a.batch_rollouts,
                                "settle_s": a.settle_s, "tick_s": a.tick_s, "commit_interval_s": a.commit_interval_s, "topics": self.prefix + "*"},
                     "runs": []}
        try:
            # warm-up: one rollout through the whole pipeline (partition assignment, JIT-free)
            await self._send_rollouts(producer, exp, ["warm-0"], {"warm-0": rollout_spans("warm-0", "0", 1.0, shape, 0)},
                                      )
            await self.wait_for(["warm-0"], 120)
            for r in range(a.runs):
                prof = self._profile(profile_dir, r) if (profile_dir and r == 0) else []
                out["runs"].append(await self._throughput_run(producer, exp, r))
                for p in prof:
                    p.wait()
                print("spanrl run", r, json.dumps(out["runs"][-1]), flush=True)
            out["latency"] = await self._latency(producer, exp)
            out["wire"] = self._wire()
        finally:
            exp.shutdown()
            await producer.stop()
            stop_evt.set()
            await consumer
            out["peak_rss_mib"] = {k: proc_peak_rss_mb(p) for k, p in self.pids().items()}
            self.stop()
            await self.delete_topics()
            if not self.a.keep_logs:
                shutil.rmtree(self.workdir, ignore_errors=True)
        return out

    def _profile(self, profile_dir: Path, r: int) -> list[subprocess.Popen]:
        spy = Path(self.a.py_spy)
        if not spy.exists():
            print(f"no py-spy at {spy}; skipping profile", file=sys.stderr)
            return []
        profile_dir.mkdir(parents=True, exist_ok=True)
        return [subprocess.Popen([str(spy), "record", "-p", str(pid), "-d", str(self.a.profile_s), "-r", "50",
                                  "--format", "raw", "-o", str(profile_dir / f"{name}.folded")],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for name, pid in self.pids().items()]

    async def _send_rollouts(self, producer, exp, rids: list[str], work: dict) -> None:
        spans = [s for rid in rids for s in work[rid]]
        await asyncio.to_thread(export_ok, exp, spans)  # acknowledged by the bridge after Kafka's ack
        for rid in rids:  # then the terminal lifecycle events, as a runner publishes them
            t, k, v = self.lifecycle(rid, rid, "succeeded")
            await producer.send(t, v, key=k)
        await producer.flush()

    async def _throughput_run(self, producer, exp, r: int) -> dict:
        n, shape = self.a.rollouts, self.shape
        rids = [f"b{self.id}-r{r}-{i}" for i in range(n)]
        work = {rid: rollout_spans(rid, "0", reward_of(i), shape, seed=i) for i, rid in enumerate(rids)}
        for rid in rids:  # 'started' events (not timed: the runner claims work before the agent runs)
            t, k, v = self.lifecycle(rid, rid, "started")
            await producer.send(t, v, key=k)
        await producer.flush()
        pids = self.pids()
        cpu0 = {k: proc_cpu_s(p) for k, p in pids.items()}
        dead0 = self.dead_letters()
        t0 = time.perf_counter()
        for b in range(0, n, self.a.batch_rollouts):
            await self._send_rollouts(producer, exp, rids[b:b + self.a.batch_rollouts], work)
        t_in = time.perf_counter()
        t_done = await self.wait_for(rids, 60)
        cpu = {k: proc_cpu_s(p) - cpu0[k] for k, p in pids.items()}
        spans = n * shape.spans_per_rollout
        trans = sum(len(self.seen.get(r_, ())) for r_ in rids)
        return {"spans": spans, "transitions": trans, "ingest_s": t_in - t0, "e2e_s": t_done - t0,
                "spans_per_s": spans / (t_in - t0), "transitions_per_s": trans / (t_done - t0), "expected_transitions": n * shape.llm_calls,
                "cpu_s": cpu, "cpu_s_total": sum(cpu.values()),
                "dead_letters": {k: v - dead0.get(k, 0) for k, v in self.dead_letters().items() if v != dead0.get(k, 0)}}

    def counters(self) -> dict:
        """The worker's /spanrl/counters/ page."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}/spanrl/counters/", timeout=5) as r:
            return json.loads(r.read())

    def dead_letters(self) -> dict[str, int]:
        """The worker's dead letters so far, by reason."""
        return self.counters()["dead_letters_out"]

    async def _latency(self, producer, exp) -> dict:
        n, rate, shape = self.a.latency_rollouts, self.a.latency_rate, self.shape
        rids = [f"b{self.id}-lat-{i}" for i in range(n)]
        work = {rid: rollout_spans(rid, "0", reward_of(i), shape, seed=i) for i, rid in enumerate(rids)}
        for rid in rids:
            t, k, v = self.lifecycle(rid, rid, "started")
            await producer.send(t, v, key=k)
        await producer.flush()
        sent: dict[str, float] = {}
        t_start = time.perf_counter()
        for i, rid in enumerate(rids):
            await asyncio.sleep(max(0.0, t_start + i / rate - time.perf_counter()))
            sent[rid] = time.perf_counter()  # the rollout's spans, final reward last, go now
            await asyncio.to_thread(export_ok, exp, work[rid])
            t, k, v = self.lifecycle(rid, rid, "succeeded")  # then its terminal event, as a runner does
            await producer.send_and_wait(t, v, key=k)
        await self.wait_for(rids, 120)
        lat = [self.seen[r][shape.llm_calls - 1] - sent[r] for r in rids
               if len(self.seen.get(r, ())) >= shape.llm_calls]
        return {"offered_rollouts_per_s": rate, "offered_spans_per_s": rate * shape.spans_per_rollout,
                "rollouts": n, "complete": len(lat), "p50_s": med(lat), "p99_s": pct(lat, 0.99), "max_s": max(lat),
                "latencies_s": sorted(round(x, 4) for x in lat), "worker_emitted_by": self.counters().get("emitted_by"),
                "settle_s": self.a.settle_s, "tick_s": self.a.tick_s, "commit_interval_s": self.a.commit_interval_s,
                "inputs_acked": self.a.inputs_acked,
                "measured_from": "client starts the OTLP export holding the final reward span (the terminal "
                                 "lifecycle event follows once the export was acknowledged)",
                "measured_to": "last transition of the rollout read (read_committed) from the transitions topic"}

    def _wire(self) -> dict:
        import zstandard

        cctx = zstandard.ZstdCompressor(level=3)
        per_rollout = [v for r, v in self.values.items() if r.startswith(f"b{self.id}-r")]
        avro = [len(x) for vs in per_rollout for x in vs]
        single = [len(cctx.compress(x)) for vs in per_rollout[:50] for x in vs]
        batch = [len(cctx.compress(b"".join(vs))) / len(vs) for vs in per_rollout[:50]]
        return {"avro_bytes_mean": med(avro), "avro_zstd_single_record_mean": med(single),
                "avro_zstd_per_rollout_batch_mean": med(batch),
                "compression": "zstd (producer compression_type and topic compression.type), level 3 here"}


# ---- (1)(3) Agent Lightning ---------------------------------------------------------

def agl_venv(a) -> Path:
    """Agent Lightning's own venv under the data root, created once (stamp file)."""
    from spanrl.core.settings import get_settings

    root = get_settings().cache_dir / "bench"
    venv = root / "agl-venv"
    stamp = venv / f".spanrl-agentlightning-{a.agl_version}"
    if not stamp.exists():
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"agentlightning=={a.agl_version}"], check=True)
        stamp.write_text(time.strftime("%F %T"))
    return venv


def start_agl_store(a, tmp: Path) -> tuple[Path, dict, int, subprocess.Popen]:
    """``agl store --backend memory`` on a free port (log in ``tmp``): (venv, env, port, process);
    the caller waits for ``/v1/agl/health`` and stops it."""
    venv = agl_venv(a)
    port = free_port()
    env = child_env({"LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONPATH": str(REPO)})
    tmp.mkdir(parents=True, exist_ok=True)
    store = subprocess.Popen([str(venv / "bin" / "agl"), "store", "--backend", "memory", "--host", "127.0.0.1",
                              "--port", str(port), "--log-level", "WARNING"],
                             env=env, stdout=open(tmp / "agl-store.log", "wb"), stderr=subprocess.STDOUT,
                             start_new_session=True)
    return venv, env, port, store


def run_agl(a, shape: Shape, tmp: Path) -> dict:
    venv, env, port, store = start_agl_store(a, tmp)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/agl/health", 120, store)
        # one warm-up run of 2 rollouts, then the measured runs (store CPU measured per run below)
        out_f = tmp / "agl.json"
        cmd = [str(venv / "bin" / "python"), "-m", "bench.agl_side", "--store", f"http://127.0.0.1:{port}",
               "--llm-calls", str(shape.llm_calls), "--tools", str(shape.tools),
               "--prompt-tokens", str(shape.prompt_tokens), "--completion-tokens", str(shape.completion_tokens),
               "--batch-rollouts", str(a.batch_rollouts)]
        subprocess.run(cmd + ["--rollouts", "2", "--runs", "1", "--out", str(out_f)], env=env, cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL)
        runs = []
        for r in range(a.runs):  # one process per run, so the store's CPU is attributed per run
            c0 = proc_cpu_s(store.pid)
            subprocess.run(cmd + ["--rollouts", str(a.rollouts), "--runs", "1", "--out", str(out_f)], env=env,
                           cwd=REPO, check=True, stdout=subprocess.DEVNULL)
            res = json.loads(out_f.read_text())
            run = res["runs"][0]
            run["cpu_s"] = {"store": proc_cpu_s(store.pid) - c0, "adapter": run.pop("adapter_cpu_s")}
            run["cpu_s_total"] = sum(run["cpu_s"].values())
            runs.append(run)
            print("agl run", r, json.dumps({k: v for k, v in run.items() if k != "sample_triplet_json"}), flush=True)
        return {"agentlightning": res["agentlightning"], "runs": runs,
                "peak_rss_mib": {"store": proc_peak_rss_mb(store.pid)},
                "note": "store = `agl store --backend memory`; adapter = query_spans + TracerTraceToTriplet.adapt "
                        "in the client process (its CPU excludes the OTLP exporter's thread); the adapter process's "
                        "RSS is not isolated (it also holds the prebuilt workload)"}
    finally:
        stop(store)


# ---- summary ------------------------------------------------------------------------

def summarize(res: dict) -> list[tuple]:
    s, g = res.get("spanrl"), res.get("agl")
    rows = []

    def m(side, key):
        return med([r[key] for r in side["runs"]]) if side else float("nan")

    for label, key in (("spans/s in", "spans_per_s"), ("transitions/s out (end to end)", "transitions_per_s"),
                       ("CPU s per run (services)", "cpu_s_total")):
        a_, b_ = m(s, key), m(g, key)
        rows.append((label, a_, b_, a_ / b_ if b_ == b_ and b_ else float("nan")))
    if s and g:
        ra, rb = sum(s["peak_rss_mib"].values()), sum(g["peak_rss_mib"].values())
        rows.append(("peak RSS MiB (services)", ra, rb, ra / rb))
        w = s["wire"]
        tj = med([r["triplet_json_bytes_mean"] for r in g["runs"]])
        rows.append(("bytes/transition (spanrl Avro+zstd batch vs AGL JSON)", w["avro_zstd_per_rollout_batch_mean"],
                     tj, w["avro_zstd_per_rollout_batch_mean"] / tj))
    return rows


def print_table(res: dict) -> str:
    lines = [f"{'metric':58s} {'spanrl':>12s} {'AGL 0.3':>12s} {'ratio':>8s}"]
    for label, a, b, r in summarize(res):
        lines.append(f"{label:58s} {a:12.1f} {b:12.1f} {r:8.2f}")
    lat = res.get("spanrl", {}).get("latency")
    if lat:
        lines.append(f"reward->transition latency p50 {lat['p50_s']*1000:.0f} ms, p99 {lat['p99_s']*1000:.0f} ms "
                     f"at {lat['offered_spans_per_s']:.0f} spans/s offered (settle {lat['settle_s']} s, "
                     f"tick {lat['tick_s']} s)")
    for k in ("trainer_cpu", "checkpoint"):
        if res.get(k):
            lines.append(f"{k}: {json.dumps(res[k].get('summary', res[k]))}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("burst", "sustained", "rate"), default="burst",
                   help="burst: the tables (1)-(5) below; sustained / rate / scale-out: bench.sustained")
    p.add_argument("--rollouts", type=int, default=None, help="burst: 100 per run; sustained: 10000")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--batch-rollouts", type=int, default=64, help="rollouts per OTLP export (64 x 8 = 512 spans, "
                   "the BatchSpanProcessor's default batch)")
    p.add_argument("--settle-s", type=float, default=2.0, help="SPANRL_SETTLE_S (default as in production)")
    p.add_argument("--tick-s", type=float, default=None, help="SPANRL_STREAM_TICK_S (default: the worker's, 0.5)")
    p.add_argument("--commit-interval-s", type=float, default=None,
                   help="SPANRL_STREAM_COMMIT_INTERVAL_S (default: the worker's, 0.5; Faust's own default is 2.8)")

    p.add_argument("--no-inputs-acked", dest="inputs_acked", action="store_false",
                   help="terminal events without inputs_acked: the worker's settle_s wait (the rule before issue 11)")
    p.add_argument("--latency-rollouts", type=int, default=40)
    p.add_argument("--latency-rate", type=float, default=4.0, help="rollouts/s offered in the latency phase")
    p.add_argument("--agl-version", default="0.3.0")
    p.add_argument("--skip-agl", action="store_true")
    p.add_argument("--skip-spanrl", action="store_true")
    p.add_argument("--skip-trainer", action="store_true")
    p.add_argument("--skip-checkpoint", action="store_true")
    p.add_argument("--profile", action="store_true", help="py-spy the bridge and worker during the first run")
    p.add_argument("--profile-s", type=int, default=8)
    p.add_argument("--py-spy", default=str(Path.home() / ".cache/spanrl/bench/tools-venv/bin/py-spy"))
    p.add_argument("--out", default=str(RESULTS / "latest.json"))
    p.add_argument("--keep-logs", action="store_true", help="keep the bridge and worker logs (bench/results/tmp/<id>)")
    from bench import sustained

    sustained.add_args(p)
    a = p.parse_args(argv)
    if a.rollouts is None:
        a.rollouts = 10000 if a.mode == "sustained" else 100
    if a.mode != "burst":
        sustained.run(a)
        return
    shape = Shape()
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    res: dict = {"machine": machine_info(), "started": stamp,
                 "workload": {"shape": shape.__dict__, "spans_per_rollout": shape.spans_per_rollout,
                              "rewards": "final reward R in {0,1}, one reward span per rollout"}}
    if not a.skip_spanrl:
        res["spanrl"] = asyncio.run(SpanrlSide(a, shape).run(RESULTS / f"profile-{stamp}" if a.profile else None))
    if not a.skip_agl:
        res["agl"] = run_agl(a, shape, RESULTS / "tmp" / f"agl-{stamp}")
    if not a.skip_trainer:
        from bench import trainer_bench

        res["trainer_cpu"] = trainer_bench.run_subprocess()
    if not a.skip_checkpoint:
        from bench import checkpoint_reload

        res["checkpoint"] = checkpoint_reload.run_subprocess()
    res["summary"] = [dict(zip(("metric", "spanrl", "agl", "ratio"), r)) for r in summarize(res)]
    res["machine"]["loadavg_at_end"] = os.getloadavg()
    out = Path(a.out)
    out.write_text(json.dumps(res, indent=1, default=str))
    (RESULTS / f"run-{stamp}.json").write_text(json.dumps(res, indent=1, default=str))
    print(print_table(res))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
