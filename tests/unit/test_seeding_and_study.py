"""Run seeds (producers/seeding.py, the request hook, the proxy's use of the header), the
study's intervals and report (spanrl/core/intervals.py, infra/study.py) and the main job's per-kind
breakdown, on hand-computed values."""
from __future__ import annotations

import httpx
import pytest

from spanrl.core.intervals import pooled_paired_difference, t_interval
from spanrl.infra import study
from spanrl.producers import instrument, seeding


def test_derived_seeds_are_stable_distinct_and_in_range():
    a = seeding.rollout_seed(0, "arith_word-0-3", 2, "0")
    assert a == seeding.rollout_seed(0, "arith_word-0-3", 2, "0")
    others = {seeding.rollout_seed(1, "arith_word-0-3", 2, "0"), seeding.rollout_seed(0, "arith_word-0-4", 2, "0"),
              seeding.rollout_seed(0, "arith_word-0-3", 3, "0"), seeding.rollout_seed(0, "arith_word-0-3", 2, "1")}
    assert a not in others and len(others) == 4
    calls = [seeding.call_seed(a, k) for k in range(50)]
    assert len(set(calls)) == 50 and all(0 <= c < seeding.SEED_LIMIT for c in calls)
    # pinned: a change of the derivation changes every run's samples, so it must be deliberate
    assert seeding.derive_seed("x") == int.from_bytes(
        bytes.fromhex("2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881")[:8], "big") % (2**31 - 1)


@pytest.mark.parametrize("text", ["", "-1", "1.5", "abc", str(2**31 - 1), "9" * 40])
def test_parse_seed_refuses_what_is_not_a_seed(text):
    with pytest.raises(ValueError):
        seeding.parse_seed(text)


def test_parse_seed():
    assert seeding.parse_seed(" 42 ") == 42 and seeding.parse_seed("0") == 0


def test_requests_inside_a_seeded_attempt_carry_each_calls_seed():
    """The patched httpx send adds the call's seed (call 0, 1, ... of the attempt) to POSTs
    made inside a rollout context with a sampling seed, and none outside or without one."""
    instrument.propagate_trace_context()
    seen = []
    client = httpx.Client(transport=httpx.MockTransport(
        lambda req: seen.append(req.headers.get(seeding.SEED_HEADER)) or httpx.Response(200, json={})))
    with instrument.rollout_context("r1", "0", sampling_seed=1234):
        client.post("http://proxy/v1/chat/completions", json={})
        client.post("http://proxy/v1/chat/completions", json={})
        client.get("http://proxy/v1/models")
        client.post("http://proxy/v1/chat/completions", json={}, headers={seeding.SEED_HEADER: "7"})
    with instrument.rollout_context("r2", "0"):
        client.post("http://proxy/v1/chat/completions", json={})
    client.post("http://proxy/v1/chat/completions", json={})
    assert seen == [str(seeding.call_seed(1234, 0)), str(seeding.call_seed(1234, 1)), None, "7", None, None]


def test_proxy_refuses_a_bad_seed_header_before_vllm():
    from fastapi.testclient import TestClient

    from spanrl.producers.kafka import Sink, Topics
    from spanrl.producers.proxy import create_app

    app = create_app(Sink("127.0.0.1:1", Topics(), send_timeout_s=1.0), "http://127.0.0.1:1", "policy")
    body = {"model": "policy", "messages": [{"role": "user", "content": "x"}]}
    with TestClient(app) as client:
        r = client.post("/rollouts/r/attempts/0/v1/chat/completions", json=body,
                        headers={seeding.SEED_HEADER: "not-a-number"})
    assert (r.status_code, r.json()["error"]["type"]) == (400, "invalid_seed")


def test_t_interval_and_pooled_difference_hand_computed():
    iv = t_interval([0.1, 0.2, 0.3])
    assert (iv.estimate, iv.low, iv.high) == pytest.approx((0.2, 0.2 - 4.303 * 0.1 / 3 ** 0.5,
                                                             0.2 + 4.303 * 0.1 / 3 ** 0.5))
    assert t_interval([0.5]).low == 0.5 and t_interval([0.5]).method == "single-value"
    with pytest.raises(ValueError):
        t_interval([])
    assert study.pooled_text(t_interval([0.19]).as_dict()) == "one seed: no spread across seeds"
    assert study.pooled_text(t_interval([0.1, 0.2, 0.3]).as_dict()) == "+0.200 [-0.048, +0.448]"
    p = pooled_paired_difference([[0, 0], [0, 1]], [[1, 0], [1, 1]])
    assert p.estimate == 0.5 and p.n == 2
    with pytest.raises(ValueError):
        pooled_paired_difference([[0, 0]], [[1]])


