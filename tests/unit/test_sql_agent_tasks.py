"""The SQL agent's databases, sandboxed executor, SQL extraction and generated tasks."""
import json
import sqlite3
from collections import Counter

import pytest

from examples.sql_agent import db as dbs
from examples.sql_agent import tasks as T
from examples.sql_agent.reward import extract_sql, orders

ROWS = {
    "chinook": {"Artist": 275, "Album": 347, "Genre": 25, "MediaType": 5, "Track": 3503, "Playlist": 18,
                "PlaylistTrack": 8715, "Employee": 8, "Customer": 59, "Invoice": 412, "InvoiceLine": 2240},
    "world": {"Continent": 7, "Currency": 178, "Country": 252, "City": 6204, "Language": 275,
              "CountryLanguage": 726},
}


def _dump(path):
    con = sqlite3.connect(path)
    try:
        return list(con.iterdump())
    finally:
        con.close()


@pytest.mark.parametrize("name", ["chinook", "world"])
def test_database_build_is_deterministic(tmp_path, name):
    a = dbs.build(name, tmp_path / "a" / f"{name}.sqlite")
    b = dbs.build(name, tmp_path / "b" / f"{name}.sqlite")
    assert a.read_bytes() == b.read_bytes()
    assert _dump(a) == _dump(dbs.database_path(name))  # the cached copy holds the same data
    con = sqlite3.connect(a)
    counts = {t: con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in dbs.SCHEMAS[name]}
    con.close()
    assert counts == ROWS[name]
    assert list(tmp_path.glob("*/.*")) == []  # no temporary file left behind


def test_database_contents_and_schema_summary(tmp_path):
    path = dbs.database_path("chinook")
    assert dbs.run_query(path, "SELECT Name FROM Artist WHERE ArtistId = 1").rows == [("AC/DC",)]
    assert dbs.run_query(path, "SELECT InvoiceDate, Total FROM Invoice WHERE InvoiceId = 1").rows == [
        ("2007-01-01 00:00:00", 1.98)]
    world = dbs.database_path("world")
    assert dbs.run_query(world, "SELECT Capital, ContinentCode, CurrencyCode FROM Country WHERE Name = 'France'"
                         ).rows == [("Paris", "EU", "EUR")]
    assert dbs.run_query(world, "SELECT Language.Name FROM Language JOIN CountryLanguage USING (LanguageCode) "
                         "WHERE CountryCode = 'AD'").rows == [("Catalan",)]
    assert dbs.schema_summary("chinook", ["Track", "Album"]) == (
        "Album(AlbumId, Title, ArtistId -> Artist.ArtistId)\n"
        "Track(TrackId, Name, AlbumId -> Album.AlbumId, MediaTypeId -> MediaType.MediaTypeId, "
        "GenreId -> Genre.GenreId, Composer, Milliseconds, Bytes, UnitPrice)")
    with pytest.raises(ValueError):
        dbs.database_path("nope")


def test_rollout_copy_is_read_only(tmp_path):
    copy = dbs.rollout_copy("chinook", tmp_path)
    before = copy.read_bytes()
    for sql in ["INSERT INTO Genre VALUES (99, 'Polka')", "DROP TABLE Genre", "DELETE FROM Track",
                "UPDATE Genre SET Name = 'x'", "CREATE TABLE t (a)", "PRAGMA journal_mode = DELETE",
                f"ATTACH '{tmp_path / 'other.db'}' AS other"]:
        e = dbs.run_query(copy, sql)
        assert e.rows is None and e.error.endswith("Error: not authorized"), sql
    assert copy.read_bytes() == before and not (tmp_path / "other.db").exists()
    # the connection itself is read-only too (mode=ro), authorizer or not
    con = sqlite3.connect(f"{copy.resolve().as_uri()}?mode=ro", uri=True)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        con.execute("INSERT INTO Genre VALUES (99, 'Polka')")
    con.close()
    e = dbs.run_query(copy, "SELECT 1; DROP TABLE Genre")
    assert e.error == "ProgrammingError: You can only execute one statement at a time."


def test_runaway_query_times_out(tmp_path):
    copy = dbs.rollout_copy("world", tmp_path)
    e = dbs.run_query(copy, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
                            "SELECT COUNT(*) FROM c", time_limit_ms=200)
    assert e.timed_out and e.rows is None and e.error == "timed out after 200 ms"
    e = dbs.run_query(copy, "SELECT COUNT(*) FROM City a, City b", time_limit_ms=200)  # 38M-row cross join
    assert e.timed_out


def test_row_cap(tmp_path):
    copy = dbs.rollout_copy("chinook", tmp_path)
    e = dbs.run_query(copy, "SELECT TrackId FROM Track ORDER BY TrackId", row_cap=10)
    assert e.ok and e.truncated and e.rows == [(i,) for i in range(1, 11)]
    e = dbs.run_query(copy, "SELECT GenreId FROM Genre", row_cap=25)
    assert e.ok and not e.truncated and len(e.rows) == 25 and e.columns == ("GenreId",)


