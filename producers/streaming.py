"""Streamed calls: vLLM's server-sent events in, the client's events out, one record per choice.

Pure parts (no I/O), used by the proxy's chat/completions path and meant for any other
streamed endpoint served from vLLM's chat stream (the Responses API):

- :class:`SseDecoder`: lines of a ``text/event-stream`` body -> the ``data`` of each event;
- :class:`StreamAccumulator`: vLLM's chunks of one request -> the answer a non-streamed
  request would have got (token ids, log-probs, finish reasons, text, usage), which
  ``spanrl.producers.proxy.llm_call_from_response`` turns into LlmCall records as for any answer;
- :func:`upstream_stream_body`, :func:`strip_chunk`, :func:`sse_event`: what the proxy asks
  vLLM for and what it forwards.

Plumbing: :func:`relay` forwards each chunk as it arrives and ends the stream with what
``record`` says once the call is recorded. Its guarantees (producers/README.md, "Streaming"):

- the closing event (``data: [DONE]`` for chat/completions) is sent only after Kafka acknowledged
  the call's records; if recording fails the stream ends with an error event instead, never
  with ``[DONE]``;
- a stream that ends early (the client went away, vLLM failed or closed the stream) records no
  span: ``interrupted`` is called once with a reason code, and the proxy writes one dead letter
  holding the partial answer (so the call is counted and can be looked at, never half-written
  as a transition).

vLLM 0.32 streamed fields (``return_token_ids: true``, logprobs asked), checked against the
served model (tests/fixtures/vllm_*stream*.sse):
  chat:        first chunk of each choice: top-level ``prompt_token_ids``; every token chunk:
               ``choices[i].token_ids`` and ``choices[i].logprobs.content``; the end-of-sequence
               token comes in a chunk with empty content; usage in a last chunk with
               ``choices: []`` when ``stream_options.include_usage``
  completions: ``choices[i].prompt_token_ids`` in the choice's first chunk (null after),
               ``choices[i].token_ids`` and ``choices[i].logprobs.{tokens,token_logprobs,
               top_logprobs,text_offset}`` per chunk
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import StreamingResponse

log = logging.getLogger("spanrl.streaming")
CHAT, COMPLETIONS = "chat.completions", "completions"
DONE = "[DONE]"
# dead-letter reason codes of a stream that ended before vLLM's [DONE] (stage "proxy")
CLIENT_DISCONNECTED = "client_disconnected"
VLLM_STREAM_FAILED = "vllm_stream_failed"
PROXY_STREAM_FAILED = "proxy_stream_failed"
_COMPLETION_LOGPROB_LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


class SseDecoder:
    """Incremental decoder of ``text/event-stream`` lines (WHATWG HTML, "Server-sent events",
    9.2.6 "Interpreting an event stream"): :meth:`feed` one line (without its line ending)
    and get the ``data`` of the events it completes (a blank line ends an event; several
    ``data`` lines join with ``\\n``; comments and other fields are ignored)."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> list[str]:
        if line == "":
            if not self._data:
                return []
            data, self._data = "\n".join(self._data), []
            return [data]
        if line.startswith(":"):
            return []
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return []

    def close(self) -> list[str]:
        """The data of an event the stream ended without a blank line after (dispatched as
        the spec says: not at all; returned here so a caller can tell the stream was cut)."""
        data, self._data = self._data, []
        return ["\n".join(data)] if data else []


@dataclass
class _Choice:
    index: int
    role: str | None = None
    text: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict] = field(default_factory=dict)
    prompt_token_ids: list[int] | None = None  # completions: per choice
    token_ids: list[int] = field(default_factory=list)
    ids_missing: bool = False  # a chunk carried text but no token ids
    logprobs: dict[str, list] | None = None
    finish_reason: str | None = None
    stop_reason: object = None


