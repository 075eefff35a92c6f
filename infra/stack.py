"""The local spanrl stack: Kafka (KRaft), MinIO, vLLM and spanrl's own services.

Each component is a process started with its log in ``<state_dir>/logs/<name>.log``
and its pid in ``<state_dir>/pids/<name>.pid``; each has a health check. ``up`` starts
them in dependency order and waits for health; ``down`` stops them in reverse order
(SIGTERM to the process group, SIGKILL after a grace period). Everything binds to
``settings.host`` (loopback by default). Topics are created from ``spanrl.schemas.topics``.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from spanrl.core.settings import (STACK_TRAINER_START, Settings, StackSettings, check_environment, child_env, env_value,
                                  get_settings)
from spanrl.schemas import topics as T

ROOT = Path(__file__).resolve().parent.parent


def vllm_args(s: Settings, root: Path = ROOT) -> list[str]:
    """The arguments of ``vllm.entrypoints.openai.api_server`` the stack starts vLLM with.

    fp32 and eager mode (the CPU build, DEVELOPERS.md); with ``s.vllm_tool_call_parser`` set,
    ``--enable-auto-tool-choice --tool-call-parser NAME`` (vLLM docs, "Tool Calling": without a
    parser vLLM refuses ``tools`` with ``tool_choice`` auto, required or named with 400); with
    ``s.vllm_chat_template`` set, ``--chat-template PATH`` (relative paths from ``root``).
    """
    args = ["--model", str(s.model_dir), "--served-model-name", s.model_name, "--host", s.host,
            "--port", str(s.vllm_port), "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "2048", "--disable-uvicorn-access-log"]
    if s.vllm_tool_call_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", s.vllm_tool_call_parser]
    if s.vllm_chat_template:
        args += ["--chat-template", str(root / s.vllm_chat_template)]
    return args


class StackError(RuntimeError):
    """A component failed to start or to become healthy; the message names it and its log."""


@dataclass
class Component:
    """One process of the stack.

    name: short name used by the CLI; command/env: how to start it;
    health: returns True when the component serves; after_start: one-off set-up run
    once it is healthy (topic creation, bucket creation); start_timeout_s: how long
    ``up`` waits for health.
    """

    name: str
    command: list[str]
    health: Callable[[], bool]
    env: dict[str, str] = field(default_factory=dict)
    after_start: Callable[[], None] | None = None
    start_timeout_s: float = 120.0
    prepare: Callable[[], None] | None = None


def _tcp_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code < 300
    except httpx.HTTPError:
        return False


class Stack:
    """The set of components for ``settings`` (see module docstring)."""

    def __init__(self, settings: Settings | None = None):
        self.s = settings or get_settings()
        self.state = (ROOT / self.s.state_dir).resolve() if not self.s.state_dir.is_absolute() else self.s.state_dir
        self.logs = self.state / "logs"
        self.pids = self.state / "pids"
        self.python = sys.executable
        self.components = self._components()

    # --- component table -----------------------------------------------------------
    def service_env(self) -> dict[str, str]:
        """Environment shared by spanrl's Python services."""
        cache = str(self.s.cache_dir)
        return {
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "OMP_NUM_THREADS": env_value("OMP_NUM_THREADS", "1"),
            "TORCH_EXTENSIONS_DIR": f"{cache}/torch_extensions",
            "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor",
            "VLLM_CACHE_ROOT": f"{cache}/vllm",
            "SPANRL_CACHE_DIR": cache,
        }

    def _components(self) -> dict[str, Component]:
        s = self.s
        stack_settings = StackSettings()
        py = [self.python, "-m"]
        kafka_libs = s.cache_dir / f"kafka-{s.kafka_version}" / "libs"
        comps = [
            Component(
                "kafka",
                # the heap committed and touched at start (-Xms = -Xmx, AlwaysPreTouch), as Kafka's
                # docs advise: with -Xms256m the broker's RSS grew in steps towards -Xmx for an hour
                # (make soak, BENCHMARKS.md "Soak"), so its memory looked like a leak
                ["java", "-Xms768m", "-Xmx768m", "-XX:+AlwaysPreTouch", "-cp", f"{kafka_libs}/*", "kafka.Kafka",
                 str(self.state / "kafka" / "server.properties")],
                health=lambda: _tcp_open(s.host, s.kafka_port),
                prepare=self._prepare_kafka,
                after_start=self.create_topics,
                start_timeout_s=60,
            ),
            Component(
                "minio",
                [str(s.cache_dir / "bin" / "minio"), "server", str(self.state / "minio"),
                 "--address", f"{s.host}:{s.minio_port}",
                 "--console-address", f"{s.host}:{s.minio_console_port}", "--quiet"],
                env={"MINIO_ROOT_USER": s.minio_access_key,
                     "MINIO_ROOT_PASSWORD": s.minio_secret_key.get_secret_value(),
                     "MINIO_BROWSER": "off"},
                health=lambda: _http_ok(f"http://{s.minio_endpoint}/minio/health/live"),
                after_start=self.create_buckets,
                start_timeout_s=60,
            ),
            Component(
                "vllm",
                py + ["spanrl.infra.vllm_server", *vllm_args(s)],
                env={"VLLM_TARGET_DEVICE": "cpu", "VLLM_SERVER_DEV_MODE": "1",
                     "VLLM_CPU_KVCACHE_SPACE": env_value("VLLM_CPU_KVCACHE_SPACE", "2"),
                     "OMP_NUM_THREADS": stack_settings.vllm_threads},
                health=lambda: _http_ok(f"{s.vllm_url}/health"),
                start_timeout_s=300,
            ),
            Component("bridge", py + ["spanrl.producers.bridge", "--grpc-port", str(s.bridge_grpc_port)],
                      # the gRPC receiver binds before HTTP serves; its port is checked all the same
                      health=lambda: _http_ok(f"{s.bridge_url}/health") and (
                          not s.bridge_grpc_port or _tcp_open(s.host, s.bridge_grpc_port))),
            Component("proxy", py + ["spanrl.producers.proxy"],
                      health=lambda: _http_ok(f"{s.proxy_url}/health")),
            Component("stream", py + ["spanrl.stream_jobs.app", "worker", "-l", "info",
                                      "--web-host", s.host, "--web-port", str(s.faust_web_port)],
                      # ready = partitions assigned and tables recovered, not just the web server up
                      health=lambda: _http_ok(f"http://{s.host}:{s.faust_web_port}/spanrl/health/"),
                      start_timeout_s=120),
            Component("trainer", py + ["spanrl.trainer.train"],
                      env={"OMP_NUM_THREADS": stack_settings.trainer_threads,
                           # a new run trains on samples produced from now on, not on the
                           # samples of earlier runs kept in the topic (unless set)
                           "SPANRL_TRAINER_START": env_value("SPANRL_TRAINER_START", STACK_TRAINER_START)},
                      health=lambda: _http_ok(f"http://{s.host}:{s.trainer_port}/health"),
                      start_timeout_s=300),
            Component("reloader", py + ["spanrl.trainer.reloader"],
                      health=lambda: _http_ok(f"http://{s.host}:{s.reloader_port}/health")),
            Component("dashboard", py + ["spanrl.infra.dashboard"],
                      health=lambda: _http_ok(f"{s.dashboard_url}/health")),
        ]
        return {c.name: c for c in comps}

    # --- one-off set-up --------------------------------------------------------------
    def _prepare_kafka(self) -> None:
        s = self.s
        kdir = self.state / "kafka"
        data = kdir / "data"
        kdir.mkdir(parents=True, exist_ok=True)
        props = kdir / "server.properties"
        props.write_text("\n".join([
            "process.roles=broker,controller",
            "node.id=1",
            f"controller.quorum.voters=1@{s.host}:{s.kafka_controller_port}",
            f"listeners=PLAINTEXT://{s.host}:{s.kafka_port},CONTROLLER://{s.host}:{s.kafka_controller_port}",
            f"advertised.listeners=PLAINTEXT://{s.host}:{s.kafka_port}",
            "controller.listener.names=CONTROLLER",
            "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            f"log.dirs={data}",
            "num.partitions=1",
            "offsets.topic.replication.factor=1",
            "offsets.topic.num.partitions=4",
            "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1",
            "transaction.state.log.num.partitions=4",
            "group.initial.rebalance.delay.ms=0",
            "auto.create.topics.enable=true",
            "message.max.bytes=8388608",
            "log.retention.check.interval.ms=300000",
            "",
        ]))
        if not (data / "meta.properties").exists():
            libs = f"{s.cache_dir / f'kafka-{s.kafka_version}' / 'libs'}/*"
            subprocess.run(
                ["java", "-cp", libs, "kafka.tools.StorageTool", "format", "-t", _kafka_cluster_id(),
                 "-c", str(props)],
                check=True, capture_output=True,
            )

    def create_topics(self, extra: tuple[T.Topic, ...] = ()) -> None:
        """Create every topic of ``spanrl.schemas.topics.ALL`` (plus ``extra``) that is missing."""
        asyncio.run(ensure_topics(self.s.kafka_bootstrap, T.ALL + tuple(extra)))

    def create_buckets(self) -> None:
        """Create the checkpoint and payload buckets if missing."""
        from minio import Minio

        client = Minio(self.s.minio_endpoint, access_key=self.s.minio_access_key,
                       secret_key=self.s.minio_secret_key.get_secret_value(), secure=False)
        for bucket in (self.s.checkpoint_bucket, self.s.payload_bucket):
            if not client.bucket_exists(bucket):
                client.make_bucket(bucket)

    # --- process control ---------------------------------------------------------------
    def _pid(self, name: str) -> int | None:
        try:
            pid = int((self.pids / f"{name}.pid").read_text())
        except (OSError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return pid

    def running(self, name: str) -> bool:
        return self._pid(name) is not None

    def healthy(self, name: str) -> bool:
        return self.components[name].health()

    def start(self, name: str, extra_env: dict[str, str] | None = None) -> None:
        """Start one component (if it is already running and healthy, only its idempotent
        ``after_start`` set-up runs again: topics and buckets that are missing are created)
        and wait for its health.

        Raises StackError (with the tail of its log) if it exits or stays unhealthy.
        """
        comp = self.components[name]
        if self.running(name) and comp.health():
            if comp.after_start:  # idempotent set-up (missing topics, buckets): a stack started
                comp.after_start()  # before schemas/topics.py declared a topic gets it now
            return
        self.logs.mkdir(parents=True, exist_ok=True)
        self.pids.mkdir(parents=True, exist_ok=True)
        if comp.prepare:
            comp.prepare()
        env = child_env(self.service_env(), comp.env, extra_env)
        log = open(self.logs / f"{name}.log", "ab")
        proc = subprocess.Popen(comp.command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        (self.pids / f"{name}.pid").write_text(str(proc.pid))
        deadline = time.monotonic() + comp.start_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise StackError(f"{name} exited with {proc.returncode}; log {self.logs / (name + '.log')}:\n{self.tail(name)}")
            if comp.health():
                break
            time.sleep(0.5)
        else:
            raise StackError(f"{name} not healthy after {comp.start_timeout_s:.0f}s; log:\n{self.tail(name)}")
        if comp.after_start:
            comp.after_start()

    def stop(self, name: str, grace_s: float = 15.0) -> None:
        """Stop one component: SIGTERM to its process group, SIGKILL after ``grace_s``."""
        pid = self._pid(name)
        if pid is None:
            (self.pids / f"{name}.pid").unlink(missing_ok=True)
            return
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self._pid(name) is not None:
            _reap(pid)
            time.sleep(0.2)
        if self._pid(name) is not None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _reap(pid)
        (self.pids / f"{name}.pid").unlink(missing_ok=True)

    def up(self, names: list[str] | None = None, progress: Callable[[str], None] | None = None) -> None:
        """Start ``names`` (default: all) in dependency order. An undeclared ``SPANRL_*``
        variable in the environment (a misspelt setting) raises UnknownSetting first."""
        check_environment()
        for name in names or list(self.components):
            if progress:
                progress(name)
            self.start(name)

    def down(self, names: list[str] | None = None) -> None:
        """Stop ``names`` (default: all) in reverse dependency order."""
        for name in reversed(names or list(self.components)):
            self.stop(name)

    def status(self) -> list[tuple[str, bool, bool, str]]:
        """(name, running, healthy, endpoint) for every component."""
        s = self.s
        where = {"kafka": s.kafka_bootstrap, "minio": f"http://{s.minio_endpoint}", "vllm": s.vllm_url,
                 "bridge": f"{s.bridge_url} (OTLP/gRPC {s.bridge_grpc_endpoint})" if s.bridge_grpc_port
                 else s.bridge_url, "proxy": s.proxy_url,
                 "stream": f"http://{s.host}:{s.faust_web_port}", "trainer": f"http://{s.host}:{s.trainer_port}",
                 "reloader": f"http://{s.host}:{s.reloader_port}", "dashboard": s.dashboard_url}
        return [(n, self.running(n), self.healthy(n), where[n]) for n in self.components]

    def tail(self, name: str, lines: int = 40) -> str:
        path = self.logs / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def stop_process_group(proc: subprocess.Popen | None, grace_s: float = 20.0) -> None:
    """Stop a process started with ``start_new_session=True`` and everything it spawned:
    SIGTERM to its process group, SIGKILL after ``grace_s``. No-op if it already exited."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _kafka_cluster_id() -> str:
    """A random KRaft cluster id: 16 bytes, URL-safe base64 without padding, never starting
    with '-' (the StorageTool would read it as an option; Kafka's own Uuid avoids it too)."""
    import base64

    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


async def ensure_topics(bootstrap: str, wanted: tuple[T.Topic, ...]) -> None:
    """Create the topics of ``wanted`` that do not exist yet (Kafka CreateTopics API)."""
    from spanrl.producers.kafka import create_topics

    await create_topics(bootstrap, wanted)
