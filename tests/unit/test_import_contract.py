"""The import contract (issue 22 item 5): pyproject.toml's ``[tool.importlinter]`` contracts
are kept (layers: infra > producers | stream_jobs | trainer > spanrl.core > schemas; the
three services independent; nothing below the control plane imports the examples), and
each breaks when a forbidden import is added to a copy of the tree.

import-linter (grimp) reads the source statically; it sees ``spanrl.producers`` etc.
through the links ``spanrl/<folder> -> ../<folder>`` (spanrl/__init__.py)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import spanrl

ROOT = Path(__file__).resolve().parents[2]
LINT = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` run from ``root`` (its pyproject.toml), no cache written."""
    try:
        import importlinter  # noqa: F401
    except ImportError:
        pytest.fail("import-linter is not installed: `make bootstrap` installs it (infra/requirements.txt)")
    return subprocess.run([sys.executable, "-c", LINT, "--no-cache", "--no-logo"], cwd=root, capture_output=True,
                          text=True, timeout=300)


def test_the_contracts_are_kept():
    out = lint_imports(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("layers: infra > producers | stream_jobs | trainer > spanrl.core > schemas KEPT",
                 "the services never import each other KEPT",
                 "below the control plane nothing imports the examples or the benchmarks KEPT"):
        assert name in out.stdout
    assert "Contracts: 3 kept, 0 broken." in out.stdout
    # the whole tree was read through the links (not only spanrl/__init__.py and spanrl/core)
    analysed = int(out.stdout.split("Analyzed ")[1].split(" files")[0])
    assert analysed > len(list((ROOT / "producers").glob("*.py"))) + len(list((ROOT / "trainer").glob("*.py")))


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory) -> Path:
    """The package and pyproject.toml copied with the links followed (real folders)."""
    dest = tmp_path_factory.mktemp("contract")
    shutil.copy(ROOT / "pyproject.toml", dest)
    shutil.copytree(ROOT / "spanrl", dest / "spanrl", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


@pytest.mark.parametrize("module, line, broken", [
    ("trainer/gate.py", "from spanrl.producers import kafka", "the services never import each other BROKEN"),
    ("core/intervals.py", "from spanrl.trainer import losses",
     "layers: infra > producers | stream_jobs | trainer > spanrl.core > schemas BROKEN"),
    ("stream_jobs/credit.py", "import examples.agents",
     "below the control plane nothing imports the examples or the benchmarks BROKEN"),
])
def test_a_forbidden_import_breaks_a_contract(tree_copy, module, line, broken):
    path = tree_copy / "spanrl" / module
    source = path.read_text()
    path.write_text(source + f"\n{line}\n")
    try:
        out = lint_imports(tree_copy)
    finally:
        path.write_text(source)
    assert out.returncode == 1, out.stdout
    assert broken in out.stdout
    assert line.split()[-1].split(".")[0] in out.stdout  # the report names the imported module


def test_the_contract_names_every_top_level_package():
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    named = {m.strip().removeprefix("spanrl.") for layer in layers for m in layer.split("|")}
    assert named == {*spanrl.PACKAGES, "core"}
