"""``module:attribute`` references: code a lower layer runs without importing it.

A service names what a higher layer provides (the control plane in ``infra``, an agent in
``examples``) by a reference in a setting, and resolves it only when it needs it: the
release gate's agent (``SPANRL_RELOADER_GATE_AGENT``) and its evaluation
(``SPANRL_RELOADER_GATE_EVALUATION``, trainer/gate.py), an evaluation's agent
(infra/evaluation.py). The import graph stays layered (import-linter checks it,
pyproject.toml) while the deployment decides what runs.
"""
from __future__ import annotations

import importlib
from typing import Any


def resolve(ref: str) -> Any:
    """The object ``ref`` names, ``"package.module:attribute"`` (the module imported now).

    Raises ImportError when the module does not import, AttributeError when it has no such
    attribute (also for a ``ref`` without ``:``), ValueError for an empty module name."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)
