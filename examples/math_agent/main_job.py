"""The main job: a calculator math agent learns through the whole spanrl loop.

One iteration (LightningRL training loop, arXiv 2508.03680 §3.4, run through Kafka):

    tasks topic ─▶ Runner (this process) runs the AutoGen agent group_size times per task,
    every LLM call through the proxy ─▶ spans; rewards; rollout lifecycle events
    ─▶ Faust (stream worker): transitions (reward = R) ─▶ samples (GRPO advantages)
    ─▶ trainer (DeepSpeed): update, checkpoint to MinIO, announcement on `checkpoints`
    ─▶ reloader: vLLM reloads the new weights; the proxy stamps the new policy version.

The job waits for each stage by reading the topics themselves (never by sleeping a
guessed time), and writes ``results/summary.json`` and ``results/reward_curve.png``.

Learning is measured on tasks never trained on: before iteration 0 the base policy and
after the last iteration the final checkpoint are evaluated (``infra/evaluation.py``, on
the evaluation topics) on ``heldout_tasks`` problems of ``heldout_seed`` (training uses
``seed``; the two sets share no question), each in two modes: ``sampled`` (the agent's own
sampling, temperature 1.0: the agent as it runs) and ``greedy`` (temperature 0: the
policy's mode), with 95% intervals and the paired difference final - base
(``results/heldout-<mode>.json`` / ``.png``).
"""
from __future__ import annotations

import asyncio
import functools
import json
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from aiokafka import AIOKafkaConsumer, TopicPartition
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from examples.math_agent.tasks import HELDOUT_SEED, TRAIN_SEED
from spanrl.core.settings import Settings, TrainerConfig, env_with_prefix, get_settings
from spanrl.infra.admin import admin_headers, request_training
from spanrl.schemas import decode
from spanrl.schemas import topics as T
from spanrl.trainer import tracking


#: what the main job adds to its trainer's settings when it starts the stack (an environment value
#: wins): it drives the trainer, one update per iteration on exactly that iteration's samples
#: (barrier batching, ``POST /admin/train``), so a run seed repeats the run. Every other setting is
#: the recipe's: TrainerConfig's own defaults are recipe ``default`` (spanrl/core/recipes.py), or
#: the recipe ``SPANRL_RECIPE`` / ``--recipe`` names.
DRIVER_TRAINER_ENV = TrainerConfig.env(batching="barrier")


def demo_trainer_env(model_env: dict[str, str], recipe: str | None = None) -> dict[str, str]:
    """The trainer settings a run of the main job applies (each unless the environment sets it):
    :data:`DRIVER_TRAINER_ENV`, and the agent's per-model settings ``model_env``
    (``AgentSpec.demo_plan``'s ``trainer_env``) unless a recipe is chosen (``SPANRL_RECIPE``,
    ``--recipe``: the trainer reads it whole). Example: ``demo_trainer_env({"SPANRL_TRAINER_LR": "5e-5"})``
    is ``{"SPANRL_TRAINER_BATCHING": "barrier", "SPANRL_TRAINER_LR": "5e-5"}``."""
    return {**DRIVER_TRAINER_ENV, **({} if recipe else model_env)}


@dataclass
class MainJobConfig:
    """Size of the main job. ``stage_timeout_s`` bounds each wait (samples, checkpoint).

    Training tasks: ``tasks_per_iteration`` new tasks of ``task_set``/``seed`` per iteration
    (iteration i takes items ``i*T .. (i+1)*T-1``), each run ``group_size`` times. Held out:
    ``heldout_tasks`` tasks of ``heldout_seed``, evaluated before and after in each of
    ``heldout_modes`` (``sampled``: the agent's own sampling; ``greedy``: temperature 0;
    ``heldout_tasks = 0``: no evaluation)."""

    iterations: int = 4
    tasks_per_iteration: int = 6
    group_size: int = 6
    #: the agent spec (spanrl/infra/agents.py): module:attribute of an AgentSpec, or math | sql | rag
    agent: str = "math"
    task_set: str = "arith_word"  # the math agent's task set (other agents: their train/heldout splits)
    #: the math agent's training task set (None: ``task_set``); held-out tasks stay ``task_set``.
    #: Default: mul, add, sub in turn (examples/math_agent/tasks.py): chosen by study 3
    #: (docs/measured/learning.md), the only setting whose greedy held-out rate rose in each of 3 seeds
    train_task_set: str | None = "arith_word_mul_add_sub"
    seed: int = TRAIN_SEED
    heldout_seed: int = HELDOUT_SEED
    heldout_tasks: int = 200
    heldout_modes: tuple = ("sampled", "greedy")
    #: out of distribution, never trained on: base and final on ``ood_tasks`` tasks of
    #: ``ood_task_set`` (math agent only; 0: none, the demo's default: ~9 min here; the study
    #: evaluates 100), in each of ``heldout_modes``
    ood_task_set: str = "gsm_symbolic"
    ood_tasks: int = 0
    concurrency: int = 8
    #: score trained completions under each new policy (the log-prob shift); off: not scored, the
    #: summary's shift figures are empty. One vLLM prefill per completion (prompt log-probs bypass
    #: the prefix cache): ~6 s each for the 0.5B model's SQL calls on 2 CPU cores
    logprob_shift: bool = True
    rollout_timeout_s: float = 180.0
    stage_timeout_s: float = 900.0
    out_dir: Path = Path("results")


