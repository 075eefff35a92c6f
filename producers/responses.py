"""The OpenAI Responses API (``POST .../v1/responses``) served from vLLM's chat completions.

Why chat completions and not vLLM's own ``/v1/responses`` (checked on vLLM 0.32, the stack's
SmolLM2-135M-Instruct, and in ``vllm/entrypoints/openai/responses/serving.py``):
- token ids: vLLM's Responses returns them only as ``input_messages`` / ``output_messages``
  (``enable_response_messages: true``, non-background only);
- log-probs: only on ``output_text`` parts (``include: ["message.output_text.logprobs"]``,
  computed over the whole completion, ``_make_response_output_items``); a ``function_call``
  item has none (``build_response_output_items``), and with ``include_reasoning: false``
  the text's are dropped too, so the tokens of a tool call, the Agents SDK's main path,
  would have no behaviour log-probs;
- checked with a tool-call parser (hermes): a forced call came back as a ``function_call``
  item without log-probs, its 32 tokens only in ``output_messages``; without a parser a named
  ``tool_choice`` was silently ignored (free text), where chat refuses it with a 400;
- ``store`` / ``previous_response_id`` are off by default (``VLLM_ENABLE_RESPONSES_API_STORE``)
  and then live in one vLLM process's memory, lost when it restarts.
Chat completions returns every prompt and completion token id and a log-prob per completion
token (what :func:`spanrl.producers.proxy.llm_call_from_response` records), so a Responses request is
translated to one chat request (:func:`chat_request`), sent through the proxy's chat path
(recorded as one chat call, attribute ``spanrl.api`` ``responses``), and vLLM's chat answer is translated back to
a Response object (:func:`response_object`). Source of the shapes: the ``openai`` package's
``types/responses`` (3.57) and the API reference (platform.openai.com/docs/api-reference/responses).

Nothing is stored: ``previous_response_id``, ``conversation``, ``background``, stored
``prompt`` templates and ``context_management`` get 400 ``stateful_not_supported`` naming the
field (an agent sends the whole conversation as ``input``, as the Agents SDK and LangChain do
by default); ``store`` itself is accepted (it only matters when a later request refers back).
Everything else either maps to chat (see :data:`TRANSLATED`), is harmless to leave out
(:data:`ACCEPTED`, each with its reason) or is refused with 400 and the field as ``param``.
"""
from __future__ import annotations

from spanrl.core.edge import BadRequest

RESPONSES = "responses"
LOGPROBS_INCLUDE = "message.output_text.logprobs"

#: Responses request fields that become chat request fields
TRANSLATED = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
    "max_output_tokens", "temperature", "top_p", "top_logprobs", "include", "stream", "reasoning",
    "truncation",
})
#: accepted and not sent on, because for this proxy they change nothing
ACCEPTED = {
    "store": "nothing is stored; a request that refers back to a response gets its 400",
    "metadata": "echoed in the Response",
    "user": "echoed in the Response",
    "safety_identifier": "an abuse-monitoring id for OpenAI",
    "prompt_cache_key": "vLLM's prefix cache needs no key",
    "prompt_cache_retention": "vLLM's prefix cache has no retention setting",
    "service_tier": "one tier",
    "max_tool_calls": "counts built-in tools, which are refused",
    "stream_options": "include_obfuscation: the stream is not obfuscated",
}
#: vLLM sampling extras a client may add (``extra_body``); passed to chat as they are
VLLM_EXTRAS = frozenset({"seed", "stop", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                         "frequency_penalty"})
#: server-side state the proxy does not keep
STATEFUL = {
    "previous_response_id": "the spanrl proxy stores no responses; send the whole conversation as input",
    "conversation": "the spanrl proxy keeps no conversations; send the whole conversation as input",
    "background": "the spanrl proxy answers in the foreground only",
    "background_options": "the spanrl proxy answers in the foreground only",
    "prompt": "the spanrl proxy has no stored prompt templates",
    "context_management": "the spanrl proxy does not compact conversations",
}


