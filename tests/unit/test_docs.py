"""The documentation: the site builds with ``mkdocs build --strict`` (a broken link, a missing page
or a page left out of the navigation fails it), and every command the README and the Quickstart
page show is checked as written: ``make`` lines by a dry run of the Makefile (``make -n``: the
target exists and its recipe expands; nothing is run), ``python -m MODULE`` lines by finding the
module, Python blocks by compiling them, importing every name they import and reading only
declared settings. The README stays short, with the attach path near its top."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED_PAGES = ("README.md", "docs/quickstart.md")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)


def fenced_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block of a Markdown file."""
    return [(m.group(1).lower(), m.group(2)) for m in FENCE.finditer(path.read_text())]


def shell_commands(body: str) -> list[str]:
    """The commands of a shell block: comments dropped, ``\\`` continuations joined."""
    commands, pending = [], ""
    for raw in body.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line:
            commands.append(line)
    return commands


def shown_commands() -> list[tuple[str, str]]:
    out = []
    for page in CHECKED_PAGES:
        for lang, body in fenced_blocks(ROOT / page):
            if lang in ("bash", "sh", "shell", "console"):
                out += [(page, c) for c in shell_commands(body)]
    return out


def shown_python() -> list[tuple[str, str]]:
    return [(page, body) for page in CHECKED_PAGES for lang, body in fenced_blocks(ROOT / page)
            if lang in ("python", "py")]


def make_dry_run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MAKEFLAGS": ""})


def test_the_checked_pages_show_commands():
    commands = [c for _, c in shown_commands()]
    assert "make demo" in commands and "make test" in commands
    assert any(c.startswith("pip install") for c in commands)
    assert shown_python()


@pytest.mark.parametrize("page,command", shown_commands(), ids=lambda v: v if "/" not in v else None)
def test_every_shown_command_is_checked(page, command):
    words = shlex.split(command)
    if words[0] == "make":
        done = make_dry_run(words[1:])
        assert done.returncode == 0, f"{page}: `{command}`: make -n says\n{done.stderr}"
        # what the target runs: each `python -m MODULE` of its recipe exists
        for module in re.findall(r"-m ([\w.]+)", done.stdout):
            assert importlib.util.find_spec(module) is not None, f"{page}: `{command}` runs a missing module {module}"
    elif words[0] == "pip" and words[1] == "install":
        # `pip install /path/to/spanrl`: the checkout is a project pip can install, named spanrl
        assert re.search(r'^name = "spanrl"$', (ROOT / "pyproject.toml").read_text(), re.M)
        assert words[-1].endswith("spanrl"), f"{page}: `{command}` installs something else"
    elif words[0] in ("python", "python3") and words[1] == "-m":
        assert importlib.util.find_spec(words[2]) is not None, f"{page}: `{command}`: no module {words[2]}"
    else:
        pytest.fail(f"{page}: `{command}` is a kind of command this test does not check yet: teach it")


@pytest.mark.parametrize("page,body", shown_python(), ids=lambda v: v if "/" not in v and "\n" not in v else None)
def test_every_shown_python_block_compiles_and_imports_what_exists(page, body):
    tree = compile(body, page, "exec", ast.PyCF_ONLY_AST)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{page}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
    # the settings it reads exist: `s = get_settings()`, then `s.<name>`
    from spanrl.core.settings import get_settings
    bound = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
             and getattr(node.value.func, "id", None) == "get_settings" for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            assert hasattr(get_settings(), node.attr), f"{page}: the settings have no {node.attr}"


def test_readme_is_short_and_shows_the_attach_path_early():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    attach = next(i for i, line in enumerate(lines, 1) if line.startswith("## Attach"))
    assert attach <= 80
    assert len((ROOT / "DEVELOPERS.md").read_text().splitlines()) <= 400


def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").exists()
    assert "emit_reward" in (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
