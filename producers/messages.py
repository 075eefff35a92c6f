"""Anthropic Messages (``POST /v1/messages``) served from vLLM's chat completions: pure translation.

vLLM 0.32 serves ``/v1/messages`` itself, but its answer carries no token ids or log-probs even
when asked (``return_token_ids``, ``logprobs`` are not fields of its Messages request), so the
proxy could not record the call. The proxy therefore translates a Messages request into a chat
completions request (:func:`chat_request`), sends that to vLLM like any chat call (and records it
with its exact token ids), and translates the answer back (:func:`message_response`), or, with
``stream: true``, turns vLLM's chat chunks into the Messages stream events as they arrive
(:class:`MessageEvents`; the proxy's chat stream relay, producers/streaming.py, records the call
and sends ``message_stop`` only after Kafka acknowledged it).

Field meanings follow Anthropic's Messages API reference (docs.anthropic.com/en/api/messages):
request ``model``, ``max_tokens``, ``messages`` (``user`` / ``assistant`` turns of text,
``tool_use`` and ``tool_result`` blocks), ``system``, ``stop_sequences``, ``temperature``,
``top_p``, ``top_k``, ``stream``, ``tools`` (``name``, ``description``, ``input_schema``),
``tool_choice`` (``auto`` / ``any`` / ``tool`` / ``none``, ``disable_parallel_tool_use``); response
``content`` blocks (``text``, ``tool_use``), ``stop_reason`` (``end_turn``, ``max_tokens``,
``stop_sequence``, ``tool_use``), ``usage`` (``input_tokens``, ``output_tokens``); stream events
as in "Streaming Messages" (docs.anthropic.com/en/docs/build-with-claude/streaming) and the
``anthropic`` package's ``types/raw_message_stream_event.py`` (2.14).
Anything else the proxy cannot serve faithfully (images, documents, thinking, server tools)
is refused with :class:`MessagesError` (400 and a reason code), never dropped.
"""
from __future__ import annotations

import json
from typing import Any

import pydantic_core


class MessagesError(ValueError):
    """A Messages request the proxy refuses: HTTP ``status`` and a ``reason`` code."""

    def __init__(self, status: int, reason: str, detail: str):
        super().__init__(detail)
        self.status, self.reason, self.detail = status, reason, detail


def _invalid(detail: str) -> MessagesError:
    return MessagesError(400, "invalid_request", detail)


def _text_of(content: Any, where: str) -> str:
    """The text of a string or a list of ``text`` blocks (joined with newlines)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(f"{where}: content must be a string or a list of blocks")
    parts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise MessagesError(400, "unsupported_content", f"{where}: only text blocks are supported here, got {kind!r}")
        parts.append(block["text"])
    return "\n".join(parts)


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise _invalid(f"{where}: content must be a string or a list of blocks")
    return content


def _user_turn(content: Any, where: str) -> list[dict]:
    """Chat messages of one user turn: its ``tool_result`` blocks as ``tool`` messages (in
    order, first), then its text as one ``user`` message. An ``is_error`` result's text is
    prefixed ``Error: ``."""
    out, texts = [], []
    for i, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            text = _text_of(block.get("content", ""), f"{where}.content[{i}]")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": ("Error: " + text) if block.get("is_error") else text})
        else:
            raise MessagesError(400, "unsupported_content", f"{where}.content[{i}]: block type {kind!r} is not supported")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_turn(content: Any, where: str) -> dict:
    """One assistant chat message: its text, and its ``tool_use`` blocks as ``tool_calls``."""
    texts, calls = [], []
    for i, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and isinstance(block.get("id"), str) and isinstance(block.get("name"), str) \
                and isinstance(block.get("input", {}), dict):
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        else:
            raise MessagesError(400, "unsupported_content", f"{where}.content[{i}]: block type {kind!r} is not supported")
    message: dict = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise _invalid("tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or \
                not isinstance(tool.get("input_schema"), dict):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise MessagesError(400, "unsupported_tool", f"tools[{i}]: only client tools with name and input_schema "
                                f"are supported (got type {kind!r})")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """(chat ``tool_choice``, ``parallel_tool_calls`` or None) of an Anthropic ``tool_choice``."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _invalid("tool_choice of type 'tool' needs a name")
        mapped = {"type": "function", "function": {"name": choice["name"]}}
    if mapped is None:
        raise _invalid(f"tool_choice type must be auto, any, tool or none, got {kind!r}")
    return mapped, (False if choice.get("disable_parallel_tool_use") else None)