def _report(base: list[int], final: list[int], low: float) -> dict:
    def pol(xs):
        return {"per_episode": [{"task_id": f"t{i}", "components": {"correct": x}, "reward": float(x)}
                                for i, x in enumerate(xs)],
                "tool_use_rate": None, "mean_llm_calls": None}
    d = (sum(final) - sum(base)) / len(base)
    return {"policies": {"base": pol(base), "run:4": pol(final)},
            "paired": {"run:4 - base": {"success_rate": {"estimate": d, "low": low, "high": d + 0.1}}}}


def test_study_report_per_seed_and_pooled():
    heldout = [{"greedy": _report([0, 0, 1, 1], [1, 0, 1, 1], 0.01), "sampled": _report([0, 0, 0, 1], [1, 1, 0, 1], 0.1)},
               {"greedy": _report([0, 0, 1, 1], [1, 1, 1, 1], 0.2), "sampled": _report([0, 0, 0, 1], [0, 1, 0, 1], 0.02)}]
    summaries = [{"run": f"s{k}", "config": {"iterations": 4}, "trainer_env": {}, "heldout": {},
                  "logprob_shift_of_iteration0_completions": {"positive": {"delta": 0.1}, "negative": {"delta": -0.2}},
                  "iterations": [{"iteration": 0, "correct_rate": 0.1, "mean_reward": 0.2}]} for k in range(2)]
    r = study.study_report([0, 1], summaries, heldout, [])
    g = r["heldout"]["greedy"]
    assert [p["difference"]["estimate"] for p in g["per_seed"]] == [0.25, 0.5]
    assert [(p["base"], p["final"]) for p in g["per_seed"]] == [(0.5, 0.75), (0.5, 1.0)]
    assert g["pooled_across_seeds"]["estimate"] == pytest.approx(0.375)
    # per task, averaged over the 2 seeds: t0 +1, t1 +0.5, t2 0, t3 0
    assert g["pooled_paired_bootstrap"]["estimate"] == pytest.approx(0.375)
    assert g["every_seed_above_zero"] and g["no_seed_below_base"]
    assert not r["target_met"]  # the target asks for 3 seeds
    r3 = study.study_report([0, 1, 2], summaries + summaries[:1], heldout + heldout[:1], [])
    assert r3["target_met"] and r3["logprob_shift_every_seed"] == {"positive_up": True, "negative_down": True}
    fell = [{**summaries[0], "logprob_shift_of_iteration0_completions": {"positive": {"delta": -0.01},
                                                                        "negative": {"delta": -0.2}}}]
    r_fell = study.study_report([0, 1, 2], summaries + fell, heldout + heldout[:1], [])
    assert r_fell["logprob_shift_every_seed"]["positive_up"] is False and not r_fell["target_met"]
    # the all-completions figure is reported per seed and across seeds, not part of the target
    pooled = [{**summaries[0], "logprob_shift_of_all_completions": {"all": {"positive": {"delta": 0.02},
                                                                            "negative": {"delta": -0.3}}}}]
    r_all = study.study_report([0, 1, 2], pooled * 3, heldout + heldout[:1], [])
    assert r_all["per_seed"][0]["logprob_shift_of_all_completions"] == {"positive": 0.02, "negative": -0.3}
    assert r_all["logprob_shift_of_all_completions_every_seed"] == {"positive_up": True, "negative_down": True}
    assert r3["logprob_shift_of_all_completions_every_seed"]["positive_up"] is False  # absent: not shown as met
    heldout[1]["sampled"]["paired"]["run:4 - base"]["success_rate"]["low"] = -0.05
    assert not study.study_report([0, 1, 2], summaries + summaries[:1], heldout + heldout[:1], [])["target_met"]
    heldout[1]["greedy"]["policies"]["base"]["per_episode"].pop()
    with pytest.raises(ValueError):
        study.study_report([0, 1], summaries, heldout, [])


