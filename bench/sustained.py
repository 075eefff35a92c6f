"""Sustained, fixed-rate and scale-out benchmarks: spanrl vs Agent Lightning 0.3.0, one invocation.

    python -m bench.run --mode sustained --rollouts 10000 [--workers 2 --bridges 2]
    python -m bench.run --mode rate --spans-per-s 1000 --duration-s 300

- ``sustained``: ``--rollouts`` rollouts (8 spans each, the burst's mix) offered as fast as each
  system accepts them: ``--exporters`` feeders (default one per bridge) send OTLP exports of
  ``--batch-rollouts`` rollouts back to back, each waiting for its acknowledgement (as a
  BatchSpanProcessor would).
- ``rate``: ``--spans-per-s`` offered for ``--duration-s``; export batch k is due at
  ``t0 + k * batch_spans / rate`` (bench.metrics.pace_schedule), sent by one of ``--exporters``
  (default 4) feeders, so one slow export does not hold the schedule back; ``rate_behind_max_s``
  says how late the latest batch started; latency reported per rollout.
- ``--workers W --bridges B`` (W or B > 1): spanrl runs twice in the same invocation, with 1 + 1
  and with W Faust workers (one consumer group: the same app id) + B bridge processes; rollouts
  are split between the bridges batch by batch (round robin, as a load balancer would).

Workload: a pool of ``--pool-rollouts`` prebuilt rollouts (bench.workload.RolloutPool) re-stamped
with fresh rollout/attempt/trace/span ids per rollout, so memory does not grow with the run.
spanrl per rollout: ``started`` lifecycle event, OTLP export of the spans (acked by the bridge
after Kafka acked them), then the terminal ``succeeded`` event with ``inputs_acked=True``.
Agent Lightning: ``start_rollout``, OTLP export to the store, ``update_attempt(succeeded)``, and,
overlapping, ``query_spans`` + ``TracerTraceToTriplet.adapt`` (bench.agl_side --sustained).

Measured: psutil samples (every ``--sample-s``) of CPU time and RSS of every process (spanrl:
bridges, workers, the Kafka broker of the stack, this client; AGL: store, client), spanrl's
consumer lag (end offsets of the spans/rewards/rollouts topics vs the worker group's committed
offsets) and AGL's (rollouts marked succeeded, not yet adapted), cumulative spans acked /
transitions out. Steady state = the inner 80 % of each series (bench.metrics.steady_rate).
Writes ``bench/results/<mode>-<time>.json`` + ``.png`` (+ ``.log``) and ``latest-<mode>.json``.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from bench import metrics as M
from bench.run import RESULTS, REPO, SpanrlSide, free_port, machine_info, start_agl_store, stop, wait_http
from bench.workload import RolloutPool, Shape, agent_headers, export_ok, exporter


# ---- logging: rich progress on a TTY, plain lines in the log file (and stdout when not a TTY) ---

class Log:
    def __init__(self, path: Path):
        from rich.console import Console

        self.path = path
        self.file = open(path, "a", buffering=1)
        self.console = Console(stderr=True)
        self.tty = self.console.is_terminal

        self.bar = None
        self.tasks: dict[str, int] = {}

    def progress(self, key: str, done: int, total: int) -> None:
        """A rich progress bar per ``key`` on a TTY (the log file gets the periodic lines)."""
        if not self.tty:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        if self.bar is None:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=self.console)
            self.bar.start()
        if key not in self.tasks:
            self.tasks[key] = self.bar.add_task(key, total=total)
        self.bar.update(self.tasks[key], completed=done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        self.file.close()

    def __call__(self, msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        self.file.write(line + "\n")
        if self.tty:
            self.console.log(msg)
        else:
            print(line, flush=True)


# ---- process sampler ---------------------------------------------------------------

class Sampler(threading.Thread):
    """Samples CPU seconds (user + system) and RSS (MiB) of named processes every ``every_s``."""

    def __init__(self, every_s: float = 1.0):
        super().__init__(daemon=True)
        self.every_s, self.procs, self.samples = every_s, {}, []   # samples: (t, {name: (cpu_s, rss_mib)})
        self._halt = threading.Event()

    def add(self, name: str, pid: int) -> None:
        import psutil

        self.procs[name] = psutil.Process(pid)

    def sample(self) -> dict:
        row = {}
        for name, p in list(self.procs.items()):
            try:
                with p.oneshot():
                    c = p.cpu_times()
                    row[name] = (c.user + c.system, p.memory_info().rss / 2**20)
            except Exception:  # noqa: BLE001 - process gone: its last sample stands
                pass
        return row

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append((time.monotonic(), self.sample()))
            self._halt.wait(self.every_s)

    def finish(self) -> None:
        self._halt.set()
        self.join()
        self.samples.append((time.monotonic(), self.sample()))

    def summary(self, t0: float, t1: float, spans: int) -> dict:
        """Per process: CPU s in [t0, t1], µs per span, cores (CPU s / wall s), peak RSS of the
        samples and final RSS (the last sample by ``t1``, the end of the run)."""
        out = {}
        for name in self.procs:
            pts = [(t, r[name]) for t, r in self.samples if name in r and r[name][1] > 0]  # rss 0: a zombie
            if not pts:
                continue
            final = [p for p in pts if p[0] <= t1 + self.every_s] or pts
            cpu = [(t, v[0]) for t, v in pts]
            c = M.value_at(cpu, t1) - M.value_at(cpu, t0)
            out[name] = {"cpu_s": c, "cpu_us_per_span": M.cpu_us_per_span(c, spans),
                         "cores": c / (t1 - t0) if t1 > t0 else float("nan"),
                         "rss_peak_mib": max(v[1] for _, v in pts), "rss_final_mib": final[-1][1][1]}
        return out

    def series(self, t0: float) -> dict:
        return {name: [(round(t - t0, 2), round(r[name][0], 3), round(r[name][1], 1))
                       for t, r in self.samples if name in r] for name in self.procs}


#: rollouts sent through the whole pipeline before a run's clock starts (their ids start with "w")
WARMUP_ROLLOUTS = 16


def stack_pid(service: str) -> int | None:
    """A running service of the stack (``<state_dir>/pids/<service>.pid``, written by
    infra/stack.py), or None."""
    from spanrl.core.settings import get_settings

    try:
        pid = int((get_settings().state_dir / "pids" / f"{service}.pid").read_text())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def kafka_broker_pid() -> int | None:
    """The stack's Kafka broker."""
    return stack_pid("kafka")


