"""The quickstart agent's tasks, reward and spec (examples/quickstart/agent.py; trained on the
stack by tests/integration/test_quickstart.py), and the README showing it as it is."""
from __future__ import annotations

from pathlib import Path

from examples.quickstart.agent import load_tasks, reward, spec

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_tasks_and_reward():
    train, heldout = load_tasks("train", 0, 50), load_tasks("heldout", 1000, 50)
    assert not {t["question"] for t in train} & {t["question"] for t in heldout}
    assert train == load_tasks("train", 0, 50)  # deterministic
    assert reward("42", 42) == {"correct": 1.0, "format": 1.0}
    assert reward("The answer is 42", 42) == {"correct": 1.0, "format": 0.0}
    assert reward("41", 42) == {"correct": 0.0, "format": 1.0}
    assert reward("", 42) == {"correct": 0.0, "format": 0.0}
    assert spec.runner_ref == "examples.quickstart.agent:sum_agent"


def test_readme_shows_the_quickstart_agent_whole():
    """The README's Python block is examples/quickstart/agent.py, so copying it gives the file
    the README's command trains."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```python\n", 1)[1].split("```", 1)[0]
    assert block == (ROOT / "examples" / "quickstart" / "agent.py").read_text()
    assert "make train AGENT=examples.quickstart.agent:spec" in readme
