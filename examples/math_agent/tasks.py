"""Deterministic GSM-Symbolic tasks from reasoning-gym (procedural, no network).

``reasoning_gym.create_dataset("gsm_symbolic", seed=S, size=N)`` generates item
``idx`` from ``Random(S + idx)`` with a generator chosen by ``Random(S)``, so the same
(seed, size) always yields the same questions and answers, fully offline.
"""

from __future__ import annotations

import functools

from typing import Any

DATASET = "gsm_symbolic"
# reasoning-gym appends this to every question; we keep it (it tells the model to
# give a bare number) but expose the stripped question too.
_RG_SUFFIX = " Give the result as your final answer. Do not include units."


def task_id(seed: int, idx: int) -> str:
    return f"{DATASET}-{seed}-{idx}"


def load_tasks(seed: int = 0, size: int = 100) -> list[dict[str, Any]]:
    """Return ``size`` JSON-serialisable task dicts for ``seed``.

    Each dict: ``task_id`` (stable, ``gsm_symbolic-{seed}-{idx}``), ``question``
    (as reasoning-gym words it), ``answer`` (string, e.g. ``"70"``) and ``metadata``
    (dataset, seed, index, the reference chain of thought).
    """
    import reasoning_gym  # imported lazily: heavy, and only needed to build tasks

    if size <= 0:
        raise ValueError("size must be positive")
    ds = reasoning_gym.create_dataset(DATASET, seed=seed, size=size)
    tasks: list[dict[str, Any]] = []
    for idx in range(size):
        entry = ds[idx]
        md = entry.get("metadata", {})
        tasks.append(
            {
                "task_id": task_id(seed, idx),
                "question": str(entry["question"]),
                "answer": str(entry["answer"]).strip(),
                "metadata": {
                    "source_dataset": DATASET,
                    "seed": seed,
                    "source_index": idx,
                    "answer_cot": str(md.get("answer_cot", "")),
                },
            }
        )
    return tasks


def short_question(task: dict[str, Any]) -> str:
    """The question without reasoning-gym's boiler-plate suffix (saves context)."""
    q = task["question"]
    return q[: -len(_RG_SUFFIX)] if q.endswith(_RG_SUFFIX) else q


# ---- arithmetic word problems (the main job's default task set) ------------------------
#
# One- and two-step word problems whose numbers are too large to work out in one's head
# (two- and three-digit operands), so the calculator is what gets them right: the
# behaviour the paper's Calc-X agent learns (arXiv 2508.03680 s4.3) at a size a 135M model
# can reach. Item ``idx`` of ``seed`` is built from ``random.Random(f"arith-{seed}-{idx}")``
# (string seeds hash with SHA-512: the same on every machine and Python version).

ARITH = "arith_word"
#: the split the main job and ``spanrl eval`` use: training tasks come from TRAIN_SEED,
#: held-out tasks from HELDOUT_SEED; ``disjoint`` checks no question is in both
TRAIN_SEED = 0
HELDOUT_SEED = 1000

