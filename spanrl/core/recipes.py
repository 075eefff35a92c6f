"""Trainer recipes as data: named sets of trainer settings, each value with where it was measured.

A recipe names :class:`~spanrl.core.settings.TrainerConfig` fields and their values, over the
recipe it is ``based_on`` (TRL's and nanoGPT's configs as plain data). ``default`` is the
setting measured in docs/measured/learning.md (study 11 in three seeds, 2026-12-05), what
``make demo`` and ``spanrl study`` train with; the 0.5B LoRA recipes are the SQL, math and RAG
agents' demos with qwen2.5-coder-0.5b (issue 19).

Selecting one: ``SPANRL_RECIPE=name`` (or ``spanrl demo --recipe name``) makes its values the
trainer's, below the environment: a ``SPANRL_TRAINER_*`` variable still wins field by field.
Unset, the trainer keeps :class:`TrainerConfig`'s own defaults (stream batching: what ``make
up`` and the integration tests run; ``default``'s barrier batching waits for a driver's ``POST
/admin/train``).

Example::

    from spanrl.core.recipes import recipe_env, recipe_values

    recipe_values("qwen05b-lora")["lr"]          # 5e-05 (the default's 1e-05 overridden)
    recipe_env("qwen05b-lora", over="default")   # {"SPANRL_TRAINER_LORA_RANK": "16",
                                                 #  "SPANRL_TRAINER_LR": "5e-5"}
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: a recipe value: what the environment would carry
Scalar = str | int | float | bool


@dataclass(frozen=True)
class Measured:
    """One recipe value and its source: the study, run or benchmark that chose it."""

    value: Scalar
    source: str


@dataclass(frozen=True)
class Recipe:
    """Named trainer settings: ``fields`` (TrainerConfig field -> :class:`Measured`) over the
    recipe ``based_on`` (None: over TrainerConfig's defaults).

    Example: ``get_recipe("qwen05b-lora").fields["lora_rank"].value == 16``, its ``source`` the
    study that measured it; ``get_recipe("qwen05b-lora").based_on == "default"``."""

    name: str
    doc: str
    fields: Mapping[str, Measured] = field(default_factory=dict)
    based_on: str | None = None


_STUDY_11 = ("study 11 (docs/measured/learning.md, three seeds, 2026-12-05): in each of three seeds held-out greedy and "
             "sampled correctness rose (greedy +0.190, +0.090, +0.210) and iteration 0's rewarded completions "
             "ended more likely under the final policy")

DEFAULT = Recipe(
    name="default",
    doc="The measured recipe: learns in 3 of 3 seeds (study 11); make demo's and spanrl study's trainer.",
    fields={
        "lr": Measured(1e-5, f"{_STUDY_11}; lr 5e-5 x 2 steps (study 3) learned as much but made those completions "
                             "less likely"),
        "loss_agg": Measured("token_mean", "study 3 (docs/measured/learning.md), kept by study 11"),
        "batching": Measured("barrier", "one update per iteration on exactly that iteration's samples (POST "
                                        "/admin/train): a run's batches do not depend on timing, so a run seed "
                                        "repeats the run (spanrl study --repeat)"),
        "mini_batches": Measured(8, f"{_STUDY_11}: 8 optimizer steps per update, mini-batches in content order"),
        "self_imitation_updates": Measured(3, f"{_STUDY_11}: the rewarded samples of the last 3 updates trained "
                                              "again (Self-Imitation Learning, Oh et al. 2018)"),
        "self_imitation_weight": Measured(4, f"{_STUDY_11}: their advantage x 4"),
        "kl_coef": Measured(0.2, f"{_STUDY_11}: k3 KL to the base weights (DeepSeekMath's GRPO estimator)"),
        "advantage_std_scale": Measured(False, "Dr. GRPO, R - group mean (docs/measured/learning.md): a format-only group [0.1 x5, "
                                               "0] gets +0.017 / -0.083 instead of GRPO's +0.447 / -2.236"),
        "drop_zero_variance": Measured(True, "DAPO's filter (docs/measured/learning.md): groups of one return give no gradient "
                                             "but cost a forward/backward, 12-36 of ~75 samples per update in study 3"),
    },
)

QWEN05B_LORA = Recipe(
    name="qwen05b-lora",
    doc="qwen2.5-coder-0.5b with LoRA: the SQL and math agents' 0.5B demo (issue 19).",
    based_on="default",
    fields={
        "lora_rank": Measured(16, "the 0.5B agents (docs/measured/learning.md, the SQL agent with qwen2.5-coder-0.5b): held-out greedy "
                                  "execution accuracy 0.455 -> 0.520, +0.065 [+0.025, +0.105], and with "
                                  "SPANRL_SEED=1 +0.040 [+0.005, +0.075]"),
        "lr": Measured(5e-5, "the 0.5B agents (docs/measured/learning.md): LoRA r16 at lr 5e-5, the 0.5B demos of the SQL, math and RAG "
                             "agents"),
    },
)

QWEN05B_LORA_TREE = Recipe(
    name="qwen05b-lora-tree",
    doc="qwen05b-lora with each micro-batch packed as a prefix tree: the RAG agent's 0.5B demo.",
    based_on="qwen05b-lora",
    fields={
        "tree_packing": Measured(True, "trainer/tree_pack.py (AReaL's tree training): the same log-probs and "
                                       "gradients to 1e-5; one RAG update of 24 recorded samples in 0.544x the "
                                       "time (docs/measured/benchmarks.md); the RAG 0.5B demo's seeds 1 and 2 ran packed"),
    },
)

#: every recipe by name
RECIPES: dict[str, Recipe] = {r.name: r for r in (DEFAULT, QWEN05B_LORA, QWEN05B_LORA_TREE)}


def get_recipe(name: str) -> Recipe:
    """The recipe ``name``; ValueError naming the known ones.

    Example: ``get_recipe("default").fields["batching"].value == "barrier"``."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known: {', '.join(RECIPES)}")
    return RECIPES[name]


