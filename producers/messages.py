"""Anthropic Messages (``POST /v1/messages``) served from vLLM's chat completions: pure translation.

vLLM 0.32 serves ``/v1/messages`` itself, but its answer carries no token ids or log-probs even
when asked (``return_token_ids``, ``logprobs`` are not fields of its Messages request), so the
proxy could not record the call. The proxy therefore translates a Messages request into a chat
completions request (:func:`chat_request`), sends that to vLLM like any chat call (and records it
with its exact token ids), and translates the answer back (:func:`message_response`).

Field meanings follow Anthropic's Messages API reference (docs.anthropic.com/en/api/messages):
request ``model``, ``max_tokens``, ``messages`` (``user`` / ``assistant`` turns of text,
``tool_use`` and ``tool_result`` blocks), ``system``, ``stop_sequences``, ``temperature``,
``top_p``, ``top_k``, ``tools`` (``name``, ``description``, ``input_schema``), ``tool_choice``
(``auto`` / ``any`` / ``tool`` / ``none``, ``disable_parallel_tool_use``); response ``content``
blocks (``text``, ``tool_use``), ``stop_reason`` (``end_turn``, ``max_tokens``,
``stop_sequence``, ``tool_use``), ``usage`` (``input_tokens``, ``output_tokens``).
Anything else the proxy cannot serve faithfully (images, documents, thinking, server tools,
streaming) is refused with :class:`~spanrl.producers.proxy.BadRequest`-shaped errors, never dropped.
"""
from __future__ import annotations

import json
from typing import Any


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
    ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` are copied, ``stop_sequences`` becomes
    ``stop``, ``tools`` become functions (``input_schema`` as ``parameters``), ``tool_choice``
    auto/any/tool/none becomes auto/required/named/none, ``output_config.format`` (a JSON
    schema) becomes ``response_format`` ``json_schema``. ``metadata`` and ``output_config.effort``
    are not used (the served model has no effort levels). ``temperature``, ``top_p`` and
    ``top_k`` are read too (anthropic 2.14's ``messages.create`` has no such parameters; ``extra_body`` sends them).

    Raises :class:`MessagesError`: 400 ``invalid_request`` (missing or mistyped fields),
    ``stream_not_supported``, ``unsupported_content`` (image, document, thinking... blocks),
    ``unsupported_tool`` (server tools), ``thinking_not_supported`` (``thinking`` enabled).
    """
    if body.get("stream"):
        raise MessagesError(400, "stream_not_supported", "stream=true is not supported on /v1/messages yet")
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
    for key in ("temperature", "top_p", "top_k"):
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
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except ValueError:
            arguments = None
        if isinstance(arguments, dict):
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
