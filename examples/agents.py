"""The example agents by name: ``make demo AGENT=NAME``, ``spanrl eval --task-set NAME:SPLIT``.

Each is a module ``examples/<agent>/spec.py`` with: ``NAME``, ``RUNNER`` (the runner
callable, ``module:attribute``), ``TRAIN_AGENTS`` (``SPANRL_TRAIN_AGENTS`` of its demo: the
agents whose calls train; empty: all), ``AGENT_NAMES``, ``load_tasks(split, seed, size)``
(split ``train`` | ``heldout``), ``TRAIN_SEED``, ``HELDOUT_SEED``, ``SUCCESS_COMPONENT``,
``FORMAT_COMPONENT`` and ``DEMO`` (iterations, tasks, group_size, heldout_tasks); optionally
``DEMO_BY_MODEL`` (the demo with another base policy: :func:`demo_plan`) and ``task_kind(task)``
(the group a task is reported in: :func:`task_kind`).
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from spanrl.core.settings import TrainerConfig

AGENTS = {
    "math": "examples.math_agent.spec",   # AutoGen calculator agent (the paper's math QA)
    "sql": "examples.sql_agent.spec",     # LangGraph text-to-SQL team (write / check / rewrite)
    "rag": "examples.rag_agent.spec",     # OpenAI Agents SDK retrieval agent (multi-hop QA)
}


#: the demo of the SQL and RAG agents with qwen2.5-coder-0.5b (their specs' ``DEMO_BY_MODEL``;
#: docs/measured/learning-archive.md): LoRA rank 16 at lr 5e-5, 5 iterations x 4 tasks x 4 rollouts, 200 held-out
#: tasks greedy only, no log-prob shift scoring (a ~6 s prefill of the 0.5B model per completion on
#: 2 CPU cores), 600 s per rollout (16 SQL rollouts in flight took one past 180 s) and 40 min per
#: training stage (a RAG update of 48 samples outlasted the default 900 s)
QWEN05B_LORA_DEMO = {
    "size": {"iterations": 5, "tasks": 4, "group_size": 4, "heldout_tasks": 200},
    "options": {"heldout_modes": ("greedy",), "logprob_shift": False, "rollout_timeout_s": 600.0,
                "stage_timeout_s": 2400.0},
    "trainer_env": TrainerConfig.env(lora_rank=16, lr="5e-5"),
}


def agent_spec(name: str) -> ModuleType:
    """The spec module of example agent ``name``; ValueError for an unknown name."""
    if name not in AGENTS:
        raise ValueError(f"unknown agent {name!r}; known: {', '.join(AGENTS)}")
    return importlib.import_module(AGENTS[name])


def demo_plan(spec: ModuleType, model: str) -> dict[str, dict[str, Any]]:
    """What ``make demo AGENT=<spec.NAME> MODEL=<model>`` runs, before the command line's options.

    Returns ``{"size": {iterations, tasks, group_size, heldout_tasks}, "options": {MainJobConfig
    field: value}, "trainer_env": {SPANRL_TRAINER_*: str}}``: the spec's ``DEMO`` with
    ``DEMO_BY_MODEL[model]``'s entries over it, when the spec has one for ``model``; otherwise
    ``DEMO`` and nothing else. Options it does not name stay the main job's defaults, trainer
    settings the demo's (``DEMO_TRAINER_ENV``); the environment and the command line win over both.
    """
    over = getattr(spec, "DEMO_BY_MODEL", {}).get(model, {})
    return {"size": {**spec.DEMO, **over.get("size", {})}, "options": dict(over.get("options", {})),
            "trainer_env": dict(over.get("trainer_env", {}))}


def task_kind(spec: ModuleType, task: dict[str, Any]) -> str:
    """The group ``task`` is reported in by the main job's per-kind breakdown (the summary's
    ``heldout_per_kind`` and ``heldout_per_kind_paired``): ``spec.task_kind(task)`` when the spec
    defines it (the SQL agent's easy | hard level, the RAG agent's question template), else the
    task's ``metadata.kind`` (the math agent's operator kinds), else ``"all"``."""
    fn = getattr(spec, "task_kind", None)
    return str(fn(task)) if fn is not None else str(task.get("metadata", {}).get("kind", "all"))


def load_split(task_set: str, seed: int, size: int) -> list[dict[str, Any]]:
    """Tasks of ``AGENT:SPLIT`` (``sql:heldout``, ``rag:train``) or of a math task set
    (``arith_word``, ``gsm_symbolic``). ValueError for an unknown agent, split or set."""
    if ":" in task_set:
        name, split = task_set.split(":", 1)
        return agent_spec(name).load_tasks(split, seed, size)
    from examples.math_agent.tasks import load_task_set

    return load_task_set(task_set, seed, size)


def disjoint(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """True when the two task lists share no task id and no question text."""
    return not ({t["task_id"] for t in a} & {t["task_id"] for t in b}) and \
        not ({t.get("question") for t in a} & {t.get("question") for t in b} - {None})