@dataclass
class IterationResult:
    iteration: int
    rollouts: int = 0
    rollouts_failed: int = 0
    transitions: int = 0
    samples: int = 0
    dead_letters: int = 0
    dead_letter_reasons: dict = field(default_factory=dict)
    mean_reward: float = 0.0
    format_rate: float = 0.0
    correct_rate: float = 0.0
    tool_use_rate: float = 0.0
    #: GRPO groups (tasks) whose rollouts all got the same reward: zero advantage, no signal
    zero_variance_groups: int = 0
    groups: int = 0
    policy_versions_served: list = field(default_factory=list)
    checkpoint_version: int | None = None
    checkpoints_announced: list = field(default_factory=list)
    #: per agent name: LLM calls seen, trained (transitions) and excluded (call-accounts topic)
    agents: dict = field(default_factory=dict)
    #: the stream job's agent selection these calls were assembled under (call accounts)
    selection: list = field(default_factory=list)
    rollout_ids: list = field(default_factory=list)
    #: logprob_shift of this iteration's own completions under the policy its update made
    #: (one update: did it raise what it rewarded?)
    logprob_shift_own: dict = field(default_factory=dict)
    #: logprob_shift of iteration 0's completions under the same policy (the drift so far;
    #: the last iteration's is the run's final shift)
    logprob_shift_iteration0: dict = field(default_factory=dict)
    wall_s: float = 0.0


class TopicReader:
    """Reads topics from remembered end offsets on (read_committed), decoding Avro."""

    def __init__(self, settings: Settings, topics: list[T.Topic]):
        self.s = settings
        self.topics = topics
        self.consumer: AIOKafkaConsumer | None = None

    async def start(self) -> None:
        self.consumer = AIOKafkaConsumer(bootstrap_servers=self.s.kafka_bootstrap, enable_auto_commit=False,
                                         isolation_level="read_committed", auto_offset_reset="earliest")
        await self.consumer.start()
        parts = [TopicPartition(t.name, p) for t in self.topics for p in range(t.partitions)]
        self.consumer.assign(parts)
        ends = await self.consumer.end_offsets(parts)
        for tp, off in ends.items():
            self.consumer.seek(tp, off)

    async def poll(self, timeout_ms: int = 500) -> list[tuple[str, dict, int, int]]:
        """(topic, record, partition, offset) of what arrived within ``timeout_ms``."""
        batches = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=5000)
        out = []
        for tp, records in batches.items():
            rec_type = T.BY_NAME[tp.topic].record
            for r in records:
                out.append((tp.topic, decode(rec_type, r.value), r.partition, r.offset))
        return out

    async def stop(self) -> None:
        if self.consumer:
            await self.consumer.stop()


def _get_json(url: str, tries: int = 5) -> dict:
    """GET a service's JSON status; a busy service (training holds both cores) gets a few
    retries before the error is raised."""
    for attempt in range(tries):
        try:
            r = httpx.get(url, timeout=10, headers=admin_headers(get_settings()))
            r.raise_for_status()
            return r.json()
        except httpx.HTTPError:
            if attempt == tries - 1:
                raise
            time.sleep(1.0 + attempt)
    return {}


def _trainer_status(s: Settings) -> dict:
    return _get_json(f"http://{s.host}:{s.trainer_port}/status")


def samples_missing(ours: set[str], accounts: list[dict], samples: list[dict], dead_ids: set[str]) -> set:
    """``(rollout_id, span_id)`` of every trained call of this job's emitted attempts (their
    call accounts, ``trained`` true) whose sample has not been read yet; rollouts with a dead
    letter are left out (their calls may never become samples). A group's samples can arrive
    over several polls: counting rollouts with *some* sample would let a barrier update start
    before the group's last samples are in, and wait for them for ever."""
    want = {(a["rollout_id"], c["span_id"]) for a in accounts
            if a["rollout_id"] in ours and a["rollout_id"] not in dead_ids and a["outcome"] == "emitted"
            for c in a["calls"] if c["trained"]}
    return want - {(x["transition"]["rollout_id"], x["transition"]["span_id"]) for x in samples}


def _served_version(s: Settings) -> int:
    return int(_get_json(f"http://{s.host}:{s.reloader_port}/status").get("served_version") or 0)