# ---- spanrl --------------------------------------------------------------------------

class SpanrlSustained(SpanrlSide):
    """The sustained run of spanrl with ``workers`` Faust workers and ``bridges`` bridges."""

    def __init__(self, a, shape: Shape, pool: RolloutPool, workers: int, bridges: int, log: Log):
        super().__init__(a, shape)
        self.pool, self.n_workers, self.n_bridges, self.log = pool, workers, bridges, log
        self.bridges: list[subprocess.Popen] = []
        self.workers: list[subprocess.Popen] = []
        self.bridge_ports: list[int] = []
        self.web_ports: list[int] = []
        self.out_series: list[tuple[float, int]] = []
        self.n_out = 0
        self.complete: set[str] = set()   # rollouts with all their transitions read

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for i in range(self.n_bridges):
            self.bridge_ports.append(free_port())
            self.bridges.append(self.start_bridge(self.bridge_ports[-1], f"bridge{i}"))
        for i in range(self.n_workers):
            self.web_ports.append(free_port())
            self.workers.append(self.start_worker(self.web_ports[-1], self.workdir / f"w{i}", f"worker{i}"))
        for p, port in zip(self.bridges, self.bridge_ports):
            wait_http(f"http://127.0.0.1:{port}/health", 60, p)
        for p, port in zip(self.workers, self.web_ports):
            wait_http(f"http://127.0.0.1:{port}/spanrl/health/", 180, p)
        self.bridge, self.worker, self.web_port = self.bridges[0], self.workers[0], self.web_ports[0]

    def stop(self) -> None:
        for p in self.bridges + self.workers:
            if p.poll() is not None and p.returncode:
                self.log(f"{' '.join(map(str, p.args[:3]))} exited {p.returncode}; logs in {self.workdir}")
            stop(p)

    def pids(self) -> dict[str, int]:
        return {**{f"bridge{i}": p.pid for i, p in enumerate(self.bridges)},
                **{f"worker{i}": p.pid for i, p in enumerate(self.workers)}}

    def summed(self, page: str, field: str) -> dict[str, int]:
        """``field`` (a dict of counts) of every worker's web ``page``, summed per key; a worker
        that does not answer, or has no such field, adds nothing."""
        total: dict[str, int] = {}
        for port in self.web_ports:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{page}", timeout=5) as r:
                    for k, v in json.loads(r.read()).get(field, {}).items():
                        total[k] = total.get(k, 0) + v
            except OSError:
                pass
        return total

    def dead_letters(self) -> dict[str, int]:
        """Dead letters by reason, all workers (``/spanrl/counters/``)."""
        return self.summed("/spanrl/counters/", "dead_letters_out")

    def changelog_writes(self) -> dict[str, int]:
        """The workers' table writes and the changelog records they became (``/spanrl/held/``'s
        ``changelog_writes``, summed; empty from a worker without them)."""
        return self.summed("/spanrl/held/", "changelog_writes")

    async def consume(self, stop_evt: asyncio.Event) -> None:
        def on_batch(now, msgs):
            for m in msgs:  # key = task_id = rollout id in this bench
                rid = m.key.decode()
                seen = self.seen.setdefault(rid, [])
                seen.append(now)
                if len(seen) == self.shape.llm_calls:
                    self.complete.add(rid)
            self.n_out += len(msgs)
            self.out_series.append((now, self.n_out))

        await self.read_transitions(stop_evt, on_batch, clock=time.monotonic)

    async def wait_for(self, rids: list[str], timeout: float) -> float:
        """Until every rollout of ``rids`` has all its transitions (or ``timeout`` s without a new
        one): the time the last one was read (time.monotonic)."""
        want, n = set(rids), self.shape.llm_calls
        last_n, last_t = -1, time.monotonic()
        while True:
            got = len(want & self.complete)
            if got == len(want):
                return max(self.seen[r][n - 1] for r in rids)
            if self.n_out != last_n:
                last_n, last_t = self.n_out, time.monotonic()
            elif time.monotonic() - last_t > timeout:
                self.log(f"WARNING: {len(want) - got}/{len(want)} rollouts without all transitions, none new "
                         f"for {timeout} s (dead letters? see {self.workdir})")
                return last_t
            for p in self.workers:
                if p.poll() is not None:
                    raise RuntimeError(f"Faust worker died; see {self.workdir}")
            await asyncio.sleep(0.2)

    async def poll_lag(self, stop_evt: asyncio.Event, every_s: float, series: list) -> None:
        from aiokafka import AIOKafkaConsumer
        from aiokafka.admin import AIOKafkaAdminClient
        from aiokafka.structs import TopicPartition

        from spanrl.schemas import topics as T

        topics = [self.names[k] for k in ("spans", "rewards", "rollouts")]
        c = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None)
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await c.start()
        await admin.start()
        try:
            tps = [TopicPartition(self.names[k], p) for k, base in (("spans", T.SPANS), ("rewards", T.REWARDS),
                                                                     ("rollouts", T.ROLLOUTS))
                   for p in range(base.partitions)]
            while not stop_evt.is_set():
                try:
                    end = await c.end_offsets(tps)
                    committed = {tp: (om.offset if om is not None else None) for tp, om in
                                 (await admin.list_consumer_group_offsets(self.app_id)).items()}
                    by_topic = {t: M.consumer_lag({tp: o for tp, o in end.items() if tp.topic == t}, committed)
                                for t in topics}
                    series.append((time.monotonic(), by_topic))
                except Exception as exc:  # noqa: BLE001 - a sample lost, not the run
                    self.log(f"lag sample failed: {exc!r}")
                try:
                    await asyncio.wait_for(stop_evt.wait(), every_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            await c.stop()
            await admin.close()

    async def run(self, mode: str, n: int, sampler: Sampler) -> dict:
        from aiokafka import AIOKafkaProducer

        a, shape = self.a, self.shape
        label = f"spanrl {self.n_workers}w/{self.n_bridges}b"
        await self.setup()
        for name, pid in self.pids().items():
            sampler.add(name, pid)
        stop_evt = asyncio.Event()
        consumer = asyncio.create_task(self.consume(stop_evt))
        lag_series: list = []
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=5)
        await producer.start()
        # feeder j (one exporter each) sends batches k = j mod F to bridge j mod B
        n_feed = exporters_for(a, self.n_bridges)
        exps = [exporter(f"http://127.0.0.1:{self.bridge_ports[j % self.n_bridges]}/v1/traces", agent_headers())
                for j in range(n_feed)]
        out: dict = {"workers": self.n_workers, "bridges": self.n_bridges, "topics": self.prefix + "*"}
        try:
            # warm-up: WARMUP_ROLLOUTS rollouts (every partition) through each bridge and the whole pipeline
            warm = [f"w{self.id}-{i}" for i in range(WARMUP_ROLLOUTS)]
            for j in range(self.n_bridges):
                await self._send_batch(producer, exps[j], warm[j::self.n_bridges], 0)
            await self.wait_for(warm, 180)
            lagger = asyncio.create_task(self.poll_lag(stop_evt, a.sample_s, lag_series))
            dead0, writes0 = self.dead_letters(), self.changelog_writes()
            rids = [f"s{self.id}-{i}" for i in range(n)]
            batches = [rids[b:b + a.batch_rollouts] for b in range(0, n, a.batch_rollouts)]
            in_series: list[tuple[float, int]] = []
            sent_at: dict[str, float] = {}
            acked_at: dict[str, float] = {}
            behind = [0.0]
            t0 = time.monotonic()
            in_series.append((t0, 0))
            out_base = self.n_out
            spans_batch = a.batch_rollouts * shape.spans_per_rollout

            async def feeder(j: int) -> None:
                for k in range(j, len(batches), len(exps)):
                    if mode == "rate":
                        due = M.pace_schedule(k, t0, spans_batch, a.spans_per_s)
                        late = time.monotonic() - due
                        behind[0] = max(behind[0], late)
                        if late < 0:
                            await asyncio.sleep(-late)
                    ts = time.monotonic()
                    for rid in batches[k]:
                        sent_at[rid] = ts
                    await self._send_batch(producer, exps[j], batches[k], (k * a.batch_rollouts))
                    ta = time.monotonic()
                    for rid in batches[k]:
                        acked_at[rid] = ta
                    in_series.append((ta, in_series[-1][1] + len(batches[k]) * shape.spans_per_rollout))

            async def progress() -> None:
                i = 0
                while True:
                    await asyncio.sleep(1)
                    i += 1
                    self.log.progress(f"{label} spans in", in_series[-1][1], n * shape.spans_per_rollout)
                    self.log.progress(f"{label} transitions out", self.n_out - out_base, n * shape.llm_calls)
                    if i % 5:
                        continue
                    lag = sum(lag_series[-1][1].values()) if lag_series else None
                    self.log(f"{label}: spans in {in_series[-1][1]}/{n * shape.spans_per_rollout}, "
                             f"transitions {self.n_out - out_base}/{n * shape.llm_calls}, lag {lag}")

            prog = asyncio.create_task(progress())
            try:
                await asyncio.gather(*(feeder(j) for j in range(len(exps))))
                t_in = time.monotonic()
                t_done = await self.wait_for(rids, a.drain_timeout_s)
            finally:
                prog.cancel()
                self.log.progress(f"{label} spans in", in_series[-1][1], n * shape.spans_per_rollout)
                self.log.progress(f"{label} transitions out", self.n_out - out_base, n * shape.llm_calls)
            spans = n * shape.spans_per_rollout
            trans = sum(len(self.seen.get(r, ())) for r in rids)
            outs = [(t, v - out_base) for t, v in self.out_series if v > out_base]
            lat = [self.seen[r][shape.llm_calls - 1] - sent_at[r] for r in rids
                   if len(self.seen.get(r, ())) >= shape.llm_calls]
            lat_term = [self.seen[r][shape.llm_calls - 1] - acked_at[r] for r in rids
                        if len(self.seen.get(r, ())) >= shape.llm_calls]
            out.update({
                "rollouts": n, "spans": spans, "transitions": trans, "expected_transitions": n * shape.llm_calls,
                "ingest_s": t_in - t0, "e2e_s": t_done - t0,
                "spans_per_s_mean": spans / (t_in - t0), "transitions_per_s_mean": trans / (t_done - t0),
                "spans_per_s_steady": M.steady_rate(in_series)["rate_per_s"],
                "transitions_per_s_steady": M.steady_rate(outs)["rate_per_s"] if outs else float("nan"),
                "rate_behind_max_s": behind[0] if mode == "rate" else None,
                "latency": {"p50_s": M.percentile(lat, 0.5), "p99_s": M.percentile(lat, 0.99),
                            "max_s": max(lat) if lat else float("nan"), "complete": len(lat),
                            "from_terminal_ack_p50_s": M.percentile(lat_term, 0.5),
                            "from_terminal_ack_p99_s": M.percentile(lat_term, 0.99),
                            "measured_from": "start of the OTLP export holding the rollout's spans (reward span "
                                             "last); from_terminal_ack: the terminal event's ack, after the spans",
                            "measured_to": "the rollout's last transition read (read_committed) from transitions"},
                "processes": sampler.summary(t0, t_done, spans),
                "dead_letters": {k: v - dead0.get(k, 0) for k, v in self.dead_letters().items()
                                 if v != dead0.get(k, 0)},
                # table writes and changelog records per rollout of the timed part (faust_patches patch 5)
                "changelog_per_rollout": {k: round((v - writes0.get(k, 0)) / n, 2)
                                          for k, v in self.changelog_writes().items()},
                "series": {"t0": t0, "spans_in": [(round(t - t0, 3), v) for t, v in in_series],
                           "transitions_out": [(round(t - t0, 3), v) for t, v in outs],
                           "lag": [(round(t - t0, 2), d) for t, d in lag_series]},
                "lag_max": max((sum(d.values()) for _, d in lag_series), default=None),
            })
            out["series"]["processes"] = sampler.series(t0)
        finally:
            stop_evt.set()
            for exp in exps:
                exp.shutdown()
            await producer.stop()
            await consumer
            if "lagger" in locals():
                await lagger
            self.stop()
            await self.delete_topics()
            if not self.a.keep_logs:
                shutil.rmtree(self.workdir, ignore_errors=True)
        return out

    async def _send_batch(self, producer, exp, rids: list[str], first: int) -> None:
        """started events, the spans' OTLP export (returns once the bridge acked them), then the
        terminal events with ``inputs_acked=True``, each awaited until Kafka acked it."""
        for rid in rids:
            t, k, v = self.lifecycle(rid, rid, "started")
            await producer.send(t, v, key=k)
        spans = [s for i, rid in enumerate(rids) for s in self.pool.spans(first + i, rid, "0")]
        await asyncio.to_thread(export_ok, exp, spans)
        futs = []
        for rid in rids:
            t, k, v = self.lifecycle(rid, rid, "succeeded", inputs_acked=True)
            futs.append(await producer.send(t, v, key=k))
        await asyncio.gather(*futs)


