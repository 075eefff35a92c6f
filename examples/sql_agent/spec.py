"""What the generic main job and ``spanrl eval`` need to know about the SQL agent."""
from __future__ import annotations

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

__all__ = ["NAME", "RUNNER", "TRAIN_AGENTS", "AGENT_NAMES", "SUCCESS_COMPONENT", "FORMAT_COMPONENT", "DEMO",
           "load_tasks", "TRAIN_SEED", "HELDOUT_SEED"]
