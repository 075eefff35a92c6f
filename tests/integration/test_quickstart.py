"""The README's quickstart agent (examples/quickstart/agent.py) trained by the one command the
README gives, ``spanrl train --agent examples.quickstart.agent:spec``, at a tiny size on the test
stack: its calls become transitions, the trainer updates, vLLM serves the new version, and the
held-out report pairs the base with it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


pytestmark = [pytest.mark.integration, pytest.mark.stack_trainer]

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_trains_with_one_command(stack, settings, tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "spanrl.infra.cli", "train", "--agent", "examples.quickstart.agent:spec",
           "--iterations", "1", "--tasks", "2", "--group-size", "2", "--heldout-tasks", "4",
           "--heldout-modes", "greedy", "--no-logprob-shift", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["agent"] == "examples.quickstart.agent:spec"

    (it,) = summary["iterations"]
    assert it["rollouts"] == 4 and it["rollouts_failed"] == 0
    assert it["transitions"] == 4 and it["samples"] + it["dead_letters"] == 4  # one call an attempt
    assert it["groups"] == 2
    assert it["checkpoint_version"] is not None  # an update, published
    assert summary["final_served_version"] >= it["checkpoint_version"] >= 1  # and served
    assert summary["trainer_updates"], "the trainer's log holds the update"

    # the trainer reports its recipe; the main job drives its updates (barrier), nothing else differs
    recipe = summary["trainer_recipe"]
    assert recipe["name"] == (settings.recipe or "default") == summary["recipe"]
    assert set(recipe["differs"]) <= {"batching"} and recipe["values"]["batching"] == "barrier"

    held = summary["heldout"]["greedy"]
    final = f"{settings.run}:{summary['final_served_version']}"
    assert list(held["policies"]) == ["base", final]
    assert held["paired"][f"{final} - base"]["tasks"] == 4
    assert set(summary["heldout_per_kind_paired"]["greedy"]) == {"all"}  # no task kind: one group
    for name in ("summary", "reward_curve", "heldout_greedy", "heldout_greedy_png"):
        assert Path(summary["paths"][name]).stat().st_size > 0

