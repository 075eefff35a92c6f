"""Sampling seeds of a run: every LLM call's vLLM ``seed`` derived from the run seed.

A run is repeatable when each call samples from a seed fixed by what the call is, not by
when it ran: the run seed, the task, the rollout's index in its group, the attempt and the
call's index in the attempt. The runner derives a rollout seed for each attempt
(:func:`rollout_seed`), the OTel request hook (``producers/instrument.py``) sends the
call's seed (:func:`call_seed`) in the :data:`SEED_HEADER` header, and the proxy gives it
to vLLM as the request's ``seed`` unless the client set one (vLLM samples a seeded request
with its own generator, so concurrent requests do not disturb each other's draws).
"""
from __future__ import annotations

import hashlib

#: request header that carries a call's sampling seed from the agent's process to the proxy
SEED_HEADER = "x-spanrl-sampling-seed"
#: seeds are drawn in [0, SEED_LIMIT): non-negative and within a signed 32-bit integer
SEED_LIMIT = 2**31 - 1


def derive_seed(*parts: object) -> int:
    """A seed in ``[0, SEED_LIMIT)`` from ``parts`` (their ``str`` joined by ``|``, SHA-256):
    the same parts always give the same seed, on any machine and Python version (no
    ``hash()`` randomisation). Example: ``derive_seed(0, "t", 1, "0") == derive_seed(0, "t", 1, "0")``
    and differs from ``derive_seed(1, "t", 1, "0")``."""
    digest = hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") % SEED_LIMIT


def rollout_seed(run_seed: int, task_id: str, index: int, attempt_id: str) -> int:
    """The seed of one attempt: run seed, task, the rollout's index in the task's group
    (0 .. group_size-1; for evaluation, the sample index) and the attempt id."""
    return derive_seed("rollout", run_seed, task_id, index, attempt_id)


def call_seed(rollout_seed_: int, call_index: int) -> int:
    """The seed of the attempt's ``call_index``-th LLM request (0-based, in the order the
    agent sends them; concurrent calls inside one attempt take indices in send order)."""
    return derive_seed("call", rollout_seed_, call_index)


def parse_seed(text: str) -> int:
    """The integer seed of a :data:`SEED_HEADER` value; ValueError unless it is a decimal
    integer in ``[0, SEED_LIMIT)``."""
    if not text.strip().isdigit():
        raise ValueError(f"{SEED_HEADER} must be a decimal integer, got {text[:40]!r}")
    value = int(text.strip())
    if value >= SEED_LIMIT:
        raise ValueError(f"{SEED_HEADER} must be < {SEED_LIMIT}, got {value}")
    return value