async def _run_iteration(it: int, cfg: MainJobConfig, s: Settings, pool: list[dict], progress, bar) -> IterationResult:
    from spanrl.infra.agents import load_agent_spec
    from spanrl.infra.evaluation import load_agent
    from spanrl.infra.replay import agent_counts
    from spanrl.producers.runner import Runner, publish_tasks

    res = IterationResult(iteration=it)
    t0 = time.monotonic()
    reader = TopicReader(s, [T.ROLLOUTS, T.REWARDS, T.TRANSITIONS, T.SAMPLES, T.DEAD_LETTER, T.CHECKPOINTS,
                             T.CALL_ACCOUNTS])
    await reader.start()
    version_before = _served_version(s)
    tasks = pool[it * cfg.tasks_per_iteration:(it + 1) * cfg.tasks_per_iteration]
    now_ms = int(time.time() * 1000)
    await publish_tasks([
        {"task_id": t["task_id"], "payload": json.dumps(t), "group_size": cfg.group_size,
         "timeout_s": cfg.rollout_timeout_s, "created_ms": now_ms} for t in tasks
    ], settings=s)
    n_rollouts = cfg.tasks_per_iteration * cfg.group_size
    progress.update(bar, description=f"iter {it}: rollouts", total=n_rollouts, completed=0)

    runner = Runner(load_agent(load_agent_spec(cfg.agent).runner_ref), settings=s, concurrency=cfg.concurrency,
                    timeout_s=cfg.rollout_timeout_s,
                    group_id="spanrl-main-job")
    ended: dict[str, str] = {}
    rewards: dict[str, float] = {}
    components: dict[str, dict] = {}
    transitions: dict[str, list[dict]] = {}
    samples: list[dict] = []
    dead: list[dict] = []
    accounts: list[dict] = []
    checkpoint_version = None
    checkpoints: list[int] = []
    samples_next: dict[int, int] = {}

    ours: set[str] = set()  # this job's rollout ids (what the runner started): count only these
    episodes: dict[str, dict] = {}

    def note_results() -> None:
        for group in (run_task.result() if run_task.done() and not run_task.exception() else []):
            for a in group:
                ours.add(a.rollout_id)
                if isinstance(a.result, dict):
                    episodes[a.rollout_id] = a.result

    def absorb(records):
        for topic, rec, partition, offset in records:
            if topic == T.ROLLOUTS.name and rec["status"] != "started":
                ended[rec["rollout_id"]] = rec["status"]
            elif topic == T.REWARDS.name and rec["final"]:
                rewards[rec["rollout_id"]] = rec["value"]
                components[rec["rollout_id"]] = rec["components"]
            elif topic == T.TRANSITIONS.name:
                transitions.setdefault(rec["rollout_id"], []).append(rec)
            elif topic == T.SAMPLES.name:
                samples.append(rec)
                # the trainer's trained offset of a partition is the offset after the last
                # sample it trained on (transaction markers take offsets, so the topic's
                # end offset can stay ahead of it)
                samples_next[partition] = max(samples_next.get(partition, 0), offset + 1)
            elif topic == T.DEAD_LETTER.name:
                dead.append(rec)
            elif topic == T.CALL_ACCOUNTS.name:
                accounts.append(rec)
            elif topic == T.CHECKPOINTS.name and rec.get("event", "published") == "published":
                checkpoints.append(rec["version"])

    run_task = asyncio.create_task(runner.run(max_tasks=cfg.tasks_per_iteration))
    # Stage 1: rollouts end (runner) and every ended rollout is accounted for downstream.
    deadline = time.monotonic() + cfg.stage_timeout_s
    while time.monotonic() < deadline:
        absorb(await reader.poll())
        progress.update(bar, completed=len(ended))
        note_results()
        sampled = {x["transition"]["rollout_id"] for x in samples}
        dead_ids = {d["rollout_id"] for d in dead if d.get("rollout_id")}
        accounted = {a["rollout_id"] for a in accounts}
        if run_task.done() and len(ours) >= n_rollouts and ours <= (sampled | dead_ids) and ours <= accounted \
                and not samples_missing(ours, accounts, samples, dead_ids):
            break
        if run_task.done() and run_task.exception():
            raise run_task.exception()
    else:
        progress.console.print(f"[yellow]iteration {it}: samples stage timed out[/yellow]")
    await run_task
    # Stage 2: the trainer has trained past every sample of this iteration (its trained
    # offsets, which go into the checkpoint manifest), and the reloader serves that version.
    # A trainer with barrier batching trains exactly this iteration's samples when asked; one
    # with groups batching (the default recipe: a stack started by `make up`) too, before its count rule.
    progress.update(bar, description=f"iter {it}: training + reload", total=None)
    if samples and _trainer_status(s).get("batching") in ("barrier", "groups"):
        request_training(s, samples_next)
    deadline = time.monotonic() + cfg.stage_timeout_s
    while samples and time.monotonic() < deadline:
        absorb(await reader.poll())
        st = _trainer_status(s)
        trained = st.get("trained_offsets", {})
        if all(trained.get(f"{T.SAMPLES.name}:{p}", 0) >= nxt for p, nxt in samples_next.items()):
            if st.get("version", 0) > version_before and _served_version(s) >= st["version"]:
                checkpoint_version = st["version"]
                break
    else:
        if samples:
            progress.console.print(f"[yellow]iteration {it}: training/reload stage timed out[/yellow]")
    await reader.stop()

    # only this job's records: the topics also hold other runs' (e.g. late dead letters of
    # attempts a test run left behind)
    note_results()
    ended = {r: v for r, v in ended.items() if r in ours}
    transitions = {r: v for r, v in transitions.items() if r in ours}
    samples = [x for x in samples if x["transition"]["rollout_id"] in ours]
    dead = [d for d in dead if d.get("rollout_id") in ours]
    res.agents = agent_counts([a for a in accounts if a["rollout_id"] in ours])
    res.selection = sorted({a["selection"] for a in accounts if a["rollout_id"] in ours})
    res.rollouts = len(ended)
    res.rollout_ids = sorted(ended)
    res.rollouts_failed = sum(1 for v in ended.values() if v != "succeeded")
    res.transitions = sum(len(v) for v in transitions.values())
    res.samples = len(samples)
    res.dead_letters = len(dead)
    for d in dead:
        res.dead_letter_reasons[d["reason"]] = res.dead_letter_reasons.get(d["reason"], 0) + 1
    vals = [rewards.get(r, 0.0) for r in ended]
    n_ended = max(1, len(ended))
    res.mean_reward = sum(vals) / len(vals) if vals else 0.0
    res.format_rate = sum(1 for r in ended if components.get(r, {}).get("format", 0) > 0) / n_ended
    res.correct_rate = sum(1 for r in ended if components.get(r, {}).get("correct", 0) > 0) / n_ended
    res.tool_use_rate = sum(1 for r in ended if episodes.get(r, {}).get("tool_calls", 0) > 0) / n_ended
    by_task: dict[str, list[float]] = {}
    for group in run_task.result():
        for a in group:
            by_task.setdefault(a.task_id, []).append(rewards.get(a.rollout_id, 0.0))
    res.groups = len(by_task)
    res.zero_variance_groups = sum(1 for v in by_task.values() if max(v) == min(v))
    res.policy_versions_served = sorted({t["policy_version"] for v in transitions.values() for t in v})
    res.checkpoint_version = checkpoint_version
    res.checkpoints_announced = checkpoints
    res.wall_s = round(time.monotonic() - t0, 1)
    res._samples = samples  # kept for the log-prob check, not serialised
    return res


