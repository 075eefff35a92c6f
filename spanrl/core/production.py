"""Production rollouts: calls of an agent that no spanrl runner launched.

Such an agent uses the proxy's plain base URL ``{proxy}/v1`` (no rollout in the path) and
may set, per request:

- ``x-spanrl-rollout-id``: the rollout (conversation, session) the call belongs to. Absent:
  the proxy mints one (``prod-`` + 32 hex digits), i.e. every call is its own rollout. The
  proxy always answers with the rollout id in the same response header, so the app can keep
  it for the next calls of the conversation and for the reward it sends later
  (``instrument.emit_reward(value, rollout_id=...)`` or the bridge's ``POST /v1/rewards``).
- ``x-spanrl-task``: the task label; rollouts with the same label form one group (GRPO inside
  it). Absent: the rollout id, a group of one, whose advantage the trainer takes from the
  batch baseline (``trainer/losses.py`` ``singleton_batch_advantages``).
- ``x-spanrl-group-size``: how many rollouts of the task make a full group (an integer >= 1,
  default 1); a group also closes at ``SPANRL_GROUP_TIMEOUT_S``.

The attempt id is always :data:`PRODUCTION_ATTEMPT` (``"0"``, also the bridge's default for a
reward). The proxy records these on each call span (:func:`span_attributes`); the assembler
begins the rollout at its first call and ends it at its final reward, at an explicit end
(the bridge's ``POST /v1/rollouts/{rollout_id}/end``) or after ``SPANRL_PRODUCTION_IDLE_S`` with
no input (stream_jobs/assembly.py ``production_begin`` / ``production_end``).

Pure: no FastAPI, no Kafka.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Callable, Mapping

from spanrl.core import ids
from spanrl.core.edge import BadRequest

ROLLOUT_HEADER = "x-spanrl-rollout-id"
TASK_HEADER = "x-spanrl-task"
GROUP_SIZE_HEADER = "x-spanrl-group-size"
PRODUCTION_ATTEMPT = "0"
#: reason code of a bad ``x-spanrl-*`` header (its value's limits: spanrl/core/ids.py)
INVALID_HEADER = "invalid_rollout_header"

# span attributes the proxy writes and the assembler reads
ORIGIN = "spanrl.origin"
PRODUCTION = "production"
TASK_ID = "spanrl.task_id"
GROUP_SIZE = "spanrl.group_size"


@dataclass(frozen=True)
class ProductionRollout:
    rollout_id: str
    task_id: str
    group_size: int
    minted: bool  # the proxy chose the rollout id (the app did not send one)


def mint_rollout_id() -> str:
    return "prod-" + secrets.token_hex(16)


def production_rollout(headers: Mapping[str, str], mint: Callable[[], str] = mint_rollout_id) -> ProductionRollout:
    """The rollout of one call on the plain ``/v1`` routes, from its request headers (names
    lower-case, as Starlette gives them): see the module doc. Raises :class:`BadRequest` 400
    :data:`INVALID_HEADER` naming the header for a rollout id or task label outside the
    limits of spanrl/core/ids.py (empty, over ``ids.MAX_ID_CHARS``, other characters), or a
    group size that is not an integer >= 1."""
    sent = headers.get(ROLLOUT_HEADER)
    rollout_id = ids.check(ids.ROLLOUT, sent.strip(), ROLLOUT_HEADER, INVALID_HEADER) if sent is not None else mint()
    task = headers.get(TASK_HEADER)
    task_id = ids.check(ids.TASK, task.strip(), TASK_HEADER, INVALID_HEADER) if task is not None else rollout_id
    size = headers.get(GROUP_SIZE_HEADER, "1").strip()
    if not size.isdigit() or int(size) < 1:
        raise BadRequest(400, INVALID_HEADER,
                         f"{GROUP_SIZE_HEADER} must be an integer >= 1, got {size!r}", param=GROUP_SIZE_HEADER)
    return ProductionRollout(rollout_id, task_id, int(size), sent is None)


def span_attributes(rollout: ProductionRollout) -> dict[str, str]:
    """What a production call's span carries so that the assembler can begin its rollout."""
    return {ORIGIN: PRODUCTION, TASK_ID: rollout.task_id, GROUP_SIZE: str(rollout.group_size)}


def rollout_from_span(attributes: Mapping[str, str] | None) -> tuple[str, int] | None:
    """(task_id, group_size) of a production call's span attributes; None for any other span
    (a runner's call) or attributes a proxy did not write (no task, a group size that is not
    an integer >= 1)."""
    attributes = attributes or {}
    if attributes.get(ORIGIN) != PRODUCTION or not attributes.get(TASK_ID):
        return None
    size = str(attributes.get(GROUP_SIZE, "1"))
    if not size.isdigit() or int(size) < 1:
        return None
    return attributes[TASK_ID], int(size)
