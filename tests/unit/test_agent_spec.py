"""The agent spec (spanrl/core/agent_spec.py) and its one loader (spanrl/infra/agents.py): a
user's spec loads from ``module:attribute`` on a PYTHONPATH outside the repository, a missing
or ill-typed field is refused naming the field, the example agents keep their short names, and
the commands that take an agent refuse a bad spec before anything starts."""
from __future__ import annotations

import sys
import textwrap

import pytest

from spanrl.core.agent_spec import AgentSpec, AgentSpecError
from spanrl.infra.agents import EXAMPLE_AGENTS, load_agent_spec, load_split, spec_reference, split_task_set

USER_AGENT = '''
from spanrl.core.agent_spec import AgentSpec


async def run(ctx):
    ctx.emit_reward(1.0, correct=1.0)


def load_tasks(split, seed, size):
    return [{"task_id": f"{split}-{seed}-{i}", "question": f"q{seed + i}", "level": "easy" if i % 2 else "hard"}
            for i in range(size)]


spec = AgentSpec(name="echo", runner=run, load_tasks=load_tasks, train_agents="echo", agent_names=("echo",),
                 task_kind=lambda task: task["level"],
                 demo_by_model={"qwen2.5-coder-0.5b": {"size": {"tasks": 2},
                                                       "trainer_env": {"SPANRL_TRAINER_LR": "5e-5"}}})
not_a_spec = {"name": "echo"}
'''


