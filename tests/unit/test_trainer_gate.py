"""The release gate's decision rule on hand-computed cases."""
import pytest

from spanrl.trainer.gate import ACCEPT, REFUSE, gate_decision


def test_equal_policies_are_served():
    inc = {"a": 1.0, "b": 0.1, "c": 0.0}
    d = gate_decision(inc, dict(inc))
    assert d.accept and d.reason == ACCEPT
    assert d.difference["estimate"] == 0.0 and d.difference["low"] == 0.0 and d.difference["high"] == 0.0
    assert (d.incumbent_mean, d.candidate_mean, d.tasks) == (pytest.approx(1.1 / 3), pytest.approx(1.1 / 3), 3)


def test_three_tasks_are_too_few_to_refuse():
    # differences [-1, 0, -1]: P(bootstrap mean = 0) = (1/3)^3 = 3.7% > 2.5% -> upper end 0
    d = gate_decision({"a": 1.0, "b": 0.0, "c": 1.0}, {"a": 0.0, "b": 0.0, "c": 0.0})
    assert d.difference["estimate"] == pytest.approx(-2 / 3)
    assert d.difference["high"] == 0.0
    assert d.accept


def test_clearly_worse_is_refused():
    # differences [-1, 0, -1, -1, 0, -1]: P(mean = 0) = 1/729, P(mean >= -1/6) = 1.8% -> upper < 0
    inc = dict(zip("abcdef", [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]))
    d = gate_decision(inc, {k: 0.0 for k in inc})
    assert not d.accept and d.reason == REFUSE
    assert d.difference["high"] < 0
    # the same drop within a tolerance of 0.7 is served
    assert gate_decision(inc, {k: 0.0 for k in inc}, tolerance=0.7).accept


def test_better_is_served_and_only_shared_tasks_count():
    d = gate_decision({"a": 0.0, "b": 0.0, "x": 1.0}, {"a": 1.0, "b": 1.0, "y": 0.0})
    assert d.accept and d.tasks == 2 and d.difference["estimate"] == 1.0


def test_bad_input():
    with pytest.raises(ValueError):
        gate_decision({"a": 1.0}, {"b": 1.0})
    with pytest.raises(ValueError):
        gate_decision({"a": 1.0}, {"a": 1.0}, tolerance=-0.1)


# ---- who runs the gate's episodes: named by a setting, not imported by the trainer ----------

def test_the_gate_evaluation_is_the_control_planes_by_default():
    from spanrl.core import plugins
    from spanrl.core.settings import ReloaderConfig
    from spanrl.infra import evaluation

    assert plugins.resolve(ReloaderConfig.from_environ({}).gate_evaluation) is evaluation.gate_rewards
    with pytest.raises(AttributeError):
        plugins.resolve("spanrl.infra.evaluation:no_such_thing")
    with pytest.raises(ImportError):
        plugins.resolve("spanrl.no_such_module:x")


async def test_the_default_gate_evaluation_runs_the_held_out_tasks_it_ran_before(monkeypatch):
    """The same tasks, agent and sampling as the reloader chose itself before the floor:
    items [gate_offset, gate_offset + gate_tasks) of the task set, greedy."""
    from examples.math_agent.tasks import load_task_set
    from spanrl.core.settings import ReloaderConfig
    from spanrl.infra import evaluation

    seen = {}

    async def episodes(cfg, s, tasks, on_done=None):
        seen.update(cfg=cfg, tasks=tasks)
        return [evaluation.Episode(t["task_id"], f"r{i}", "succeeded", reward=float(i % 2)) for i, t in enumerate(tasks)]

    monkeypatch.setattr(evaluation, "run_policy_episodes", episodes)
    cfg = ReloaderConfig.from_environ({}).model_copy(update={"gate_tasks": 5, "gate_offset": 3})
    rewards = await evaluation.gate_rewards(cfg, object(), "gate-r-v1")
    assert seen["tasks"] == load_task_set("arith_word", 1000, 8)[3:]
    assert (seen["cfg"].agent, seen["cfg"].temperature, seen["cfg"].concurrency, seen["cfg"].name) == (
        "examples.math_agent.agent:math_agent", 0.0, 8, "gate-r-v1")
    assert rewards == {t["task_id"]: float(i % 2) for i, t in enumerate(seen["tasks"])}


async def test_the_reloader_uses_the_evaluation_it_is_given(monkeypatch):
    from spanrl.core.settings import ReloaderConfig, Settings
    from spanrl.trainer import reloader

    calls = []

    async def evaluation(cfg, settings, name):
        calls.append(name)
        return {"t": 1.0}

    rl = reloader.Reloader(ReloaderConfig.from_environ({}).model_copy(update={"run": "r"}),
                           Settings.from_environ({}), gate_evaluation=evaluation)
    assert await rl._gate_rewards("v3") == {"t": 1.0} and calls == ["gate-r-v3"]
