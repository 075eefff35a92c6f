"""The local spanrl stack: Kafka (KRaft), MinIO, a schema registry, vLLM and spanrl's own services.

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
from pydantic import SecretStr

from spanrl.core import shm
from spanrl.core.settings import (PROCESSED_LOGPROBS, STACK_TRAINER_START, Settings, StackSettings,
                                  check_environment, child_env, default_replication, env_value, get_settings)
from spanrl.infra import storage
from spanrl.schemas import topics as T

ROOT = Path(__file__).resolve().parent.parent


def vllm_args(s: Settings, root: Path = ROOT) -> list[str]:
    """The arguments of ``vllm.entrypoints.openai.api_server`` the stack starts vLLM with.

    fp32 and eager mode (the CPU build, DEVELOPERS.md); with ``s.vllm_tool_call_parser`` set,
    ``--enable-auto-tool-choice --tool-call-parser NAME`` (vLLM docs, "Tool Calling": without a
    parser vLLM refuses ``tools`` with ``tool_choice`` auto, required or named with 400); with
    ``s.vllm_chat_template`` set, ``--chat-template PATH`` (relative paths from ``root``); with
    ``s.rollout_temperature`` set, ``--logprobs-mode processed_logprobs`` (vLLM's log-probs are
    then those of the distribution it sampled from, after temperature, not of the raw logits:
    vllm/v1/sample/sampler.py, vLLM 0.32; a greedy call's are the raw ones either way).
    """
    args = ["--model", str(s.model_dir), "--served-model-name", s.model_name, "--host", s.host,
            "--port", str(s.vllm_port), "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "2048", "--disable-uvicorn-access-log"]
    if s.vllm_tool_call_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", s.vllm_tool_call_parser]
    if s.vllm_chat_template:
        args += ["--chat-template", str(root / s.vllm_chat_template)]
    if s.rollout_temperature is not None:
        args += ["--logprobs-mode", PROCESSED_LOGPROBS]
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
    #: components launched with this one when they are not running (a KRaft quorum serves
    #: only once a majority of its voters runs)
    peers: tuple[str, ...] = ()


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
        self.shm = self.state / "shm"
        self.python = sys.executable
        self.components = self._components()
        self._credentials_checked = False

    # --- component table -----------------------------------------------------------
    def service_env(self) -> dict[str, str]:
        """Environment shared by spanrl's Python services. ``PYTHONPATH``: the checkout, then the
        caller's (where a user's agent spec and runner live: the release gate's agent)."""
        cache = str(self.s.cache_dir)
        return {
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env_value("PYTHONPATH", "")) if p),
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
        nodes = kafka_node_names(s.kafka_brokers)
        comps = [
            Component(
                name,
                # the heap committed and touched at start (-Xms = -Xmx, AlwaysPreTouch), as Kafka's
                # docs advise: with -Xms256m the broker's RSS grew in steps towards -Xmx for an hour
                # (make soak, docs/measured/faults.md), so its memory looked like a leak
                ["java", "-Xms768m", "-Xmx768m", "-XX:+AlwaysPreTouch", "-cp", f"{kafka_libs}/*", "kafka.Kafka",
                 str(self.kafka_dir(i + 1) / "server.properties")],
                health=lambda port=port: _tcp_open(s.host, port),
                prepare=lambda node=i + 1: self._prepare_kafka(node),
                # topics once the last broker serves (replication factor 3 needs all three)
                after_start=self.create_topics if name == nodes[-1] else None,
                start_timeout_s=60 if len(nodes) == 1 else 120,
                peers=tuple(n for n in nodes if n != name),
            )
            for i, (name, port) in enumerate(zip(nodes, s.kafka_ports))
        ] + [
            Component(
                "minio",
                [str(s.cache_dir / "bin" / "minio"), "server", str(self.state / "minio"),
                 "--address", f"{s.host}:{s.minio_port}",
                 "--console-address", f"{s.host}:{s.minio_console_port}", "--quiet"],
                env={"MINIO_ROOT_USER": s.minio_access_key,
                     "MINIO_ROOT_PASSWORD": s.minio_secret_key.get_secret_value(),
                     "MINIO_BROWSER": "off",
                     # a deleted object is moved to .minio.sys/tmp/.trash and purged every 5 min
                     # by default: `make test` held 2.1 GiB of deleted checkpoints there
                     "MINIO_API_DELETE_CLEANUP_INTERVAL": MINIO_TRASH_PURGE_INTERVAL},
                health=lambda: _http_ok(f"http://{s.minio_endpoint}/minio/health/live"),
                after_start=self.create_buckets,
                start_timeout_s=60,
            ),
            Component(
                "schema-registry",
                # Apicurio Registry's Quarkus distribution (infra/bootstrap.sh), schemas in memory
                # (registered again at each start, with the same ids: spanrl/core/schema_registry.py);
                # its management interface (health, metrics) moved off Quarkus's 0.0.0.0:9000
                [str(self.registry_dir / "java"), "-Xms256m", "-Xmx512m",
                 f"-Dquarkus.http.host={s.host}", f"-Dquarkus.http.port={s.schema_registry_port}",
                 f"-Dquarkus.management.host={s.host}", f"-Dquarkus.management.port={s.schema_registry_port + 1}",
                 "-jar", str(self.registry_dir / "quarkus-run.jar")],
                health=lambda: _http_ok(f"{self.registry_local_url}/subjects"),
                prepare=self._check_registry_install,
                after_start=self.register_schemas,
                start_timeout_s=120,
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
        ] + [
            Component(name, py + ["spanrl.producers.bridge", "--port", str(port), "--grpc-port", str(grpc)],
                      # the gRPC receiver binds before HTTP serves; its port is checked all the same
                      health=lambda url=url, grpc=grpc: _http_ok(f"{url}/health") and (
                          not grpc or _tcp_open(s.host, grpc)))
            for name, port, grpc, url in zip(replica_names("bridge", s.bridge_replicas), s.bridge_ports,
                                             s.bridge_grpc_ports, s.bridge_urls)
        ] + [
            Component("proxy", py + ["spanrl.producers.proxy"],
                      health=lambda: _http_ok(f"{s.proxy_url}/health")),
        ] + [
            # workers of one consumer group (the app id): Kafka splits the partitions between them
            Component(name, py + ["spanrl.stream_jobs.app", "--datadir", str(self.state / "stream" / name),
                                  "worker", "-l", "info", "--web-host", s.host, "--web-port", str(port)],
                      # ready = partitions assigned and tables recovered, not just the web server up
                      health=lambda port=port: _http_ok(f"http://{s.host}:{port}/spanrl/health/"),
                      prepare=lambda name=name: (self.state / "stream" / name).mkdir(parents=True, exist_ok=True),
                      start_timeout_s=120)
            for name, port in zip(replica_names("stream", s.stream_workers), s.faust_web_ports)
        ] + [
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
    def kafka_dir(self, node: int) -> Path:
        """Node ``node``'s directory (properties, data): ``<state>/kafka`` for the one-broker
        stack, ``<state>/kafka-cluster/node<i>`` for a cluster (its own metadata: a cluster's
        voters are not the single broker's)."""
        if self.s.kafka_brokers == 1:
            return self.state / "kafka"
        return self.state / "kafka-cluster" / f"node{node}"

    def _prepare_kafka(self, node: int = 1) -> None:
        s = self.s
        kdir = self.kafka_dir(node)
        data = kdir / "data"
        kdir.mkdir(parents=True, exist_ok=True)
        props = kdir / "server.properties"
        props.write_text(kafka_server_properties(node, s.host, s.kafka_ports, s.kafka_controller_ports, data))
        if not (data / "meta.properties").exists():
            if s.kafka_brokers == 1:
                cid = _kafka_cluster_id()
            else:  # one id for every node of the cluster, chosen by whichever is formatted first
                id_file = kdir.parent / "cluster_id"
                if not id_file.exists():
                    id_file.write_text(_kafka_cluster_id())
                cid = id_file.read_text().strip()
            libs = f"{s.cache_dir / f'kafka-{s.kafka_version}' / 'libs'}/*"
            subprocess.run(
                ["java", "-cp", libs, "kafka.tools.StorageTool", "format", "-t", cid, "-c", str(props)],
                check=True, capture_output=True,
            )

    def create_topics(self, extra: tuple[T.Topic, ...] = ()) -> None:
        """Create every topic of ``spanrl.schemas.topics.ALL`` (plus ``extra``) that is missing."""
        from aiokafka.errors import KafkaError

        deadline = time.monotonic() + 60
        while True:  # a cluster's last brokers may still be registering with the controller
            try:
                asyncio.run(ensure_topics(self.s.kafka_bootstrap, T.ALL + tuple(extra),
                                          self.s.kafka_replication_factor))
                return
            except KafkaError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)

    @property
    def registry_dir(self) -> Path:
        """Where infra/bootstrap.sh unpacked Apicurio Registry (with ``java``: a link to a Java >= 21)."""
        return self.s.cache_dir / f"apicurio-registry-{self.s.schema_registry_version}"

    @property
    def registry_local_url(self) -> str:
        """The Confluent-compatible API of the stack's own registry process."""
        return f"http://{self.s.host}:{self.s.schema_registry_port}/apis/ccompat/v7"

    def _check_registry_install(self) -> None:
        for need, what in ((self.registry_dir / "quarkus-run.jar", "Apicurio Registry"),
                           (self.registry_dir / "java", "a link to a Java >= 21")):
            if not need.exists():
                raise StackError(f"schema-registry: {need} ({what}) missing: run `make bootstrap` "
                                 "(it needs a Java >= 21: Temurin 21 or newer, or the distribution's openjdk-21)")

    def register_schemas(self) -> None:
        """Register every schema of ``schemas/avro`` with ``SPANRL_SCHEMA_COMPATIBILITY``
        (spanrl/core/schema_registry.py); StackError when the registry gives other ids than the
        committed ones (records would name schemas the registry holds under other ids)."""
        from spanrl.core import schema_registry

        wrong = schema_registry.register(self.registry_local_url, self.s.schema_compatibility)
        if wrong:
            raise StackError("schema-registry assigned other ids than schemas/avro/registry_ids.json (a registry "
                             "that held other schemas first?):\n  " + "\n  ".join(wrong))

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
        if shm.is_zombie(shm.PROC / str(pid)):  # killed, not yet reaped by a parent that is not this process
            return None
        return pid

    def running(self, name: str) -> bool:
        return self._pid(name) is not None

    def healthy(self, name: str) -> bool:
        return self.components[name].health()

    def start(self, name: str, extra_env: dict[str, str] | None = None) -> None:
        """Start one component and wait for its health; its ``peers`` that are not running are
        launched with it. If it is already running (or was launched as a peer), wait for its
        health; only its idempotent ``after_start`` set-up runs again (topics and buckets that
        are missing are created).

        Raises StackError (with the tail of its log) if it exits or stays unhealthy.
        """
        comp = self.components[name]
        self.ensure_credentials()
        if self.running(name):
            self._wait_healthy(name, None)
            if comp.after_start:  # idempotent set-up (missing topics, buckets): a stack started
                comp.after_start()  # before schemas/topics.py declared a topic gets it now
            return
        proc = self._launch(name, extra_env)
        for peer in comp.peers:
            if not self.running(peer):
                self._launch(peer)
        self._wait_healthy(name, proc)
        self.record_segments(name, proc.pid)
        if comp.after_start:
            comp.after_start()

    def _launch(self, name: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``name``'s process (its own session and process group) without waiting."""
        comp = self.components[name]
        self.logs.mkdir(parents=True, exist_ok=True)
        self.pids.mkdir(parents=True, exist_ok=True)
        self.release_segments(name)  # what a killed earlier instance left in /dev/shm
        if comp.prepare:
            comp.prepare()
        env = child_env(self.service_env(), comp.env, extra_env)
        log = open(self.logs / f"{name}.log", "ab")
        proc = subprocess.Popen(comp.command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        (self.pids / f"{name}.pid").write_text(str(proc.pid))
        return proc

    def _wait_healthy(self, name: str, proc: subprocess.Popen | None) -> None:
        comp = self.components[name]
        deadline = time.monotonic() + comp.start_timeout_s
        while time.monotonic() < deadline:
            if comp.health():
                return
            if proc is not None and proc.poll() is not None:
                raise StackError(f"{name} exited with {proc.returncode}; log {self.logs / (name + '.log')}:\n{self.tail(name)}")
            if proc is None and not self.running(name):
                raise StackError(f"{name} exited; log {self.logs / (name + '.log')}:\n{self.tail(name)}")
            time.sleep(0.5)
        raise StackError(f"{name} not healthy after {comp.start_timeout_s:.0f}s; log:\n{self.tail(name)}")

    def record_segments(self, name: str, pgid: int) -> set[str]:
        """Write the /dev/shm segments component ``name`` (process group ``pgid``) maps now to
        ``<state_dir>/shm/<name>`` (one name per line), for :meth:`release_segments`."""
        names = shm.group_segments(pgid) if shm.SHM_DIR.is_dir() else set()
        self.shm.mkdir(parents=True, exist_ok=True)
        (self.shm / name).write_text("".join(f"{n}\n" for n in sorted(names)))
        return names

    def release_segments(self, name: str) -> tuple[int, int]:
        """Unlink the segments recorded for ``name`` that no live process maps any more (vLLM's
        message queues outlive a SIGKILL: 400 MiB of RAM per killed vLLM otherwise; see
        spanrl/core/shm.py). Returns ``(segments, bytes)`` removed."""
        path = self.shm / name
        if not path.exists():
            return 0, 0
        names = path.read_text().split()
        removed = shm.release_unmapped(names)
        still = [n for n in names if (shm.SHM_DIR / n).exists()]  # mapped by a process not yet gone
        if still:
            path.write_text("".join(f"{n}\n" for n in still))
        else:
            path.unlink()
        return removed

    def stop(self, name: str, grace_s: float = 15.0) -> None:
        """Stop one component: SIGTERM to its process group, SIGKILL after ``grace_s``."""
        pid = self._pid(name)
        if pid is None:
            self._stopped(name)
            return
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        # the leader gone is not enough: its children (vLLM's engine, a trainer's ranks) too
        while time.monotonic() < deadline and (self._pid(name) is not None or shm.group_alive(pid)):
            _reap(pid)
            time.sleep(0.2)
        if self._pid(name) is not None or shm.group_alive(pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _reap(pid)
        self._stopped(name)

    def _stopped(self, name: str) -> None:
        """What a stopped component leaves that the stack removes: its pid file, its unmapped
        /dev/shm segments, MinIO's trash."""
        (self.pids / f"{name}.pid").unlink(missing_ok=True)
        self.release_segments(name)
        if name == "minio":
            self.empty_minio_trash()

    def empty_minio_trash(self) -> int:
        """Delete what a stopped MinIO left in its trash (``.minio.sys/tmp/.trash``: deleted
        objects it had not purged yet; it purges them only while it runs). Returns bytes freed;
        0 while MinIO runs (the trash is its own then)."""
        trash = self.state / "minio" / storage.MINIO_TRASH
        if self.running("minio") or not trash.is_dir():
            return 0
        return storage.empty_dir(trash)

    def up(self, names: list[str] | None = None, progress: Callable[[str], None] | None = None) -> None:
        """Start ``names`` (default: all) in dependency order. An undeclared ``SPANRL_*``
        variable in the environment (a misspelt setting) raises UnknownSetting first."""
        check_environment()
        for name in self.with_replicas(names or list(self.components)):
            if progress:
                progress(name)
            self.start(name)

    def ensure_credentials(self) -> list[str]:
        """Before the first component starts: with auth on, make the secrets the state directory
        lacks (spanrl/core/credentials.py; the agent and administrator tokens printed once, when
        made) and give them to this process's settings; open: say so. Returns the names made."""
        from spanrl.core import credentials

        if self._credentials_checked:
            return []
        self._credentials_checked = True
        if self.s.auth == "open":
            print("*** SPANRL_AUTH=open: the stack checks no credential; anyone who reaches "
                  f"{self.s.host} may use and train the model (a laptop demo only) ***", file=sys.stderr)
            return []
        made = credentials.ensure_secrets(self.state)
        for field, name in (("auth_token", credentials.AGENT_TOKEN), ("admin_token", credentials.ADMIN_TOKEN)):
            if getattr(self.s, field) is None:  # the settings were read before the secrets existed
                setattr(self.s, field, SecretStr(credentials.read_secret(self.state, name) or ""))
        if made:
            lines = [f"  {name}: {credentials.read_secret(self.state, name)}" for name in made
                     if name != credentials.CHECKPOINT_KEY]
            print(f"spanrl: made the stack's secrets in {credentials.secrets_dir(self.state)} (mode 0600; the tokens "
                  "are shown this once):", *lines,
                  "  clients on this machine read them from there (docs/operations.md, Credentials)",
                  sep="\n", file=sys.stderr)
        return made

    def down(self, names: list[str] | None = None) -> None:
        """Stop ``names`` (default: all) in reverse dependency order."""
        for name in reversed(self.with_replicas(names or list(self.components))):
            self.stop(name)
        if not names:
            for name in self.strays():
                self.stop(name)

    def with_replicas(self, names: list[str]) -> list[str]:
        """``names`` with ``kafka``, ``stream`` and ``bridge`` standing for all their replicas
        (``kafka``, ``kafka2``, ...: a cluster's nodes start and stop together, topics are
        created once the last serves; ``stream``, ``stream2``, ...: the workers)."""
        s = self.s
        groups = {"kafka": kafka_node_names(s.kafka_brokers), "stream": replica_names("stream", s.stream_workers),
                  "bridge": replica_names("bridge", s.bridge_replicas)}
        out: list[str] = []
        for n in names:
            for m in groups.get(n, [n]):
                if m not in out:
                    out.append(m)
        return out

    def strays(self) -> list[str]:
        """Components with a pid file that this stack's layout does not have (a stack started
        with more brokers, workers or bridges than the settings now say): ``down`` stops them."""
        return sorted(p.stem for p in self.pids.glob("*.pid") if p.stem not in self.components) \
            if self.pids.is_dir() else []

    def status(self) -> list[tuple[str, bool, bool, str]]:
        """(name, running, healthy, endpoint) for every component."""
        s = self.s
        where = {**{n: f"{s.host}:{p}" for n, p in zip(kafka_node_names(s.kafka_brokers), s.kafka_ports)},
                 **{n: f"{url} (OTLP/gRPC http://{s.host}:{grpc})" if grpc else url
                    for n, url, grpc in zip(replica_names("bridge", s.bridge_replicas), s.bridge_urls,
                                            s.bridge_grpc_ports)},
                 **{n: f"http://{s.host}:{p}" for n, p in zip(replica_names("stream", s.stream_workers),
                                                              s.faust_web_ports)},
                 "minio": f"http://{s.minio_endpoint}", "vllm": s.vllm_url, "proxy": s.proxy_url,
                 "schema-registry": self.registry_local_url,
                 "trainer": f"http://{s.host}:{s.trainer_port}",
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


#: how often the stack's MinIO purges deleted objects from its trash (Go duration; MinIO's
#: ``MINIO_API_DELETE_CLEANUP_INTERVAL``, default 5m)
MINIO_TRASH_PURGE_INTERVAL = "20s"


def replica_names(base: str, n: int) -> list[str]:
    """The stack's component names of ``n`` replicas of ``base``: ``base`` (the first), ``base2``, ..."""
    return [base] + [f"{base}{i}" for i in range(2, n + 1)]


def kafka_node_names(brokers: int) -> list[str]:
    """The stack's component names of ``brokers`` Kafka nodes: ``kafka`` (node 1), ``kafka2``, ..."""
    return replica_names("kafka", brokers)


def kafka_server_properties(node: int, host: str, ports: list[int], controller_ports: list[int], data: Path) -> str:
    """``server.properties`` of KRaft node ``node`` (1-based) of ``len(ports)`` combined
    broker + controller nodes on ``host``: every node a voter; on one node replication factor
    1; on three or more, replication factor 3 for the internal topics and by default, and
    ``min.insync.replicas`` 2 (with acks=all a write survives the loss of one broker; Kafka's
    docs, "Replication")."""
    rf = default_replication(len(ports))
    isr = 1 if rf == 1 else 2
    port, cport = ports[node - 1], controller_ports[node - 1]
    voters = ",".join(f"{i + 1}@{host}:{p}" for i, p in enumerate(controller_ports))
    return "\n".join([
        "process.roles=broker,controller",
        f"node.id={node}",
        f"controller.quorum.voters={voters}",
        f"listeners=PLAINTEXT://{host}:{port},CONTROLLER://{host}:{cport}",
        f"advertised.listeners=PLAINTEXT://{host}:{port}",
        "controller.listener.names=CONTROLLER",
        "inter.broker.listener.name=PLAINTEXT",
        "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        f"log.dirs={data}",
        "num.partitions=1",
        f"default.replication.factor={rf}",
        f"min.insync.replicas={isr}",
        f"offsets.topic.replication.factor={rf}",
        "offsets.topic.num.partitions=4",
        f"transaction.state.log.replication.factor={rf}",
        f"transaction.state.log.min.isr={isr}",
        "transaction.state.log.num.partitions=4",
        "group.initial.rebalance.delay.ms=0",
        "auto.create.topics.enable=true",
        "message.max.bytes=8388608",
        "log.retention.check.interval.ms=300000",
        "",
    ])


def _kafka_cluster_id() -> str:
    """A random KRaft cluster id: 16 bytes, URL-safe base64 without padding, never starting
    with '-' (the StorageTool would read it as an option; Kafka's own Uuid avoids it too)."""
    import base64

    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


async def ensure_topics(bootstrap: str, wanted: tuple[T.Topic, ...], replication_factor: int = 1) -> None:
    """Create the topics of ``wanted`` that do not exist yet (Kafka CreateTopics API), with
    ``replication_factor`` replicas (and min.insync.replicas 2 when > 1)."""
    from spanrl.producers.kafka import create_topics

    await create_topics(bootstrap, wanted, replication_factor)
