"""Reward for the calculator math agent: pure and deterministic.

    reward = 0.9 * correct + 0.1 * format

* ``format`` is 1 when the final text contains ``Answer: <number>`` (or the GSM8K
  style ``#### <number>``), else 0.
* ``correct`` is 1 when that extracted number equals the task's reference answer
  *numerically* (exact ``decimal.Decimal`` equality after removing thousands
  separators, ``$`` and a trailing ``.0``-style zero: ``"1,200"`` == ``"1200"``,
  ``"12.0"`` == ``"12"``), else 0. So the possible returns are 0.0, 0.1 and 1.0.

We deliberately do not call reasoning-gym's ``GSMSymbolicDataset.score_answer``:
it returns 0.01 (not 0) for a wrong number and takes the *first* number it finds
with ``\\b-?\\d+(?:\\.\\d+)?\\b`` (so ``"1,200"`` scores as 1). On a clean number
both agree (tested in tests/unit/test_math_agent_reward.py).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

W_CORRECT = 0.9
W_FORMAT = 0.1

# A number as a model writes it: optional sign, optional $, digits with optional
# thousands commas, optional decimals. E.g. -3, $1,200, 12.50, .5
_NUM = r"[-+−]?\s?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?"
_MARKER = re.compile(
    r"(?:\banswer\s*:|####)[ \t]*\**[ \t]*(?P<num>" + _NUM + r")",
    re.IGNORECASE,
)


def _normalise(raw: str) -> str | None:
    s = raw.replace("−", "-").replace("$", "").replace(",", "").replace(" ", "")
    if s.startswith("+"):
        s = s[1:]
    if not re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)", s):
        return None
    return s


def extract_answer(text: str | None) -> str | None:
    """The number after the *last* ``Answer:`` / ``####`` marker, normalised.

    Commas, ``$`` and spaces are removed (``"Answer: $1,200"`` → ``"1200"``);
    decimals are kept as written (``"12.0"`` stays ``"12.0"``). ``None`` when no
    marker is followed by a number.
    """
    if not text:
        return None
    found: str | None = None
    for m in _MARKER.finditer(text):
        norm = _normalise(m.group("num"))
        if norm is not None:
            found = norm
    return found


def format_ok(text: str | None) -> bool:
    """True when the text ends its work with ``Answer: <number>`` or ``#### <number>``."""
    return extract_answer(text) is not None


def numbers_equal(a: str | None, b: str | None) -> bool:
    """Exact numeric equality of two number strings (``"12.0"`` == ``"12"``)."""
    if a is None or b is None:
        return False
    na, nb = _normalise(a.strip()), _normalise(b.strip())
    if na is None or nb is None:
        return False
    try:
        return Decimal(na) == Decimal(nb)
    except InvalidOperation:
        return False


def reward(completion_text: str | None, task: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """``(value, components)`` with components ``{"correct": 0/1, "format": 0/1}``."""
    pred = extract_answer(completion_text)
    fmt = 1.0 if pred is not None else 0.0
    correct = 1.0 if numbers_equal(pred, str(task["answer"])) else 0.0
    value = W_CORRECT * correct + W_FORMAT * fmt
    return round(value, 6), {"correct": correct, "format": fmt}