# ---- Agent Lightning ------------------------------------------------------------------

def exporters_for(a, bridges: int) -> int:
    """Concurrent feeders (each one OTLP exporter, one export in flight): ``--exporters`` if given,
    else one per bridge (sustained) or 4 (rate: a late export does not hold the schedule back),
    rounded up to a multiple of ``bridges`` so each bridge gets the same share."""
    n = a.exporters or (bridges if a.mode == "sustained" else 4)
    return -(-n // bridges) * bridges


def run_agl_sustained(a, shape: Shape, mode: str, n: int, tmp: Path, sampler: Sampler, log: Log) -> dict:
    venv, env, port, store = start_agl_store(a, tmp)
    out_f = tmp / "agl-sustained.json"
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/agl/health", 120, store)
        cmd = [str(venv / "bin" / "python"), "-m", "bench.agl_side", "--sustained", "--store", f"http://127.0.0.1:{port}",
               "--rollouts", str(n), "--batch-rollouts", str(a.batch_rollouts), "--pool-rollouts",
               str(a.pool_rollouts), "--exporters", str(exporters_for(a, 1)), "--out", str(out_f)]
        if mode == "rate":
            cmd += ["--spans-per-s", str(a.spans_per_s)]
        sampler.add("agl_store", store.pid)
        client = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True)
        sampler.add("agl_client", client.pid)
        t_last = 0.0
        for line in client.stdout:
            if not line.startswith("{"):
                continue
            p = json.loads(line)
            log.progress("agl spans in", p["spans_acked"], n * shape.spans_per_rollout)
            log.progress("agl triplets out", p["triplets"], n * shape.llm_calls)
            if time.monotonic() - t_last > 5:
                log(f"agl: spans in {p['spans_acked']}/{n * shape.spans_per_rollout}, triplets "
                    f"{p['triplets']}/{n * shape.llm_calls}, lag (succeeded, not adapted) {p['finished'] - p['adapted']}")
                t_last = time.monotonic()
        if client.wait() != 0:
            raise RuntimeError(f"bench.agl_side --sustained exited {client.returncode}")
        res = json.loads(out_f.read_text())
        t0, t_end = res["t0"], res["t_end"]
        procs = sampler.summary(t0, t_end, res["spans"])
        # the client's CPU without its exporter threads (the agent side) = the adapter/runner side
        if "agl_client" in procs:
            c = procs["agl_client"]
            procs["agl_adapter"] = {**c, "cpu_s": c["cpu_s"] - res["export_cpu_s"],
                                    "cpu_us_per_span": M.cpu_us_per_span(c["cpu_s"] - res["export_cpu_s"], res["spans"]),
                                    "note": "agl_client CPU minus its OTLP exporter thread; RSS = the client's"}
        res["processes"] = procs
        res["spans_per_s_steady"] = M.steady_rate([tuple(x) for x in res["series"]["spans_in"]])["rate_per_s"]
        res["transitions_per_s_steady"] = M.steady_rate([tuple(x) for x in res["series"]["transitions_out"]
                                                         if x[1] > 0])["rate_per_s"]
        res["series"]["processes"] = sampler.series(t0)
        for k in ("spans_in", "transitions_out", "lag"):
            res["series"][k] = [(round(x[0] - t0, 3), x[1]) for x in res["series"][k]]
        res["lag_max"] = max((x[1] for x in res["series"]["lag"]), default=None)
        return res
    finally:
        stop(store)