@pytest.fixture
def user_pkg(tmp_path, monkeypatch):
    """A package ``userpkg`` in a temporary folder on sys.path (outside the repository):
    ``write(module, source)`` adds ``userpkg/<module>.py``; imported modules are forgotten after."""
    (tmp_path / "userpkg").mkdir()
    (tmp_path / "userpkg" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(module: str, source: str) -> str:
        (tmp_path / "userpkg" / f"{module}.py").write_text(textwrap.dedent(source))
        return f"userpkg.{module}"

    write("my_agent", USER_AGENT)
    yield write
    for name in [m for m in sys.modules if m == "userpkg" or m.startswith("userpkg.")]:
        del sys.modules[name]


def test_a_users_spec_loads_from_module_attribute(user_pkg, tmp_path):
    spec = load_agent_spec("userpkg.my_agent:spec")
    assert isinstance(spec, AgentSpec) and sys.modules["userpkg.my_agent"].__file__.startswith(str(tmp_path))
    assert (spec.name, spec.runner_ref, spec.train_agents, spec.agent_names) == (
        "echo", "userpkg.my_agent:run", "echo", ("echo",))
    assert (spec.train_seed, spec.heldout_seed, spec.success_component, spec.format_component) == (
        0, 1000, "correct", "format")
    assert spec.load_runner() is sys.modules["userpkg.my_agent"].run
    assert spec.tasks("heldout", 2) == [
        {"task_id": "heldout-1000-0", "question": "q1000", "level": "hard"},
        {"task_id": "heldout-1000-1", "question": "q1001", "level": "easy"}]
    assert [spec.kind_of(t) for t in spec.tasks("train", 3)] == ["hard", "easy", "hard"]
    assert spec.demo_plan("smollm2-135m") == {
        "size": {"iterations": 3, "tasks": 4, "group_size": 4, "heldout_tasks": 40}, "options": {}, "trainer_env": {}}
    assert spec.demo_plan("qwen2.5-coder-0.5b") == {
        "size": {"iterations": 3, "tasks": 2, "group_size": 4, "heldout_tasks": 40}, "options": {},
        "trainer_env": {"SPANRL_TRAINER_LR": "5e-5"}}


def test_a_users_task_set_and_runner_by_the_specs_reference(user_pkg):
    from spanrl.infra.evaluation import load_agent

    assert split_task_set("userpkg.my_agent:spec:heldout") == ("userpkg.my_agent:spec", "heldout")
    assert split_task_set("sql:train") == ("sql", "train") and split_task_set("arith_word") is None
    assert [t["task_id"] for t in load_split("userpkg.my_agent:spec:train", 7, 2)] == ["train-7-0", "train-7-1"]
    assert load_agent("userpkg.my_agent:spec") is sys.modules["userpkg.my_agent"].run
    with pytest.raises(AgentSpecError, match="split must be one of train, heldout, got 'test'"):
        load_split("userpkg.my_agent:spec:test", 0, 1)


def test_a_missing_field_is_refused_with_its_name(user_pkg):
    ref = user_pkg("no_tasks", '''
        from spanrl.core.agent_spec import AgentSpec
        spec = AgentSpec(name="x", runner="userpkg.no_tasks:run")
    ''')
    with pytest.raises(AgentSpecError) as info:
        load_agent_spec(f"{ref}:spec")
    assert str(info.value) == ("agent spec 'userpkg.no_tasks:spec': importing 'userpkg.no_tasks' failed: TypeError: "
                               "AgentSpec.__init__() missing 1 required keyword-only argument: 'load_tasks'")


@pytest.mark.parametrize("field, value, expected", [
    ("train_seed", '"0"', "agent spec field 'train_seed': expected an integer, got str '0'"),
    ("runner", '"run_without_module"', "agent spec field 'runner': expected a module-level agent callable or its "
                                       "'module:attribute', got str 'run_without_module'"),
    ("runner", "lambda ctx: None", "agent spec field 'runner': expected a module-level agent callable or its "
                                   "'module:attribute', got function <function <lambda>"),
    ("load_tasks", "3", "agent spec field 'load_tasks': expected a callable, got int 3"),
    ("agent_names", '["a"]', "agent spec field 'agent_names': expected a tuple of non-empty strings, got list ['a']"),
    ("demo", '{"iterations": 1}', "agent spec field 'demo': expected a mapping of iterations, tasks, group_size, "
                                  "heldout_tasks to integers >= 0, got dict {'iterations': 1}"),
    ("task_kind", '"level"', "agent spec field 'task_kind': expected a callable or None, got str 'level'"),
    ("demo_by_model", '{"m": {"sizes": {}}}', "agent spec field 'demo_by_model': expected a mapping of model "
                                              "name to {size, options, trainer_env: mapping}, got dict "
                                              "{'m': {'sizes': {}}}"),
])
def test_an_ill_typed_field_is_refused_with_its_name(user_pkg, field, value, expected):
    ref = user_pkg(f"bad_{field}", f'''
        from spanrl.core.agent_spec import AgentSpec
        fields = dict(name="x", runner="userpkg.m:run", load_tasks=lambda split, seed, size: [])
        fields[{field!r}] = {value}
        spec = AgentSpec(**fields)
    ''')
    with pytest.raises(AgentSpecError) as info:
        load_agent_spec(f"{ref}:spec")
    assert str(info.value).startswith(f"agent spec '{ref}:spec': {expected}")


def test_references_that_name_no_spec(user_pkg):
    with pytest.raises(AgentSpecError, match=r"^agent spec 'userpkg.my_agent:not_a_spec' is a dict, not "
                                             r"spanrl.AgentSpec$"):
        load_agent_spec("userpkg.my_agent:not_a_spec")
    with pytest.raises(AgentSpecError, match=r"module 'userpkg.my_agent' has no attribute 'nope'$"):
        load_agent_spec("userpkg.my_agent:nope")
    with pytest.raises(AgentSpecError, match="importing 'userpkg.absent' failed: ModuleNotFoundError"):
        load_agent_spec("userpkg.absent:spec")
    for bad in ("nope", "a:b:c", ":spec", "mod:"):
        with pytest.raises(AgentSpecError, match="expected module:attribute .* or one of math, sql, rag"):
            load_agent_spec(bad)


def test_the_example_agents_short_names_are_aliases():
    assert EXAMPLE_AGENTS == {"math": "examples.math_agent.spec:SPEC", "sql": "examples.sql_agent.spec:SPEC",
                              "rag": "examples.rag_agent.spec:SPEC"}
    for name, ref in EXAMPLE_AGENTS.items():
        assert spec_reference(name) == ref and spec_reference(ref) == ref
        assert load_agent_spec(name) is load_agent_spec(ref) and load_agent_spec(name).name == name
    assert load_agent_spec("sql").runner_ref == "examples.sql_agent.agent:sql_agent"


def test_commands_refuse_a_bad_spec_before_anything_starts(user_pkg, monkeypatch):
    """``spanrl demo`` / ``study`` with a spec missing a field exit 2 naming the field; the stack is
    never asked about; ``spanrl eval --task-set REF:SPLIT`` runs the spec's runner by default."""
    from typer.testing import CliRunner

    from spanrl.infra import cli

    ref = user_pkg("no_runner", '''
        from spanrl.core.agent_spec import AgentSpec
        spec = AgentSpec(name="x", load_tasks=lambda split, seed, size: [])
    ''')
    touched = []
    monkeypatch.setattr(cli, "Stack", lambda *a, **k: touched.append("stack"))
    monkeypatch.setattr(cli, "_check_free_space", lambda command: touched.append("disk"))
    for command in ("demo", "study"):
        r = CliRunner().invoke(cli.app, [command, "--agent", f"{ref}:spec"])
        assert r.exit_code == 2 and "'runner'" in r.output, r.output
    assert touched == []

    seen = {}

    def fake_evaluate(cfg, console=None):
        seen["cfg"] = cfg
        return {"paired": {}, "paths": {}}

    import spanrl.infra.evaluation as evaluation

    monkeypatch.setattr(evaluation, "evaluate", fake_evaluate)
    CliRunner().invoke(cli.app, ["eval", "--task-set", "userpkg.my_agent:spec:heldout", "--tasks", "2"])
    assert (seen["cfg"].agent, seen["cfg"].task_set) == ("userpkg.my_agent:run", "userpkg.my_agent:spec:heldout")


def test_the_stacks_services_see_the_users_pythonpath(monkeypatch, tmp_path):
    """The reloader (the release gate's agent) and every other service import from the checkout
    first, then from the caller's PYTHONPATH, where a user's spec and runner live."""
    import os

    from spanrl.core.settings import Settings
    from spanrl.infra.stack import ROOT, Stack

    stack = Stack(Settings.from_environ({}))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert stack.service_env()["PYTHONPATH"] == f"{ROOT}{os.pathsep}{tmp_path}"
    monkeypatch.delenv("PYTHONPATH")
    assert stack.service_env()["PYTHONPATH"] == str(ROOT)
