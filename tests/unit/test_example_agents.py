"""Every example agent's spec has the interface the main job and `spanrl eval` use
(examples/agents.py), and its train / held-out tasks are disjoint."""
from __future__ import annotations

import pytest

from examples.agents import AGENTS, agent_spec, disjoint, load_split, task_kind
from spanrl.infra.evaluation import load_agent
from spanrl.stream_jobs.assembly import parse_train_agents


@pytest.mark.parametrize("name", sorted(AGENTS))
def test_spec_interface_and_split(name):
    spec = agent_spec(name)
    assert spec.NAME == name and callable(load_agent(spec.RUNNER))
    assert spec.SUCCESS_COMPONENT == "correct" and spec.FORMAT_COMPONENT == "format"
    assert set(spec.DEMO) == {"iterations", "tasks", "group_size", "heldout_tasks"}
    selection = parse_train_agents(spec.TRAIN_AGENTS)
    assert selection is None or all(selection.selects(a) or a == "check_query" for a in spec.AGENT_NAMES)
    train = spec.load_tasks("train", spec.TRAIN_SEED, 20)
    held = spec.load_tasks("heldout", spec.HELDOUT_SEED, 20)
    assert len(train) == len(held) == 20 and disjoint(train, held)
    assert len({t["task_id"] for t in train}) == 20
    assert all(isinstance(task_kind(spec, t), str) and task_kind(spec, t) for t in train + held)


def test_task_kinds_of_each_agent():
    """The groups the main job's per-kind breakdown reports: the RAG question's template (its
    task id is ``rag-<template>-...``), the SQL task's level, the math task's operator kind."""
    rag = agent_spec("rag").load_tasks("heldout", agent_spec("rag").HELDOUT_SEED, 30)
    assert all(t["task_id"].startswith(f"rag-{task_kind(agent_spec('rag'), t)}-") for t in rag)
    assert len({task_kind(agent_spec("rag"), t) for t in rag}) > 1
    sql = agent_spec("sql").load_tasks("heldout", agent_spec("sql").HELDOUT_SEED, 30)
    assert {task_kind(agent_spec("sql"), t) for t in sql} == {"easy", "hard"}
    math = load_split("arith_word", 1000, 20)
    assert {task_kind(agent_spec("math"), t) for t in math} == {t["metadata"]["kind"] for t in math}
    assert task_kind(agent_spec("math"), {"task_id": "x"}) == "all"


def test_load_split_and_unknown_names():
    assert load_split("sql:heldout", 1000, 3) == agent_spec("sql").load_tasks("heldout", 1000, 3)
    assert [t["task_id"] for t in load_split("arith_word", 1000, 2)] == ["arith_word-1000-0", "arith_word-1000-1"]
    with pytest.raises(ValueError):
        agent_spec("nope")
    with pytest.raises(ValueError):
        load_split("nope:train", 0, 1)
