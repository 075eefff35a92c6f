"""The test tree's own rule: no two test modules share a file name.

tests/unit and tests/integration are not packages (no ``__init__.py``), so pytest's default import
mode (``prepend``) imports each test module under its bare file name; a second
``test_x.py`` in another folder then stops the collection of the whole suite with "import file
mismatch" — which ``make test-unit`` (one folder) does not show and ``make test`` (both) does.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_module_names_are_unique_across_the_test_folders():
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        if "node_modules" not in path.parts:
            by_name[path.name].append(str(path.relative_to(TESTS)))
    assert len(by_name) > 80  # the walk found the suite
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}
