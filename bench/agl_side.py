"""Agent Lightning side of benchmark (1) and (3); runs in Agent Lightning's own venv.

    <agl-venv>/bin/python -m bench.agl_side --store http://127.0.0.1:P --rollouts R --runs N --out f.json

Against a running ``agl store --backend memory`` (started by bench.run, which measures the
store process's CPU and RSS): per run, R rollouts are started (``start_rollout``, not timed,
like a runner claiming work), then timed: the workload's spans go to the store's OTLP/HTTP
endpoint (``/v1/traces``) with the standard exporter in batches, each batch's attempts are
marked ``succeeded``, and - overlapping, as its trainer does for completed rollouts -
``query_spans(rollout_id, attempt_id="latest")`` + ``TracerTraceToTriplet().adapt(spans)``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price-list download offline

from bench.workload import Shape, export_ok, exporter, reward_of, rollout_spans  # noqa: E402


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
    p.add_argument("--out", required=True)
    a = p.parse_args()
    res = asyncio.run(main_async(a))
    with open(a.out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
