"""The SQL agent's reward: Spider's execution accuracy on the final query (pure functions).

Execution accuracy (Yu et al., Spider, EMNLP 2018; the test-suite evaluation of Zhong et
al. 2020): the predicted query is right when it returns the gold query's result, compared
as multisets of rows (order-insensitive unless the gold query has a top-level ORDER BY),
with the predicted columns allowed in another order. Values are normalised lightly: a float
that is a whole number equals that int, other floats are rounded to 4 decimals, strings
are compared as they are.

``reward = 1.0`` if correct, ``0.1`` if the final query is a SELECT that ran but returned
something else, ``0.0`` for no query, invalid SQL, a non-SELECT statement, a run-time
error or a time-out. Components: ``correct``, ``format`` (a statement was extracted from
the final writer reply), ``executed`` (it ran as a read-only SELECT).
"""
from __future__ import annotations

from collections import Counter
from itertools import permutations
from typing import Any, Sequence

import sqlglot
from sqlglot import exp
from sqlglot.errors import SqlglotError

EXECUTED_REWARD = 0.1
#: column permutations tried when matching (Spider); beyond this width only the given order
MAX_PERMUTED_COLUMNS = 4


def parse_select(sql: str | None) -> exp.Expression | None:
    """The parsed statement when ``sql`` is exactly one SELECT (``WITH``, ``UNION`` … allowed),
    else None (empty, unparsable, several statements, INSERT/DROP/PRAGMA/ATTACH …)."""
    if not sql or not sql.strip():
        return None
    try:
        statements = [s for s in sqlglot.parse(sql, read="sqlite") if s is not None]
    except SqlglotError:
        return None
    if len(statements) != 1 or not isinstance(statements[0], exp.Query):
        return None
    tree = statements[0]
    writes = (exp.Insert, exp.Update, exp.Delete, exp.Drop, exp.Create, exp.Alter, exp.Command, exp.Pragma)
    if any(isinstance(node, writes) for node in tree.walk()):
        return None
    return tree


def is_select(sql: str | None) -> bool:
    return parse_select(sql) is not None


def orders(sql: str) -> bool:
    """True when the query's outermost level has an ORDER BY (then row order counts)."""
    tree = parse_select(sql)
    return tree is not None and tree.args.get("order") is not None


def normalise_value(value: Any) -> Any:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        return round(value, 4)
    if isinstance(value, bytes):
        return value.hex()
    return value


def normalise_rows(rows: Sequence[Sequence[Any]]) -> list[tuple]:
    return [tuple(normalise_value(v) for v in row) for row in rows]


def execution_match(pred_rows: Sequence[Sequence[Any]], gold_rows: Sequence[Sequence[Any]], ordered: bool) -> bool:
    """Spider execution match of two results (lists of row tuples)."""
    pred, gold = normalise_rows(pred_rows), normalise_rows(gold_rows)
    if len(pred) != len(gold):
        return False
    if not gold:
        return True
    width = len(gold[0])
    if any(len(r) != width for r in pred):
        return False
    orders_to_try = permutations(range(width)) if width <= MAX_PERMUTED_COLUMNS else [tuple(range(width))]
    want = gold if ordered else Counter(gold)
    for perm in orders_to_try:
        moved = [tuple(r[i] for i in perm) for r in pred]
        if (moved if ordered else Counter(moved)) == want:
            return True
    return False


def reward(sql: str | None, rows: Sequence[Sequence[Any]] | None, error: str | None,
           gold_rows: Sequence[Sequence[Any]], ordered: bool, truncated: bool = False) -> tuple[float, dict[str, float]]:
    """``(value, components)`` of a final query ``sql`` whose execution gave ``rows`` or
    ``error`` (a time-out is an error); ``truncated``: the result hit the row cap (it cannot
    then be compared, and counts as wrong)."""
    fmt = bool(sql and sql.strip())
    executed = fmt and error is None and rows is not None and is_select(sql)
    correct = executed and not truncated and execution_match(rows, gold_rows, ordered)
    value = 1.0 if correct else EXECUTED_REWARD if executed else 0.0
    return value, {"correct": float(correct), "format": float(fmt), "executed": float(executed)}
