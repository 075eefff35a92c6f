"""The one import name `spanrl`: the checkout's links spanrl/<folder> -> ../<folder> and the
wheel's mapping (spanrl/__init__.py), and no file importing a top-level folder by its bare
name (it would load a second copy of the module)."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import spanrl

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("spanrl", *spanrl.PACKAGES, "tests", "examples", "bench")


def test_each_folder_is_a_committed_relative_link_under_spanrl():
    assert list(spanrl.__path__) == [str(ROOT / "spanrl")]  # no import hook, no extra path entry
    staged = subprocess.run(["git", "ls-files", "-s", "--", *(f"spanrl/{n}" for n in spanrl.PACKAGES)], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    assert sorted(line.split()[0] for line in staged) == ["120000"] * len(spanrl.PACKAGES)  # git symlinks
    for name in spanrl.PACKAGES:
        link = ROOT / "spanrl" / name
        assert link.is_symlink() and str(link.readlink()) == f"../{name}"
        assert link.resolve() == ROOT / name


def test_each_folder_is_a_subpackage():
    assert spanrl.PACKAGES == ("producers", "schemas", "stream_jobs", "trainer", "infra")
    for name in (*spanrl.PACKAGES, "core"):
        module = importlib.import_module(f"spanrl.{name}")
        assert Path(module.__file__) == ROOT / "spanrl" / name / "__init__.py"
    from spanrl.schemas import codec
    assert codec.__name__ == "spanrl.schemas.codec"
    assert Path(codec.__file__).resolve() == ROOT / "schemas" / "codec.py"


def test_a_fresh_interpreter_at_the_root_imports_the_linked_modules():
    out = subprocess.run([sys.executable, "-c", "import spanrl.producers.kafka as k; print(k.__name__, k.__file__)"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert out == ["spanrl.producers.kafka", str(ROOT / "spanrl" / "producers" / "kafka.py")]


def test_the_wheel_mapping_names_every_package_by_its_real_folder():
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = tool["package-dir"]
    for name in spanrl.PACKAGES:
        assert dirs[f"spanrl.{name}"] == name
    assert dirs["spanrl.core"] == "spanrl/core"
    for package in tool["packages"]:
        folder = ROOT / dirs.get(package, package.replace(".", "/"))
        assert (folder / "__init__.py").is_file() and not folder.is_symlink(), package
    packaged = {ROOT / dirs.get(p, p.replace(".", "/")) for p in tool["packages"]}
    on_disk = {f.parent for f in (ROOT / "spanrl").resolve().glob("core/**/__init__.py")}
    on_disk |= {f.parent for n in spanrl.PACKAGES for f in (ROOT / n).glob("**/__init__.py")}
    assert on_disk <= packaged  # no subpackage left out of the wheel


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
        for path in sorted((ROOT / folder).rglob("*.py")):  # "**" follows no link: each file once
            offenders += [f"{path.relative_to(ROOT)}:{line} {name}" for line, name in bare_imports(path.read_text())]
    assert offenders == []
