"""The client APIs the proxy serves, behind one interface: :class:`ClientApi`.

Every call the proxy records is one call of a vLLM API that returns every prompt and
completion token id and a log-prob per completion token: chat completions or completions.
A client API is how a client asks for that call and reads its answer. Each implementation
gives the three conversions:

- :meth:`ClientApi.vllm_request`: the client's request body -> the body of the vLLM call
  (chat completions for the Responses and Messages APIs); raises :class:`BadRequest` for what
  the proxy refuses (400 and a reason code; the proxy answers it in the OpenAI error shape,
  as every refusal, whatever the API);
- :meth:`ClientApi.stream`: -> the :class:`StreamEvents` of one streamed call: each vLLM chunk
  -> the client's server-sent events, the answer assembled from the whole stream -> the
  closing events (sent once Kafka acknowledged the call), a failure -> the event the stream
  ends with;
- :meth:`ClientApi.answer`: vLLM's answer (non-streamed) -> the client's response body;

and what routes and records need: ``name``, ``route`` (the path after a route family's
``/v1``), ``endpoint`` / ``upstream_path`` (the vLLM API that serves the call, the span's name),
``span_api`` (the span's ``spanrl.api``: None for vLLM's own APIs) and ``counter`` (the
``/status`` counter of its requests, None: only ``requests``).

:data:`CLIENT_APIS` is the table the proxy's routes are generated from, each API under every
route family (``proxy.ROUTE_FAMILIES``): serving another API is one implementation
and one row here. The translations themselves are pure and live with their API
(producers/responses.py, producers/messages.py); this module only puts them behind the
interface.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from spanrl.producers import messages, responses, streaming
from spanrl.core.edge import BadRequest
from spanrl.producers.streaming import CHAT, COMPLETIONS

#: the span's ``spanrl.api`` of a call made through the Anthropic Messages API
MESSAGES = "anthropic.messages"
#: vLLM's path of each of its APIs
UPSTREAM_PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}


@runtime_checkable
class StreamEvents(Protocol):
    """One streamed call as its client gets it (made per call: it may keep state, such as the
    Responses events' sequence numbers)."""

    def chunk(self, chunk: dict) -> bytes:
        """The bytes sent for one vLLM chunk as it arrives (b"": nothing)."""

    def finish(self, answer: dict) -> bytes:
        """The closing bytes, sent after Kafka acknowledged the call; ``answer``: the answer
        assembled from the whole stream (``streaming.StreamAccumulator.response()``)."""

    def error(self, reason: str, message: str, status: int) -> bytes:
        """The bytes a failed stream ends with (vLLM broke off, recording failed)."""


@runtime_checkable
class ClientApi(Protocol):
    """A client API the proxy serves from one vLLM call (see the module doc)."""

    name: str
    route: str
    endpoint: str
    upstream_path: str
    span_api: str | None
    counter: str | None

    def vllm_request(self, body: dict) -> dict:
        """The body of the vLLM call for the client's request ``body``; raises BadRequest."""

    def stream(self, client_body: dict, vllm_body: dict) -> StreamEvents:
        """The events of one streamed call of ``client_body``, sent to vLLM as ``vllm_body``."""

    def answer(self, client_body: dict, vllm_body: dict, response: dict) -> dict:
        """The client's response body of vLLM's ``response`` to ``vllm_body``."""


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


def sse_events(events: list[dict]) -> bytes:
    """Responses or Messages stream events as server-sent events, each named by its ``type``."""
    return b"".join(streaming.sse_event(e, e["type"]) for e in events)


@dataclass
class VllmStream:
    """vLLM's own stream, forwarded: each chunk minus what the client did not ask for
    (``streaming.strip_chunk``), ``data: [DONE]`` at the end, an OpenAI-shaped error event
    on failure."""

    endpoint: str
    body: dict

    def chunk(self, chunk: dict) -> bytes:
        """The chunk as its client gets it, or b"" when nothing of it is for the client."""
        out = streaming.strip_chunk(self.body, chunk, lambda c: strip_response(self.endpoint, self.body, c))
        return b"" if out is None else streaming.sse_event(out)

    def finish(self, answer: dict) -> bytes:
        """``data: [DONE]``."""
        return streaming.sse_event(streaming.DONE)

    def error(self, reason: str, message: str, status: int) -> bytes:
        """``streaming.error_event``: ``{"error": {"message", "type": reason, "code": status}}``."""
        return streaming.error_event(reason, message, status)


class TypedStream:
    """The stream of an API whose events are dicts named by their ``type`` (Responses,
    Messages), each sent as ``event: <type>`` + ``data: <json>``: ``events`` is that API's
    translator of one call (``responses.ResponseEvents``, ``messages.MessageEvents``)."""

    def __init__(self, events) -> None:
        self.events = events

    def chunk(self, chunk: dict) -> bytes:
        """The events the translator makes of one chat chunk."""
        return sse_events(self.events.chunk(chunk))

    def finish(self, answer: dict) -> bytes:
        """The translator's closing events of the assembled chat answer."""
        return sse_events(self.events.finish(answer))

    def error(self, reason: str, message: str, status: int) -> bytes:
        """The translator's error event (its API's shape; ``status`` is not in it)."""
        return sse_events([self.events.error(reason, message)])


@dataclass
class VllmApi:
    """One of vLLM's own APIs (chat completions, completions), served as it is: the client's
    body is the vLLM call's body (the same dict: the proxy adds the sampling seed and an
    evaluation temperature to it; a training call at ``SPANRL_ROLLOUT_TEMPERATURE`` goes to vLLM
    as a copy with that temperature and neutral truncation fields), and the answer and chunks
    go back minus the token ids and log-probs the client did not ask for (the proxy always asks
    vLLM for them)."""

    name: str
    route: str
    endpoint: str
    span_api: str | None = None
    counter: str | None = None
    #: vLLM's path of :attr:`endpoint`
    upstream_path: str = field(init=False)

    def __post_init__(self) -> None:
        self.upstream_path = UPSTREAM_PATHS[self.endpoint]

    def vllm_request(self, body: dict) -> dict:
        """``body`` itself."""
        return body

    def stream(self, client_body: dict, vllm_body: dict) -> VllmStream:
        """vLLM's stream forwarded (:class:`VllmStream`)."""
        return VllmStream(self.endpoint, vllm_body)

    def answer(self, client_body: dict, vllm_body: dict, response: dict) -> dict:
        """vLLM's answer, :func:`strip_response`-ed."""
        return strip_response(self.endpoint, vllm_body, response)


class ResponsesApi:
    """The OpenAI Responses API from one chat call (producers/responses.py)."""

    name = "responses"
    route = "/responses"
    endpoint = CHAT
    upstream_path = UPSTREAM_PATHS[CHAT]
    span_api = responses.RESPONSES
    counter = "responses_requests"

    def vllm_request(self, body: dict) -> dict:
        """``responses.chat_request``."""
        return responses.chat_request(body)

    def stream(self, client_body: dict, vllm_body: dict) -> TypedStream:
        """The Responses stream events (``responses.ResponseEvents``)."""
        return TypedStream(responses.ResponseEvents(client_body, vllm_body))

    def answer(self, client_body: dict, vllm_body: dict, response: dict) -> dict:
        """The Response object (``responses.response_object``; its log-probs as the client's
        ``include`` asks, its token ids never)."""
        return responses.response_object(client_body, vllm_body, response)


class MessagesApi:
    """Anthropic Messages from one chat call (producers/messages.py). The client's base URL is
    a route family's prefix without ``/v1``: the anthropic SDK adds ``/v1/messages``."""

    name = "messages"
    route = "/messages"
    endpoint = CHAT
    upstream_path = UPSTREAM_PATHS[CHAT]
    span_api = MESSAGES
    counter = "messages_requests"

    def vllm_request(self, body: dict) -> dict:
        """``messages.chat_request``, its ``MessagesError`` as a :class:`BadRequest`."""
        try:
            return messages.chat_request(body)
        except messages.MessagesError as exc:
            raise BadRequest(exc.status, exc.reason, exc.detail) from exc

    def stream(self, client_body: dict, vllm_body: dict) -> TypedStream:
        """The Messages stream events (``messages.MessageEvents``)."""
        return TypedStream(messages.MessageEvents())

    def answer(self, client_body: dict, vllm_body: dict, response: dict) -> dict:
        """The Messages answer (``messages.message_response``) of the stripped chat answer."""
        return messages.message_response(strip_response(CHAT, vllm_body, response))


CHAT_COMPLETIONS_API = VllmApi("chat_completions", "/chat/completions", CHAT)
COMPLETIONS_API = VllmApi("completions", "/completions", COMPLETIONS)
RESPONSES_API = ResponsesApi()
MESSAGES_API = MessagesApi()
#: every client API the proxy serves, each under every route family (proxy.ROUTE_FAMILIES)
CLIENT_APIS: tuple[ClientApi, ...] = (CHAT_COMPLETIONS_API, COMPLETIONS_API, RESPONSES_API, MESSAGES_API)
