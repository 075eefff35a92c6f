"""What the generic main job and ``spanrl eval`` need to know about the SQL agent."""
from __future__ import annotations

from spanrl.core.settings import TrainerConfig

from .tasks import HELDOUT_SEED, TRAIN_SEED, load_tasks

NAME = "sql"
RUNNER = "examples.sql_agent.agent:sql_agent"
#: the roles whose calls are trained; the checker is left out (the paper's Spider setting)
TRAIN_AGENTS = "write_query,rewrite_query"
AGENT_NAMES = ("write_query", "check_query", "rewrite_query")
SUCCESS_COMPONENT = "correct"
FORMAT_COMPONENT = "format"
#: the demo's size (``make demo AGENT=sql``): an episode makes 2-6 calls, ~20 s each on 2 CPU cores
DEMO = {"iterations": 3, "tasks": 4, "group_size": 4, "heldout_tasks": 40}
#: the demo with another base policy (``make demo AGENT=sql MODEL=...``), over ``DEMO``, the main
#: job's options and the demo's trainer settings (examples/agents.py ``demo_plan``).
#: qwen2.5-coder-0.5b: LoRA rank 16 at lr 5e-5, 5 iterations x 4 tasks x 4 rollouts, 200 held-out
#: ``world`` tasks greedy only and no log-prob shift scoring (each is a ~6 s prefill of the 0.5B
#: model here): held-out greedy execution accuracy 0.455 -> 0.510 and 0.455 -> 0.490 in two runs
#: (LEARNING.md, issue 19; the second one's interval touches 0, after one rollout of 16 in flight
#: outlived the main job's 180 s rollout timeout, so the 0.5B entry allows 600 s; and 40 min per training
#: stage, as a 0.5B RAG update outlasted the default 900 s: examples/rag_agent/spec.py)
DEMO_BY_MODEL = {
    "qwen2.5-coder-0.5b": {
        "size": {"iterations": 5, "tasks": 4, "group_size": 4, "heldout_tasks": 200},
        "options": {"heldout_modes": ("greedy",), "logprob_shift": False, "rollout_timeout_s": 600.0,
                    "stage_timeout_s": 2400.0},
        "trainer_env": TrainerConfig.env(lora_rank=16, lr="5e-5"),
    },
}

__all__ = ["NAME", "RUNNER", "TRAIN_AGENTS", "AGENT_NAMES", "SUCCESS_COMPONENT", "FORMAT_COMPONENT", "DEMO",
           "DEMO_BY_MODEL", "load_tasks", "TRAIN_SEED", "HELDOUT_SEED"]
