"""Bounds on the identifiers clients send: rollout, attempt and task ids (issue 23 item 5).

One rule for every entry point (the proxy's per-rollout path segments and ``x-spanrl-*``
headers, the bridge's span attributes, ``POST /v1/rewards`` and ``/v1/rollouts/{id}/end``),
so that an id one of them accepts is accepted by all:

- **rollout and attempt ids**: 1 to :data:`MAX_ID_CHARS` characters of
  ``A-Z a-z 0-9 . _ : -`` (:data:`ID_CHARS`), the first a letter or digit;
- **task ids** (GRPO group labels, e.g. ``x-spanrl-task: faq/refunds``): the same, ``/`` allowed too.

Why these: an id is a Kafka key (the broker takes any bytes, but every record of a
rollout carries it, and a 10,000-character id did pass before), a path segment of the
proxy's and the bridge's routes (``/`` would split it; a leading ``-`` or ``.`` reads as
an option or ``..``), part of the stream worker's table keys, which join ids with ``|``
(stream_jobs/assembly.py ``call_key``, grouping.py), and a MinIO object name
(claims.py quotes it). What the project generates passes: uuid4 hex (the runner),
``prod-`` + 32 hex (the proxy), task ids ``arith_word-0-12``, ``gsm_symbolic-0-0``,
``sql-chinook-tracks_of_artist-121``, ``rag-city_capital-city:2643743`` (the examples),
attempt ids ``0``, ``1``, ... (tests/unit/test_producers_ids.py reads the examples' task lists).

Pure: no FastAPI, no Kafka; :func:`check` raises :class:`~spanrl.core.edge.BadRequest`.
"""
from __future__ import annotations

import string

from spanrl.core.edge import BadRequest

#: the longest id accepted (characters; every allowed character is one UTF-8 byte)
MAX_ID_CHARS = 128
ROLLOUT, ATTEMPT, TASK = "rollout", "attempt", "task"
KINDS = (ROLLOUT, ATTEMPT, TASK)
#: reason code of a bad id in a path or a body field (headers keep ``invalid_rollout_header``)
INVALID_ID = "invalid_id"

#: what ids may hold besides letters and digits (each kind); written once: the checks and
#: the error message's words (:data:`ID_CHARS`) are both made from it
_PUNCTUATION = {ROLLOUT: "._:-", ATTEMPT: "._:-", TASK: "._:-/"}
_FIRST = frozenset(string.ascii_letters + string.digits)
_CHARS = {kind: _FIRST | frozenset(p) for kind, p in _PUNCTUATION.items()}
_ALLOWED = {kind: " ".join(["A-Z a-z 0-9", *p]) for kind, p in _PUNCTUATION.items()}
#: the characters of rollout and attempt ids, as the error message says them: ``A-Z a-z 0-9 . _ : -``
ID_CHARS = _ALLOWED[ROLLOUT]


def rule(kind: str) -> str:
    """The limit in words, for error messages: ``rollout ids are 1-128 characters of
    A-Z a-z 0-9 . _ : -, the first a letter or digit``. ``kind``: one of :data:`KINDS`
    (KeyError otherwise)."""
    return f"{kind} ids are 1-{MAX_ID_CHARS} characters of {_ALLOWED[kind]}, the first a letter or digit"


def problem(kind: str, value: object) -> str | None:
    """What is wrong with ``value`` as a ``kind`` id (one of :data:`KINDS`), or None when it
    is a valid one. The message names the limit and says how the value breaks it without
    echoing it (it may be 10,000 characters or hold control bytes): ``"is 300 characters;
    rollout ids are 1-128 characters of ..."``. Raises KeyError for an unknown ``kind``."""
    limit = rule(kind)
    if not isinstance(value, str):
        return f"is not a string ({type(value).__name__}); {limit}"
    if not value:
        return f"is empty; {limit}"
    if len(value) > MAX_ID_CHARS:
        return f"is {len(value)} characters; {limit}"
    if value[0] not in _FIRST:
        return f"starts with {value[0]!r}; {limit}"
    chars = _CHARS[kind]
    if not chars.issuperset(value):
        i, c = next((i, c) for i, c in enumerate(value) if c not in chars)
        return f"has the character {c!r} at position {i}; {limit}"
    return None


def is_valid(kind: str, value: object) -> bool:
    """``problem(kind, value) is None``."""
    return problem(kind, value) is None


def check(kind: str, value: object, where: str, reason: str = INVALID_ID, status: int = 400) -> str:
    """``value`` when it is a valid ``kind`` id, else :class:`BadRequest` ``status`` ``reason``
    with ``where`` (the path parameter, header or field) as ``param`` and in the detail:
    ``"rollout_id is 300 characters; rollout ids are 1-128 characters of ..."``."""
    why = problem(kind, value)
    if why is not None:
        raise BadRequest(status, reason, f"{where} {why}", param=where)
    return value  # type: ignore[return-value]  (a str: problem() said so)
