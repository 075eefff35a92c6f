"""spanrl's command line: train and evaluate an agent, studies, replay, chaos, the local stack.

    spanrl stack up [--only kafka,minio]   start components, wait for health
    spanrl stack status                    table of components, health, endpoints
    spanrl stack down                      stop everything
    spanrl stack logs NAME [-n 50]         tail a component's log
    spanrl train [--agent REF] ...         train an agent, evaluate before and after (the main job)
    spanrl demo ...                        the same command (make demo)
    spanrl study [--seeds 3] ...           the main job once per run seed, one report across seeds
    spanrl eval --policy base --policy RUN:VERSION   held-out evaluation (stack must be up)
    spanrl replay ...                      rebuild transitions under a new credit rule
    spanrl chaos [--faults worker,kafka]   SIGKILL components mid-run, prove nothing lost
    spanrl test [--tier fast|slow|all]     start the stack, run a test tier, stop it (make test)
    spanrl calls [--rollout ID] [--last N] each LLM call's agent (resolved how), trained or excluded
    spanrl runs                            runs with checkpoints (MinIO, local copies), sizes, free space
    spanrl clean 'PATTERN' [--dry-run]     delete matching runs' checkpoints (MinIO and local)
"""
from __future__ import annotations

import re

import typer
from rich.console import Console
from rich.table import Table

from spanrl.core.settings import StreamSettings, UnknownSetting, child_env, setdefault_env
from spanrl.infra.stack import Stack, StackError

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__.split("\n\n")[0])
stack_app = typer.Typer(no_args_is_help=True, help="Start, inspect and stop the local stack.")
app.add_typer(stack_app, name="stack")
console = Console()


def _names(only: str | None) -> list[str] | None:
    return [n.strip() for n in only.split(",") if n.strip()] if only else None


@stack_app.command("up")
def stack_up(only: str = typer.Option(None, help="comma-separated components (default: all)"),
             cluster: bool = typer.Option(False, help="the deployment's layout as processes here: 3 Kafka brokers, "
                                          "2 stream workers, 2 bridges (settings.CLUSTER_LAYOUT)")) -> None:
    """Start the stack (Kafka, MinIO, vLLM, bridge, proxy, stream, trainer, reloader, dashboard)."""
    if cluster:
        from spanrl.core.settings import CLUSTER_LAYOUT, Settings, get_settings, update_env

        update_env(Settings.env(**{k: str(v) for k, v in CLUSTER_LAYOUT.items()}))
        get_settings.cache_clear()
    stack = Stack()
    try:
        with console.status("starting") as st:
            stack.up(_names(only), progress=lambda n: st.update(f"starting {n} …"))
    except UnknownSetting as exc:  # nothing was started
        console.print(f"[red]stack up refused[/red]: {exc}")
        raise typer.Exit(1)
    except StackError as exc:
        console.print(f"[red]stack up failed[/red]: {exc}")
        raise typer.Exit(1)
    stack_status()


@stack_app.command("down")
def stack_down(only: str = typer.Option(None, help="comma-separated components (default: all)")) -> None:
    """Stop the stack (reverse order)."""
    Stack().down(_names(only))
    console.print("stack stopped")


@stack_app.command("status")
def stack_status() -> None:
    """Show each component: running, healthy, endpoint."""
    table = Table(title="spanrl stack")
    for col in ("component", "running", "healthy", "endpoint"):
        table.add_column(col)
    stack = Stack()
    for name, running, healthy, where in stack.status():
        table.add_row(name, "yes" if running else "no", "[green]yes[/green]" if healthy else "[red]no[/red]", where)
    for name in stack.strays():  # e.g. `stack up --cluster`'s replicas, asked without its settings
        table.add_row(name, "yes" if stack.running(name) else "no", "?", "another layout (--cluster?); "
                      "`stack down` stops it")
    console.print(table)


@stack_app.command("logs")
def stack_logs(name: str, lines: int = typer.Option(50, "-n")) -> None:
    """Print the last lines of a component's log."""
    console.print(Stack().tail(name, lines))


