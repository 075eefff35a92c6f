"""Reward for the RAG agent (arXiv 2508.03680 s4.2): pure and deterministic.

    reward = 0.9 * f1 + 0.1 * format

* ``format`` is 1 when the reply holds a non-empty ``<answer>…</answer>``, else 0.
* the *answer* is the content of the last such tag; a reply without one is taken
  whole as the answer (F1's precision term already punishes a long reply).
* ``f1`` is SQuAD's word-level F1 (bag of tokens) between the normalised answer and
  the normalised gold, maximised over the task's gold aliases. Normalisation as SQuAD
  v1.1's ``normalize_answer`` — lower-case, punctuation removed, the articles
  a/an/the removed, whitespace collapsed — plus accent folding ("Bogotá" = "Bogota").
* ``correct`` is 1 when the normalised answer equals a normalised alias exactly or
  ``f1 >= CORRECT_F1`` (0.8), else 0. It is the success component evaluation reads;
  it is reported, not added to the reward.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

from .corpus import fold

W_F1 = 0.9
W_FORMAT = 0.1
CORRECT_F1 = 0.8

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)  # deleted, as SQuAD does


def normalise(text: str) -> str:
    """SQuAD normalisation with accent folding: ``"The Peso!"`` → ``"peso"``."""
    s = fold(text).lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def extract_answer(text: str | None) -> tuple[str, bool]:
    """``(answer, tagged)``: the last non-empty ``<answer>`` content, or the whole text."""
    text = text or ""
    tagged = [m.strip() for m in _ANSWER.findall(text) if m.strip()]
    if tagged:
        return tagged[-1], True
    return text.strip(), False


def f1_score(prediction: str, gold: str) -> float:
    """SQuAD word-level F1 of two strings (normalised here)."""
    pred, ref = normalise(prediction).split(), normalise(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def reward(completion_text: str | None, task: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """``(value, components)`` with components ``{"f1", "format", "correct"}``."""
    answer, tagged = extract_answer(completion_text)
    golds = [str(a) for a in task["answers"]]
    f1 = max((f1_score(answer, g) for g in golds), default=0.0) if answer else 0.0
    exact = bool(answer) and normalise(answer) in {normalise(g) for g in golds}
    fmt = 1.0 if tagged else 0.0
    correct = 1.0 if exact or f1 >= CORRECT_F1 else 0.0
    value = W_F1 * f1 + W_FORMAT * fmt
    return round(value, 6), {"f1": round(f1, 6), "format": fmt, "correct": correct}
