"""Every example agent's spec has the interface the main job and `spanrl eval` use
(examples/agents.py), and its train / held-out tasks are disjoint."""
from __future__ import annotations

import pytest

from examples.agents import AGENTS, agent_spec, disjoint, load_split
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


def test_load_split_and_unknown_names():
    assert load_split("sql:heldout", 1000, 3) == agent_spec("sql").load_tasks("heldout", 1000, 3)
    assert [t["task_id"] for t in load_split("arith_word", 1000, 2)] == ["arith_word-1000-0", "arith_word-1000-1"]
    with pytest.raises(ValueError):
        agent_spec("nope")
    with pytest.raises(ValueError):
        load_split("nope:train", 0, 1)
