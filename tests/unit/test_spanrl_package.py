"""The one import name `spanrl`: the checkout mapping of spanrl/__init__.py, and no file
importing a top-level folder by its bare name (it would load a second copy of the module)."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import spanrl

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("spanrl", *spanrl.PACKAGES, "tests", "examples", "bench")


def test_checkout_root_is_on_the_package_path():
    assert spanrl._checkout_root(ROOT / "spanrl") == ROOT
    assert list(spanrl.__path__) == [str(ROOT / "spanrl"), str(ROOT)]


def test_checkout_root_needs_pyproject_and_producers(tmp_path):
    (tmp_path / "spanrl").mkdir()
    assert spanrl._checkout_root(tmp_path / "spanrl") is None  # site-packages: neither
    (tmp_path / "pyproject.toml").write_text("")
    assert spanrl._checkout_root(tmp_path / "spanrl") is None  # another project's checkout
    (tmp_path / "producers").mkdir()
    (tmp_path / "producers" / "__init__.py").write_text("")
    assert spanrl._checkout_root(tmp_path / "spanrl") == tmp_path


def test_each_folder_is_a_subpackage():
    assert spanrl.PACKAGES == ("producers", "schemas", "stream_jobs", "trainer", "infra")
    for name in spanrl.PACKAGES:
        module = importlib.import_module(f"spanrl.{name}")
        assert Path(module.__file__) == ROOT / name / "__init__.py"
    from spanrl.schemas import codec
    assert codec.__name__ == "spanrl.schemas.codec"


def test_a_fresh_interpreter_at_the_root_imports_the_mapped_modules():
    out = subprocess.run([sys.executable, "-c", "import spanrl.infra.settings as s; print(s.__name__, s.__file__)"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert out == ["spanrl.infra.settings", str(ROOT / "infra" / "settings.py")]


def bare_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of each absolute import whose first name is one of spanrl.PACKAGES."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in spanrl.PACKAGES]
    return found


def test_bare_imports_finds_exactly_the_top_level_names():
    # the names go through variables: the script that rewrote the imports to spanrl.* (and
    # may run again on other branches) would prefix a literal "import <name>.x" too
    producers, schemas, _, trainer, infra = spanrl.PACKAGES
    src = (f"import os\nimport {producers}.proxy as p\nfrom {schemas} import codec\nfrom .{trainer} import x\n"
           f"from spanrl.{infra} import settings\nimport {infra}\n")
    assert bare_imports(src) == [(2, f"{producers}.proxy"), (3, schemas), (6, infra)]


def test_no_file_imports_a_folder_by_its_bare_name():
    offenders = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            offenders += [f"{path.relative_to(ROOT)}:{line} {name}" for line, name in bare_imports(path.read_text())]
    assert offenders == []
