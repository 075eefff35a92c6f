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

import re
from collections import Counter
from itertools import permutations
from typing import Any, Sequence

import sqlglot
from sqlglot import exp
from sqlglot.errors import SqlglotError
from sqlglot.tokens import Tokenizer

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
    if isinstance(tree, exp.Select) and not tree.expressions:
        return None  # a bare "SELECT"
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


# ---- SQL from a model reply ---------------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*([A-Za-z]*)[ \t]*\n?(.*?)(?:```|$)", re.DOTALL)
_START = re.compile(r"\b(SELECT|WITH)\b", re.IGNORECASE)
_WORD_END = re.compile(r"\S+")
#: a line of prose after the query: a capitalised word that is no SQL keyword, then 2+ words
_PROSE_LINE = re.compile(r"\n[ \t]*(?!(?:From|Where|Select|Join|And|Or|Group|Order|Limit|On|Having|Union|Inner|"
                         r"Left|As|Not|In|Like|Case|When|Count|Sum|Avg|Min|Max)\b)[A-Z][a-z']+:?(?:[ \t]+\S+){2,}")
MAX_SQL_CHARS = 1500
#: words SQL can go on with (sqlglot's keywords, first words of the multi-word ones)
_SQL_WORDS = frozenset(k.split()[0] for k in Tokenizer.KEYWORDS if k.split() and k.split()[0].isalpha())


def _prose_word(word: str) -> bool:
    return word.isalpha() and word.upper() not in _SQL_WORDS


def _first_statement(text: str) -> str:
    """``text`` up to its first ``;`` outside quotes (the rest is another statement or prose)."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"`":
            quote = ch
        elif ch == ";":
            return text[:i]
    return text


def extract_sql(reply: str | None) -> str | None:
    """The SELECT statement in a model reply, or None.

    Reads a fenced block (```sql … ```, the closing fence optional: a reply cut at
    max_tokens) when one holds a query, else the reply; starts at the first ``SELECT`` /
    ``WITH``; stops at the first ``;`` outside quotes, a fence, a blank line or a line of
    prose (``This query …``); then keeps the longest word prefix that parses as one SELECT
    and is followed by nothing or by a word that is no SQL keyword (drops prose on the
    query's own line, but never cuts a garbled clause off a query). Line breaks inside the query become spaces."""
    if not reply:
        return None
    text = reply
    for _, body in _FENCE.findall(reply):
        if _START.search(body):
            text = body
            break
    start = _START.search(text)
    if start is None:
        return None
    candidate = text[start.start():start.start() + MAX_SQL_CHARS]
    candidate = re.split(r"```|\n[ \t]*\n", _first_statement(candidate), maxsplit=1)[0]
    candidate = _PROSE_LINE.split(candidate, maxsplit=1)[0]
    ends = [m.end() for m in _WORD_END.finditer(candidate)]
    for end in reversed(ends):
        sql, rest = candidate[:end].strip(), candidate[end:].split(None, 1)
        if rest and not _prose_word(rest[0]):
            continue  # cut only before prose, never inside the query (e.g. a garbled WHERE)
        if is_select(sql):
            return re.sub(r"[ \t]*\n\s*", " ", sql)
    return None
