"""Every example agent's spec is an AgentSpec the main job and `spanrl eval` load by short name
(spanrl/infra/agents.py), and its train / held-out tasks are disjoint."""
from __future__ import annotations

import pytest

from spanrl.core.agent_spec import AgentSpec
from spanrl.infra.agents import EXAMPLE_AGENTS, disjoint, load_split
from spanrl.infra.agents import load_agent_spec as agent_spec
from spanrl.infra.evaluation import load_agent
from spanrl.stream_jobs.assembly import parse_train_agents


@pytest.mark.parametrize("name", sorted(EXAMPLE_AGENTS))
def test_spec_interface_and_split(name):
    spec = agent_spec(name)
    assert isinstance(spec, AgentSpec) and spec is agent_spec(EXAMPLE_AGENTS[name])
    assert spec.name == name and callable(load_agent(spec.runner_ref))
    assert load_agent(EXAMPLE_AGENTS[name]) is load_agent(spec.runner_ref)  # a spec's reference runs its runner
    assert spec.success_component == "correct" and spec.format_component == "format"
    assert set(spec.demo) == {"iterations", "tasks", "group_size", "heldout_tasks"}
    selection = parse_train_agents(spec.train_agents)
    assert selection is None or all(selection.selects(a) or a == "check_query" for a in spec.agent_names)
    train = spec.tasks("train", 20)
    held = spec.tasks("heldout", 20)
    assert train == spec.load_tasks("train", spec.train_seed, 20)
    assert len(train) == len(held) == 20 and disjoint(train, held)
    assert len({t["task_id"] for t in train}) == 20
    assert all(isinstance(spec.kind_of(t), str) and spec.kind_of(t) for t in train + held)


def test_task_kinds_of_each_agent():
    """The groups the main job's per-kind breakdown reports: the RAG question's template (its
    task id is ``rag-<template>-...``), the SQL task's level, the math task's operator kind."""
    rag = agent_spec("rag").tasks("heldout", 30)
    assert all(t["task_id"].startswith(f"rag-{agent_spec('rag').kind_of(t)}-") for t in rag)
    assert len({agent_spec("rag").kind_of(t) for t in rag}) > 1
    sql = agent_spec("sql").tasks("heldout", 30)
    assert {agent_spec("sql").kind_of(t) for t in sql} == {"easy", "hard"}
    math = load_split("arith_word", 1000, 20)
    assert {agent_spec("math").kind_of(t) for t in math} == {t["metadata"]["kind"] for t in math}
    assert agent_spec("math").kind_of({"task_id": "x"}) == "all"


def test_load_split_and_unknown_names():
    assert load_split("sql:heldout", 1000, 3) == agent_spec("sql").load_tasks("heldout", 1000, 3)
    assert [t["task_id"] for t in load_split("arith_word", 1000, 2)] == ["arith_word-1000-0", "arith_word-1000-1"]
    with pytest.raises(ValueError):
        agent_spec("nope")
    with pytest.raises(ValueError):
        load_split("nope:train", 0, 1)