def _graded(base: list[float], final: list[float], low: float) -> dict:
    """An evaluation report of a graded reward (RAG: 0.9 x word F1 + 0.1 x format): correct only at 1."""
    def pol(xs):
        return {"per_episode": [{"task_id": f"q{i}", "components": {"correct": float(x == 1.0)}, "reward": x}
                                for i, x in enumerate(xs)], "tool_use_rate": None, "mean_llm_calls": None}
    d = (sum(final) - sum(base)) / len(base)
    return {"policies": {"base": pol(base), "run:5": pol(final)},
            "paired": {"run:5 - base": {"mean_reward": {"estimate": d, "low": low, "high": d + 0.1},
                                        "success_rate": {"estimate": 0.0, "low": 0.0, "high": 0.0}}}}


def test_study_report_mean_reward_of_a_graded_reward():
    heldout = [{"greedy": _graded([0.1, 0.5, 1.0, 0.2], [0.3, 0.5, 1.0, 0.6], 0.05)},
               {"greedy": _graded([0.1, 0.5, 1.0, 0.2], [0.1, 0.9, 1.0, 0.2], -0.02)}]
    summaries = [{"run": f"s{k}", "config": {}, "trainer_env": {}, "heldout": {},
                  "iterations": [{"iteration": 0, "correct_rate": 0.0, "mean_reward": 0.4}]} for k in range(2)]
    r = study.study_report([0, 1], summaries, heldout, [])
    g = r["heldout_reward"]["greedy"]
    assert [(p["base"], p["final"]) for p in g["per_seed"]] == [pytest.approx((0.45, 0.6)), pytest.approx((0.45, 0.55))]
    assert [p["difference"]["estimate"] for p in g["per_seed"]] == [pytest.approx(0.15), pytest.approx(0.1)]
    # per question, averaged over the 2 seeds: +0.1, +0.2, 0, +0.2
    assert g["pooled_paired_bootstrap"]["estimate"] == pytest.approx(0.125)
    assert not g["every_seed_above_zero"] and g["no_seed_below_base"]
    # the correct rate of the same reports: nothing changed (no answer went to 1.0)
    c = r["heldout"]["greedy"]
    assert [(p["base"], p["final"]) for p in c["per_seed"]] == [(0.25, 0.25), (0.25, 0.25)]
    with pytest.raises(KeyError):
        study.paired_block([heldout[0]["greedy"]], "f1")


def test_per_kind_breakdown():
    from examples.math_agent.main_job import per_kind

    rep = {"policies": {"base": {"per_episode": [
        {"task_id": "a", "reward": 1.0, "components": {"correct": 1}},
        {"task_id": "b", "reward": 0.25, "components": {"correct": 0}},
        {"task_id": "c", "reward": 0.5, "components": {"correct": 1}}]}}}
    assert per_kind(rep, {"a": "add", "b": "add", "c": "mul"}) == {
        "add": {"base": {"episodes": 2, "correct": 0.5, "reward": 0.625}},
        "mul": {"base": {"episodes": 1, "correct": 1.0, "reward": 0.5}}}


def _episode(task_id, reward, correct):
    return {"task_id": task_id, "rollout_id": f"r-{task_id}", "status": "succeeded", "reward": reward,
            "components": {"correct": correct}}


def test_per_kind_paired_differences():
    """Final - base per kind over that kind's tasks only: kind ``add`` (a: 0 -> 1, b: 0.5 -> 0.5)
    gains +0.5 in reward and in success; kind ``mul`` (c: 1 -> 0) loses 1; a kind only one
    policy ran is an error entry, not a crash."""
    from examples.math_agent.main_job import per_kind_paired

    rep = {"policies": {
        "base": {"per_episode": [_episode("a", 0.0, 0), _episode("b", 0.5, 1), _episode("c", 1.0, 1),
                                 _episode("d", 0.3, 0)]},
        "run:3": {"per_episode": [_episode("a", 1.0, 1), _episode("b", 0.5, 1), _episode("c", 0.0, 0)]}}}
    out = per_kind_paired(rep, {"a": "add", "b": "add", "c": "mul", "d": "div"})
    assert sorted(out) == ["add", "div", "mul"]
    add = out["add"]["run:3 - base"]
    assert add["tasks"] == 2 and add["mean_reward"]["estimate"] == pytest.approx(0.5)
    assert add["success_rate"]["estimate"] == pytest.approx(0.5)
    assert add["mean_reward"]["method"] == "paired-bootstrap" and add["mean_reward"]["n"] == 2
    mul = out["mul"]["run:3 - base"]
    assert (mul["tasks"], mul["mean_reward"]["estimate"], mul["mean_reward"]["low"]) == (1, -1.0, -1.0)
    assert out["div"] == {"error": "the two policies share no task"}
    # one policy: nothing to pair
    assert per_kind_paired({"policies": {"base": rep["policies"]["base"]}}, {}) == {"all": {}}


