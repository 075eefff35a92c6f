"""Agent Lightning side of benchmark (1) and (3); runs in Agent Lightning's own venv.

    <agl-venv>/bin/python -m bench.agl_side --store http://127.0.0.1:P --rollouts R --runs N --out f.json

Against a running ``agl store --backend memory`` (started by bench.run, which measures the
store process's CPU and RSS): per run, R rollouts are started (``start_rollout``, not timed,
like a runner claiming work), then timed: the workload's spans go to the store's OTLP/HTTP
endpoint (``/v1/traces``) with the standard exporter in batches, each batch's attempts are
marked ``succeeded``, and - overlapping, as its trainer does for completed rollouts -
``query_spans(rollout_id, attempt_id="latest")`` + ``TracerTraceToTriplet().adapt(spans)``.

    ... -m bench.agl_side --sustained --store URL --rollouts R --out f.json [--spans-per-s S]

Sustained / fixed-rate (bench.sustained samples the store's and this process's CPU/RSS): per
export batch of ``--batch-rollouts`` rollouts, ``start_rollout`` each (a runner claiming work),
the spans (bench.workload.RolloutPool, fresh ids) to ``/v1/traces`` with the standard OTLP
exporter in a thread, then ``update_attempt(succeeded)`` and, overlapping, ``query_spans`` +
``adapt`` (the path of agentlightning/verl/daemon.py). Without ``--spans-per-s`` as fast as the
store accepts, with it batch k is due at ``t0 + k * batch_spans / rate``. Prints one JSON
progress line a second; writes cumulative series (time.monotonic, the parent's clock),
per-rollout latency (export start -> adapted) and the exporter threads' CPU to ``--out``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price-list download offline

from bench import metrics as M  # noqa: E402
from bench.workload import RolloutPool, Shape, export_ok, exporter, reward_of, rollout_spans  # noqa: E402


async def one_run(client, store_url: str, n: int, shape: Shape, batch_rollouts: int, run: int) -> dict:
    from agentlightning import TracerTraceToTriplet

    adapter = TracerTraceToTriplet()
    started = [await client.start_rollout(input={"task": f"r{run}-{i}"}) for i in range(n)]
    ids = [(a.rollout_id, a.attempt.attempt_id) for a in started]
    work = [rollout_spans(rid, aid, reward_of(i), shape, seed=i) for i, (rid, aid) in enumerate(ids)]
    exp = exporter(store_url.rstrip("/") + "/v1/traces")
    export_cpu = 0.0
    triplets, json_bytes, n_spans = 0, [], 0
    sample_json = None

    def export(spans):
        nonlocal export_cpu
        t = time.thread_time()
        export_ok(exp, spans)
        export_cpu += time.thread_time() - t

    queue: asyncio.Queue = asyncio.Queue()

    async def adapt_worker():
        nonlocal triplets, sample_json
        while True:
            item = await queue.get()
            if item is None:
                return
            rid = item
            spans = await client.query_spans(rid, attempt_id="latest")
            out = adapter.adapt(spans)
            triplets += len(out)
            for tr in out:
                js = tr.model_dump_json()
                json_bytes.append(len(js.encode()))
                sample_json = sample_json or js

    cpu0, t0 = time.process_time(), time.perf_counter()
    worker = asyncio.create_task(adapt_worker())
    for b in range(0, n, batch_rollouts):
        chunk = range(b, min(n, b + batch_rollouts))
        spans = [s for i in chunk for s in work[i]]
        n_spans += len(spans)
        await asyncio.to_thread(export, spans)
        for i in chunk:
            await client.update_attempt(ids[i][0], ids[i][1], status="succeeded")
            queue.put_nowait(ids[i][0])
    t_in = time.perf_counter()
    queue.put_nowait(None)
    await worker
    t_done = time.perf_counter()
    exp.shutdown()
    return {"spans": n_spans, "transitions": triplets, "ingest_s": t_in - t0, "e2e_s": t_done - t0,
            "spans_per_s": n_spans / (t_in - t0), "transitions_per_s": triplets / (t_done - t0),
            "adapter_cpu_s": time.process_time() - cpu0 - export_cpu,
            "triplet_json_bytes_mean": sum(json_bytes) / max(1, len(json_bytes)),
            "sample_triplet_json": sample_json}


async def main_async(a) -> dict:
    from agentlightning.store.client_server import LightningStoreClient

    client = LightningStoreClient(a.store)
    shape = Shape(a.llm_calls, a.tools, a.prompt_tokens, a.completion_tokens)
    runs = []
    try:
        for r in range(a.runs):
            runs.append(await one_run(client, a.store, a.rollouts, shape, a.batch_rollouts, r))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "sample_triplet_json"}), flush=True)
    finally:
        await client.close()
    import agentlightning
    from importlib.metadata import version

    return {"agentlightning": version("agentlightning"), "module": agentlightning.__file__, "runs": runs}


async def sustained_async(a) -> dict:
    """The sustained / fixed-rate run (``--sustained``), see the module docstring."""
    from agentlightning import TracerTraceToTriplet
    from agentlightning.store.client_server import LightningStoreClient

    client = LightningStoreClient(a.store)
    shape = Shape(a.llm_calls, a.tools, a.prompt_tokens, a.completion_tokens)
    pool = RolloutPool(shape, a.pool_rollouts)
    adapter = TracerTraceToTriplet()
    # one exporter (HTTP session) per concurrent feeder; feeder j takes batches k = j mod F
    exps = [exporter(a.store.rstrip("/") + "/v1/traces") for _ in range(a.exporters)]
    lock = threading.Lock()
    export_cpu = [0.0]
    st = {"spans_acked": 0, "finished": 0, "adapted": 0, "triplets": 0}
    series = {"spans_in": [], "transitions_out": [], "lag": []}
    sent_at: dict[str, float] = {}
    lat: list[float] = []
    queue: asyncio.Queue = asyncio.Queue()
    batch_spans = a.batch_rollouts * shape.spans_per_rollout
    n_batches = -(-a.rollouts // a.batch_rollouts)
    behind = 0.0

    def export(exp, spans):
        t = time.thread_time()
        export_ok(exp, spans)
        with lock:
            export_cpu[0] += time.thread_time() - t

    async def adapt_worker():
        while True:
            rid = await queue.get()
            if rid is None:
                return
            spans = await client.query_spans(rid, attempt_id="latest")
            out = adapter.adapt(spans)
            now = time.monotonic()
            st["adapted"] += 1
            st["triplets"] += len(out)
            series["transitions_out"].append((now, st["triplets"]))
            lat.append(now - sent_at[rid])

    async def progress():
        while True:
            series["lag"].append((time.monotonic(), st["finished"] - st["adapted"]))
            print(json.dumps(st), flush=True)
            await asyncio.sleep(a.sample_s)

    t0 = time.monotonic()
    series["spans_in"].append((t0, 0))
    series["transitions_out"].append((t0, 0))
    worker = asyncio.create_task(adapt_worker())
    prog = asyncio.create_task(progress())
    try:
        async def feeder(j: int, exp_j) -> None:
            nonlocal behind
            for k in range(j, n_batches, len(exps)):
                if a.spans_per_s:
                    due = M.pace_schedule(k, t0, batch_spans, a.spans_per_s)
                    behind = max(behind, time.monotonic() - due)
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
                idx = range(k * a.batch_rollouts, min(a.rollouts, (k + 1) * a.batch_rollouts))
                started = [await client.start_rollout(input={"task": f"s{i}"}) for i in idx]
                ts = time.monotonic()
                spans = []
                for i, r in zip(idx, started):
                    sent_at[r.rollout_id] = ts
                    spans += pool.spans(i, r.rollout_id, r.attempt.attempt_id)
                await asyncio.to_thread(export, exp_j, spans)
                st["spans_acked"] += len(spans)
                series["spans_in"].append((time.monotonic(), st["spans_acked"]))
                for r in started:
                    await client.update_attempt(r.rollout_id, r.attempt.attempt_id, status="succeeded")
                    st["finished"] += 1
                    queue.put_nowait(r.rollout_id)

        await asyncio.gather(*(feeder(j, e) for j, e in enumerate(exps)))
        t_in = time.monotonic()
        queue.put_nowait(None)
        await worker
        t_end = time.monotonic()
    finally:
        prog.cancel()
        for exp in exps:
            exp.shutdown()
        await client.close()
    series["lag"].append((time.monotonic(), st["finished"] - st["adapted"]))
    from importlib.metadata import version

    spans = st["spans_acked"]
    return {"agentlightning": version("agentlightning"), "rollouts": a.rollouts, "spans": spans,
            "transitions": st["triplets"], "expected_transitions": a.rollouts * shape.llm_calls,
            "t0": t0, "t_end": t_end, "ingest_s": t_in - t0, "e2e_s": t_end - t0,
            "spans_per_s_mean": spans / (t_in - t0), "transitions_per_s_mean": st["triplets"] / (t_end - t0),
            "rate_behind_max_s": behind if a.spans_per_s else None, "export_cpu_s": export_cpu[0],
            "latency": {"p50_s": M.percentile(lat, 0.5), "p99_s": M.percentile(lat, 0.99),
                        "max_s": max(lat) if lat else float("nan"), "complete": len(lat),
                        "measured_from": "start of the OTLP export holding the rollout's spans",
                        "measured_to": "TracerTraceToTriplet.adapt of the rollout's spans returned"},
            "series": series}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--rollouts", type=int, default=100)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--batch-rollouts", type=int, default=64)
    p.add_argument("--llm-calls", type=int, default=5)
    p.add_argument("--tools", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--completion-tokens", type=int, default=128)
    p.add_argument("--sustained", action="store_true", help="the sustained / fixed-rate run")
    p.add_argument("--pool-rollouts", type=int, default=64)
    p.add_argument("--spans-per-s", type=float, default=None)
    p.add_argument("--sample-s", type=float, default=1.0)
    p.add_argument("--exporters", type=int, default=1, help="--sustained: concurrent feeders/exporters")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    res = asyncio.run(sustained_async(a) if a.sustained else main_async(a))
    with open(a.out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
