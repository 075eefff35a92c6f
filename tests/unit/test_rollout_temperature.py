"""SPANRL_ROLLOUT_TEMPERATURE: training calls sampled below (or above) temperature 1 with
log-probs that match on both sides. The setting's bounds, vLLM's ``--logprobs-mode`` from the
stack, the proxy's refusals and its check of vLLM's mode (a fake vLLM behind the real app), and
the trainer's log-probs at the temperature: exact on a tiny vocabulary (chunked = full with
gradients: tests/unit/test_trainer_memory.py), and an on-policy update whose importance ratio
is 1 only at the sampling temperature. tests/integration/test_rollout_temperature_stack.py checks
the real vLLM's processed log-probs against the trainer's."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import httpx
import pytest
import torch
from fastapi import FastAPI, Request
from pydantic import ValidationError

import deepspeed  # noqa: E402,F401  (installed by infra/bootstrap.sh)
from test_learning import rollout, tiny_model  # noqa: E402

from spanrl.core.settings import PROCESSED_LOGPROBS, Settings  # noqa: E402
from spanrl.infra.stack import vllm_args  # noqa: E402
from spanrl.producers.proxy import NEUTRAL_SAMPLING, logprobs_mode_problem, untrainable_sampling  # noqa: E402
from spanrl.trainer import losses  # noqa: E402
from spanrl.trainer.train import build_engine, train_update  # noqa: E402


def test_the_setting_is_unset_or_a_positive_finite_temperature():
    assert Settings().rollout_temperature is None
    assert Settings(rollout_temperature="0.6").rollout_temperature == 0.6
    assert Settings(rollout_temperature="none").rollout_temperature is None
    for bad in (0, -0.5, "nan", "inf", "warm"):
        with pytest.raises(ValidationError, match="rollout_temperature"):
            Settings(rollout_temperature=bad)


def test_vllm_returns_processed_logprobs_only_with_a_rollout_temperature():
    s = Settings(base_model_dir=Path("/m"), vllm_tool_call_parser="", vllm_chat_template="")
    assert "--logprobs-mode" not in vllm_args(s)
    assert vllm_args(s.model_copy(update={"rollout_temperature": 0.6}))[-2:] == ["--logprobs-mode", PROCESSED_LOGPROBS]


def test_untrainable_sampling_names_what_the_trainer_cannot_score():
    assert untrainable_sampling({"temperature": 0.2, "top_p": 1.0, "top_k": -1, "min_p": 0, "logit_bias": {},
                                 "repetition_penalty": 1, "presence_penalty": 0.0, "min_tokens": 0}) is None
    assert untrainable_sampling({"top_p": 0.9, "top_k": 0, "frequency_penalty": 0.5, "logit_bias": {"7": -100}}) == (
        'top_p=0.9, frequency_penalty=0.5, logit_bias={"7": -100}: with SPANRL_ROLLOUT_TEMPERATURE set, training '
        "calls sample the softmax at that temperature untruncated (the trainer scores no truncation or bias); leave "
        "these out of training calls")
    assert untrainable_sampling({"top_k": 20}).startswith("top_k=20: ")


def test_logprobs_mode_problem_reads_vllms_server_info():
    info = {"vllm_config": {"model_config": {"logprobs_mode": PROCESSED_LOGPROBS}}}
    assert logprobs_mode_problem(200, info) is None
    raw = {"vllm_config": {"model_config": {"logprobs_mode": "raw_logprobs"}}}
    assert logprobs_mode_problem(200, raw) == (
        "vLLM returns raw_logprobs; start it with --logprobs-mode processed_logprobs")
    assert logprobs_mode_problem(200, {"vllm_config": "text"}) == (
        "vLLM returns None; start it with --logprobs-mode processed_logprobs")
    assert logprobs_mode_problem(404, None).startswith("GET /server_info answered 404: its logprobs mode cannot")


def _fake_vllm(mode: str, seen: list[dict]) -> FastAPI:
    """vLLM's two routes the proxy uses here: ``/server_info`` in ``mode`` and a chat answer
    with token ids and log-probs; each chat body is appended to ``seen``."""
    app = FastAPI()

    @app.get("/server_info")
    async def server_info(config_format: str = "text"):
        assert config_format == "json"
        seen.append({"server_info": config_format})
        return {"vllm_config": {"model_config": {"logprobs_mode": mode}}}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        seen.append(await request.json())
        return {"id": "chatcmpl-1", "model": "policy", "prompt_token_ids": [1, 2],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "token_ids": [5],
                             "finish_reason": "stop", "logprobs": {"content": [{"token": "hi", "logprob": -0.5}]}}],
                "usage": {"prompt_tokens": 2, "completion_tokens": 1}}

    return app


@pytest.mark.parametrize("mode", [PROCESSED_LOGPROBS, "raw_logprobs"])
def test_the_proxy_sets_the_training_temperature_once_vllm_is_in_processed_mode(mode):
    """Training calls (chat, and the Responses API through chat) get the rollout temperature
    and neutral truncation fields, or a 400 naming what the trainer cannot score; vLLM's mode
    is read once (raw: 503 ``vllm_logprobs_mode`` and asked again, nothing forwarded);
    evaluation routes keep their own temperature. Kafka is unreachable, so a forwarded call
    ends in 503 after vLLM answered."""
    from fastapi.testclient import TestClient

    from spanrl.producers.kafka import Sink, Topics
    from spanrl.producers.proxy import create_app

    app = create_app(Sink("127.0.0.1:1", Topics(), send_timeout_s=0.5), "http://127.0.0.1:1", "policy",
                     rollout_temperature=0.6)
    seen: list[dict] = []
    chat = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    train_url = "/rollouts/r/attempts/0/v1"
    with TestClient(app) as client:
        app.state.client = httpx.AsyncClient(transport=httpx.ASGITransport(_fake_vllm(mode, seen)),
                                             base_url="http://vllm")
        top_p = client.post(f"{train_url}/chat/completions", json={**chat, "top_p": 0.5})
        train = client.post(f"{train_url}/chat/completions", json={**chat, "temperature": 1.0})
        same = client.post(f"{train_url}/chat/completions", json={**chat, "temperature": 0.6, "top_k": -1})
        responses = client.post(f"{train_url}/responses", json={"model": "policy", "input": "x", "temperature": 0.2})
        evaluation = client.post("/eval/0.0/rollouts/r/attempts/0/v1/chat/completions", json=chat)
        m = client.get("/status").json()
    assert (top_p.status_code, top_p.json()["error"]["type"]) == (400, "untrainable_sampling")
    assert evaluation.status_code == 503  # vLLM answered; Kafka did not take the span
    infos = [b for b in seen if "server_info" in b]
    calls = [b for b in seen if "server_info" not in b]
    if mode == PROCESSED_LOGPROBS:
        assert len(infos) == 1  # read once
        assert [c["temperature"] for c in calls] == [0.6, 0.6, 0.6, 0.0]
        assert [r.status_code for r in (train, same, responses)] == [503, 503, 503]  # Kafka, after vLLM
        # the model's generation_config.json cannot fill in a truncation; evaluation calls are left as sent
        assert {k: calls[0][k] for k in NEUTRAL_SAMPLING} == NEUTRAL_SAMPLING == {
            "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "repetition_penalty": 1.0}
        assert calls[1]["top_k"] == -1 and not set(NEUTRAL_SAMPLING) & set(calls[3])
        assert m["rollout_temperature_set"] == 2  # the chat call at 1.0 and the Responses call at 0.2
    else:
        assert len(infos) == 3  # asked again by each training call
        for r in (train, same, responses):
            assert (r.status_code, r.json()["error"]["type"]) == (503, "vllm_logprobs_mode")
        assert "start it with --logprobs-mode processed_logprobs" in train.json()["error"]["message"]
        assert [c["temperature"] for c in calls] == [0.0]  # only the evaluation call reached vLLM
        assert m.get("rollout_temperature_set", 0) == 0


def test_token_logprobs_at_a_temperature_tiny_logits():
    # logits [0, ln 2, 0] at T = 0.5 -> [0, ln 4, 0] -> p = [1/6, 2/3, 1/6]; uniform logits stay uniform
    logits = torch.tensor([[[0.0, 0.0, 0.0], [0.0, math.log(2.0), 0.0], [9.0, 9.0, 9.0]]])
    ids, mask = torch.tensor([[2, 0, 1]]), torch.tensor([[0.0, 1.0, 1.0]])
    out = losses.token_logprobs(logits, ids, mask, temperature=0.5)
    assert torch.allclose(out, torch.tensor([[0.0, -math.log(3.0), math.log(2 / 3)]]), atol=1e-6)
    assert torch.equal(losses.token_logprobs(logits, ids, mask, None), losses.token_logprobs(logits, ids, mask))
    x = torch.ones(2)
    assert losses.tempered(x, None) is x and losses.tempered(x, 1.0) is x
    assert torch.equal(losses.tempered(x, 0.25), torch.full((2,), 4.0))
    with pytest.raises(ValueError, match="must be > 0"):
        losses.tempered(x, 0.0)


@pytest.mark.parametrize("logprob_chunk", [0, 256])
def test_an_update_on_samples_drawn_at_a_temperature_is_on_policy_only_at_it(logprob_chunk):
    """Completions sampled at T = 0.5 with their tempered behaviour log-probs: the trainer's
    first step sees an importance ratio of 1 (approx KL ~0, nothing clipped) and a reference
    KL of 0 when it scores policy and reference at 0.5, and a different distribution when it
    scores the raw logits (the mismatch vLLM's
    default raw log-probs would give at a temperature other than 1)."""
    gen = torch.Generator().manual_seed(11)
    base = tiny_model(11)
    samples, _ = rollout(base, gen, 0, temperature=0.5)

    ref = copy.deepcopy(base).eval().requires_grad_(False)  # the reference is scored at the same temperature

    def update(temperature):
        engine = build_engine(copy.deepcopy(base), lr=1e-3, micro_batch=64)
        return train_update(engine, samples, micro_batch=64, logprob_chunk=logprob_chunk, temperature=temperature,
                            ref_model=ref, kl_coef=0.1)

    matched, unmatched = update(0.5), update(None)
    assert abs(matched["approx_kl"]) < 1e-6 and matched["clip_frac"] == 0.0 and abs(matched["ref_kl"]) < 1e-6
    assert unmatched["approx_kl"] > 100 * max(abs(matched["approx_kl"]), 1e-8) and unmatched["clip_frac"] > 0.1
