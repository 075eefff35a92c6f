"""The public surface: ``import spanrl`` names the user's API (runner and context, tasks,
telemetry, the agent spec, the recipes), each documented with an example, imported lazily (no Kafka,
OpenTelemetry or torch at ``import spanrl``); ``spanrl --help`` gives every command one line."""
from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import spanrl

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = ["Runner", "RolloutContext", "make_task", "publish_tasks", "instrument", "emit_reward", "flush",
          "AgentSpec", "AgentSpecError", "load_agent_spec", "Recipe", "get_recipe", "recipe_env"]


def test_all_names_the_public_surface_and_each_is_documented_with_an_example():
    assert spanrl.__all__ == PUBLIC
    for name in spanrl.__all__:
        value = getattr(spanrl, name)
        assert value.__name__ == name and value.__module__.startswith("spanrl."), name
        doc = inspect.getdoc(value) or ""
        assert "Example" in doc, name
    assert set(PUBLIC) <= set(dir(spanrl))
    with pytest.raises(AttributeError, match="module 'spanrl' has no attribute 'Trainer'"):
        spanrl.Trainer  # noqa: B018 - internal names stay internal


def test_import_spanrl_loads_nothing_heavy():
    heavy = ("torch", "faust", "vllm", "aiokafka", "opentelemetry", "deepspeed", "transformers")
    code = ("import sys, spanrl; spanrl.AgentSpec; "
            f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True).stdout.strip()
    assert out == "[]"


def test_the_lazy_names_are_the_modules_objects():
    from spanrl.core.agent_spec import AgentSpec
    from spanrl.producers.runner import Runner, make_task

    assert (spanrl.AgentSpec, spanrl.Runner, spanrl.make_task) == (AgentSpec, Runner, make_task)
    task = spanrl.make_task({"question": "2 + 2?"}, group_size=6, task_id="t1")
    assert {k: task[k] for k in ("task_id", "payload", "group_size", "timeout_s")} == {
        "task_id": "t1", "payload": '{"question": "2 + 2?"}', "group_size": 6, "timeout_s": 120.0}


def test_help_gives_every_command_one_line():
    from typer.testing import CliRunner

    from spanrl.infra import cli

    def commands(app, prefix=""):
        for info in app.registered_commands:
            yield prefix + (info.name or info.callback.__name__), info.short_help
        for group in app.registered_groups:
            yield prefix + group.name, group.typer_instance.info.help
            yield from commands(group.typer_instance, prefix + group.name + " ")

    listed = dict(commands(cli.app))
    assert {"demo", "study", "eval", "replay", "chaos", "calls", "runs", "clean", "stack", "stack up"} <= set(listed)
    for name, line in listed.items():
        assert line and "\n" not in line and len(line) <= 100 and line.endswith("."), (name, line)
    out = CliRunner().invoke(cli.app, ["--help"], env={"COLUMNS": "200"}).output
    for name, line in listed.items():
        if " " not in name:
            assert line in out, name
    assert cli.SHORT_HELP["demo"] in out
    assert cli.first_sentence("One. Two.\n\nThree.") == "One." and cli.first_sentence("No end") == "No end"
