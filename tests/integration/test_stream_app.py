"""The stream app end to end against the real Kafka and MinIO (spanrl.core.settings).

Runs ``python -m spanrl.stream_jobs.app worker`` as a subprocess on private topics
(``sjtest-<uuid>-*``) and a private app id:

- 2 tasks x 2 rollouts x 2 LLM calls (+ a tool span, a re-delivered span, one
  undecodable record): exactly what reaches transitions, samples and dead-letter;
- a span above the spans topic's limit posted to the OTLP bridge (``python -m
  spanrl.producers.bridge``): claim-checked into MinIO, resolved by the worker, full token ids
  in the transition; claims to a missing or altered object -> ``claim_unresolved``;
- a worker SIGKILLed with a call pending: the restarted worker recovers its tables
  from the changelogs and emits the call;
- a real ``openai`` client instrumented only by OpenInference's OpenAI instrumentor (a plain
  TracerProvider exporting to the bridge, no spanrl rollout context) calling the proxy
  (``python -m spanrl.producers.proxy``, the stack's vLLM behind it): its spans join the call's
  rollout by trace id, one transition, and a trace without a proxy call ends ``no_rollout_id``;
- late rewards: attempts parked after a 2 s reward timeout (token data out of the calls
  table), a reward that comes later re-reads the spans (a claim among them), a span deleted
  meanwhile -> ``late_spans_missing``, no reward within the window -> ``no_reward_before_window``.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import hashlib
import io
import os
import signal

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue

from spanrl.core import claims
from spanrl.infra.stack import Stack, stop_process_group
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from spanrl.core.settings import get_settings
from spanrl.schemas import codec, topics
from tests.integration.services import private_env

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
EPS = 1e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _span(rid, seq, sid, kind="llm", prompt=(1, 2), completion=(3, 4)):
    return {
        "rollout_id": rid, "attempt_id": "a0", "sequence_id": seq, "trace_id": "t" * 32,
        "span_id": sid, "name": "chat" if kind == "llm" else "tool", "kind": kind,
        "source": "proxy" if kind == "llm" else "otlp", "start_time_unix_nano": seq,
        "end_time_unix_nano": seq + 1, "agent_name": "solver",
        "llm": None if kind != "llm" else {
            "model": "policy", "policy_version": 0, "prompt_token_ids": list(prompt),
            "completion_token_ids": list(completion), "completion_logprobs": [-0.5] * len(completion),
            "request_id": f"req-{sid}"},
    }


def _rollout_event(rid, task, status):
    return {"rollout_id": rid, "attempt_id": "a0", "task_id": task, "status": status,
            "group_size": 2, "timestamp_ms": 1}


async def _run(names: dict[str, str], web_port: int, proc: subprocess.Popen, deadline: float):
    bootstrap = get_settings().kafka_bootstrap
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    returns = {("task-a", "ra1"): 1.0, ("task-a", "ra2"): 0.0,
               ("task-b", "rb1"): 2.0, ("task-b", "rb2"): 0.0}
    try:
        for (task, rid), R in returns.items():
            key = rid.encode()
            # out of order on purpose: lifecycle end first, calls in reverse order
            await producer.send_and_wait(names["rollouts"], codec.encode("rollout", _rollout_event(rid, task, "started")), key=key)
            await producer.send_and_wait(names["spans"], codec.encode("span", _span(rid, 2, f"{rid}-c2", completion=(7, 8, 9))), key=key)
            await producer.send_and_wait(names["spans"], codec.encode("span", _span(rid, 1, f"{rid}-tool", kind="tool")), key=key)
            await producer.send_and_wait(names["spans"], codec.encode("span", _span(rid, 0, f"{rid}-c0")), key=key)
            await producer.send_and_wait(names["spans"], codec.encode("span", _span(rid, 0, f"{rid}-c0")), key=key)  # re-delivered
            await producer.send_and_wait(names["rollouts"], codec.encode("rollout", _rollout_event(rid, task, "succeeded")), key=key)
            await producer.send_and_wait(names["rewards"], codec.encode("reward", {
                "rollout_id": rid, "attempt_id": "a0", "value": R, "final": True, "timestamp_ms": 2}), key=key)
        await producer.send_and_wait(names["spans"], b"not avro at all", key=b"rbad")
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(names["transitions"], names["samples"], names["dead-letter"],
                                bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                isolation_level="read_committed", group_id=None)
    await consumer.start()
    got = {"transitions": [], "samples": [], "dead-letter": []}
    by_topic = {names[k]: k for k in got}
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "worker died"
            batch = await consumer.getmany(timeout_ms=500)
            for tp, msgs in batch.items():
                kind = by_topic[tp.topic]
                for m in msgs:
                    record = codec.decode({"transitions": "transition", "samples": "sample",
                                           "dead-letter": "dead_letter"}[kind], m.value)
                    got[kind].append((m.key, record))
            if len(got["transitions"]) >= 8 and len(got["samples"]) >= 8 and got["dead-letter"]:
                await asyncio.sleep(2)  # anything extra would show up now
                for tp, msgs in (await consumer.getmany(timeout_ms=1000)).items():
                    got[by_topic[tp.topic]] += [(m.key, None) for m in msgs]
                break
    finally:
        await consumer.stop()
    counters = json.loads(urllib.request.urlopen(
        f"http://127.0.0.1:{web_port}/spanrl/counters/", timeout=5).read())
    return got, counters, returns


async def _admin(op, names, app_id=None):
    admin = AIOKafkaAdminClient(bootstrap_servers=get_settings().kafka_bootstrap)
    await admin.start()
    try:
        if op == "create":
            base = {"spans": topics.SPANS, "rewards": topics.REWARDS, "rollouts": topics.ROLLOUTS,
                    "transitions": topics.TRANSITIONS, "samples": topics.SAMPLES,
                    "dead-letter": topics.DEAD_LETTER, "orphan-spans": topics.ORPHAN_SPANS}
            await admin.create_topics([NewTopic(names[k], t.partitions, 1, topic_configs=t.config())
                                       for k, t in base.items()])
        else:
            existing = await admin.list_topics()
            doomed = [t for t in existing if t in names.values() or (app_id and t.startswith(app_id))]
            if doomed:
                await admin.delete_topics(doomed)
    finally:
        await admin.close()


@pytest.fixture(scope="module")
def kafka_minio(settings):
    """The stack's Kafka and MinIO (started like ``make up`` starts them, if missing)."""
    st = Stack(settings)
    st.up(["kafka", "minio"])
    return st


