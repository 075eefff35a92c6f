"""What integration tests of the producers share: our services run as subprocesses from this
checkout on free ports (``python -m spanrl.producers.bridge|proxy``), writing to a test's own
``<prefix>*`` topics on the stack's Kafka, and reading those topics back.

Credentials (docs/operations.md): the stack's own services run with auth on, so a test that
calls them sends the stack's tokens (:func:`agent_key`, :func:`agent_headers`,
:func:`admin_headers`, read when called: the stack makes them at its first start). A test's
private service runs open (``SPANRL_AUTH=open``, on loopback) unless the test gives it
credentials in ``env``: its subject is something else; the auth tests give it a token."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import httpx
from aiokafka import AIOKafkaConsumer, TopicPartition

from spanrl.core.edge import bearer_headers, token_value
from spanrl.core.settings import get_settings
from spanrl.producers.kafka import Topics, create_topics, delete_topics
from spanrl.schemas import codec

ROOT = Path(__file__).resolve().parents[2]
S = get_settings()


#: variables that mean a test wants its private service closed
AUTH_VARIABLES = ("SPANRL_AUTH", "SPANRL_AUTH_TOKEN", "SPANRL_AUTH_TOKEN_FILE", "SPANRL_ADMIN_TOKEN")


def agent_key() -> str:
    """The stack's agent token, as an OpenAI client's ``api_key`` ("unused" when open)."""
    return token_value(S.auth_token) or "unused"


def agent_headers() -> dict[str, str]:
    """``Authorization: Bearer <the stack's agent token>`` ({} when there is none)."""
    return bearer_headers(S.auth_token)


def admin_headers() -> dict[str, str]:
    """``Authorization: Bearer <the stack's administrator token>`` ({} when there is none)."""
    return bearer_headers(S.admin_token)


def private_env(env: dict | None = None) -> dict[str, str]:
    """The environment of a test's private service: this process's, open unless ``env`` sets
    a credential, then ``env``."""
    env = dict(env or {})
    auth = {} if any(k in env for k in AUTH_VARIABLES) else {"SPANRL_AUTH": "open"}
    return {**os.environ, **auth, **env}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((S.host, 0))
        return s.getsockname()[1]


def start_service(module: str, *args: str, env: dict | None = None, output: Path | None = None,
                  timeout_s: float = 30) -> tuple[subprocess.Popen, str]:
    """``python -m module --port P *args`` with ``env`` added; stdout+stderr to ``output``. A
    bridge runs without its OTLP/gRPC receiver unless ``args`` name a ``--grpc-port`` (the
    default port is the stack's bridge's, and a second bind of it fails). It runs open unless
    ``env`` sets a credential (:func:`private_env`)."""
    if module.endswith(".bridge") and "--grpc-port" not in args:
        args = ("--grpc-port", "0", *args)
    port = free_port()
    out = open(output, "wb") if output else None
    proc = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), *args], cwd=ROOT,
                            env=private_env(env), stdout=out, stderr=subprocess.STDOUT if out else None)
    if out:
        out.close()  # the child holds its own descriptor
    url = f"http://{S.host}:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{module} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{module} did not become healthy")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def topic_prefix(topics: Topics) -> str:
    return topics.spans.name.removesuffix("spans")


@contextmanager
def own_topics(tag: str):
    """Topics ``<tag>-<id>-*`` (the training ones, yielded, and the evaluation ones,
    ``Topics.with_prefix(prefix, Topics.evaluation())``) created on the stack's Kafka for the
    block, deleted after it."""
    prefix = f"{tag}-{uuid.uuid4().hex[:8]}-"
    t = Topics.with_prefix(prefix)
    asyncio.run(create_topics(S.kafka_bootstrap, t.all() + Topics.with_prefix(prefix, Topics.evaluation()).all()))
    try:
        yield t
    finally:
        asyncio.run(cleanup_topics(prefix))


async def cleanup_topics(prefix: str) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=S.kafka_bootstrap)
    await admin.start()
    try:
        names = [n for n in await admin.list_topics() if n.startswith(prefix)]
    finally:
        await admin.close()
    await delete_topics(S.kafka_bootstrap, names)


def read_topic(topic, want, timeout_s: float = 20.0) -> list[tuple[str | None, dict]]:
    """All (key, record) of ``topic`` from the beginning until ``want(records)`` or timeout."""

    async def go():
        c = AIOKafkaConsumer(bootstrap_servers=S.kafka_bootstrap, enable_auto_commit=False)
        await c.start()
        try:
            tps = [TopicPartition(topic.name, p) for p in range(topic.partitions)]
            c.assign(tps)
            await c.seek_to_beginning(*tps)
            out: list = []
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and not want(out):
                for msgs in (await c.getmany(timeout_ms=300)).values():
                    out += [(m.key.decode() if m.key else None, codec.decode(topic.record, m.value)) for m in msgs]
            return out
        finally:
            await c.stop()

    return asyncio.run(go())


def of_rollout(records, rid):
    return [r for k, r in records if r.get("rollout_id") == rid]
