"""The dashboard service: tails the topics into bounded views and serves HTML pages.

    python -m spanrl.infra.dashboard [--host H] [--port P] [--topic-prefix X]

One aiokafka consumer (read_committed, no consumer group, nothing committed) reads
``spans``, ``rollouts``, ``rewards``, ``transitions``, ``samples``, ``dead-letter``,
``call-accounts`` and ``checkpoints`` from the beginning and keeps reading; every record
is decoded with ``spanrl.schemas.codec`` into :class:`~spanrl.infra.dashboard.views.Views`
(bounds in its docstring). A record that does not decode is counted (``undecodable``),
never fatal. The trainer's and the reloader's ``/status``, the stream worker's committed
offsets (consumer group = its app id) and checkpoint manifests in MinIO are read when a
page asks, with a short timeout; a part that does not answer shows as unavailable.

Pages: ``/`` rollouts (filters: runner, task, status, agent) and dead letters;
``/rollouts/{id}`` one rollout's waterfall and its LLM calls as text (decoded from the
recorded token ids with the served model's tokenizer); ``/training`` per policy version;
``/pipeline`` rates and consumer lag; ``/health``. Auth: infra/dashboard/auth.py.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.templating import Jinja2Templates

from spanrl.core.edge import bearer_headers, service_credentials
from spanrl.core.settings import (DashboardSettings, Settings, StreamSettings, TopicSettings, check_environment,
                                  get_settings)
from spanrl.infra.dashboard import charts, views
from spanrl.schemas import codec
from spanrl.schemas import topics as T

log = logging.getLogger("spanrl.dashboard")
TEMPLATES = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))
TEMPLATES.env.filters["ms"] = lambda ms: time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000)) + " UTC"
#: the topics the dashboard tails (record type = the view's kind)
TAILED = (T.SPANS, T.ROLLOUTS, T.REWARDS, T.TRANSITIONS, T.SAMPLES, T.DEAD_LETTER, T.CALL_ACCOUNTS, T.CHECKPOINTS)
#: the stream worker's input topics, whose committed offsets are its lag (stage "stream")
STREAM_INPUTS = (T.SPANS, T.REWARDS, T.ROLLOUTS, T.ORPHAN_SPANS, T.TRANSITIONS)
#: attribute keys never shown (a client may put anything in its telemetry)
SECRET_KEY = re.compile(r"auth|token|secret|password|api[_.-]?key|cookie", re.I)
RATE_WINDOW_S = 60.0


@dataclass
class Tail:
    """The tailer's state: the views, the record timestamps the rates use (last 100 000
    per kind) and the counts of records that did not decode."""

    views: views.Views = field(default_factory=views.Views)
    stamps: dict[str, deque] = field(default_factory=lambda: {k: deque(maxlen=100_000)
                                                              for k in ("span", "transition")})
    undecodable: dict[str, int] = field(default_factory=dict)
    #: (topic, partition) -> the next offset to read: a reconnect resumes there, so no record
    #: is taken twice
    positions: dict[tuple[str, int], int] = field(default_factory=dict)
    caught_up: bool = False
    error: str | None = None

    def take(self, kind: str, value: bytes, timestamp_ms: int) -> None:
        try:
            self.views.add(kind, codec.decode(kind, value))
        except (codec.SchemaError, KeyError, TypeError, ValueError) as exc:
            self.undecodable[kind] = self.undecodable.get(kind, 0) + 1
            log.warning("undecodable %s record: %s", kind, exc)
            return
        if kind in self.stamps:
            self.stamps[kind].append(timestamp_ms)


async def tail_topics(state: Tail, bootstrap: str, names: dict[str, T.Topic], stop: asyncio.Event) -> None:
    """Read every topic of ``names`` (name -> Topic) from the beginning into ``state`` until
    ``stop``; after an error (its message in ``state.error``) reconnects and resumes at
    ``state.positions``."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    by_name = {n: t.record for n, t in names.items()}
    while not stop.is_set():
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed",
                                    enable_auto_commit=False, group_id=None)
        try:
            await consumer.start()
            parts = [TopicPartition(n, p) for n, t in names.items() for p in range(t.partitions)]
            consumer.assign(parts)
            fresh = [tp for tp in parts if (tp.topic, tp.partition) not in state.positions]
            if fresh:  # (with no argument aiokafka seeks every assigned partition)
                await consumer.seek_to_beginning(*fresh)
            for tp in parts:
                if (tp.topic, tp.partition) in state.positions:
                    consumer.seek(tp, state.positions[(tp.topic, tp.partition)])
            ends = await consumer.end_offsets(parts)
            state.error = None
            while not stop.is_set():
                batch = await consumer.getmany(timeout_ms=500, max_records=2000)
                for tp, msgs in batch.items():
                    for m in msgs:
                        state.take(by_name[tp.topic], m.value, m.timestamp)
                    state.positions[(tp.topic, tp.partition)] = msgs[-1].offset + 1
                if not state.caught_up and all(await _positions_reached(consumer, ends)):
                    state.caught_up = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - Kafka away: show it, retry
            state.error = f"{type(exc).__name__}: {exc}"
            log.warning("tailing stopped (%s); retrying in 2 s", state.error)
            await asyncio.sleep(2)
        finally:
            await consumer.stop()


