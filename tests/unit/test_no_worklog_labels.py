"""No work-log labels in the product: a numbered working-session label (the word, a space, a
number) appears in no tracked file, documents, code comments and result files alike. Where a run
happened is said by its date, commit and run name; the history of the work is in git."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LABEL = re.compile("sess" + r"ion [0-9]+", re.I)  # split so that this file does not match itself


def tracked_files() -> list[Path]:
    done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if done.returncode == 0 and done.stdout:
        return [ROOT / name for name in done.stdout.decode().split("\0") if name]
    return [p for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]  # not a git checkout


def labelled_lines(paths: list[Path], root: Path = ROOT) -> list[str]:
    found = []
    for path in paths:
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if LABEL.search(line):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()[:120]}")
    return found


def test_the_rule_finds_a_label(tmp_path):
    (tmp_path / "notes.md").write_text("measured in " + "Sess" + "ion 12 on the machine\nno label here\n")
    (tmp_path / "run.log").write_text("a session of 3 runs, " + "sess" + "ions 4 and 5\n")
    assert labelled_lines([tmp_path / "notes.md", tmp_path / "run.log"], tmp_path) == [
        "notes.md:1: measured in " + "Sess" + "ion 12 on the machine"]


def test_no_tracked_file_carries_a_worklog_label():
    files = tracked_files()
    assert len(files) > 100  # the walk found the tree
    assert labelled_lines(files) == []