def lineage(name: str, over: str | None = None) -> list[Recipe]:
    """``name``'s recipe and those it is based on, the furthest first, stopping before ``over``."""
    chain: list[Recipe] = []
    current: str | None = name
    while current is not None and current != over:
        recipe = get_recipe(current)
        chain.insert(0, recipe)
        current = recipe.based_on
    return chain


def recipe_measured(name: str, over: str | None = None) -> dict[str, Measured]:
    """Field -> :class:`Measured` of recipe ``name`` with its bases (a recipe's own value wins
    over its base's); with ``over``, only what ``name`` adds to recipe ``over``."""
    out: dict[str, Measured] = {}
    for recipe in lineage(name, over):
        out.update(recipe.fields)
    return out


def recipe_values(name: str, over: str | None = None) -> dict[str, Scalar]:
    """Field -> value of recipe ``name`` (:func:`recipe_measured` without the sources)."""
    return {k: m.value for k, m in recipe_measured(name, over).items()}


def env_text(value: Scalar) -> str:
    """``value`` as the environment writes it: ``true``/``false``, ``1e-5`` (not ``1e-05``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value).replace("e-0", "e-").replace("e+0", "e+")
    return str(value)


def recipe_env(name: str, over: str | None = None) -> dict[str, str]:
    """The ``SPANRL_TRAINER_*`` variables of recipe ``name`` (with ``over``: only what it adds
    to that recipe), checked against TrainerConfig's fields.

    Example: ``recipe_env("qwen05b-lora-tree", over="qwen05b-lora")`` is
    ``{"SPANRL_TRAINER_TREE_PACKING": "true"}``; a child process's environment with
    ``recipe_env("default")`` trains with the measured recipe."""
    from spanrl.core.settings import TrainerConfig

    return TrainerConfig.env(**{k: env_text(v) for k, v in recipe_values(name, over).items()})


def describe(name: str) -> list[dict[str, Any]]:
    """One row per field of recipe ``name``: ``{"field", "value", "source", "recipe"}`` (the
    recipe that sets it), for reports and documentation."""
    rows: dict[str, dict[str, Any]] = {}
    for recipe in lineage(name):
        for k, m in recipe.fields.items():
            rows[k] = {"field": k, "value": m.value, "source": m.source, "recipe": recipe.name}
    return list(rows.values())


def markdown(name: str) -> str:
    """Recipe ``name`` as a markdown table: each field, its value, the recipe that sets it and
    its source (``python -m spanrl.core.recipes NAME``; the reference of where a value comes from)."""
    lines = [f"**{name}**: {get_recipe(name).doc}", "", "| setting | value | recipe | source |", "|---|---|---|---|"]
    for row in describe(name):
        variable = f"SPANRL_TRAINER_{row['field'].upper()}"
        source = row["source"].replace("|", "\\|")
        lines.append(f"| `{variable}` | `{env_text(row['value'])}` | {row['recipe']} | {source} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="spanrl's trainer recipes, each value with its source.")
    p.add_argument("names", nargs="*", help=f"recipes to print (default: all; known: {', '.join(RECIPES)})")
    for name in p.parse_args(argv).names or RECIPES:
        print(markdown(name))


if __name__ == "__main__":
    main()
