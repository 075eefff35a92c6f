"""Deterministic GSM-Symbolic tasks from reasoning-gym (procedural, no network).

``reasoning_gym.create_dataset("gsm_symbolic", seed=S, size=N)`` generates item
``idx`` from ``Random(S + idx)`` with a generator chosen by ``Random(S)``, so the same
(seed, size) always yields the same questions and answers, fully offline.
"""

from __future__ import annotations

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
