"""The RAG agent's interface for the generic main job and ``spanrl eval``: :data:`SPEC`, an
:class:`~spanrl.core.agent_spec.AgentSpec` (``make demo AGENT=rag``; spanrl/infra/agents.py).

Both agents of the default path train; evaluation reads ``correct`` as success and
``format`` as the format rate (components of :func:`reward.reward`).
"""

from examples.agents import QWEN05B_LORA_DEMO
from spanrl.core.agent_spec import AgentSpec
from spanrl.core.recipes import recipe_env

from .tasks import HELDOUT_SEED, TRAIN_SEED, load_tasks


def task_kind(task: dict) -> str:
    """The question's template (``city_currency``, ...): the group the main job reports it in."""
    return task["metadata"]["template"]


SPEC = AgentSpec(
    name="rag",
    runner="examples.rag_agent.agent:rag_agent",
    load_tasks=load_tasks,
    train_seed=TRAIN_SEED,
    heldout_seed=HELDOUT_SEED,
    train_agents="query_writer,answerer",
    agent_names=("query_writer", "answerer"),
    # the demo's size (``make demo AGENT=rag``): an episode makes 3 calls, ~10 s on 2 CPU cores
    demo={"iterations": 3, "tasks": 4, "group_size": 4, "heldout_tasks": 40},
    # the demo with another base policy (``make demo AGENT=rag MODEL=...``), over ``demo``, the main
    # job's options and the demo's trainer settings (AgentSpec.demo_plan).
    # qwen2.5-coder-0.5b: examples/agents.py ``QWEN05B_LORA_DEMO`` with 8 questions an iteration and 3
    # iterations (24 training questions; ~2 h on 2 CPU cores, 8 x 5 would be ~3 h). Held-out greedy
    # reward, fresh clones (docs/measured/learning-archive.md): with 4 questions x 5 iterations seed 0 (2026-12-06)
    # 0.568 -> 0.750, +0.182 [+0.138, +0.229] and seed 1 (``SPANRL_SEED=1``, 2026-12-07) 0.564 -> 0.549,
    # -0.015 [-0.048, +0.020]: one seed of two; with 8 x 3, seed 0 (2026-12-07) 0.564 -> 0.629, +0.065
    # [+0.022, +0.107], 121 min (updates 85 of them), seed 1 (2026-12-07) +0.012 [-0.017, +0.041], seed 2
    # (2026-12-07) +0.041 [+0.008, +0.075], 135 min: two seeds of three. Its trainer packs each
    # micro-batch as a prefix tree (``SPANRL_TRAINER_TREE_PACKING``, trainer/tree_pack.py: the same
    # log-probs and gradients to 1e-5; one update of 24 recorded samples 0.544x the time, docs/measured/benchmarks.md):
    # the agents' calls share their system prompt and worked turns, a group's calls their question. Seed
    # 0 ran unpacked, seeds 1 and 2 packed.
    # Its trainer settings are the recipe qwen05b-lora-tree (spanrl/core/recipes.py).
    demo_by_model={"qwen2.5-coder-0.5b": {
        **QWEN05B_LORA_DEMO,
        "size": {**QWEN05B_LORA_DEMO["size"], "tasks": 8, "iterations": 3},
        "trainer_env": recipe_env("qwen05b-lora-tree", over="default")}},
    task_kind=task_kind,
)
#: the runner's reference as a module attribute, for examples/agents.py ``agent_spec`` (the integration tests)
RUNNER = SPEC.runner_ref