def test_stream_app_end_to_end(tmp_path, kafka_minio):
    suffix = uuid.uuid4().hex[:8]
    names = _names(suffix)
    app_id = f"sjtest-stream-{suffix}"
    web_port = _free_port()
    asyncio.run(_admin("create", names))
    env = {**os.environ, "SPANRL_STREAM_APP_ID": app_id, "SPANRL_FAUST_WEB_PORT": str(web_port),
           "SPANRL_SPANS_TOPIC": names["spans"], "SPANRL_REWARDS_TOPIC": names["rewards"],
           "SPANRL_ROLLOUTS_TOPIC": names["rollouts"], "SPANRL_TRANSITIONS_TOPIC": names["transitions"],
           "SPANRL_SAMPLES_TOPIC": names["samples"], "SPANRL_DEAD_LETTER_TOPIC": names["dead-letter"],
           "SPANRL_CALL_ACCOUNTS_TOPIC": names["call-accounts"], "SPANRL_ORPHAN_SPANS_TOPIC": names["orphan-spans"],
           "SPANRL_REWARD_TIMEOUT_S": "30", "SPANRL_GROUP_TIMEOUT_S": "60"}
    log = open(tmp_path / "worker.log", "wb")
    # cwd: Faust writes <app_id>-data into the working directory
    proc = subprocess.Popen([sys.executable, "-m", "spanrl.stream_jobs.app", "worker", "-l", "info"],
                            cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        got, counters, returns = asyncio.run(_run(names, web_port, proc, time.monotonic() + 80))
    finally:
        stop_process_group(proc, grace_s=15)
        log.close()
        try:
            asyncio.run(_admin("delete", names, app_id))
        except Exception:
            pass
    worker_log = (tmp_path / "worker.log").read_text(errors="replace")[-4000:]

    # transitions: 4 rollouts x 2 calls, each rollout in call order, reward = R (identical credit)
    trs = got["transitions"]
    assert len(trs) == 8, (counters, got["dead-letter"], worker_log)
    by_rollout: dict[str, list[dict]] = {}
    for key, t in trs:
        assert key == t["task_id"].encode()
        by_rollout.setdefault(t["rollout_id"], []).append(t)
    for (task, rid), R in returns.items():
        ts = by_rollout[rid]
        assert [t["span_id"] for t in ts] == [f"{rid}-c0", f"{rid}-c2"]
        assert [t["call_index"] for t in ts] == [0, 1]
        assert all(t["task_id"] == task and t["rollout_transition_count"] == 2 for t in ts)
        assert [t["reward"] for t in ts] == [R, R]
        assert [t["episode_return"] for t in ts] == [R, R]
        assert ts[1]["completion_token_ids"] == [7, 8, 9]
        assert ts[1]["behaviour_logprobs"] == [-0.5, -0.5, -0.5]
        assert all(t["status"] == "succeeded" and t["credit_rule"] == "identical" for t in ts)

    # samples: GRPO inside each task, population std
    samples = got["samples"]
    assert len(samples) == 8, worker_log
    adv = {("task-a", "ra1"): 0.5 / (0.5 + EPS), ("task-a", "ra2"): -0.5 / (0.5 + EPS),
           ("task-b", "rb1"): 1.0 / (1.0 + EPS), ("task-b", "rb2"): -1.0 / (1.0 + EPS)}
    for key, s in samples:
        t = s["transition"]
        assert key == t["task_id"].encode()
        assert s["group_id"] == f"{t['task_id']}/0"
        assert s["group_rollouts"] == 2
        assert s["advantage"] == pytest.approx(adv[(t["task_id"], t["rollout_id"])], abs=1e-12)
        assert (s["group_mean"], s["group_std"]) == ((0.5, 0.5) if t["task_id"] == "task-a" else (1.0, 1.0))

    # dead letters: exactly the undecodable record
    dead = got["dead-letter"]
    assert len(dead) == 1, dead
    key, d = dead[0]
    assert d["reason"] == "schema_error" and d["stage"] == "assembler"
    assert d["source_topic"] == names["spans"] and d["payload"] == b"not avro at all"
    assert d["rollout_id"] == "rbad" and d["source_offset"] is not None

    assert counters == {"spans_in": 17, "rewards_in": 4, "rollout_events_in": 8,
                        "transitions_out": 8, "samples_out": 8,
                        "dead_letters_out": {"schema_error": 1},
                        "call_accounts_out": 4, "calls_by_agent": {"solver|trained": 8},
                        # the test's spans have no trace parent: no trace links, nothing joined
                        "trace_links_out": 0, "trace_links_in": 0, "orphans_in": 0, "spans_joined": 0,
                        # no terminal event says inputs_acked: all let out by the settle time
                        "inputs_bounds_read": 0, "emitted_by": {"settle_s": 4},
                        "attempts_parked": 0, "spans_reread": 0, "late_rewards_emitted": 0, "calls_held": 0,
                        "transitions_held": 0, "transitions_reread": 0, "rollouts_evicted": 0, "tasks_evicted": 0}


# ---------------------------------------------------------------- helpers of the tests below
def _names(suffix: str) -> dict[str, str]:
    """Private topics ``sjtest-<suffix>-<name>``: the bridge's ``--topic-prefix sjtest-<suffix>-``
    writes the same names."""
    return {k: f"sjtest-{suffix}-{k}" for k in
            ("spans", "rewards", "rollouts", "transitions", "samples", "dead-letter", "call-accounts",
             "orphan-spans")}


def _start_worker(names: dict, app_id: str, web_port: int, log_path: Path, **extra: str) -> subprocess.Popen:
    env = {**os.environ, "SPANRL_STREAM_APP_ID": app_id, "SPANRL_FAUST_WEB_PORT": str(web_port),
           "SPANRL_SPANS_TOPIC": names["spans"], "SPANRL_REWARDS_TOPIC": names["rewards"],
           "SPANRL_ROLLOUTS_TOPIC": names["rollouts"], "SPANRL_TRANSITIONS_TOPIC": names["transitions"],
           "SPANRL_SAMPLES_TOPIC": names["samples"], "SPANRL_DEAD_LETTER_TOPIC": names["dead-letter"],
           "SPANRL_CALL_ACCOUNTS_TOPIC": names["call-accounts"], "SPANRL_ORPHAN_SPANS_TOPIC": names["orphan-spans"],
           "SPANRL_SETTLE_S": "1", "PYTHONPATH": str(REPO), **extra}
    # cwd: Faust writes <app_id>-data into the working directory
    return subprocess.Popen([sys.executable, "-m", "spanrl.stream_jobs.app", "worker", "-l", "info"],
                            cwd=log_path.parent, env=env, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop_and_delete(procs: list[subprocess.Popen], names: dict, app_id: str) -> None:
    """Stop the test's processes, then delete its topics (best effort)."""
    for proc in procs:
        stop_process_group(proc, grace_s=15)
    try:
        asyncio.run(_admin("delete", names, app_id))
    except Exception:
        pass


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{proc.args} exited {proc.returncode}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not up after {timeout_s}s")


def _counters(web_port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{web_port}/spanrl/counters/", timeout=5).json()


async def _produce(records: list[tuple[str, str, bytes]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=get_settings().kafka_bootstrap,
                                max_request_size=8 << 20)
    await producer.start()
    try:
        for topic, key, value in records:
            await producer.send_and_wait(topic, value, key=key.encode())
    finally:
        await producer.stop()


async def _read(names: dict, kinds: tuple[str, ...], done, timeout_s: float) -> dict[str, list[dict]]:
    """Decoded records of ``names[kind]`` topics (read_committed) until ``done(got)``."""
    record = {"spans": "span", "transitions": "transition", "samples": "sample", "dead-letter": "dead_letter",
              "call-accounts": "call_account"}
    consumer = AIOKafkaConsumer(*(names[k] for k in kinds), bootstrap_servers=get_settings().kafka_bootstrap,
                                auto_offset_reset="earliest", isolation_level="read_committed",
                                group_id=None, fetch_max_bytes=16 << 20, max_partition_fetch_bytes=16 << 20)
    await consumer.start()
    got: dict[str, list] = {k: [] for k in kinds}
    by_topic = {names[k]: k for k in kinds}
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not done(got):
            for tp, msgs in (await consumer.getmany(timeout_ms=500)).items():
                kind = by_topic[tp.topic]
                got[kind] += [{**codec.decode(record[kind], m.value), "_size": len(m.value)} for m in msgs]
    finally:
        await consumer.stop()
    return got


async def _committed(group: str, topic: str) -> int:
    """Offsets of ``topic`` the consumer group committed, summed over partitions."""
    admin = AIOKafkaAdminClient(bootstrap_servers=get_settings().kafka_bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    return sum(max(0, m.offset) for tp, m in offsets.items() if tp.topic == topic)


def _lifecycle(names: dict, rid: str, status: str, group_size: int = 1) -> tuple[str, str, bytes]:
    return (names["rollouts"], rid, codec.encode("rollout", {
        "rollout_id": rid, "attempt_id": "a0", "task_id": f"task-{rid}", "status": status,
        "group_size": group_size, "timestamp_ms": 1}))


def _reward(names: dict, rid: str, value: float) -> tuple[str, str, bytes]:
    return (names["rewards"], rid, codec.encode("reward", {
        "rollout_id": rid, "attempt_id": "a0", "value": value, "final": True, "timestamp_ms": 2}))


def _ints(values: list) -> AnyValue:
    return AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=v) for v in values]))


def _otlp_llm_span(rid: str, prompt: list[int], completion: list[int], logprobs: list[float],
                   prompt_text: str) -> bytes:
    """An OTLP request with one LLM span carrying its token ids (spanrl.llm.*) and a
    (large) prompt text attribute."""
    req = ExportTraceServiceRequest()
    s = req.resource_spans.add().scope_spans.add().spans.add()
    s.trace_id, s.span_id, s.name = b"\1" * 16, b"\3" * 8, "chat policy"
    s.start_time_unix_nano, s.end_time_unix_nano = 1, 2
    attrs = {"spanrl.rollout_id": AnyValue(string_value=rid), "spanrl.attempt_id": AnyValue(string_value="a0"),
             "spanrl.sequence_id": AnyValue(int_value=0), "spanrl.agent_name": AnyValue(string_value="solver"),
             "gen_ai.operation.name": AnyValue(string_value="chat"),
             "gen_ai.request.model": AnyValue(string_value="policy"),
             "gen_ai.prompt": AnyValue(string_value=prompt_text),
             "spanrl.llm.prompt_token_ids": _ints(prompt), "spanrl.llm.completion_token_ids": _ints(completion),
             "spanrl.llm.completion_logprobs": AnyValue(array_value=ArrayValue(
                 values=[AnyValue(double_value=x) for x in logprobs]))}
    s.attributes.extend(KeyValue(key=k, value=v) for k, v in attrs.items())
    return req.SerializeToString()


def _claim_span(rid: str, ref: str) -> bytes:
    return codec.encode("span", claims.claim_span({
        "rollout_id": rid, "attempt_id": "a0", "sequence_id": 0, "trace_id": "t" * 32, "span_id": f"{rid}-c0",
        "name": "chat", "kind": "llm", "source": "proxy", "start_time_unix_nano": 1,
        "end_time_unix_nano": 2, "agent_name": "solver"}, ref))


def test_oversize_span_is_claim_checked_and_resolved(tmp_path, kafka_minio, settings):
    suffix = uuid.uuid4().hex[:8]
    names, app_id = _names(suffix), f"sjtest-stream-{suffix}"
    asyncio.run(_admin("create", names))
    minio = claims.make_client(settings)
    bucket = settings.payload_bucket
    # the span: 300 000 prompt ids (its call store value, 1.2 MB, is over Faust's default
    # 1 MB request size) + a 3.4 MB prompt text: its Avro record is over the 4 MiB topic limit
    prompt = [(i * 7919) % 49152 for i in range(300_000)]
    completion, logprobs = [11, 12, 13], [-0.5, -0.25, -2.0]
    body = _otlp_llm_span("rbig", prompt, completion, logprobs, "p" * 3_400_000)
    # claims of two other rollouts: to no object, and to an object whose content is not its sha256
    missing = f"s3://{bucket}/{names['spans']}/rmiss/{'0' * 64}.avro"
    altered_key = claims.content_key(names["spans"], "ralt", b"the original")
    minio.put_object(bucket, altered_key, io.BytesIO(b"something else"), 14)
    web_port, bridge_port = _free_port(), _free_port()
    bridge = subprocess.Popen([sys.executable, "-m", "spanrl.producers.bridge", "--port", str(bridge_port),
                               "--grpc-port", "0", "--topic-prefix", f"sjtest-{suffix}-"], cwd=REPO,
                              env=private_env(), stdout=open(tmp_path / "bridge.log", "wb"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    worker = _start_worker(names, app_id, web_port, tmp_path / "worker.log")
    bridge_url = f"http://127.0.0.1:{bridge_port}"
    try:
        _wait_http(bridge_url + "/health", bridge)
        _wait_http(f"http://127.0.0.1:{web_port}/spanrl/health/", worker)
        r = httpx.post(bridge_url + "/v1/traces", content=body, timeout=60,
                       headers={"content-type": "application/x-protobuf"})
        assert r.status_code == 200, r.text
        assert not ExportTraceServiceResponse.FromString(r.content).HasField("partial_success")
        assert httpx.get(bridge_url + "/status").json()["claims"] == 1
        asyncio.run(_produce([
            _lifecycle(names, "rbig", "started"), _lifecycle(names, "rbig", "succeeded"),
            _reward(names, "rbig", 1.0),
            (names["spans"], "rmiss", _claim_span("rmiss", missing)),
            (names["spans"], "ralt", _claim_span("ralt", f"s3://{bucket}/{altered_key}"))]))
        got = asyncio.run(_read(names, ("spans", "transitions", "samples", "dead-letter"),
                                lambda g: g["samples"] and len(g["dead-letter"]) >= 2, 90))
        counters = _counters(web_port)
        # MinIO unreachable: the oversize span is refused with 503 + Retry-After, nothing produced
        stop_process_group(bridge, grace_s=10)
        bridge = subprocess.Popen([sys.executable, "-m", "spanrl.producers.bridge", "--port", str(bridge_port),
                                   "--grpc-port", "0", "--topic-prefix", f"sjtest-{suffix}-"], cwd=REPO,
                                  env=private_env({"SPANRL_MINIO_PORT": "1"}),
                                  stdout=open(tmp_path / "bridge2.log", "wb"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
        _wait_http(bridge_url + "/health", bridge)
        down = httpx.post(bridge_url + "/v1/traces", content=body, timeout=60,
                          headers={"content-type": "application/x-protobuf"})
        assert (down.status_code, down.json()["error"]) == (503, "claim_store_unavailable")
        assert down.headers["retry-after"] and httpx.get(bridge_url + "/status").json().get("spans", 0) == 0
    finally:
        stop_process_group(bridge, grace_s=10)
        _stop_and_delete([worker], names, app_id)
        minio.remove_object(bucket, altered_key)
    worker_log = (tmp_path / "worker.log").read_text(errors="replace")[-3000:]

    # Kafka holds the small span; MinIO the whole record under its sha256
    [small] = [s for s in got["spans"] if s["rollout_id"] == "rbig"]
    assert small["llm"] is None and small["attributes"] == {} and small["_size"] < 1000
    ref = claims.parse_ref(small["payload_ref"], bucket)
    assert ref.key.startswith(f"{names['spans']}/rbig/")
    data = minio.get_object(bucket, ref.key).read()
    assert hashlib.sha256(data).hexdigest() == ref.sha256 and len(data) > topics.SPANS.max_message_bytes
    full = codec.decode("span", data)
    assert (full["span_id"], full["llm"]["prompt_token_ids"]) == (small["span_id"], prompt)
    assert full["attributes"]["gen_ai.prompt"] == "p" * 3_400_000

    # the worker resolved it: the transition has every token id
    [t] = got["transitions"]
    assert (t["rollout_id"], t["span_id"], t["reward"]) == ("rbig", "0303030303030303", 1.0), worker_log
    assert t["prompt_token_ids"] == prompt and t["completion_token_ids"] == completion
    assert t["behaviour_logprobs"] == logprobs
    assert [s["transition"]["span_id"] for s in got["samples"]] == ["0303030303030303"]

    # unresolvable claims: dead letters, the worker lives on
    dead = sorted(got["dead-letter"], key=lambda d: d["rollout_id"])
    assert [(d["rollout_id"], d["reason"], d["stage"], d["source_topic"]) for d in dead] == [
        ("ralt", "claim_unresolved", "assembler", names["spans"]),
        ("rmiss", "claim_unresolved", "assembler", names["spans"])], worker_log
    assert "sha256 mismatch" in dead[0]["detail"] and "NoSuchKey" in dead[1]["detail"]
    assert codec.decode("span", dead[1]["payload"])["payload_ref"] == missing
    assert counters["dead_letters_out"] == {"claim_unresolved": 2} and counters["transitions_out"] == 1


@pytest.mark.slow
def test_worker_restart_recovers_pending_calls(tmp_path, kafka_minio):
    """SIGKILL the worker while a rollout's first call waits in its state (its token data in
    the worker's memory only), and a span without rollout id waits in the trace join's tables;
    the next worker (same app id) restores the tables from their changelogs, re-reads the first
    call's token data from spans at the position its state kept, emits both calls, and joins the
    span when the second call (same trace) comes. A transition waiting in an open group (held in
    memory only) is re-read from transitions, and the group closes with it."""
    suffix = uuid.uuid4().hex[:8]
    names, app_id = _names(suffix), f"sjtest-stream-{suffix}"
    asyncio.run(_admin("create", names))
    rid, trace = "rrec", "ab" * 16
    c0 = codec.encode("span", _span(rid, 0, "c0", prompt=(1, 2, 3), completion=(4, 5)))
    c1 = codec.encode("span", {**_span(rid, 1, "c1", prompt=(6,), completion=(7, 8, 9)),
                               "trace_id": trace, "parent_span_id": "cd" * 8})
    orphan = codec.encode("span", {**_span("", 0, "cd" * 8, kind="agent"), "attempt_id": "", "trace_id": trace,
                                   "sequence_id": -1, "agent_name": "planner"})
    def grouped(rid, R):  # a transition of a group of 2 whose other member comes after the restart
        return (names["transitions"], "tgrp", codec.encode("transition", {
            "rollout_id": rid, "attempt_id": "a0", "span_id": f"{rid}-s", "task_id": "tgrp", "group_size": 2,
            "sequence_id": 0, "call_index": 0, "rollout_transition_count": 1, "agent_name": None, "model": "m",
            "policy_version": 0, "prompt_token_ids": [1, 2], "completion_token_ids": [3], "behaviour_logprobs": [-0.5],
            "episode_return": R, "reward": R, "credit_rule": "identical", "status": "succeeded"}))

    log = tmp_path / "worker.log"
    web_port = _free_port()
    # the orphan must outlive the restart (the killed worker's membership expires after ~60 s)
    worker = _start_worker(names, app_id, web_port, log, SPANRL_ORPHAN_TIMEOUT_S="600")
    try:
        _wait_http(f"http://127.0.0.1:{web_port}/spanrl/health/", worker)
        asyncio.run(_produce([_lifecycle(names, rid, "started", 2), (names["spans"], rid, c0),
                              (names["orphan-spans"], trace, orphan), grouped("g1", 1.0)]))
        deadline = time.monotonic() + 30
        while (asyncio.run(_committed(app_id, names["spans"])) < 1
               or asyncio.run(_committed(app_id, names["orphan-spans"])) < 1
               or asyncio.run(_committed(app_id, names["transitions"])) < 1) and time.monotonic() < deadline:
            time.sleep(0.2)  # the transaction with the span's offset (and its table writes) committed
        before = _counters(web_port)
        assert (before["spans_in"], before["orphans_in"], before["calls_held"], before["transitions_held"]) == (
            1, 1, 1, 1)
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        web_port = _free_port()
        worker = _start_worker(names, app_id, web_port, log, SPANRL_ORPHAN_TIMEOUT_S="600")
        _wait_http(f"http://127.0.0.1:{web_port}/spanrl/health/", worker)
        asyncio.run(_produce([(names["spans"], rid, c1), _lifecycle(names, rid, "succeeded", 2),
                              _reward(names, rid, 0.5), grouped("g2", 0.0)]))
        got = asyncio.run(_read(names, ("spans", "transitions", "samples", "dead-letter"),
                                lambda g: len([t for t in g["transitions"] if t["rollout_id"] == rid]) >= 2
                                and any(sp["source"] == "otlp" for sp in g["spans"]) and len(g["samples"]) >= 2, 90))
        counters = _counters(web_port)
    finally:
        _stop_and_delete([worker], names, app_id)
    worker_log = log.read_text(errors="replace")[-3000:]
    trs = [t for t in got["transitions"] if t["rollout_id"] == rid]
    assert [(t["span_id"], t["call_index"], t["rollout_transition_count"]) for t in trs] == [
        ("c0", 0, 2), ("c1", 1, 2)], (got["dead-letter"], worker_log)
    assert [(t["prompt_token_ids"], t["completion_token_ids"]) for t in trs] == [
        ([1, 2, 3], [4, 5]), ([6], [7, 8, 9])]
    assert [t["reward"] for t in trs] == [0.5, 0.5] and got["dead-letter"] == []
    # the orphan waited in the recovered join tables and joined the attempt of c1's trace
    [joined] = [sp for sp in got["spans"] if sp["source"] == "otlp"]
    assert (joined["rollout_id"], joined["attempt_id"], joined["span_id"], joined["agent_name"]) == (
        rid, "a0", "cd" * 8, "planner")
    assert counters["spans_joined"] == 1 and counters["trace_links_out"] == 1
    # c0 (offset 0, committed before the kill) is not consumed again: its state came from the
    # rollouts changelog, its token data from one re-read of its span. (Inputs that arrive while the worker recovers may be handled twice:
    # Faust resumes stream partitions before seeking them to the committed offsets; the
    # assembler's state is idempotent to that.)
    assert counters["transitions_out"] == 2 and counters["spans_reread"] == 1
    # g1's transition waited in the open group across the kill: re-read from transitions, the group closed
    assert sorted((s["transition"]["rollout_id"], s["advantage"] > 0, s["group_id"]) for s in got["samples"]) == [
        ("g1", True, "tgrp/0"), ("g2", False, "tgrp/0")]
    assert counters["transitions_reread"] == 1


def _start_service(module: str, port: int, prefix: str, log_path: Path, *args: str) -> subprocess.Popen:
    """``python -m module`` (the bridge or the proxy) on ``port`` writing to ``prefix``-ed topics;
    the bridge without its gRPC receiver (its port is the stack's bridge's); open, as every
    private service of the tests (tests/integration/services.py ``private_env``)."""
    if module.endswith(".bridge"):
        args = ("--grpc-port", "0", *args)
    return subprocess.Popen([sys.executable, "-m", module, "--port", str(port), "--topic-prefix", prefix, *args],
                            cwd=REPO, env=private_env(), stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, start_new_session=True)


@contextmanager
def _private_pipeline(tmp_path: Path, **worker_env: str):
    """The bridge and the proxy from this checkout (free ports, the stack's vLLM behind the
    proxy) and a Faust worker, on new private ``sjtest-<id>-*`` topics; yields their names and
    URLs once all three answer, and stops them and deletes the topics after the block."""
    suffix = uuid.uuid4().hex[:8]
    names, app_id, prefix = _names(suffix), f"sjtest-stream-{suffix}", f"sjtest-{suffix}-"
    asyncio.run(_admin("create", names))
    web_port, bridge_port, proxy_port = _free_port(), _free_port(), _free_port()
    bridge = _start_service("spanrl.producers.bridge", bridge_port, prefix, tmp_path / "bridge.log")
    proxy = _start_service("spanrl.producers.proxy", proxy_port, prefix, tmp_path / "proxy.log", "--reloader-url", "")
    worker = _start_worker(names, app_id, web_port, tmp_path / "worker.log", **worker_env)
    p = SimpleNamespace(suffix=suffix, names=names, web_port=web_port, bridge_url=f"http://127.0.0.1:{bridge_port}",
                        proxy_url=f"http://127.0.0.1:{proxy_port}")
    try:
        for url, proc in ((p.bridge_url + "/health", bridge), (p.proxy_url + "/health", proxy),
                          (f"http://127.0.0.1:{web_port}/spanrl/health/", worker)):
            _wait_http(url, proc)
        yield p
    finally:
        _stop_and_delete([bridge, proxy, worker], names, app_id)


def _join_by_trace(p: SimpleNamespace, provider, rid: str, model: str):
    """The plain-OTel agent of the test below: one proxy call inside an agent span, one trace
    without a call; then the runner's part by hand (lifecycle, reward). Returns the answer, the
    spans as joined, everything read after, the worker's counters."""
    import openai

    client = openai.OpenAI(base_url=f"{p.proxy_url}/rollouts/{rid}/attempts/a0/v1", api_key="unused")
    tracer = provider.get_tracer("plain-otel-agent")
    with tracer.start_as_current_span("invoke_agent planner", attributes={
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "planner"}):
        answer = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": "Say hi."}])
    with tracer.start_as_current_span("lonely step"):  # a trace with no proxy call
        pass
    assert provider.force_flush(30_000)
    joined = asyncio.run(_read(p.names, ("spans",), lambda g: len(g["spans"]) >= 3, 60))["spans"]
    asyncio.run(_produce([_lifecycle(p.names, rid, "started"), _lifecycle(p.names, rid, "succeeded"),
                          _reward(p.names, rid, 1.0)]))
    got = asyncio.run(_read(p.names, ("spans", "transitions", "call-accounts", "dead-letter"),
                            lambda g: g["transitions"] and g["call-accounts"] and g["dead-letter"], 60))
    return answer, joined, got, _counters(p.web_port)


def test_framework_spans_without_rollout_join_the_proxy_call_by_trace(tmp_path, kafka_minio, settings):
    """An agent traced only by a standard GenAI instrumentation (OpenInference's OpenAI
    instrumentor, a plain TracerProvider + OTLP exporter to the bridge; its HTTP requests carry
    the W3C traceparent) calls the proxy's per-rollout URL: its spans carry no rollout id, go to
    orphan-spans and join the call's rollout by trace id as context (the agent span names the
    call's agent), exactly one transition (the proxy's record, exact token ids), no
    missing_token_ids; a trace with no proxy call ends as no_rollout_id."""
    from openinference.instrumentation.openai import OpenAIInstrumentor
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from spanrl.producers.instrument import propagate_trace_context

    kafka_minio.start("vllm")
    with _private_pipeline(tmp_path, SPANRL_ORPHAN_TIMEOUT_S="5") as p:
        names = p.names
        provider = TracerProvider(resource=Resource.create({"service.name": "plain-otel-agent"}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=p.bridge_url + "/v1/traces")))
        instrumentor = OpenAIInstrumentor()
        instrumentor.uninstrument()  # whatever instrumented openai before: this provider's spans only
        instrumentor.instrument(tracer_provider=provider)
        propagate_trace_context()  # openai>=3 sends with httpx2, which no OTel instrumentation covers
        rid = f"join-{p.suffix}"
        try:
            answer, joined, got, counters = _join_by_trace(p, provider, rid, settings.model_name)
        finally:
            instrumentor.uninstrument()
            provider.shutdown()
    worker_log = (tmp_path / "worker.log").read_text(errors="replace")[-3000:]
    assert answer.choices[0].message.content is not None

    # spans of the rollout: the proxy's call record and the two framework spans, joined by trace
    [call] = [s for s in got["spans"] if s["source"] == "proxy"]
    others = sorted((s for s in got["spans"] if s["source"] != "proxy"), key=lambda s: s["name"])
    assert len(got["spans"]) == 3 and len(joined) == 3, (got["spans"], worker_log)
    assert [(s["name"], s["kind"], s["rollout_id"], s["attempt_id"], s["attributes"]["spanrl.joined_by"])
            for s in others] == [("ChatCompletion", "llm", rid, "a0", "response_id"),  # it names its attempt too
                                 ("invoke_agent planner", "agent", rid, "a0", "trace")]
    llm_span, agent_span = others
    assert {s["trace_id"] for s in got["spans"]} == {call["trace_id"]}
    assert call["parent_span_id"] == llm_span["span_id"] and llm_span["parent_span_id"] == agent_span["span_id"]
    assert llm_span["llm"] is None and agent_span["agent_name"] == "planner"

    # one transition: the proxy's record with vLLM's exact token ids; its agent from the joined spans
    [t] = got["transitions"]
    assert (t["rollout_id"], t["span_id"], t["agent_name"], t["reward"]) == (rid, call["span_id"], "planner", 1.0)
    assert t["prompt_token_ids"] == call["llm"]["prompt_token_ids"]
    assert t["completion_token_ids"] == call["llm"]["completion_token_ids"]
    [account] = got["call-accounts"]
    assert [(c["span_id"], c["agent_name"], c["agent_source"], c["trained"]) for c in account["calls"]] == [
        (call["span_id"], "planner", "telemetry", True)]

    # the trace with no proxy call: no_rollout_id, with its orphan-spans record; nothing else dead
    [dead] = got["dead-letter"]
    assert (dead["reason"], dead["stage"], dead["source_topic"], dead["rollout_id"]) == (
        "no_rollout_id", "joiner", names["orphan-spans"], None), worker_log
    lonely = codec.decode("span", dead["payload"])
    assert lonely["name"] == "lonely step" and lonely["trace_id"] != call["trace_id"]
    assert counters["dead_letters_out"] == {"no_rollout_id": 1}
    assert {k: counters[k] for k in ("trace_links_out", "trace_links_in", "orphans_in", "spans_joined",
                                     "transitions_out")} == {
        "trace_links_out": 1, "trace_links_in": 1, "orphans_in": 3, "spans_joined": 2, "transitions_out": 1}


#: an agent with its own OpenTelemetry set-up and no spanrl code (issue 23 item 4): OpenInference's
#: OpenAI instrumentor, a plain TracerProvider, openai 3.x, which sends no traceparent; run in a
#: fresh interpreter, so no patch of this test process (propagate_trace_context) reaches it
NO_SPANRL_AGENT = """
import json, sys
import openai
from openinference.instrumentation.openai import OpenAIInstrumentor
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

proxy, bridge, rid, model = sys.argv[1:5]
provider = TracerProvider(resource=Resource.create({"service.name": "no-spanrl-agent"}))
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=bridge + "/v1/traces")))
OpenAIInstrumentor().instrument(tracer_provider=provider)
client = openai.OpenAI(base_url=proxy + "/rollouts/" + rid + "/attempts/a0/v1", api_key="unused")
with provider.get_tracer("no-spanrl-agent").start_as_current_span("invoke_agent planner", attributes={
        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "planner"}):
    answer = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                            messages=[{"role": "user", "content": "Say hi."}])
assert provider.force_flush(30000)
print(json.dumps({"id": answer.id, "content": answer.choices[0].message.content}))
"""


def test_framework_spans_without_traceparent_join_by_the_minted_response_id(tmp_path, kafka_minio, settings):
    """The agent above: its HTTP request carries no traceparent, so the proxy's record of the
    call has no parent and no trace link is written; the framework's LLM span carries the
    answer's id (OpenInference's output.value), which names the attempt
    (spanrl/core/response_ids.py): it joins by that id, the agent span joins through the trace,
    and the call's one transition takes its agent from them."""
    kafka_minio.start("vllm")
    with _private_pipeline(tmp_path, SPANRL_ORPHAN_TIMEOUT_S="30") as p:
        rid = f"nojoin-{p.suffix}"
        run = subprocess.run([sys.executable, "-c", NO_SPANRL_AGENT, p.proxy_url, p.bridge_url, rid,
                              settings.model_name], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        answer = json.loads(run.stdout.strip().splitlines()[-1])
        joined = asyncio.run(_read(p.names, ("spans",), lambda g: len(g["spans"]) >= 3, 60))["spans"]
        asyncio.run(_produce([_lifecycle(p.names, rid, "started"), _lifecycle(p.names, rid, "succeeded"),
                              _reward(p.names, rid, 1.0)]))
        got = asyncio.run(_read(p.names, ("spans", "transitions", "call-accounts"),
                                lambda g: g["transitions"] and g["call-accounts"], 60))
        counters = _counters(p.web_port)
    worker_log = (tmp_path / "worker.log").read_text(errors="replace")[-3000:]
    assert answer["id"].endswith(f"~spanrl~{rid}~a0"), answer

    [call] = [s for s in got["spans"] if s["source"] == "proxy"]
    assert call["parent_span_id"] is None and call["attributes"]["gen_ai.response.id"] == answer["id"]
    others = sorted((s for s in got["spans"] if s["source"] != "proxy"), key=lambda s: s["name"])
    assert len(joined) == 3, (joined, worker_log)
    assert [(s["name"], s["rollout_id"], s["attempt_id"], s["attributes"]["spanrl.joined_by"]) for s in others] == [
        ("ChatCompletion", rid, "a0", "response_id"), ("invoke_agent planner", rid, "a0", "trace")], worker_log
    llm_span, agent_span = others
    assert llm_span["trace_id"] == agent_span["trace_id"] != call["trace_id"]  # no shared trace: no propagation
    assert llm_span["attributes"]["spanrl.joined_response_id"] == answer["id"]

    [t] = got["transitions"]
    assert (t["rollout_id"], t["span_id"], t["agent_name"], t["reward"]) == (rid, call["span_id"], "planner", 1.0)
    assert t["completion_token_ids"] == call["llm"]["completion_token_ids"]
    [account] = got["call-accounts"]
    assert [(c["span_id"], c["agent_name"], c["agent_source"]) for c in account["calls"]] == [
        (call["span_id"], "planner", "telemetry")]
    assert {k: counters[k] for k in ("trace_links_out", "orphans_in", "spans_joined")} == {
        "trace_links_out": 0, "orphans_in": 2, "spans_joined": 2}, counters


def test_acked_terminal_event_is_emitted_without_the_settle_wait(tmp_path, kafka_minio):
    """A terminal event with inputs_acked (sent, as the runner does, after its spans and reward
    were acknowledged) is emitted once the worker has read the spans/rewards partitions up to
    their end offsets at that event: with a settle time of 600 s its transitions still come
    out. A rollout without the flag, produced before it, still waits its settle time."""
    suffix = uuid.uuid4().hex[:8]
    names, app_id = _names(suffix), f"sjtest-stream-{suffix}"
    asyncio.run(_admin("create", names))
    web_port = _free_port()
    worker = _start_worker(names, app_id, web_port, tmp_path / "worker.log", SPANRL_SETTLE_S="600")

    def acked(rid):
        return (names["rollouts"], rid, codec.encode("rollout", {
            "rollout_id": rid, "attempt_id": "a0", "task_id": f"task-{rid}", "status": "succeeded",
            "group_size": 1, "timestamp_ms": 3, "inputs_acked": True}))
    try:
        _wait_http(f"http://127.0.0.1:{web_port}/spanrl/health/", worker)
        slow = [_lifecycle(names, "rslow", "started"), (names["spans"], "rslow", codec.encode("span", _span("rslow", 0, "s0"))),
                _reward(names, "rslow", 1.0), _lifecycle(names, "rslow", "succeeded")]
        fast = [_lifecycle(names, "rfast", "started")] + [
            (names["spans"], "rfast", codec.encode("span", _span("rfast", i, f"f{i}", completion=(3 + i,))))
            for i in range(3)] + [_reward(names, "rfast", 0.5), acked("rfast")]
        asyncio.run(_produce(slow + fast))  # one at a time, each acknowledged before the next
        got = asyncio.run(_read(names, ("transitions",), lambda g: len(g["transitions"]) >= 3, 90))
        # a few seconds more: the unflagged rollout must not come out (its settle is 600 s)
        more = asyncio.run(_read(names, ("transitions",), lambda g: False, 3))
        counters = _counters(web_port)
    finally:
        _stop_and_delete([worker], names, app_id)
    log = (tmp_path / "worker.log").read_text(errors="replace")[-3000:]
    trs = got["transitions"]
    assert [(t["rollout_id"], t["span_id"], t["completion_token_ids"], t["reward"]) for t in trs] == [
        ("rfast", "f0", [3], 0.5), ("rfast", "f1", [4], 0.5), ("rfast", "f2", [5], 0.5)], log
    assert [t["rollout_id"] for t in more["transitions"]] == ["rfast"] * 3, log
    assert counters["inputs_bounds_read"] == 1 and counters["transitions_out"] == 3, counters
    assert counters["emitted_by"] == {"inputs_bound": 1}, counters


def test_late_reward_parks_the_attempt_and_rereads_its_spans(tmp_path, kafka_minio, settings):
    """Late rewards (stream_jobs/assembly.py): a worker with SPANRL_REWARD_TIMEOUT_S=2 parks
    three ended attempts without a reward (their token data leave the worker's memory:
    calls_held 0); then rlate's reward comes: its spans are re-read from
    the spans topic (one of them a claim record, resolved from MinIO again) and its
    transitions carry the spans' token ids, late_reward and reward_delay_ms; rgone's span
    was deleted meanwhile (DeleteRecords, what retention does) -> late_spans_missing;
    rnever gets no reward within SPANRL_REWARD_WINDOW_S -> no_reward_before_window."""
    from aiokafka.structs import TopicPartition

    suffix = uuid.uuid4().hex[:8]
    names, app_id = _names(suffix), f"sjtest-stream-{suffix}"
    asyncio.run(_admin("create", names))
    minio = claims.make_client(settings)
    spans = {"rgone": _span("rgone", 0, "g0", prompt=(9,), completion=(9, 9)),
             "rlate0": _span("rlate", 0, "l0", prompt=(1, 2, 3), completion=(4, 5)),
             "rlate1": _span("rlate", 1, "l1", prompt=tuple(range(100, 140)), completion=(6, 7, 8)),
             "rnever": _span("rnever", 0, "n0")}
    full = codec.encode("span", spans["rlate1"])
    claim_key = claims.content_key(names["spans"], "rlate", full)
    minio.put_object(settings.payload_bucket, claim_key, io.BytesIO(full), len(full))
    claim = codec.encode("span", claims.claim_span(spans["rlate1"], f"s3://{settings.payload_bucket}/{claim_key}"))

    stamped: dict[tuple[str, str], int] = {}  # (rollout, status) -> the event's timestamp_ms

    def event(rid, status):
        stamped[(rid, status)] = int(time.time() * 1000)
        return codec.encode("rollout", {"rollout_id": rid, "attempt_id": "a0", "task_id": f"task-{rid}",
                                        "status": status, "group_size": 1, "timestamp_ms": stamped[(rid, status)]})

    async def produce(records):
        producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap)
        await producer.start()
        try:
            return [await producer.send_and_wait(t, v, key=k.encode()) for t, k, v in records]
        finally:
            await producer.stop()

    web_port = _free_port()
    worker = _start_worker(names, app_id, web_port, tmp_path / "worker.log", SPANRL_REWARD_TIMEOUT_S="2",
                           SPANRL_REWARD_WINDOW_S="25")
    try:
        _wait_http(f"http://127.0.0.1:{web_port}/spanrl/health/", worker)
        sp = names["spans"]
        [gone, *_] = asyncio.run(produce([
            (sp, "rgone", codec.encode("span", spans["rgone"])), (sp, "rlate", codec.encode("span", spans["rlate0"])),
            (sp, "rlate", claim), (sp, "rnever", codec.encode("span", spans["rnever"]))]
            + [(names["rollouts"], rid, event(rid, s)) for rid in ("rgone", "rlate", "rnever")
               for s in ("started", "succeeded")]))  # only succeeded attempts park (a failed one is dead-lettered at the reward timeout)
        deadline = time.monotonic() + 40
        while _counters(web_port)["attempts_parked"] < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        parked = _counters(web_port)
        asyncio.run(_delete_records(TopicPartition(sp, gone.partition), gone.offset + 1))
        reward_ms = int(time.time() * 1000)
        asyncio.run(produce([(names["rewards"], rid, codec.encode("reward", {
            "rollout_id": rid, "attempt_id": "a0", "value": 0.75, "final": True, "timestamp_ms": reward_ms}))
            for rid in ("rlate", "rgone")]))
        got = asyncio.run(_read(names, ("transitions", "samples", "dead-letter"),
                                lambda g: len(g["samples"]) >= 2 and len(g["dead-letter"]) >= 2, 60))
        counters = _counters(web_port)
    finally:
        _stop_private(worker, names, app_id)
        minio.remove_object(settings.payload_bucket, claim_key)
    worker_log = (tmp_path / "worker.log").read_text(errors="replace")[-3000:]

    # parked: no token data held (they were in the worker's memory only, never in a changelog)
    assert (parked["attempts_parked"], parked["calls_held"]) == (3, 0), (parked, worker_log)

    # the late reward: transitions exactly from the spans (the claim resolved again), marked late
    trs = sorted(got["transitions"], key=lambda t: t["call_index"])
    assert [(t["rollout_id"], t["span_id"], t["prompt_token_ids"], t["completion_token_ids"], t["reward"])
            for t in trs] == [("rlate", sid, spans[k]["llm"]["prompt_token_ids"],
                               spans[k]["llm"]["completion_token_ids"], 0.75)
                              for sid, k in (("l0", "rlate0"), ("l1", "rlate1"))], (got, worker_log)
    assert all(t["behaviour_logprobs"] == [-0.5] * len(t["completion_token_ids"]) for t in trs)
    # the delay as the records state it: the reward's timestamp minus the terminal event's
    assert all(t["late_reward"] and t["reward_delay_ms"] == reward_ms - stamped[("rlate", "succeeded")] > 0
               for t in trs), (trs, stamped)
    assert sorted(s["transition"]["span_id"] for s in got["samples"]) == ["l0", "l1"]
    assert {(s["group_id"], s["advantage"]) for s in got["samples"]} == {("task-rlate/0", 0.0)}
    dead = sorted((d["rollout_id"], d["reason"]) for d in got["dead-letter"])
    assert dead == [("rgone", "late_spans_missing"), ("rnever", "no_reward_before_window")], got["dead-letter"]
    assert (counters["spans_reread"], counters["late_rewards_emitted"], counters["transitions_out"]) == (2, 1, 2)


def _stop_private(worker: subprocess.Popen, names: dict, app_id: str) -> None:
    """Stop a private worker and delete its topics (best effort)."""
    stop_process_group(worker, grace_s=15)
    try:
        asyncio.run(_admin("delete", names, app_id))
    except Exception:
        pass


async def _delete_records(tp, before: int) -> None:
    """Delete ``tp``'s records before offset ``before`` (the log start moves, as retention moves it)."""
    from aiokafka.admin import RecordsToDelete

    admin = AIOKafkaAdminClient(bootstrap_servers=get_settings().kafka_bootstrap)
    await admin.start()
    try:
        await admin.delete_records({tp: RecordsToDelete(before_offset=before)})
    finally:
        await admin.close()