_NAMES = ["Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jon", "Kira", "Liam",
          "Mei", "Noah", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq"]
#: (container, its plural, what it holds)
_ITEMS = [("box", "boxes", "pencils"), ("crate", "crates", "bottles"), ("bag", "bags", "marbles"),
          ("shelf", "shelves", "books"), ("tray", "trays", "cupcakes"), ("carton", "cartons", "eggs"),
          ("basket", "baskets", "apples"), ("pack", "packs", "cards")]


#: the problem kinds, in the order ``arith_word_balanced`` cycles through them
KINDS = ("mul", "add", "sub", "div", "mul_sub", "mul_add")


def _arith_item(rng, kind: str | None = None) -> tuple[str, int, str, str]:
    """(question, answer, expression, kind) of one generated problem (``kind``: that kind,
    else one drawn from ``rng``)."""
    name = rng.choice(_NAMES)
    box, boxes, things = rng.choice(_ITEMS)
    drawn = rng.choice(list(KINDS))
    kind = kind or drawn
    if kind == "mul":
        a, b = rng.randint(12, 99), rng.randint(12, 99)
        q = f"A {box} holds {a} {things}. How many {things} are in {b} {boxes}?"
        return q, a * b, f"{a}*{b}", kind
    if kind == "add":
        a, b = rng.randint(120, 999), rng.randint(120, 999)
        q = f"{name} had {a} {things} and got {b} more. How many {things} does {name} have now?"
        return q, a + b, f"{a}+{b}", kind
    if kind == "sub":
        a = rng.randint(500, 999)
        b = rng.randint(101, a - 50)
        q = f"{name} had {a} {things} and gave away {b}. How many {things} are left?"
        return q, a - b, f"{a}-{b}", kind
    if kind == "div":
        b, ans = rng.randint(12, 40), rng.randint(12, 60)
        a = b * ans
        q = f"{a} {things} are shared equally among {b} {boxes}. How many {things} go in each {box}?"
        return q, ans, f"{a}/{b}", kind
    a, b, c = rng.randint(12, 60), rng.randint(12, 60), rng.randint(10, 99)
    if kind == "mul_sub":
        q = f"{name} has {a} {boxes} of {b} {things} and gives away {c} {things}. How many {things} are left?"
        return q, a * b - c, f"{a}*{b}-{c}", kind
    q = f"{name} has {a} {boxes} of {b} {things} and finds {c} more {things}. How many {things} are there now?"
    return q, a * b + c, f"{a}*{b}+{c}", kind


def load_arith_tasks(seed: int = TRAIN_SEED, size: int = 100) -> list[dict[str, Any]]:
    """``size`` arithmetic word problems for ``seed`` (task dicts as :func:`load_tasks`).

    ``task_id`` is ``arith_word-{seed}-{idx}``; ``answer`` a whole number as a string;
    ``metadata`` has ``expression`` (what a calculator call would compute) and ``kind``
    (mul, add, sub, div, mul_sub, mul_add). Deterministic and offline; a larger ``size``
    extends the list. Raises ValueError for ``size <= 0``.
    """
    import random

    if size <= 0:
        raise ValueError("size must be positive")
    tasks = []
    for idx in range(size):
        question, answer, expression, kind = _arith_item(random.Random(f"arith-{seed}-{idx}"))
        tasks.append({"task_id": f"{ARITH}-{seed}-{idx}", "question": question, "answer": str(answer),
                      "metadata": {"source_dataset": ARITH, "seed": seed, "source_index": idx,
                                   "expression": expression, "kind": kind}})
    return tasks


ARITH_BALANCED = "arith_word_balanced"
#: balanced over the one-step kinds the base policy ever solves when sampling (``mul``, ``add``,
#: ``sub``: docs/measured/learning-archive.md, run A's per-kind table); ``div`` and the two-step kinds are never
#: solved in training rollouts, so their groups carry no correctness signal
ARITH_ONE_STEP = "arith_word_mul_add_sub"
#: each balanced set: (the prefix of its per-item generator seeds, the kinds it cycles through in order)
BALANCED_SETS = {ARITH_BALANCED: ("arith-balanced", KINDS), ARITH_ONE_STEP: (ARITH_ONE_STEP, ("mul", "add", "sub"))}


def load_balanced_tasks(name: str, seed: int = TRAIN_SEED, size: int = 100) -> list[dict[str, Any]]:
    """Tasks of the balanced set ``name`` (a key of :data:`BALANCED_SETS`): like
    :func:`load_arith_tasks`, but item ``idx`` is of kind ``kinds[idx % len(kinds)]``, so the kind
    mix of one main-job iteration (6 consecutive items) does not drift from iteration to
    iteration. ``task_id`` ``{name}-{seed}-{idx}``; numbers from their own generator (``disjoint``
    checks questions against other sets). KeyError for another name, ValueError for ``size <= 0``."""
    import random

    prefix, kinds = BALANCED_SETS[name]
    if size <= 0:
        raise ValueError("size must be positive")
    tasks = []
    for idx in range(size):
        question, answer, expression, kind = _arith_item(random.Random(f"{prefix}-{seed}-{idx}"),
                                                         kinds[idx % len(kinds)])
        tasks.append({"task_id": f"{name}-{seed}-{idx}", "question": question, "answer": str(answer),
                      "metadata": {"source_dataset": name, "seed": seed, "source_index": idx,
                                   "expression": expression, "kind": kind}})
    return tasks


TASK_SETS = {ARITH: load_arith_tasks, DATASET: load_tasks,
             **{name: functools.partial(load_balanced_tasks, name) for name in BALANCED_SETS}}


def load_task_set(name: str, seed: int, size: int) -> list[dict[str, Any]]:
    """Tasks of the named set (a key of ``TASK_SETS``);
    ValueError for another name."""
    if name not in TASK_SETS:
        raise ValueError(f"unknown task set {name!r}; known: {', '.join(TASK_SETS)}")
    return TASK_SETS[name](seed=seed, size=size)


def disjoint(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """True when no question (text) of ``a`` is also a question of ``b``."""
    return not ({t["question"] for t in a} & {t["question"] for t in b})