class StreamAccumulator:
    """vLLM's streamed chunks of one request (parsed JSON, in order) -> the non-streamed answer.

    :meth:`add` each chunk; :meth:`response` gives the answer in the shape of vLLM's
    non-streamed response for ``endpoint`` (``chat.completions``: ``choices[i].message``,
    ``logprobs.content``, top-level ``prompt_token_ids``; ``completions``: ``choices[i].text``,
    ``logprobs.token_logprobs`` ..., per-choice ``prompt_token_ids``), choices sorted by
    index, with each choice's ``token_ids`` concatenated over its chunks (None when a chunk
    carried text without token ids: never guessed), its log-prob entries concatenated, its
    last finish reason, and the last usage seen. Raises ValueError for a chunk that is not
    an object with a list of choice objects (each with an int ``index``).
    """

    def __init__(self, endpoint: str):
        if endpoint not in (CHAT, COMPLETIONS):
            raise ValueError(f"unknown endpoint {endpoint!r}")
        self.endpoint = endpoint
        self.id: str | None = None
        self.model: str | None = None
        self.created: int | None = None
        self.prompt_token_ids: list[int] | None = None  # chat: top level
        self.usage: dict | None = None
        self.system_fingerprint: str | None = None
        self.chunks = 0
        self._choices: dict[int, _Choice] = {}

    def add(self, chunk: dict) -> None:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("choices", []), list):
            raise ValueError("a stream chunk must be an object with a list of choices")
        self.chunks += 1
        for key in ("id", "model", "created", "system_fingerprint"):
            if chunk.get(key) is not None and getattr(self, key) is None:
                setattr(self, key, chunk[key])
        if chunk.get("prompt_token_ids") is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = list(chunk["prompt_token_ids"])
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        for c in chunk.get("choices") or []:
            if not isinstance(c, dict) or not isinstance(c.get("index"), int):
                raise ValueError("a stream choice must be an object with an int index")
            self._add_choice(self._choices.setdefault(c["index"], _Choice(c["index"])), c)

    def _add_choice(self, ch: _Choice, c: dict) -> None:
        if self.endpoint == CHAT:
            delta = c.get("delta") or {}
            ch.role = ch.role or delta.get("role")
            text = delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                _merge_tool_call(ch.tool_calls, tc)
            entries = (c.get("logprobs") or {}).get("content")
            if entries is not None:
                ch.logprobs = ch.logprobs or {"content": []}
                ch.logprobs["content"] += entries
        else:
            text = c.get("text") or ""
            if c.get("prompt_token_ids") is not None and ch.prompt_token_ids is None:
                ch.prompt_token_ids = list(c["prompt_token_ids"])
            lp = c.get("logprobs")
            if lp is not None:
                ch.logprobs = ch.logprobs or {k: [] for k in _COMPLETION_LOGPROB_LISTS}
                for k in _COMPLETION_LOGPROB_LISTS:
                    ch.logprobs[k] += lp.get(k) or []
        ch.text.append(text)
        if c.get("token_ids") is not None:
            ch.token_ids += c["token_ids"]
        elif text:
            ch.ids_missing = True
        if c.get("finish_reason") is not None:
            ch.finish_reason = c["finish_reason"]
        if c.get("stop_reason") is not None:
            ch.stop_reason = c["stop_reason"]

    def finished(self) -> bool:
        """Whether at least one choice came and every choice has a finish reason."""
        return bool(self._choices) and all(c.finish_reason is not None for c in self._choices.values())

    def response(self) -> dict:
        choices = [self._choice_out(self._choices[i]) for i in sorted(self._choices)]
        out = {"id": self.id, "object": "chat.completion" if self.endpoint == CHAT else "text_completion",
               "created": self.created, "model": self.model, "choices": choices, "usage": self.usage}
        if self.system_fingerprint is not None:
            out["system_fingerprint"] = self.system_fingerprint
        if self.endpoint == CHAT:
            out["prompt_token_ids"] = self.prompt_token_ids
        return out

    def _choice_out(self, ch: _Choice) -> dict:
        text = "".join(ch.text)
        out: dict = {"index": ch.index}
        if self.endpoint == CHAT:
            message: dict = {"role": ch.role or "assistant", "content": text or None}
            if ch.tool_calls:
                message["tool_calls"] = [ch.tool_calls[i] for i in sorted(ch.tool_calls)]
            out["message"] = message
        else:
            out["text"] = text
            out["prompt_token_ids"] = ch.prompt_token_ids
        out.update(logprobs=ch.logprobs, finish_reason=ch.finish_reason, stop_reason=ch.stop_reason,
                   token_ids=None if ch.ids_missing else list(ch.token_ids))
        return out


