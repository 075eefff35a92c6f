"""Trainer recipes as data: named sets of trainer settings, each value with where it was measured.

A recipe names :class:`~spanrl.core.settings.TrainerConfig` fields and their values, over the
recipe it is ``based_on`` (TRL's and nanoGPT's configs as plain data). ``default`` is the
setting measured in docs/measured/learning.md (study 11 in three seeds, 2026-12-05) and *is*
TrainerConfig's defaults: those fields' declared defaults are read from :data:`DEFAULT` (one
place), so ``make up``, a runner and a production agent train with it; ``spanrl train`` (and
``make demo``) too, its main job asking for one update per iteration (barrier batching). The
0.5B LoRA recipes are the SQL, math and RAG agents' demos with qwen2.5-coder-0.5b (issue 19);
``plain`` turns every learning option off (the suite's plumbing tests).

Selecting one: ``SPANRL_RECIPE=name`` (or ``spanrl train --recipe name``) makes its values the
trainer's, below the environment: a ``SPANRL_TRAINER_*`` variable still wins field by field.

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
        "batching": Measured("groups", "the driverless form of study 11's per-iteration barrier: an update is cut "
                                       "at a count of complete GRPO groups, each group's samples in one update, from "
                                       "the samples and their order alone, no clock and no driver (trainer/batching.py "
                                       "`group_cut`), so a runner or a production agent gets it; the main job, which "
                                       "drives its iterations, still asks for each update (barrier)"),
        "update_groups": Measured(6, "the math demo's tasks per iteration in study 11: an update holds what one of "
                                     "its iterations held"),
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

_BEFORE = ("the trainer's settings before the learning work (docs/measured/learning-archive.md, runs 3-7: greedy "
           "held-out correctness fell in 6 of 7 runs under them)")

PLAIN = Recipe(
    name="plain",
    doc="Every learning option off (GRPO with std scaling, one optimizer step an update, stream batching): not "
        "a recipe that learns; the suite's own trainers run it to test plumbing with the fewest moving parts.",
    fields={
        "lr": Measured(1e-5, _BEFORE),
        "loss_agg": Measured("token_mean", _BEFORE),
        "batching": Measured("stream", f"{_BEFORE}: an update at min_batch samples or after idle_flush_s"),
        "mini_batches": Measured(1, _BEFORE),
        "self_imitation_updates": Measured(0, _BEFORE),
        "self_imitation_weight": Measured(1.0, _BEFORE),
        "kl_coef": Measured(0.0, f"{_BEFORE}: no reference model loaded"),
        "advantage_std_scale": Measured(True, _BEFORE),
        "drop_zero_variance": Measured(False, _BEFORE),
    },
)

#: every recipe by name
RECIPES: dict[str, Recipe] = {r.name: r for r in (DEFAULT, QWEN05B_LORA, QWEN05B_LORA_TREE, PLAIN)}


def get_recipe(name: str) -> Recipe:
    """The recipe ``name``; ValueError naming the known ones.

    Example: ``get_recipe("default").fields["batching"].value == "groups"``."""
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


def recipe_fields() -> list[str]:
    """Every TrainerConfig field some recipe sets, sorted: what a trainer reports of its recipe."""
    return sorted({k for recipe in RECIPES.values() for k in recipe.fields})


def differences(values: Mapping[str, Any], name: str) -> dict[str, dict[str, Any]]:
    """The fields of recipe ``name`` (with its bases) whose value in ``values`` is another:
    ``{field: {"recipe": its value, "actual": the value in values}}``; a field ``values`` lacks
    counts as different (``actual`` None).

    Example: ``differences({**recipe_values("default"), "batching": "barrier"}, "default")`` is
    ``{"batching": {"recipe": "groups", "actual": "barrier"}}``."""
    return {k: {"recipe": v, "actual": values.get(k)} for k, v in recipe_values(name).items() if values.get(k) != v}


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