# ---- summary, plot --------------------------------------------------------------------

SERVICES_SPANRL = ("bridge", "worker", "kafka")
SERVICES_AGL = ("agl_store", "agl_adapter")


def service_cpu_us(side: dict, prefixes: tuple[str, ...]) -> float:
    """Sum of the services' CPU µs per span (spanrl: bridges, workers[, broker]; AGL: store +
    adapter side of its client)."""
    return sum(v["cpu_us_per_span"] for k, v in side["processes"].items() if k.startswith(prefixes))


def service_rss(side: dict, prefixes: tuple[str, ...], key: str) -> float:
    """Sum of the services' RSS (``rss_peak_mib`` or ``rss_final_mib``); AGL's adapter row is the
    client process (its RSS also holds the exporter), so it is not added."""
    return sum(v[key] for k, v in side["processes"].items() if k.startswith(prefixes) and k != "agl_adapter")


def summarize(res: dict) -> list[tuple]:
    rows = []
    s, g = res.get("spanrl", [None])[0], res.get("agl")
    no_broker = ("bridge", "worker")
    for label, f, fg in (
            ("spans/s in (steady)", lambda x: x["spans_per_s_steady"], None),
            ("transitions/s out (steady)", lambda x: x["transitions_per_s_steady"], None),
            ("transitions/s out (whole run)", lambda x: x["transitions_per_s_mean"], None),
            ("service CPU µs/span incl. broker", lambda x: service_cpu_us(x, SERVICES_SPANRL),
             lambda x: service_cpu_us(x, SERVICES_AGL)),
            ("service CPU µs/span excl. broker", lambda x: service_cpu_us(x, no_broker),
             lambda x: service_cpu_us(x, SERVICES_AGL)),
            ("peak RSS MiB excl. broker (sum)", lambda x: service_rss(x, no_broker, "rss_peak_mib"),
             lambda x: service_rss(x, SERVICES_AGL, "rss_peak_mib")),
            ("final RSS MiB excl. broker (sum)", lambda x: service_rss(x, no_broker, "rss_final_mib"),
             lambda x: service_rss(x, SERVICES_AGL, "rss_final_mib")),
            ("latency p50 s", lambda x: x["latency"]["p50_s"], None),
            ("latency p99 s", lambda x: x["latency"]["p99_s"], None)):
        va = f(s) if s else float("nan")
        vb = (fg or f)(g) if g else float("nan")
        rows.append((label, va, vb, va / vb if vb == vb and vb else float("nan")))
    return rows


