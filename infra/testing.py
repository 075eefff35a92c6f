"""``make test`` / ``make test-slow``: which pytest runs a tier is, and what the log says.

A tier is two pytest runs: the unit tests (no stack; several pytest-xdist processes, started
while the stack boots) and the integration tests (one process, against the stack). ``fast``
(``make test``, what ``.ci/run`` calls) leaves out the tests marked ``slow``; ``slow``
(``make test-slow``) runs only those; ``all`` runs both. Each run writes a JUnit XML file, from
which the end of the log gives the phases' wall times, the slowest tests of both runs and one
closing count line.

The command itself (start the stack, run, stop) is ``spanrl.infra.cli.test``; this module is
the part that reads alone: the argument lists and the report."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

#: tier -> the pytest marker expression of its runs (pyproject.toml declares ``slow``)
TIERS: dict[str, str | None] = {"fast": "not slow", "slow": "slow", "all": None}


@dataclass(frozen=True)
class PytestRun:
    """One pytest process of a tier: its name in the report, its arguments, its JUnit file."""

    name: str
    args: list[str]
    junit: Path


def tier_runs(tier: str, unit_workers: int, junit_dir: Path) -> list[PytestRun]:
    """The unit run and the integration run of ``tier``.
    Example: ``tier_runs("fast", 2, d)[0].args`` ->
    ``["tests/unit", "-m", "not slow", "-p", "xdist", "-n", "2", "--junitxml", str(d / "unit.xml"), ...]``."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}: one of {', '.join(TIERS)}")
    marker = TIERS[tier]
    select = ["-m", marker] if marker else []
    runs = []
    for name, where, parallel in (("unit", "tests/unit", unit_workers > 0), ("integration", "tests/integration", False)):
        junit = junit_dir / f"{name}.xml"
        args = [where, *select, *(["-p", "xdist", "-n", str(unit_workers)] if parallel else []),
                "--junitxml", str(junit), "-o", "junit_family=xunit1", "-q", "-ra"]
        runs.append(PytestRun(name, args, junit))
    return runs


@dataclass(frozen=True)
class CaseTime:
    """A test's time (setup + call + teardown) and outcome, from a JUnit file."""

    run: str
    nodeid: str
    seconds: float
    outcome: str


def read_junit(path: Path, run: str) -> list[CaseTime]:
    """Every test case of a pytest JUnit XML file (``-o junit_family=xunit1``: the file path
    is an attribute). Outcome: passed, failed (a failure or an error element), skipped.
    A run that wrote no file (it crashed before the end) gives no cases."""
    if not path.exists():
        return []
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed")
        where = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        out.append(CaseTime(run, f"{where}::{case.get('name')}", float(case.get("time") or 0.0), outcome))
    return out


def slowest(cases: list[CaseTime], n: int = 30) -> list[CaseTime]:
    """The ``n`` slowest cases, slowest first (ties: by node id)."""
    return sorted(cases, key=lambda c: (-c.seconds, c.nodeid))[:n]


def counts(cases: list[CaseTime]) -> dict[str, int]:
    """Passed, failed and skipped cases. Example: two passed, one skipped ->
    ``{"passed": 2, "failed": 0, "skipped": 1}``."""
    out = {"passed": 0, "failed": 0, "skipped": 0}
    for c in cases:
        out[c.outcome] += 1
    return out


def closing_line(cases: list[CaseTime], return_codes: dict[str, int]) -> str:
    """The log's last line, ``tests: N passed, N failed, N skipped``; a run that exited
    non-zero without a failed case (a crash, an interrupt, nothing collected) counts as one
    failure, so the line never reads 0 failed for a red run."""
    c = counts(cases)
    failed_runs = {run for run, rc in return_codes.items() if rc != 0}
    with_failures = {case.run for case in cases if case.outcome == "failed"}
    failed = c["failed"] + len(failed_runs - with_failures)
    return f"tests: {c['passed']} passed, {failed} failed, {c['skipped']} skipped"
