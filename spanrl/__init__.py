"""spanrl: one import name for the repository's top-level packages.

The repository keeps the folders the design card fixes (``producers``, ``schemas``,
``stream_jobs``, ``trainer``, ``infra``) at its root; they are imported as
``spanrl.producers``, ``spanrl.schemas``, ``spanrl.stream_jobs``, ``spanrl.trainer``,
``spanrl.infra``, so installing spanrl cannot clash with another distribution's
``schemas`` or ``trainer``. The ground floor the services share is a real subpackage here,
``spanrl/core`` (``spanrl.core``; DEVELOPERS.md, "Where things are").

- In a checkout (tests, the stack's ``python -m spanrl...`` commands and the Makefile run
  from the repository root without an install): ``spanrl/producers`` and the four others
  are relative symbolic links to ``../producers`` etc., committed in git. Python finds
  ``spanrl.producers`` as the directory ``spanrl/producers`` like any subpackage, and so do
  static readers (grimp and import-linter, editors, ``python -m compileall``): the import
  graph is on disk, no import hook or ``__path__`` entry is needed. A module's ``__file__``
  is the path through the link (``<root>/spanrl/producers/proxy.py``); code that needs the
  repository root resolves it (``Path(__file__).resolve()``).
- Installed (wheel): setuptools' ``package-dir`` mapping in pyproject.toml puts each
  folder under ``spanrl/`` in site-packages (the links are not followed twice: the mapping
  names each package's real folder); this file does nothing more.

Limits:
- ``producers`` (without ``spanrl.``) is importable too from the root, as a *second*,
  separate module object: its globals (settings caches, counters, monkeypatches) are not
  those of ``spanrl.producers``. All code imports ``spanrl.*`` only
  (tests/unit/test_spanrl_package.py checks every file).
- A checkout needs symbolic links (git's ``core.symlinks``, on by default on Linux and
  macOS); without them ``spanrl/producers`` is a small text file and nothing imports.
- If spanrl is also pip-installed in the same environment, the first ``spanrl`` on
  ``sys.path`` wins: from the repository root that is the checkout.
"""

#: the top-level folders that are subpackages of ``spanrl`` (each a link ``spanrl/<name>``)
PACKAGES = ("producers", "schemas", "stream_jobs", "trainer", "infra")
