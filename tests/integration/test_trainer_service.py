"""Trainer + reloader against the real stack (Kafka, MinIO, vLLM): real samples from vLLM
-> one update -> verified checkpoint in MinIO + announcement -> resume point -> vLLM
reloads it; a tampered checkpoint is refused while vLLM keeps serving.

Crash safety (Kafka + MinIO only, a tiny random Qwen2 with SmolLM2's tokenizer): a
trainer SIGKILLed before its first checkpoint resumes at its start marker; checkpoint
upload and reloader download ride out a MinIO outage (MinIO stopped and restarted).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch

from spanrl.core.settings import get_settings
from spanrl.infra.stack import ROOT, Stack
from spanrl.schemas.codec import encode
from spanrl.trainer import checkpoint, lora
from spanrl.trainer.reloader import Reloader, ReloaderConfig, reload_vllm
from spanrl.trainer.train import Trainer, TrainerConfig, read_announcements
from tests.integration.services import admin_headers

pytestmark = pytest.mark.integration

def _sign(ckpt_dir: Path) -> None:
    """Sign a hand-made checkpoint as the trainer signs its own (the reloader serves only what
    verifies under the stack's key; none in open mode)."""
    key = get_settings().checkpoint_key()
    if key is not None:
        checkpoint.sign_manifest(ckpt_dir, key)


PROMPTS = ["Name a colour.", "Say hello in French.", "What is 2+2?", "Name a fruit."]


async def _vllm_ready(url: str, wait_s: float = 180.0) -> None:
    deadline = time.monotonic() + wait_s
    async with httpx.AsyncClient(timeout=5.0) as c:
        while True:
            try:
                if (await c.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM at {url} not healthy after {wait_s:.0f}s (is the stack up?)")
            await asyncio.sleep(2)


async def _chat(url: str, prompt: str, max_tokens: int = 12, temperature: float = 1.0) -> dict:
    async with httpx.AsyncClient(timeout=120.0) as c:
        r = await c.post(f"{url}/v1/chat/completions", json={
            "model": get_settings().model_name, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": temperature, "logprobs": True, "return_token_ids": True})
        r.raise_for_status()
        return r.json()


def _sample_from(resp: dict, task_id: str, ret: float, adv: float) -> dict:
    choice = resp["choices"][0]
    lps = [t["logprob"] for t in choice["logprobs"]["content"]]
    assert len(lps) == len(choice["token_ids"])
    transition = {
        "rollout_id": f"r-{uuid.uuid4().hex[:8]}", "attempt_id": "a0", "span_id": uuid.uuid4().hex[:16],
        "task_id": task_id, "group_size": 2, "sequence_id": 0, "call_index": 0, "rollout_transition_count": 1,
        "agent_name": None, "model": "policy", "policy_version": 0,
        "prompt_token_ids": resp["prompt_token_ids"], "completion_token_ids": choice["token_ids"],
        "behaviour_logprobs": lps, "episode_return": ret, "reward": ret, "credit_rule": "identical",
        "status": "succeeded"}
    return {"transition": transition, "advantage": adv, "group_id": task_id, "group_rollouts": 2,
            "group_mean": 0.5, "group_std": 0.5}


@contextlib.asynccontextmanager
async def _scratch_training(scratch_run, name: str):
    """A scratch run with its own samples and checkpoints topics; the samples topic holds 4 real
    samples (token ids and behaviour log-probs as vLLM reports them for PROMPTS). Yields
    ``(run, samples_topic, ckpt_topic, minio)``; afterwards vLLM gets its base weights back and
    the topics and the run's objects are deleted."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    s = get_settings()
    run, samples_topic, ckpt_topic = _scratch_names(scratch_run, name)
    await _vllm_ready(s.vllm_url)
    admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(samples_topic, 1, 1), NewTopic(ckpt_topic, 1, 1)])
    minio = checkpoint.make_client(s)
    try:
        samples = [_sample_from(await _chat(s.vllm_url, p), f"task-{i // 2}", float(i % 2), 1.0 if i % 2 else -1.0)
                   for i, p in enumerate(PROMPTS)]
        producer = AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap, enable_idempotence=True)
        await producer.start()
        for smp in samples:
            await producer.send_and_wait(samples_topic, encode("sample", smp), key=smp["transition"]["task_id"].encode())
        await producer.stop()
        yield run, samples_topic, ckpt_topic, minio
    finally:
        try:
            await reload_vllm(s.vllm_url, s.model_dir)
        finally:
            await admin.delete_topics([samples_topic, ckpt_topic])
            await admin.close()
            if minio.bucket_exists(s.checkpoint_bucket):
                for o in minio.list_objects(s.checkpoint_bucket, prefix=f"{run}/", recursive=True):
                    minio.remove_object(s.checkpoint_bucket, o.object_name)


async def test_trainer_publishes_and_reloader_serves(tmp_path, stack, scratch_run):
    s = get_settings()
    async with _scratch_training(scratch_run, "trtest") as (run, samples_topic, ckpt_topic, minio):
        # trainer: one update, checkpoint_every=1
        cfg = TrainerConfig(run=run, samples_topic=samples_topic, checkpoints_topic=ckpt_topic, min_batch=4,
                            micro_batch=2, max_updates=1, checkpoint_every=1, http=False, start="earliest",
                            log_path=tmp_path / "trainer.jsonl")
        trainer = Trainer(cfg)
        await asyncio.wait_for(trainer.serve(), timeout=240)
        assert trainer.state.version == 1
        assert trainer.state.trained_offsets == {f"{samples_topic}:0": len(PROMPTS)}
        lines = [json.loads(x) for x in (tmp_path / "trainer.jsonl").read_text().splitlines()]
        upd = next(x for x in lines if x["event"] == "update")
        assert upd["samples"] == 4 and upd["approx_kl"] < 0.5, upd  # vLLM and HF agree on log-probs
        print("update", {k: upd[k] for k in ("loss", "approx_kl", "clip_frac", "update_s", "tokens_per_s")})

        # the manifest in MinIO verifies and the announcement arrived
        uri = checkpoint.checkpoint_uri(s.checkpoint_bucket, run, 1)
        manifest = await asyncio.to_thread(checkpoint.download_checkpoint, minio, uri, tmp_path / "dl")
        assert manifest["trained_offsets"] == {f"{samples_topic}:0": 4}
        assert manifest["consumed_offsets"] == {f"{samples_topic}:0": [0, 4]}
        assert upd["consumed"] == {f"{samples_topic}:0": [0, 4]}
        assert manifest["parent_version"] == 0 and manifest["step"] == 1
        assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(manifest["files"])
        anns = await read_announcements(ckpt_topic, run, s.kafka_bootstrap)
        assert [(a["version"], a["uri"]) for a in anns] == [(1, uri)]
        assert anns[0]["manifest_sha256"] == checkpoint.manifest_sha256(tmp_path / "dl")

        # a restarted trainer resumes at version 1 and at the trained offsets
        again = Trainer(cfg)
        m = await again.resume()
        assert m["version"] == 1 and again.state.trained_offsets == {f"{samples_topic}:0": 4}

        # reloader: loads the announced version into vLLM
        rl = Reloader(ReloaderConfig(run=run, checkpoints_topic=ckpt_topic, start="latest",
                                     max_announcements=1, http=False))
        await asyncio.wait_for(rl.serve(), timeout=180)
        st = rl.status()
        assert st["served_version"] == 1, st
        assert st["history"][-1]["verified"] and st["history"][-1]["reloaded"], st
        print("reload_s", st["history"][-1]["reload_s"])
        assert (await _chat(s.vllm_url, "Say hi", 4))["choices"][0]["token_ids"]

        # tampered checkpoint v2: manifest says one hash, object store holds other bytes
        prefix2 = f"{run}/000002/"
        m2 = dict(manifest, version=2, parent_version=1)
        (tmp_path / "m2.json").write_text(json.dumps(m2))
        (tmp_path / "evil").write_bytes(b"not the weights")
        for name in manifest["files"]:
            if name != "model.safetensors":
                minio.fput_object(s.checkpoint_bucket, prefix2 + name, str(tmp_path / "dl" / name))
        minio.fput_object(s.checkpoint_bucket, prefix2 + "model.safetensors", str(tmp_path / "evil"))
        minio.fput_object(s.checkpoint_bucket, prefix2 + "manifest.json", str(tmp_path / "m2.json"))
        ann2 = dict(anns[0], version=2, uri=f"s3://{s.checkpoint_bucket}/{prefix2}", parent_version=1,
                    manifest_sha256=checkpoint.sha256_file(tmp_path / "m2.json"))
        assert await rl.handle(ann2) is False
        st = rl.status()
        assert st["served_version"] == 1
        assert st["history"][-1]["verified"] is False and "sha256 mismatch" in st["history"][-1]["error"]
        assert not (s.cache_dir / "checkpoints" / run / "000002").exists()
        assert (await _chat(s.vllm_url, "Say hi", 4))["choices"][0]["token_ids"]


def _hf_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """Log-probs of ``completion_ids`` after ``prompt_ids`` under an HF causal LM (fp32, CPU)."""
    import torch

    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion_ids)[:, None])[:, 0].tolist()


async def test_lora_adapter_is_published_alone_and_vllm_serves_it_merged(tmp_path, stack, scratch_run):
    """SPANRL_TRAINER_LORA_RANK > 0 against the real stack: the trainer publishes only the
    adapter (manifest ``adapter``, no model.safetensors); the reloader merges it into the base
    weights and vLLM serves the merge: vLLM's log-probs of its greedy answer equal those of
    the base model with the downloaded adapter applied by peft (independent of our merge), and
    differ from the base model's. A second adapter replaces the first and its merged copy is
    deleted; an adapter of another base model is refused, and the served one stays."""
    from peft import PeftModel

    from spanrl.trainer.train import load_model

    s = get_settings()
    async with _scratch_training(scratch_run, "trlora") as (run, samples_topic, ckpt_topic, minio):
        # a large step, so that the served policy visibly moves
        cfg = TrainerConfig(run=run, samples_topic=samples_topic, checkpoints_topic=ckpt_topic, min_batch=4,
                            micro_batch=2, max_updates=1, checkpoint_every=1, http=False, start="earliest",
                            lr=5e-3, lora_rank=8, log_path=tmp_path / "trainer.jsonl")
        await asyncio.wait_for(Trainer(cfg).serve(), timeout=240)
        uri = checkpoint.checkpoint_uri(s.checkpoint_bucket, run, 1)
        manifest = await asyncio.to_thread(checkpoint.download_checkpoint, minio, uri, tmp_path / "dl")
        assert manifest["adapter"]["kind"] == "lora" and manifest["adapter"]["rank"] == 8
        assert "adapter_model.safetensors" in manifest["files"] and "model.safetensors" not in manifest["files"]
        adapter_bytes = sum((tmp_path / "dl" / f).stat().st_size for f in manifest["files"])
        assert adapter_bytes < 0.05 * (s.model_dir / "model.safetensors").stat().st_size

        rl = Reloader(ReloaderConfig(run=run, checkpoints_topic=ckpt_topic, start="latest",
                                     max_announcements=1, http=False))
        await asyncio.wait_for(rl.serve(), timeout=300)
        st = rl.status()
        assert st["served_version"] == 1 and st["history"][-1]["reloaded"], st
        assert st["history"][-1]["merged"], st
        print("merge_s", st["history"][-1]["merge_s"], "reload_s", st["history"][-1]["reload_s"])

        served = await _chat(s.vllm_url, PROMPTS[0], 8, temperature=0.0)
        prompt_ids, ids = served["prompt_token_ids"], served["choices"][0]["token_ids"]
        vllm_lps = [t["logprob"] for t in served["choices"][0]["logprobs"]["content"]]
        base = await asyncio.to_thread(load_model, s.model_dir)
        base_lps = await asyncio.to_thread(_hf_logprobs, base, prompt_ids, ids)
        adapted = PeftModel.from_pretrained(base, str(tmp_path / "dl"))
        peft_lps = await asyncio.to_thread(_hf_logprobs, adapted, prompt_ids, ids)
        served_vs_peft = max(abs(a - b) for a, b in zip(vllm_lps, peft_lps))
        peft_vs_base = max(abs(a - b) for a, b in zip(peft_lps, base_lps))
        print("max |log-prob| differences: vLLM vs peft", served_vs_peft, "peft vs base", peft_vs_base)
        assert peft_vs_base > 10 * served_vs_peft, (vllm_lps, peft_lps, base_lps)

        # v2: v1's adapter with lora_B halved (other weights, the same base), published to MinIO
        # as the trainer publishes: merged and served; v1's merged copy is deleted, v1 kept
        run_dir = s.cache_dir / "checkpoints" / run
        v2 = tmp_path / "v2"
        shutil.copytree(tmp_path / "dl", v2)
        ann2 = await asyncio.to_thread(_republish_adapter, minio, v2, manifest, 2, halve_lora_b=True)
        assert await rl.handle(ann2)
        st = rl.status()
        assert st["served_version"] == 2 and st["served_weights_dir"] == str(run_dir / "000002.merged"), st
        assert sorted(p.name for p in run_dir.iterdir()) == ["000001", "000002", "000002.merged"]
        served2 = await _chat(s.vllm_url, PROMPTS[0], 8, temperature=0.0)
        ids2 = served2["choices"][0]["token_ids"]
        vllm2 = [t["logprob"] for t in served2["choices"][0]["logprobs"]["content"]]
        base2 = await asyncio.to_thread(load_model, s.model_dir)
        peft2 = await asyncio.to_thread(_hf_logprobs, PeftModel.from_pretrained(base2, str(v2)), prompt_ids, ids2)
        assert max(abs(a - b) for a, b in zip(vllm2, peft2)) < 10 * max(served_vs_peft, 1e-5), (vllm2, peft2)
        assert (ids2, vllm2) != (ids, vllm_lps)
        # an evaluation pin of v1 merges its pinned copy; unpin deletes both and serves v2's merge again
        await rl.pin(run, 1)
        pinned = s.cache_dir / "checkpoints" / "pinned" / run
        assert rl.status()["served_weights_dir"] == str(pinned / "000001.merged")
        assert (await _chat(s.vllm_url, PROMPTS[0], 8, temperature=0.0))["choices"][0]["token_ids"] == ids
        await rl.unpin()
        assert rl.status()["served_weights_dir"] == str(run_dir / "000002.merged") and not pinned.exists()
        assert rl.history[-1]["event"] == "unpin" and rl.history[-1]["merge_s"] < 1.0  # current: not merged again

        # v3: an adapter whose manifest names another base model: refused before any download
        # is kept or any reload, as an announcement and as an evaluation pin; v2 stays served
        v3 = tmp_path / "v3"
        shutil.copytree(v2, v3)
        ann3 = await asyncio.to_thread(_republish_adapter, minio, v3, manifest, 3, base_model="another base model")
        assert await rl.handle(ann3) is False
        entry = rl.status()["history"][-1]
        assert entry["verified"] is False and entry["reloaded"] is False, entry
        assert entry["error"].startswith("BaseModelMismatch: adapter " + f"{run}:3 was trained on base model "
                                         "'another base model'"), entry
        assert not (run_dir / "000003").exists()
        with pytest.raises(lora.BaseModelMismatch):
            await rl.pin(run, 3)
        assert rl.status()["served_version"] == 2
        again = await _chat(s.vllm_url, PROMPTS[0], 8, temperature=0.0)
        assert again["choices"][0]["token_ids"] == ids2


def _republish_adapter(minio, d: Path, manifest: dict, version: int, *, halve_lora_b: bool = False,
                       base_model: str | None = None) -> dict:
    """Publish the adapter in ``d`` (a downloaded checkpoint of ``manifest``'s run) again as
    ``version``, its lora_B weights halved if asked, its manifest naming ``base_model`` (default:
    the original's); returns the announcement the reloader handles."""
    import safetensors.torch

    (d / checkpoint.MANIFEST).unlink()
    if halve_lora_b:
        f = d / "adapter_model.safetensors"
        tensors = safetensors.torch.load_file(str(f))
        safetensors.torch.save_file({k: t * 0.5 if "lora_B" in k else t for k, t in tensors.items()}, str(f),
                                    metadata={"format": "pt"})
    checkpoint.write_manifest(d, run=manifest["run"], version=version, parent_version=version - 1,
                              base_model=base_model or manifest["base_model"], step=manifest["step"] + version - 1,
                              trained_offsets=manifest["trained_offsets"], metrics=manifest["metrics"],
                              consumed_offsets=manifest["consumed_offsets"], adapter=manifest["adapter"])
    _sign(d)  # replaces the copied manifest.sig of the original
    s = get_settings()
    uri = checkpoint.checkpoint_uri(s.checkpoint_bucket, manifest["run"], version)
    checkpoint.upload_checkpoint(minio, d, uri)
    return {"run": manifest["run"], "version": version, "uri": uri, "parent_version": version - 1,
            "manifest_sha256": checkpoint.manifest_sha256(d)}


# ---- crash safety: Kafka + MinIO only, a tiny model --------------------------------------

@pytest.fixture(scope="module")
def light_stack(settings):
    """Kafka and MinIO of the local stack (started if missing), nothing else."""
    st = Stack(settings)
    st.up(["kafka", "minio"])
    yield st
    if not st.running("minio"):  # a failed test may leave MinIO stopped
        st.start("minio")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, settings):
    """A random 2-layer Qwen2 (hidden 32) with SmolLM2's tokenizer files: a real HF model
    dir the trainer loads in seconds."""
    from bench.soak import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny-model"), settings.model_dir, max_positions=128)


def _toy_sample(i: int) -> dict:
    transition = {
        "rollout_id": f"r-{i}", "attempt_id": "a0", "span_id": f"{i:016x}", "task_id": f"task-{i // 2}",
        "group_size": 2, "sequence_id": 0, "call_index": 0, "rollout_transition_count": 1, "agent_name": None,
        "model": "policy", "policy_version": 0, "prompt_token_ids": [1, 20 + i % 7, 30],
        "completion_token_ids": [40 + i % 5, 2], "behaviour_logprobs": [-1.0, -0.5],
        "episode_return": float(i % 2), "reward": float(i % 2), "credit_rule": "identical", "status": "succeeded"}
    return {"transition": transition, "advantage": 1.0 if i % 2 else -1.0, "group_id": f"task-{i // 2}",
            "group_rollouts": 2, "group_mean": 0.5, "group_std": 0.5}


def _scratch_names(scratch_run, prefix: str) -> tuple[str, str, str]:
    """A fresh ``(run, samples topic, checkpoints topic)`` for a test, the run registered with
    ``scratch_run`` (removed afterwards)."""
    tag = uuid.uuid4().hex[:8]
    return scratch_run(f"{prefix}-{tag}"), f"{prefix}-samples-{tag}", f"{prefix}-checkpoints-{tag}"


async def _produce(topic: str, first: int, n: int) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=get_settings().kafka_bootstrap, enable_idempotence=True)
    await producer.start()
    try:
        for i in range(first, first + n):
            await producer.send_and_wait(topic, encode("sample", _toy_sample(i)), key=f"task-{i // 2}".encode())
    finally:
        await producer.stop()


async def _topics(*names: str):
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=get_settings().kafka_bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(n, 1, 1) for n in names])
    return admin


def _events(path: Path, event: str) -> list[dict]:
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == event]


async def _wait_for(what: str, cond, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log else ""
            pytest.fail(f"trainer exited {proc.returncode} waiting for {what}:\n{tail}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}" + (f":\n{log.read_text()[-3000:]}" if log else ""))
        await asyncio.sleep(0.5)


def _remove_run(minio, bucket: str, run: str) -> None:
    if minio.bucket_exists(bucket):
        for o in minio.list_objects(bucket, prefix=f"{run}/", recursive=True):
            minio.remove_object(bucket, o.object_name)


class TrainerProcesses:
    """Trainer processes (``python -m spanrl.trainer.train``, each in its own session) of one
    test run with the environment ``env``; logs ``tmp_path/trainer-<i>.log``; :meth:`kill_all`
    SIGKILLs those still running."""

    def __init__(self, tmp_path: Path, env: dict):
        self.tmp_path, self.env, self.procs = tmp_path, env, []

    def start(self, **extra) -> subprocess.Popen:
        out = open(self.tmp_path / f"trainer-{len(self.procs)}.log", "wb")
        p = subprocess.Popen([sys.executable, "-m", "spanrl.trainer.train"], cwd=ROOT, env={**self.env, **extra},
                             stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _trainer_env(stack, run: str, model_dir: Path, samples_topic: str, ckpt_topic: str, jsonl: Path, **extra) -> dict:
    """The environment of a trainer process of a test run: this process's, without the
    pytest process's torch.distributed rendezvous (an in-process trainer test may have set
    MASTER_PORT and still hold it: each trainer process picks a free port of its own), plus the
    stack's service environment and the run's settings (``extra``: more variables)."""
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK",
                                                                 "WORLD_SIZE", "LOCAL_RANK")}
    return {**inherited, **stack.service_env(), "SPANRL_TRAINER_RUN": run, "SPANRL_TRAINER_BASE_DIR": str(model_dir),
            "SPANRL_TRAINER_SAMPLES_TOPIC": samples_topic, "SPANRL_TRAINER_CHECKPOINTS_TOPIC": ckpt_topic,
            "SPANRL_TRAINER_HTTP": "false", "SPANRL_TRAINER_LOG_PATH": str(jsonl), "SPANRL_TRAINER_LR": "0.001",
            **extra}


async def test_trainer_killed_before_first_checkpoint_resumes_at_start_marker(tmp_path, light_stack, scratch_run,
                                                                             tiny_model_dir):
    """start=latest, SIGKILL before the first checkpoint, samples produced meanwhile: the
    restarted trainer starts at the marker, not at the new end (no sample skipped)."""
    s = get_settings()
    run, samples_topic, ckpt_topic = _scratch_names(scratch_run, "trcrash")
    key = f"{samples_topic}:0"
    admin = await _topics(samples_topic, ckpt_topic)
    minio = checkpoint.make_client(s)
    jsonl = tmp_path / "trainer.jsonl"
    trainers = TrainerProcesses(tmp_path, _trainer_env(
        light_stack, run, tiny_model_dir, samples_topic, ckpt_topic, jsonl, SPANRL_TRAINER_START="latest",
        SPANRL_TRAINER_MICRO_BATCH="4", SPANRL_TRACKER="tensorboard", SPANRL_TRACKER_DIR=str(tmp_path / "tb")))
    start = trainers.start
    try:
        await _produce(samples_topic, 0, 3)  # before the run: not its samples (start=latest)
        first = start(SPANRL_TRAINER_MIN_BATCH="1000", SPANRL_TRAINER_IDLE_FLUSH_S="3600")
        await _wait_for("first start", lambda: _events(jsonl, "start"), 420, first, tmp_path / "trainer-0.log")
        [marker_ev] = _events(jsonl, "start_marker")
        assert marker_ev["offsets"] == {key: 3}
        marker = checkpoint.read_start_marker(minio, s.checkpoint_bucket, run)
        assert (marker["offsets"], marker["start"], marker["run"]) == ({key: 3}, "latest", run)
        assert _events(jsonl, "start")[0]["from"] == {key: "latest"}

        await _produce(samples_topic, 3, 4)  # offsets 3..6: the run's, buffered, not yet trained
        await asyncio.sleep(2)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        await _produce(samples_topic, 7, 2)  # offsets 7..8 while the trainer is down

        second = start(SPANRL_TRAINER_MIN_BATCH="6", SPANRL_TRAINER_IDLE_FLUSH_S="3600",
                       SPANRL_TRAINER_MAX_UPDATES="1")
        await _wait_for("the restart", lambda: len(_events(jsonl, "start")) == 2, 420, second,
                        tmp_path / "trainer-1.log")
        restart = _events(jsonl, "start")[1]
        assert (restart["offsets"], restart["from"]) == ({key: 3}, {key: "marker"})
        rc = await asyncio.to_thread(second.wait, 420)
        assert rc == 0, (tmp_path / "trainer-1.log").read_text()[-3000:]
        assert len(_events(jsonl, "start_marker")) == 1  # the marker is written once
        [upd] = _events(jsonl, "update")
        assert (upd["samples"], upd["consumed"]) == (6, {key: [3, 9]})
        # experiment tracking (TensorBoard): the update's scalars, read back as tensorboard reads them
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(tmp_path / "tb" / run / "trainer"))
        acc.Reload()
        assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(upd["step"], pytest.approx(upd["loss"], abs=1e-5))]
        assert [e.value for e in acc.Scalars("reward/mean")] == [pytest.approx(upd["mean_reward"], abs=1e-5)]
        assert [e.value for e in acc.Scalars("policy/version_lag_max")] == [0.0]  # samples of version 0, trained at 0
        assert {"train/approx_kl", "train/clip_fraction", "train/grad_norm", "train/lr", "reward/std",
                "train/advantage_std", "train/zero_variance_group_fraction", "train/tokens_per_s",
                "policy/version"} <= set(acc.Tags()["scalars"])
        manifest = await asyncio.to_thread(checkpoint.download_checkpoint, minio,
                                           checkpoint.checkpoint_uri(s.checkpoint_bucket, run, 1), tmp_path / "v1")
        assert (manifest["trained_offsets"], manifest["consumed_offsets"]) == ({key: 9}, {key: [3, 9]})
        assert checkpoint.check_offset_chain([manifest], start=marker["offsets"]) == []
    finally:
        trainers.kill_all()
        await admin.delete_topics([samples_topic, ckpt_topic])
        await admin.close()
        _remove_run(minio, s.checkpoint_bucket, run)
        shutil.rmtree(s.cache_dir / "trainer" / run, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
async def test_two_rank_trainer_trains_each_sample_once_and_restarts_as_one_group(tmp_path, light_stack, scratch_run,
                                                                                  tiny_model_dir, zero_stage):
    """SPANRL_TRAINER_RANKS=2: the trainer process becomes DeepSpeed's launcher over two ranks;
    rank 0 alone reads and publishes (one checkpoint per version, offsets [0, 4)). SIGKILL of
    rank 1 ends the whole group (the launcher exits with an error); the restarted group resumes
    at the checkpoint and trains the next samples once: the offset chain tiles [0, 8). ZeRO-3:
    the checkpoint holds the gathered weights (the tiny model's tied embeddings included)."""
    from safetensors.torch import load_file

    from spanrl.trainer import ranks

    s = get_settings()
    run, samples_topic, ckpt_topic = _scratch_names(scratch_run, "tr2")
    key = f"{samples_topic}:0"
    admin = await _topics(samples_topic, ckpt_topic)
    minio = checkpoint.make_client(s)
    jsonl = tmp_path / "trainer.jsonl"
    trainers = TrainerProcesses(tmp_path, _trainer_env(
        light_stack, run, tiny_model_dir, samples_topic, ckpt_topic, jsonl, SPANRL_TRAINER_RANKS="2",
        SPANRL_TRAINER_START="earliest", SPANRL_TRAINER_MIN_BATCH="4", SPANRL_TRAINER_MAX_BATCH="4",
        SPANRL_TRAINER_IDLE_FLUSH_S="3600", SPANRL_TRAINER_MICRO_BATCH="1", SPANRL_TRAINER_ZERO_STAGE=str(zero_stage),
        SPANRL_TRAINER_LOGPROB_CHUNK="0" if zero_stage == 3 else "256"))
    start = trainers.start
    try:
        await _produce(samples_topic, 0, 4)
        first = start()
        await _wait_for("the first checkpoint", lambda: _events(jsonl, "checkpoint"), 420, first,
                        tmp_path / "trainer-0.log")
        [upd] = _events(jsonl, "update")  # one line per update: rank 0 speaks for the group
        assert (upd["samples"], upd["consumed"], upd["steps"]) == (4, {key: [0, 4]}, 1)
        assert _events(jsonl, "start")[0]["ranks"] == 2
        pids = ranks.rank_processes(first.pid)
        assert sorted(pids) == [0, 1] and first.pid not in pids.values()
        os.kill(pids[1], signal.SIGKILL)
        rc = await asyncio.to_thread(first.wait, 90)  # the launcher takes rank 0 down and exits with the error
        assert rc != 0
        assert not any(psutil_alive(pid) for pid in pids.values())

        await _produce(samples_topic, 4, 4)
        second = start(SPANRL_TRAINER_MAX_UPDATES="1")
        rc = await asyncio.to_thread(second.wait, 420)
        assert rc == 0, (tmp_path / "trainer-1.log").read_text()[-3000:]
        restart = _events(jsonl, "start")[1]
        assert (restart["offsets"], restart["from"]) == ({key: 4}, {key: "checkpoint"})
        updates = _events(jsonl, "update")
        assert [(u["samples"], u["consumed"]) for u in updates] == [(4, {key: [0, 4]}), (4, {key: [4, 8]})]
        manifests = []
        for v in (1, 2):
            manifests.append(await asyncio.to_thread(checkpoint.download_checkpoint, minio,
                                                     checkpoint.checkpoint_uri(s.checkpoint_bucket, run, v),
                                                     tmp_path / f"v{v}"))
        assert [m["consumed_offsets"] for m in manifests] == [{key: [0, 4]}, {key: [4, 8]}]
        assert checkpoint.check_offset_chain(manifests, start={key: 0}) == []
        # whole weights in every version (ZeRO-3: gathered from both ranks), and they moved
        base, v1, v2 = (load_file(str(d / "model.safetensors")) for d in (tiny_model_dir, tmp_path / "v1", tmp_path / "v2"))
        assert set(v1) == set(base) and all(v1[k].shape == base[k].shape for k in base)
        assert any(not torch.equal(v1[k], base[k]) for k in base) and any(not torch.equal(v2[k], v1[k]) for k in base)
    finally:
        trainers.kill_all()
        await admin.delete_topics([samples_topic, ckpt_topic])
        await admin.close()
        _remove_run(minio, s.checkpoint_bucket, run)
        shutil.rmtree(s.cache_dir / "trainer" / run, ignore_errors=True)


def psutil_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
async def test_checkpoint_upload_rides_out_a_minio_outage(tmp_path, light_stack, scratch_run, tiny_model_dir):
    """MinIO stopped before publish: upload retried with backoff (logged), version 1 is
    published once MinIO is back; a stop during a retry leaves the version unpublished."""
    from spanrl.trainer.train import build_engine, load_model

    s = get_settings()
    run, samples_topic, ckpt_topic = _scratch_names(scratch_run, "trminio")
    key = f"{samples_topic}:0"
    admin = await _topics(samples_topic, ckpt_topic)
    minio = checkpoint.make_client(s)
    jsonl = tmp_path / "trainer.jsonl"
    tr = Trainer(TrainerConfig(run=run, base_dir=tiny_model_dir, samples_topic=samples_topic,
                               checkpoints_topic=ckpt_topic, http=False, log_path=jsonl))
    tr.engine = await asyncio.to_thread(build_engine, load_model(tiny_model_dir), lr=1e-3, micro_batch=2)
    tr._consumed_from, tr.state.trained_offsets = {key: 3}, {key: 7}
    tr.state.last_metrics, tr.state.step = {"loss": 0.25}, 1
    try:
        await asyncio.to_thread(light_stack.stop, "minio")
        publish = asyncio.create_task(tr.publish())
        await _wait_for("2 upload retries", lambda: len(_events(jsonl, "retry")) >= 2, 300)
        assert not publish.done() and tr.state.version == 0
        assert tr.state.pending_checkpoint == checkpoint.checkpoint_uri(s.checkpoint_bucket, run, 1)
        await asyncio.to_thread(light_stack.start, "minio")
        await asyncio.wait_for(publish, 180)
        retries = _events(jsonl, "retry")
        assert [r["attempt"] for r in retries[:2]] == [1, 2] and retries[0]["what"].startswith("upload s3://")
        assert tr.state.version == 1 and tr.state.pending_checkpoint is None
        uri = checkpoint.checkpoint_uri(s.checkpoint_bucket, run, 1)
        manifest = await asyncio.to_thread(checkpoint.download_checkpoint, minio, uri, tmp_path / "v1")
        assert (manifest["consumed_offsets"], manifest["trained_offsets"]) == ({key: [3, 7]}, {key: 7})
        anns = await read_announcements(ckpt_topic, run, s.kafka_bootstrap)
        sha = checkpoint.manifest_sha256(tmp_path / "v1")
        assert [(a["version"], a["manifest_sha256"]) for a in anns] == [(1, sha)]
        # the same upload again (a retry whose first reply was lost) is a no-op; other bytes are refused
        out = s.cache_dir / "trainer" / run / "000001"
        await asyncio.to_thread(checkpoint.upload_checkpoint, minio, out, uri)
        other = tmp_path / "other"
        other.mkdir()
        (other / "x").write_text("x")
        checkpoint.write_manifest(other, run=run, version=1, parent_version=0, base_model="b", step=9,
                                  trained_offsets={key: 8}, metrics={})
        with pytest.raises(checkpoint.CheckpointError, match="already holds a different published manifest"):
            await asyncio.to_thread(checkpoint.upload_checkpoint, minio, other, uri)

        # stopped while MinIO is down: v2 stays unpublished, the trainer's version stays 1
        tr.state.trained_offsets = {key: 9}
        await asyncio.to_thread(light_stack.stop, "minio")
        publish = asyncio.create_task(tr.publish())
        n = len(_events(jsonl, "retry"))
        await _wait_for("a retry of v2", lambda: len(_events(jsonl, "retry")) > n, 300)
        tr.stop()
        with pytest.raises(checkpoint.Stopped):
            await asyncio.wait_for(publish, 60)
        assert tr.state.version == 1
        await asyncio.to_thread(light_stack.start, "minio")
        assert checkpoint.latest_version_in_store(minio, s.checkpoint_bucket, run) == 1
    finally:
        if not light_stack.running("minio"):
            await asyncio.to_thread(light_stack.start, "minio")
        await admin.delete_topics([samples_topic, ckpt_topic])
        await admin.close()
        _remove_run(minio, s.checkpoint_bucket, run)
        shutil.rmtree(s.cache_dir / "trainer" / run, ignore_errors=True)


@pytest.mark.slow
async def test_reloader_download_rides_out_a_minio_outage(tmp_path, light_stack, scratch_run, tiny_model_dir):
    """MinIO down while the reloader fetches an announced checkpoint: retried until MinIO
    is back, then verified; a checksum mismatch is refused at once, never retried."""
    s = get_settings()
    run = scratch_run(f"trreload-{uuid.uuid4().hex[:8]}")
    minio = checkpoint.make_client(s)
    ckpt = tmp_path / "000001"
    shutil.copytree(tiny_model_dir, ckpt)
    checkpoint.write_manifest(ckpt, run=run, version=1, parent_version=0, base_model="tiny", step=1,
                              trained_offsets={"s:0": 4}, consumed_offsets={"s:0": [0, 4]}, metrics={})
    _sign(ckpt)
    uri = checkpoint.checkpoint_uri(s.checkpoint_bucket, run, 1)
    ann = {"run": run, "version": 1, "uri": uri, "manifest_sha256": checkpoint.manifest_sha256(ckpt)}
    rl = Reloader(ReloaderConfig(run=run, http=False, watch_interval_s=0))
    dest = s.cache_dir / "checkpoints" / run / "000001"
    try:
        await asyncio.to_thread(checkpoint.upload_checkpoint, minio, ckpt, uri)
        await asyncio.to_thread(light_stack.stop, "minio")
        entry: dict = {}
        fetch = asyncio.create_task(rl.fetch(ann, entry))
        await _wait_for("a download retry", lambda: entry.get("retries", 0) >= 1, 300)
        assert not fetch.done() and not dest.exists()
        await asyncio.to_thread(light_stack.start, "minio")
        assert await asyncio.wait_for(fetch, 180) == dest
        assert checkpoint.verify_manifest(dest)["version"] == 1

        bad = dict(ann, manifest_sha256="0" * 64)
        entry = {}
        with pytest.raises(checkpoint.CheckpointError, match="manifest sha256"):
            await rl.fetch(bad, entry)
        assert "retries" not in entry and not dest.exists()
    finally:
        if not light_stack.running("minio"):
            await asyncio.to_thread(light_stack.start, "minio")
        _remove_run(minio, s.checkpoint_bucket, run)
        shutil.rmtree(s.cache_dir / "checkpoints" / run, ignore_errors=True)


# ---- policy-version labels across vLLM and proxy restarts (needs vLLM) -----------------

async def _spans(topic: str, rollout_id: str, at_least: int = 0, timeout_s: float = 30.0) -> list[dict]:
    """The rollout's span records on ``topic`` (read_committed, from the beginning); read again
    until there are ``at_least`` of them or ``timeout_s`` passed (what was read is returned
    either way: the caller asserts). Fails if the topic's partitions never show up."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from spanrl.schemas.codec import decode
    from spanrl.core.partitions import topic_partitions

    deadline = time.monotonic() + timeout_s
    while True:
        c = AIOKafkaConsumer(bootstrap_servers=get_settings().kafka_bootstrap, group_id=None,
                             isolation_level="read_committed", enable_auto_commit=False)
        await c.start()
        try:
            parts = await topic_partitions(c, topic)
            assert parts, f"no partitions for {topic}"
            tps = [TopicPartition(topic, p) for p in parts]
            c.assign(tps)
            end = await c.end_offsets(tps)
            await c.seek_to_beginning(*tps)
            out = []
            while any([await c.position(t) < end[t] for t in tps]):
                for msgs in (await c.getmany(timeout_ms=1000)).values():
                    out += [decode("span", m.value) for m in msgs]
        finally:
            await c.stop()
        mine = [x for x in out if x["rollout_id"] == rollout_id]
        if len(mine) >= at_least or time.monotonic() > deadline:
            return mine
        await asyncio.sleep(1.0)


def _port_free(host: str, port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex((host, port)) != 0


@pytest.mark.slow
async def test_policy_version_labels_survive_vllm_and_proxy_restarts(tmp_path, light_stack, scratch_run):
    """The proxy starts with the reloader's served version (not 0); when vLLM goes, the
    proxy answers 503 policy_unsynced (never a call under a wrong label) until the
    reloader has reloaded the served checkpoint into the restarted vLLM and posted it."""
    from spanrl.producers.kafka import Topics, create_topics, delete_topics

    s = get_settings()
    light_stack.up(["vllm"])
    await _vllm_ready(s.vllm_url)
    tag = uuid.uuid4().hex[:8]
    run, ckpt_topic = scratch_run(f"trlabel-{tag}"), f"trlabel-checkpoints-{tag}"
    topics = Topics.with_prefix(f"trlabel-{tag}-")
    await create_topics(s.kafka_bootstrap, topics.all())
    admin = await _topics(ckpt_topic)
    # "v1": the base weights (hard links) under a checkpoint manifest: the label is what is
    # tested here, download and verification are tested above
    ckpt = tmp_path / "000001"
    shutil.copytree(s.model_dir, ckpt, copy_function=os.link)
    checkpoint.write_manifest(ckpt, run=run, version=1, parent_version=0, base_model="base", step=1,
                              trained_offsets={}, metrics={})
    uri = checkpoint.checkpoint_uri(s.checkpoint_bucket, run, 1)
    # this test owns the proxy and reloader ports: the full stack's own proxy and reloader
    # (when `make test` runs it) step aside and come back afterwards
    displaced = [n for n in ("proxy", "reloader") if light_stack.running(n)]
    for n in displaced:
        await asyncio.to_thread(light_stack.stop, n)
    rl = Reloader(ReloaderConfig(run=run, checkpoints_topic=ckpt_topic, start="latest", watch_interval_s=1.0))
    reloader_task = proxy = None
    proxy_url = s.proxy_url
    chat_url = f"{proxy_url}/rollouts/{run}/attempts/0/v1/chat/completions"
    body = {"model": s.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    try:
        assert await rl.load(1, ckpt, uri) is True
        reloader_task = asyncio.create_task(rl.serve())
        await _wait_for("the reloader to serve v1", lambda: rl.vllm_synced and rl.served_version == 1, 300)

        # (a) a proxy started now asks the reloader: v1, not 0
        # the stack's proxy has gone (stop waits for it): this test's proxy must be the one
        # answering on the port, or its calls would be recorded to the stack's topics
        await _wait_for(f"port {s.proxy_port} to be free", lambda: _port_free(s.host, s.proxy_port), 30)
        proxy_log = tmp_path / "proxy.log"
        proxy = subprocess.Popen([sys.executable, "-m", "spanrl.producers.proxy", "--port", str(s.proxy_port),
                                  "--topic-prefix", f"trlabel-{tag}-", "--vllm-url", s.vllm_url,
                                  "--reloader-url", f"http://{s.host}:{s.reloader_port}"], cwd=ROOT,
                                 stdout=proxy_log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
        async with httpx.AsyncClient(timeout=120, headers=admin_headers()) as http:  # auth on: every route
            async def proxy_state() -> dict:
                try:
                    return (await http.get(f"{proxy_url}/admin/policy_version")).json()
                except httpx.HTTPError:
                    return {}

            deadline = time.monotonic() + 60
            while not (await proxy_state()) and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            assert proxy.poll() is None, proxy_log.read_text()[-3000:]
            assert (await proxy_state())["version"] == 1 and (await proxy_state())["synced"] is True
            assert (await http.post(chat_url, json=body)).status_code == 200

            # (b) vLLM goes: the proxy is told (no call needed) and refuses calls
            await asyncio.to_thread(light_stack.stop, "vllm")
            deadline = time.monotonic() + 30
            while (await proxy_state())["synced"] and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            assert (await proxy_state())["synced"] is False
            r = await http.post(chat_url, json=body)
            assert (r.status_code, r.json()["error"]["type"]) == (503, "policy_unsynced") and r.headers["retry-after"]

            # vLLM back (base weights): calls are refused until the reloader re-applied v1
            answers: list[tuple[float, int]] = []

            async def keep_calling():
                while True:
                    try:
                        answers.append((time.time() * 1000, (await http.post(chat_url, json=body)).status_code))
                    except httpx.HTTPError:
                        answers.append((time.time() * 1000, -1))
                    await asyncio.sleep(0.5)

            caller = asyncio.create_task(keep_calling())
            await asyncio.to_thread(light_stack.start, "vllm")
            deadline = time.monotonic() + 120
            while not (await proxy_state())["synced"] and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            deadline = time.monotonic() + 120
            while 200 not in [st for _, st in answers] and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            caller.cancel()
            await asyncio.gather(caller, return_exceptions=True)
            assert (await proxy_state()) == {"version": 1, "checkpoint": uri, "synced": True, "managed": True,
                                             "reason": None}
            reapply = [h for h in rl.history if h.get("event") == "reapply" and h["reloaded"]]
            assert reapply, rl.history
            reapplied_ms = reapply[-1]["at_ms"] + reapply[-1]["reload_s"] * 1000
            assert [st for t, st in answers if t < reapplied_ms and st == 200] == [], answers
            assert 200 in [st for _, st in answers], answers
            assert (await http.post(chat_url, json=body)).status_code == 200
            assert proxy.poll() is None, proxy_log.read_text()[-3000:]
        spans = await _spans(topics.spans.name, run, at_least=3)
        assert len(spans) >= 3, (len(spans), proxy_log.read_text()[-3000:])
        assert {sp["llm"]["policy_version"] for sp in spans} == {1}
    finally:
        if proxy is not None:
            os.killpg(proxy.pid, signal.SIGTERM)
            proxy.wait(20)
        rl.stop()
        if reloader_task is not None:
            await asyncio.wait_for(reloader_task, 30)
        if light_stack.healthy("vllm"):
            await reload_vllm(s.vllm_url, s.model_dir)
        await admin.delete_topics([ckpt_topic])
        await admin.close()
        await delete_topics(s.kafka_bootstrap, [t.name for t in topics.all()])
        for n in displaced:
            await asyncio.to_thread(light_stack.start, n)


def test_prune_store_keeps_newest_weights_and_every_manifest(tmp_path, light_stack, scratch_run):
    """SPANRL_TRAINER_KEEP_PUBLISHED: older versions lose their weight files in MinIO but keep
    their manifests (the offset chain stays checkable); the newest stay downloadable."""
    s = get_settings()
    client = checkpoint.make_client(s)
    run = scratch_run(f"trprune-{uuid.uuid4().hex[:8]}")
    try:
        for v in (1, 2, 3):
            d = tmp_path / f"{v:06d}"
            d.mkdir()
            (d / "model.safetensors").write_bytes(bytes([v]) * 64)
            checkpoint.write_manifest(d, run=run, version=v, parent_version=v - 1, base_model="b", step=v,
                                      trained_offsets={"samples:0": v}, metrics={})
            checkpoint.upload_checkpoint(client, d, checkpoint.checkpoint_uri(s.checkpoint_bucket, run, v))
        assert checkpoint.prune_store(client, s.checkpoint_bucket, run, keep=1) == [1, 2]
        names = sorted(o.object_name for o in client.list_objects(s.checkpoint_bucket, prefix=f"{run}/",
                                                                   recursive=True))
        assert names == [f"{run}/000001/manifest.json", f"{run}/000002/manifest.json",
                         f"{run}/000003/manifest.json", f"{run}/000003/model.safetensors"]
        assert checkpoint.latest_version_in_store(client, s.checkpoint_bucket, run) == 3
        assert checkpoint.download_checkpoint(client, checkpoint.checkpoint_uri(s.checkpoint_bucket, run, 3),
                                              tmp_path / "r3")["version"] == 3
        with pytest.raises(checkpoint.CheckpointError):
            checkpoint.download_checkpoint(client, checkpoint.checkpoint_uri(s.checkpoint_bucket, run, 1),
                                           tmp_path / "r1")
        assert checkpoint.prune_store(client, s.checkpoint_bucket, run, keep=1) == []  # idempotent
    finally:
        for o in client.list_objects(s.checkpoint_bucket, prefix=f"{run}/", recursive=True):
            client.remove_object(s.checkpoint_bucket, o.object_name)


def test_spanrl_runs_and_clean_delete_a_run_from_minio_and_disk(tmp_path, light_stack, scratch_run):
    """`spanrl clean PATTERN` deletes the matching runs' MinIO objects and local copies,
    `--dry-run` deletes nothing, other runs stay; `spanrl runs` lists them with sizes."""
    s = get_settings()
    client = checkpoint.make_client(s)
    tag = uuid.uuid4().hex[:8]
    doomed, kept = scratch_run(f"trclean-{tag}-a"), scratch_run(f"trclean-{tag}-b")
    for run in (doomed, kept):
        d = tmp_path / run / "000001"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"w" * 1000)
        checkpoint.write_manifest(d, run=run, version=1, parent_version=0, base_model="b", step=1,
                                  trained_offsets={"samples:0": 1}, metrics={})
        checkpoint.upload_checkpoint(client, d, checkpoint.checkpoint_uri(s.checkpoint_bucket, run, 1))
        shutil.copytree(d, s.cache_dir / "trainer" / run / "000001")
    runs = checkpoint.list_runs(client, s.checkpoint_bucket, s.cache_dir)
    assert runs[doomed]["store_objects"] == 2 and runs[doomed]["store_bytes"] > 1000
    assert runs[doomed]["local_bytes"] == runs[doomed]["store_bytes"]

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "spanrl.infra.cli", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})

    listed = cli("runs")
    assert listed.returncode == 0 and doomed in listed.stdout and kept in listed.stdout, listed.stdout + listed.stderr
    dry = cli("clean", f"trclean-{tag}-a*", "--dry-run")
    assert dry.returncode == 0 and f"would delete {doomed}" in dry.stdout, dry.stdout + dry.stderr
    assert checkpoint.latest_version_in_store(client, s.checkpoint_bucket, doomed) == 1
    done = cli("clean", f"trclean-{tag}-a*")
    assert done.returncode == 0 and f"deleted {doomed}: 2 objects" in done.stdout, done.stdout + done.stderr
    assert not list(client.list_objects(s.checkpoint_bucket, prefix=f"{doomed}/", recursive=True))
    assert not (s.cache_dir / "trainer" / doomed).exists()
    assert checkpoint.latest_version_in_store(client, s.checkpoint_bucket, kept) == 1
    assert (s.cache_dir / "trainer" / kept / "000001" / "model.safetensors").exists()
    assert cli("clean", "").returncode == 2  # no pattern: a usage error, nothing deleted


# ---- the staleness bound (Kafka + MinIO, the tiny model) ---------------------------------

async def test_stale_samples_are_refused_dead_lettered_and_counted(tmp_path, light_stack, scratch_run, tiny_model_dir):
    """A run started from a version-6 checkpoint (``init_from``) trains at version 6 with
    ``max_staleness`` 4: samples made by versions 6, 5, 2, 1, 0 have lags 0, 1, 4, 5, 6; the
    last two are refused (dead letters ``stale_sample`` on the dead-letter topic, with lag,
    source offset), the others trained; the status and the new checkpoint's manifest report
    the lag histogram and the refused count."""
    from spanrl.schemas.codec import decode

    s = get_settings()
    tag = uuid.uuid4().hex[:8]
    base, run = scratch_run(f"trstale-base-{tag}"), scratch_run(f"trstale-{tag}")
    samples_topic, ckpt_topic, dead_topic = (f"trstale-{x}-{tag}" for x in ("samples", "checkpoints", "dead"))
    key = f"{samples_topic}:0"
    admin = await _topics(samples_topic, ckpt_topic, dead_topic)
    minio = checkpoint.make_client(s)
    ckpt = tmp_path / "000006"
    shutil.copytree(tiny_model_dir, ckpt)
    checkpoint.write_manifest(ckpt, run=base, version=6, parent_version=5, base_model="tiny", step=6,
                              trained_offsets={}, metrics={})
    try:
        await asyncio.to_thread(checkpoint.upload_checkpoint, minio, ckpt,
                                checkpoint.checkpoint_uri(s.checkpoint_bucket, base, 6))
        from aiokafka import AIOKafkaProducer

        producer = AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap, enable_idempotence=True)
        await producer.start()
        for i, version in enumerate((6, 5, 2, 1, 0)):
            smp = _toy_sample(i)
            smp["transition"]["policy_version"] = version
            await producer.send_and_wait(samples_topic, encode("sample", smp), key=b"t")
        await producer.stop()
        cfg = TrainerConfig(run=run, base_dir=tiny_model_dir, init_from=f"{base}:6", samples_topic=samples_topic,
                            checkpoints_topic=ckpt_topic, dead_letter_topic=dead_topic, min_batch=5, micro_batch=4,
                            max_updates=1, http=False, start="earliest", lr=1e-3, log_path=tmp_path / "t.jsonl")
        trainer = Trainer(cfg)
        await asyncio.wait_for(trainer.serve(), timeout=300)
        assert trainer.state.version == 7
        want = {"max_staleness": 4, "policy": "refuse", "lag_histogram": {"0": 1, "1": 1, "4": 1}, "refused": 2,
                "kept": 0}
        assert trainer.status()["staleness"] == want
        [upd] = _events(tmp_path / "t.jsonl", "update")
        assert (upd["samples"], upd["max_lag"], upd["consumed"]) == (3, 4, {key: [0, 5]})
        manifest = await asyncio.to_thread(checkpoint.download_checkpoint, minio,
                                           checkpoint.checkpoint_uri(s.checkpoint_bucket, run, 7), tmp_path / "v7")
        assert manifest["staleness"] == want and manifest["consumed_offsets"] == {key: [0, 5]}
        from spanrl.infra.replay import read_records

        dead = [decode("dead_letter", v) for _, _, _, v in await read_records(s.kafka_bootstrap, dead_topic)]
        assert [(d["reason"], d["stage"], d["source_topic"], d["source_offset"], d["rollout_id"]) for d in dead] == [
            ("stale_sample", "trainer", samples_topic, 3, "r-3"), ("stale_sample", "trainer", samples_topic, 4, "r-4")]
        assert dead[0]["detail"].startswith("lag 5 > max_staleness 4: behaviour version 1, trained version 6")
    finally:
        await admin.delete_topics([samples_topic, ckpt_topic, dead_topic])
        await admin.close()
        for r in (base, run):
            _remove_run(minio, s.checkpoint_bucket, r)
            shutil.rmtree(s.cache_dir / "trainer" / r, ignore_errors=True)


async def test_a_sample_of_a_larger_vocabulary_is_skipped_and_counted(tmp_path, light_stack, scratch_run,
                                                                     tiny_model_dir):
    """A sample whose token ids the trained model has no embedding row for (here Qwen2.5's
    ``<|endoftext|>``, 151643, in a trainer of SmolLM2's 49,152-token vocabulary: a topic made by
    another model replayed into this trainer) is skipped with reason ``token_id_out_of_vocab``
    and counted; the others are trained and the offsets move past all three. Without the check
    the embedding raised IndexError mid-update and the trainer died."""
    run, samples_topic, ckpt_topic = _scratch_names(scratch_run, "trvocab")
    admin = await _topics(samples_topic, ckpt_topic)
    try:
        from aiokafka import AIOKafkaProducer

        producer = AIOKafkaProducer(bootstrap_servers=get_settings().kafka_bootstrap, enable_idempotence=True)
        await producer.start()
        for i in range(3):
            smp = _toy_sample(i)
            if i == 1:
                smp["transition"]["completion_token_ids"] = [151643, 2]
            await producer.send_and_wait(samples_topic, encode("sample", smp), key=b"t")
        await producer.stop()
        log = tmp_path / "t.jsonl"
        cfg = TrainerConfig(run=run, base_dir=tiny_model_dir, samples_topic=samples_topic, checkpoints_topic=ckpt_topic,
                            min_batch=2, idle_flush_s=5.0, micro_batch=2, max_updates=1, http=False, start="earliest",
                            log_path=log)
        trainer = Trainer(cfg)
        await asyncio.wait_for(trainer.serve(), timeout=300)
        assert trainer.state.skipped == {"token_id_out_of_vocab": 1}
        [upd] = _events(log, "update")
        assert (upd["samples"], upd["consumed"], upd["skipped"]) == (
            2, {f"{samples_topic}:0": [0, 3]}, {"token_id_out_of_vocab": 1})
    finally:
        await admin.delete_topics([samples_topic, ckpt_topic])
        await admin.close()


# ---- barrier batching (Kafka + MinIO, the tiny model) --------------------------------------

async def test_barrier_trainer_trains_exactly_the_requested_samples(tmp_path, light_stack, scratch_run,
                                                                    tiny_model_dir):
    """SPANRL_TRAINER_BATCHING=barrier: 6 samples buffered and nothing trained (min_batch 2,
    idle flush 0.2 s would have); asked to train up to offset 4: one update of exactly those 4
    (2 mini-batch steps), one checkpoint whose manifest consumed [0, 4); then up to 6: the rest.
    A stream trainer answers the request 409, a malformed one is 400."""
    run, samples_topic, ckpt_topic = _scratch_names(scratch_run, "trbar")
    admin = await _topics(samples_topic, ckpt_topic)
    try:
        await _produce(samples_topic, 0, 6)
        log = tmp_path / "trainer.jsonl"
        cfg = TrainerConfig(run=run, base_dir=tiny_model_dir, samples_topic=samples_topic,
                            checkpoints_topic=ckpt_topic, min_batch=2, idle_flush_s=0.2, micro_batch=2,
                            batching="barrier", mini_batches=2, http=False, start="earliest", log_path=log)
        tr = Trainer(cfg)
        assert (await Trainer(cfg.model_copy(update={"batching": "stream"})).request_train(
            {"until": {f"{samples_topic}:0": 4}}))[0] == 409
        assert (await tr.request_train({"until": {"other:0": 4}}))[0] == 400
        assert (await tr.request_train({"until": {f"{samples_topic}:0": -1}}))[0] == 400
        task = asyncio.create_task(tr.serve())
        await _wait_for("the trainer to buffer 6 samples", lambda: tr.state.buffered == 6, 180)
        await asyncio.sleep(1.5)  # several idle flushes' worth: a stream trainer would have trained
        assert tr.state.updates == 0 and not _events(log, "update")
        code, answer = await tr.request_train({"until": {f"{samples_topic}:0": 4}})
        assert (code, answer) == (202, {"until": {f"{samples_topic}:0": 4}})
        await _wait_for("the first update", lambda: tr.state.version == 1, 180)
        upd = _events(log, "update")
        assert [(u["samples"], u["steps"], u["mini_batches"], u["consumed"]) for u in upd] == [
            (4, 2, 2, {f"{samples_topic}:0": [0, 4]})]
        assert tr.state.trained_offsets == {f"{samples_topic}:0": 4} and tr.state.train_until == {}
        await tr.request_train({"until": {f"{samples_topic}:0": 6}})
        await _wait_for("the second update", lambda: tr.state.version == 2, 180)
        tr.stop()
        await asyncio.wait_for(task, 60)
        assert [(u["samples"], u["consumed"]) for u in _events(log, "update")] == [
            (4, {f"{samples_topic}:0": [0, 4]}), (2, {f"{samples_topic}:0": [4, 6]})]
        assert tr.state.step == 4  # 2 mini-batch steps per update
    finally:
        await admin.delete_topics([samples_topic, ckpt_topic])
        await admin.close()