def scale_rows(res: dict) -> list[tuple]:
    sides = res.get("spanrl", [])
    if len(sides) < 2:
        return []
    one, many = sides[0], sides[1]
    rows = []
    for label, f in (("transitions/s out (steady)", lambda x: x["transitions_per_s_steady"]),
                     ("spans/s in (steady)", lambda x: x["spans_per_s_steady"]),
                     ("service CPU µs/span incl. broker", lambda x: service_cpu_us(x, SERVICES_SPANRL)),
                     ("service CPU µs/span excl. broker", lambda x: service_cpu_us(x, ("bridge", "worker"))),
                     ("service CPU cores (mean over the run)",
                      lambda x: sum(v["cores"] for k, v in x["processes"].items() if k.startswith(SERVICES_SPANRL)))):
        rows.append((label, f(one), f(many), f(many) / f(one) if f(one) else float("nan")))
    return rows


def print_table(res: dict) -> str:
    lines = [f"{'metric':34s} {'spanrl':>10s} {'AGL 0.3':>10s} {'ratio':>7s}"]
    lines += [f"{lab:34s} {a:10.2f} {b:10.2f} {r:7.2f}" for lab, a, b, r in summarize(res)]
    sr = scale_rows(res)
    if sr:
        w, b = res["spanrl"][1]["workers"], res["spanrl"][1]["bridges"]
        lines.append(f"{'scale-out':34s} {'1w/1b':>10s} {f'{w}w/{b}b':>10s} {'ratio':>7s}")
        lines += [f"{lab:34s} {a:10.2f} {b_:10.2f} {r:7.2f}" for lab, a, b_, r in sr]
    for side in res.get("spanrl", []) + ([res["agl"]] if res.get("agl") else []):
        tag = f"spanrl {side['workers']}w/{side['bridges']}b" if "workers" in side else "agl"
        lines.append(tag + ": " + ", ".join(f"{k} {v['cpu_us_per_span']:.0f} µs/span, RSS {v['rss_peak_mib']:.0f}"
                                           f"/{v['rss_final_mib']:.0f} MiB" for k, v in side["processes"].items()))
    return "\n".join(lines)


