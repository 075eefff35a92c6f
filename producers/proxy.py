"""OpenAI-compatible LLM proxy in front of vLLM that records every call as a Span.

    python -m spanrl.producers.proxy [--port P] [--topic-prefix X] [--policy-version V]

An agent points its OpenAI client at the per-rollout base URL
``{proxy}/rollouts/{rollout_id}/attempts/{attempt_id}/v1``. The proxy asks vLLM for
token ids and log-probs of every call, records them (never re-tokenised) with the
current policy version in a Span (source=proxy, kind=llm; one per choice when ``n`` > 1),
waits for Kafka to acknowledge it, and only then returns vLLM's answer, minus what the client
did not ask for. ``stream: true``: vLLM's events are forwarded as they arrive and the spans
written after vLLM's last one; the client's ``data: [DONE]`` comes only after Kafka's ack, and
a stream cut short is one dead letter (``producers/streaming.py``, producers/README.md).
``POST .../v1/responses`` (the Responses API, the OpenAI Agents SDK's default model) is
served from vLLM's chat completions (producers/responses.py says why): one chat call per
request, recorded like any chat call (``spanrl.api`` ``responses``), answered as a Response
object or, streamed, as the Responses API's events.
The same API under ``{proxy}/eval/{sampling}/rollouts/...`` records to the evaluation topics
(``spans.eval``, ``dead-letter.eval``) instead: what ``spanrl eval`` and the release gate
use, so evaluation calls are logged like any other but never trained on; ``{sampling}`` is
``agent`` (the client's own sampling) or a temperature every call gets (``0``: greedy).

An agent that no runner launched (in production) uses the plain base URL ``{proxy}/v1``:
the rollout comes from the ``x-spanrl-rollout-id`` request header (minted when absent and
returned in the same response header), the group from ``x-spanrl-task`` /
``x-spanrl-group-size`` (spanrl/core/production.py).

Anthropic Messages clients use the base URL ``{proxy}/rollouts/{rollout_id}/attempts/{attempt_id}``
(their SDK adds ``/v1/messages``): the proxy serves them from vLLM's chat completions
(producers/messages.py), since vLLM's own ``/v1/messages`` returns no token ids; streamed, as
the Messages stream events, ``message_stop`` only after Kafka acked the call.

Each client API is one implementation of :class:`~spanrl.producers.client_apis.ClientApi`
(request -> vLLM request, vLLM chunk -> client events, vLLM answer -> client body;
producers/client_apis.py), and the routes are generated from the table
``client_apis.CLIENT_APIS`` × :data:`ROUTE_FAMILIES` (:func:`client_routes`).

The policy version comes from the reloader (``POST /admin/policy_version``; at start-up
``GET {reloader}/policy``). After a vLLM transport error the label may be false (a
restarted vLLM serves the base weights), so the proxy answers 503 ``policy_unsynced``
until the reloader has reloaded vLLM and posts a version again (see :class:`PolicyState`).

With auth on (the default), every route but ``GET /health`` needs a bearer token (an OpenAI
client sends its ``api_key`` as one): the agent token for the LLM routes, ``/status`` and
``/metrics``, the administrator token for ``/admin/*`` (spanrl/core/edge.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import secrets
import time
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Awaitable, Callable

import cachetools
import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, SecretStr

from spanrl.core import call_order, claims, ids, production, response_ids
from spanrl.core import metrics as prom
from spanrl.core.edge import BadRequest, Credentials, bearer_headers
from spanrl.core.settings import PROCESSED_LOGPROBS, ProducerSettings, TopicSettings, check_environment
from spanrl.producers import edge, seeding, streaming
from spanrl.producers.content import recorded_content
from spanrl.producers.client_apis import CLIENT_APIS, ClientApi, StreamEvents
from spanrl.producers.client_apis import MESSAGES, sse_events, strip_response  # noqa: F401 - their old home
from spanrl.producers.kafka import KafkaUnavailable, Sink, Topics, now_ms
from spanrl.producers.streaming import CHAT, COMPLETIONS, RecordFailed
from spanrl.schemas import codec

log = logging.getLogger("spanrl.proxy")
RETRY_AFTER_S = "5"
ROLLOUT_PREFIX = "/rollouts/{rollout_id}/attempts/{attempt_id}/v1"
#: the route families every client API is served under (its ``route`` after the prefix):
#: a runner's rollout attempt; the same recorded on the evaluation topics (``{sampling}``:
#: ``agent`` keeps the client's sampling, a number sets every call's temperature, 0: greedy);
#: agents in production, the rollout from headers (spanrl/core/production.py)
ROUTE_FAMILIES = {"rollout": ROLLOUT_PREFIX, "eval": "/eval/{sampling}" + ROLLOUT_PREFIX, "production": "/v1"}
#: the proxy's plain counters (its JSON ``/status``) as Prometheus counters; every other key
#: of the count dict is a status, vLLM status, dead-letter or refusal reason (prom.count_families)
PLAIN_COUNTERS = {
    "requests": "LLM calls received (every API, training and evaluation routes)",
    "eval_requests": "calls on the evaluation routes (/eval/...)",
    "responses_requests": "Responses API calls",
    "messages_requests": "Anthropic Messages calls",
    "streams": "streamed calls relayed",
    "spans": "records (spans and dead letters) Kafka acknowledged",
    "policy_version_updates": "policy versions posted by the reloader",
    "policy_unsynced_posts": "policy_unsynced notices posted by the reloader",
    "dead_letter_unwritten": "dead letters of interrupted streams Kafka did not take",
    "rollout_temperature_set": "training calls forwarded with SPANRL_ROLLOUT_TEMPERATURE instead of the client's",
}


class MissingTokenIds(ValueError):
    """vLLM's answer lacks token ids or log-probs (dead-letter reason missing_token_ids)."""


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON (RFC 8259 has no NaN/Infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def parse_body(content_type: str | None, raw: bytes) -> dict:
    """The JSON object of an OpenAI request body; raises :class:`BadRequest` otherwise.

    415 ``unsupported_media_type`` unless Content-Type is ``application/json`` (or
    ``application/*+json``): a browser page can send ``text/plain`` cross-site without a
    CORS preflight, JSON it cannot. 400 ``invalid_json``: empty, not UTF-8 (RFC 8259
    s8.1), not JSON, NaN/Infinity or numbers out of float range, lone surrogates
    (``"\\ud800"``, which vLLM could not encode). 400 ``invalid_request``: not an object.
    """
    media = (content_type or "").split(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise BadRequest(415, "unsupported_media_type", f"Content-Type must be application/json, got {media!r}")
    if not raw:
        raise BadRequest(400, "invalid_json", "empty body")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(400, "invalid_json", f"body is not UTF-8: {exc}") from exc
    try:
        body = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
        json.dumps(body, ensure_ascii=False).encode("utf-8")  # lone surrogates from \uXXXX escapes
    except (ValueError, RecursionError) as exc:  # UnicodeEncodeError is a ValueError
        raise BadRequest(400, "invalid_json", f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest(400, "invalid_request", "body must be a JSON object")
    return body


# ---------------------------------------------------------------- pure functions
def llm_call_from_response(endpoint: str, request: dict, response: dict, policy_version: int,
                           choice: int = 0) -> dict:
    """The LlmCall record of choice ``choice`` (position in ``choices``) of one vLLM answer;
    with ``n`` > 1 each choice is its own call (same prompt token ids, its own completion).
    A streamed answer, assembled by ``streaming.StreamAccumulator``, has the same shape.

    A tool-call answer is recorded like any other: its completion token ids are the text
    vLLM's tool-call parser read the calls from (``<tool_call>{...}</tool_call>`` with the
    ``hermes`` parser), and ``finish_reason`` is vLLM's (``tool_calls`` for ``tool_choice``
    auto/required, ``stop`` for a named ``tool_choice``, as OpenAI's API does).

    vLLM 0.32 fields used (with ``return_token_ids: true`` and logprobs asked):
      chat:        response.prompt_token_ids, choices[k].token_ids,
                   choices[k].logprobs.content[i].logprob
      completions: choices[k].prompt_token_ids, choices[k].token_ids,
                   choices[k].logprobs.token_logprobs[i]
    Raises :class:`MissingTokenIds` when the choice, its token ids or one log-prob per
    completion token is missing.
    """
    try:
        choice = response["choices"][choice]
    except (KeyError, IndexError, TypeError) as exc:
        raise MissingTokenIds(f"response has no choice {choice}") from exc
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


def check_n(body: dict) -> int:
    """The number of choices asked (``n``, default 1); each becomes its own call record.
    Raises :class:`BadRequest` 400 ``invalid_request`` unless ``n`` is an integer >= 1 (JSON
    ``true`` or ``"2"`` included, which vLLM would coerce), 400 ``n_requires_sampling`` for
    ``n`` > 1 with ``temperature: 0`` (vLLM 0.32 refuses n > 1 with greedy sampling)."""
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadRequest(400, "invalid_request", f"n must be an integer >= 1, got {json.dumps(n)[:40]}")
    if n > 1 and body.get("temperature") == 0:
        raise BadRequest(400, "n_requires_sampling", f"n={n} needs temperature > 0: greedy sampling "
                         "gives one answer (vLLM refuses n > 1 with temperature 0)")
    return n


def check_stream(body: dict) -> bool:
    """Whether the call streams. Raises :class:`BadRequest` 400 ``invalid_request`` unless
    ``stream`` is a boolean (or absent/null) and ``stream_options`` an object (or absent/null),
    as the OpenAI API defines them (the proxy must know for sure whether it streams)."""
    stream, opts = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(400, "invalid_request", f"stream must be a boolean, got {json.dumps(stream)[:40]}")
    if opts is not None and not isinstance(opts, dict):
        raise BadRequest(400, "invalid_request", f"stream_options must be an object, got {json.dumps(opts)[:40]}")
    return bool(stream)


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
    """Per (rollout_id, attempt_id) sequence numbers, from 0 (one proxy process; the load
    balancer keeps an attempt's calls on one unit, infra/deploy/nginx.conf).

    An attempt with no call for ``idle_s`` (``SPANRL_PROXY_ROLLOUT_IDLE_S``) is forgotten, so
    the proxy's memory follows the attempts in flight, not every attempt it ever served. A
    call after that would count from 0 again; the stream job has ended such an attempt by
    then (``rollout_timeout_s`` / ``production_idle_s`` after its last input, both shorter
    than the default idle time) and dead-letters the call as ``late_span`` whatever its
    sequence id. ``timer``: the clock of the idle time (monotonic seconds)."""

    def __init__(self, idle_s: float = math.inf, timer: Callable[[], float] = time.monotonic) -> None:
        self._next: cachetools.TTLCache = cachetools.TTLCache(maxsize=math.inf, ttl=idle_s, timer=timer)

    def next(self, rollout_id: str, attempt_id: str) -> int:
        key = (rollout_id, attempt_id)
        n = self._next.get(key, 0)
        self._next[key] = n + 1  # (re)sets the attempt's idle deadline
        return n

    def __len__(self) -> int:
        """Attempts remembered now (idle ones dropped first)."""
        self._next.expire()
        return len(self._next)


def vllm_lost(exc: Exception) -> bool:
    """Whether an httpx error talking to vLLM means vLLM may have gone (and may come back
    with other weights): refused/reset connections and broken protocol, not timeouts
    (a slow vLLM still holds its weights)."""
    return isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.TimeoutException)


class PolicyState:
    """The policy version the proxy stamps on calls, and whether that label is known true.

    - static (no reloader has spoken yet): the configured version, always synced;
    - managed (the reloader posted a version or a policy, or told it unsynced): a vLLM
      transport error makes it unsynced (vLLM may come back with its base weights), and
      calls are refused (503 policy_unsynced) until a version is set again.
    ``epoch`` counts the times it became unsynced: a version read from the reloader is
    adopted only if no unsync happened while it was being read (:meth:`adopt`).
    """

    def __init__(self, version: int = 0, checkpoint: str = ""):
        self.version, self.checkpoint = version, checkpoint
        self.synced, self.managed = True, False
        self.reason: str | None = None
        self.epoch = 0

    def set_version(self, version: int, checkpoint: str) -> None:
        """The reloader posted the version vLLM now serves."""
        self.version, self.checkpoint = version, checkpoint
        self.synced, self.managed, self.reason = True, True, None

    def adopt(self, policy: dict, epoch: int) -> bool:
        """Take the reloader's ``/policy`` answer ``{"version", "checkpoint", "synced"}``,
        read while ``self.epoch`` was ``epoch``. A synced answer sets the version; an
        unsynced one makes the proxy unsynced. Ignored (False) when the proxy became
        unsynced meanwhile: the answer may predate the outage."""
        if epoch != self.epoch:
            return False
        if policy.get("synced"):
            self.set_version(int(policy["version"]), str(policy.get("checkpoint") or ""))
        else:
            self.unsync("reloader: vLLM not synced")
        return True

    def unsync(self, reason: str) -> None:
        """The reloader said vLLM lost (or has not yet reloaded) the served version."""
        if self.synced:
            self.epoch += 1
        self.synced, self.managed, self.reason = False, True, reason

    def vllm_unreachable(self) -> bool:
        """A transport error talking to vLLM; True when this made the proxy unsynced."""
        if not self.managed:
            return False
        was = self.synced
        self.unsync("vllm_unreachable")
        return was

    def wants_reloader(self) -> bool:
        """Whether to ask the reloader's /policy: unsynced, or never heard from it."""
        return not self.synced or not self.managed

    def view(self) -> dict:
        return {"version": self.version, "checkpoint": self.checkpoint, "synced": self.synced,
                "managed": self.managed, "reason": self.reason}


# ---------------------------------------------------------------- service
@dataclass
class CallContext:
    """One client request on its way: what its records are made of (plumbing)."""
    endpoint: str
    body: dict
    rollout_id: str
    attempt_id: str
    topics: Topics
    agent: str | None
    trace: tuple[str, str] | None
    start_ns: int
    #: the client's API when it is not vLLM's (served as this chat call, the span's
    #: ``spanrl.api``): ``responses.RESPONSES`` or :data:`MESSAGES`
    api: str | None = None
    #: extra span attributes (a production call's rollout: spanrl/core/production.py)
    attributes: dict | None = None


class PolicyVersionIn(BaseModel):
    version: int
    checkpoint: str = ""


class PolicyUnsyncedIn(BaseModel):
    reason: str = "reloader"


async def ask_reloader(client: httpx.AsyncClient, reloader_url: str, policy: PolicyState) -> bool:
    """``GET {reloader}/policy`` and :meth:`PolicyState.adopt` it; False when unreachable."""
    epoch = policy.epoch
    try:
        r = await client.get(f"{reloader_url}/policy")
        r.raise_for_status()
        answer = r.json()
    except (httpx.HTTPError, ValueError) as exc:
        log.debug("reloader at %s: %s", reloader_url, exc)
        return False
    before = policy.view()
    if policy.adopt(answer, epoch) and policy.view() != before:
        log.info("policy version from the reloader: %s", policy.view())
    return True


def create_app(sink: Sink, vllm_url: str, model_name: str, policy_version: int = 0,
               timeout_s: float = 600.0, reloader_url: str | None = None, follow_s: float = 1.0,
               credentials: Credentials | SecretStr | str | None = None, claim_client=None,
               payload_bucket: str | None = None, eval_topics: Topics | None = None,
               rollout_temperature: float | None = None, reloader_token: SecretStr | str | None = None,
               max_body_bytes: int | None = None, rollout_idle_s: float = math.inf) -> FastAPI:
    """The proxy app. ``reloader_url``: asked for the policy version at start-up and every
    ``follow_s`` while the proxy is unsynced or has not heard from it (None: never).
    ``credentials``: what every route but ``GET /health`` requires (None: open; spanrl/core/edge.py
    ``Credentials``: the agent token for the LLM routes, the administrator's for ``/admin/*``;
    one plain token: both). ``reloader_token``: the token the proxy sends the reloader.
    ``max_body_bytes``: the largest request body (413 ``body_too_large``; default
    ``SPANRL_PROXY_MAX_BODY_BYTES``).
    ``claim_client`` / ``payload_bucket``: where span records over the spans topic's limit go
    (spanrl/core/claims.py); default: MinIO and bucket of the settings.
    ``eval_topics``: where calls to the ``/eval/rollouts/...`` routes are recorded (default
    ``Topics.evaluation()``: ``spans.eval``, ``dead-letter.eval``); nothing trains on them.
    ``rollout_temperature`` (``SPANRL_ROLLOUT_TEMPERATURE``): the temperature every call of a
    training or production route is sampled at, with :data:`NEUTRAL_SAMPLING` for the fields
    the call leaves unset (:func:`untrainable_sampling` refusals: 400
    ``untrainable_sampling``), once vLLM is known to return processed log-probs
    (:func:`logprobs_mode_problem`; else 503 ``vllm_logprobs_mode``); None: the client's own.
    ``rollout_idle_s`` (``SPANRL_PROXY_ROLLOUT_IDLE_S``): how long an attempt's sequence
    counter outlives its last call (:class:`SequenceCounter`)."""
    metrics: Counter[str] = Counter()
    if payload_bucket is None:
        from spanrl.core.settings import get_settings

        payload_bucket = get_settings().payload_bucket
    if max_body_bytes is None:
        max_body_bytes = ProducerSettings().proxy_max_body_bytes
    claim_client = claim_client or claims.make_client()
    capture, tokenizer = call_content_settings()
    seq = SequenceCounter(rollout_idle_s)
    instance = secrets.token_hex(8)  # this process's id on its spans: whose counter numbered them
    policy = PolicyState(policy_version)
    train_topics: Topics = sink.topics
    eval_topics = eval_topics or Topics.evaluation()
    vllm_mode = {"processed": False, "lock": asyncio.Lock()}  # vLLM's logprobs mode, checked once per vLLM

    async def check_vllm_mode() -> str | None:
        """:func:`logprobs_mode_problem` of vLLM's ``/server_info``, asked once (one request
        at a time) until vLLM says ``processed_logprobs``, and again after vLLM was lost (it
        may come back with other arguments). Raises httpx.TransportError."""
        async with vllm_mode["lock"]:
            if vllm_mode["processed"]:
                return None
            info = await app.state.client.get("/server_info", params={"config_format": "json"}, timeout=60.0)
            try:
                answer = info.json() if info.status_code == 200 else None
            except ValueError:
                answer = None
            problem = logprobs_mode_problem(info.status_code, answer)
            vllm_mode["processed"] = problem is None
            return problem

    async def follow_reloader(client: httpx.AsyncClient) -> None:
        while True:
            await asyncio.sleep(follow_s)
            if policy.wants_reloader():
                await ask_reloader(client, reloader_url, policy)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.client = httpx.AsyncClient(base_url=vllm_url, timeout=httpx.Timeout(timeout_s, connect=5.0))
        try:
            await sink.start()
        except KafkaUnavailable as exc:
            log.warning("%s", exc)
        follower = None
        if reloader_url:
            reloader_client = httpx.AsyncClient(timeout=8.0, headers=bearer_headers(reloader_token))  # the reloader checks vLLM (5 s) before answering
            if not await ask_reloader(reloader_client, reloader_url, policy):
                log.warning("reloader at %s unreachable; policy version %d until it answers", reloader_url,
                            policy.version)
            follower = asyncio.create_task(follow_reloader(reloader_client))
        yield
        if follower is not None:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await reloader_client.aclose()
        await app.state.client.aclose()
        await sink.stop()

    app = FastAPI(title="spanrl LLM proxy", lifespan=lifespan)
    app.state.metrics = metrics
    registry = prom.registry(lambda: [
        *prom.count_families("proxy", metrics, PLAIN_COUNTERS),
        prom.gauge("spanrl_proxy_policy_version", "policy version the proxy stamps on calls", policy.version),
        prom.gauge("spanrl_proxy_policy_synced", "1 when the served policy version is known", policy.synced),
        prom.gauge("spanrl_proxy_sequence_attempts", "attempts whose sequence counter the proxy holds", len(seq))])
    upstream_s = prom.latency_histogram(registry, "spanrl_proxy_upstream_seconds",
                                        "vLLM's time per call: request sent to answer (streamed: to its last event)",
                                        ("endpoint", "stream"))
    ack_s = prom.latency_histogram(registry, "spanrl_proxy_kafka_ack_seconds",
                                   "time until Kafka acknowledged a call's records")

    def error(status: int, reason: str, detail: str, headers: dict | None = None, param: str | None = None) -> Response:
        """OpenAI error shape (so the SDK shows the message; ``param``: the request field to
        blame); counts ``http_<status>`` and ``reason``."""
        metrics[f"http_{status}"] += 1
        metrics[reason] += 1
        detail = edge.safe_detail(detail)
        body = {"message": detail, "type": reason, "code": status}
        if param is not None:
            body["param"] = param
        return JSONResponse({"error": body}, status, headers=headers)

    edge.install_auth(app, credentials, error)
    edge.install_error_handlers(app, error)

    async def call(api: ClientApi, rollout_id: str, attempt_id: str, request: Request,
                   topics: Topics = train_topics, sampling: str | None = None,
                   attributes: dict | None = None) -> Response:
        """One recorded vLLM call, asked and answered in the client's ``api``
        (producers/client_apis.py: its request made the vLLM call's body, its answer or stream
        made from vLLM's); the span says which in ``spanrl.api`` when it is not vLLM's own."""
        metrics["requests"] += 1
        if topics is eval_topics:
            metrics["eval_requests"] += 1
        temperature_changed = False
        at_rollout_temperature = topics is not eval_topics and rollout_temperature is not None
        try:
            ids.check(ids.ROLLOUT, rollout_id, "rollout_id")  # the path's ids (spanrl/core/ids.py)
            ids.check(ids.ATTEMPT, attempt_id, "attempt_id")
            body = client_body = parse_body(request.headers.get("content-type"),
                                            await edge.read_body(request, max_body_bytes))
            if api.counter is not None:
                metrics[api.counter] += 1
            body = api.vllm_request(client_body)
            if (seed_header := request.headers.get(seeding.SEED_HEADER)) is not None and body.get("seed") is None:
                try:  # the call's sampling seed from the run seed (producers/seeding.py)
                    body["seed"] = seeding.parse_seed(seed_header)
                except ValueError as exc:
                    raise BadRequest(400, "invalid_seed", str(exc)) from None
            if sampling is not None and sampling != "agent":
                temperature = eval_temperature(sampling)
                if temperature is None:
                    raise BadRequest(400, "invalid_sampling",
                                     f"evaluation sampling must be 'agent' or a temperature >= 0, got {sampling!r}")
                body["temperature"] = temperature
            elif at_rollout_temperature:
                if (problem := untrainable_sampling(body)) is not None:
                    raise BadRequest(400, "untrainable_sampling", problem)
                temperature_changed = body.get("temperature") != rollout_temperature
                body = {**body, **{k: v for k, v in NEUTRAL_SAMPLING.items() if body.get(k) is None},
                        "temperature": rollout_temperature}
            check_n(body)
            streamed = check_stream(body)
        except BadRequest as exc:
            return error(exc.status, exc.reason, exc.detail, param=exc.param)
        if body.get("model") != model_name:
            return error(404, "model_not_found", f"model {body.get('model')!r} is not served; use {model_name!r}")
        if not policy.synced:  # error() counts the reason
            return error(503, "policy_unsynced", f"the served policy version is not known ({policy.reason}); "
                         "waiting for the reloader to reload vLLM", {"Retry-After": RETRY_AFTER_S})
        if at_rollout_temperature:
            try:
                problem = await check_vllm_mode()
            except httpx.TransportError as exc:
                return vllm_unavailable(exc)
            if problem is not None:
                return error(503, "vllm_logprobs_mode", f"SPANRL_ROLLOUT_TEMPERATURE={rollout_temperature} needs "
                             f"vLLM's processed log-probs: {problem}")
            metrics["rollout_temperature_set"] += temperature_changed
        ctx = CallContext(api.endpoint, body, rollout_id, attempt_id, topics, request.headers.get("x-spanrl-agent"),
                          parse_traceparent(request.headers.get("traceparent")), time.time_ns(), api.span_api,
                          attributes)
        if streamed:
            return await stream(ctx, api.upstream_path, api.stream(client_body, body))
        try:
            t0 = time.perf_counter()
            upstream = await app.state.client.post(api.upstream_path, json=upstream_body(api.endpoint, body))
            upstream_s.labels(api.endpoint, "false").observe(time.perf_counter() - t0)
        except httpx.TransportError as exc:
            return vllm_unavailable(exc)
        if upstream.status_code != 200:
            metrics[f"vllm_http_{upstream.status_code}"] += 1
            return Response(upstream.content, upstream.status_code, media_type="application/json")
        response = upstream.json()
        if isinstance(response, dict):  # the id names the attempt (spanrl/core/response_ids.py)
            response["id"] = response_ids.mint(str(response.get("id") or ""), ctx.rollout_id, ctx.attempt_id)
        try:
            await record(ctx, response)
        except RecordFailed as exc:
            return error(exc.status, exc.reason, exc.detail,
                         {"Retry-After": RETRY_AFTER_S} if exc.status == 503 else None)
        return JSONResponse(api.answer(client_body, body, response))

    def vllm_unavailable(exc: httpx.TransportError) -> Response:
        if vllm_lost(exc):  # a vLLM that comes back may have other arguments
            vllm_mode["processed"] = False
        if vllm_lost(exc) and policy.vllm_unreachable():
            log.warning("vLLM unreachable (%r): policy version unsynced until the reloader posts one", exc)
        return error(503, "vllm_unavailable", f"vLLM at {vllm_url} unreachable: {exc!r}",
                     {"Retry-After": RETRY_AFTER_S})

    def base_span(ctx: CallContext, sequence_id: int | None, response: dict, choice: int) -> dict:
        span = {
            "rollout_id": ctx.rollout_id, "attempt_id": ctx.attempt_id, "sequence_id": sequence_id,
            "trace_id": ctx.trace[0] if ctx.trace else secrets.token_hex(16),
            "span_id": secrets.token_hex(8),
            "parent_span_id": ctx.trace[1] if ctx.trace else None,
            "name": ctx.endpoint, "kind": "llm", "source": "proxy",
            "start_time_unix_nano": ctx.start_ns, "end_time_unix_nano": time.time_ns(),
            "status_code": "OK", "agent_name": ctx.agent,
            "attributes": span_attributes(ctx.endpoint, ctx.body, response, ctx.agent, choice),
            "llm": None, "payload_ref": None,
        }
        if ctx.api:
            span["attributes"]["spanrl.api"] = ctx.api
        span["attributes"][call_order.INSTANCE] = instance
        span["attributes"].update(ctx.attributes or {})
        return span

    def dead_letter(topics: Topics, reason: str, detail: str, rollout_id: str, payload: dict) -> tuple:
        metrics[f"dead_letter.{reason}"] += 1
        return (topics.dead_letter, rollout_id, codec.encode(topics.dead_letter.record, {
            "reason": reason, "detail": detail, "stage": "proxy", "source_topic": None,
            "source_partition": None, "source_offset": None, "rollout_id": rollout_id, "task_id": None,
            "payload": json.dumps(payload).encode(), "timestamp_ms": now_ms()}))

    async def record(ctx: CallContext, response: dict) -> None:
        """One span per choice of vLLM's answer (each its own sequence id, all in the rollout),
        acked by Kafka on return; a choice without token ids -> dead letter missing_token_ids.
        Raises :class:`RecordFailed` (schema error, claim store or Kafka unavailable)."""
        items: list[tuple] = []
        for choice in range(max(1, len(response.get("choices") or []))):
            span = base_span(ctx, seq.next(ctx.rollout_id, ctx.attempt_id), response, choice)
            try:
                span["llm"] = llm_call_from_response(ctx.endpoint, ctx.body, response, policy.version, choice)
                span["llm"].update(recorded_content(ctx.endpoint == CHAT, ctx.body, response, choice, capture, tokenizer))
                value = codec.encode(ctx.topics.spans.record, span)
                # oversize: the record goes to MinIO, a small span with its ref to Kafka
                items.append((ctx.topics.spans, ctx.rollout_id, await claims.check_in(
                    claim_client, payload_bucket, ctx.topics.spans, ctx.rollout_id, span, value)))
            except MissingTokenIds as exc:
                items.append(dead_letter(ctx.topics, "missing_token_ids", str(exc), ctx.rollout_id, span))
            except codec.SchemaError as exc:
                raise RecordFailed(502, "schema_error", exc.detail) from exc
            except claims.ClaimStoreUnavailable as exc:
                raise RecordFailed(503, "claim_store_unavailable", str(exc)) from exc
        try:
            t0 = time.perf_counter()
            await sink.produce_raw(items)
            ack_s.observe(time.perf_counter() - t0)
        except KafkaUnavailable as exc:
            raise RecordFailed(503, "kafka_unavailable", str(exc)) from exc
        metrics["spans"] += len(items)

    async def stream(ctx: CallContext, path: str, events: StreamEvents) -> Response:
        """``stream: true``: vLLM's events at ``path`` made the client's as they come
        (``events.chunk``, streaming.relay); the spans written after vLLM's [DONE], and the
        client's closing events (``events.finish``: ``data: [DONE]`` for vLLM's own APIs) sent
        once Kafka acked them, a failure's event (``events.error``) otherwise. ``ctx.body`` is
        the body sent to vLLM."""
        client: httpx.AsyncClient = app.state.client
        body = streaming.upstream_stream_body(upstream_body(ctx.endpoint, ctx.body))
        t0 = time.perf_counter()
        try:
            upstream = await client.send(client.build_request("POST", path, json=body), stream=True)
        except httpx.TransportError as exc:
            return vllm_unavailable(exc)
        if upstream.status_code != 200:  # vLLM refused before streaming: its error as it is
            content = await upstream.aread()
            await upstream.aclose()
            metrics[f"vllm_http_{upstream.status_code}"] += 1
            return Response(content, upstream.status_code, media_type="application/json")
        metrics["streams"] += 1

        async def recorded(response: dict) -> bytes:
            upstream_s.labels(ctx.endpoint, "true").observe(time.perf_counter() - t0)  # after vLLM's [DONE]
            try:
                await record(ctx, response)
            except RecordFailed as exc:  # the stream ends with its error event, no [DONE]
                metrics[exc.reason] += 1
                raise
            return events.finish(response)

        async def interrupted(reason: str, detail: str, partial: dict) -> None:
            span = base_span(ctx, None, partial, 0)
            span["status_code"] = "ERROR"
            try:
                await sink.produce_raw([dead_letter(ctx.topics, reason, detail, ctx.rollout_id,
                                                    {"span": span, "partial_response": partial})])
            except KafkaUnavailable as exc:
                metrics["dead_letter_unwritten"] += 1
                log.error("stream of rollout %s ended early (%s) and Kafka did not take its dead letter: %s",
                          ctx.rollout_id, reason, exc)

        def lost(exc: Exception) -> None:
            if vllm_lost(exc) and policy.vllm_unreachable():
                log.warning("vLLM lost mid-stream (%r): policy version unsynced until the reloader posts one", exc)

        minted: dict[str, str] = {}  # vLLM's id -> ours: one id per stream, minted once, not per chunk

        def named(chunk: dict) -> dict:  # every chunk's id names the attempt (spanrl/core/response_ids.py)
            if "id" in chunk:
                upstream_id = str(chunk["id"] or "")
                if upstream_id not in minted:
                    minted[upstream_id] = response_ids.mint(upstream_id, ctx.rollout_id, ctx.attempt_id)
                chunk["id"] = minted[upstream_id]
            return chunk

        relay = streaming.Relay(ctx.endpoint, upstream.aiter_lines(), events.chunk, recorded, interrupted,
                                upstream.aclose, lost, events.error, edit=named)
        return streaming.EventStreamResponse(streaming.relay(relay, (httpx.TransportError,)),
                                             headers={"cache-control": "no-cache"})

    async def models() -> Response:
        """vLLM's model list (the same answer on every route family, for every rollout)."""
        try:
            upstream = await app.state.client.get("/v1/models")
        except httpx.TransportError as exc:
            if vllm_lost(exc):
                policy.vllm_unreachable()
            return error(503, "vllm_unavailable", repr(exc), {"Retry-After": RETRY_AFTER_S})
        return Response(upstream.content, upstream.status_code, media_type="application/json")

    # ---- production agents: the plain base URL {proxy}/v1, rollout from headers (spanrl/core/production.py)
    async def production_call(api: ClientApi, request: Request) -> Response:
        try:
            rollout = production.production_rollout(request.headers)
        except BadRequest as exc:
            return error(exc.status, exc.reason, exc.detail, param=exc.param)
        metrics["production_requests"] += 1
        response = await call(api, rollout.rollout_id, production.PRODUCTION_ATTEMPT, request,
                              attributes=production.span_attributes(rollout))
        response.headers[production.ROLLOUT_HEADER] = rollout.rollout_id
        return response

    # ---- the client APIs' routes: every API of CLIENT_APIS under every family of ROUTE_FAMILIES
    def rollout_route(api: ClientApi) -> Callable[..., Awaitable[Response]]:
        async def rollout_handler(rollout_id: str, attempt_id: str, request: Request) -> Response:
            return await call(api, rollout_id, attempt_id, request)
        return rollout_handler

    def eval_route(api: ClientApi) -> Callable[..., Awaitable[Response]]:
        async def eval_handler(sampling: str, rollout_id: str, attempt_id: str, request: Request) -> Response:
            return await call(api, rollout_id, attempt_id, request, eval_topics, sampling)
        return eval_handler

    def production_route(api: ClientApi) -> Callable[..., Awaitable[Response]]:
        async def production_handler(request: Request) -> Response:
            return await production_call(api, request)
        return production_handler

    handlers = {"rollout": rollout_route, "eval": eval_route, "production": production_route}
    for family, path, api in client_routes():
        app.add_api_route(path, handlers[family](api), methods=["POST"], name=f"{family}_{api.name}")
    for family, prefix in ROUTE_FAMILIES.items():
        app.add_api_route(prefix + "/models", models, methods=["GET"], name=f"{family}_models")

    @app.get("/admin/policy_version")
    async def get_version() -> dict:
        return policy.view()

    @app.post("/admin/policy_version")
    async def set_version(v: PolicyVersionIn) -> dict:
        policy.set_version(v.version, v.checkpoint)
        metrics["policy_version_updates"] += 1
        log.info("policy version -> %d (%s)", v.version, v.checkpoint)
        return policy.view()

    @app.post("/admin/policy_unsynced")
    async def set_unsynced(v: PolicyUnsyncedIn) -> dict:
        policy.unsync(v.reason)
        metrics["policy_unsynced_posts"] += 1
        log.warning("policy version unsynced: %s", v.reason)
        return policy.view()

    @app.get("/health")
    async def health() -> dict:
        try:
            vllm_ok = (await app.state.client.get("/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError as exc:
            if vllm_lost(exc):
                policy.vllm_unreachable()
            vllm_ok = False
        return {"status": "ok", "vllm": vllm_ok, "kafka_producer_started": sink.started,
                "policy_version": policy.version, "policy_synced": policy.synced}

    @app.get("/status")
    async def status() -> dict:
        """The counters as JSON (``http_<status>``, reasons, ``dead_letter.<reason>``, ...)."""
        return {**metrics, "policy_version": policy.version, "policy_synced": int(policy.synced),
                "sequence_attempts": len(seq)}

    @app.get("/metrics")
    async def get_metrics() -> Response:
        """The same counters and the latency histograms in the Prometheus text format."""
        return Response(prom.exposition(registry), media_type=prom.CONTENT_TYPE)

    return app


def client_routes(apis: tuple[ClientApi, ...] = CLIENT_APIS) -> list[tuple[str, str, ClientApi]]:
    """``(family, path, api)`` of every client-API route: each API of ``apis`` under each
    family of :data:`ROUTE_FAMILIES` (the proxy's POST routes, generated from this table)."""
    return [(family, prefix + api.route, api) for family, prefix in ROUTE_FAMILIES.items() for api in apis]


#: the request fields that truncate or bias vLLM's sampling distribution, and their neutral
#: values, the first being what the proxy sends (vLLM 0.32 ``SamplingParams``; for ``top_k`` both
#: 0 and -1 mean all tokens)
SAMPLING_DISTORTIONS = {"top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,), "presence_penalty": (0.0,),
                        "frequency_penalty": (0.0,), "repetition_penalty": (1.0,), "logit_bias": ({},),
                        "min_tokens": (0,), "bad_words": ([],), "allowed_token_ids": ([],)}
#: what a training call at the rollout temperature sends for the fields vLLM would otherwise
#: take from the model directory's generation_config.json (its priority: request, then the
#: model's defaults, then its own: ``ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS``, vLLM
#: 0.32), so a model's own top_k / top_p defaults cannot truncate what is trained on
NEUTRAL_SAMPLING = {k: SAMPLING_DISTORTIONS[k][0] for k in ("top_p", "top_k", "min_p", "presence_penalty",
                                                             "frequency_penalty", "repetition_penalty")}


def untrainable_sampling(body: dict) -> str | None:
    """Why the trainer could not score a call of vLLM ``body`` as it was sampled, or None.

    With ``SPANRL_ROLLOUT_TEMPERATURE`` set, vLLM's log-probs are those of the distribution
    it sampled from (``--logprobs-mode processed_logprobs``): after temperature and after
    top-p / top-k / min-p truncation, penalties, logit bias and banned tokens. The trainer
    divides its logits by the temperature only, so a call that set any of
    :data:`SAMPLING_DISTORTIONS` to a non-neutral value would give an importance ratio of two
    different distributions. Not refused: constrained decoding (``response_format``,
    structured outputs, ``tool_choice`` required or named, as the RAG agent's forced search),
    whose grammar mask vLLM applies to the logits before sampling in either logprobs mode;
    the trainer does not mask, with or without the setting.
    Example: ``{"top_p": 0.9, "top_k": -1}`` -> ``"top_p=0.9: ..."``."""
    bad = [f"{key}={json.dumps(body[key])}" for key, neutral in SAMPLING_DISTORTIONS.items()
           if body.get(key) is not None and body[key] not in neutral]
    if not bad:
        return None
    return (f"{', '.join(bad)}: with SPANRL_ROLLOUT_TEMPERATURE set, training calls sample the softmax at "
            "that temperature untruncated (the trainer scores no truncation or bias); leave these out of "
            "training calls")


def logprobs_mode_problem(status: int, server_info: dict | None) -> str | None:
    """What is wrong with vLLM's log-probs for a rollout temperature, from its
    ``GET /server_info?config_format=json`` answer (``status``, the JSON; vLLM's dev-mode
    endpoint, which spanrl's stack and manifests turn on for weight reloads), or None when
    vLLM returns ``processed_logprobs``. Example: (200, ``{"vllm_config": {"model_config":
    {"logprobs_mode": "raw_logprobs"}}}``) -> ``"vLLM returns raw_logprobs; start it with
    --logprobs-mode processed_logprobs"``."""
    if status != 200 or not isinstance(server_info, dict):
        return (f"GET /server_info answered {status}: its logprobs mode cannot be checked (vLLM needs "
                "VLLM_SERVER_DEV_MODE=1 and --logprobs-mode processed_logprobs)")
    config = server_info.get("vllm_config")
    model_config = config.get("model_config") if isinstance(config, dict) else None
    mode = model_config.get("logprobs_mode") if isinstance(model_config, dict) else None
    if mode == PROCESSED_LOGPROBS:
        return None
    return f"vLLM returns {mode}; start it with --logprobs-mode {PROCESSED_LOGPROBS}"


def eval_temperature(sampling: str) -> float | None:
    """The temperature an ``/eval/{sampling}/...`` route sets: a finite number >= 0, else None."""
    try:
        value = float(sampling)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def call_content_settings() -> tuple[bool, tuple[str, str | None]]:
    """(``SPANRL_CAPTURE_MESSAGES``, the served base model's tokenizer identity: its name and
    spanrl.core.tokenizer_id's hash of its directory's tokenizer files, None without them),
    read once when the app is made (spanrl/producers/content.py)."""
    from spanrl.core.settings import get_settings
    from spanrl.core.tokenizer_id import tokenizer_sha256

    s = get_settings()
    name = s.base_model_dir.name if s.base_model_dir else s.model
    return ProducerSettings().capture_messages, (name, tokenizer_sha256(s.model_dir))


def span_attributes(endpoint: str, body: dict, response: dict, agent: str | None, choice: int = 0) -> dict[str, str]:
    """GenAI semantic-convention attributes of the call of choice ``choice`` (all values as
    strings). With n > 1 (``gen_ai.request.choice.count``) each choice is its own call: its
    own finish reason, output tokens = its completion token count (vLLM's usage counts all
    choices), ``spanrl.choice_index`` its index."""
    usage = response.get("usage") or {}
    choices = response.get("choices") or []
    mine = choices[choice] if choice < len(choices) else {}
    output_tokens = usage.get("completion_tokens")
    if len(choices) > 1:
        output_tokens = len(mine["token_ids"]) if mine.get("token_ids") is not None else None
    attrs = {
        "gen_ai.operation.name": "chat" if endpoint == CHAT else "text_completion",
        "gen_ai.system": "vllm",
        "gen_ai.request.model": str(body.get("model")),
        "gen_ai.response.model": str(response.get("model")),
        "gen_ai.response.id": str(response.get("id")),
        "gen_ai.usage.input_tokens": str(usage.get("prompt_tokens")),
        "gen_ai.usage.output_tokens": str(output_tokens),
        "gen_ai.response.finish_reasons": json.dumps([mine.get("finish_reason")] if mine else []),
    }
    for key in ("temperature", "top_p", "max_tokens"):
        if body.get(key) is not None:
            attrs[f"gen_ai.request.{key}"] = json.dumps(body[key])
    if body.get("n") not in (None, 1):
        attrs["gen_ai.request.choice.count"] = json.dumps(body["n"])
        attrs["spanrl.choice_index"] = str(mine.get("index", choice))
    if body.get("stream"):
        attrs["spanrl.streamed"] = "true"
    attrs.update(tool_attributes(body, response, choice))
    if agent:
        attrs["spanrl.agent_name"] = agent
    return attrs


def _function_name(item) -> str | None:
    """``item["function"]["name"]`` of an OpenAI tool or tool call, None when it has none."""
    function = item.get("function") if isinstance(item, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


def tool_attributes(body: dict, response: dict, choice: int = 0) -> dict[str, str]:
    """Span attributes of a chat call's tools (none when it offered and called no tool).

    ``spanrl.tools``: JSON list of the offered functions' names (``body["tools"]``);
    ``spanrl.tool_choice``: the request's ``tool_choice`` as JSON (``"auto"``, ``"required"``,
    ``{"type": "function", "function": {"name": ...}}``); ``spanrl.tool_calls``: JSON list of
    the names of the functions choice ``choice`` called (``choices[choice].message.tool_calls``,
    as vLLM's tool-call parser read them from the completion). Malformed entries are skipped.
    """
    attrs: dict[str, str] = {}
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        attrs["spanrl.tools"] = json.dumps([n for n in map(_function_name, tools) if n is not None])
    if body.get("tool_choice") is not None:
        attrs["spanrl.tool_choice"] = json.dumps(body["tool_choice"])
    choices = response.get("choices") or []
    mine = choices[choice] if choice < len(choices) and isinstance(choices[choice], dict) else {}
    message = mine.get("message")
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if isinstance(calls, list) and calls:
        attrs["spanrl.tool_calls"] = json.dumps([n for n in map(_function_name, calls) if n is not None])
    return attrs


def main(argv: list[str] | None = None) -> None:
    from spanrl.core.edge import service_credentials
    from spanrl.core.settings import get_settings

    check_environment()
    s = get_settings()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default=s.host)
    p.add_argument("--port", type=int, default=s.proxy_port)
    p.add_argument("--vllm-url", default=s.vllm_url)
    p.add_argument("--model-name", default=s.model_name)
    p.add_argument("--kafka-bootstrap", default=s.kafka_bootstrap)
    p.add_argument("--topic-prefix", default=TopicSettings().topic_prefix)
    p.add_argument("--policy-version", type=int, default=ProducerSettings().policy_version,
                   help="label used until the reloader answers")
    p.add_argument("--reloader-url", default=f"http://{s.host}:{s.reloader_port}",
                   help="reloader asked for the served policy version ('' = never)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    topics = Topics.with_prefix(a.topic_prefix) if a.topic_prefix else Topics()
    eval_topics = Topics.with_prefix(a.topic_prefix, Topics.evaluation()) if a.topic_prefix else None
    app = create_app(Sink(a.kafka_bootstrap, topics, send_timeout_s=s.kafka_send_timeout_s), a.vllm_url,
                     a.model_name, a.policy_version, reloader_url=a.reloader_url.rstrip("/") or None,
                     credentials=service_credentials(s, "proxy", log), eval_topics=eval_topics,
                     rollout_temperature=s.rollout_temperature, reloader_token=s.admin_token,
                     rollout_idle_s=ProducerSettings().proxy_rollout_idle_s)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