#: sequences per scoring request (one vLLM forward over all of them; bounded so a request
#: stays well inside its time-out on 2 CPU cores)
SCORE_BATCH = 16


def _logprobs_under_served(s: Settings, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """Summed log p(completion | prompt) in nats for each ``(prompt_ids, completion_ids)``, in
    order, under the policy vLLM serves now (``prompt_logprobs``, ``SCORE_BATCH`` sequences per
    request). Raises httpx.HTTPStatusError when vLLM refuses a request."""
    out: list[float] = []
    for start in range(0, len(pairs), SCORE_BATCH):
        chunk = pairs[start:start + SCORE_BATCH]
        r = httpx.post(f"{s.vllm_url}/v1/completions", timeout=300, json={
            "model": s.model_name, "prompt": [p + c for p, c in chunk], "max_tokens": 1,
            "prompt_logprobs": 0, "temperature": 0.0})
        r.raise_for_status()
        choices = sorted(r.json()["choices"], key=lambda ch: ch["index"])
        for (prompt_ids, completion_ids), ch in zip(chunk, choices, strict=True):
            plp = ch["prompt_logprobs"]
            out.append(sum(float(plp[pos][str(tok)]["logprob"])
                           for pos, tok in enumerate(completion_ids, start=len(prompt_ids))))
    return out


def logprob_shift(samples: list[dict], logprobs_of) -> dict[str, dict]:
    """How far the policy moved on completions it was trained on, split by advantage sign.

    For every sample with a non-empty completion, all of them (the result must not depend
    on the order samples arrived in), the token-weighted mean log-prob per token under the
    behaviour policy (``behaviour_logprobs``, recorded by the proxy when the completion was
    sampled) and under the policy served now (``logprobs_of(pairs)``: for a list of
    ``(prompt_ids, completion_ids)``, the summed log-prob in nats of each, in order; one call). A policy-gradient step should raise the likelihood of
    positive-advantage completions (``delta`` > 0) and lower that of negative ones.

    Args:
        samples: ``sample`` records (schemas/avro/sample.v2) as dicts.
        logprobs_of: callable from a list of (prompt ids, completion ids) to the summed
            log p(completion | prompt) of each, nats.
    Returns:
        ``{"positive"|"negative": {"completions", "tokens", "mean_logprob_behaviour",
        "mean_logprob_final", "delta"}}``, a sign absent when no sample has it; units nats/token.
    """
    out: dict[str, dict] = {}
    scored = [x for x in samples if x["transition"]["completion_token_ids"] and x["advantage"] != 0]
    final = logprobs_of([(x["transition"]["prompt_token_ids"], x["transition"]["completion_token_ids"])
                         for x in scored]) if scored else []
    for sign, keep in (("positive", lambda a: a > 0), ("negative", lambda a: a < 0)):
        chosen = [(x, f) for x, f in zip(scored, final, strict=True) if keep(x["advantage"])]
        if not chosen:
            continue
        n_tok = sum(len(x["transition"]["completion_token_ids"]) for x, _ in chosen)
        before = sum(sum(x["transition"]["behaviour_logprobs"]) for x, _ in chosen) / n_tok
        after = sum(f for _, f in chosen) / n_tok
        out[sign] = {"completions": len(chosen), "tokens": n_tok, "mean_logprob_behaviour": before,
                     "mean_logprob_final": after, "delta": after - before}
    return out


def logprob_shift_all(per_iteration: list[list[dict]], logprobs_of) -> dict:
    """:func:`logprob_shift` of every completion the job trained on, each against the policy
    that sampled it (its recorded behaviour log-probs), under the policy served now: pooled
    (``all``) and per iteration (``per_iteration[k]``: iteration k's samples). Every completion
    is scored once (one ``logprobs_of`` call). Later iterations' completions were sampled by
    later policies, so the pooled figure charges each completion only the drift since its own
    iteration; ``per_iteration[0]`` equals ``logprob_shift`` of iteration 0's samples.
    Example: iterations [[+a: -1.0 -> -0.8 nats over 2 tokens], [+b: -0.5 -> -0.6 over 3]]
    -> all positive delta (-1.4 - -1.5) / 5 = +0.02 nats/token; per iteration +0.1, -0.0333."""
    keep = lambda x: bool(x["transition"]["completion_token_ids"]) and x["advantage"] != 0  # noqa: E731
    scored = [x for xs in per_iteration for x in xs if keep(x)]
    values = logprobs_of([(x["transition"]["prompt_token_ids"], x["transition"]["completion_token_ids"])
                          for x in scored]) if scored else []
    by_id = {id(x): v for x, v in zip(scored, values, strict=True)}
    cached = lambda xs: lambda _pairs: [by_id[id(x)] for x in xs if keep(x)]  # noqa: E731
    every = [x for xs in per_iteration for x in xs]
    return {"all": logprob_shift(every, cached(every)),
            "per_iteration": [logprob_shift(xs, cached(xs)) for xs in per_iteration]}


def _shift_text(shift: dict) -> str:
    """``+0.123 / -0.456`` from a :func:`logprob_shift` result (``n/a`` for an absent sign)."""
    return " / ".join(f"{shift[k]['delta']:+.3f}" if k in shift else "n/a" for k in ("positive", "negative"))


#: held-out evaluation modes: the temperature every call gets (None: the agent's own)
HELDOUT_MODES = {"sampled": None, "greedy": 0.0}


def _is_math(cfg: MainJobConfig) -> bool:
    """Whether the job's agent is the math agent (by short name or by reference): it alone has
    named task sets (``task_set``, ``train_task_set``) and the out-of-distribution set."""
    from spanrl.infra.agents import load_agent_spec

    return load_agent_spec(cfg.agent) is load_agent_spec("math")


def _task_set(cfg: MainJobConfig, split: str) -> str:
    """The task set name of ``split`` (spanrl/infra/agents.py ``load_split``): the math agent's
    named set (its seeds separate train and held out), else ``AGENT:SPLIT``."""
    if not _is_math(cfg):
        return f"{cfg.agent}:{split}"
    return cfg.train_task_set or cfg.task_set if split == "train" else cfg.task_set


def _heldout_eval(cfg: MainJobConfig, s: Settings, spec: str, mode: str, console, ood: bool = False) -> dict:
    """Evaluate policy ``spec`` in ``mode`` on the held-out tasks (``ood``: the
    out-of-distribution set ``cfg.ood_task_set``, ``cfg.ood_tasks`` of them)."""
    from spanrl.infra.evaluation import EvalConfig, evaluate

    if mode not in HELDOUT_MODES:
        raise ValueError(f"unknown held-out mode {mode!r}; known: {', '.join(HELDOUT_MODES)}")
    from spanrl.infra.agents import load_agent_spec

    ecfg = EvalConfig(policies=[spec], agent=load_agent_spec(cfg.agent).runner_ref,
                      task_set=cfg.ood_task_set if ood else _task_set(cfg, "heldout"),
                      seed=cfg.heldout_seed, tasks=cfg.ood_tasks if ood else cfg.heldout_tasks,
                      samples=1, temperature=HELDOUT_MODES[mode], concurrency=cfg.concurrency,
                      out_dir=cfg.out_dir, name=f"{'ood' if ood else 'heldout'}-{mode}")
    return evaluate(ecfg, settings=s, console=console, write=False)


def per_kind(report: dict, kinds: dict[str, str]) -> dict[str, dict]:
    """Correct rate and mean reward per task kind and policy of an evaluation report: ``{kind:
    {policy: {"episodes", "correct", "reward"}}}``, ``kinds`` mapping task id -> kind
    (``AgentSpec.kind_of``; tasks not in it count as ``"all"``). Example: two
    ``add`` episodes of base, one correct with reward 1, one wrong with reward 0: ``{"add":
    {"base": {"episodes": 2, "correct": 0.5, "reward": 0.5}}}``."""
    out: dict[str, dict] = {}
    for policy, rep in report["policies"].items():
        counts: dict[str, list[float]] = {}
        for e in rep["per_episode"]:
            c = counts.setdefault(kinds.get(e["task_id"], "all"), [0, 0, 0.0])
            c[0] += 1
            c[1] += 1 if e["components"].get("correct", 0) > 0 else 0
            c[2] += e["reward"]
        for kind, (n, k, r) in sorted(counts.items()):
            out.setdefault(kind, {})[policy] = {"episodes": n, "correct": k / n, "reward": round(r / n, 6)}
    return out


def per_kind_paired(report: dict, kinds: dict[str, str]) -> dict[str, dict]:
    """The paired differences of every later policy against the first (base), per task kind:
    ``{kind: {"<policy> - <first>": paired report}}`` with the shape of the report's own
    ``paired`` (mean reward and success rate per task, paired bootstrap 95% intervals, tasks;
    ``spanrl.infra.evaluation.pair_against_first``) over the kind's tasks only. ``kinds`` as
    :func:`per_kind`'s. A kind whose tasks the policies do not share gets ``{"error": reason}``
    instead of a crash at the end of a run."""
    from spanrl.infra.evaluation import EvalError, pair_against_first

    kind_of = {e["task_id"]: kinds.get(e["task_id"], "all")
               for rep in report["policies"].values() for e in rep["per_episode"]}
    out: dict[str, dict] = {}
    for kind in sorted(set(kind_of.values())):
        subset = {policy: {"per_episode": [e for e in rep["per_episode"] if kind_of[e["task_id"]] == kind]}
                  for policy, rep in report["policies"].items()}
        try:
            out[kind] = pair_against_first(subset)
        except EvalError as exc:
            out[kind] = {"error": str(exc)}
    return out


def run_main_job(cfg: MainJobConfig, settings: Settings | None = None, console: Console | None = None) -> dict:
    """Evaluate the base policy on the held-out tasks, run ``cfg.iterations`` iterations,
    evaluate the final policy on the same held-out tasks; write summary.json,
    reward_curve.png and heldout-<mode>.json/.png; return the summary."""
    from spanrl.infra.agents import disjoint, load_agent_spec, load_split
    from spanrl.infra.evaluation import merge_reports, write_report

    s = settings or get_settings()
    console = console or Console()
    pool = load_split(_task_set(cfg, "train"), cfg.seed, cfg.iterations * cfg.tasks_per_iteration)
    if cfg.heldout_tasks > 0:
        heldout_set = load_split(_task_set(cfg, "heldout"), cfg.heldout_seed, cfg.heldout_tasks)
        if not disjoint(pool, heldout_set):
            raise ValueError(f"training seed {cfg.seed} and held-out seed {cfg.heldout_seed} share questions")
    results: list[IterationResult] = []
    score = functools.partial(_logprobs_under_served, s)  # logprob_shift's scorer: the served policy
    t_start = time.monotonic()
    modes = list(cfg.heldout_modes) if cfg.heldout_tasks > 0 else []
    base_reports = {}
    if modes and _served_version(s) != 0:
        console.print("[yellow]the stack serves a trained version: the base evaluation pins the base "
                      "model (version 0) for its duration[/yellow]")
    ood = _is_math(cfg) and cfg.ood_tasks > 0 and bool(modes)
    base_ood = {}
    for mode in modes:
        base_reports[mode] = _heldout_eval(cfg, s, "base", mode, console)
        if ood:
            base_ood[mode] = _heldout_eval(cfg, s, "base", mode, console, ood=True)
    t_train = time.monotonic()
    staleness_before = _trainer_status(s).get("staleness")
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as progress:
        bar = progress.add_task("starting", total=None)
        for it in range(cfg.iterations):
            res = asyncio.run(_run_iteration(it, cfg, s, pool, progress, bar))
            results.append(res)
            if cfg.logprob_shift and res.checkpoint_version is not None:  # served now: the policy this iteration's update made
                progress.update(bar, description=f"iter {it}: log-prob shift", total=None)
                res.logprob_shift_own = logprob_shift(res._samples, score)
                res.logprob_shift_iteration0 = res.logprob_shift_own if it == 0 else \
                    logprob_shift(results[0]._samples, score)
            tracking.log_once(s, s.run, "main_job", {it: tracking.iteration_scalars(asdict(res))})
            progress.console.print(
                f"iter {it}: rollouts={res.rollouts} transitions={res.transitions} samples={res.samples} "
                f"dead={res.dead_letters} reward={res.mean_reward:.3f} correct={res.correct_rate:.2f} "
                f"format={res.format_rate:.2f} tool={res.tool_use_rate:.2f} "
                f"zero-variance groups={res.zero_variance_groups}/{res.groups} "
                f"served={res.policy_versions_served} -> checkpoint v{res.checkpoint_version} ({res.wall_s}s)")
            if res.logprob_shift_own:
                progress.console.print("  log-prob shift +/- (nats/token) of its own completions: "
                                       f"{_shift_text(res.logprob_shift_own)}; of iteration 0's: "
                                       f"{_shift_text(res.logprob_shift_iteration0)}")
            for name, c in res.agents.items():
                progress.console.print(f"  agent {name}: calls={c['calls']} trained={c['trained']} "
                                       f"excluded={c['excluded']}")
    train_s = time.monotonic() - t_train
    from spanrl.trainer.staleness import status_delta

    # the staleness bound over this job's training: lag histogram of what the trainer trained
    # (trained version - behaviour version), samples refused (dead letter stale_sample) / kept
    staleness = status_delta(staleness_before, _trainer_status(s).get("staleness"))

    # Did the served policy change? Mean per-token log-prob of iteration 0's completions
    # with positive / negative advantage: behaviour (v0, recorded by the proxy) vs now.
    # (the last iteration's drift figure when its checkpoint was served: the same policy)
    shift, shift_all = {}, {}
    if cfg.logprob_shift:
        shift = results[-1].logprob_shift_iteration0 if results and results[-1].logprob_shift_iteration0 else \
            logprob_shift(results[0]._samples if results else [], score)
        # every trained completion, each against its own behaviour policy, under the final policy
        shift_all = logprob_shift_all([r._samples for r in results], score)
        console.print(f"log-prob shift +/- (nats/token) under the final policy: iteration 0's {_shift_text(shift)}; "
                      f"every iteration's {_shift_text(shift_all['all'])}")

    final_version = _served_version(s)
    heldout: dict[str, dict] = {}
    out = cfg.out_dir
    out.mkdir(parents=True, exist_ok=True)
    final_spec = f"{s.run}:{final_version}" if final_version > 0 else "base"
    if modes and final_spec == "base":
        console.print("[yellow]no checkpoint was served: the final policy is the base model[/yellow]")
    ood_reports: dict[str, dict] = {}
    for mode in modes:
        heldout[mode] = base_reports[mode] if final_spec == "base" else \
            merge_reports(base_reports[mode], _heldout_eval(cfg, s, final_spec, mode, console))
        write_report(heldout[mode], out, f"heldout-{mode}", s)
        if mode in base_ood:
            ood_reports[mode] = base_ood[mode] if final_spec == "base" else \
                merge_reports(base_ood[mode], _heldout_eval(cfg, s, final_spec, mode, console, ood=True))
            write_report(ood_reports[mode], out, f"ood-{mode}", s)
    spec = load_agent_spec(cfg.agent)
    trainer_status = _trainer_status(s)
    kinds = {t["task_id"]: spec.kind_of(t) for t in heldout_set} if modes else {}
    agents_total: dict[str, dict[str, int]] = {}
    for r in results:
        for name, c in r.agents.items():
            e = agents_total.setdefault(name, {"calls": 0, "trained": 0, "excluded": 0})
            for k in e:
                e[k] += c[k]
    summary = {
        "run": s.run,
        "agent": cfg.agent,
        "train_agents": sorted({sel for r in results for sel in r.selection}),
        "agents": dict(sorted(agents_total.items())),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "seed": s.seed,
        "rollout_temperature": s.rollout_temperature,  # SPANRL_ROLLOUT_TEMPERATURE (None: the agent's own)
        "recipe": s.recipe or "default",  # SPANRL_RECIPE (spanrl/core/recipes.py); unset: default
        # the stack's trainer's report of its recipe: its values and where they differ from it
        "trainer_recipe": trainer_status.get("recipe", {}),
        "trainer_settings": env_with_prefix("SPANRL_TRAINER_"),
        "trainer_updates": _trainer_updates(s),
        "iterations": [{k: v for k, v in asdict(r).items()} for r in results],
        "policy_versions_served": sorted({v for r in results for v in r.policy_versions_served}),
        "final_served_version": final_version,
        "staleness": staleness,
        "logprob_shift_of_iteration0_completions": shift,
        "logprob_shift_of_all_completions": shift_all,
        "heldout": {mode: _heldout_summary(r) for mode, r in heldout.items()},
        "heldout_per_kind": {mode: per_kind(r, kinds) for mode, r in heldout.items()},
        "heldout_per_kind_paired": {mode: per_kind_paired(r, kinds) for mode, r in heldout.items()},
        "ood": {mode: _heldout_summary(r) for mode, r in ood_reports.items()},
        "training_wall_s": round(train_s, 1),
        "wall_s": round(time.monotonic() - t_start, 1),
        "paths": {"summary": str(out / "summary.json"), "reward_curve": str(out / "reward_curve.png"),
                  **{f"heldout_{m}": str(out / f"heldout-{m}.json") for m in heldout},
                  **{f"heldout_{m}_png": str(out / f"heldout-{m}.png") for m in heldout},
                  **{f"ood_{m}": str(out / f"ood-{m}.json") for m in ood_reports}},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    for mode, kinds_paired in summary["heldout_per_kind_paired"].items():
        for kind, pairs in kinds_paired.items():
            for name, p in pairs.items():
                console.print(f"held-out {mode}, {kind}: " + (f"not paired: {p}" if name == "error" else
                              f"{name} over {p['tasks']} tasks: reward {_interval_text(p['mean_reward'])}, "
                              f"success {_interval_text(p['success_rate'])}"))
    _plot(results, summary["heldout"], out / "reward_curve.png")
    return summary


def _trainer_updates(s: Settings) -> list[dict]:
    """The update events of the stack's trainer for this run (its JSON-lines log), the
    numbers per update: samples, dropped zero-variance samples, steps, KL to the behaviour
    and the reference policy, advantages, loss."""
    path = s.state_dir / f"trainer-{s.run}.jsonl"
    keys = ("update", "version", "samples_received", "samples", "dropped_zero_variance", "steps", "mini_batches",
            "loss", "approx_kl", "ref_kl", "clip_frac", "grad_norm", "mean_return", "mean_advantage",
            "weighted_advantage", "advantage_std", "completion_tokens", "update_s")
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") == "update":
                out.append({k: e[k] for k in keys if k in e})
    return out


def _interval_text(iv: dict) -> str:
    """``+0.065 [+0.022, +0.107]`` of an interval's ``as_dict()``."""
    return f"{iv['estimate']:+.3f} [{iv['low']:+.3f}, {iv['high']:+.3f}]"


def _heldout_summary(report: dict) -> dict:
    """The held-out numbers people look for (the per-episode lists stay in heldout-<mode>.json)."""
    keys = ("episodes", "tasks", "failed_attempts", "mean_reward", "success_rate", "format_rate", "tool_use_rate",
            "mean_llm_calls", "wall_s")
    return {"task_set": report["config"]["task_set"], "seed": report["config"]["seed"],
            "temperature": report["config"]["temperature"],
            "policies": {p: {k: r.get(k) for k in keys} for p, r in report["policies"].items()},
            "paired": report["paired"]}


def _plot(results: list[IterationResult], heldout: dict, path: Path) -> None:
    """Left: training rollouts per iteration (reward, correct, format, tool use). Right:
    held-out correct rate of base and final per mode, with 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    xs = [r.iteration for r in results]
    ax.plot(xs, [r.mean_reward for r in results], marker="o", label="mean reward")
    ax.plot(xs, [r.correct_rate for r in results], marker="^", label="correct rate")
    ax.plot(xs, [r.format_rate for r in results], marker="s", linestyle="--", label="answer-format rate")
    ax.plot(xs, [r.tool_use_rate for r in results], marker="x", linestyle=":", label="calculator-use rate")
    for r in results:
        ax.annotate(f"v{r.policy_versions_served[-1] if r.policy_versions_served else '?'}",
                    (r.iteration, r.mean_reward), textcoords="offset points", xytext=(0, 6), fontsize=8)
    ax.set_xticks(xs)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("iteration (new training tasks, agent's own sampling)")
    ax.set_ylabel("rate / mean reward")
    ax.set_title("training rollouts: calculator math agent", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if heldout:
        modes = list(heldout)
        title = []
        for j, mode in enumerate(modes):
            h = heldout[mode]
            for i, p in enumerate(h["policies"]):
                iv = h["policies"][p]["success_rate"]
                x = j + (i - 0.5) * 0.38
                bx.bar(x, iv["estimate"], 0.38, yerr=[[iv["estimate"] - iv["low"]], [iv["high"] - iv["estimate"]]],
                       capsize=3, color=f"C{i}", label=("base" if p == "base" else "final") if j == 0 else None)
            for d in h["paired"].values():
                iv = d["success_rate"]
                title.append(f"{mode}: final - base {_interval_text(iv)}")
        first = heldout[modes[0]]
        n = next(iter(first["policies"].values()))["episodes"]
        bx.set_xticks(range(len(modes)), [f"{m}\n(T={'agent' if heldout[m]['temperature'] is None else heldout[m]['temperature']})"
                                          for m in modes])
        bx.set_ylim(0, 1.05)
        bx.set_ylabel("held-out correct rate (95% CI)")
        bx.set_title(f"held out: {n} tasks of {first['task_set']} seed {first['seed']}\n" + "\n".join(title),
                     fontsize=8)
        bx.legend(fontsize=8)
        bx.grid(axis="y", alpha=0.3)
    else:
        bx.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
