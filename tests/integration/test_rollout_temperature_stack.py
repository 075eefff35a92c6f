"""SPANRL_ROLLOUT_TEMPERATURE against the real parts: a second vLLM started as the stack would
start it with the setting (``--logprobs-mode processed_logprobs``), a proxy with the setting
in front of it on this test's own topics, the OpenAI client, Kafka, and the trainer's own
log-prob code (trainer/train.py completion_logprobs). The proxy samples the client's call at
the rollout temperature, and the log-probs vLLM reports for it are the trainer's at that
temperature, not its raw ones; vLLM's ``/server_info`` tells the two modes apart as the
proxy's check reads it."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest
import torch
from openai import OpenAI
from services import free_port, of_rollout, own_topics, read_topic, start_service, stop, topic_prefix

from spanrl.core.settings import StackSettings, get_settings
from spanrl.infra.stack import ROOT, Stack, vllm_args
from spanrl.producers.proxy import logprobs_mode_problem
from spanrl.trainer.train import completion_logprobs, load_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]


TEMPERATURE = 0.5
PROMPT = "Name three colours and say why you like them."


@pytest.fixture(scope="module")
def processed_vllm():
    """A vLLM of the stack's base model with the stack's arguments at ``TEMPERATURE``, on a
    free port; the stack's own vLLM (raw log-probs) runs beside it."""
    s = get_settings()
    Stack(s).start("kafka")
    Stack(s).start("vllm")
    port = free_port()
    args = vllm_args(s.model_copy(update={"rollout_temperature": TEMPERATURE, "vllm_port": port}))
    (s.state_dir / "logs").mkdir(parents=True, exist_ok=True)
    log_path = s.state_dir / "logs" / "vllm-rollout-temperature.log"
    with open(log_path, "wb") as log:
        # its own process group: vLLM's engine and worker processes go with it (a SIGTERM to the
        # server alone left a starved engine behind once, holding 3 GB)
        proc = subprocess.Popen([sys.executable, "-m", "spanrl.infra.vllm_server", *args], cwd=ROOT,
                                env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_SERVER_DEV_MODE": "1",
                                     "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": StackSettings().vllm_threads},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://{s.host}:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"vLLM exited with {proc.returncode}; log {log_path}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"vLLM not healthy after 300 s; log {log_path}"
            time.sleep(1)
        yield url
    finally:
        _stop_group(proc)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group of ``proc``, SIGKILL after 30 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_vllm_server_info_tells_the_logprobs_modes_apart(processed_vllm, settings):
    for url, mode in ((processed_vllm, "processed_logprobs"), (settings.vllm_url, "raw_logprobs")):
        r = httpx.get(url + "/server_info", params={"config_format": "json"}, timeout=120)
        assert r.status_code == 200 and r.json()["vllm_config"]["model_config"]["logprobs_mode"] == mode
        problem = logprobs_mode_problem(r.status_code, r.json())
        assert problem is None if mode == "processed_logprobs" else "vLLM returns raw_logprobs" in problem


def test_a_training_call_is_sampled_at_the_rollout_temperature_with_the_trainers_logprobs(processed_vllm, settings):
    rid = uuid.uuid4().hex
    with own_topics("rtemp") as topics:
        proxy, proxy_url = start_service("spanrl.producers.proxy", "--topic-prefix", topic_prefix(topics),
                                         "--vllm-url", processed_vllm, "--reloader-url", "",
                                         env={"SPANRL_ROLLOUT_TEMPERATURE": str(TEMPERATURE)})
        try:
            client = OpenAI(base_url=f"{proxy_url}/rollouts/{rid}/attempts/0/v1", api_key="x", max_retries=0)
            answer = client.chat.completions.create(model=settings.model_name, max_tokens=24, temperature=1.0,
                                                    seed=7, messages=[{"role": "user", "content": PROMPT}])
            assert answer.choices[0].message.content
            status = httpx.get(proxy_url + "/status").json()
        finally:
            stop(proxy)
        [span] = of_rollout(read_topic(topics.spans, lambda rs: bool(of_rollout(rs, rid)), 20), rid)
    assert status["rollout_temperature_set"] == 1
    llm = span["llm"]
    assert llm["temperature"] == TEMPERATURE
    P, C = len(llm["prompt_token_ids"]), len(llm["completion_token_ids"])
    ids = torch.tensor([llm["prompt_token_ids"] + llm["completion_token_ids"]])
    mask = torch.zeros_like(ids, dtype=torch.float32)
    mask[0, P:] = 1.0
    model = load_model(settings.model_dir)
    with torch.no_grad():
        at_t, raw = (completion_logprobs(model, ids, torch.ones_like(ids), mask, C + 1, 256, t)[0, 1:]
                     for t in (TEMPERATURE, None))
    served = torch.tensor(llm["completion_logprobs"])
    tempered_gap, raw_gap = float((served - at_t).abs().max()), float((served - raw).abs().max())
    print(f"{C} tokens: max |vLLM - trainer| at T={TEMPERATURE} {tempered_gap:.2e}, raw {raw_gap:.2e}")
    assert tempered_gap < 1e-2 and raw_gap > 10 * tempered_gap
