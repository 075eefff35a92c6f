"""Response ids that name their rollout attempt: the join key that needs no traceparent
(issue 23 item 4).

An agent that keeps its own OpenTelemetry set-up (an OpenInference or OTel GenAI
instrumentor and a plain ``TracerProvider``, no spanrl code) sends framework spans without
``spanrl.rollout_id``, and its HTTP client may send no W3C ``traceparent`` (openai 3.x does
not), so the trace join of stream_jobs/joining.py never links them. What such a span does
carry, exactly, is the id of the answer the client got: OTel GenAI's ``gen_ai.response.id``
and OpenInference's ``output.value`` (the answer's JSON, ``"id"`` in it). The proxy
therefore answers with an id that says which attempt the call belonged to::

    chatcmpl-<vLLM's id part>~spanrl~<rollout_id>~<attempt_id>

``~`` is in no rollout or attempt id (spanrl/core/ids.py) and in no id vLLM makes, so the id
splits back without ambiguity; the Responses and Messages translations (``resp_…``,
``msg_…``) keep the tail. Exact, not fuzzy: the join reads the attempt out of the id, it
never matches texts or times. A client cannot name another rollout's attempt in a way it
could not already (``spanrl.rollout_id`` is an attribute any span may carry), and a joined
span is context, never training data (joining.py).

Pure: no FastAPI, no Kafka.
"""
from __future__ import annotations

import json

from spanrl.core import ids

#: separator of the id's parts (in no rollout, attempt or vLLM id)
SEP = "~"
#: the marker part between vLLM's id and the attempt
MARK = "spanrl"
#: span attributes that hold the client's response id: OTel GenAI semantic conventions;
#: OpenInference keeps the whole answer in ``output.value`` (:func:`from_attributes`)
ID_ATTRIBUTES = ("gen_ai.response.id", "llm.response.id")
OPENINFERENCE_OUTPUT = "output.value"


def mint(upstream_id: str, rollout_id: str, attempt_id: str) -> str:
    """The id the proxy answers with for vLLM's ``upstream_id`` (e.g. ``chatcmpl-3f2a``) of a
    call of attempt ``(rollout_id, attempt_id)``: ``chatcmpl-3f2a~spanrl~R~A``. An id that
    already names an attempt is returned as it is. Raises BadRequest (400) for ids that
    break spanrl/core/ids.py's rule (the proxy checked them before)."""
    ids.check(ids.ROLLOUT, rollout_id, "rollout_id")
    ids.check(ids.ATTEMPT, attempt_id, "attempt_id")
    if attempt_of(upstream_id) is not None:
        return upstream_id
    return SEP.join((str(upstream_id), MARK, rollout_id, attempt_id))


def attempt_of(response_id: object) -> tuple[str, str] | None:
    """``(rollout_id, attempt_id)`` a minted response id names (any prefix: ``chatcmpl-``,
    ``resp_``, ``msg_``), else None: not a string, not minted by :func:`mint`, or its ids
    break spanrl/core/ids.py's rule."""
    if not isinstance(response_id, str) or SEP not in response_id:
        return None
    parts = response_id.split(SEP)
    if len(parts) != 4 or parts[1] != MARK:
        return None
    rollout_id, attempt_id = parts[2], parts[3]
    if ids.problem(ids.ROLLOUT, rollout_id) or ids.problem(ids.ATTEMPT, attempt_id):
        return None
    return rollout_id, attempt_id


def from_attributes(attributes: dict | None) -> str | None:
    """The minted response id (:func:`mint`) a framework span's attributes hold: the first of
    :data:`ID_ATTRIBUTES` that holds one, else OpenInference's ``output.value`` when it is a
    JSON object whose ``"id"`` is one; None when none does (also for a value that is not
    JSON: OpenInference records plain text outputs there too). :func:`attempt_of` of the
    result names the attempt."""
    attributes = attributes or {}
    for key in ID_ATTRIBUTES:
        if attempt_of(attributes.get(key)) is not None:
            return attributes[key]
    output = attributes.get(OPENINFERENCE_OUTPUT)
    if isinstance(output, str) and output.lstrip().startswith("{") and SEP in output:
        try:
            body = json.loads(output)
        except ValueError:
            return None
        if isinstance(body, dict) and attempt_of(body.get("id")) is not None:
            return body["id"]
    return None


#: attribute of a framework span the trace join joined by its response id: that id
JOINED_RESPONSE_ID = "spanrl.joined_response_id"
#: prefix of the parent a proxy call without a traceparent gets in the assembler's links:
#: ``response:<minted id>`` (stream_jobs/assembly.py), which the framework's LLM span of the
#: same call, joined by its response id, fills in (stream_jobs/joining.py)
LINK_PREFIX = "response:"


def call_link(attributes: dict | None) -> str | None:
    """``response:<id>`` for span attributes whose ``gen_ai.response.id`` is a minted id (the
    proxy's own record of a call), else None."""
    rid = (attributes or {}).get("gen_ai.response.id")
    return LINK_PREFIX + rid if attempt_of(rid) is not None else None
