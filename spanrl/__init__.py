"""spanrl: one import name for the repository's top-level packages.

The repository keeps the folders the design card fixes (``producers``, ``schemas``,
``stream_jobs``, ``trainer``, ``infra``) at its root; they are imported as
``spanrl.producers``, ``spanrl.schemas``, ``spanrl.stream_jobs``, ``spanrl.trainer``,
``spanrl.infra``, so installing spanrl cannot clash with another distribution's
``schemas`` or ``trainer``.

- Installed (wheel): setuptools' ``package-dir`` mapping in pyproject.toml puts each
  folder under ``spanrl/`` in site-packages; this file does nothing more.
- In a checkout (tests, the stack's ``python -m spanrl...`` commands and the Makefile run
  from the repository root without an install): the root is on ``sys.path`` (the working
  directory of ``python -m``, pytest's ``pythonpath = ["."]``), Python finds this package
  at ``<root>/spanrl``, and the lines below append ``<root>`` to its ``__path__``, so
  ``spanrl.producers`` is found as ``<root>/producers`` (PEP 302 / importlib: a package's
  submodules are searched along its ``__path__``).

Limits of the checkout trick:
- ``producers`` (without ``spanrl.``) is importable too, as a *second*, separate module
  object: its globals (settings caches, counters, monkeypatches) are not those of
  ``spanrl.producers``. All code imports ``spanrl.*`` only (tests/unit/test_spanrl_package.py
  checks every file).
- Every other folder at the root (``tests``, ``examples``, ``bench``) is reachable as
  ``spanrl.<folder>`` in a checkout, not in the wheel; nothing should import it so.
- If spanrl is also pip-installed in the same environment, the first ``spanrl`` on
  ``sys.path`` wins: from the repository root that is the checkout.
- The root counts as a checkout when it holds ``pyproject.toml`` and
  ``producers/__init__.py`` beside this folder; in site-packages neither is there.
"""
from pathlib import Path as _Path

PACKAGES = ("producers", "schemas", "stream_jobs", "trainer", "infra")


def _checkout_root(package_dir: _Path) -> _Path | None:
    """The repository root when ``package_dir`` (this folder) sits in a checkout, else None."""
    root = package_dir.parent
    if (root / "pyproject.toml").is_file() and (root / "producers" / "__init__.py").is_file():
        return root
    return None


_root = _checkout_root(_Path(__file__).resolve().parent)
if _root is not None and str(_root) not in __path__:
    __path__.append(str(_root))
del _root