async def _positions_reached(consumer, ends) -> list[bool]:
    return [await consumer.position(tp) >= end for tp, end in ends.items()]


class Sources:
    """What pages read on demand besides the tail: the trainer's and reloader's status,
    the stream group's committed offsets, manifests in MinIO, evaluation reports."""

    def __init__(self, s: Settings, prefix: str, stream_group: str, eval_dirs: list[Path]):
        self.s, self.prefix, self.stream_group, self.eval_dirs = s, prefix, stream_group, eval_dirs
        self._manifests: dict[str, dict | None] = {}

    async def status(self, port: int) -> dict | None:
        try:
            async with httpx.AsyncClient(timeout=2.0, headers=bearer_headers(self.s.auth_token)) as c:
                r = await c.get(f"http://{self.s.host}:{port}/status")
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def lag(self, trained_offsets: dict[str, int] | None) -> dict:
        """Consumer lag per stage: ``{"stream": {topic: lag}, "trainer": {topic: lag} | None,
        "group": app id}`` (the stream worker's committed offsets of its consumer group; the
        trainer's trained offsets ``{"samples:0": next offset}`` from its status), or
        ``{"error": ...}`` when Kafka does not answer."""
        from aiokafka import AIOKafkaConsumer, TopicPartition
        from aiokafka.admin import AIOKafkaAdminClient

        inputs = [self.prefix + t.name for t in STREAM_INPUTS]
        samples = self.prefix + T.SAMPLES.name
        parts = [TopicPartition(n, p) for n, t in zip(inputs, STREAM_INPUTS) for p in range(t.partitions)]
        parts += [TopicPartition(samples, p) for p in range(T.SAMPLES.partitions)]
        consumer = AIOKafkaConsumer(bootstrap_servers=self.s.kafka_bootstrap, isolation_level="read_committed")
        admin = AIOKafkaAdminClient(bootstrap_servers=self.s.kafka_bootstrap)
        try:
            await asyncio.wait_for(consumer.start(), 5)
            await asyncio.wait_for(admin.start(), 5)
            ends = await asyncio.wait_for(consumer.end_offsets(parts), 5)
            committed = await asyncio.wait_for(admin.list_consumer_group_offsets(self.stream_group), 5)
        except Exception as exc:  # noqa: BLE001 - shown on the page
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            await consumer.stop()
            await admin.close()
        end_map = {(tp.topic, tp.partition): e for tp, e in ends.items()}
        done = {(tp.topic, tp.partition): meta.offset for tp, meta in committed.items()}
        stream = views.consumer_lag({k: v for k, v in end_map.items() if k[0] != samples}, done)
        trainer = None
        if trained_offsets is not None:  # a partition it has not trained on yet has no lag to show
            # (the stack's trainer starts at the samples' end, SPANRL_TRAINER_START=latest)
            known = {(samples, p): trained_offsets[f"{T.SAMPLES.name}:{p}"] for p in range(T.SAMPLES.partitions)
                     if f"{T.SAMPLES.name}:{p}" in trained_offsets}
            trainer = views.consumer_lag({k: v for k, v in end_map.items() if k in known}, known)
        return {"stream": stream, "trainer": trainer, "group": self.stream_group}

    def manifest(self, uri: str) -> dict | None:
        """The manifest of checkpoint ``uri`` in MinIO (cached), None when it cannot be read."""
        if uri not in self._manifests:
            from spanrl.trainer import checkpoint

            try:
                bucket, prefix = checkpoint.parse_uri(uri)
                client = checkpoint.make_client(self.s)
                obj = client.get_object(bucket, prefix + checkpoint.MANIFEST)
                try:
                    self._manifests[uri] = json.loads(obj.read())
                finally:
                    obj.close()
                    obj.release_conn()
            except Exception as exc:  # noqa: BLE001 - pruned or MinIO away: not cached
                log.info("manifest %s: %s", uri, exc)
                return None
        return self._manifests[uri]

    def evaluations(self) -> list[dict]:
        """Held-out evaluation reports in ``eval_dirs``: ``spanrl eval``'s ``results/eval/NAME.json``,
        the main job's ``results/heldout-{sampled,greedy}.json`` (infra/evaluation.py
        ``write_report``) and the reports inside a main job's ``summary.json`` (``heldout``:
        mode -> report); a JSON file with neither ``policies`` nor ``heldout`` is not one. Each:
        name, modification time, policies with their episodes and mean-reward interval
        (``estimate``, ``low``, ``high``)."""
        out = []
        for path in [p for d in self.eval_dirs if d.is_dir() for p in sorted(d.glob("*.json"))]:
            try:
                doc = json.loads(path.read_text())
                reports = {str(path): doc} if "policies" in doc else \
                    {f"{path} ({mode})": rep for mode, rep in (doc.get("heldout") or {}).items()}
                mtime = int(path.stat().st_mtime * 1000)
                for name, report in reports.items():
                    out.append({"name": name, "mtime_ms": mtime, "policies": {
                        k: {"episodes": v.get("episodes"), "mean_reward": v.get("mean_reward")}
                        for k, v in report["policies"].items()}})
            except (OSError, ValueError, KeyError, AttributeError, TypeError):
                continue
        return out


