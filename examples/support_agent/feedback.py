"""Pure parts of the support agent: its prompt and how a user's rating becomes a reward."""
from __future__ import annotations

SYSTEM = "You are a helpful support assistant. Answer in one short sentence."
RATINGS = {"up": 1.0, "down": 0.0}  # a thumbs-up is R = 1, a thumbs-down R = 0


def reward_of(rating: str) -> float:
    """The episode return R of a user's rating (``up`` | ``down``, any case, surrounding
    blanks ignored). Raises ValueError for any other rating."""
    key = rating.strip().lower()
    if key not in RATINGS:
        raise ValueError(f"rating must be one of {', '.join(RATINGS)}, got {rating!r}")
    return RATINGS[key]


def messages_for(history: list[dict], question: str) -> list[dict]:
    """Chat messages of the next turn: the system prompt, the session's earlier turns
    (``{"role", "content"}`` dicts, oldest first) and the new question. ``history`` is not changed."""
    return [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": question}]
