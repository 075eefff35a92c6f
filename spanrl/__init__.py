"""spanrl: reinforcement learning for LLM agents from their telemetry.

The public surface (everything else is internal); each name is imported when first used, so
``import spanrl`` loads neither Kafka, OpenTelemetry nor torch:

- the runner: :class:`Runner` runs your agent on the tasks topic, a
  :class:`RolloutContext` per attempt (``ctx.task``, ``ctx.base_url``, ``ctx.emit_reward``);
- tasks: :func:`make_task`, :func:`publish_tasks`;
- telemetry, for an agent the Runner does not start (a production agent):
  :func:`instrument`, :func:`emit_reward`, :func:`flush`;
- the agent spec: :class:`AgentSpec` (what ``spanrl demo --agent my_pkg.my_agent:spec``,
  ``spanrl study``, ``spanrl eval`` and the release gate load), :func:`load_agent_spec`,
  :class:`AgentSpecError`;
- trainer recipes as data: :class:`Recipe`, :func:`get_recipe`, :func:`recipe_env` (``default``
  is the measured one; ``SPANRL_RECIPE=name`` selects one for the trainer).

Example::

    import asyncio
    import spanrl

    async def my_agent(ctx: spanrl.RolloutContext) -> None:
        ...  # call the LLM at ctx.base_url, then
        ctx.emit_reward(1.0, correct=1.0)

    async def main() -> None:
        await spanrl.publish_tasks([spanrl.make_task({"question": "2 + 2?"}, group_size=4)])
        await spanrl.Runner(my_agent).run(max_tasks=1)

    asyncio.run(main())

The package: one import name for the repository's top-level packages.

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

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for type checkers and editors (imported lazily below)
    from spanrl.core.agent_spec import AgentSpec, AgentSpecError
    from spanrl.core.recipes import Recipe, get_recipe, recipe_env
    from spanrl.infra.agents import load_agent_spec
    from spanrl.producers.instrument import emit_reward, flush, instrument
    from spanrl.producers.runner import RolloutContext, Runner, make_task, publish_tasks

#: the public names -> the module each is imported from when first used
_EXPORTS = {
    "Runner": "spanrl.producers.runner",
    "RolloutContext": "spanrl.producers.runner",
    "make_task": "spanrl.producers.runner",
    "publish_tasks": "spanrl.producers.runner",
    "instrument": "spanrl.producers.instrument",
    "emit_reward": "spanrl.producers.instrument",
    "flush": "spanrl.producers.instrument",
    "AgentSpec": "spanrl.core.agent_spec",
    "AgentSpecError": "spanrl.core.agent_spec",
    "load_agent_spec": "spanrl.infra.agents",
    "Recipe": "spanrl.core.recipes",
    "get_recipe": "spanrl.core.recipes",
    "recipe_env": "spanrl.core.recipes",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (PEP 562) and kept here."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'spanrl' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
