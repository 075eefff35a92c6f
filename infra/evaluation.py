"""Held-out evaluation of an agent under a chosen policy (``spanrl eval``, the main job,
the release gate).

For each policy (``base`` or ``RUN:VERSION``): the reloader pins it (downloads and
verifies the checkpoint, vLLM reloads it; ``trainer/reloader.py`` ``/admin/pin``), the
runner runs the agent callable on every task ``samples`` times through the proxy's
evaluation routes (``/eval/{temperature}/rollouts/...``, recorded on ``spans.eval``;
rewards and lifecycle on ``rewards.eval`` / ``rollouts.eval``), and the pin is dropped
again, so vLLM goes back to what the training run serves. The report is computed from
what the evaluation topics hold (final rewards and their components, LLM calls per
episode) plus the agent's own episode dict where it has one (``tool_calls``).

Per policy: mean reward (bootstrap 95% interval); per reward component its rate, the share of
episodes where it is > 0 (Wilson), and its mean (bootstrap) — the same number for a 0/1 component,
not for a graded one such as word F1; success = component ``correct``, format, tool use, mean LLM
calls per episode;
between two policies on the same tasks: paired differences of reward and success with
paired-bootstrap intervals (``spanrl/core/intervals.py``). JSON + PNG.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from spanrl.core import intervals, plugins
from spanrl.core.agent_spec import AgentSpec
from spanrl.core.settings import ReloaderConfig, Settings, get_settings
from spanrl.schemas import topics as T

SUCCESS_COMPONENT = "correct"
FORMAT_COMPONENT = "format"


class EvalError(RuntimeError):
    """An evaluation that cannot run: unknown policy, unverifiable checkpoint, no tasks,
    stack not reachable. The message says which."""


@dataclass
class EvalConfig:
    """What to evaluate. ``policies``: ``base`` or ``RUN:VERSION`` each; ``temperature``
    0 is greedy (then ``samples`` > 1 repeats the same answer; use a temperature);
    ``agent``: ``module:callable`` of a runner callable."""

    policies: list[str] = field(default_factory=lambda: ["base"])
    agent: str = "examples.math_agent.agent:math_agent"
    task_set: str = "arith_word"
    # examples.math_agent.tasks.HELDOUT_SEED (a literal: infra imports examples/ only lazily,
    # the packaged CLI does not ship them)
    seed: int = 1000
    tasks: int = 200
    samples: int = 1
    temperature: float | None = 0.0  # None: the agent's own sampling
    concurrency: int = 8
    timeout_s: float = 180.0
    out_dir: Path = Path("results/eval")
    name: str = "eval"


def parse_policy(spec: str, default_run: str | None = None) -> tuple[str | None, int]:
    """``"base"`` -> (None, 0); ``"RUN:VERSION"`` -> (RUN, VERSION); ``"VERSION"`` -> the
    default run. Raises EvalError for anything else."""
    spec = spec.strip()
    if spec == "base":
        return None, 0
    run, sep, version = spec.rpartition(":")
    if not sep:
        run, version = default_run or "", spec
    if not version.isdigit() or (not run and int(version) != 0):
        raise EvalError(f"policy must be 'base' or RUN:VERSION, got {spec!r}")
    return (run or None), int(version)


def load_agent(path: str) -> Callable:
    """The callable named ``module:attribute``, or the runner of the AgentSpec it names
    (``my_pkg.my_agent:spec``); EvalError when it does not exist."""
    try:
        found = plugins.resolve(path)
        return found.load_runner() if isinstance(found, AgentSpec) else found
    except (ImportError, AttributeError, ValueError) as exc:
        raise EvalError(f"agent {path!r} not found: {exc}") from exc


# ---- metrics (pure) --------------------------------------------------------------------

@dataclass
class Episode:
    """One evaluated attempt, from the evaluation topics (and the agent's returned dict)."""

    task_id: str
    rollout_id: str
    status: str  # succeeded | failed | timeout
    reward: float = 0.0  # final reward; 0 when none arrived (failed attempt)
    components: dict = field(default_factory=dict)
    llm_calls: int = 0
    tool_calls: int | None = None  # from the agent's episode dict, when it reports it


def policy_report(episodes: list[Episode], success: str = SUCCESS_COMPONENT, fmt: str = FORMAT_COMPONENT,
                  seed: int = 0) -> dict:
    """Metrics of one policy's episodes with 95% intervals (see module doc).

    Raises EvalError for no episodes."""
    n = len(episodes)
    if n == 0:
        raise EvalError("no episodes to report")
    rewards = [e.reward for e in episodes]
    names = sorted({k for e in episodes for k in e.components})
    rates = {k: intervals.wilson_interval(sum(1 for e in episodes if e.components.get(k, 0.0) > 0), n).as_dict()
             for k in names}
    means = {k: intervals.bootstrap_mean_interval([e.components.get(k, 0.0) for e in episodes], seed=seed).as_dict()
             for k in names}
    out = {
        "episodes": n,
        "tasks": len({e.task_id for e in episodes}),
        "failed_attempts": sum(1 for e in episodes if e.status != "succeeded"),
        "mean_reward": intervals.bootstrap_mean_interval(rewards, seed=seed).as_dict(),
        "component_rates": rates,
        "component_means": means,
        "success_rate": rates.get(success),
        "format_rate": rates.get(fmt),
        "mean_llm_calls": intervals.bootstrap_mean_interval([e.llm_calls for e in episodes], seed=seed).as_dict(),
        "tool_use_rate": None,
    }
    known = [e for e in episodes if e.tool_calls is not None]
    if known:
        out["tool_use_rate"] = intervals.wilson_interval(sum(1 for e in known if e.tool_calls > 0), len(known)).as_dict()
    return out


def per_task_means(episodes: list[Episode], value: Callable[[Episode], float]) -> dict[str, float]:
    """Mean of ``value`` over each task's episodes (the unit a paired comparison pairs)."""
    acc: dict[str, list[float]] = {}
    for e in episodes:
        acc.setdefault(e.task_id, []).append(value(e))
    return {k: sum(v) / len(v) for k, v in acc.items()}


def paired_report(a: list[Episode], b: list[Episode], success: str = SUCCESS_COMPONENT, seed: int = 0) -> dict:
    """Paired differences (b - a) over the tasks both policies ran: mean reward and success
    rate per task, paired bootstrap 95% intervals. Raises EvalError when no task is shared."""
    out: dict[str, Any] = {}
    for name, fn in (("mean_reward", lambda e: e.reward),
                     ("success_rate", lambda e: 1.0 if e.components.get(success, 0.0) > 0 else 0.0)):
        ma, mb = per_task_means(a, fn), per_task_means(b, fn)
        shared = sorted(set(ma) & set(mb))
        if not shared:
            raise EvalError("the two policies share no task")
        out[name] = intervals.paired_difference([ma[k] for k in shared], [mb[k] for k in shared],
                                                seed=seed).as_dict()
    out["tasks"] = len(shared)
    return out


# ---- plumbing: pin, run, read back ------------------------------------------------------

def _reloader(s: Settings) -> str:
    return f"http://{s.host}:{s.reloader_port}"


def _post(url: str, body: dict, s: Settings, timeout: float = 900.0) -> dict:
    from spanrl.core.edge import bearer_headers

    try:
        r = httpx.post(url, json=body, timeout=timeout, headers=bearer_headers(s.admin_token))  # /admin/* routes
    except httpx.HTTPError as exc:
        raise EvalError(f"{url} unreachable ({exc!r}): is the stack up? (spanrl stack up)") from exc
    try:
        answer = r.json()
    except ValueError:
        answer = {"error": "non_json", "detail": r.text[:300]}
    if r.status_code == 404:
        raise EvalError(f"unknown checkpoint: {answer.get('detail')}")
    if r.status_code == 409:
        raise EvalError(f"checkpoint does not verify (tampered or incomplete): {answer.get('detail')}")
    if r.status_code >= 400:
        raise EvalError(f"{url}: {r.status_code} {answer}")
    return answer


def pin(s: Settings, run: str | None, version: int) -> dict:
    """Ask the reloader to serve ``run:version`` (0 = base); EvalError on refusal."""
    return _post(f"{_reloader(s)}/admin/pin", {"run": run, "version": version}, s)


def unpin(s: Settings) -> dict:
    return _post(f"{_reloader(s)}/admin/unpin", {}, s)


async def read_since(s: Settings, start: dict) -> dict[str, list[dict]]:
    """Every record of the partitions in ``start`` (TopicPartition -> offset) from there to
    the current end (read_committed), decoded, by topic name."""
    from aiokafka import AIOKafkaConsumer

    from spanrl.schemas.codec import decode

    out: dict[str, list[dict]] = {tp.topic: [] for tp in start}
    c = AIOKafkaConsumer(bootstrap_servers=s.kafka_bootstrap, isolation_level="read_committed",
                         enable_auto_commit=False)
    await c.start()
    try:
        tps = list(start)
        c.assign(tps)
        end = await c.end_offsets(tps)
        for tp in tps:
            c.seek(tp, start[tp])
        while any([await c.position(tp) < end[tp] for tp in tps]):
            for tp, msgs in (await c.getmany(timeout_ms=1000, max_records=5000)).items():
                for m in msgs:
                    if m.offset < end[tp]:
                        out[tp.topic].append(decode(T.BY_NAME[tp.topic].record, m.value))
    finally:
        await c.stop()
    return out


def episodes_from_records(records: dict[str, list[dict]], attempts: list, eval_topics) -> list[Episode]:
    """Join the runner's attempts (spanrl.producers.runner.AttemptResult) with what the evaluation
    topics hold: final reward + components (rewards.eval), LLM calls (spans.eval: the proxy's
    records, kind llm; the agent framework's own spans of the same calls are not counted)."""
    rewards = {r["rollout_id"]: r for r in records.get(eval_topics.rewards.name, []) if r["final"]}
    calls: dict[str, int] = {}
    for sp in records.get(eval_topics.spans.name, []):
        if sp["kind"] == "llm" and sp.get("source") == "proxy":
            calls[sp["rollout_id"]] = calls.get(sp["rollout_id"], 0) + 1
    out = []
    for a in attempts:
        rw = rewards.get(a.rollout_id)
        tool_calls = a.result.get("tool_calls") if isinstance(a.result, dict) else None
        out.append(Episode(a.task_id, a.rollout_id, a.status, float(rw["value"]) if rw else 0.0,
                           dict(rw["components"]) if rw else {}, calls.get(a.rollout_id, 0),
                           int(tool_calls) if isinstance(tool_calls, (int, float)) else None))
    return out


async def run_policy_episodes(cfg: EvalConfig, s: Settings, tasks: list[dict], on_done=None) -> list[Episode]:
    """Run every task ``cfg.samples`` times with the evaluation runner and read the
    episodes back from the evaluation topics. ``on_done()`` after each attempt."""
    from spanrl.infra.replay import topics_end_offsets
    from spanrl.producers.kafka import Topics
    from spanrl.producers.runner import Runner, make_task

    eval_topics = Topics.evaluation()
    start = await topics_end_offsets(s, [eval_topics.spans, eval_topics.rewards])
    temp = "agent" if cfg.temperature is None else repr(float(cfg.temperature))
    runner = Runner(load_agent(cfg.agent), settings=s, topics=eval_topics, concurrency=cfg.concurrency,
                    timeout_s=cfg.timeout_s, proxy_url=f"{s.proxy_url}/eval/{temp}",
                    runner_id=f"eval-{cfg.name}", record_to="eval")

    async def one(task: dict, k: int):
        record = {**make_task(json.dumps(task), group_size=1, task_id=task["task_id"], timeout_s=cfg.timeout_s)}
        result = await runner.run_attempt(record, k)
        if on_done:
            on_done()
        return result

    try:
        attempts = await asyncio.gather(*(one(t, k) for t in tasks for k in range(cfg.samples)))
    finally:
        await runner.sink.stop()
    records = await read_since(s, start)
    return episodes_from_records(records, attempts, eval_topics)


async def gate_rewards(cfg: ReloaderConfig, s: Settings, name: str) -> dict[str, float]:
    """The release gate's evaluation (trainer/gate.py ``GateEvaluation``, the default of
    ``SPANRL_RELOADER_GATE_EVALUATION``): per-task reward of what vLLM serves now on the
    gate's held-out tasks, ``[gate_offset, gate_offset + gate_tasks)`` of ``gate_task_set``
    (a math task set or an agent's ``REF:SPLIT``, spanrl/infra/agents.py ``load_split``), the agent ``gate_agent`` run
    greedily through the proxy's evaluation routes (recorded on the evaluation topics)."""
    from spanrl.infra.agents import load_split

    tasks = load_split(cfg.gate_task_set, cfg.gate_seed, cfg.gate_offset + cfg.gate_tasks)[cfg.gate_offset:]
    run = EvalConfig(agent=cfg.gate_agent, temperature=0.0, concurrency=cfg.gate_concurrency, name=name)
    return per_task_means(await run_policy_episodes(run, s, tasks), lambda e: e.reward)


def episodes_of(policy_report_: dict) -> list[Episode]:
    """The Episodes of a policy report written by :func:`evaluate` (its ``per_episode``)."""
    return [Episode(**e) for e in policy_report_["per_episode"]]


def evaluate(cfg: EvalConfig, settings: Settings | None = None, tasks: list[dict] | None = None,
             console=None, write: bool = True) -> dict:
    """Evaluate each policy of ``cfg`` on the same tasks; write ``<out>/<name>.json`` and
    ``.png`` (unless ``write`` is False); return the report. Raises EvalError (see class doc)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    s = settings or get_settings()
    console = console or Console()
    if tasks is None:
        if cfg.tasks <= 0:
            raise EvalError("empty task set: --tasks must be positive")
        from spanrl.infra.agents import load_split

        try:
            tasks = load_split(cfg.task_set, cfg.seed, cfg.tasks)
        except (ValueError, ImportError) as exc:
            raise EvalError(str(exc)) from exc
    if not tasks:
        raise EvalError("empty task set")
    if cfg.samples <= 0:
        raise EvalError("--samples must be positive")
    specs = [(spec, *parse_policy(spec, s.run)) for spec in cfg.policies]
    if not specs:
        raise EvalError("no policy to evaluate")
    load_agent(cfg.agent)
    report: dict[str, Any] = {"name": cfg.name, "config": {k: str(v) if isinstance(v, Path) else v
                                                           for k, v in asdict(cfg).items()},
                              "task_ids": [t["task_id"] for t in tasks], "policies": {}, "paired": {}}
    t_all = time.monotonic()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        for spec, run, version in specs:
            total = len(tasks) * cfg.samples
            bar = progress.add_task(f"eval {spec}", total=total)
            t0 = time.monotonic()
            done = [0]

            def advance(spec=spec, bar=bar, total=total, t0=t0) -> None:
                progress.advance(bar)
                done[0] += 1
                # a log file gets no live bar: a line every 10%
                if not console.is_terminal and (done[0] % max(1, total // 10) == 0 or done[0] == total):
                    progress.console.print(f"eval {spec}: {done[0]}/{total} episodes ({time.monotonic() - t0:.0f}s)")

            served = pin(s, run, version)
            try:
                episodes = asyncio.run(run_policy_episodes(cfg, s, tasks, advance))
            finally:
                unpin(s)
            rep = policy_report(episodes)
            rep.update({"policy": spec, "run": run, "version": version, "served_uri": served.get("served_uri", ""),
                        "wall_s": round(time.monotonic() - t0, 1),
                        "per_episode": [asdict(e) for e in episodes]})
            report["policies"][spec] = rep
            progress.console.print(_line(spec, rep))
    report["paired"] = pair_against_first(report["policies"])
    report["wall_s"] = round(time.monotonic() - t_all, 1)
    if write:
        write_report(report, Path(cfg.out_dir), cfg.name, s)
    return report


def write_report(report: dict, out: Path, name: str, settings: Settings | None = None) -> None:
    """``out/name.json`` and ``out/name.png``; sets ``report["paths"]``. The report's scalars
    also go to the tracker (``SPANRL_TRACKER``) of the stack's run, ``RUN/eval/<name>``, x =
    the policy version evaluated (trainer/tracking.py ``report_scalars``)."""
    from spanrl.trainer import tracking

    out.mkdir(parents=True, exist_ok=True)
    report["paths"] = {"json": str(out / f"{name}.json"), "png": str(out / f"{name}.png")}
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot_report(report, out / f"{name}.png")
    s = settings or get_settings()
    tracking.log_once(s, s.run, f"eval/{name}", tracking.report_scalars(report))


def merge_reports(first: dict, second: dict) -> dict:
    """One report of two evaluations of the same tasks (e.g. before and after training):
    the policies of both and the paired differences of every later policy against the
    first. Raises EvalError when their task lists differ."""
    if first["task_ids"] != second["task_ids"]:
        raise EvalError("the two evaluations ran different tasks; they cannot be paired")
    policies = {**first["policies"], **second["policies"]}
    return {**first, "policies": policies, "paired": pair_against_first(policies),
            "wall_s": round(first.get("wall_s", 0) + second.get("wall_s", 0), 1)}


def pair_against_first(policies: dict[str, dict]) -> dict[str, dict]:
    """``{"<other> - <first>": paired_report}`` for every policy report after the first."""
    names = list(policies)
    first = episodes_of(policies[names[0]]) if names else []
    return {f"{other} - {names[0]}": paired_report(first, episodes_of(policies[other])) for other in names[1:]}


def _fmt(iv: dict | None) -> str:
    if not iv:
        return "n/a"
    return f"{iv['estimate']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]"


def _line(spec: str, rep: dict) -> str:
    return (f"{spec}: {rep['episodes']} episodes, reward {_fmt(rep['mean_reward'])}, "
            f"success {_fmt(rep['success_rate'])}, format {_fmt(rep['format_rate'])}, "
            f"tool use {_fmt(rep['tool_use_rate'])}, LLM calls {rep['mean_llm_calls']['estimate']:.2f}")


def plot_report(report: dict, path: Path) -> None:
    """Bars per policy (reward, success, format, tool use) with their 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("mean reward", "mean_reward"), ("success", "success_rate"), ("format", "format_rate"),
               ("tool use", "tool_use_rate")]
    pols = list(report["policies"])
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / max(1, len(pols))
    for i, p in enumerate(pols):
        rep = report["policies"][p]
        xs, ys, lo, hi = [], [], [], []
        for j, (_, key) in enumerate(metrics):
            iv = rep.get(key)
            if not iv:
                continue
            xs.append(j + (i - (len(pols) - 1) / 2) * width)
            ys.append(iv["estimate"])
            lo.append(iv["estimate"] - iv["low"])
            hi.append(iv["high"] - iv["estimate"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=f"{p} (n={rep['episodes']})")
    ax.set_xticks(range(len(metrics)), [m for m, _ in metrics])
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("rate / mean (95% CI)")
    title = f"held-out evaluation: {report['config']['task_set']} seed {report['config']['seed']}"
    for k, d in report["paired"].items():
        title += f"\n{k}: success {d['success_rate']['estimate']:+.3f} " \
                 f"[{d['success_rate']['low']:+.3f}, {d['success_rate']['high']:+.3f}]"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