@pytest.mark.parametrize("reply, sql", [
    ("```sql\nSELECT COUNT(*) FROM Track;\n```", "SELECT COUNT(*) FROM Track"),
    ("```SQL\nselect Name\nfrom Genre\nwhere GenreId = 2\n```\nThis returns Jazz.",
     "select Name from Genre where GenreId = 2"),
    ("```\nSELECT Name FROM Genre\n```", "SELECT Name FROM Genre"),
    ("```sql\nSELECT Name FROM Track WHERE", None),        # cut at max_tokens inside a clause: no query
    ("```sql\nSELECT Name FROM Track", "SELECT Name FROM Track"),  # cut before the closing fence
    ("Sure! Here is the query: SELECT Name FROM Genre WHERE Name = 'a;b'; It lists it.",
     "SELECT Name FROM Genre WHERE Name = 'a;b'"),
    ("SELECT Name FROM Genre\nThis query lists the genres.", "SELECT Name FROM Genre"),
    ("SQL: SELECT * FROM Genre WHERE GenreId = 1 The answer is Rock", "SELECT * FROM Genre WHERE GenreId = 1"),
    ("SELECT Album.Title,\n  Artist.Name\nFrom Album\nJoin Artist On Album.ArtistId = Artist.ArtistId\n"
     "The titles are listed.",
     "SELECT Album.Title, Artist.Name From Album Join Artist On Album.ArtistId = Artist.ArtistId"),
    ("First:\nSELECT 1;\nSELECT 2;", "SELECT 1"),
    # a garbled clause is not cut off (that would be another query): nothing is extracted
    ("```sql\nSELECT COUNT(*) FROM Artist WHERE Artiste.*MusicId = [x].Artistid - 123;\n```", None),
    ("The answer:\n```text\n42\n```\n```sql\nWITH x AS (SELECT 1 AS a) SELECT a FROM x\n```",
     "WITH x AS (SELECT 1 AS a) SELECT a FROM x"),
    ("SELECT Name FROM Genre\n\nNote: SELECT is a keyword", "SELECT Name FROM Genre"),
    ("I don't know.", None),
    ("", None),
    (None, None),
    ("SELECT", None),
    ("DROP TABLE Genre;", None),
    ("```sql\nDELETE FROM Track\n```", None),
])
def test_sql_extraction_from_messy_replies(reply, sql):
    assert extract_sql(reply) == sql


# ---- generated tasks --------------------------------------------------------------------------

def test_pools_and_first_tasks_are_pinned():
    assert len(T.split_pool("train")) == 329 and len(T.split_pool("heldout")) == 334
    first = T.load_tasks("train", T.TRAIN_SEED, 1)[0]
    assert first == {
        "task_id": "sql-chinook-tracks_of_artist-121", "db": "chinook",
        "question": "How many tracks does the artist 'Marvin Gaye' have?",
        "gold_sql": "SELECT COUNT(*) FROM Track JOIN Album ON Track.AlbumId = Album.AlbumId "
                    "JOIN Artist ON Album.ArtistId = Artist.ArtistId WHERE Artist.Name = 'Marvin Gaye'",
        "ordered": False, "tables": ["Album", "Artist", "Track"], "level": "hard", "template": "tracks_of_artist"}
    assert T.load_tasks("heldout", T.HELDOUT_SEED, 1)[0]["task_id"] == "sql-world-countries_in_continent-1"


def test_load_tasks_is_deterministic_and_extends():
    a = T.load_tasks("train", 3, 20)
    assert a == T.load_tasks("train", 3, 20)
    assert T.load_tasks("train", 3, 50)[:20] == a
    assert [t["task_id"] for t in a] != [t["task_id"] for t in T.load_tasks("train", 4, 20)]
    a[0]["tables"].append("mutated")  # callers get copies
    assert T.load_tasks("train", 3, 1)[0]["tables"] != a[0]["tables"]
    for bad in [("dev", 0, 1), ("train", 0, 0), ("train", 0, 330)]:
        with pytest.raises(ValueError):
            T.load_tasks(*bad)


def test_split_is_by_database():
    train, heldout = T.split_pool("train"), T.split_pool("heldout")
    assert {t["db"] for t in train} == {"chinook"} and {t["db"] for t in heldout} == {"world"}
    assert T.disjoint(train, heldout) and not T.disjoint(train, train[:1])
    assert not {t["question"] for t in train} & {t["question"] for t in heldout}
    # the prompts' worked example uses neither database's tables
    from examples.sql_agent.agent import EXAMPLE_SCHEMA
    assert not any(f"{table}(" in EXAMPLE_SCHEMA for schema in dbs.SCHEMAS.values() for table in schema)


def test_tasks_are_well_formed_and_mixed():
    tasks = T.split_pool("train") + T.split_pool("heldout")
    ids = [t["task_id"] for t in tasks]
    assert len(ids) == len(set(ids)) == 663
    assert len({t["question"] for t in tasks}) == 663
    for t in tasks:
        assert json.loads(json.dumps(t)) == t
        assert set(t) == {"task_id", "db", "question", "gold_sql", "ordered", "tables", "level", "template"}
        assert t["ordered"] == orders(t["gold_sql"]) == ("ORDER BY" in t["gold_sql"])
        assert set(t["tables"]) <= set(dbs.SCHEMAS[t["db"]])
    levels = Counter((t["db"], t["level"]) for t in tasks)
    assert levels == {("chinook", "easy"): 184, ("chinook", "hard"): 145,
                      ("world", "easy"): 176, ("world", "hard"): 158}


def test_every_gold_query_runs_and_returns_rows(tmp_path):
    for name in ("chinook", "world"):
        copy = dbs.rollout_copy(name, tmp_path)
        for t in T.pool(name):
            e = dbs.run_query(copy, t["gold_sql"], time_limit_ms=dbs.GOLD_TIME_LIMIT_MS)
            assert e.ok and not e.truncated, (t["task_id"], e.error)
            assert 1 <= len(e.rows) <= T.MAX_GOLD_ROWS, t["task_id"]
            assert any(v not in (None, 0) for row in e.rows for v in row), t["task_id"]
