"""Two-hop (bridge) questions over the corpus of :mod:`corpus`, with gold answers.

Every question names an entity (a city) whose passage names a *bridge* entity (its
country); the answer is in the bridge's passage. E.g. "What currency is used in the
country where Guadalajara is?": ``city:4005539`` ("Guadalajara is a city in Mexico")
→ ``country:MX`` ("... Its currency is the Mexican Peso (MXN)"). Templates:

==========================  ===========================================================
``city_currency``           What currency is used in the country where {city} is?
``city_capital``            What is the capital of the country where {city} is?
``city_language``           Name a language spoken in the country where {city} is.
``city_continent``          On which continent is the country where {city} is?
``city_country_capital``    In which country is {city}, and what is that country's capital?
``capital_currency``        What is the currency of the country whose capital is {capital}?
``capital_language``        Name a language spoken in the country whose capital is {capital}.
==========================  ===========================================================

``answers`` are the gold aliases (the reward takes the best F1 over them): for a
currency its ISO name, geonames' short name and code ("Mexican Peso", "Peso", "MXN");
for a language any of the country's listed languages (at most three); the compound
template has one answer "Mexico, Mexico City". ``support`` is ``[hop-1 passage id,
hop-2 passage id]``.

Only unambiguous entities are asked about: the city's name is the title of no other
passage, does not contain its country's name (no "Kuwait City"), and at most
:data:`CITIES_PER_COUNTRY` (the most populous) cities of a country are used, so a few
large countries do not dominate.

Split by bridge country: a country is held out when ``sha256("rag-split-<ISO2>")`` is
0 mod :data:`HELDOUT_MOD` (about a fifth of the countries); ``train`` and ``heldout``
share no country, so no passage that answers a held-out question is a training answer
passage. ``load_tasks(split, seed, size)`` shuffles the split's pool with
``random.Random(f"rag-{split}-{seed}")`` and takes the first ``size`` (a larger size
extends the list). Task ids are stable: ``rag-<template>-<entity passage id>``.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections import Counter
from typing import Any

from . import corpus
from .corpus import fold

#: the split the main job and ``spanrl eval`` use (seeds only order the split's pool)
TRAIN_SEED = 0
HELDOUT_SEED = 1000
SPLITS = ("train", "heldout")
HELDOUT_MOD = 5
CITIES_PER_COUNTRY = 6

CITY_TEMPLATES = {
    "city_currency": "What currency is used in the country where {entity} is?",
    "city_capital": "What is the capital of the country where {entity} is?",
    "city_language": "Name a language spoken in the country where {entity} is.",
    "city_continent": "On which continent is the country where {entity} is?",
    "city_country_capital": "In which country is {entity}, and what is that country's capital?",
}
CAPITAL_TEMPLATES = {
    "capital_currency": "What is the currency of the country whose capital is {entity}?",
    "capital_language": "Name a language spoken in the country whose capital is {entity}.",
}


def split_of(iso2: str) -> str:
    """``"heldout"`` or ``"train"`` for a bridge country (stable hash of its ISO code)."""
    h = int(hashlib.sha256(f"rag-split-{iso2}".encode()).hexdigest(), 16)
    return "heldout" if h % HELDOUT_MOD == 0 else "train"


def _dedupe(items: list[str]) -> list[str]:
    out: list[str] = []
    for s in items:
        if s and s.lower() not in {o.lower() for o in out}:
            out.append(s)
    return out


def _answers(template: str, c: dict[str, Any]) -> list[str]:
    kind = template.split("_", 1)[1]
    if kind == "currency":
        return _dedupe([c["currency"], c["currency_short"], c["currency_code"]])
    if kind == "capital":
        return [c["capital"]]
    if kind == "language":
        return list(c["languages"])
    if kind == "continent":
        return [c["continent"]]
    if kind == "country_capital":
        return [f"{c['name']}, {c['capital']}"]
    raise ValueError(template)


def _task(template: str, question: str, entity: dict[str, Any], c: dict[str, Any]) -> dict[str, Any]:
    return {
        "task_id": f"rag-{template}-{entity['id']}",
        "question": question.format(entity=entity["title"]),
        "answers": _answers(template, c),
        "support": [entity["id"], f"country:{c['iso2']}"],
        "metadata": {"template": template, "entity": entity["title"], "bridge": c["name"],
                     "country": c["iso2"], "split": split_of(c["iso2"])},
    }


@functools.lru_cache(maxsize=1)
def all_tasks() -> tuple[dict[str, Any], ...]:
    """Every question of both splits, ordered by task id."""
    facts = corpus.countries()
    titles = Counter(fold(p["title"]).lower() for p in corpus.passages())
    cities = [p for p in corpus.passages() if p["kind"] == "city"
              and titles[fold(p["title"]).lower()] == 1
              and fold(facts[p["country"]]["name"]).lower() not in fold(p["title"]).lower()]
    out = []
    per_country: Counter[str] = Counter()
    for city in sorted((p for p in cities if not p["capital"]), key=lambda p: (-p["population"], p["id"])):
        if per_country[city["country"]] >= CITIES_PER_COUNTRY:
            continue
        per_country[city["country"]] += 1
        out += [_task(t, q, city, facts[city["country"]]) for t, q in CITY_TEMPLATES.items()]
    for city in (p for p in cities if p["capital"]):
        out += [_task(t, q, city, facts[city["country"]]) for t, q in CAPITAL_TEMPLATES.items()]
    return tuple(sorted(out, key=lambda t: t["task_id"]))


def load_tasks(split: str = "train", seed: int = TRAIN_SEED, size: int = 100) -> list[dict[str, Any]]:
    """``size`` JSON-serialisable tasks of ``split`` (``"train"`` or ``"heldout"``) in the
    order ``seed`` gives; ``{"task_id", "question", "answers", "support", "metadata"}``.

    Deterministic and offline. ValueError for an unknown split, ``size <= 0`` or a
    ``size`` larger than the split's pool (see :func:`pool_sizes`).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    if size <= 0:
        raise ValueError("size must be positive")
    pool = [t for t in all_tasks() if t["metadata"]["split"] == split]
    if size > len(pool):
        raise ValueError(f"split {split!r} has {len(pool)} tasks, asked for {size}")
    random.Random(f"rag-{split}-{seed}").shuffle(pool)
    return [dict(t, answers=list(t["answers"]), support=list(t["support"]), metadata=dict(t["metadata"]))
            for t in pool[:size]]


def pool_sizes() -> dict[str, int]:
    """How many tasks each split has."""
    return dict(Counter(t["metadata"]["split"] for t in all_tasks()))


def disjoint(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """True when ``a`` and ``b`` share no question text and no bridge country."""
    questions = {t["question"] for t in a} & {t["question"] for t in b}
    bridges = {t["metadata"]["country"] for t in a} & {t["metadata"]["country"] for t in b}
    return not questions and not bridges
