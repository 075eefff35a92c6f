"""infra/testing.py: the runs of each test tier and the report read from their JUnit files."""
from __future__ import annotations

from pathlib import Path

import pytest

from spanrl.infra.testing import CaseTime, closing_line, counts, read_junit, slowest, tier_runs

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="5" time="12.0">
<testcase classname="tests.unit.test_a" name="test_ok" file="tests/unit/test_a.py" line="3" time="1.5"/>
<testcase classname="tests.unit.test_a" name="test_bad" file="tests/unit/test_a.py" line="9" time="4.25">
<failure message="assert 1 == 2">...</failure></testcase>
<testcase classname="tests.unit.test_b" name="test_skip[x]" file="tests/unit/test_b.py" line="1" time="0.0">
<skipped type="pytest.skip" message="no">...</skipped></testcase>
<testcase classname="tests.unit.test_b" name="test_err" file="tests/unit/test_b.py" line="5" time="2.0">
<error message="fixture">...</error></testcase>
<testcase classname="tests.unit.test_c" name="test_slowest" time="6.0"/>
</testsuite></testsuites>
"""


def test_fast_tier_leaves_slow_out_and_runs_units_in_parallel(tmp_path):
    unit, integration = tier_runs("fast", 2, tmp_path)
    assert unit.args == ["tests/unit", "-m", "not slow", "-p", "xdist", "-n", "2", "--junitxml",
                         str(tmp_path / "unit.xml"), "-o", "junit_family=xunit1", "-q", "-ra"]
    assert integration.args == ["tests/integration", "-m", "not slow", "--junitxml", str(tmp_path / "integration.xml"),
                                "-o", "junit_family=xunit1", "-q", "-ra"]
    assert (unit.name, integration.name) == ("unit", "integration")


def test_slow_and_all_tiers_and_one_unit_process(tmp_path):
    assert tier_runs("slow", 0, tmp_path)[0].args[:3] == ["tests/unit", "-m", "slow"]
    assert "-p" not in tier_runs("slow", 0, tmp_path)[0].args
    assert tier_runs("all", 2, tmp_path)[1].args[:2] == ["tests/integration", "--junitxml"]
    with pytest.raises(ValueError, match="unknown tier 'quick': one of fast, slow, all"):
        tier_runs("quick", 2, tmp_path)


def test_read_junit_outcomes_times_and_node_ids(tmp_path):
    path = tmp_path / "unit.xml"
    path.write_text(JUNIT)
    cases = read_junit(path, "unit")
    assert [(c.nodeid, c.seconds, c.outcome) for c in cases] == [
        ("tests/unit/test_a.py::test_ok", 1.5, "passed"),
        ("tests/unit/test_a.py::test_bad", 4.25, "failed"),
        ("tests/unit/test_b.py::test_skip[x]", 0.0, "skipped"),
        ("tests/unit/test_b.py::test_err", 2.0, "failed"),
        ("tests/unit/test_c.py::test_slowest", 6.0, "passed"),  # no file attribute: from the class name
    ]
    assert counts(cases) == {"passed": 2, "failed": 2, "skipped": 1}
    assert [c.nodeid.split("::")[1] for c in slowest(cases, 3)] == ["test_slowest", "test_bad", "test_err"]
    assert read_junit(tmp_path / "missing.xml", "unit") == []


def test_closing_line_counts_a_red_run_without_failed_cases():
    ok = [CaseTime("unit", "a::t", 1.0, "passed"), CaseTime("integration", "b::t", 2.0, "skipped")]
    assert closing_line(ok, {"unit": 0, "integration": 0}) == "tests: 1 passed, 0 failed, 1 skipped"
    # the integration run crashed (or collected nothing): one failure, never "0 failed"
    assert closing_line(ok, {"unit": 0, "integration": 2}) == "tests: 1 passed, 1 failed, 1 skipped"
    bad = ok + [CaseTime("unit", "c::t", 1.0, "failed")]
    assert closing_line(bad, {"unit": 1, "integration": 0}) == "tests: 1 passed, 1 failed, 1 skipped"
