"""The RAG agent's interface for the generic main job and ``spanrl eval``.

Both agents of the default path train; evaluation reads ``correct`` as success and
``format`` as the format rate (components of :func:`reward.reward`).
"""

from .tasks import HELDOUT_SEED, TRAIN_SEED, load_tasks

NAME = "rag"
RUNNER = "examples.rag_agent.agent:rag_agent"
TRAIN_AGENTS = "query_writer,answerer"
AGENT_NAMES = ("query_writer", "answerer")
SUCCESS_COMPONENT = "correct"
FORMAT_COMPONENT = "format"
#: the demo's size (``make demo AGENT=rag``): an episode makes 3 calls, ~10 s on 2 CPU cores
DEMO = {"iterations": 3, "tasks": 4, "group_size": 4, "heldout_tasks": 40}

__all__ = ["NAME", "RUNNER", "TRAIN_AGENTS", "AGENT_NAMES", "load_tasks", "TRAIN_SEED", "HELDOUT_SEED",
           "SUCCESS_COMPONENT", "FORMAT_COMPONENT"]