def _merge_tool_call(calls: dict[int, dict], delta: dict) -> None:
    """One streamed ``tool_calls`` delta into the calls by index: id/type set once, the
    function's ``name`` and ``arguments`` concatenated (OpenAI chat streaming format)."""
    i = delta.get("index", len(calls))
    call = calls.setdefault(i, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    if delta.get("id"):
        call["id"] = delta["id"]
    if delta.get("type"):
        call["type"] = delta["type"]
    fn = delta.get("function") or {}
    call["function"]["name"] += fn.get("name") or ""
    call["function"]["arguments"] += fn.get("arguments") or ""


def wants_usage(client_body: dict) -> bool:
    """Whether the client asked for the usage chunk (``stream_options.include_usage``)."""
    opts = client_body.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get("include_usage"))


def upstream_stream_body(body: dict) -> dict:
    """The streamed request to vLLM (on top of what ``spanrl.producers.proxy.upstream_body`` adds):
    usage always asked (``stream_options.include_usage``, the client's other stream options
    kept), so the record has vLLM's token counts whether or not the client wants them."""
    out = dict(body)
    opts = body.get("stream_options")
    out["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    return out


def strip_chunk(client_body: dict, chunk: dict, strip: Callable[[dict], dict]) -> dict | None:
    """One vLLM chunk as the client gets it, or None when nothing of it is for the client.

    ``strip``: removes the token ids / log-probs the client did not ask for (the proxy's
    ``strip_response``, which works on chunks since they carry the same keys). Without
    ``stream_options.include_usage`` asked, ``usage`` is removed from every chunk and the
    usage-only last chunk (``choices: []``) is not sent (OpenAI's documented stream)."""
    out = strip(chunk)
    if not wants_usage(client_body) and "usage" in out:
        if not out.get("choices"):
            return None
        out = {k: v for k, v in out.items() if k != "usage"}
    return out


def sse_event(data: dict | str, event: str | None = None) -> bytes:
    """One server-sent event: ``event: NAME`` (optional) and ``data: JSON``, then a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return (head + "".join(f"data: {line}\n" for line in text.split("\n")) + "\n").encode("utf-8")


def error_event(reason: str, message: str, status: int) -> bytes:
    """The OpenAI-shaped error a stream ends with (the OpenAI SDK raises ``APIError`` on a
    chunk with an ``error`` key): ``{"error": {"message", "type": reason, "code": status}}``."""
    return sse_event({"error": {"message": message, "type": reason, "code": status}})


class RecordFailed(Exception):
    """Recording a call failed (Kafka / claim store unavailable, schema error): HTTP-like
    ``status`` and a ``reason`` code, sent as the stream's error event."""

    def __init__(self, status: int, reason: str, detail: str):
        super().__init__(detail)
        self.status, self.reason, self.detail = status, reason, detail


@dataclass
class Relay:
    """How one streamed call is forwarded and recorded (the parts :func:`relay` calls).

    ``lines``: the upstream body's lines (``httpx.Response.aiter_lines()``);
    ``forward(chunk) -> bytes for the client`` (b"" to send nothing);
    ``record(response) -> closing bytes``: writes the records of the assembled answer and
    returns when Kafka acknowledged them (raises :class:`RecordFailed`), then the closing
    bytes are sent; ``interrupted(reason, detail, response)``: records a stream that ended
    early (one dead letter); ``close()``: closes the upstream response (vLLM aborts the
    request when its client goes); ``lost(exc)``: told of a transport error mid-stream;
    ``fail_event(reason, message, status)``: the bytes a failed stream ends with (default
    :func:`error_event`, chat/completions' shape; another API passes its own); ``edit(chunk)
    -> chunk``: applied to each chunk before it is assembled and forwarded.
    """

    endpoint: str
    lines: AsyncIterator[str]
    forward: Callable[[dict], bytes]
    record: Callable[[dict], Awaitable[bytes]]
    interrupted: Callable[[str, str, dict], Awaitable[None]]
    close: Callable[[], Awaitable[None]]
    lost: Callable[[Exception], None] = lambda exc: None
    fail_event: Callable[[str, str, int], bytes] = error_event
    #: applied to every upstream chunk before it is assembled and forwarded (None: as it is)
    edit: Callable[[dict], dict] | None = None


async def relay(r: Relay, transport_errors: tuple[type[BaseException], ...] = ()) -> AsyncIterator[bytes]:
    """The client's stream (plumbing, see the module doc): each upstream chunk forwarded as it
    arrives; after vLLM's ``[DONE]``, ``r.record`` (its closing bytes only once Kafka acked);
    an ``error`` chunk from vLLM, a transport error (``transport_errors``), a malformed chunk or
    a stream that ends without ``[DONE]`` -> an error event and ``interrupted(VLLM_STREAM_FAILED)``;
    the client going away (cancellation / generator close) -> ``interrupted(CLIENT_DISCONNECTED)``.
    Recording is shielded from cancellation, so a call is either recorded or dead-lettered; a
    failure is recorded before its event is sent, so a client leaving then does not change it."""
    acc = StreamAccumulator(r.endpoint)
    settled = False  # recorded, or its interruption recorded

    async def fail(detail: str, reason: str = VLLM_STREAM_FAILED) -> None:
        nonlocal settled
        settled = True
        with anyio.CancelScope(shield=True):
            await r.interrupted(reason, detail, acc.response())

    try:
        decoder, done = SseDecoder(), False
        try:
            async for line in r.lines:
                for data in decoder.feed(line):
                    if data == DONE:
                        done = True
                        break
                    chunk = json.loads(data)
                    if isinstance(chunk, dict) and chunk.get("error") is not None:
                        err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
                        await fail(f"vLLM sent an error after {acc.chunks} chunks: {data[:300]}")
                        yield r.fail_event(str(err.get("type") or VLLM_STREAM_FAILED), str(err.get("message", "")),
                                           int(err["code"]) if isinstance(err.get("code"), int) else 502)
                        return
                    if r.edit is not None:
                        chunk = r.edit(chunk)
                    acc.add(chunk)
                    out = r.forward(chunk)
                    if out:
                        yield out
                if done:
                    break
        except transport_errors as exc:
            r.lost(exc)
            await fail(f"transport error after {acc.chunks} chunks: {exc!r}")
            yield r.fail_event("vllm_unavailable", f"vLLM stream broke after {acc.chunks} chunks: {exc!r}", 503)
            return
        except ValueError as exc:  # not JSON / not a chunk
            await fail(f"malformed chunk after {acc.chunks} chunks: {exc}")
            yield r.fail_event("vllm_stream_failed", f"vLLM sent a malformed chunk: {exc}", 502)
            return
        if not done:
            await fail(f"stream closed without [DONE] after {acc.chunks} chunks")
            yield r.fail_event("vllm_stream_failed", f"vLLM closed the stream after {acc.chunks} chunks", 502)
            return
        with anyio.CancelScope(shield=True):
            try:
                closing = await r.record(acc.response())
            except RecordFailed as exc:
                closing = r.fail_event(exc.reason, exc.detail, exc.status)
            settled = True
        yield closing
    except Exception as exc:  # noqa: BLE001 - a bug here must still settle the call
        log.exception("stream relay failed")
        if not settled:
            await fail(f"proxy error after {acc.chunks} chunks: {exc!r}", PROXY_STREAM_FAILED)
        yield r.fail_event(PROXY_STREAM_FAILED, "the proxy failed while streaming", 500)
    finally:
        with anyio.CancelScope(shield=True):
            if not settled:
                await fail(f"the client went away after {acc.chunks} chunks", CLIENT_DISCONNECTED)
            await r.close()


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` response whose generator is always closed when the response ends,
    shielded from cancellation: when the client goes away Starlette cancels the sending task
    (or stops iterating), and the generator's cleanup (:func:`relay` recording the interrupted
    call, closing the upstream stream) must still run at once, not whenever it is collected."""

    media_type = "text/event-stream"

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
