"""What a proxy call keeps of its content besides token ids (span schema v2, the LlmCall's
``input_messages`` / ``output_messages`` / ``request`` / ``tokenizer`` / ``tokenizer_sha256``):
the messages the proxy sent to vLLM and this choice's answer in OpenAI chat JSON (the
OpenTelemetry GenAI conventions' ``gen_ai.input.messages`` / ``gen_ai.output.messages`` of
the call), the request's other fields, and the tokenizer's identity
(spanrl/core/tokenizer_id.py). ``SPANRL_CAPTURE_MESSAGES=false`` keeps no text: only ids and
the identity (docs/replay.md says what is then impossible). An oversize record is
claim-checked to MinIO like any other (spanrl/core/claims.py).
"""
from __future__ import annotations

import json

#: request fields recorded as messages, not as ``request``
_MESSAGE_FIELDS = ("messages",)


def recorded_content(endpoint_is_chat: bool, body: dict, response: dict, choice: int, capture: bool,
                     tokenizer: tuple[str, str | None] | None) -> dict:
    """The LlmCall v2 fields of choice ``choice`` of a vLLM answer to ``body``. Pure."""
    name, sha = tokenizer or (None, None)
    out = {"input_messages": None, "output_messages": None, "request": None, "tokenizer": name,
           "tokenizer_sha256": sha}
    if not capture:
        return out
    choices = response.get("choices") or []
    mine = choices[choice] if choice < len(choices) and isinstance(choices[choice], dict) else {}
    if endpoint_is_chat:
        if isinstance(body.get("messages"), list):
            out["input_messages"] = json.dumps(body["messages"])
        message = mine.get("message")
        if isinstance(message, dict):
            out["output_messages"] = json.dumps([message])
    elif isinstance(mine.get("text"), str):
        out["output_messages"] = json.dumps([{"role": "assistant", "content": mine["text"]}])
    out["request"] = json.dumps({k: v for k, v in body.items() if k not in _MESSAGE_FIELDS}, default=str)
    return out
