"""The agent spec: what every command that takes an agent needs to know about it, one typed value.

An agent lives in the user's code; its spec is an :class:`AgentSpec` at a ``module:attribute``
on the user's ``PYTHONPATH`` (``make demo AGENT=my_pkg.my_agent:spec``, ``spanrl eval``,
``spanrl study``, the release gate). spanrl/infra/agents.py loads it (and keeps the example
agents' short names ``math``, ``sql``, ``rag``). A field that is missing or of the wrong type
is refused when the spec is built, naming the field, before anything starts.

Example::

    from spanrl import AgentSpec

    def load_tasks(split: str, seed: int, size: int) -> list[dict]:
        return [{"task_id": f"{split}-{seed}-{i}", "question": f"{i} + {i}?", "answer": 2 * i}
                for i in range(size)]

    spec = AgentSpec(name="adder", runner="my_pkg.my_agent:run", load_tasks=load_tasks)
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from spanrl.core import plugins

#: the keys of a demo's size (``AgentSpec.demo``)
DEMO_KEYS = ("iterations", "tasks", "group_size", "heldout_tasks")
#: a demo's size when the spec names none: the SQL and RAG agents' (3 iterations of 4 tasks x 4
#: rollouts, 40 held-out tasks)
DEFAULT_DEMO: Mapping[str, int] = MappingProxyType({"iterations": 3, "tasks": 4, "group_size": 4,
                                                    "heldout_tasks": 40})
#: what an entry of ``AgentSpec.demo_by_model`` may hold
MODEL_ENTRY_KEYS = ("size", "options", "trainer_env")
#: the task splits ``AgentSpec.load_tasks`` takes
SPLITS = ("train", "heldout")


class AgentSpecError(ValueError):
    """An agent spec that cannot be used: not found, not an :class:`AgentSpec`, or a field
    missing or of the wrong type (the message names it). A ValueError.

    Example: ``AgentSpec(name="x", runner="m:run", load_tasks=f, train_seed="0")`` raises
    ``AgentSpecError("agent spec field 'train_seed': expected an integer, got str '0'")``."""


def _field_error(name: str, expected: str, value: Any) -> AgentSpecError:
    return AgentSpecError(f"agent spec field {name!r}: expected {expected}, got {type(value).__name__} {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_str(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise _field_error(name, "a string", value)


def _check_runner(value: Any) -> None:
    """A module-level callable (its ``module:qualname`` names it to the processes that run it:
    the runner, the evaluator, the release gate) or a ``module:attribute`` string."""
    if callable(value):
        qualname = getattr(value, "__qualname__", "<none>")
        if "<" not in qualname and "." not in qualname and getattr(value, "__module__", None):
            return
    module, sep, attr = value.partition(":") if isinstance(value, str) else ("", "", "")
    if not (module and sep and attr):
        raise _field_error("runner", "a module-level agent callable or its 'module:attribute'", value)


def _check_names(value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(n, str) and n for n in value):
        raise _field_error("agent_names", "a tuple of non-empty strings", value)


def _check_demo(value: Any) -> None:
    if not isinstance(value, Mapping) or tuple(sorted(value)) != tuple(sorted(DEMO_KEYS)) \
            or not all(_is_int(v) and v >= 0 for v in value.values()):
        raise _field_error("demo", f"a mapping of {', '.join(DEMO_KEYS)} to integers >= 0", value)


def _check_demo_by_model(value: Any) -> None:
    if not isinstance(value, Mapping) or not all(
            isinstance(model, str) and isinstance(entry, Mapping) and set(entry) <= set(MODEL_ENTRY_KEYS)
            and all(isinstance(part, Mapping) for part in entry.values()) for model, entry in value.items()):
        raise _field_error("demo_by_model", f"a mapping of model name to {{{', '.join(MODEL_ENTRY_KEYS)}: mapping}}",
                           value)


@dataclass(frozen=True, kw_only=True)
class AgentSpec:
    """An agent as spanrl's commands see it: how to run it, its tasks, how its reward reads.

    Required: ``name`` (reports and run names), ``runner`` (the agent: a callable, sync or
    async, of one :class:`~spanrl.producers.runner.RolloutContext` (``ctx.task``,
    ``ctx.base_url``, ``ctx.emit_reward``), or its ``"module:attribute"``, so that loading the
    spec does not import the agent's framework) and ``load_tasks(split, seed,
    size)`` (``split`` is ``"train"`` or ``"heldout"``; the two seeds give disjoint tasks).
    The rest have defaults: the seeds of each split, the reward components that mean success
    and a well-formed answer, whose calls train (``train_agents``: ``SPANRL_TRAIN_AGENTS``
    syntax, empty for every call), the demo's size, per-model demo settings and the task kind
    held-out results are reported by.

    Example::

        spec = AgentSpec(name="adder", runner="my_pkg.my_agent:run", load_tasks=load_tasks,
                         success_component="correct", task_kind=lambda t: t["level"])
        spec.tasks("heldout", 3)  # three held-out tasks of the held-out seed
    """

    name: str
    runner: str | Callable[..., Any]
    load_tasks: Callable[[str, int, int], list[dict[str, Any]]]
    train_seed: int = 0
    heldout_seed: int = 1000
    #: the reward component whose value > 0 means the task was solved (evaluation's success rate)
    success_component: str = "correct"
    #: the reward component that means a well-formed answer (the format rate)
    format_component: str = "format"
    #: whose calls train (``SPANRL_TRAIN_AGENTS`` of its runs): comma-separated names or ``re:EXPR``; "": all
    train_agents: str = ""
    #: the agent names its calls carry (the roles of a multi-agent runner)
    agent_names: tuple[str, ...] = ()
    #: the demo's size: iterations, tasks per iteration, group_size rollouts each, heldout_tasks
    demo: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_DEMO))
    #: per base model, what its demo changes: ``{"size": {...}, "options": {MainJobConfig field:
    #: value}, "trainer_env": {SPANRL_TRAINER_*: str}}`` (:meth:`demo_plan`)
    demo_by_model: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=dict)
    #: the group a task is reported in (held-out results per kind); None: :meth:`kind_of`'s fallback
    task_kind: Callable[[dict[str, Any]], str] | None = None

    def __post_init__(self) -> None:
        for name in ("name", "success_component", "format_component", "train_agents"):
            _check_str(name, getattr(self, name))
        if not self.name:
            raise _field_error("name", "a non-empty string", self.name)
        _check_runner(self.runner)
        if not callable(self.load_tasks):
            raise _field_error("load_tasks", "a callable", self.load_tasks)
        if self.task_kind is not None and not callable(self.task_kind):
            raise _field_error("task_kind", "a callable or None", self.task_kind)
        for name in ("train_seed", "heldout_seed"):
            if not _is_int(getattr(self, name)):
                raise _field_error(name, "an integer", getattr(self, name))
        _check_names(self.agent_names)
        _check_demo(self.demo)
        _check_demo_by_model(self.demo_by_model)

    @property
    def runner_ref(self) -> str:
        """The runner as ``module:attribute`` (a callable's module and qualified name)."""
        if isinstance(self.runner, str):
            return self.runner
        return f"{self.runner.__module__}:{self.runner.__qualname__}"

    def load_runner(self) -> Callable[..., Any]:
        """The runner callable (a ``module:attribute`` runner is imported now)."""
        return self.runner if callable(self.runner) else plugins.resolve(self.runner)

    def seed_of(self, split: str) -> int:
        """The seed of ``split``: ``train_seed`` or ``heldout_seed``."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        return self.train_seed if split == "train" else self.heldout_seed

    def tasks(self, split: str, size: int, seed: int | None = None) -> list[dict[str, Any]]:
        """``size`` tasks of ``split`` (``seed``: the split's own unless given)."""
        return self.load_tasks(split, self.seed_of(split) if seed is None else seed, size)

    def kind_of(self, task: Mapping[str, Any]) -> str:
        """The group ``task`` is reported in: ``task_kind(task)`` when the spec has one, else
        the task's ``metadata.kind``, else ``"all"``."""
        if self.task_kind is not None:
            return str(self.task_kind(dict(task)))
        return str(task.get("metadata", {}).get("kind", "all"))

    def demo_plan(self, model: str) -> dict[str, dict[str, Any]]:
        """What the demo of this agent with base policy ``model`` runs, before the command
        line's options: ``{"size": {iterations, tasks, group_size, heldout_tasks}, "options":
        {MainJobConfig field: value}, "trainer_env": {SPANRL_TRAINER_*: str}}``, ``demo`` with
        ``demo_by_model[model]``'s entries over it (none: ``demo`` alone). Options it does not
        name stay the main job's defaults, trainer settings the demo's recipe; the environment
        and the command line win over both."""
        over = self.demo_by_model.get(model, {})
        return {"size": {**self.demo, **over.get("size", {})}, "options": dict(over.get("options", {})),
                "trainer_env": dict(over.get("trainer_env", {}))}