def decode_text(tokenizer, ids: list[int]) -> str:
    """The text of recorded token ids (special tokens kept: the chat template's markers)."""
    return tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else f"<{len(ids)} tokens>"


def safe_attributes(attrs: dict[str, str]) -> dict[str, str]:
    """``attrs`` with the values of credential-like keys (:data:`SECRET_KEY`) replaced."""
    return {k: ("[hidden]" if SECRET_KEY.search(k) else v) for k, v in attrs.items()}


def create_app(s: Settings, prefix: str = "", stream_group: str | None = None,
               eval_dirs: list[Path] | None = None, tail: bool = True) -> FastAPI:
    """The dashboard app for settings ``s``, tailing :data:`TAILED` named ``prefix + name``;
    ``tail=False`` for tests that feed ``app.state.tail`` themselves."""
    names = {prefix + t.name: t for t in TAILED}
    state = Tail(views.Views(max_rollouts=s.dashboard_max_rollouts))
    sources = Sources(s, prefix, stream_group or StreamSettings().stream_app_id,
                      eval_dirs or [Path(p) for p in DashboardSettings().dashboard_eval_dirs.split(os.pathsep) if p])
    tok: dict = {}

    def tokenizer():
        if "t" not in tok and not (Path(s.model_dir) / "tokenizer_config.json").is_file():
            log.warning("no tokenizer in %s: LLM calls show as token counts", s.model_dir)
            tok["t"] = None
        if "t" not in tok:
            try:
                from transformers import AutoTokenizer

                # the served model's own files, never the Hub (no network at run time)
                tok["t"] = AutoTokenizer.from_pretrained(s.model_dir, local_files_only=True)
            except Exception as exc:  # noqa: BLE001 - shown as token counts instead
                log.warning("no tokenizer at %s: %s", s.model_dir, exc)
                tok["t"] = None
        return tok["t"]

    @asynccontextmanager
    async def lifespan(app):
        stop = asyncio.Event()
        task = asyncio.create_task(tail_topics(state, s.kafka_bootstrap, names, stop)) if tail else None
        loading = asyncio.create_task(asyncio.to_thread(tokenizer)) if tail else None  # first trace page fast
        yield
        if loading:
            await asyncio.gather(loading, return_exceptions=True)
        stop.set()
        if task:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    app = FastAPI(title="spanrl dashboard", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tail, app.state.sources = state, sources
    credentials = service_credentials(s, "dashboard", log)
    if credentials is not None:
        from spanrl.infra.dashboard.auth import DashboardAuth

        app.add_middleware(DashboardAuth, credentials=credentials)

    def page(request: Request, name: str, **ctx) -> HTMLResponse:
        return TEMPLATES.TemplateResponse(request, name, {"tail": state, "now": time.strftime("%H:%M:%S"), **ctx})

    @app.get("/health")
    async def health():
        return {"ok": True, "caught_up": state.caught_up, "kafka_error": state.error}

    @app.get("/", response_class=HTMLResponse)
    async def rollouts(request: Request, runner: str = "", task: str = "", status: str = "", agent: str = "",
                       reason: str = "", limit: int = 200):
        rows = sorted((views.rollout_summary(r) for r in state.views.rollouts.values()),
                      key=lambda x: x["last_ms"], reverse=True)
        statuses = sorted({r["status"] for r in rows})
        agents = sorted({a for r in rows for a in r["agents"]})
        shown = [r for r in rows if views.matches(r, runner, task, status, agent)]
        dead = [d for d in reversed(state.views.dead_letters) if views.dead_letter_matches(d, task, reason)]
        return page(request, "rollouts.html", rows=shown[:max(1, min(limit, 2000))], total=len(shown),
                    statuses=statuses, agents=agents, f={"runner": runner, "task": task, "status": status,
                                                         "agent": agent, "reason": reason},
                    dead=dead[:50], dead_total=len(dead),
                    reasons=sorted({d["reason"] for d in state.views.dead_letters}))

    @app.get("/rollouts/{rollout_id}", response_class=HTMLResponse)
    async def rollout(request: Request, rollout_id: str):
        r = state.views.rollouts.get(rollout_id)
        if r is None:
            raise HTTPException(404, f"rollout {rollout_id!r} is not in the dashboard's view")
        rows = views.waterfall(r)
        t = await asyncio.to_thread(tokenizer)
        calls = []
        for row in rows:
            sp = row["span"]
            if sp is None:
                continue
            entry = {"row": row, "attributes": safe_attributes(sp.get("attributes") or {}),
                     "account": r.accounts.get(sp["span_id"]), "transition": r.transitions.get(sp["span_id"])}
            if sp.get("llm"):
                entry["prompt"] = decode_text(t, sp["llm"]["prompt_token_ids"])
                entry["completion"] = decode_text(t, sp["llm"]["completion_token_ids"])
            calls.append(entry)
        svg = await asyncio.to_thread(charts.waterfall_svg, rows) if rows else ""
        return page(request, "rollout.html", r=r, summary=views.rollout_summary(r), svg=svg, calls=calls)

    @app.get("/training", response_class=HTMLResponse)
    async def training(request: Request, run: str = ""):
        """``run``: one run's versions; empty: the run vLLM serves (the reloader's), ``*``: all."""
        trainer, reloader = await asyncio.gather(sources.status(s.trainer_port), sources.status(s.reloader_port))
        runs = sorted({c["run"] for c in state.views.checkpoints})
        run = run or (reloader or {}).get("run") or s.run
        rows = views.training_rows(list(state.views.checkpoints), None if run == "*" else run)
        loaded = views.loaded_times((reloader or {}).get("history", []), (reloader or {}).get("run", ""))
        for row in rows:
            row["loaded_ms"] = loaded.get(row["version"]) if reloader and row["run"] == reloader["run"] else None
        for row in rows[-20:]:
            m = await asyncio.to_thread(sources.manifest, row["uri"])
            row["trained_offsets"] = (m or {}).get("trained_offsets")
        svg = await asyncio.to_thread(charts.training_svg, rows) if rows else ""
        return page(request, "training.html", rows=rows, runs=runs, run=run, svg=svg, trainer=trainer,
                    reloader=reloader, evaluations=sources.evaluations())

    @app.get("/pipeline", response_class=HTMLResponse)
    async def pipeline(request: Request):
        now = int(time.time() * 1000)
        rates = {k: views.rate_per_s(list(v), now, RATE_WINDOW_S) for k, v in state.stamps.items()}
        trainer = await sources.status(s.trainer_port)
        lag = await sources.lag((trainer or {}).get("trained_offsets"))
        return page(request, "pipeline.html", rates=rates, window=RATE_WINDOW_S, lag=lag, trainer=trainer,
                    counts=state.views.counts)

    @app.get("/api/rollouts")
    async def api_rollouts():
        return JSONResponse([views.rollout_summary(r) for r in state.views.rollouts.values()])

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    check_environment()
    s = get_settings()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default=s.host)
    p.add_argument("--port", type=int, default=s.dashboard_port)
    p.add_argument("--topic-prefix", default=TopicSettings().topic_prefix)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvicorn.run(create_app(s, a.topic_prefix), host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
