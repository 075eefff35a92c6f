"""What the example agents' specs share: the demo of the SQL, RAG and math agents with
qwen2.5-coder-0.5b (their specs' ``demo_by_model``).

Each example agent is an :class:`~spanrl.core.agent_spec.AgentSpec`, ``SPEC`` in
``examples/<agent>/spec.py``; spanrl/infra/agents.py loads a spec by reference
(``module:attribute``) and keeps the short names ``math``, ``sql``, ``rag``.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from spanrl.core.recipes import recipe_env

#: the demo of the SQL and RAG agents with qwen2.5-coder-0.5b (their specs' ``demo_by_model``;
#: docs/measured/learning-archive.md): LoRA rank 16 at lr 5e-5, 5 iterations x 4 tasks x 4 rollouts, 200 held-out
#: tasks greedy only, no log-prob shift scoring (a ~6 s prefill of the 0.5B model per completion on
#: 2 CPU cores), 600 s per rollout (16 SQL rollouts in flight took one past 180 s) and 40 min per
#: training stage (a RAG update of 48 samples outlasted the default 900 s)
QWEN05B_LORA_DEMO = {
    "size": {"iterations": 5, "tasks": 4, "group_size": 4, "heldout_tasks": 200},
    "options": {"heldout_modes": ("greedy",), "logprob_shift": False, "rollout_timeout_s": 600.0,
                "stage_timeout_s": 2400.0},
    # the recipe qwen05b-lora's settings over the default recipe's (spanrl/core/recipes.py)
    "trainer_env": recipe_env("qwen05b-lora", over="default"),
}


def agent_spec(name: str) -> ModuleType:
    """The spec *module* of example agent ``name`` (its ``RUNNER`` and ``load_tasks``): kept only
    for tests/integration/test_agents.py; everything else loads the spec itself
    (spanrl/infra/agents.py ``load_agent_spec``). AgentSpecError (a ValueError) for an unknown name."""
    from spanrl.infra.agents import EXAMPLE_AGENTS, AgentSpecError

    if name not in EXAMPLE_AGENTS:
        raise AgentSpecError(f"unknown example agent {name!r}; known: {', '.join(EXAMPLE_AGENTS)}")
    return importlib.import_module(EXAMPLE_AGENTS[name].partition(":")[0])
