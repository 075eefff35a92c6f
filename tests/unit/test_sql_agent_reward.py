"""The SQL agent's reward: execution match (Spider) and the scored components (pure)."""
import pytest

from examples.sql_agent.reward import EXECUTED_REWARD, execution_match, is_select, orders, reward


def test_execution_match_is_order_insensitive_unless_ordered():
    gold = [("Rock", 1297), ("Jazz", 130)]
    assert execution_match([("Jazz", 130), ("Rock", 1297)], gold, ordered=False)
    assert not execution_match([("Jazz", 130), ("Rock", 1297)], gold, ordered=True)
    assert execution_match([("Rock", 1297), ("Jazz", 130)], gold, ordered=True)


def test_execution_match_compares_multisets():
    assert not execution_match([("a",), ("a",), ("b",)], [("a",), ("b",), ("b",)], ordered=False)
    assert not execution_match([("a",)], [("a",), ("a",)], ordered=False)
    assert execution_match([("a",), ("b",), ("a",)], [("a",), ("a",), ("b",)], ordered=False)
    assert execution_match([], [], ordered=False)
    assert not execution_match([(1,)], [], ordered=False)


def test_values_are_normalised_lightly():
    assert execution_match([(2.0,)], [(2,)], ordered=False)
    assert execution_match([(39.62000001,)], [(39.62,)], ordered=False)
    assert not execution_match([(39.63,)], [(39.62,)], ordered=False)
    assert execution_match([(True,)], [(1,)], ordered=False)
    assert not execution_match([("2",)], [(2,)], ordered=False)       # types are not coerced
    assert not execution_match([("rock",)], [("Rock",)], ordered=False)
    assert execution_match([(None, 1)], [(None, 1)], ordered=False)


def test_columns_may_come_in_another_order():
    gold = [("Rock", 1297), ("Jazz", 130)]
    assert execution_match([(130, "Jazz"), (1297, "Rock")], gold, ordered=False)
    assert execution_match([(1297, "Rock"), (130, "Jazz")], gold, ordered=True)
    # but a column too many or too few is wrong
    assert not execution_match([("Rock",), ("Jazz",)], gold, ordered=False)
    assert not execution_match([("Rock", 1297, 1), ("Jazz", 130, 2)], gold, ordered=False)


def test_select_detection():
    assert is_select("SELECT 1")
    assert is_select("WITH x AS (SELECT 1 AS a) SELECT a FROM x")
    assert is_select("SELECT 1 UNION SELECT 2")
    for sql in ["", None, "   ", "SELECT", "INSERT INTO Genre VALUES (99, 'x')", "DROP TABLE Genre",
                "DELETE FROM Genre", "UPDATE Genre SET Name = 'x'", "PRAGMA table_info(Track)",
                "ATTACH 'x.db' AS y", "CREATE TABLE t (a)", "SELECT 1; DROP TABLE Genre", "SELECT FROM WHERE ((",
                "hello world"]:
        assert not is_select(sql), sql


def test_order_by_detection():
    assert orders("SELECT Name FROM Track ORDER BY Milliseconds DESC LIMIT 1")
    assert orders("SELECT 1 UNION SELECT 2 ORDER BY 1")
    assert not orders("SELECT Name FROM Track")
    assert not orders("SELECT * FROM (SELECT Name FROM Track ORDER BY Name)")  # only the outer level counts
    assert not orders("DROP TABLE Track")


GOLD = [("Jazz", 130)]


@pytest.mark.parametrize("sql, rows, error, truncated, value, components", [
    ("SELECT Name, COUNT(*) FROM x", [("Jazz", 130)], None, False, 1.0, (1, 1, 1)),
    ("SELECT Name, COUNT(*) FROM x", [("Rock", 1297)], None, False, EXECUTED_REWARD, (0, 1, 1)),
    ("SELECT Name, COUNT(*) FROM x", [("Jazz", 130)], None, True, EXECUTED_REWARD, (0, 1, 1)),  # hit the row cap
    ("SELECT Nme FROM Genre", None, "OperationalError: no such column: Nme", False, 0.0, (0, 1, 0)),
    ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c", None,
     "timed out after 2000 ms", False, 0.0, (0, 1, 0)),
    ("DROP TABLE Genre", [("Jazz", 130)], None, False, 0.0, (0, 1, 0)),  # never a non-SELECT, whatever it returned
    (None, None, "no SQL query found in the reply", False, 0.0, (0, 0, 0)),
    ("", [("Jazz", 130)], None, False, 0.0, (0, 0, 0)),
])
def test_reward(sql, rows, error, truncated, value, components):
    got, comps = reward(sql, rows, error, GOLD, ordered=False, truncated=truncated)
    assert got == value
    assert comps == dict(zip(("correct", "format", "executed"), map(float, components)))
