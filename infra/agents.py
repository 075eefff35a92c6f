"""Loading an agent spec by reference: the one loader every command that takes an agent uses.

A reference is ``module:attribute`` naming an :class:`~spanrl.core.agent_spec.AgentSpec` on
``PYTHONPATH`` (``my_pkg.my_agent:spec``), or the short name of an example agent
(:data:`EXAMPLE_AGENTS`: ``math``, ``sql``, ``rag``). ``make demo AGENT=``, ``spanrl demo
--agent``, ``spanrl study --agent``, ``spanrl eval --task-set REF:SPLIT`` (and ``--agent REF``),
the main job and the release gate's task set (``SPANRL_RELOADER_GATE_TASK_SET=REF:SPLIT``) all
resolve it here; a spec that does not load or does not validate raises
:class:`~spanrl.core.agent_spec.AgentSpecError` naming the reference or the field, before
anything starts.
"""
from __future__ import annotations

import importlib
from typing import Any

from spanrl.core.agent_spec import SPLITS, AgentSpec, AgentSpecError

#: the example agents by short name (``make demo AGENT=sql``): their specs' references
EXAMPLE_AGENTS = {
    "math": "examples.math_agent.spec:SPEC",   # AutoGen calculator agent (the paper's math QA)
    "sql": "examples.sql_agent.spec:SPEC",     # LangGraph text-to-SQL team (write / check / rewrite)
    "rag": "examples.rag_agent.spec:SPEC",     # OpenAI Agents SDK retrieval agent (multi-hop QA)
}


def spec_reference(ref: str) -> str:
    """``ref`` as ``module:attribute``: an example's short name is replaced by its reference.
    AgentSpecError for anything else without exactly one ``:``."""
    ref = ref.strip()
    if ref in EXAMPLE_AGENTS:
        return EXAMPLE_AGENTS[ref]
    module, sep, attr = ref.partition(":")
    if not (module and sep and attr) or ":" in attr:
        raise AgentSpecError(f"agent {ref!r}: expected module:attribute (an AgentSpec on PYTHONPATH) or one of "
                             f"{', '.join(EXAMPLE_AGENTS)}")
    return ref


def load_agent_spec(ref: str) -> AgentSpec:
    """The :class:`AgentSpec` ``ref`` names (``my_pkg.my_agent:spec``, or ``math`` | ``sql`` |
    ``rag``). Raises AgentSpecError when the module does not import (a spec built with a
    missing or ill-typed field fails there; the message carries the field's name), the
    attribute does not exist, or it is not an AgentSpec.

    Example: ``load_agent_spec("sql").runner_ref == "examples.sql_agent.agent:sql_agent"``."""
    module, _, attr = spec_reference(ref).partition(":")
    try:
        loaded = importlib.import_module(module)
    except AgentSpecError as exc:  # the spec was built with an ill-typed field
        raise AgentSpecError(f"agent spec {ref!r}: {exc}") from exc
    except Exception as exc:  # the user's module: whatever its import raises (TypeError: a missing field)
        raise AgentSpecError(f"agent spec {ref!r}: importing {module!r} failed: {type(exc).__name__}: {exc}") from exc
    if not hasattr(loaded, attr):
        raise AgentSpecError(f"agent spec {ref!r}: module {module!r} has no attribute {attr!r}")
    obj = getattr(loaded, attr)
    if not isinstance(obj, AgentSpec):
        raise AgentSpecError(f"agent spec {ref!r} is a {type(obj).__name__}, not spanrl.AgentSpec")
    return obj


def split_task_set(task_set: str) -> tuple[str, str] | None:
    """``(agent reference, split)`` of a task set ``REF:SPLIT`` (``sql:heldout``,
    ``my_pkg.my_agent:spec:train``); None for a named task set without ``:`` (``arith_word``)."""
    ref, sep, split = task_set.rpartition(":")
    return (ref, split) if sep else None


def load_split(task_set: str, seed: int, size: int) -> list[dict[str, Any]]:
    """Tasks of ``REF:SPLIT`` (``sql:heldout``, ``my_pkg.my_agent:spec:train``) or of a math
    task set (``arith_word``, ``gsm_symbolic``). ValueError (AgentSpecError) for an unknown
    agent, split or set."""
    parts = split_task_set(task_set)
    if parts is None:
        from examples.math_agent.tasks import load_task_set

        return load_task_set(task_set, seed, size)
    ref, split = parts
    if split not in SPLITS:
        raise AgentSpecError(f"task set {task_set!r}: split must be one of {', '.join(SPLITS)}, got {split!r}")
    return load_agent_spec(ref).load_tasks(split, seed, size)


def disjoint(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """True when the two task lists share no task id and no question text."""
    return not ({t["task_id"] for t in a} & {t["task_id"] for t in b}) and \
        not ({t.get("question") for t in a} & {t.get("question") for t in b} - {None})
