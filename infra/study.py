"""``spanrl study``: the main job once per seed, and one report across the seeds.

One run per setting proves nothing when run-to-run variance is as large as the effect, so a
study runs the main job (examples/math_agent/main_job.py) with the same settings and tasks
for each run seed (``SPANRL_SEED``: every rollout's sampling seed and the trainer's torch
seed; producers/seeding.py), each on a fresh stack run, and reports per seed and pooled:

- held-out correct rate, base and final, and the paired difference final - base with its
  95% interval, greedy and sampled (``heldout-<mode>.json`` of each seed); the same for the
  mean reward (``heldout_reward``: the measure of agents whose reward is graded, such as the RAG
  agent's 0.9 × word F1 + 0.1 × format);
- pooled over seeds: the Student-t interval of the per-seed differences (run-to-run spread,
  :func:`spanrl.core.intervals.t_interval`) and the paired bootstrap of the per-task
  differences averaged over seeds (:func:`spanrl.core.intervals.pooled_paired_difference`);
- correct rate and mean reward per task kind (and final - base per kind, paired), calculator
  use, LLM calls per episode, the log-prob shift of iteration 0's completions, the
  out-of-distribution (``gsm_symbolic``) paired differences;
- every seed's training curve in one PNG; the settings.

:func:`study_report` is pure (summaries and episode lists in, report out); :func:`run_study`
is the plumbing (stack up, main job, stack down, per seed).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from spanrl.core.intervals import pooled_paired_difference, t_interval

MODES = ("greedy", "sampled")


# metric -> (the evaluation report's paired key, the per-episode value it pairs)
METRICS = {"correct": ("success_rate", lambda e: 1.0 if e["components"].get("correct", 0) > 0 else 0.0),
           "reward": ("mean_reward", lambda e: float(e["reward"]))}


def _per_task(report: dict, policy: str, metric: str = "correct") -> dict[str, float]:
    """task id -> the policy's value of ``metric`` on its episode (one episode per task): 1.0 /
    0.0 for ``correct``, the final reward for ``reward``."""
    value = METRICS[metric][1]
    return {e["task_id"]: value(e) for e in report["policies"][policy]["per_episode"]}


def _final_name(report: dict) -> str | None:
    names = [p for p in report["policies"] if p != "base"]
    return names[-1] if names else None


def paired_block(reports: list[dict], metric: str = "correct") -> dict:
    """Per-seed and pooled paired differences (final - base) of ``metric`` (``correct``: the
    correct rate; ``reward``: the mean reward) for one evaluation (``reports[s]``: seed s's
    evaluation report with policies ``base`` and its final checkpoint, the same tasks in every
    seed). A seed whose final policy is the base (nothing was served) counts as a difference of
    0 on every task. Raises ValueError for tasks that differ between seeds, KeyError for an
    unknown metric."""
    key = METRICS[metric][0]
    per_seed, a, b = [], [], []
    tasks = None
    for rep in reports:
        base = _per_task(rep, "base", metric)
        final_name = _final_name(rep)
        final = _per_task(rep, final_name, metric) if final_name else base
        ids = sorted(base)
        if tasks is None:
            tasks = ids
        if ids != tasks or sorted(final) != tasks:
            raise ValueError("the seeds' evaluations are not on the same tasks")
        pair = rep["paired"].get(f"{final_name} - base", {}).get(key) if final_name else None
        per_seed.append({"base": sum(base.values()) / len(ids), "final": sum(final.values()) / len(ids),
                         "difference": pair or {"estimate": 0.0, "low": 0.0, "high": 0.0, "n": len(ids)},
                         "tasks": len(ids)})
        a.append([base[t] for t in tasks])
        b.append([final[t] for t in tasks])
    diffs = [p["difference"]["estimate"] for p in per_seed]
    return {"per_seed": per_seed,
            "pooled_across_seeds": t_interval(diffs).as_dict(),
            "pooled_paired_bootstrap": pooled_paired_difference(a, b).as_dict(),
            "every_seed_above_zero": all(p["difference"]["low"] > 0 for p in per_seed),
            "no_seed_below_base": all(p["difference"]["estimate"] >= 0 for p in per_seed)}


def _one_seed(pooled: dict) -> bool:
    """True when ``pooled`` is :func:`t_interval` of one value: a zero-width figure, no interval."""
    return pooled.get("method") == "single-value"


def pooled_text(pooled: dict) -> str:
    """The pooled-across-seeds figure as the study prints it: ``"+0.183 [+0.164, +0.202]"``
    (Student-t across seeds, :func:`spanrl.core.intervals.t_interval`), or ``"one seed: no
    spread across seeds"`` when only one seed ran (``method == "single-value"``: its
    zero-width interval is not an interval)."""
    if _one_seed(pooled):
        return "one seed: no spread across seeds"
    return f"{pooled['estimate']:+.3f} [{pooled['low']:+.3f}, {pooled['high']:+.3f}]"


def study_report(seeds: list[int], summaries: list[dict], heldout: list[dict[str, dict]],
                 ood: list[dict[str, dict]]) -> dict:
    """The study's report from each seed's main-job ``summary.json`` (``summaries[s]``), its
    held-out evaluation reports by mode (``heldout[s][mode]``) and its out-of-distribution
    ones (``ood[s][mode]``, may be empty). Raises ValueError when the seeds' evaluations are
    not on the same tasks."""
    modes = [m for m in MODES if all(m in h for h in heldout)]
    out = {
        "seeds": seeds,
        "settings": {"config": summaries[0].get("config"), "trainer_env": summaries[0].get("trainer_env"),
                     "trainer_settings": summaries[0].get("trainer_settings"),
                     "rollout_temperature": summaries[0].get("rollout_temperature")},
        "heldout": {m: paired_block([h[m] for h in heldout]) for m in modes},
        "heldout_reward": {m: paired_block([h[m] for h in heldout], "reward") for m in modes},
        "ood": {m: paired_block([o[m] for o in ood]) for m in modes if ood and all(m in o for o in ood)},
        "per_seed": [],
    }
    for seed, summ, h in zip(seeds, summaries, heldout):
        out["per_seed"].append({
            "seed": seed, "run": summ.get("run"), "wall_s": summ.get("wall_s"),
            "logprob_shift_of_iteration0_completions": {
                k: v.get("delta") for k, v in (summ.get("logprob_shift_of_iteration0_completions") or {}).items()},
            # every trained completion against its own behaviour policy (absent before 2026-12-04)
            "logprob_shift_of_all_completions": {
                k: v.get("delta") for k, v in ((summ.get("logprob_shift_of_all_completions") or {}).get("all")
                                               or {}).items()},
            "heldout_per_kind": summ.get("heldout_per_kind"),
            # final - base per kind, paired (absent before 2026-12-07)
            "heldout_per_kind_paired": summ.get("heldout_per_kind_paired"),
            "tool_use_and_calls": {m: {p: {"tool_use_rate": r.get("tool_use_rate"),
                                           "mean_llm_calls": r.get("mean_llm_calls")}
                                       for p, r in summ["heldout"][m]["policies"].items()}
                                   for m in summ.get("heldout", {})},
            "iterations": [{k: it.get(k) for k in ("iteration", "correct_rate", "format_rate", "tool_use_rate",
                                                   "mean_reward", "zero_variance_groups", "groups",
                                                   "policy_versions_served", "wall_s")}
                           | {k: {sign: v.get("delta") for sign, v in (it.get(k) or {}).items()}
                              for k in ("logprob_shift_own", "logprob_shift_iteration0")}
                           for it in summ.get("iterations", [])],
            "trainer_updates": summ.get("trainer_updates", []),
        })
    shifts = [p["logprob_shift_of_iteration0_completions"] for p in out["per_seed"]]
    out["logprob_shift_every_seed"] = {
        "positive_up": all((s.get("positive") or 0) > 0 for s in shifts),
        "negative_down": all((s.get("negative") or 0) < 0 for s in shifts)}
    every = [p["logprob_shift_of_all_completions"] for p in out["per_seed"]]
    out["logprob_shift_of_all_completions_every_seed"] = {
        "positive_up": all((s.get("positive") or 0) > 0 for s in every),
        "negative_down": all((s.get("negative") or 0) < 0 for s in every)}
    h = out["heldout"]
    # issue 18's target: both modes above 0 in each of at least 3 seeds, none below its base,
    # and iteration 0's rewarded completions more likely, punished ones less, in every seed
    # (the strict reading: the pooled all-completions figure is reported beside it, not counted)
    out["target_met"] = len(seeds) >= 3 and len(h) == 2 and all(
        h[m]["every_seed_above_zero"] and h[m]["no_seed_below_base"] for m in ("greedy", "sampled")) and all(
        out["logprob_shift_every_seed"].values())
    return out


def plot_study(report: dict, path: Path) -> None:
    """Left: every seed's training correct rate per iteration. Middle: KL per update. Right:
    held-out paired difference (final - base) of the correct rate, and of the mean reward, per
    seed and pooled, greedy and sampled (and of the correct rate out of distribution), with 95%
    intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, kx, bx) = plt.subplots(1, 3, figsize=(16, 4.2), gridspec_kw={"width_ratios": [1, 1, 1.3]})
    for j, p in enumerate(report["per_seed"]):
        xs = [it["iteration"] for it in p["iterations"]]
        ax.plot(xs, [it["correct_rate"] for it in p["iterations"]], marker="o", color=f"C{j}",
                label=f"seed {p['seed']}: correct")
        ax.plot(xs, [it["mean_reward"] for it in p["iterations"]], linestyle=":", color=f"C{j}")
        ax.set_xticks(xs)
        ups = p.get("trainer_updates") or []
        ux = [u.get("update") for u in ups]
        kx.plot(ux, [u.get("approx_kl") for u in ups], marker="o", color=f"C{j}", label=f"seed {p['seed']}: to behaviour")
        if any("ref_kl" in u for u in ups):
            kx.plot(ux, [u.get("ref_kl") for u in ups], marker="s", linestyle="--", color=f"C{j}",
                    label=f"seed {p['seed']}: to reference")
    kx.set_xlabel("update")
    kx.set_ylabel("KL (k3, token mean)")
    kx.set_title("per update: KL to the behaviour policy (and to the reference)", fontsize=9)
    kx.grid(alpha=0.3)
    kx.legend(fontsize=7)
    ax.set_xlabel("iteration (training rollouts, agent's sampling)")
    ax.set_ylabel("correct rate (dotted: mean reward)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("training curves, every seed", fontsize=10)
    blocks = [(f"held-out {m}", report["heldout"][m]) for m in report["heldout"]] + \
             [(f"held-out {m}\n(mean reward)", report["heldout_reward"][m])
              for m in report.get("heldout_reward", {})] + \
             [(f"OOD {m}", report["ood"][m]) for m in report.get("ood", {})]
    labels = []
    for i, (name, blk) in enumerate(blocks):
        n = len(blk["per_seed"])
        for j, p in enumerate(blk["per_seed"]):
            d = p["difference"]
            x = i + (j - n / 2) * 0.15
            bx.errorbar(x, d["estimate"], yerr=[[d["estimate"] - d["low"]], [d["high"] - d["estimate"]]],
                        fmt="o", color=f"C{j}", capsize=3, label=f"seed {report['seeds'][j]}" if i == 0 else None)
        pooled = blk["pooled_across_seeds"]
        x = i + (n / 2) * 0.15
        if not _one_seed(pooled):  # one seed: no interval across seeds to draw
            bx.errorbar(x, pooled["estimate"], yerr=[[pooled["estimate"] - pooled["low"]],
                                                     [pooled["high"] - pooled["estimate"]]],
                        fmt="s", color="k", capsize=4, label="pooled (t across seeds)" if i == 0 else None)
        labels.append(name)
    bx.axhline(0, color="grey", linewidth=1)
    bx.set_xticks(range(len(labels)), labels, fontsize=8)
    bx.set_ylabel("correct rate (or mean reward), final - base (95% CI)")
    bx.grid(axis="y", alpha=0.3)
    bx.legend(fontsize=7)
    bx.set_title("held out and out of distribution, paired", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare_repeat(summary_a: dict, summary_b: dict, heldout_a: dict[str, dict], heldout_b: dict[str, dict],
                   weights_a: dict[int, str], weights_b: dict[int, str]) -> dict:
    """Two runs of the same seed side by side: which checkpoint versions have the same weights
    (``weights_x``: version -> sha256 of the weights file from the manifests), the first
    version whose weights differ (None: none), the training iterations' rewards, and per
    held-out mode the fraction of tasks whose final-policy episode got the same reward in
    both runs and the two paired differences; ``repeatable``: every held-out episode got the
    same reward in both runs (the weights may still differ in their last bits:
    ``weights_identical``). Pure. Example: weights {1: "a", 2: "b"} vs {1: "a", 2: "c"} ->
    identical_versions [1], first_differing_version 2, weights_identical False."""
    versions = sorted(set(weights_a) & set(weights_b))
    same = [v for v in versions if weights_a[v] == weights_b[v]]
    differing = [v for v in versions if weights_a[v] != weights_b[v]]
    out = {"versions_compared": versions, "identical_versions": same,
           "first_differing_version": differing[0] if differing else None,
           "training_rewards": [[it.get("mean_reward") for it in s.get("iterations", [])]
                                for s in (summary_a, summary_b)],
           "heldout": {}}
    for mode in sorted(set(heldout_a) & set(heldout_b)):
        fa, fb = _final_name(heldout_a[mode]), _final_name(heldout_b[mode])
        ra = {e["task_id"]: e["reward"] for e in heldout_a[mode]["policies"][fa or "base"]["per_episode"]}
        rb = {e["task_id"]: e["reward"] for e in heldout_b[mode]["policies"][fb or "base"]["per_episode"]}
        tasks = sorted(set(ra) & set(rb))
        diff = [(h["paired"].get(f"{f} - base", {}).get("success_rate") or {}).get("estimate")
                for h, f in ((heldout_a[mode], fa), (heldout_b[mode], fb))]
        out["heldout"][mode] = {"tasks": len(tasks),
                                "same_final_reward": sum(ra[t] == rb[t] for t in tasks) / len(tasks) if tasks else None,
                                "paired_differences": diff}
    out["weights_identical"] = not differing and bool(versions)
    # the results a user sees: every held-out episode of the final policy got the same reward
    out["repeatable"] = bool(out["heldout"]) and all(m["same_final_reward"] == 1.0 for m in out["heldout"].values())
    return out


def _weights(summary: dict, settings) -> dict[int, str]:
    """version -> sha256 of model.safetensors (a LoRA run's: adapter_model.safetensors) of the
    summary's run, from MinIO's manifests."""
    from spanrl.trainer import checkpoint, lora

    client = checkpoint.make_client(settings)
    out = {}
    for v in range(1, int(summary.get("final_served_version") or 0) + 1):
        m = checkpoint.read_manifest(client, settings.checkpoint_bucket, summary["run"], v)
        if m is not None:
            out[v] = m["files"].get("model.safetensors") or m["files"].get(lora.ADAPTER_WEIGHTS)
    return out


def load_seed_dir(d: Path) -> tuple[dict, dict, dict]:
    """(summary, held-out reports by mode, OOD reports by mode) of one seed's output folder."""
    summary = json.loads((d / "summary.json").read_text())
    heldout = {m: json.loads((d / f"heldout-{m}.json").read_text()) for m in MODES
               if (d / f"heldout-{m}.json").exists()}
    ood = {m: json.loads((d / f"ood-{m}.json").read_text()) for m in MODES if (d / f"ood-{m}.json").exists()}
    return summary, heldout, ood


def write_study(seeds: list[int], dirs: list[Path], out: Path) -> dict:
    """Read each seed's folder, write ``out/study.json`` and ``out/study.png``; the report."""
    loaded = [load_seed_dir(d) for d in dirs]
    report = study_report(seeds, [x[0] for x in loaded], [x[1] for x in loaded], [x[2] for x in loaded])
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.json").write_text(json.dumps(report, indent=2))
    plot_study(report, out / "study.png")
    return report


def run_study(seeds: list[int], out: Path, size: dict, console, repeat: bool = False) -> dict:
    """Run the main job once per seed on a fresh stack run (``study-<time>-s<seed>``), each
    into ``out/seed-<seed>/``, then :func:`write_study`. ``repeat``: each seed runs twice
    (the second into ``out/seed-<seed>-repeat/``) and the report's ``repeatability`` compares
    the two (:func:`compare_repeat`). The stack must be down (its trainer reads the seed and
    run at start-up); raises RuntimeError if it is up."""
    from examples.math_agent.main_job import MainJobConfig, demo_trainer_env, run_main_job
    from spanrl.infra.agents import load_agent_spec
    from spanrl.core.settings import get_settings, set_env, setdefault_env
    from spanrl.infra.stack import Stack

    if Stack().running("trainer"):
        raise RuntimeError("the stack is up: a study starts its own stack per seed (stop it with `make down`)")
    spec = load_agent_spec(size.get("agent", "math"))
    for k, v in demo_trainer_env({}, get_settings().recipe or None).items():  # SPANRL_RECIPE, else the default
        setdefault_env(k, v)
    setdefault_env("SPANRL_TRAIN_AGENTS", spec.train_agents)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dirs, repeats = [], {}

    def one(seed: int, name: str) -> Path:
        set_env("SPANRL_SEED", str(seed))
        set_env("SPANRL_RUN", f"study-{stamp}-{name}")
        get_settings.cache_clear()
        stack = Stack(get_settings())
        console.rule(f"seed {seed} (run {get_settings().run})")
        stack.up()
        d = out / name.replace("s", "seed-", 1)
        try:
            run_main_job(MainJobConfig(agent=size.get("agent", "math"), iterations=size["iterations"],
                                       tasks_per_iteration=size["tasks"], group_size=size["group_size"],
                                       heldout_tasks=size["heldout_tasks"], out_dir=d,
                                       **{k: size[k] for k in ("ood_tasks", "train_task_set") if k in size}),
                         console=console)
        finally:
            stack.down()
        return d

    for seed in seeds:
        dirs.append(one(seed, f"s{seed}"))
        if repeat:
            again = one(seed, f"s{seed}-repeat")
            (sa, ha, _), (sb, hb, _) = load_seed_dir(dirs[-1]), load_seed_dir(again)
            Stack(get_settings()).up(["minio"])
            try:
                repeats[seed] = compare_repeat(sa, sb, ha, hb, _weights(sa, get_settings()), _weights(sb, get_settings()))
            finally:
                Stack(get_settings()).down()
        report = write_study(seeds[:len(dirs)], dirs, out)  # a partial report after every seed
    if repeats:
        report["repeatability"] = repeats
        (out / "study.json").write_text(json.dumps(report, indent=2))
    return report