def chat_request(body: dict) -> dict:
    """The chat completions request of an Anthropic Messages request ``body``.

    ``system`` (string or text blocks) becomes the first ``system`` message; each user turn
    becomes its ``tool_result`` blocks as ``tool`` messages then its text; each assistant turn
    its text and ``tool_use`` blocks as ``tool_calls`` (``input`` as JSON ``arguments``);
    ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stream`` are copied, ``stop_sequences`` becomes
    ``stop``, ``tools`` become functions (``input_schema`` as ``parameters``), ``tool_choice``
    auto/any/tool/none becomes auto/required/named/none, ``output_config.format`` (a JSON
    schema) becomes ``response_format`` ``json_schema``. ``metadata`` and ``output_config.effort``
    are not used (the served model has no effort levels). ``temperature``, ``top_p`` and
    ``top_k`` are read too (anthropic 2.14's ``messages.create`` has no such parameters; ``extra_body`` sends them).

    Raises :class:`MessagesError`: 400 ``invalid_request`` (missing or mistyped fields; a
    ``stream`` that is not a boolean is refused by the proxy's ``check_stream``),
    ``unsupported_content`` (image, document, thinking... blocks),
    ``unsupported_tool`` (server tools), ``thinking_not_supported`` (``thinking`` enabled).
    """
    if (body.get("thinking") or {}).get("type") not in (None, "disabled"):
        raise MessagesError(400, "thinking_not_supported", "extended thinking is not supported by the served model")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise _invalid("max_tokens is required (an integer >= 1)")
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise _invalid("messages must be a non-empty list")
    chat: list[dict] = []
    if body.get("system") is not None:
        chat.append({"role": "system", "content": _text_of(body["system"], "system")})
    for i, turn in enumerate(turns):
        role = turn.get("role") if isinstance(turn, dict) else None
        if role == "user":
            chat += _user_turn(turn.get("content"), f"messages[{i}]")
        elif role == "assistant":
            chat.append(_assistant_turn(turn.get("content"), f"messages[{i}]"))
        else:
            raise _invalid(f"messages[{i}].role must be 'user' or 'assistant', got {role!r}")
    out: dict = {"model": body.get("model"), "messages": chat, "max_tokens": max_tokens}
    for key in ("temperature", "top_p", "top_k", "stream"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("stop_sequences") is not None:
        out["stop"] = body["stop_sequences"]
    fmt = (body.get("output_config") or {}).get("format") if isinstance(body.get("output_config"), dict) else None
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise _invalid("output_config.format must be {'type': 'json_schema', 'schema': {...}}")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"], parallel = _tool_choice(body["tool_choice"])
        if parallel is not None:
            out["parallel_tool_calls"] = parallel
    return out


def _stop_reason(choice: dict, tool_used: bool) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a chat choice: a tool call → ``tool_use``;
    ``length`` → ``max_tokens``; a stop string vLLM matched (its ``stop_reason``) →
    ``stop_sequence``; otherwise ``end_turn``."""
    if tool_used:
        return "tool_use", None
    if choice.get("finish_reason") == "length":
        return "max_tokens", None
    if isinstance(choice.get("stop_reason"), str):
        return "stop_sequence", choice["stop_reason"]
    return "end_turn", None


def tool_input(arguments: str | None) -> dict | None:
    """The ``input`` of a ``tool_use`` block: a chat tool call's ``arguments`` (JSON text; empty
    or None: ``{}``) parsed, or None when they are not a JSON object (Anthropic's ``input`` is one)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def message_response(chat: dict) -> dict:
    """The Anthropic Messages answer of a chat completions answer (its first choice).

    ``content``: a ``text`` block of the message's text (if any), then a ``tool_use`` block per
    tool call (``input`` = the parsed ``arguments``; a call whose arguments are not a JSON
    object stays a ``text`` block of the raw call); one empty ``text`` block when there is
    neither. ``usage`` from the chat usage; ``id`` and ``model`` copied.
    """
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    tool_used = False
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = tool_input(function.get("arguments"))
        if arguments is not None:
            content.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"), "input": arguments})
            tool_used = True
        else:
            content.append({"type": "text", "text": json.dumps(function)})
    if not content:
        content.append({"type": "text", "text": ""})
    stop_reason, stop_sequence = _stop_reason(choice, tool_used)
    usage = chat.get("usage") or {}
    return {"id": chat.get("id"), "type": "message", "role": "assistant", "model": chat.get("model"),
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": usage.get("prompt_tokens") or 0, "output_tokens": usage.get("completion_tokens") or 0}}


def object_prefix(text: str) -> bool:
    """Whether ``text`` is a JSON object or the beginning of one, as a streaming client's
    partial-JSON parser reads it: the anthropic SDK (2.14) parses the ``partial_json`` of a
    ``tool_use`` block received so far after every ``input_json_delta`` with
    ``jiter.from_json(partial_mode=True)`` and raises when that fails; ``pydantic_core.from_json``
    with ``allow_partial`` is the same parser (jiter), so ``'{"ci'`` is a prefix, ``'  '``,
    ``'[1'`` and ``'{"a" x'`` are not."""
    try:
        return isinstance(pydantic_core.from_json(text, allow_partial=True), dict)
    except ValueError:
        return False


class _ToolInput:
    """The ``input_json_delta`` pieces of one ``tool_use`` block: a chat tool call's streamed
    ``arguments`` forwarded while what was forwarded stays a JSON object or its beginning
    (:func:`object_prefix`). Leading whitespace is held back until a piece with more comes;
    once the arguments stop being an object's beginning (the model wrote malformed JSON), no
    later piece is forwarded, since a prefix that is not JSON never becomes JSON again and a
    client would raise on it (the recorded call keeps every token either way)."""

    def __init__(self) -> None:
        self.sent, self.held, self.broken = "", "", False

    def piece(self, text: str) -> str | None:
        """What to send of the next arguments piece ``text`` (None: nothing)."""
        if self.broken or not text:
            return None
        candidate = self.held + text
        if not (self.sent + candidate).strip():
            self.held = candidate
            return None
        if not object_prefix(self.sent + candidate):
            self.broken = True
            return None
        self.sent, self.held = self.sent + candidate, ""
        return candidate


class MessageEvents:
    """vLLM's chat stream of one call -> the Anthropic Messages stream events (pure, in order).

    :meth:`chunk` takes each parsed chat chunk (choice 0: Messages has no ``n``) as it arrives
    and returns the events it makes; :meth:`finish` takes the answer assembled from the whole
    stream (``streaming.StreamAccumulator.response()``) and returns the closing events, which
    the proxy sends only after Kafka acknowledged the call; :meth:`error` is the event a failed
    stream ends with. Each event is a dict with its ``type``, sent as ``event: <type>`` +
    ``data: <json>``; shapes as the ``anthropic`` package's ``RawMessageStreamEvent`` (2.14):

    - first chunk: ``message_start`` (``id``, ``model``, empty ``content``, ``stop_reason``
      null, ``usage.input_tokens`` = the prompt's token count vLLM sent, ``output_tokens`` 0),
      then a ``ping``;
    - text (``delta.content``): ``content_block_start`` of a ``text`` block (index 0, 1, …, in
      ``content`` order) before its first piece, then a ``content_block_delta`` ``text_delta``
      per chunk with text;
    - a tool call (a chat ``tool_calls`` delta of a new index, which carries the call's ``id``
      and whole ``name`` with vLLM's parsers): ``content_block_start`` of a ``tool_use`` block
      (``input: {}``), then a ``content_block_delta`` ``input_json_delta`` per arguments piece
      (:class:`_ToolInput` says which pieces); pieces of a call whose block is already closed
      are not sent (vLLM's parsers stream calls one after the other);
    - a block ends (``content_block_stop``) when the next one starts or at :meth:`finish`;
    - :meth:`finish`: the open block's stop (one empty ``text`` block first when nothing came,
      as :func:`message_response`), ``message_delta`` with ``stop_reason`` / ``stop_sequence`` /
      ``usage`` of :func:`message_response` of the assembled answer (the non-streamed rules:
      ``tool_use`` when a call's arguments are a JSON object, ``max_tokens``, ``stop_sequence``,
      ``end_turn``), then ``message_stop``.
    The streamed message equals the non-streamed :func:`message_response` of the same answer
    but for a call whose arguments are not a JSON object: non-streamed it is a ``text`` block
    of the raw call, streamed it was already a ``tool_use`` block (its input as far as it was
    an object's beginning) when that showed.
    """

    def __init__(self) -> None:
        self.started = False
        self.blocks = 0                      # content blocks opened so far
        self.open: int | None = None         # index of the open block
        self.open_kind: str | None = None    # its type: "text" or "tool_use"
        self.calls: dict[int, int] = {}      # chat tool-call index -> its block index
        self.inputs: dict[int, _ToolInput] = {}

    def _start(self, block: dict) -> list[dict]:
        events = self._stop()
        self.open, self.open_kind = self.blocks, block["type"]
        self.blocks += 1
        return events + [{"type": "content_block_start", "index": self.open, "content_block": block}]

    def _stop(self) -> list[dict]:
        if self.open is None:
            return []
        index, self.open, self.open_kind = self.open, None, None
        return [{"type": "content_block_stop", "index": index}]

    def _message_start(self, chunk: dict) -> list[dict]:
        self.started = True
        prompt = chunk.get("prompt_token_ids")
        message = {"id": chunk.get("id"), "type": "message", "role": "assistant", "model": chunk.get("model"),
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": len(prompt) if isinstance(prompt, list) else 0, "output_tokens": 0}}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def chunk(self, chunk: dict) -> list[dict]:
        events = [] if self.started else self._message_start(chunk)
        for choice in (chunk.get("choices") or [])[:1]:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.open_kind != "text":
                    events += self._start({"type": "text", "text": ""})
                events.append({"type": "content_block_delta", "index": self.open,
                               "delta": {"type": "text_delta", "text": delta["content"]}})
            for call in delta.get("tool_calls") or []:
                events += self._tool_call(call)
        return events

    def _tool_call(self, call: dict) -> list[dict]:
        i = call.get("index", len(self.calls))
        function = call.get("function") or {}
        events = []
        if i not in self.calls:
            events += self._start({"type": "tool_use", "id": call.get("id"), "name": function.get("name"), "input": {}})
            self.calls[i], self.inputs[self.open] = self.open, _ToolInput()
        index = self.calls[i]
        piece = self.inputs[index].piece(function.get("arguments") or "") if index == self.open else None
        if piece is not None:
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": piece}})
        return events

    def finish(self, chat: dict) -> list[dict]:
        final = message_response(chat)
        events = [] if self.started else self._message_start(chat)
        if self.blocks == 0:
            events += self._start({"type": "text", "text": ""})
        events += self._stop()
        return events + [
            {"type": "message_delta", "delta": {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]},
             "usage": final["usage"]},
            {"type": "message_stop"}]

    @staticmethod
    def error(reason: str, message: str) -> dict:
        """The stream's last event when it fails (vLLM broke off, Kafka did not acknowledge the
        call): Anthropic's ``error`` event ``{"type": "error", "error": {"type": reason,
        "message"}}``, the proxy's reason code as the error's type as in its other answers
        (the anthropic SDK raises ``APIStatusError`` with it as ``body``); no ``message_stop``
        follows."""
        return {"type": "error", "error": {"type": reason, "message": message}}