def _refuse(param: str, detail: str, reason: str = "unsupported_parameter") -> BadRequest:
    return BadRequest(400, reason, f"{param}: {detail}", param)


def check_fields(body: dict) -> None:
    """Raise :class:`BadRequest` (400) for a field the proxy cannot honour.

    ``stateful_not_supported``: a :data:`STATEFUL` field set (``background: false`` and nulls
    are fine); ``reasoning_not_supported``: ``reasoning`` asks for effort or a summary (the
    served model has no reasoning mode); ``invalid_request``: ``reasoning`` not an object,
    ``include`` not a list; ``unsupported_parameter``: ``truncation: "auto"``,
    ``text.verbosity``, or a field set (not null) that is in none of :data:`TRANSLATED`,
    :data:`ACCEPTED`, :data:`VLLM_EXTRAS`, :data:`STATEFUL` (e.g. ``n``: Responses has no ``n``).
    """
    for key, why in STATEFUL.items():
        value = body.get(key)
        if value not in (None, False, [], {}):
            raise _refuse(key, why, "stateful_not_supported")
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise _refuse("reasoning", "must be an object", "invalid_request")
        asked = {k: v for k, v in reasoning.items() if v not in (None, "none")}
        if asked:
            raise _refuse("reasoning", f"the served model has no reasoning mode (asked {sorted(asked)})",
                          "reasoning_not_supported")
    if not isinstance(body.get("include") or [], list):
        raise _refuse("include", "must be a list", "invalid_request")
    if body.get("truncation") not in (None, "disabled"):
        raise _refuse("truncation", "only 'disabled': the proxy does not drop input to fit the context")
    unknown = sorted(k for k in set(body) - TRANSLATED - set(ACCEPTED) - VLLM_EXTRAS - set(STATEFUL)
                     if body[k] is not None)
    if unknown:
        raise _refuse(unknown[0], f"not supported by the spanrl proxy's Responses API (fields {unknown})")