def _fresh_run(prefix: str) -> Stack:
    """A Stack whose trainer and reloader use a new run name (``prefix-<UTC time>``), unless
    the stack is already up (then its running services and run are kept). The stack's
    trainer starts a run without checkpoints at the end of the samples topic."""
    import time

    from spanrl.core.settings import get_settings

    if not Stack().running("trainer"):
        setdefault_env("SPANRL_RUN", f"{prefix}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
        get_settings.cache_clear()
    return Stack(get_settings())


def _up_or_exit(stack: Stack) -> None:
    try:
        with console.status("starting the stack") as st:
            stack.up(progress=lambda n: st.update(f"starting {n} …"))
    except UnknownSetting as exc:  # nothing was started
        console.print(f"[red]stack up refused[/red]: {exc}")
        raise typer.Exit(1)
    except StackError as exc:
        console.print(f"[red]stack up failed[/red]: {exc}")
        stack.down()
        raise typer.Exit(1)


def _check_free_space(command: str) -> None:
    """Exit 1 with a clear message when the cache or state directory's drive has less free
    space than ``command`` needs (spanrl.infra.storage.NEEDED_FREE)."""
    from spanrl.core.settings import get_settings
    from spanrl.infra.stack import ROOT
    from spanrl.infra.storage import (GIB, NEEDED_FREE, empty_dir, free_space_problem, largest_entries,
                                      stale_minio_trash)

    s = get_settings()
    paths = [s.cache_dir, Stack(s).state]
    problem = free_space_problem(paths, NEEDED_FREE[command])
    if problem:  # first take back what stopped MinIOs of this and nearby clones left in their trash
        freed = sum(empty_dir(t) for t in stale_minio_trash([ROOT.parent, *ROOT.parent.parent.glob("*/")]))
        if freed:
            console.print(f"deleted {freed / GIB:.1f} GiB of objects stopped MinIOs had deleted "
                          f"(.spanrl/minio/.minio.sys/tmp/.trash of clones near {ROOT})")
            problem = free_space_problem(paths, NEEDED_FREE[command])
    if problem:
        console.print(f"[red]not enough disk space for `{command}`[/red]: {problem}")
        console.print("largest here: " + ", ".join(f"{p} {n / GIB:.1f} GiB"
                                                    for p, n in largest_entries([*paths, ROOT.parent])))
        raise typer.Exit(1)


def _storage_client(s):
    """A MinIO client when MinIO is up (started here if it is not: returns (client,
    started))."""
    from spanrl.trainer import checkpoint

    stack = Stack(s)
    started = False
    if not stack.running("minio"):
        stack.up(["minio"])
        started = True
    return checkpoint.make_client(s), started


@app.command()
def test(
    tier: str = typer.Option("fast", help="fast: every test not marked slow (`make test`, CI); slow: the slow "
                             "tier (`make test-slow`); all: both"),
    unit_workers: int = typer.Option(2, help="pytest-xdist processes for the unit tests (0: one process)"),
    keep_up: bool = typer.Option(False, help="leave the stack running afterwards"),
    pytest_args: list[str] = typer.Argument(None, help="pytest arguments: run just these, in one process "
                                            "(default: the tier's unit and integration runs)"),
) -> None:
    """Start the stack and run a test tier: the unit tests in parallel from the start (they
    need no stack), the integration tests against the stack once it is up; stop the stack. The log ends with each phase's
    time, the 30 slowest tests and one count line. The stack's trainer batches at a barrier
    (it updates only when a test asks, ``POST /admin/train``) and its stream worker's session
    time-out is 10 s; the runs the tests create delete their checkpoints themselves; the
    stack's own run ``test-<time>`` is deleted here (unless --keep-up)."""
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    from spanrl.core.settings import TrainerConfig, get_settings
    from spanrl.infra import storage, testing
    from spanrl.trainer import checkpoint

    s = get_settings()
    serving = {s.run} if Stack(s).running("trainer") or Stack(s).running("reloader") else set()
    if freed := storage.reclaim_scratch(s.cache_dir, protect=serving):
        console.print(f"deleted the local checkpoints of {len(freed)} runs earlier tests left: "
                      f"{sum(freed.values()) / storage.GIB:.1f} GiB")
    _check_free_space("test")
    # a SIGKILLed worker's partitions move after 10 s, not 60 (the stack's worker and the
    # workers tests start); the stack's trainer updates only when a test asks (barrier), so no
    # update is started by whichever test's rollouts came before
    stack_only = TrainerConfig.env(batching="barrier")
    # every trainer of the suite (the stack's and those tests start) runs recipe ``plain``, the
    # learning options off: the suite tests plumbing; the default recipe is tested apart
    # (tests/unit/test_recipes.py) and learns in ``make demo`` / ``make study``
    for name, value in {**TrainerConfig.env(keep_published=str(storage.TEST_KEEP_PUBLISHED)), **stack_only,
                        "SPANRL_RECIPE": "plain", **StreamSettings.env(stream_session_timeout_s="10")}.items():
        setdefault_env(name, value)
    stack = _fresh_run("test")
    storage.register_scratch(stack.s.cache_dir, stack.s.run)
    # the trainers tests start themselves (scratch runs, replays) batch as they say, not at a barrier
    env = {k: v for k, v in child_env(stack.service_env()).items() if k not in stack_only}
    junit_dir = Path(tempfile.mkdtemp(prefix="spanrl-test-"))
    runs = ([testing.PytestRun("pytest", [*pytest_args, "--junitxml", str(junit_dir / "pytest.xml"), "-o",
                                          "junit_family=xunit1"], junit_dir / "pytest.xml")] if pytest_args
            else testing.tier_runs(tier, unit_workers, junit_dir))
    pytest = [sys.executable, "-m", "pytest"]
    t0 = time.monotonic()
    phases: dict[str, float] = {}
    codes: dict[str, int] = {}
    # the unit tests need no stack: they start now, beside the stack's start, their output in a file
    unit = runs[0] if len(runs) == 2 else None
    unit_log = junit_dir / "unit.log"
    unit_proc = (subprocess.Popen([*pytest, *unit.args], env=env, stdout=unit_log.open("wb"),
                                  stderr=subprocess.STDOUT) if unit else None)
    unit_end: list[float] = []  # when the unit run ended (it runs beside the stack's start and the integration run)
    if unit_proc is not None:
        import threading

        threading.Thread(target=lambda: (unit_proc.wait(), unit_end.append(time.monotonic())), daemon=True).start()
    try:
        _up_or_exit(stack)
        phases["stack start"] = time.monotonic() - t0
        console.print(f"stack up in {phases['stack start']:.0f} s"
                      + (" (the unit tests go on beside the integration tests; their log follows them)" if unit else ""))
        for run in runs[1:] if unit else runs:
            t = time.monotonic()
            codes[run.name] = subprocess.call([*pytest, *run.args], env=env)
            phases[f"{run.name} tests"] = time.monotonic() - t
        if unit_proc is not None:
            with console.status("unit tests …"):
                codes["unit"] = unit_proc.wait()
            phases["unit tests (from the start)"] = unit_end[0] - t0 if unit_end else time.monotonic() - t0
            console.print(unit_log.read_text(errors="replace"), markup=False, highlight=False)
    finally:
        if unit_proc is not None and unit_proc.poll() is None:
            unit_proc.kill()
        if not keep_up:
            t = time.monotonic()
            s = stack.s
            stack.down(["reloader", "trainer"])
            try:
                checkpoint.delete_run(checkpoint.make_client(s) if stack.running("minio") else None,
                                      s.checkpoint_bucket, s.cache_dir, s.run)
                storage.forget_scratch(s.cache_dir, [s.run])
            finally:
                stack.down()
            phases["stack stop"] = time.monotonic() - t
    phases["total"] = time.monotonic() - t0
    cases = [c for run in runs for c in testing.read_junit(run.junit, run.name)]
    _print_test_report(phases, testing.slowest(cases),
                       [f"{r.name}: {testing.counts([c for c in cases if c.run == r.name])}" for r in runs])
    console.print(testing.closing_line(cases, codes), markup=False, highlight=False)
    raise typer.Exit(0 if codes and not any(codes.values()) else 1)


def _print_test_report(phases: dict[str, float], slowest, run_counts: list[str]) -> None:
    """The end of a test log: the slowest tests (plain lines: a CI log is not a terminal and a
    table would cut the node ids), each phase's wall time, each run's counts."""
    console.print(f"slowest {len(slowest)} tests (setup + call + teardown):")
    for c in slowest:
        console.print(f"{c.seconds:8.1f} s  {c.run:<11}  {c.nodeid}" + ("" if c.outcome == "passed" else f"  [{c.outcome}]"),
                      markup=False, highlight=False, soft_wrap=True)
    console.print("  ".join(f"{name} {seconds / 60:.1f} min" for name, seconds in phases.items()), soft_wrap=True)
    for line in run_counts:
        console.print(line, markup=False, highlight=False)


@app.command()
def calls(
    rollout: list[str] = typer.Option(None, help="rollout ids (repeatable; default: the newest attempts)"),
    last: int = typer.Option(10, help="without --rollout: this many of the newest ended attempts"),
    topic: str = typer.Option("call-accounts", help="call-accounts topic (a replay's: call-accounts.SUFFIX)"),
) -> None:
    """Each LLM call of ended attempts: its agent, how the agent was resolved (call: the
    x-spanrl-agent header; telemetry: the framework's spans; unresolved), trained or
    excluded, from the call-accounts topic; then the counts per agent."""
    import asyncio

    from spanrl.core.settings import get_settings
    from spanrl.infra.replay import agent_counts, read_topic
    from spanrl.schemas import topics as T

    s = get_settings()
    accounts = asyncio.run(read_topic(s.kafka_bootstrap, T.derived(T.CALL_ACCOUNTS, topic.split(".", 1)[1])
                                      if "." in topic else T.CALL_ACCOUNTS))
    accounts = [a for a in accounts if a["rollout_id"] in set(rollout)] if rollout else accounts[-last:]
    if not accounts:
        console.print("no call accounts" + (f" for {', '.join(rollout)}" if rollout else ""))
        raise typer.Exit(1 if rollout else 0)
    table = Table(title=f"LLM calls ({topic})")
    for col in ("rollout", "attempt", "outcome", "selection", "seq", "span", "agent", "resolved by", "trained"):
        table.add_column(col)
    for a in accounts:
        for c in a["calls"]:
            table.add_row(a["rollout_id"], a["attempt_id"], a["outcome"], a["selection"], str(c["sequence_id"]),
                          c["span_id"], c["agent_name"] or "-", c["agent_source"], "yes" if c["trained"] else "no")
    console.print(table)
    for name, c in agent_counts(accounts).items():
        console.print(f"{name}: calls {c['calls']}, trained {c['trained']}, excluded {c['excluded']}")


@app.command()
def runs() -> None:
    """Runs that have checkpoints in MinIO or local copies, with sizes, and the free space."""
    import shutil

    from spanrl.core.settings import get_settings
    from spanrl.infra.storage import GIB
    from spanrl.trainer import checkpoint

    s = get_settings()
    client, started = _storage_client(s)
    try:
        found = checkpoint.list_runs(client, s.checkpoint_bucket, s.cache_dir)
    finally:
        if started:
            Stack(s).down(["minio"])
    serving = s.run if Stack(s).running("trainer") else None
    table = Table(title=f"runs (s3://{s.checkpoint_bucket}, {s.cache_dir})")
    for col in ("run", "MinIO GiB", "objects", "local GiB", ""):
        table.add_column(col)
    for run, e in sorted(found.items()):
        table.add_row(run, f"{e['store_bytes'] / GIB:.2f}", str(e["store_objects"]), f"{e['local_bytes'] / GIB:.2f}",
                      "served by the stack" if run == serving else "")
    console.print(table)
    total = sum(e["store_bytes"] + e["local_bytes"] for e in found.values())
    free = shutil.disk_usage(s.cache_dir if s.cache_dir.exists() else ".").free
    console.print(f"{len(found)} runs, {total / GIB:.1f} GiB; {free / GIB:.1f} GiB free")


@app.command()
def clean(
    patterns: list[str] = typer.Argument(..., help="run names or shell patterns, e.g. 'test-*' 'demo-20261201-*'"),
    dry_run: bool = typer.Option(False, help="only list what would be deleted"),
) -> None:
    """Delete the checkpoints of the matching runs: MinIO objects (weights, manifests, start
    marker, gate records) and local copies. Never the run the running stack trains and
    serves. Kafka records stay."""
    from spanrl.core.settings import get_settings
    from spanrl.infra.storage import GIB, select_runs
    from spanrl.trainer import checkpoint

    s = get_settings()
    protect = {s.run} if Stack(s).running("trainer") or Stack(s).running("reloader") else set()
    client, started = _storage_client(s)
    try:
        try:
            doomed = select_runs(list(checkpoint.list_runs(client, s.checkpoint_bucket, s.cache_dir)), patterns,
                                 protect)
        except ValueError as exc:
            raise typer.BadParameter(str(exc))
        freed = 0
        for run in doomed:
            if dry_run:
                console.print(f"would delete {run}")
                continue
            r = checkpoint.delete_run(client, s.checkpoint_bucket, s.cache_dir, run)
            freed += r["store_bytes"] + r["local_bytes"]
            console.print(f"deleted {run}: {r['store_objects']} objects, "
                          f"{(r['store_bytes'] + r['local_bytes']) / GIB:.2f} GiB")
    finally:
        if started:
            Stack(s).down(["minio"])
    if protect and any(select_runs(list(protect), patterns)):
        console.print(f"kept {s.run}: the running stack serves it")
    console.print(f"{len(doomed)} runs {'would be ' if dry_run else ''}deleted" +
                  ("" if dry_run else f", {freed / GIB:.1f} GiB freed"))


def _heldout_modes(value: str | None) -> tuple[str, ...] | None:
    """``--heldout-modes`` as a tuple of known modes (None: the main job's default, both);
    an unknown or empty list is a ``typer.BadParameter`` naming the known ones."""
    if value is None:
        return None
    from examples.math_agent.main_job import HELDOUT_MODES

    modes = tuple(dict.fromkeys(m.strip() for m in value.split(",") if m.strip()))
    unknown = [m for m in modes if m not in HELDOUT_MODES]
    if unknown or not modes:
        raise typer.BadParameter(f"held-out modes {value!r}: known modes are {', '.join(HELDOUT_MODES)}")
    return modes


RECIPE_HELP = ("a trainer recipe of spanrl/core/recipes.py (default | qwen05b-lora | qwen05b-lora-tree), applied "
               "whole instead of the demo's trainer settings; SPANRL_TRAINER_* variables still win (default: "
               "SPANRL_RECIPE; unset: the default recipe with the agent's per-model settings)")


def _recipe(name: str | None) -> str | None:
    """The recipe chosen: ``name`` (set as ``SPANRL_RECIPE``, so the stack's trainer reads it too),
    else ``SPANRL_RECIPE``; None when neither. An unknown name is the command line's error."""
    from spanrl.core.recipes import get_recipe
    from spanrl.core.settings import get_settings, set_env

    if name is not None:
        try:
            get_recipe(name)
        except ValueError as exc:
            raise typer.BadParameter(str(exc))
        set_env("SPANRL_RECIPE", name)
        get_settings.cache_clear()
    return get_settings().recipe or None


def _agent_spec(ref: str):
    """The AgentSpec ``ref`` names (spanrl/infra/agents.py); a bad reference or spec is the
    command line's error, before anything starts."""
    from spanrl.infra.agents import load_agent_spec

    try:
        return load_agent_spec(ref)
    except ValueError as exc:  # AgentSpecError
        raise typer.BadParameter(str(exc))


@app.command()
def train(
    agent: str = typer.Option("math", help="the agent spec: module:attribute (a spanrl.AgentSpec on PYTHONPATH, "
                              "e.g. my_pkg.my_agent:spec) or math (AutoGen calculator) | sql (LangGraph "
                              "text-to-SQL team, write/rewrite trained, check excluded) | rag (Agents SDK "
                              "retrieval)"),
    iterations: int = typer.Option(None, help="tasks -> rollouts -> samples -> update -> reload cycles "
                                   "(default: the agent's demo size)"),
    tasks: int = typer.Option(None, help="new training tasks per iteration"),
    group_size: int = typer.Option(None, help="rollouts per task (GRPO group)"),
    heldout_tasks: int = typer.Option(None, help="held-out tasks evaluated before and after (0: none)"),
    ood_tasks: int = typer.Option(None, help="out-of-distribution gsm_symbolic tasks evaluated before and after "
                                  "(math agent; default: none)"),
    heldout_modes: str = typer.Option(None, help="held-out evaluation modes, comma-separated: sampled (the agent's "
                                      "own sampling), greedy (temperature 0); default: both"),
    logprob_shift: bool = typer.Option(None, "--logprob-shift/--no-logprob-shift",
                                       help="score trained completions under each new policy (default: on; "
                                       "one vLLM prefill per completion)"),
    train_task_set: str = typer.Option(None, help="the math agent's training tasks: arith_word_mul_add_sub "
                                       "(default: mul, add, sub in turn) | arith_word (random kinds) | "
                                       "arith_word_balanced (one of each kind per 6 tasks)"),
    out: str = typer.Option("results", help="where summary.json, reward_curve.png and heldout.* go"),
    keep_up: bool = typer.Option(False, help="leave the stack running afterwards (a stack that was up before "
                                 "is always left up)"),
    recipe: str = typer.Option(None, help=RECIPE_HELP),
) -> None:
    """Train an agent (``--agent``: an AgentSpec by module:attribute, or math | sql | rag) on the
    stack and evaluate it before and after on held-out tasks.

    Starts the stack if it is down (and stops it afterwards unless ``--keep-up``), publishes the
    spec's training tasks iteration by iteration, runs the agent on them through the runner, trains
    with the recipe (TrainerConfig's defaults: recipe ``default``; ``--recipe`` or SPANRL_RECIPE
    picks another), one update per iteration, and evaluates the base and the final policy on the
    spec's held-out tasks with 95% paired intervals: OUT/summary.json, reward_curve.png,
    heldout-<mode>.json/.png and per-kind results (examples/math_agent/main_job.py).
    ``make demo`` is this command on the math agent at its demo size."""
    from pathlib import Path

    from examples.math_agent.main_job import MainJobConfig, demo_trainer_env, run_main_job
    from spanrl.core.settings import get_settings

    spec = _agent_spec(agent)
    chosen = _recipe(recipe)
    modes = _heldout_modes(heldout_modes)
    plan = spec.demo_plan(get_settings().model)  # the agent's demo with this base policy
    size = {**plan["size"], **{k: v for k, v in {"iterations": iterations, "tasks": tasks, "group_size": group_size,
                                                  "heldout_tasks": heldout_tasks}.items() if v is not None}}
    options = {**plan["options"], **{k: v for k, v in {"ood_tasks": ood_tasks, "train_task_set": train_task_set or None,
                                                        "heldout_modes": modes, "logprob_shift": logprob_shift}.items()
                                     if v is not None}}
    was_up = Stack().running("trainer")
    if not was_up:  # the run's trainer settings, unless set in the environment
        for k, v in demo_trainer_env(plan["trainer_env"], chosen).items():
            setdefault_env(k, v)
        setdefault_env("SPANRL_TRAIN_AGENTS", spec.train_agents)  # read by the stream job at start
    elif StreamSettings().train_agents != spec.train_agents:
        console.print(f"[yellow]the stack is up: its stream job keeps its agent selection; {agent}'s run "
                      f"trains {spec.train_agents or 'every agent'} (restart the stack to apply)[/yellow]")
    _check_free_space("train")
    stack = _fresh_run(re.sub(r"[^A-Za-z0-9_.-]+", "-", spec.name))  # the run: <agent>-<UTC time>
    _up_or_exit(stack)
    try:
        summary = run_main_job(MainJobConfig(agent=agent, iterations=size["iterations"],
                                             tasks_per_iteration=size["tasks"], group_size=size["group_size"],
                                             heldout_tasks=size["heldout_tasks"], **options,
                                             out_dir=Path(out)), console=console)
    finally:
        if not (keep_up or was_up):
            stack.down()
    console.print(f"[bold green]done[/bold green]: {summary['paths']}")


#: ``spanrl demo`` is ``spanrl train`` (the name ``make demo`` and earlier documents use)
app.command("demo", help="The same command as `train` (make demo: the math agent at its demo size).")(train)


@app.command()
def study(
    seeds: int = typer.Option(3, help="how many run seeds (first_seed, first_seed + 1, ...)"),
    first_seed: int = typer.Option(0, help="the first run seed"),
    agent: str = typer.Option("math", help="the agent spec: module:attribute (an AgentSpec on PYTHONPATH) or "
                              "math | sql | rag"),
    iterations: int = typer.Option(None, help="iterations per seed (default: the agent's demo size)"),
    tasks: int = typer.Option(None, help="new training tasks per iteration"),
    group_size: int = typer.Option(None, help="rollouts per task (GRPO group)"),
    heldout_tasks: int = typer.Option(None, help="held-out tasks evaluated before and after"),
    ood_tasks: int = typer.Option(100, help="out-of-distribution gsm_symbolic tasks evaluated before and after "
                                  "(0: none)"),
    train_task_set: str = typer.Option(None, help="training tasks: arith_word_mul_add_sub (default) | arith_word | "
                                   "arith_word_balanced"),
    out: str = typer.Option("results/study", help="where study.json, study.png and seed-<k>/ go"),
    repeat: bool = typer.Option(False, help="run every seed twice and compare the two runs (weights per "
                                "version, held-out episodes)"),
    recipe: str = typer.Option(None, help=RECIPE_HELP),
) -> None:
    """The main job once per run seed (a fresh stack run each), and one report across seeds:
    per seed and pooled paired differences, greedy and sampled, per kind, out of distribution."""
    from pathlib import Path

    from spanrl.infra.study import pooled_text, run_study

    if seeds < 1:
        raise typer.BadParameter("--seeds must be >= 1")
    _recipe(recipe)  # run_study applies it (SPANRL_RECIPE)
    given = {"iterations": iterations, "tasks": tasks, "group_size": group_size, "heldout_tasks": heldout_tasks,
             "ood_tasks": ood_tasks, "train_task_set": train_task_set}
    size = {**_agent_spec(agent).demo, "agent": agent, **{k: v for k, v in given.items() if v is not None}}
    _check_free_space("demo")
    try:
        report = run_study(list(range(first_seed, first_seed + seeds)), Path(out), size, console, repeat)
    except (RuntimeError, StackError) as exc:
        console.print(f"[red]study failed[/red]: {exc}")
        raise typer.Exit(1)
    for (mode, blk), what in [(x, "correct") for x in report["heldout"].items()] + \
            [(x, "mean reward") for x in report.get("heldout_reward", {}).items()]:
        p = blk["pooled_across_seeds"]
        console.print(f"held-out {mode}, {what}: per seed " + ", ".join(
            f"{x['difference']['estimate']:+.3f} [{x['difference']['low']:+.3f}, {x['difference']['high']:+.3f}]"
            for x in blk["per_seed"]) + f"; pooled {pooled_text(p)}")
    fmt = lambda d: " / ".join(f"{d[k]:+.3f}" if k in d else "n/a" for k in ("positive", "negative"))  # noqa: E731
    for p in report["per_seed"]:
        console.print(f"seed {p['seed']}: log-prob shift +/- under the final policy, iteration 0's completions "
                      f"{fmt(p['logprob_shift_of_iteration0_completions'])}, every iteration's "
                      f"{fmt(p['logprob_shift_of_all_completions'])} (nats/token)")
    for seed, r in report.get("repeatability", {}).items():
        console.print(f"seed {seed} twice: {'repeatable' if r['repeatable'] else 'NOT repeatable'} (held-out "
                      f"episodes); weights {'identical' if r['weights_identical'] else 'not identical'}: identical "
                      f"weights at versions {r['identical_versions']} of {r['versions_compared']}; "
                      + ", ".join(f"{m}: same final reward on {x['same_final_reward']:.0%} of tasks"
                                  for m, x in r["heldout"].items()))
    console.print(f"[bold]{'target met' if report['target_met'] else 'target not met'}[/bold]: "
                  f"{Path(out) / 'study.json'}, {Path(out) / 'study.png'}")


@app.command("eval")
def eval_cmd(
    policy: list[str] = typer.Option(["base"], help="base or RUN:VERSION (repeat: compared on the same tasks, "
                                     "paired differences against the first)"),
    agent: str = typer.Option(None, help="runner callable or agent spec, module:attribute (default: the runner "
                              "of the task set's agent; the math agent for arith_word/gsm_symbolic)"),
    task_set: str = typer.Option("arith_word", help="arith_word | gsm_symbolic (math) | AGENT:SPLIT, AGENT a "
                                 "spec's module:attribute or math | sql | rag, e.g. sql:heldout, "
                                 "my_pkg.my_agent:spec:heldout"),
    seed: int = typer.Option(1000, help="task seed (the main job trains on seed 0; 1000 is held out: "
                             "examples/math_agent/tasks.py TRAIN_SEED, HELDOUT_SEED)"),
    tasks: int = typer.Option(200, help="number of tasks"),
    samples: int = typer.Option(1, help="episodes per task"),
    temperature: float = typer.Option(0.0, help="sampling temperature of every call (0: greedy); "
                                      "negative: the agent's own"),
    concurrency: int = typer.Option(8, help="episodes in flight"),
    out: str = typer.Option("results/eval", help="where NAME.json and NAME.png go"),
    name: str = typer.Option("eval", help="report name"),
) -> None:
    """Evaluate an agent on held-out tasks under one or more policies (base model or a
    verified checkpoint, pinned in vLLM for the evaluation and restored after). Calls are
    recorded on the evaluation topics (spans.eval, rewards.eval), never trained on. Writes
    JSON + PNG with 95% intervals and paired differences."""
    from pathlib import Path

    from spanrl.infra.evaluation import EvalConfig, EvalError, evaluate

    if agent is None:
        from spanrl.infra.agents import split_task_set

        agent = _agent_spec((split_task_set(task_set) or ("math", ""))[0]).runner_ref
    cfg = EvalConfig(policies=list(policy), agent=agent, task_set=task_set, seed=seed, tasks=tasks,
                     samples=samples, temperature=None if temperature < 0 else temperature,
                     concurrency=concurrency, out_dir=Path(out), name=name)
    try:
        report = evaluate(cfg, console=console)
    except EvalError as exc:
        console.print(f"[red]eval failed[/red]: {exc}")
        raise typer.Exit(2)
    for k, d in report["paired"].items():
        console.print(f"{k}: reward {d['mean_reward']['estimate']:+.3f} [{d['mean_reward']['low']:+.3f}, "
                      f"{d['mean_reward']['high']:+.3f}], success {d['success_rate']['estimate']:+.3f} "
                      f"[{d['success_rate']['low']:+.3f}, {d['success_rate']['high']:+.3f}] over {d['tasks']} tasks")
    console.print(f"{report['paths']}")


@app.command()
def replay(
    suffix: str = typer.Option(..., help="names the output topics (transitions.<suffix>, samples.<suffix>) and the new run"),
    credit_rule: str = typer.Option("identical", help="identical | scaled:<factor> | discounted:<gamma> "
                                    "| return_to_go:<gamma>"),
    air_rules: str = typer.Option(None, help="AIR intermediate rewards, FACT:REWARD,... (e.g. tool_error:-0.1; "
                                  "default: none; the live job's SPANRL_AIR_RULES is not used)"),
    train_agents: str = typer.Option(None, help="whose calls train: comma-separated agent names or re:EXPR "
                                     "(default: every call; the live job's SPANRL_TRAIN_AGENTS is not used)"),
    since: str = typer.Option(None, help="replay from this time (ISO 8601, UTC) instead of the beginning"),
    train_from: str = typer.Option(None, help="RUN:VERSION checkpoint to train run replay-<suffix> from"),
    train_updates: int = typer.Option(1, help="updates of that training"),
) -> None:
    """Rebuild transitions/samples from the stored spans/rewards/rollouts under a new credit
    rule into new topics, then (optionally) train a new run from a chosen checkpoint."""
    import json
    from datetime import datetime, timezone

    from spanrl.infra.replay import ReplayConfig, replay as run_replay

    since_ms = None
    if since:
        ts = datetime.fromisoformat(since)
        since_ms = int((ts if ts.tzinfo else ts.replace(tzinfo=timezone.utc)).timestamp() * 1000)
    with console.status(f"replaying into transitions.{suffix} …"):
        result = run_replay(ReplayConfig(suffix=suffix, credit_rule=credit_rule, since_ms=since_ms,
                                         train_agents=train_agents, air_rules=air_rules,
                                         train_from=train_from, train_updates=train_updates), log=console.print)
    console.print_json(json.dumps(result))


@app.command()
def chaos(
    faults: str = typer.Option(None, help="comma-separated faults (default: all): worker,trainer,"
                               "trainer_rank,bridge,proxy,runner,kafka,minio,vllm, and kafka_broker,"
                               "kafka_controller on a 3-broker cluster (the stack restarted as one)"),
    tasks: int = typer.Option(6, help="tasks per fault run"),
    group_size: int = typer.Option(4, help="rollouts per task"),
    calls: int = typer.Option(3, help="LLM calls per rollout"),
    out: str = typer.Option("results", help="where chaos.json goes"),
    keep_up: bool = typer.Option(False, help="leave the stack running afterwards"),
    reuse_stack: bool = typer.Option(False, help="keep a stack left up by an earlier `chaos --keep-up`"),
) -> None:
    """Fault injection: for each fault, run a known workload, SIGKILL the component mid-run,
    restart it, and account for every acknowledged call (results/chaos.json). Restarts the
    stack with short timeouts first. Exits 1 unless every fault ends with nothing missing or
    duplicated."""
    from pathlib import Path

    from spanrl.infra.chaos import FAULTS, ChaosConfig, run_chaos

    names = tuple(_names(faults) or FAULTS)
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise typer.BadParameter(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    _check_free_space("chaos")
    cfg = ChaosConfig(faults=names, tasks=tasks, group_size=group_size, calls=calls, out_dir=Path(out),
                      restart_stack=not reuse_stack)
    try:
        result = run_chaos(cfg, say=console.print)
    finally:
        if not keep_up:
            Stack().down()
    table = Table(title=f"chaos ({result['run']})")
    for col in ("fault", "expected", "produced", "dead-lettered", "missing", "duplicated", "recovery s",
                "settled s", "also restarted", "ok"):
        table.add_column(col)
    for f in result["faults"]:
        table.add_row(f["fault"], str(f["expected"]), str(f["produced"]), str(f["dead_lettered"]),
                      str(f["missing"]), str(f["duplicated"]), str(f["recovery_s"]), str(f["settled_s"]),
                      ",".join(f["also_restarted"]) or "-", "[green]yes[/green]" if f["ok"] else "[red]no[/red]")
    console.print(table)
    console.print(f"{Path(out) / 'chaos.json'}")
    raise typer.Exit(0 if result["ok"] else 1)


#: ``spanrl --help``'s line for the commands whose docstring's first sentence is longer than a line
SHORT_HELP = {
    "calls": "Each LLM call of ended attempts: its agent, how it was resolved, trained or excluded.",
    "clean": "Delete the checkpoints of the matching runs (MinIO objects and local copies).",
    "train": "Train an agent (--agent module:attribute) on the stack, evaluated before and after.",
    "demo": "The same as train (make demo: the math agent at its demo size).",
    "study": "The main job once per run seed, and one report across the seeds.",
    "eval": "Evaluate an agent on held-out tasks under one or more policies.",
    "replay": "Rebuild transitions from the stored spans under a new credit rule; optionally train.",
    "chaos": "SIGKILL components mid-run and account for every acknowledged call.",
    "test": "Start the stack, run a test tier (--tier fast | slow | all), stop the stack.",
}


def first_sentence(doc: str) -> str:
    """The first sentence of ``doc``'s first paragraph, on one line."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[:end + 1]


def one_line_help(typer_app: typer.Typer, short: dict[str, str]) -> None:
    """Give each command of ``typer_app`` and of its groups one line in ``--help``: ``short``'s
    entry for its name, else its docstring's first sentence."""
    import inspect

    for info in typer_app.registered_commands:
        name = info.name or info.callback.__name__.replace("_", "-")
        info.short_help = info.short_help or short.get(name) or first_sentence(inspect.getdoc(info.callback) or "")
    for group in typer_app.registered_groups:
        one_line_help(group.typer_instance, short)


one_line_help(app, SHORT_HELP)


if __name__ == "__main__":
    app()
