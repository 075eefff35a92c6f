"""Trainer recipes as data (spanrl/core/recipes.py): the measured ``default`` and the 0.5B LoRA
recipes, the dicts the demos apply read from them (no copy), ``SPANRL_RECIPE`` selects one below
the environment, and TrainerConfig's own defaults are unchanged when none is selected."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from spanrl.core import recipes as R
from spanrl.core.settings import TrainerConfig

DEFAULT_ENV = {
    "SPANRL_TRAINER_LR": "1e-5", "SPANRL_TRAINER_LOSS_AGG": "token_mean", "SPANRL_TRAINER_BATCHING": "barrier",
    "SPANRL_TRAINER_MINI_BATCHES": "8", "SPANRL_TRAINER_SELF_IMITATION_UPDATES": "3",
    "SPANRL_TRAINER_SELF_IMITATION_WEIGHT": "4", "SPANRL_TRAINER_KL_COEF": "0.2",
    "SPANRL_TRAINER_ADVANTAGE_STD_SCALE": "false", "SPANRL_TRAINER_DROP_ZERO_VARIANCE": "true"}


def test_the_recipes_and_their_values():
    assert list(R.RECIPES) == ["default", "qwen05b-lora", "qwen05b-lora-tree"]
    assert R.recipe_env("default") == DEFAULT_ENV
    assert R.recipe_env("qwen05b-lora", over="default") == {"SPANRL_TRAINER_LORA_RANK": "16",
                                                            "SPANRL_TRAINER_LR": "5e-5"}
    assert R.recipe_env("qwen05b-lora-tree", over="default") == {
        "SPANRL_TRAINER_LORA_RANK": "16", "SPANRL_TRAINER_LR": "5e-5", "SPANRL_TRAINER_TREE_PACKING": "true"}
    assert R.recipe_env("qwen05b-lora-tree", over="qwen05b-lora") == {"SPANRL_TRAINER_TREE_PACKING": "true"}
    assert R.recipe_values("qwen05b-lora-tree") == {
        "lr": 5e-5, "loss_agg": "token_mean", "batching": "barrier", "mini_batches": 8, "self_imitation_updates": 3,
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
    with pytest.raises(ValueError, match=r"^unknown recipe 'nope'; known: default, qwen05b-lora, qwen05b-lora-tree$"):
        R.recipe_env("nope")
    assert [R.env_text(v) for v in (1e-5, 5e-05, 0.2, 1e20, 8, True, False, "barrier")] == [
        "1e-5", "5e-5", "0.2", "1e+20", "8", "true", "false", "barrier"]


def test_the_demos_settings_read_from_the_recipes():
    from examples.agents import QWEN05B_LORA_DEMO
    from examples.math_agent.main_job import DEMO_TRAINER_ENV, demo_trainer_env
    from spanrl.infra.agents import load_agent_spec

    assert DEMO_TRAINER_ENV == R.recipe_env("default") == DEFAULT_ENV
    assert QWEN05B_LORA_DEMO["trainer_env"] == R.recipe_env("qwen05b-lora", over="default")
    model = "qwen2.5-coder-0.5b"
    assert load_agent_spec("rag").demo_plan(model)["trainer_env"] == R.recipe_env("qwen05b-lora-tree", over="default")
    for agent in ("math", "sql"):
        assert load_agent_spec(agent).demo_plan(model)["trainer_env"] == R.recipe_env("qwen05b-lora", over="default")
    assert demo_trainer_env({}) == DEFAULT_ENV
    assert demo_trainer_env({"SPANRL_TRAINER_LR": "5e-5"}) == {**DEFAULT_ENV, "SPANRL_TRAINER_LR": "5e-5"}
    assert demo_trainer_env({"SPANRL_TRAINER_LR": "2e-5"}, "qwen05b-lora") == {
        **DEFAULT_ENV, "SPANRL_TRAINER_LR": "5e-5", "SPANRL_TRAINER_LORA_RANK": "16"}


def test_spanrl_recipe_selects_one_below_the_environment():
    # none selected: TrainerConfig's own defaults, unchanged (stream batching; what make up runs)
    plain = TrainerConfig.from_environ({})
    assert (plain.batching, plain.lr, plain.mini_batches, plain.kl_coef, plain.advantage_std_scale,
            plain.drop_zero_variance, plain.self_imitation_updates) == ("stream", 1e-5, 1, 0.0, True, False, 0)
    chosen = TrainerConfig.from_environ({"SPANRL_RECIPE": "qwen05b-lora-tree"})
    assert (chosen.batching, chosen.lr, chosen.mini_batches, chosen.kl_coef, chosen.advantage_std_scale,
            chosen.drop_zero_variance, chosen.self_imitation_updates, chosen.self_imitation_weight,
            chosen.lora_rank, chosen.tree_packing) == ("barrier", 5e-5, 8, 0.2, False, True, 3, 4.0, 16, True)
    env_wins = TrainerConfig.from_environ({"SPANRL_RECIPE": "default", "SPANRL_TRAINER_BATCHING": "stream",
                                           "SPANRL_TRAINER_MINI_BATCHES": "2"})
    assert (env_wins.batching, env_wins.mini_batches, env_wins.kl_coef) == ("stream", 2, 0.2)
    assert TrainerConfig.from_environ({"SPANRL_RECIPE": "default"}, mini_batches=4).mini_batches == 4  # init wins
    with pytest.raises(ValidationError, match="unknown recipe 'nope'; known: default, qwen05b-lora"):
        TrainerConfig.from_environ({"SPANRL_RECIPE": "nope"})


def test_demo_recipe_option_applies_the_recipe_whole(monkeypatch):
    """``spanrl demo --recipe qwen05b-lora-tree``: the recipe's values reach the environment the
    stack's trainer starts with (SPANRL_RECIPE too), the environment still wins; an unknown
    recipe exits 2 before anything starts."""
    from typer.testing import CliRunner

    from spanrl.core.settings import get_settings
    from spanrl.infra import cli
    from stackless_demo import stackless_demo

    seen: dict = {}
    stackless_demo(monkeypatch, seen, (*R.recipe_env("qwen05b-lora-tree"), "SPANRL_RECIPE"),
                   forget={*R.recipe_env("qwen05b-lora-tree"), "SPANRL_RECIPE", "SPANRL_TRAIN_AGENTS", "SPANRL_MODEL"})
    monkeypatch.setenv("SPANRL_TRAINER_KL_COEF", "0.1")  # the environment wins over the recipe
    get_settings.cache_clear()
    try:
        r = CliRunner().invoke(cli.app, ["demo", "--recipe", "nope"])
        assert r.exit_code == 2 and "unknown recipe 'nope'" in r.output and not seen
        r = CliRunner().invoke(cli.app, ["demo", "--recipe", "qwen05b-lora-tree"])
        assert r.exit_code == 0, r.output
        assert seen["env"] == {**R.recipe_env("qwen05b-lora-tree"), "SPANRL_TRAINER_KL_COEF": "0.1",
                               "SPANRL_RECIPE": "qwen05b-lora-tree"}
    finally:
        get_settings.cache_clear()


def test_the_recipes_reference_table(capsys):
    table = R.markdown("qwen05b-lora-tree").splitlines()
    assert table[:4] == ["**qwen05b-lora-tree**: " + R.get_recipe("qwen05b-lora-tree").doc, "",
                         "| setting | value | recipe | source |", "|---|---|---|---|"]
    assert len(table) == 4 + 11
    assert table[4].startswith("| `SPANRL_TRAINER_LR` | `5e-5` | qwen05b-lora | the 0.5B agents (docs/measured/learning.md)")
    assert table[-1].startswith("| `SPANRL_TRAINER_TREE_PACKING` | `true` | qwen05b-lora-tree | trainer/tree_pack.py")
    R.main(["default"])
    assert capsys.readouterr().out == R.markdown("default") + "\n"