def _text_parts(content, where: str, allowed: tuple[str, ...]) -> str | list[dict]:
    """Chat content of a Responses content: a string stays a string, a list of text parts
    (types in ``allowed``) becomes chat ``{"type": "text", "text"}`` parts. Images, files and
    audio are refused (``unsupported_content``: the served model reads text only)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(where, "content must be a string or a list of content parts", "invalid_request")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise _refuse(where, f"content part {kind!r} is not supported (text only: {list(allowed)})",
                          "unsupported_content")
        if not isinstance(part.get("text"), str):
            raise _refuse(where, f"content part {kind!r} has no text", "invalid_request")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def chat_messages(instructions: str | None, items) -> list[dict]:
    """Chat ``messages`` of a Responses ``instructions`` + ``input``.

    - ``instructions`` → a first ``system`` message;
    - ``input`` a string → one ``user`` message;
    - a message item (``{"role", "content"}``, ``type`` ``"message"`` or absent; roles
      ``user``/``system``/``developer``/``assistant`` kept as they are) → that message, its
      ``input_text`` / ``output_text`` parts as chat text parts;
    - ``function_call`` ``{"call_id", "name", "arguments"}`` → a ``tool_calls`` entry
      ``{"id": call_id, "type": "function", "function": {"name", "arguments"}}`` of the
      assistant message just before (so an answer with text and calls, which the proxy
      returns as a message item and function_call items, goes back as the one assistant
      message vLLM produced), or of a new assistant message (``content: None``);
    - ``function_call_output`` ``{"call_id", "output"}`` → ``{"role": "tool",
      "tool_call_id": call_id, "content": output}``.
    Raises :class:`BadRequest`: 400 ``invalid_request`` for malformed items,
    ``unsupported_input_item`` for other item types (reasoning, hosted-tool calls, …),
    ``stateful_not_supported`` for ``item_reference``, ``unsupported_content`` for non-text parts.
    """
    messages: list[dict] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _refuse("instructions", "must be a string", "invalid_request")
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _refuse("input", "must be a string or a list of items", "invalid_request")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _refuse(where, "an item must be an object", "invalid_request")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _refuse(where, f"role {role!r} is not one of user, system, developer, assistant",
                              "invalid_request")
            allowed = ("output_text", "input_text") if role == "assistant" else ("input_text",)
            messages.append({"role": role, "content": _text_parts(item.get("content"), where, allowed)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise _refuse(where, "a function_call needs string call_id, name and arguments", "invalid_request")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _refuse(where, "a function_call_output needs a string call_id", "invalid_request")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_parts(item.get("output"), where, ("input_text",))})
        elif kind == "item_reference":
            raise _refuse(where, "item_reference: the spanrl proxy stores no items; send the item itself",
                          "stateful_not_supported")
        else:
            raise _refuse(where, f"input item type {kind!r} is not supported (message, function_call, "
                          "function_call_output)", "unsupported_input_item")
    return messages


def chat_tool(tool, where: str = "tools") -> dict:
    """Chat tool of a Responses function tool ``{"type": "function", "name", "description",
    "parameters", "strict"}`` → ``{"type": "function", "function": {...}}`` (absent and null
    fields left out). Other tool types (web_search, file_search, mcp, …) are hosted by
    OpenAI: 400 ``unsupported_tool``."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise _refuse(where, f"tool type {kind!r} is not supported (function tools only)", "unsupported_tool")
    if not isinstance(tool.get("name"), str):
        raise _refuse(where, "a function tool needs a string name", "invalid_request")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def chat_tool_choice(choice) -> str | dict:
    """Chat ``tool_choice`` of a Responses one: ``"none" | "auto" | "required"`` as they are,
    ``{"type": "function", "name": N}`` → ``{"type": "function", "function": {"name": N}}``.
    Others (``allowed_tools``, hosted tools, ``custom``, ``mcp``): 400 ``unsupported_tool_choice``."""
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise _refuse("tool_choice", f"{kind!r} is not supported (none, auto, required or a function)",
                  "unsupported_tool_choice")


