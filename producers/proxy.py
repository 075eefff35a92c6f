"""OpenAI-compatible LLM proxy in front of vLLM that records every call as a Span.

    python -m producers.proxy [--port P] [--topic-prefix X] [--policy-version V]

An agent points its OpenAI client at the per-rollout base URL
``{proxy}/rollouts/{rollout_id}/attempts/{attempt_id}/v1``. The proxy asks vLLM for
token ids and log-probs of every call, records them (never re-tokenised) with the
current policy version in a Span (source=proxy, kind=llm), waits for Kafka to
acknowledge it, and only then returns vLLM's answer, minus what the client did not ask for.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import secrets
import time
from collections import Counter
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from producers import claims
from producers.kafka import KafkaUnavailable, Sink, Topics, now_ms
from schemas import codec

log = logging.getLogger("spanrl.proxy")
RETRY_AFTER_S = "5"
CHAT, COMPLETIONS = "chat.completions", "completions"


class MissingTokenIds(ValueError):
    """vLLM's answer lacks token ids or log-probs (dead-letter reason missing_token_ids)."""


# ---------------------------------------------------------------- pure functions
def llm_call_from_response(endpoint: str, request: dict, response: dict, policy_version: int) -> dict:
    """The LlmCall record of one vLLM answer (n=1).

    vLLM 0.32 fields used (with ``return_token_ids: true`` and logprobs asked):
      chat:        response.prompt_token_ids, choices[0].token_ids,
                   choices[0].logprobs.content[i].logprob
      completions: choices[0].prompt_token_ids, choices[0].token_ids,
                   choices[0].logprobs.token_logprobs[i]
    """
    try:
        choice = response["choices"][0]
    except (KeyError, IndexError, TypeError) as exc:
        raise MissingTokenIds("response has no choices") from exc
    if endpoint == CHAT:
        prompt_ids = response.get("prompt_token_ids")
        lp = (choice.get("logprobs") or {}).get("content")
        logprobs = None if lp is None else [t.get("logprob") for t in lp]
    else:
        prompt_ids = choice.get("prompt_token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    completion_ids = choice.get("token_ids")
    if prompt_ids is None or completion_ids is None:
        raise MissingTokenIds("vLLM returned no prompt/completion token ids")
    if logprobs is None or len(logprobs) != len(completion_ids) or any(x is None for x in logprobs):
        raise MissingTokenIds(f"{0 if logprobs is None else len(logprobs)} log-probs for {len(completion_ids)} tokens")
    max_tokens = request.get("max_completion_tokens", request.get("max_tokens"))
    return {
        "model": response.get("model") or request.get("model"),
        "policy_version": policy_version,
        "prompt_token_ids": list(prompt_ids),
        "completion_token_ids": list(completion_ids),
        "completion_logprobs": [float(x) for x in logprobs],
        "temperature": float(request["temperature"]) if request.get("temperature") is not None else 1.0,
        "top_p": float(request["top_p"]) if request.get("top_p") is not None else 1.0,
        "max_tokens": int(max_tokens) if max_tokens is not None else None,
        "finish_reason": choice.get("finish_reason"),
        "request_id": str(response.get("id", "")),
    }


def upstream_body(endpoint: str, body: dict) -> dict:
    """What the proxy sends vLLM: the client's body plus token ids and log-probs."""
    out = dict(body)
    out["return_token_ids"] = True
    if endpoint == CHAT:
        out["logprobs"] = True
    else:
        out["logprobs"] = max(1, int(body.get("logprobs") or 0))
    return out


def strip_response(endpoint: str, client_body: dict, response: dict) -> dict:
    """vLLM's answer without the token ids / log-probs the client did not ask for."""
    want_ids = bool(client_body.get("return_token_ids"))
    want_lp = bool(client_body.get("logprobs")) if endpoint == CHAT else client_body.get("logprobs") is not None
    if want_ids and want_lp:
        return response
    out = dict(response)
    out["choices"] = [dict(c) for c in response.get("choices", [])]
    if not want_ids:
        if "prompt_token_ids" in out:
            out["prompt_token_ids"] = None
        for c in out["choices"]:
            for k in ("token_ids", "prompt_token_ids"):
                if k in c:
                    c[k] = None
    if not want_lp:
        for c in out["choices"]:
            c["logprobs"] = None
    return out


def parse_traceparent(header: str | None) -> tuple[str, str] | None:
    """(trace_id, parent span_id) from a W3C ``traceparent`` header, if well formed."""
    if not header:
        return None
    parts = header.strip().split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        int(parts[1], 16), int(parts[2], 16)
    except ValueError:
        return None
    if set(parts[1]) == {"0"} or set(parts[2]) == {"0"}:
        return None
    return parts[1].lower(), parts[2].lower()


class SequenceCounter:
    """Per (rollout_id, attempt_id) sequence numbers, from 0 (one proxy process)."""

    def __init__(self) -> None:
        self._counters: dict[tuple[str, str], itertools.count] = {}

    def next(self, rollout_id: str, attempt_id: str) -> int:
        return next(self._counters.setdefault((rollout_id, attempt_id), itertools.count()))


# ---------------------------------------------------------------- service
class PolicyVersionIn(BaseModel):
    version: int
    checkpoint: str = ""


def create_app(sink: Sink, vllm_url: str, model_name: str, policy_version: int = 0,
               timeout_s: float = 600.0, claim_client=None, payload_bucket: str | None = None) -> FastAPI:
    """The proxy app. ``claim_client`` / ``payload_bucket``: where span records over the
    spans topic's limit go (producers/claims.py); default: MinIO and bucket of the settings."""
    metrics: Counter[str] = Counter()
    if payload_bucket is None:
        from infra.settings import get_settings

        payload_bucket = get_settings().payload_bucket
    claim_client = claim_client or claims.make_client()
    seq = SequenceCounter()
    state = {"version": policy_version, "checkpoint": ""}
    topics: Topics = sink.topics

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.client = httpx.AsyncClient(base_url=vllm_url, timeout=httpx.Timeout(timeout_s, connect=5.0))
        try:
            await sink.start()
        except KafkaUnavailable as exc:
            log.warning("%s", exc)
        yield
        await app.state.client.aclose()
        await sink.stop()

    app = FastAPI(title="spanrl LLM proxy", lifespan=lifespan)
    app.state.metrics = metrics

    def error(status: int, reason: str, detail: str, headers: dict | None = None) -> Response:
        metrics[f"http_{status}"] += 1
        # OpenAI error shape so the SDK shows the message
        return JSONResponse({"error": {"message": detail, "type": reason, "code": status}}, status, headers=headers)

    async def call(endpoint: str, path: str, rollout_id: str, attempt_id: str, request: Request) -> Response:
        metrics["requests"] += 1
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            return error(400, "invalid_json", f"body is not JSON: {exc}")
        if not isinstance(body, dict):
            return error(400, "invalid_request", "body must be a JSON object")
        if body.get("stream"):
            return error(400, "stream_not_supported", "stream=true is not supported by the spanrl proxy yet")
        if body.get("n") not in (None, 1):
            return error(400, "n_not_supported", "only n=1 is supported (one call = one transition)")
        if body.get("model") != model_name:
            return error(404, "model_not_found", f"model {body.get('model')!r} is not served; use {model_name!r}")
        agent = request.headers.get("x-spanrl-agent")
        start_ns = time.time_ns()
        try:
            upstream = await app.state.client.post(path, json=upstream_body(endpoint, body))
        except httpx.TransportError as exc:
            metrics["vllm_unavailable"] += 1
            return error(503, "vllm_unavailable", f"vLLM at {vllm_url} unreachable: {exc!r}",
                         {"Retry-After": RETRY_AFTER_S})
        end_ns = time.time_ns()
        if upstream.status_code != 200:
            metrics[f"vllm_http_{upstream.status_code}"] += 1
            return Response(upstream.content, upstream.status_code, media_type="application/json")
        response = upstream.json()
        trace = parse_traceparent(request.headers.get("traceparent"))
        span = {
            "rollout_id": rollout_id, "attempt_id": attempt_id,
            "sequence_id": seq.next(rollout_id, attempt_id),
            "trace_id": trace[0] if trace else secrets.token_hex(16),
            "span_id": secrets.token_hex(8),
            "parent_span_id": trace[1] if trace else None,
            "name": endpoint, "kind": "llm", "source": "proxy",
            "start_time_unix_nano": start_ns, "end_time_unix_nano": end_ns,
            "status_code": "OK", "agent_name": agent,
            "attributes": span_attributes(endpoint, body, response, agent),
            "llm": None, "payload_ref": None,
        }
        items: list[tuple] = []
        try:
            span["llm"] = llm_call_from_response(endpoint, body, response, state["version"])
            value = codec.encode(topics.spans.record, span)
            # oversize: the record goes to MinIO, a small span with its ref to Kafka
            items.append((topics.spans, rollout_id, await claims.check_in(
                claim_client, payload_bucket, topics.spans, rollout_id, span, value)))
        except MissingTokenIds as exc:
            metrics["dead_letter.missing_token_ids"] += 1
            items.append((topics.dead_letter, rollout_id, codec.encode(topics.dead_letter.record, {
                "reason": "missing_token_ids", "detail": str(exc), "stage": "proxy", "source_topic": None,
                "source_partition": None, "source_offset": None, "rollout_id": rollout_id, "task_id": None,
                "payload": json.dumps(span).encode(), "timestamp_ms": now_ms()})))
        except codec.SchemaError as exc:
            metrics["schema_error"] += 1
            return error(502, "schema_error", exc.detail)
        except claims.ClaimStoreUnavailable as exc:
            metrics["claim_store_unavailable"] += 1
            return error(503, "claim_store_unavailable", str(exc), {"Retry-After": RETRY_AFTER_S})
        try:
            await sink.produce_raw(items)
        except KafkaUnavailable as exc:
            metrics["kafka_unavailable"] += 1
            return error(503, "kafka_unavailable", str(exc), {"Retry-After": RETRY_AFTER_S})
        metrics["spans"] += 1
        return JSONResponse(strip_response(endpoint, body, response))

    prefix = "/rollouts/{rollout_id}/attempts/{attempt_id}/v1"

    @app.post(prefix + "/chat/completions")
    async def chat(rollout_id: str, attempt_id: str, request: Request) -> Response:
        return await call(CHAT, "/v1/chat/completions", rollout_id, attempt_id, request)

    @app.post(prefix + "/completions")
    async def completions(rollout_id: str, attempt_id: str, request: Request) -> Response:
        return await call(COMPLETIONS, "/v1/completions", rollout_id, attempt_id, request)

    @app.get(prefix + "/models")
    async def models(rollout_id: str, attempt_id: str) -> Response:
        try:
            upstream = await app.state.client.get("/v1/models")
        except httpx.TransportError as exc:
            return error(503, "vllm_unavailable", repr(exc), {"Retry-After": RETRY_AFTER_S})
        return Response(upstream.content, upstream.status_code, media_type="application/json")

    @app.get("/admin/policy_version")
    async def get_version() -> dict:
        return dict(state)

    @app.post("/admin/policy_version")
    async def set_version(v: PolicyVersionIn) -> dict:
        state.update(version=v.version, checkpoint=v.checkpoint)
        metrics["policy_version_updates"] += 1
        log.info("policy version -> %d (%s)", v.version, v.checkpoint)
        return dict(state)

    @app.get("/health")
    async def health() -> dict:
        try:
            vllm_ok = (await app.state.client.get("/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            vllm_ok = False
        return {"status": "ok", "vllm": vllm_ok, "kafka_producer_started": sink.started,
                "policy_version": state["version"]}

    @app.get("/metrics")
    async def get_metrics() -> dict:
        return {**metrics, "policy_version": state["version"]}

    return app


def span_attributes(endpoint: str, body: dict, response: dict, agent: str | None) -> dict[str, str]:
    """GenAI semantic-convention attributes of one call (all values as strings)."""
    usage = response.get("usage") or {}
    attrs = {
        "gen_ai.operation.name": "chat" if endpoint == CHAT else "text_completion",
        "gen_ai.system": "vllm",
        "gen_ai.request.model": str(body.get("model")),
        "gen_ai.response.model": str(response.get("model")),
        "gen_ai.response.id": str(response.get("id")),
        "gen_ai.usage.input_tokens": str(usage.get("prompt_tokens")),
        "gen_ai.usage.output_tokens": str(usage.get("completion_tokens")),
        "gen_ai.response.finish_reasons": json.dumps([c.get("finish_reason") for c in response.get("choices", [])]),
    }
    for key in ("temperature", "top_p", "max_tokens"):
        if body.get(key) is not None:
            attrs[f"gen_ai.request.{key}"] = json.dumps(body[key])
    if agent:
        attrs["spanrl.agent_name"] = agent
    return attrs


def main(argv: list[str] | None = None) -> None:
    from infra.settings import get_settings

    s = get_settings()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default=s.host)
    p.add_argument("--port", type=int, default=s.proxy_port)
    p.add_argument("--vllm-url", default=s.vllm_url)
    p.add_argument("--model-name", default=s.model_name)
    p.add_argument("--kafka-bootstrap", default=s.kafka_bootstrap)
    p.add_argument("--topic-prefix", default=os.environ.get("SPANRL_TOPIC_PREFIX", ""))
    p.add_argument("--policy-version", type=int, default=int(os.environ.get("SPANRL_POLICY_VERSION", 0)))
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    topics = Topics.with_prefix(a.topic_prefix) if a.topic_prefix else Topics()
    app = create_app(Sink(a.kafka_bootstrap, topics), a.vllm_url, a.model_name, a.policy_version)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
