"""Text-to-SQL tasks: question + gold SQL pairs generated from templates over two databases.

Split by database, as Spider splits (Yu et al. 2018: a model is tested on databases it
never saw): **train** questions are about ``chinook`` (a music store), **held-out**
questions about ``world`` (countries, cities, currencies, languages), so held-out success
needs schema reading, not memorised table names.

Each template is a question pattern, a gold SQL pattern and a *slot query* that lists the
values to fill in, read from the database itself (so every gold query has an answer).
A template takes at most :data:`PER_TEMPLATE` slot values, chosen by
``random.Random(f"{db}:{template}")``; a filled task is kept only when its gold query
returns 1..:data:`MAX_GOLD_ROWS` rows and not only NULLs/zeros (a gold query that fails
raises: the pool never depends on the machine's speed). Values with an apostrophe
are skipped (the question quotes them as ``'…'``). Templates are ``easy`` (one table: a
filter, a count, a sum) or ``hard`` (a join, GROUP BY, ORDER BY … LIMIT 1).

``load_tasks(split, seed, size)`` shuffles the split's pool with
``random.Random(f"sql-{split}-{seed}")`` and returns the first ``size`` tasks (a larger
``size`` extends the same list). Task dicts are JSON-serialisable::

    {"task_id": "sql-chinook-tracks_in_genre-3", "db": "chinook", "question": "...",
     "gold_sql": "SELECT ...", "ordered": false, "tables": ["Genre", "Track"],
     "level": "hard", "template": "tracks_in_genre"}
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from sqlglot import exp

from . import db as dbs
from .reward import orders, parse_select

TRAIN_SEED = 0
HELDOUT_SEED = 1000
SPLITS = {"train": ("chinook",), "heldout": ("world",)}
PER_TEMPLATE = 20
MAX_GOLD_ROWS = 60


@dataclass(frozen=True)
class Template:
    name: str
    level: str          # easy | hard
    slots: str | tuple  # SQL listing the slot values (one tuple per task), or the values themselves
    question: str       # str.format pattern over the slot tuple ({0}, {1} …)
    gold: str


_COUNT_RANGE = "GROUP BY {key} HAVING COUNT(*) BETWEEN {lo} AND {hi} ORDER BY 1"

CHINOOK_TEMPLATES = [
    # -- easy: one table
    Template("customers_in_country", "easy", "SELECT DISTINCT Country FROM Customer ORDER BY 1",
             "How many customers live in the country '{0}'?",
             "SELECT COUNT(*) FROM Customer WHERE Country = '{0}'"),
    Template("customers_in_city", "easy", "SELECT DISTINCT City FROM Customer ORDER BY 1",
             "List the first and last names of the customers in the city '{0}'.",
             "SELECT FirstName, LastName FROM Customer WHERE City = '{0}'"),
    Template("invoices_in_country", "easy", "SELECT DISTINCT BillingCountry FROM Invoice ORDER BY 1",
             "How many invoices have the billing country '{0}'?",
             "SELECT COUNT(*) FROM Invoice WHERE BillingCountry = '{0}'"),
    Template("invoice_total_city", "easy", "SELECT DISTINCT BillingCity FROM Invoice ORDER BY 1",
             "What is the sum of the totals of the invoices billed to the city '{0}'?",
             "SELECT SUM(Total) FROM Invoice WHERE BillingCity = '{0}'"),
    Template("tracks_by_composer", "easy",
             "SELECT Composer FROM Track WHERE Composer IS NOT NULL "
             + _COUNT_RANGE.format(key="Composer", lo=2, hi=12),
             "List the names of the tracks composed by '{0}'.",
             "SELECT Name FROM Track WHERE Composer = '{0}'"),
    Template("tracks_longer_than", "easy", tuple((ms,) for ms in range(100_000, 1_000_001, 50_000)),
             "How many tracks are longer than {0} milliseconds?",
             "SELECT COUNT(*) FROM Track WHERE Milliseconds > {0}"),
    Template("albums_of_artist_id", "easy", "SELECT DISTINCT ArtistId FROM Album ORDER BY 1",
             "How many albums does the artist with ArtistId {0} have?",
             "SELECT COUNT(*) FROM Album WHERE ArtistId = {0}"),
    Template("album_title", "easy", "SELECT AlbumId FROM Album ORDER BY 1",
             "What is the title of the album with AlbumId {0}?",
             "SELECT Title FROM Album WHERE AlbumId = {0}"),
    Template("customer_email", "easy", "SELECT FirstName, LastName FROM Customer ORDER BY CustomerId",
             "What is the email of the customer named {0} {1}?",
             "SELECT Email FROM Customer WHERE FirstName = '{0}' AND LastName = '{1}'"),
    Template("employees_with_title", "easy", "SELECT DISTINCT Title FROM Employee ORDER BY 1",
             "What are the last names of the employees with the title '{0}'?",
             "SELECT LastName FROM Employee WHERE Title = '{0}'"),
    # -- hard: joins, GROUP BY, ORDER BY … LIMIT
    Template("tracks_in_genre", "hard", "SELECT Name FROM Genre ORDER BY 1",
             "How many tracks belong to the genre '{0}'?",
             "SELECT COUNT(*) FROM Track JOIN Genre ON Track.GenreId = Genre.GenreId WHERE Genre.Name = '{0}'"),
    Template("albums_by_artist", "hard",
             "SELECT Artist.Name FROM Artist JOIN Album ON Album.ArtistId = Artist.ArtistId "
             + _COUNT_RANGE.format(key="Artist.Name", lo=1, hi=10),
             "List the titles of the albums by the artist '{0}'.",
             "SELECT Album.Title FROM Album JOIN Artist ON Album.ArtistId = Artist.ArtistId "
             "WHERE Artist.Name = '{0}'"),
    Template("tracks_of_artist", "hard",
             "SELECT Artist.Name FROM Artist JOIN Album ON Album.ArtistId = Artist.ArtistId GROUP BY Artist.Name "
             "ORDER BY 1",
             "How many tracks does the artist '{0}' have?",
             "SELECT COUNT(*) FROM Track JOIN Album ON Track.AlbumId = Album.AlbumId "
             "JOIN Artist ON Album.ArtistId = Artist.ArtistId WHERE Artist.Name = '{0}'"),
    Template("tracks_per_album_of_artist", "hard",
             "SELECT Artist.Name FROM Artist JOIN Album ON Album.ArtistId = Artist.ArtistId "
             + _COUNT_RANGE.format(key="Artist.Name", lo=2, hi=10),
             "For each album by the artist '{0}', give the album title and its number of tracks.",
             "SELECT Album.Title, COUNT(*) FROM Album JOIN Artist ON Album.ArtistId = Artist.ArtistId "
             "JOIN Track ON Track.AlbumId = Album.AlbumId WHERE Artist.Name = '{0}' GROUP BY Album.AlbumId"),
    Template("customer_spent", "hard", "SELECT FirstName, LastName FROM Customer ORDER BY CustomerId",
             "What is the total amount spent by the customer {0} {1}?",
             "SELECT SUM(Invoice.Total) FROM Invoice JOIN Customer ON Invoice.CustomerId = Customer.CustomerId "
             "WHERE Customer.FirstName = '{0}' AND Customer.LastName = '{1}'"),
    Template("customers_of_rep", "hard",
             "SELECT DISTINCT e.FirstName, e.LastName FROM Employee e JOIN Customer c ON c.SupportRepId = e.EmployeeId "
             "ORDER BY 1, 2",
             "How many customers does the employee {0} {1} support?",
             "SELECT COUNT(*) FROM Customer JOIN Employee ON Customer.SupportRepId = Employee.EmployeeId "
             "WHERE Employee.FirstName = '{0}' AND Employee.LastName = '{1}'"),
    Template("invoices_per_country_in_year", "hard",
             "SELECT DISTINCT substr(InvoiceDate, 1, 4) FROM Invoice ORDER BY 1",
             "For each billing country, how many invoices were issued in the year {0}?",
             "SELECT BillingCountry, COUNT(*) FROM Invoice WHERE InvoiceDate LIKE '{0}%' GROUP BY BillingCountry"),
    Template("tracks_in_playlist", "hard", "SELECT DISTINCT Name FROM Playlist ORDER BY 1",
             "How many tracks are in the playlist '{0}'?",
             "SELECT COUNT(*) FROM PlaylistTrack JOIN Playlist ON PlaylistTrack.PlaylistId = Playlist.PlaylistId "
             "WHERE Playlist.Name = '{0}'"),
    Template("longest_track_of_album", "hard",
             "WITH m AS (SELECT a.Title, MAX(t.Milliseconds) AS top FROM Album a JOIN Track t ON t.AlbumId = a.AlbumId "
             "GROUP BY a.Title) SELECT a.Title FROM Album a JOIN Track t ON t.AlbumId = a.AlbumId "
             "JOIN m ON m.Title = a.Title GROUP BY a.Title HAVING COUNT(*) >= 3 AND SUM(t.Milliseconds = m.top) = 1 "
             "ORDER BY 1",
             "What is the name of the longest track on the album '{0}'?",
             "SELECT Track.Name FROM Track JOIN Album ON Track.AlbumId = Album.AlbumId WHERE Album.Title = '{0}' "
             "ORDER BY Track.Milliseconds DESC LIMIT 1"),
    Template("genres_per_media_type", "hard", "SELECT Name FROM MediaType ORDER BY 1",
             "For each genre, how many tracks have the media type '{0}'?",
             "SELECT Genre.Name, COUNT(*) FROM Track JOIN Genre ON Track.GenreId = Genre.GenreId "
             "JOIN MediaType ON Track.MediaTypeId = MediaType.MediaTypeId WHERE MediaType.Name = '{0}' "
             "GROUP BY Genre.Name"),
]

WORLD_TEMPLATES = [
    # -- easy: one table
    Template("capital", "easy", "SELECT Name FROM Country WHERE Capital IS NOT NULL ORDER BY 1",
             "What is the capital of the country '{0}'?",
             "SELECT Capital FROM Country WHERE Name = '{0}'"),
    Template("country_population", "easy", "SELECT Name FROM Country WHERE Population > 0 ORDER BY 1",
             "What is the population of the country '{0}'?",
             "SELECT Population FROM Country WHERE Name = '{0}'"),
    Template("country_currency_code", "easy", "SELECT Name FROM Country WHERE CurrencyCode IS NOT NULL ORDER BY 1",
             "Which currency code does the country '{0}' use?",
             "SELECT CurrencyCode FROM Country WHERE Name = '{0}'"),
    Template("country_area", "easy", "SELECT Name FROM Country WHERE AreaKm2 > 0 ORDER BY 1",
             "What is the area in square kilometres of the country '{0}'?",
             "SELECT AreaKm2 FROM Country WHERE Name = '{0}'"),
    Template("countries_population_over", "easy",
             tuple((n,) for n in (1_000_000, 2_000_000, 5_000_000, 10_000_000, 20_000_000, 30_000_000,
                                  50_000_000, 100_000_000, 200_000_000)),
             "How many countries have a population greater than {0}?",
             "SELECT COUNT(*) FROM Country WHERE Population > {0}"),
    Template("countries_with_continent_code", "easy", "SELECT ContinentCode FROM Continent ORDER BY 1",
             "How many countries have the continent code '{0}'?",
             "SELECT COUNT(*) FROM Country WHERE ContinentCode = '{0}'"),
    Template("currency_name", "easy", "SELECT DISTINCT CurrencyCode FROM Country WHERE CurrencyCode IS NOT NULL "
             "ORDER BY 1",
             "What is the name of the currency with the code '{0}'?",
             "SELECT Name FROM Currency WHERE CurrencyCode = '{0}'"),
    Template("city_population", "easy", "SELECT Name FROM City GROUP BY Name HAVING COUNT(*) = 1 ORDER BY 1",
             "What is the population of the city '{0}'?",
             "SELECT Population FROM City WHERE Name = '{0}'"),
    Template("cities_with_country_code", "easy", "SELECT DISTINCT CountryCode FROM City ORDER BY 1",
             "How many cities have the country code '{0}'?",
             "SELECT COUNT(*) FROM City WHERE CountryCode = '{0}'"),
    Template("language_name", "easy", "SELECT DISTINCT LanguageCode FROM CountryLanguage ORDER BY 1",
             "What is the name of the language with the code '{0}'?",
             "SELECT Name FROM Language WHERE LanguageCode = '{0}'"),
    # -- hard: joins, GROUP BY, ORDER BY … LIMIT
    Template("countries_in_continent", "hard", "SELECT Name FROM Continent ORDER BY 1",
             "How many countries are in the continent '{0}'?",
             "SELECT COUNT(*) FROM Country JOIN Continent ON Country.ContinentCode = Continent.ContinentCode "
             "WHERE Continent.Name = '{0}'"),
    Template("cities_in_country", "hard",
             "SELECT Country.Name FROM Country JOIN City ON City.CountryCode = Country.CountryCode "
             "GROUP BY Country.Name ORDER BY 1",
             "How many cities are there in the country '{0}'?",
             "SELECT COUNT(*) FROM City JOIN Country ON City.CountryCode = Country.CountryCode "
             "WHERE Country.Name = '{0}'"),
    Template("largest_city", "hard",
             "WITH m AS (SELECT CountryCode, MAX(Population) AS top FROM City GROUP BY CountryCode) "
             "SELECT co.Name FROM Country co JOIN City c ON c.CountryCode = co.CountryCode "
             "JOIN m ON m.CountryCode = co.CountryCode GROUP BY co.Name "
             "HAVING COUNT(*) >= 2 AND SUM(c.Population = m.top) = 1 ORDER BY 1",
             "What is the name of the city with the largest population in the country '{0}'?",
             "SELECT City.Name FROM City JOIN Country ON City.CountryCode = Country.CountryCode "
             "WHERE Country.Name = '{0}' ORDER BY City.Population DESC LIMIT 1"),
    Template("languages_of_country", "hard",
             "SELECT co.Name FROM Country co JOIN CountryLanguage cl ON cl.CountryCode = co.CountryCode "
             "GROUP BY co.Name ORDER BY 1",
             "What are the names of the languages spoken in the country '{0}'?",
             "SELECT Language.Name FROM Language "
             "JOIN CountryLanguage ON CountryLanguage.LanguageCode = Language.LanguageCode "
             "JOIN Country ON CountryLanguage.CountryCode = Country.CountryCode WHERE Country.Name = '{0}'"),
    Template("cities_per_country_in_continent", "hard", "SELECT Name FROM Continent ORDER BY 1",
             "For each country in the continent '{0}', give the country name and its number of cities.",
             "SELECT Country.Name, COUNT(*) FROM City JOIN Country ON City.CountryCode = Country.CountryCode "
             "JOIN Continent ON Country.ContinentCode = Continent.ContinentCode WHERE Continent.Name = '{0}' "
             "GROUP BY Country.Name"),
    Template("city_population_of_country", "hard",
             "SELECT Country.Name FROM Country JOIN City ON City.CountryCode = Country.CountryCode "
             "GROUP BY Country.Name ORDER BY 1",
             "What is the total population of the cities in the country '{0}'?",
             "SELECT SUM(City.Population) FROM City JOIN Country ON City.CountryCode = Country.CountryCode "
             "WHERE Country.Name = '{0}'"),
    Template("countries_using_currency", "hard",
             "SELECT Currency.Name FROM Currency JOIN Country ON Country.CurrencyCode = Currency.CurrencyCode "
             + _COUNT_RANGE.format(key="Currency.Name", lo=1, hi=30),
             "Which countries use the currency '{0}'? Give their names.",
             "SELECT Country.Name FROM Country JOIN Currency ON Country.CurrencyCode = Currency.CurrencyCode "
             "WHERE Currency.Name = '{0}'"),
    Template("countries_speaking", "hard",
             "SELECT Language.Name FROM Language JOIN CountryLanguage ON CountryLanguage.LanguageCode = "
             "Language.LanguageCode GROUP BY Language.Name ORDER BY 1",
             "How many countries speak the language '{0}'?",
             "SELECT COUNT(*) FROM CountryLanguage JOIN Language ON CountryLanguage.LanguageCode = "
             "Language.LanguageCode WHERE Language.Name = '{0}'"),
    Template("big_cities_of_country", "hard",
             "SELECT co.Name FROM Country co JOIN City c ON c.CountryCode = co.CountryCode GROUP BY co.Name "
             "HAVING SUM(c.Population > 1000000) BETWEEN 1 AND 20 ORDER BY 1",
             "List the cities in the country '{0}' with a population over 1000000.",
             "SELECT City.Name FROM City JOIN Country ON City.CountryCode = Country.CountryCode "
             "WHERE Country.Name = '{0}' AND City.Population > 1000000"),
    Template("countries_of_continent_over", "hard", "SELECT Name FROM Continent ORDER BY 1",
             "Which countries in the continent '{0}' have a population over 50000000?",
             "SELECT Country.Name FROM Country JOIN Continent ON Country.ContinentCode = Continent.ContinentCode "
             "WHERE Continent.Name = '{0}' AND Country.Population > 50000000"),
]

TEMPLATES = {"chinook": CHINOOK_TEMPLATES, "world": WORLD_TEMPLATES}


def tables_of(sql: str) -> list[str]:
    """The tables a query reads, sorted (what the prompt's schema summary shows)."""
    tree = parse_select(sql)
    return sorted({t.name for t in tree.find_all(exp.Table)}) if tree is not None else []


def _informative(rows: list[tuple]) -> bool:
    return 1 <= len(rows) <= MAX_GOLD_ROWS and any(v not in (None, 0) for row in rows for v in row)


def _template_tasks(db: str, template: Template) -> list[dict[str, Any]]:
    path = dbs.database_path(db)
    if isinstance(template.slots, tuple):
        slots = list(template.slots)
    else:
        listed = dbs.run_query(path, template.slots, time_limit_ms=dbs.GOLD_TIME_LIMIT_MS, row_cap=100_000)
        if not listed.ok:
            raise RuntimeError(f"slot query of {db}:{template.name} failed: {listed.error}")
        slots = listed.rows
    indexed = [(i, s) for i, s in enumerate(slots) if not any("'" in str(v) for v in s)]
    rng = random.Random(f"{db}:{template.name}")
    chosen = sorted(rng.sample(indexed, min(PER_TEMPLATE, len(indexed))))
    tasks = []
    for i, slot in chosen:
        gold = template.gold.format(*slot)
        result = dbs.run_query(path, gold, time_limit_ms=dbs.GOLD_TIME_LIMIT_MS)
        if not result.ok:  # a template bug (or a machine too busy): never drop tasks silently
            raise RuntimeError(f"gold query of {db}:{template.name} failed: {result.error}\n{gold}")
        if result.truncated or not _informative(result.rows):
            continue
        tasks.append({
            "task_id": f"sql-{db}-{template.name}-{i}",
            "db": db,
            "question": template.question.format(*slot),
            "gold_sql": gold,
            "ordered": orders(gold),
            "tables": tables_of(gold),
            "level": template.level,
            "template": template.name,
        })
    return tasks


@lru_cache(maxsize=None)
def _pool(db: str) -> tuple[dict[str, Any], ...]:
    return tuple(t for template in TEMPLATES[db] for t in _template_tasks(db, template))


def pool(db: str) -> list[dict[str, Any]]:
    """Every task of database ``db``, in template order (copies)."""
    return [dict(t, tables=list(t["tables"])) for t in _pool(db)]


def load_tasks(split: str, seed: int, size: int) -> list[dict[str, Any]]:
    """``size`` tasks of ``split`` (``train``: chinook, ``heldout``: world), shuffled by ``seed``.

    Deterministic; a larger ``size`` extends the list. ValueError for an unknown split,
    ``size <= 0`` or more tasks than the split has (``len(split_pool(split))``)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    if size <= 0:
        raise ValueError("size must be positive")
    tasks = split_pool(split)
    if size > len(tasks):
        raise ValueError(f"split {split!r} has {len(tasks)} tasks; asked for {size}")
    random.Random(f"sql-{split}-{seed}").shuffle(tasks)
    return tasks[:size]


def split_pool(split: str) -> list[dict[str, Any]]:
    return [t for db in SPLITS[split] for t in pool(db)]


def disjoint(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """True when no task of ``a`` is about a database a task of ``b`` is about."""
    return not ({t["db"] for t in a} & {t["db"] for t in b})