def chat_response_format(text) -> dict | None:
    """Chat ``response_format`` of a Responses ``text`` config: ``format`` ``{"type": "text"}``
    (or none) → None; ``{"type": "json_object"}`` as it is; ``{"type": "json_schema", "name",
    "schema", "description", "strict"}`` → ``{"type": "json_schema", "json_schema": {"name",
    "schema", "description", "strict"}}``. ``verbosity`` set: 400 ``unsupported_parameter``
    (a GPT-5 hint this model cannot follow)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _refuse("text", "must be an object", "invalid_request")
    if text.get("verbosity") is not None:
        raise _refuse("text.verbosity", "the served model has no verbosity control")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise _refuse("text.format", "a json_schema format needs a name and a schema object", "invalid_request")
        schema = {k: fmt[k] for k in ("name", "schema", "description", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise _refuse("text.format", f"format type {kind!r} is not supported (text, json_object, json_schema)")


def chat_request(body: dict) -> dict:
    """The chat completions request of one Responses request (``body`` as the client sent it).

    ``max_output_tokens`` → ``max_tokens``; ``temperature``, ``top_p``, ``parallel_tool_calls``,
    ``stream`` and :data:`VLLM_EXTRAS` as they are; ``top_logprobs`` → ``top_logprobs`` (the
    proxy asks vLLM for log-probs anyway); the rest through :func:`chat_messages`,
    :func:`chat_tool`, :func:`chat_tool_choice`, :func:`chat_response_format`. Fields not sent
    stay unsent (vLLM's defaults apply, as for a chat client). Raises :class:`BadRequest`
    (:func:`check_fields` and the functions above).
    """
    check_fields(body)
    out: dict = {"model": body.get("model"),
                 "messages": chat_messages(body.get("instructions"), body.get("input", []))}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise _refuse("tools", "must be a list", "invalid_request")
        out["tools"] = [chat_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    if body.get("tool_choice") is not None:
        out["tool_choice"] = chat_tool_choice(body["tool_choice"])
    response_format = chat_response_format(body.get("text"))
    if response_format is not None:
        out["response_format"] = response_format
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    for key in ("temperature", "top_p", "parallel_tool_calls", "top_logprobs", "stream", *sorted(VLLM_EXTRAS)):
        if body.get(key) is not None:
            out[key] = body[key]
    return out


def wants_logprobs(body: dict) -> bool:
    """Whether a Responses request asked for ``output_text`` log-probs."""
    return LOGPROBS_INCLUDE in (body.get("include") or [])


def response_id(chat_id: str) -> str:
    """``resp_<x>`` of vLLM's ``chatcmpl-<x>`` (one Response per chat answer)."""
    return "resp_" + str(chat_id).removeprefix("chatcmpl-")


def usage(chat_usage: dict | None) -> dict | None:
    """Responses ``usage`` of a chat ``usage``: prompt → input tokens (cached from
    ``prompt_tokens_details.cached_tokens``, 0 when vLLM gives none; ``cache_write_tokens`` 0:
    vLLM's prefix cache is not billed), completion → output tokens (no reasoning tokens: the
    model has no reasoning mode)."""
    if not chat_usage:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": chat_usage.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat_usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage.get("total_tokens", 0)}


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    """(``status``, ``incomplete_details``) of a chat ``finish_reason``: ``length`` →
    ``incomplete`` / ``max_output_tokens``, ``content_filter`` → ``incomplete`` /
    ``content_filter``, anything else (``stop``, ``tool_calls``) → ``completed``."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def text_logprobs(chat_logprobs: dict | None) -> list[dict]:
    """``output_text.logprobs`` of a chat choice's ``logprobs``: each token's ``{"token",
    "bytes", "logprob", "top_logprobs": [{"token", "bytes", "logprob"}]}`` (the same shape)."""
    out = []
    for t in (chat_logprobs or {}).get("content") or []:
        out.append({"token": t.get("token"), "bytes": t.get("bytes"), "logprob": t.get("logprob"),
                    "top_logprobs": [{"token": x.get("token"), "bytes": x.get("bytes"), "logprob": x.get("logprob")}
                                     for x in t.get("top_logprobs") or []]})
    return out


def message_item(item_id: str, text: str, status: str, logprobs: list[dict] | None) -> dict:
    """A finished assistant ``message`` output item ``msg_<item_id>`` with one ``output_text``
    part (``logprobs`` on it when not None)."""
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"type": "message", "id": f"msg_{item_id}", "role": "assistant", "status": status, "content": [part]}


def call_item(item_id: str, i: int, call_id: str | None, name: str | None, arguments: str,
              status: str = "completed") -> dict:
    """A ``function_call`` output item ``fc_<item_id>_<i>`` (``i``: the call's position)."""
    return {"type": "function_call", "id": f"fc_{item_id}_{i}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(choice: dict, item_id: str, logprobs: bool) -> list[dict]:
    """Responses ``output`` of one chat choice: a ``message`` item ``msg_<item_id>`` with one
    ``output_text`` part when the answer has text (or has neither text nor tool calls: then the
    text is ``""``), then a ``function_call`` item ``fc_<item_id>_<i>`` per tool call
    (``call_id`` = the chat tool call's id). ``logprobs``: put the log-probs of all the
    choice's tokens (the end-of-sequence token's included) on the text part, only when there
    are no tool calls (with calls they also cover the calls' tokens, which Responses has no
    place for)."""
    message = choice.get("message") or {}
    content, calls = message.get("content"), message.get("tool_calls") or []
    status, _ = status_of(choice.get("finish_reason"))
    items = []
    if content or not calls:
        lp = text_logprobs(choice.get("logprobs")) if logprobs and not calls else None
        items.append(message_item(item_id, content or "", "completed" if status == "completed" else "incomplete", lp))
    for i, call in enumerate(calls):
        fn = call.get("function") or {}
        items.append(call_item(item_id, i, call.get("id"), fn.get("name"), fn.get("arguments") or ""))
    return items


def envelope(body: dict, chat_body: dict, rid: str, created: int | None, model: str | None) -> dict:
    """A Response object without its outcome (``status`` ``in_progress``, no output, no
    usage): what a stream's ``response.created`` carries, and the frame of the final one.
    Echoes the request's settings as the API does; ``temperature`` / ``top_p`` are what was
    sent to vLLM (an evaluation route may have set the temperature), None when vLLM's
    defaults applied."""
    return {
        "id": rid, "object": "response", "created_at": created, "status": "in_progress",
        "error": None, "incomplete_details": None,
        "instructions": body.get("instructions"), "metadata": body.get("metadata"), "model": model,
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "temperature": chat_body.get("temperature"), "top_p": chat_body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"), "top_logprobs": body.get("top_logprobs"),
        "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
        "text": body.get("text") or {"format": {"type": "text"}},
        "previous_response_id": None, "reasoning": None, "truncation": "disabled", "background": False,
        "user": body.get("user"), "usage": None,
    }


def response_object(body: dict, chat_body: dict, chat: dict) -> dict:
    """The Response object of vLLM's chat answer ``chat`` (non-streamed, or assembled from a
    stream) to ``chat_body`` (from :func:`chat_request` of the client's ``body``): the
    :func:`envelope` with status, :func:`output_items` and :func:`usage`."""
    choice = (chat.get("choices") or [{}])[0]
    status, incomplete = status_of(choice.get("finish_reason"))
    rid = response_id(chat.get("id", ""))
    out = envelope(body, chat_body, rid, chat.get("created"), chat.get("model"))
    out.update(status=status, incomplete_details=incomplete, usage=usage(chat.get("usage")),
               output=output_items(choice, rid.removeprefix("resp_"), wants_logprobs(body)))
    return out


class ResponseEvents:
    """vLLM's chat stream of one call -> the Responses API's stream events (pure, in order).

    :meth:`chunk` takes each parsed chat chunk as it arrives and returns the events it makes;
    :meth:`finish` takes the answer assembled from the whole stream (the non-streamed shape,
    ``streaming.StreamAccumulator.response()``) and returns the closing events. Each event is
    ``{"type", "sequence_number", ...}`` (0, 1, 2, … over the stream), shaped as the ``openai``
    package's ``types/responses/response_*_event.py`` (3.57):

    - first chunk: ``response.created``, ``response.in_progress`` (the :func:`envelope`);
    - text: ``response.output_item.added`` (a ``message``, ``in_progress``, no content) and
      ``response.content_part.added`` (empty ``output_text``) before the first text, then
      ``response.output_text.delta`` per chunk with text (its tokens' log-probs when
      ``include`` asks, else ``[]``);
    - a tool call (chat ``tool_calls`` delta of a new index): ``response.output_item.added``
      (a ``function_call`` with its ``call_id`` and ``name``, empty ``arguments``), then
      ``response.function_call_arguments.delta`` per arguments piece;
    - an item ends when the next one starts or at :meth:`finish`: text ``output_text.done``,
      ``content_part.done``, ``output_item.done``; call ``function_call_arguments.done``,
      ``output_item.done``;
    - :meth:`finish`: the open item's end (an empty message if nothing came, as
      :func:`output_items`), then ``response.completed``, or ``response.incomplete`` when the
      answer was cut (``max_output_tokens``), with the :func:`response_object` whose output is
      the items as streamed (same ids as the deltas).
    Items are numbered as :func:`output_items` numbers them, so the streamed and the
    non-streamed Response of the same answer are equal (one exception: a message followed by
    calls is closed ``completed`` when the first call starts, before a later cut could make it
    ``incomplete``).
    """

    def __init__(self, body: dict, chat_body: dict):
        self.body, self.chat_body = body, chat_body
        self.logprobs = wants_logprobs(body)
        self.seq = 0
        self.rid: str | None = None
        self.items: list[dict] = []          # finished output items, in output order
        self.open: dict | None = None        # the item being streamed (an output item) and its output index
        self.open_index = -1
        self.text: list[str] = []
        self.calls = 0                        # function calls opened so far
        self.entries: list[dict] = []         # every chat log-prob entry of the stream

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _item_id(self) -> str:
        return self.rid.removeprefix("resp_")

    def _start(self, item: dict) -> list[dict]:
        events = self._close()
        self.open, self.open_index = item, len(self.items)
        events.append(self._event("response.output_item.added", output_index=self.open_index,
                                  item={**item, "status": "in_progress"}))
        if item["type"] == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=self.open_index, content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        return events

    def _close(self, status: str = "completed", with_logprobs: bool = False) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self.open_index}
        if item["type"] == "message":
            lp = text_logprobs({"content": self.entries}) if self.logprobs and with_logprobs else None
            done = message_item(self._item_id(), "".join(self.text), status, lp)
            part = done["content"][0]
            events = [self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                                  logprobs=part.get("logprobs") or []),
                      self._event("response.content_part.done", **where, content_index=0, part=part)]
        else:
            done = item
            events = [self._event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=item["arguments"])]
        self.items.append(done)
        return events + [self._event("response.output_item.done", output_index=self.open_index, item=done)]

    def chunk(self, chunk: dict) -> list[dict]:
        events: list[dict] = []
        if self.rid is None:
            self.rid = response_id(chunk.get("id", ""))
            shell = envelope(self.body, self.chat_body, self.rid, chunk.get("created"), chunk.get("model"))
            events += [self._event("response.created", response=shell),
                       self._event("response.in_progress", response=shell)]
        for choice in chunk.get("choices") or []:
            entries = (choice.get("logprobs") or {}).get("content") or []
            self.entries += entries
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.open is None or self.open["type"] != "message":
                    events += self._start(message_item(self._item_id(), "", "in_progress", None) | {"content": []})
                self.text.append(delta["content"])
                lp = [{"token": e.get("token"), "logprob": e.get("logprob"),
                       "top_logprobs": [{"token": x.get("token"), "logprob": x.get("logprob")}
                                        for x in e.get("top_logprobs") or []]}
                      for e in entries] if self.logprobs else []
                events.append(self._event("response.output_text.delta", item_id=self.open["id"],
                                          output_index=self.open_index, content_index=0,
                                          delta=delta["content"], logprobs=lp))
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                if call.get("id") or self.open is None or self.open["type"] != "function_call":
                    events += self._start(call_item(self._item_id(), self.calls, call.get("id"), fn.get("name"), ""))
                    self.calls += 1
                if fn.get("arguments"):
                    self.open["arguments"] += fn["arguments"]
                    events.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                              output_index=self.open_index, delta=fn["arguments"]))
        return events

    def error(self, reason: str, message: str) -> dict:
        """The stream's last event when it fails (vLLM broke off, recording failed): the
        Responses ``error`` event ``{"type": "error", "code": reason, "message", "param":
        None}`` (the Agents SDK raises ``ModelBehaviorError`` on it, LangChain ``ValueError``;
        no ``response.completed`` follows)."""
        return self._event("error", code=reason, message=message, param=None)

    def finish(self, chat: dict) -> list[dict]:
        final = response_object(self.body, self.chat_body, chat)
        if self.rid is None:  # no chunk came before the end: open the stream now
            events = self.chunk({"id": chat.get("id", ""), "created": chat.get("created"), "model": chat.get("model")})
        else:
            events = []
        message_status = "completed" if final["status"] == "completed" else "incomplete"
        if not self.items and self.open is None:
            events += self._start(message_item(self._item_id(), "", "in_progress", None) | {"content": []})
        events += self._close(message_status, with_logprobs=self.calls == 0)
        final["output"] = self.items
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return events + [self._event(kind, response=final)]
