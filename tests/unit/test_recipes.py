"""Trainer recipes as data (spanrl/core/recipes.py): the measured ``default`` *is*
TrainerConfig's defaults (one place), the 0.5B LoRA recipes and ``plain`` beside it, the dicts
the demos apply read from them (no copy), ``SPANRL_RECIPE`` selects one below the environment,
and a trainer reports its recipe and where it differs."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from spanrl.core import recipes as R
from spanrl.core.settings import TrainerConfig

DEFAULT_ENV = {
    "SPANRL_TRAINER_LR": "1e-5", "SPANRL_TRAINER_LOSS_AGG": "token_mean", "SPANRL_TRAINER_BATCHING": "groups",
    "SPANRL_TRAINER_UPDATE_GROUPS": "6",
    "SPANRL_TRAINER_MINI_BATCHES": "8", "SPANRL_TRAINER_SELF_IMITATION_UPDATES": "3",
    "SPANRL_TRAINER_SELF_IMITATION_WEIGHT": "4", "SPANRL_TRAINER_KL_COEF": "0.2",
    "SPANRL_TRAINER_ADVANTAGE_STD_SCALE": "false", "SPANRL_TRAINER_DROP_ZERO_VARIANCE": "true"}


def test_the_recipes_and_their_values():
    assert list(R.RECIPES) == ["default", "qwen05b-lora", "qwen05b-lora-tree", "plain"]
    assert R.recipe_env("default") == DEFAULT_ENV
    assert R.recipe_env("qwen05b-lora", over="default") == {"SPANRL_TRAINER_LORA_RANK": "16",
                                                            "SPANRL_TRAINER_LR": "5e-5"}
    assert R.recipe_env("qwen05b-lora-tree", over="default") == {
        "SPANRL_TRAINER_LORA_RANK": "16", "SPANRL_TRAINER_LR": "5e-5", "SPANRL_TRAINER_TREE_PACKING": "true"}
    assert R.recipe_env("qwen05b-lora-tree", over="qwen05b-lora") == {"SPANRL_TRAINER_TREE_PACKING": "true"}
    assert R.recipe_values("qwen05b-lora-tree") == {
        "lr": 5e-5, "loss_agg": "token_mean", "batching": "groups", "update_groups": 6, "mini_batches": 8,
        "self_imitation_updates": 3,
        "self_imitation_weight": 4, "kl_coef": 0.2, "advantage_std_scale": False, "drop_zero_variance": True,
        "lora_rank": 16, "tree_packing": True}
    assert [r.name for r in R.lineage("qwen05b-lora-tree")] == ["default", "qwen05b-lora", "qwen05b-lora-tree"]


def test_every_value_is_a_trainer_field_with_a_source():
    for name, recipe in R.RECIPES.items():
        assert recipe.doc and (recipe.based_on is None or recipe.based_on in R.RECIPES), name
        for field, measured in recipe.fields.items():
            assert field in TrainerConfig.model_fields and len(measured.source) > 20, (name, field)
        R.recipe_env(name)  # every value parses as its field (TrainerConfig.env)
    rows = R.describe("qwen05b-lora")
    assert [(r["field"], r["recipe"]) for r in rows if r["field"] in ("lr", "lora_rank", "kl_coef")] == [
        ("lr", "qwen05b-lora"), ("kl_coef", "default"), ("lora_rank", "qwen05b-lora")]


def test_unknown_recipe_and_env_text():
    with pytest.raises(ValueError, match=r"^unknown recipe 'nope'; known: default, qwen05b-lora, qwen05b-lora-tree, "
                                         r"plain$"):
        R.recipe_env("nope")
    assert [R.env_text(v) for v in (1e-5, 5e-05, 0.2, 1e20, 8, True, False, "barrier")] == [
        "1e-5", "5e-5", "0.2", "1e+20", "8", "true", "false", "barrier"]


def test_the_demos_settings_read_from_the_recipes():
    from examples.agents import QWEN05B_LORA_DEMO
    from examples.math_agent.main_job import DRIVER_TRAINER_ENV, demo_trainer_env
    from spanrl.infra.agents import load_agent_spec

    assert DRIVER_TRAINER_ENV == {"SPANRL_TRAINER_BATCHING": "barrier"}  # the main job drives its updates
    assert QWEN05B_LORA_DEMO["trainer_env"] == R.recipe_env("qwen05b-lora", over="default")
    model = "qwen2.5-coder-0.5b"
    assert load_agent_spec("rag").demo_plan(model)["trainer_env"] == R.recipe_env("qwen05b-lora-tree", over="default")
    for agent in ("math", "sql"):
        assert load_agent_spec(agent).demo_plan(model)["trainer_env"] == R.recipe_env("qwen05b-lora", over="default")
    assert demo_trainer_env({}) == DRIVER_TRAINER_ENV
    assert demo_trainer_env({"SPANRL_TRAINER_LR": "5e-5"}) == {**DRIVER_TRAINER_ENV, "SPANRL_TRAINER_LR": "5e-5"}
    # a chosen recipe is read whole by the trainer (SPANRL_RECIPE): the per-model settings are left out
    assert demo_trainer_env({"SPANRL_TRAINER_LR": "2e-5"}, "qwen05b-lora") == DRIVER_TRAINER_ENV


def test_trainer_config_defaults_are_the_default_recipe():
    """No environment (``make up``, a runner, a production agent): every field the default recipe
    sets has its value, from recipes.DEFAULT alone (the settings reference says so)."""
    from spanrl.core import settings as S

    none = TrainerConfig.from_environ({})
    values = R.recipe_values("default")
    assert {k: getattr(none, k) for k in values} == values
    assert R.differences({k: getattr(none, k) for k in R.recipe_fields()}, "default") == {}
    for field in values:  # the declared default is the recipe's, and the reference names the recipe
        assert TrainerConfig.model_fields[field].default == values[field]
        assert S._shown_default(TrainerConfig, field).endswith("(recipe `default`)")
    assert S._shown_default(TrainerConfig, "batching") == "`groups` (recipe `default`)"
    assert "recipe" not in (TrainerConfig.model_fields["clip_eps"].json_schema_extra or {})


def test_a_trainer_reports_its_recipe_and_the_differences():
    from spanrl.trainer.train import recipe_report

    report = recipe_report(TrainerConfig.from_environ({"SPANRL_TRAINER_BATCHING": "barrier"}), "default")
    assert report["name"] == "default" and set(report["values"]) == set(R.recipe_fields())
    assert report["differs"] == {"batching": {"recipe": "groups", "actual": "barrier"}}
    plain = recipe_report(TrainerConfig.from_environ({"SPANRL_RECIPE": "plain"}), "plain")
    assert plain["differs"] == {} and plain["values"]["kl_coef"] == 0.0 and plain["values"]["batching"] == "stream"
    assert R.differences({"lr": 1e-5}, "plain")["mini_batches"] == {"recipe": 1, "actual": None}


def test_spanrl_recipe_selects_one_below_the_environment():
    plain = TrainerConfig.from_environ({"SPANRL_RECIPE": "plain"})  # the settings before the recipe
    assert (plain.batching, plain.lr, plain.mini_batches, plain.kl_coef, plain.advantage_std_scale,
            plain.drop_zero_variance, plain.self_imitation_updates) == ("stream", 1e-5, 1, 0.0, True, False, 0)
    chosen = TrainerConfig.from_environ({"SPANRL_RECIPE": "qwen05b-lora-tree"})
    assert (chosen.batching, chosen.lr, chosen.mini_batches, chosen.kl_coef, chosen.advantage_std_scale,
            chosen.drop_zero_variance, chosen.self_imitation_updates, chosen.self_imitation_weight,
            chosen.lora_rank, chosen.tree_packing) == ("groups", 5e-5, 8, 0.2, False, True, 3, 4.0, 16, True)
    env_wins = TrainerConfig.from_environ({"SPANRL_RECIPE": "plain", "SPANRL_TRAINER_BATCHING": "barrier",
                                           "SPANRL_TRAINER_MINI_BATCHES": "2"})
    assert (env_wins.batching, env_wins.mini_batches, env_wins.kl_coef) == ("barrier", 2, 0.0)
    assert TrainerConfig.from_environ({"SPANRL_RECIPE": "default"}, mini_batches=4).mini_batches == 4  # init wins
    with pytest.raises(ValidationError, match="unknown recipe 'nope'; known: default, qwen05b-lora"):
        TrainerConfig.from_environ({"SPANRL_RECIPE": "nope"})


def test_demo_recipe_option_applies_the_recipe_whole(monkeypatch):
    """``spanrl train --recipe qwen05b-lora-tree``: SPANRL_RECIPE reaches the environment the
    stack's trainer starts with (which reads the recipe whole), the environment still wins; an
    unknown recipe exits 2 before anything starts."""
    from typer.testing import CliRunner

    from spanrl.core.settings import get_settings
    from spanrl.infra import cli
    from stackless_demo import stackless_demo

    seen: dict = {}
    names = ("SPANRL_TRAINER_BATCHING", "SPANRL_TRAINER_KL_COEF", "SPANRL_RECIPE", "SPANRL_TRAINER_LORA_RANK")
    stackless_demo(monkeypatch, seen, names,
                   forget={*R.recipe_env("qwen05b-lora-tree"), *names, "SPANRL_TRAIN_AGENTS", "SPANRL_MODEL"})
    monkeypatch.setenv("SPANRL_TRAINER_KL_COEF", "0.1")  # the environment wins over the recipe
    get_settings.cache_clear()
    try:
        r = CliRunner().invoke(cli.app, ["demo", "--recipe", "nope"])
        assert r.exit_code == 2 and "unknown recipe 'nope'" in r.output and not seen
        r = CliRunner().invoke(cli.app, ["train", "--recipe", "qwen05b-lora-tree"])
        assert r.exit_code == 0, r.output
        # the trainer reads the recipe whole (SPANRL_RECIPE); the main job adds its barrier
        assert seen["env"] == {"SPANRL_TRAINER_BATCHING": "barrier", "SPANRL_TRAINER_KL_COEF": "0.1",
                               "SPANRL_RECIPE": "qwen05b-lora-tree", "SPANRL_TRAINER_LORA_RANK": None}
    finally:
        get_settings.cache_clear()


def test_the_recipes_reference_table(capsys):
    table = R.markdown("qwen05b-lora-tree").splitlines()
    assert table[:4] == ["**qwen05b-lora-tree**: " + R.get_recipe("qwen05b-lora-tree").doc, "",
                         "| setting | value | recipe | source |", "|---|---|---|---|"]
    assert len(table) == 4 + 12
    assert table[4].startswith("| `SPANRL_TRAINER_LR` | `5e-5` | qwen05b-lora | the 0.5B agents (docs/measured/learning.md)")
    assert table[-1].startswith("| `SPANRL_TRAINER_TREE_PACKING` | `true` | qwen05b-lora-tree | trainer/tree_pack.py")
    R.main(["default"])
    assert capsys.readouterr().out == R.markdown("default") + "\n"
