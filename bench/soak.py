"""Soak: the sustained workload at a fixed rate for an hour or more, with the trainer consuming;
is every process's memory flat, and does every call come out once? (issue 21)

    make soak                                   # 80 spans/s for 65 min, 15 min warm-up
    make soak ARGS="--duration-s 600 --warmup-s 180 --spans-per-s 120"

Kafka and MinIO of the local stack are started if they are not (nothing else: no vLLM). One
bridge, one Faust worker and one trainer run on this run's own topics (``soak-<id>-*``); the
workload is bench.sustained's (OTLP exports of ``--batch-rollouts`` rollouts, each rollout
``started`` -> spans -> ``succeeded`` with ``inputs_acked``), paced to ``--spans-per-s``, with
rollouts grouped by task: rollouts 4k..4k+3 are the 4 members of task k (``group_size`` 4,
rewards 0, 1, 0, 1), so every group closes complete and every transition becomes a sample.
Task ids never repeat (as with production agents), so both the rollout and the task tables
grow with the run unless their bound holds: the worker runs with
``SPANRL_STREAM_RETAIN_MAX=--retain-max`` (300 by default, so that both tables reach the bound
inside the warm-up; the setting's default is 10,000). The default rate, 80 spans/s (10 rollouts,
50 samples a second), is one the trainer below keeps up with on 2 cores beside the pipeline (it
trained ~66 samples/s there; at 200 spans/s it fell behind).

The trainer: ``python -m spanrl.trainer.train`` on the samples topic with a random 2-layer
Qwen2 (hidden 32; SmolLM2's vocabulary and tokenizer) so that it keeps up on a CPU: one thread,
updates of ``--trainer-batch`` samples in micro-batches of 64, ``stale_policy=keep``, publishing
every ``--checkpoint-every`` updates (MinIO keeps the last 2).

Measured every ``--sample-s``: CPU and RSS of the bridge, the worker, the trainer, the Kafka
broker, MinIO and this client (psutil); every 30 s the worker's ``/spanrl/held/`` (states per
table) and ``/spanrl/counters/``, with the trainer's malloc heap after its latest update (its log's
``heap``: in use, freed and kept, mmapped; their trends are reported, not judged). Checked at the end: calls in (LLM spans exported) =
transitions out = samples out = samples the trainer received, none duplicated (by rollout,
attempt and span id on transitions and samples), no dead letter; each process's memory trend
between the warm-up and the end of the feed (bench.metrics.memory_trend; flat: the fitted growth
over that window <= max(5 % of the mean, 16 MiB)). The client (this process) is sampled but not
judged: it keeps every transition's key to find duplicates.
Writes ``bench/results/soak-<time>.{json,png,log}``; exit status 1 when a check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench import metrics as M
from bench.run import RESULTS, machine_info, stop
from bench.sustained import WARMUP_ROLLOUTS, Log, Sampler, SpanrlSustained, kafka_broker_pid, stack_pid
from bench.workload import RolloutPool, Shape, export_ok

GROUP_SIZE = 4


def task_of(rollout_index: int) -> str:
    """The task of the ``rollout_index``-th rollout of the run: groups of :data:`GROUP_SIZE`."""
    return f"task-{rollout_index // GROUP_SIZE}"


def tiny_model(dest: Path, tokenizer_dir: Path, max_positions: int) -> Path:
    """A random 2-layer Qwen2 (hidden 32, SmolLM2's vocabulary) with SmolLM2's tokenizer files
    in ``dest``: a real HF model directory the trainer loads and updates in well under a second."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tokenizer_dir / name, dest / name)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=max_positions, tie_word_embeddings=True, use_cache=False)
    Qwen2ForCausalLM(cfg).save_pretrained(str(dest), safe_serialization=True)
    return dest


class SoakSide(SpanrlSustained):
    """One bridge, one worker (with the retention bound) and the trainer on this run's topics."""

    def __init__(self, a, shape: Shape, pool: RolloutPool, log: Log):
        super().__init__(a, shape, pool, 1, 1, log)
        self.prefix = f"soak-{self.id}-"
        self.app_id = f"soak-{self.id}-stream"
        self.names = {k: self.prefix + k for k in self.names}
        self.workdir = RESULTS / "tmp" / f"soak-{self.id}"
        self.trainer: subprocess.Popen | None = None
        self.task_index: dict[str, int] = {}
        self.transition_keys: set[tuple] = set()
        self.sample_keys: set[tuple] = set()
        self.dup_transitions = 0
        self.dup_samples = 0
        self.n_samples = 0
        self.n_warm_samples = 0
        self.held: list = []
        self.holding = True
        self.worker_env = {"SPANRL_STREAM_RETAIN_MAX": str(a.retain_max)}

    async def create_topics(self) -> None:
        import dataclasses

        from spanrl.producers.kafka import create_topics
        from spanrl.schemas import topics as T

        await super().create_topics()
        await create_topics(self.bootstrap, (dataclasses.replace(T.CHECKPOINTS, name=self.prefix + "checkpoints"),))

    def start(self) -> None:
        super().start()
        from spanrl.core.settings import child_env, get_settings

        s = get_settings()
        model = tiny_model(self.workdir / "tiny-model", s.model_dir,
                           max_positions=self.shape.prompt_tokens + self.shape.completion_tokens + 64)
        env = child_env({
            "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1",
            "SPANRL_TRAINER_RUN": f"soak-{self.id}", "SPANRL_TRAINER_BASE_DIR": str(model),
            "SPANRL_TRAINER_SAMPLES_TOPIC": self.names["samples"],
            "SPANRL_TRAINER_CHECKPOINTS_TOPIC": self.prefix + "checkpoints",
            "SPANRL_TRAINER_HTTP": "false", "SPANRL_TRAINER_LOG_PATH": str(self.workdir / "trainer.jsonl"),
            "SPANRL_TRAINER_BATCHING": "stream", "SPANRL_TRAINER_MIN_BATCH": str(self.a.trainer_batch), "SPANRL_TRAINER_MAX_BATCH": str(self.a.trainer_batch),
            "SPANRL_TRAINER_MICRO_BATCH": "64", "SPANRL_TRAINER_MICRO_BATCH_TOKENS": "16384",
            "SPANRL_TRAINER_ACTIVATION_CHECKPOINTING": "false", "SPANRL_TRAINER_STALE_POLICY": "keep",
            "SPANRL_TRAINER_CHECKPOINT_EVERY": str(self.a.checkpoint_every),
            "SPANRL_TRAINER_KEEP_PUBLISHED": "2", "SPANRL_TRAINER_KEEP_LOCAL": "1",
            "SPANRL_TRAINER_START": "earliest"})
        self.trainer = subprocess.Popen([sys.executable, "-m", "spanrl.trainer.train"], cwd=self.workdir, env=env,
                                        stdout=open(self.workdir / "trainer.log", "wb"), stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def stop(self) -> None:
        """Nothing while ``holding`` (bench.sustained's run stops its processes when its feed and
        drain end; the trainer's last updates come after): :meth:`close` stops them."""
        if not self.holding:
            self.close()

    async def delete_topics(self) -> None:
        if not self.holding:
            await super().delete_topics()

    def close(self) -> None:
        super().stop()
        if self.trainer is not None:
            if self.trainer.poll() is not None and self.trainer.returncode:
                self.log(f"trainer exited {self.trainer.returncode}; logs in {self.workdir}")
            stop(self.trainer)

    def pids(self) -> dict[str, int]:
        out = super().pids()
        if self.trainer is not None:
            out["trainer"] = self.trainer.pid
        return out

    def trainer_events(self, event: str) -> list[dict]:
        path = self.workdir / "trainer.jsonl"
        if not path.exists():
            return []
        return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("event") == event]

    async def consume(self, stop_evt: asyncio.Event) -> None:
        """Transitions (bench.sustained's run reads them until its drain ends; keyed by task
        here), each checked for duplicates by (rollout, attempt, span id)."""
        from spanrl.schemas import codec

        def on_batch(now, msgs):
            for m in msgs:
                tr = codec.decode("transition", m.value)
                key = (tr["rollout_id"], tr["attempt_id"], tr["span_id"])
                self.dup_transitions += key in self.transition_keys
                self.transition_keys.add(key)
                seen = self.seen.setdefault(tr["rollout_id"], [])
                seen.append(now)
                if len(seen) == self.shape.llm_calls:
                    self.complete.add(tr["rollout_id"])
            self.n_out += len(msgs)
            self.out_series.append((now, self.n_out))

        await self.read_transitions(stop_evt, on_batch, clock=time.monotonic)

    async def consume_samples(self, stop_evt: asyncio.Event) -> None:
        """The samples topic (read_committed, from the start) until ``stop_evt``: the run's and the
        warm-up's, each checked for duplicates by (rollout, attempt, span id)."""
        from aiokafka import AIOKafkaConsumer

        from spanrl.schemas import codec

        c = AIOKafkaConsumer(self.names["samples"], bootstrap_servers=self.bootstrap, group_id=None,
                             auto_offset_reset="earliest", isolation_level="read_committed")
        await c.start()
        try:
            while not stop_evt.is_set():
                for msgs in (await c.getmany(timeout_ms=200)).values():
                    for m in msgs:
                        tr = codec.decode("sample", m.value)["transition"]
                        if not tr["rollout_id"].startswith(f"s{self.id}-"):  # the warm-up's
                            self.n_warm_samples += 1
                            continue
                        key = (tr["rollout_id"], tr["attempt_id"], tr["span_id"])
                        self.n_samples += 1
                        self.dup_samples += key in self.sample_keys
                        self.sample_keys.add(key)
        finally:
            await c.stop()

    def trainer_heap(self) -> dict | None:
        """What malloc held in the trainer after its latest update (its log's ``heap``:
        spanrl/core/heap.py), or None before the first."""
        updates = self.trainer_events("update")
        return updates[-1].get("heap") if updates else None

    async def poll_held(self, stop_evt: asyncio.Event, t0: float) -> None:
        """The worker's /spanrl/held/ and evictions every 30 s (what it holds, by table), with
        the trainer's malloc heap after its latest update."""
        while not stop_evt.is_set():
            try:
                base = f"http://127.0.0.1:{self.web_ports[0]}/spanrl"
                held = await asyncio.to_thread(_get_json, f"{base}/held/")
                counters = await asyncio.to_thread(_get_json, f"{base}/counters/")
                self.held.append({"t": time.monotonic() - t0, "tables": held["tables"],
                                  "rollouts_finished": sum(p["rollouts_finished"] for p in held["partitions"].values()),
                                  "tasks_finished": held["tasks_finished"],
                                  "rollouts_evicted": counters["rollouts_evicted"],
                                  "tasks_evicted": counters["tasks_evicted"], "calls_held": counters["calls_held"],
                                  "transitions_held": counters["transitions_held"],
                                  "trainer_heap": self.trainer_heap()})
            except (OSError, KeyError, ValueError) as exc:
                self.log(f"held sample failed: {exc!r}")
            try:
                await asyncio.wait_for(stop_evt.wait(), 30)
            except asyncio.TimeoutError:
                pass

    async def _send_batch(self, producer, exp, rids: list[str], first: int) -> None:
        """As bench.sustained's, with each rollout's task (:func:`task_of`) and group size 4."""
        from spanrl.schemas import codec

        def event(rid: str, status: str) -> tuple[str, bytes, bytes]:
            acked = status != "started"
            return (self.names["rollouts"], rid.encode(), codec.encode("rollout", {
                "rollout_id": rid, "attempt_id": "0", "status": status,
                "task_id": ("warm-" if rid.startswith("w") else "") + task_of(self.task_index[rid]),
                "group_size": GROUP_SIZE, "runner_id": "soak", "timestamp_ms": int(time.time() * 1000),
                "inputs_acked": acked}))

        for i, rid in enumerate(rids):
            self.task_index[rid] = first + i
            t, k, v = event(rid, "started")
            await producer.send(t, v, key=k)
        spans = [s for i, rid in enumerate(rids) for s in self.pool.spans(first + i, rid, "0")]
        await asyncio.to_thread(export_ok, exp, spans)
        futs = []
        for rid in rids:
            t, k, v = event(rid, "succeeded")
            futs.append(await producer.send(t, v, key=k))
        await asyncio.gather(*futs)


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def run(a) -> dict:
    from spanrl.core.settings import get_settings
    from spanrl.infra.stack import Stack

    shape = Shape(prompt_tokens=a.prompt_tokens, completion_tokens=a.completion_tokens)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = RESULTS / f"soak-{stamp}"
    log = Log(base.with_suffix(".log"))
    Stack(get_settings()).up(["kafka", "minio"])
    n = M.rollouts_for(a.spans_per_s, a.duration_s, shape.spans_per_rollout)
    n -= n % GROUP_SIZE
    log(f"soak: {n} rollouts ({n * shape.spans_per_rollout} spans, {n * shape.llm_calls} calls) at "
        f"{a.spans_per_s} spans/s for {a.duration_s:.0f} s, warm-up {a.warmup_s:.0f} s -> {base}.json")
    a.mode = "rate"
    pool = RolloutPool(shape, a.pool_rollouts)
    # the side keeps its work directory (bench.sustained removes it when its run ends, but the
    # trainer still writes there): _run_with_checks removes it unless --keep-logs
    side = SoakSide(argparse.Namespace(**{**vars(a), "keep_logs": True}), shape, pool, log)
    sampler = Sampler(a.sample_s)
    sampler.add("client", os.getpid())
    broker = kafka_broker_pid()
    if broker:
        sampler.add("kafka", broker)
    minio = stack_pid("minio")
    if minio:
        sampler.add("minio", minio)
    sampler.start()
    t_start = time.monotonic()
    try:
        res = asyncio.run(_run_with_checks(a, side, n, sampler, log))
    finally:
        sampler.finish()
    res.update({"mode": "soak", "machine": machine_info(), "started": stamp, "wall_s": time.monotonic() - t_start,
                "params": {k: getattr(a, k) for k in ("spans_per_s", "duration_s", "warmup_s", "retain_max",
                                                     "batch_rollouts", "pool_rollouts", "exporters", "trainer_batch",
                                                     "checkpoint_every", "sample_s")},
                "workload": {"shape": shape.__dict__, "group_size": GROUP_SIZE, "rollouts": n}})
    t0 = res["series"]["t0"]
    for h in res["held"]:  # seconds since the first export of the run, as every other series
        h["t"] = round(h["t"] + res["t_poll0"] - t0, 1)
    series = sampler.series(t0)
    res["series"]["processes"] = series
    # the trend of the fed part after the warm-up (the drain after it is idle time)
    res["memory"] = {name: M.memory_trend([(t, rss) for t, _, rss in pts if t <= a.duration_s], a.warmup_s)
                     for name, pts in series.items() if name != "client"}
    for tr in res["memory"].values():
        tr["flat"] = M.is_flat(tr)
    # the trainer's RSS split: malloc's memory in use vs freed and kept (a leak grows the first)
    res["trainer_heap"] = {key: M.memory_trend([(h["t"], h["trainer_heap"][key]) for h in res["held"]
                                                if h.get("trainer_heap") and h["t"] <= a.duration_s], a.warmup_s)
                           for key in ("in_use_mib", "free_held_mib", "mmapped_mib")}
    res["checks"] = checks(res)
    res["ok"] = all(c["ok"] for c in res["checks"].values())
    js = json.dumps(res, indent=1, default=str)
    base.with_suffix(".json").write_text(js)
    (RESULTS / "latest-soak.json").write_text(js)
    plot(res, base.with_suffix(".png"))
    log("\n" + table(res))
    log(f"-> {base}.json, {base}.png ({res['wall_s']:.0f} s); {'OK' if res['ok'] else 'FAILED'}")
    log.close()
    return res


async def _run_with_checks(a, side: SoakSide, n: int, sampler: Sampler, log: Log) -> dict:
    """bench.sustained's rate run of ``side``, then the trainer's drain; what the checks read."""
    stop_evt = asyncio.Event()
    t_poll0 = time.monotonic()

    async def poll_held() -> None:
        while not side.web_ports:
            await asyncio.sleep(0.5)
        await side.poll_held(stop_evt, t_poll0)

    held_task = asyncio.create_task(poll_held())
    samples_task = asyncio.create_task(side.consume_samples(stop_evt))
    try:
        res = await side.run("rate", n, sampler)
        expected = n * side.shape.llm_calls
        deadline = time.monotonic() + a.drain_trainer_s
        received = 0
        while time.monotonic() < deadline:  # the last groups' samples, the trainer's last updates
            received = sum(u.get("samples_received", 0) for u in side.trainer_events("update"))
            if (side.n_samples >= expected and received >= expected + side.n_warm_samples) or (
                    side.trainer is not None and side.trainer.poll() is not None):
                break
            await asyncio.sleep(2)
        res.update({
            "trainer": {"updates": len(side.trainer_events("update")), "samples_received": received,
                        "running_at_end": side.trainer is not None and side.trainer.poll() is None},
            "samples_out": side.n_samples, "warm_up": {"rollouts": WARMUP_ROLLOUTS, "samples": side.n_warm_samples},
            "dead_letters_total": side.dead_letters(),
            "duplicates": {"transitions": side.dup_transitions, "samples": side.dup_samples},
            "expected": {"calls_in": expected}, "held": side.held, "t_poll0": t_poll0})
        return res
    finally:
        stop_evt.set()
        await held_task
        await samples_task
        side.holding = False
        side.close()
        await side.delete_topics()
        if not a.keep_logs:
            shutil.rmtree(side.workdir, ignore_errors=True)


def checks(res: dict) -> dict:
    """Each check: ``{"ok", "detail"}``."""
    exp = res["expected"]["calls_in"]
    out = {
        "transitions_out": {"ok": res["transitions"] == exp, "detail": f"{res['transitions']} of {exp}"},
        "samples_out": {"ok": res["samples_out"] == exp, "detail": f"{res['samples_out']} of {exp}"},
        "warm_up_samples": {"ok": res["warm_up"]["samples"] == res["warm_up"]["rollouts"] * res["workload"]["shape"][
            "llm_calls"], "detail": f"{res['warm_up']['samples']} of the warm-up's {res['warm_up']['rollouts']} rollouts"},
        "trainer_received": {"ok": res["trainer"]["samples_received"] == res["samples_out"] + res["warm_up"]["samples"],
                             "detail": f"{res['trainer']['samples_received']} of {exp} + the warm-up's "
                                       f"{res['warm_up']['samples']} in {res['trainer']['updates']} updates"},
        "no_duplicates": {"ok": not any(res["duplicates"].values()), "detail": json.dumps(res["duplicates"])},
        "no_dead_letters": {"ok": not res["dead_letters_total"], "detail": json.dumps(res["dead_letters_total"])},
        "rate_kept": {"ok": (res["rate_behind_max_s"] or 0) <= 60,
                      "detail": f"latest export started {res['rate_behind_max_s']:.1f} s behind the schedule"},
    }
    for name, tr in res["memory"].items():
        out[f"memory_flat_{name}"] = {"ok": tr["flat"], "detail": (
            f"{tr['slope_mib_per_h']:+.1f} MiB/h, {tr['growth_mib']:+.1f} MiB over {tr['window_s']:.0f} s "
            f"after the warm-up (mean {tr['mean_mib']:.0f} MiB)")}
    return out


def table(res: dict) -> str:
    lines = [f"soak: {res['workload']['rollouts']} rollouts at {res['params']['spans_per_s']} spans/s, "
             f"{res['params']['duration_s']:.0f} s (warm-up {res['params']['warmup_s']:.0f} s)"]
    for name, c in res["checks"].items():
        lines.append(f"  {'ok ' if c['ok'] else 'BAD'} {name}: {c['detail']}")
    for key, tr in (res.get("trainer_heap") or {}).items():
        lines.append(f"  trainer malloc {key}: {tr['first_mib']} -> {tr['last_mib']} MiB, "
                     f"{tr['slope_mib_per_h']:+.1f} MiB/h after the warm-up")
    if res.get("held"):
        h = res["held"][-1]
        lines.append(f"  worker holds at the end: {h['tables']}; evicted rollouts {h['rollouts_evicted']}, "
                     f"tasks {h['tasks_evicted']}")
    return "\n".join(lines)


def plot(res: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(3, 1, figsize=(11, 11))
    warm = res["params"]["warmup_s"]
    for name, pts in res["series"]["processes"].items():
        ax[0].plot([p[0] / 60 for p in pts], [p[2] for p in pts], label=name)
    heap_pts = [h for h in res.get("held") or [] if h.get("trainer_heap")]
    for key, style in (("in_use_mib", "--"), ("free_held_mib", ":")):
        ax[0].plot([h["t"] / 60 for h in heap_pts], [h["trainer_heap"][key] for h in heap_pts], style,
                   label=f"trainer malloc {key[:-4].replace('_', ' ')}")
    ax[0].set_ylabel("RSS MiB")
    ax[0].set_title(f"soak: RSS per process (flat after the warm-up: "
                    f"{', '.join(n for n, t in res['memory'].items() if t['flat'])})")
    held = res.get("held") or []
    for key in ("rollouts", "groups"):
        ax[1].plot([h["t"] / 60 for h in held], [h["tables"][key] for h in held], label=f"{key} table states")
    ax[1].set_ylabel("states in the worker")
    ax[1].set_title(f"table sizes (bound: {res['params']['retain_max']} finished per partition and table)")
    for key, style in (("spans_in", "-"), ("transitions_out", "--")):
        s = res["series"][key]
        ax[2].plot([p[0] / 60 for p in s], [p[1] for p in s], style, label=key)
    ax[2].set_ylabel("cumulative")
    ax[2].set_xlabel("minutes since the first export")
    for x in ax:
        x.axvline(warm / 60, color="grey", ls=":", lw=1)
        x.legend(fontsize=7)
        x.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spans-per-s", type=float, default=80.0, help="offered spans/s (8 spans per rollout)")
    p.add_argument("--duration-s", type=float, default=3900.0, help="seconds offered")
    p.add_argument("--warmup-s", type=float, default=900.0, help="memory trends are fitted after this")
    p.add_argument("--retain-max", type=int, default=300, help="the worker's SPANRL_STREAM_RETAIN_MAX")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--completion-tokens", type=int, default=16)
    p.add_argument("--batch-rollouts", type=int, default=16, help="rollouts per OTLP export (a multiple of 4)")
    p.add_argument("--pool-rollouts", type=int, default=64)
    p.add_argument("--exporters", type=int, default=4)
    p.add_argument("--trainer-batch", type=int, default=512, help="the trainer's SPANRL_TRAINER_MIN_BATCH")
    p.add_argument("--checkpoint-every", type=int, default=20, help="updates per published checkpoint")
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--drain-timeout-s", type=float, default=120.0)
    p.add_argument("--drain-trainer-s", type=float, default=300.0)
    p.add_argument("--keep-logs", action="store_true")
    a = p.parse_args(argv)
    if a.batch_rollouts % GROUP_SIZE:
        p.error(f"--batch-rollouts must be a multiple of {GROUP_SIZE}")
    # bench.sustained's settings of the worker: as in production
    a.settle_s, a.tick_s, a.commit_interval_s, a.inputs_acked = 2.0, None, None, True
    res = run(a)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