def test_compare_repeat():
    a = {"greedy": _report([0, 0, 1, 1], [1, 0, 1, 1], 0.01)}
    b = {"greedy": _report([0, 0, 1, 1], [1, 0, 1, 0], 0.01)}
    summ = {"iterations": [{"mean_reward": 0.2}]}
    same = study.compare_repeat(summ, summ, a, a, {1: "x", 2: "y"}, {1: "x", 2: "y"})
    assert same["repeatable"] and same["weights_identical"] and same["first_differing_version"] is None
    assert same["heldout"]["greedy"]["same_final_reward"] == 1.0
    for ep in b["greedy"]["policies"]["run:4"]["per_episode"]:
        ep["reward"] = ep["components"]["correct"]
    for ep in a["greedy"]["policies"]["run:4"]["per_episode"]:
        ep["reward"] = ep["components"]["correct"]
    diff = study.compare_repeat(summ, summ, a, b, {1: "x", 2: "y"}, {1: "x", 2: "z"})
    assert (diff["identical_versions"], diff["first_differing_version"]) == ([1], 2)
    assert diff["heldout"]["greedy"]["same_final_reward"] == 0.75 and not diff["repeatable"]
    assert not diff["weights_identical"]
    bits = study.compare_repeat(summ, summ, a, a, {1: "x"}, {1: "z"})  # same results, other bytes
    assert bits["repeatable"] and not bits["weights_identical"]


def test_demo_heldout_modes_option():
    import typer

    from spanrl.infra.cli import _heldout_modes

    assert _heldout_modes(None) is None
    assert _heldout_modes("greedy") == ("greedy",)
    assert _heldout_modes(" greedy , sampled,greedy") == ("greedy", "sampled")
    for bad in ("", ",", "greedy,beam"):
        with pytest.raises(typer.BadParameter, match="known modes are sampled, greedy"):
            _heldout_modes(bad)


def test_demo_plan_is_the_agents_demo_with_its_models_entry_over_it():
    from spanrl.infra.agents import load_agent_spec as agent_spec

    def demo_plan(spec, model):
        return spec.demo_plan(model)

    sql = agent_spec("sql")
    assert demo_plan(sql, "smollm2-135m") == {
        "size": {"iterations": 3, "tasks": 4, "group_size": 4, "heldout_tasks": 40}, "options": {}, "trainer_env": {}}
    assert demo_plan(sql, "qwen2.5-coder-0.5b") == {
        "size": {"iterations": 5, "tasks": 8, "group_size": 4, "heldout_tasks": 200},
        "options": {"heldout_modes": ("greedy",), "logprob_shift": False, "rollout_timeout_s": 600.0, "stage_timeout_s": 2400.0},
        "trainer_env": {"SPANRL_TRAINER_LORA_RANK": "16", "SPANRL_TRAINER_LR": "5e-5"}}
    assert demo_plan(agent_spec("rag"), "qwen2.5-coder-0.5b") == {
        "size": {"iterations": 3, "tasks": 8, "group_size": 4, "heldout_tasks": 200},
        "options": {"heldout_modes": ("greedy",), "logprob_shift": False, "rollout_timeout_s": 600.0, "stage_timeout_s": 2400.0},
        "trainer_env": {"SPANRL_TRAINER_LORA_RANK": "16", "SPANRL_TRAINER_LR": "5e-5",
                        "SPANRL_TRAINER_TREE_PACKING": "true"}}
    assert demo_plan(agent_spec("rag"), "smollm2-135m")["size"] == {
        "iterations": 3, "tasks": 4, "group_size": 4, "heldout_tasks": 40}
    assert demo_plan(agent_spec("math"), "qwen2.5-coder-0.5b") == {
        "size": {"iterations": 4, "tasks": 6, "group_size": 6, "heldout_tasks": 200},
        "options": {"heldout_modes": ("greedy",), "logprob_shift": False, "rollout_timeout_s": 600.0,
                    "stage_timeout_s": 2400.0, "task_set": "gsm_symbolic", "train_task_set": "gsm_symbolic"},
        "trainer_env": {"SPANRL_TRAINER_LORA_RANK": "16", "SPANRL_TRAINER_LR": "5e-5"}}
    assert demo_plan(agent_spec("math"), "smollm2-135m") == {
        "size": {"iterations": 4, "tasks": 6, "group_size": 6, "heldout_tasks": 200}, "options": {}, "trainer_env": {}}


