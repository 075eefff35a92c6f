"""Clients of the services' admin routes that more than one driver uses.

``admin_headers``: the administrator's bearer header (spanrl/core/edge.py; the token from
``SPANRL_ADMIN_TOKEN`` or the stack's ``state_dir/secrets``; none in open mode: {}).

``request_training``: a trainer with barrier batching (``SPANRL_TRAINER_BATCHING=barrier``)
updates only when asked; the main job asks once per iteration, ``make chaos``'s accounting
and the test stack's chaos case ask for what their workload produced."""
from __future__ import annotations

import httpx

from spanrl.core.edge import bearer_headers
from spanrl.core.settings import Settings
from spanrl.schemas import topics as T


def admin_headers(s: Settings) -> dict[str, str]:
    """``{"Authorization": "Bearer <administrator token>"}`` ({} when there is none)."""
    return bearer_headers(s.admin_token)


def request_training(s: Settings, samples_next: dict[int, int]) -> dict:
    """Ask a barrier-batching trainer to train every sample below ``samples_next``
    (samples partition -> the offset after the last sample to train) as one update
    (``POST /admin/train``, trainer/train.py ``Trainer.request_train``).
    Example: ``{0: 120}`` -> body ``{"until": {"samples:0": 120}}``."""
    r = httpx.post(f"http://{s.host}:{s.trainer_port}/admin/train", timeout=30, headers=admin_headers(s),
                   json={"until": {f"{T.SAMPLES.name}:{p}": off for p, off in sorted(samples_next.items())}})
    r.raise_for_status()
    return r.json()