def plot(res: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = [(f"spanrl {s['workers']}w/{s['bridges']}b", s) for s in res.get("spanrl", [])]
    if res.get("agl"):
        sides.append(("AGL 0.3.0", res["agl"]))
    fig, ax = plt.subplots(3, 1, figsize=(11, 11), sharex=False)

    def per_s(series):  # cumulative -> rate per ~1 s bin
        if len(series) < 2:
            return [], []
        t_end = series[-1][0]
        ts = [i * 1.0 for i in range(int(t_end) + 2)]
        vs = [M.value_at(series, t) for t in ts]
        return ts[1:], [vs[i + 1] - vs[i] for i in range(len(vs) - 1)]

    for name, s in sides:
        for key, style in (("spans_in", "-"), ("transitions_out", "--")):
            t, v = per_s([tuple(x) for x in s["series"][key]])
            unit = "spans/s in" if key == "spans_in" else "transitions/s out"
            ax[0].plot(t, v, style, label=f"{name} {unit}")
        for proc, pts in s["series"]["processes"].items():
            if proc == "agl_adapter":
                continue
            ax[1].plot([p[0] for p in pts], [p[2] for p in pts], label=f"{name}: {proc}")
        lag = s["series"]["lag"]
        ax[2].plot([x[0] for x in lag], [sum(x[1].values()) if isinstance(x[1], dict) else x[1] for x in lag],
                   label=name + (" (records: spans+rewards+rollouts)" if "workers" in s else
                                 " (rollouts succeeded, not adapted)"))
    ax[0].set_ylabel("per second")
    ax[0].set_title(f"{res['mode']}: throughput (1 s bins)")
    ax[1].set_ylabel("RSS MiB (log)")
    ax[1].set_yscale("log")
    ax[1].set_title("RSS per process")
    ax[2].set_ylabel("consumer lag")
    ax[2].set_xlabel("s since the first export")
    for x in ax:
        x.legend(fontsize=7)
        x.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def run(a) -> dict:
    shape = Shape()
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = RESULTS / f"{a.mode}-{stamp}"
    log = Log(base.with_suffix(".log"))
    n = a.rollouts if a.mode == "sustained" else M.rollouts_for(a.spans_per_s, a.duration_s, shape.spans_per_rollout)
    t_start = time.monotonic()
    pool = RolloutPool(shape, a.pool_rollouts)
    res: dict = {"mode": a.mode, "machine": machine_info(), "started": stamp,
                 "params": {"rollouts": n, "batch_rollouts": a.batch_rollouts, "pool_rollouts": a.pool_rollouts,
                            "spans_per_s": a.spans_per_s if a.mode == "rate" else None,
                            "duration_s": a.duration_s if a.mode == "rate" else None,
                            "workers": a.workers, "bridges": a.bridges, "exporters": a.exporters, "settle_s": a.settle_s,
                            "tick_s": a.tick_s, "commit_interval_s": a.commit_interval_s, "sample_s": a.sample_s},
                 "workload": {"shape": shape.__dict__, "spans_per_rollout": shape.spans_per_rollout,
                              "generation": f"pool of {a.pool_rollouts} prebuilt rollouts re-stamped with fresh "
                                            "rollout/attempt/trace/span ids per rollout (bench.workload.RolloutPool)"}}
    log(f"{a.mode}: {n} rollouts ({n * shape.spans_per_rollout} spans) per system -> {base}.json")
    broker = kafka_broker_pid()
    if not a.skip_spanrl:
        configs = [(1, 1)] + ([(a.workers, a.bridges)] if (a.workers, a.bridges) != (1, 1) else [])
        res["spanrl"] = []
        for w, b in configs:
            sampler = Sampler(a.sample_s)
            sampler.add("client", os.getpid())
            if broker:
                sampler.add("kafka", broker)
                base_cpu = sampler.sample()["kafka"][0]
                time.sleep(3)
                res.setdefault("kafka_idle_cpu_cores", []).append((sampler.sample()["kafka"][0] - base_cpu) / 3)
            else:
                log("WARNING: no Kafka broker pid in the stack's state dir; broker CPU not measured")
            sampler.start()
            try:
                side = SpanrlSustained(a, shape, pool, w, b, log)
                res["spanrl"].append(asyncio.run(side.run(a.mode, n, sampler)))
            finally:
                sampler.finish()
            kp = res["spanrl"][-1]["processes"].get("kafka")
            if kp and res.get("kafka_idle_cpu_cores"):
                idle_s = res["kafka_idle_cpu_cores"][-1] * kp["cpu_s"] / kp["cores"] if kp["cores"] else 0.0
                kp["cpu_us_per_span_minus_idle"] = M.cpu_us_per_span(kp["cpu_s"] - idle_s, n * shape.spans_per_rollout)
            log(f"spanrl {w}w/{b}b done: " + json.dumps({k: v for k, v in res["spanrl"][-1].items()
                                                         if k not in ("series", "processes")}, default=str))
    if not a.skip_agl:
        sampler = Sampler(a.sample_s)
        sampler.start()
        try:
            res["agl"] = run_agl_sustained(a, shape, a.mode, n, RESULTS / "tmp" / f"agl-{stamp}", sampler, log)
        finally:
            sampler.finish()
        log("agl done: " + json.dumps({k: v for k, v in res["agl"].items() if k not in ("series", "processes")},
                                      default=str))
    res["summary"] = [dict(zip(("metric", "spanrl", "agl", "ratio"), r)) for r in summarize(res)]
    res["scale_out"] = [dict(zip(("metric", "one", "many", "ratio"), r)) for r in scale_rows(res)]
    res["wall_s"] = time.monotonic() - t_start
    res["machine"]["loadavg_at_end"] = os.getloadavg()
    js = json.dumps(res, indent=1, default=str)
    base.with_suffix(".json").write_text(js)
    (RESULTS / f"latest-{a.mode}.json").write_text(js)
    plot(res, base.with_suffix(".png"))
    table = print_table(res)
    log("\n" + table)
    log(f"-> {base}.json, {base}.png ({res['wall_s']:.0f} s)")
    log.close()
    return res


def add_args(p) -> None:
    g = p.add_argument_group("sustained / rate / scale-out (--mode sustained|rate)")
    g.add_argument("--spans-per-s", type=float, default=1000.0, help="rate mode: offered spans/s")
    g.add_argument("--duration-s", type=float, default=300.0, help="rate mode: seconds offered")
    g.add_argument("--workers", type=int, default=1, help="Faust worker processes (one group) of the 2nd spanrl run")
    g.add_argument("--bridges", type=int, default=1, help="bridge processes of the 2nd spanrl run")
    g.add_argument("--pool-rollouts", type=int, default=64, help="prebuilt rollouts re-stamped with fresh ids")
    g.add_argument("--exporters", type=int, default=None,
                   help="concurrent exporters (feeders), each with one export in flight; default: one per "
                        "bridge in sustained mode, 4 in rate mode")
    g.add_argument("--sample-s", type=float, default=1.0, help="psutil / lag sampling period")
    g.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="give up when no transition came for this long after the last export")