def test_every_demo_by_model_entry_names_known_models_options_and_settings():
    from dataclasses import fields

    from examples.math_agent.main_job import MainJobConfig
    from spanrl.core.model import MODELS
    from spanrl.core.settings import TrainerConfig
    from spanrl.infra.agents import EXAMPLE_AGENTS as AGENTS
    from spanrl.infra.agents import load_agent_spec as agent_spec

    options = {f.name for f in fields(MainJobConfig)} - {"iterations", "tasks_per_iteration", "group_size",
                                                           "heldout_tasks", "agent", "out_dir"}
    entries = [(name, model, e) for name in AGENTS for model, e in agent_spec(name).demo_by_model.items()]
    assert entries  # the SQL agent's 0.5B demo at least
    for name, model, e in entries:
        assert model in MODELS and set(e) <= {"size", "options", "trainer_env"}, (name, model)
        assert set(e.get("size", {})) <= set(agent_spec(name).demo) and set(e.get("options", {})) <= options
        assert set(e.get("trainer_env", {})) <= set(TrainerConfig.env_names())


def test_demo_runs_the_plan_under_the_command_lines_options(monkeypatch):
    """``spanrl demo --agent sql`` with SPANRL_MODEL=qwen2.5-coder-0.5b: the plan's size, options
    and trainer settings reach the main job; the command line and the environment win."""
    from typer.testing import CliRunner

    import examples.math_agent.main_job as main_job
    from spanrl.core.settings import get_settings
    from spanrl.infra import cli
    from stackless_demo import stackless_demo

    seen: dict = {}
    stackless_demo(monkeypatch, seen, ("SPANRL_TRAINER_LORA_RANK", "SPANRL_TRAINER_LR", "SPANRL_TRAINER_KL_COEF"),
                   forget={*main_job.DRIVER_TRAINER_ENV, "SPANRL_TRAINER_LORA_RANK", "SPANRL_TRAIN_AGENTS",
                           "SPANRL_RECIPE"})
    monkeypatch.setenv("SPANRL_MODEL", "qwen2.5-coder-0.5b")
    monkeypatch.setenv("SPANRL_TRAINER_LR", "2e-5")  # the environment wins over the plan
    get_settings.cache_clear()
    try:
        r = CliRunner().invoke(cli.app, ["demo", "--agent", "sql", "--tasks", "3", "--no-logprob-shift"])
        assert r.exit_code == 0, r.output
        cfg = seen["cfg"]
        assert (cfg.iterations, cfg.tasks_per_iteration, cfg.group_size, cfg.heldout_tasks) == (5, 3, 4, 200)
        assert (cfg.heldout_modes, cfg.logprob_shift, cfg.rollout_timeout_s, cfg.stage_timeout_s) == (
            ("greedy",), False, 600.0, 2400.0)
        # the recipe's values are TrainerConfig's defaults: nothing to set (KL 0.2 without a variable)
        assert seen["env"] == {"SPANRL_TRAINER_LORA_RANK": "16", "SPANRL_TRAINER_LR": "2e-5",
                               "SPANRL_TRAINER_KL_COEF": None}
        r = CliRunner().invoke(cli.app, ["demo", "--agent", "sql", "--heldout-modes", "sampled,greedy",
                                         "--logprob-shift"])
        assert r.exit_code == 0, r.output
        assert (seen["cfg"].heldout_modes, seen["cfg"].logprob_shift) == (("sampled", "greedy"), True)
    finally:
        get_settings.cache_clear()
