"""Experiment tracking (TensorBoard by default; MLflow or W&B offline) and the trainer's and
reloader's Prometheus families.

Tracking: ``SPANRL_TRACKER`` = ``tensorboard`` (default) | ``mlflow`` | ``wandb`` | ``none``
(spanrl/core/settings.py); logs go under ``settings.tracker_root / RUN / <who>`` (default
``.spanrl/tensorboard/RUN/trainer``; ``tensorboard --logdir .spanrl/tensorboard``). One
small interface, :class:`Tracker` (``log(scalars, step)``, ``close()``), one thin adapter per
library; nothing leaves the machine (MLflow: a ``file:`` store; W&B: ``mode="offline"``).

The scalars of one update come from :func:`update_scalars` (pure): the update's metrics
(trainer/train.py ``train_update``), the samples it trained on and the version trained.

Prometheus: :func:`trainer_families` and :func:`reloader_families` turn the services' own
``/status`` state into families at scrape time (spanrl.core.metrics), nothing counted
twice.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from spanrl.core import metrics as prom

TRACKERS = ("tensorboard", "mlflow", "wandb", "none")


# ---- the scalars of one update (pure) ----------------------------------------------------

def _mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and population standard deviation (0, 0 for no values)."""
    if not xs:
        return 0.0, 0.0
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def version_lag(trained_version: int, behaviour_versions: list[int]) -> dict[str, float]:
    """Policy-version lag of an update's samples: ``trained_version - v`` for each sample's
    behaviour version ``v`` (the ``policy_version`` the proxy stamped on its call), as
    ``{"min", "mean", "max"}``; ``{}`` for no samples. 0 = on-policy; AReaL's
    "staleness" (arXiv 2505.24298 s4) counts versions the same way."""
    if not behaviour_versions:
        return {}
    lags = [trained_version - int(v) for v in behaviour_versions]
    return {"min": float(min(lags)), "mean": sum(lags) / len(lags), "max": float(max(lags))}


def zero_variance_group_fraction(samples: list[dict], eps: float = 1e-9) -> float:
    """Fraction of the distinct GRPO groups (``group_id``) among ``samples`` whose reward
    spread ``group_std`` is 0 (every rollout got the same return: advantage 0, no gradient;
    DAPO's "dynamic sampling" filters these, arXiv 2503.14476 s3.2). 0.0 for no samples."""
    groups = {s["group_id"]: float(s["group_std"]) for s in samples}
    return sum(1 for std in groups.values() if abs(std) <= eps) / len(groups) if groups else 0.0


def update_scalars(metrics: Mapping, samples: list[dict], trained_version: int) -> dict[str, float]:
    """The tracked scalars of one policy update, keyed by TensorBoard tag.

    ``metrics``: ``train_update``'s dict (loss, approx_kl, clip_frac, grad_norm, lr,
    advantage_std, tokens_per_s, ...; a key that is missing or not a finite number is left
    out). ``samples``: the decoded Sample records trained on. ``trained_version``: the policy
    version the update starts from (the trainer's ``state.version``). The version lag is
    ``metrics["version_lag"]`` when the update reports one (a number, or a mapping of
    numbers such as ``{"min", "mean", "max"}``), else :func:`version_lag` of the samples.
    """
    out: dict[str, float] = {}

    def put(tag: str, value) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[tag] = float(value)

    for tag, key in (("train/loss", "loss"), ("train/approx_kl", "approx_kl"), ("train/clip_fraction", "clip_frac"),
                     ("train/grad_norm", "grad_norm"), ("train/lr", "lr"), ("train/advantage_std", "advantage_std"),
                     ("train/mean_advantage", "mean_advantage"), ("train/tokens_per_s", "tokens_per_s"),
                     ("train/samples", "samples"), ("train/update_s", "update_s"),
                     ("train/mean_return", "mean_return"), ("train/ref_kl", "ref_kl"),
                     ("train/dropped_zero_variance", "dropped_zero_variance"), ("train/steps", "steps"),
                     ("train/prefix_merge_rows", "prefix_merge_rows"),
                     ("train/prefix_merge_links", "prefix_merge_links"),
                     ("train/prefix_merge_tokens", "prefix_merge_tokens"),
                     ("train/prefix_merge_tokens_per_call", "prefix_merge_tokens_per_call"),
                     ("train/tree_pack_tokens", "tree_pack_tokens"),
                     ("train/tree_pack_row_tokens", "tree_pack_row_tokens")):
        put(tag, metrics.get(key))
    for cause, n in (metrics.get("prefix_merge_breaks") or {}).items():  # prefix_merge on: breaks by cause
        put(f"prefix_merge/breaks_{cause}", n)
    rewards = [float(s["transition"]["reward"]) for s in samples]
    mean, std = _mean_std(rewards)
    if rewards:
        put("reward/mean", mean)
        put("reward/std", std)
    if samples:
        put("train/zero_variance_group_fraction", zero_variance_group_fraction(samples))
    put("policy/version", trained_version)
    lag = metrics.get("version_lag")
    if isinstance(lag, Mapping):
        for k, v in lag.items():
            put(f"policy/version_lag_{k}", v)
    elif lag is not None:
        put("policy/version_lag", lag)
    else:
        for k, v in version_lag(trained_version, [s["transition"]["policy_version"] for s in samples]).items():
            put(f"policy/version_lag_{k}", v)
    return out


_ITERATION_KEYS = ("mean_reward", "correct_rate", "format_rate", "tool_use_rate", "rollouts", "rollouts_failed",
                   "transitions", "samples", "dead_letters", "wall_s")


def iteration_scalars(result: Mapping) -> dict[str, float]:
    """The tracked scalars of one main-job iteration (``asdict(IterationResult)``,
    examples/math_agent/main_job.py): its rates and counts under ``main_job/``, the fraction
    of its GRPO groups with zero reward variance, and the newest policy version that served
    its calls. Keys that are missing or not numbers are left out."""
    out = {f"main_job/{k}": float(result[k]) for k in _ITERATION_KEYS
           if isinstance(result.get(k), (int, float)) and not isinstance(result.get(k), bool)}
    if result.get("groups"):
        out["main_job/zero_variance_group_fraction"] = result.get("zero_variance_groups", 0) / result["groups"]
    if result.get("policy_versions_served"):
        out["policy/version_served"] = float(max(result["policy_versions_served"]))
    return out


_REPORT_KEYS = ("mean_reward", "success_rate", "format_rate", "tool_use_rate", "mean_llm_calls")


def report_scalars(report: Mapping) -> dict[int, dict[str, float]]:
    """An evaluation report's scalars (infra/evaluation.py ``evaluate`` / the main job's
    held-out reports), keyed by policy version (base = 0): x = the version evaluated. Per
    policy ``eval/<metric>`` (the point estimate of each interval, and ``eval/episodes``);
    per paired comparison against the first policy ``eval/paired_<metric>`` (the paired
    difference, at the other policy's version). A metric that is None is left out."""
    out: dict[int, dict[str, float]] = {}
    for spec, rep in report.get("policies", {}).items():
        row = out.setdefault(int(rep.get("version", 0)), {})
        row["eval/episodes"] = float(rep["episodes"])
        for k in _REPORT_KEYS:
            if isinstance(rep.get(k), Mapping):
                row[f"eval/{k}"] = float(rep[k]["estimate"])
    versions = {spec: int(rep.get("version", 0)) for spec, rep in report.get("policies", {}).items()}
    for name, pair in report.get("paired", {}).items():
        other = name.split(" - ")[0]
        for k in ("mean_reward", "success_rate"):
            if isinstance(pair.get(k), Mapping) and other in versions:
                out.setdefault(versions[other], {})[f"eval/paired_{k}"] = float(pair[k]["estimate"])
    return out


# ---- trackers (plumbing) ---------------------------------------------------------------

class Tracker(Protocol):
    def log(self, scalars: Mapping[str, float], step: int) -> None: ...
    def close(self) -> None: ...


class NullTracker:
    def log(self, scalars: Mapping[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardTracker:
    """``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package)."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # readable at once (tensorboard, the tests)

    def close(self) -> None:
        self.writer.close()


class MlflowTracker:
    """MLflow with a local ``file:`` store in ``log_dir`` (``mlflow ui --backend-store-uri``)."""

    def __init__(self, log_dir: Path, run: str):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(Path(log_dir).resolve().as_uri())
        mlflow.set_experiment("spanrl")
        self.active = mlflow.start_run(run_name=run)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.mlflow.log_metrics({k.replace("/", "."): v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class WandbTracker:
    """Weights & Biases in offline mode (``wandb sync`` uploads it later, if wanted)."""

    def __init__(self, log_dir: Path, run: str):
        import wandb

        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project="spanrl", name=run, dir=str(log_dir), mode="offline")

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


def make_tracker(kind: str, log_dir: Path, run: str) -> Tracker:
    """The tracker ``kind`` (one of :data:`TRACKERS`) writing under ``log_dir``. Raises
    ValueError for an unknown kind and RuntimeError when its library is not installed."""
    if kind not in TRACKERS:
        raise ValueError(f"SPANRL_TRACKER must be one of {', '.join(TRACKERS)}, got {kind!r}")
    if kind == "none":
        return NullTracker()
    try:
        if kind == "tensorboard":
            return TensorBoardTracker(log_dir)
        if kind == "mlflow":
            return MlflowTracker(log_dir, run)
        return WandbTracker(log_dir, run)
    except ImportError as exc:
        package = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}[kind]
        raise RuntimeError(f"SPANRL_TRACKER={kind} needs the {package!r} package ({exc}); "
                           f"pip install {package}, or SPANRL_TRACKER=none") from exc


def tracker_for(settings, run: str, who: str) -> Tracker:
    """``make_tracker`` with the settings' kind, under ``settings.tracker_root / run / who``."""
    return make_tracker(settings.tracker, Path(settings.tracker_root) / run / who, f"{run}/{who}")


def log_once(settings, run: str, who: str, scalars_by_step: Mapping[int, Mapping[str, float]]) -> None:
    """Open the tracker of ``run/who``, log ``{step: scalars}``, close it. A tracker that
    fails is logged as a warning: tracking never fails the job it watches."""
    import logging

    try:
        tracker = tracker_for(settings, run, who)
        try:
            for step, scalars in sorted(scalars_by_step.items()):
                tracker.log(scalars, step)
        finally:
            tracker.close()
    except Exception as exc:  # noqa: BLE001
        logging.getLogger("spanrl.tracking").warning("tracking %s/%s failed: %s", run, who, exc)


# ---- Prometheus (the services' /status state at scrape time) ------------------------------

#: last update metric -> gauge help text
_LAST_UPDATE = {"loss": "loss of the last update", "approx_kl": "approx KL (k3) of the last update",
                "clip_frac": "clip fraction of the last update", "tokens_per_s": "tokens/s of the last update",
                "mean_reward": "mean reward of the last update's samples",
                "grad_norm": "gradient norm of the last update"}


def trainer_families(status: Mapping) -> list:
    """Families of the trainer's ``/status`` (``TrainerState`` as a dict): counters
    ``spanrl_trainer_{updates,steps,retries}_total``, ``spanrl_trainer_skipped_samples_total{reason}``;
    gauges ``spanrl_trainer_policy_version``, ``_buffered_samples``, ``_pending_checkpoint``
    (1 while one is unpublished) and ``spanrl_trainer_last_<metric>`` of the last update (NaN
    before the first, or when the update did not report it)."""
    out = [prom.CounterMetricFamily("spanrl_trainer_updates", "policy updates", value=status.get("updates", 0)),
           prom.CounterMetricFamily("spanrl_trainer_steps", "optimizer steps", value=status.get("step", 0)),
           prom.CounterMetricFamily("spanrl_trainer_retries", "retried MinIO/Kafka operations since start",
                                    value=status.get("retries", 0)),
           prom.labelled_counter("spanrl_trainer_skipped_samples", "unusable samples skipped, by reason",
                                 "reason", status.get("skipped") or {}),
           prom.gauge("spanrl_trainer_policy_version", "newest published policy version", status.get("version", 0)),
           prom.gauge("spanrl_trainer_buffered_samples", "good samples waiting for the next update",
                      status.get("buffered", 0)),
           prom.gauge("spanrl_trainer_pending_checkpoint", "1 while a saved checkpoint is not published yet",
                      status.get("pending_checkpoint") is not None)]
    last = status.get("last_metrics") or {}
    for key, text in _LAST_UPDATE.items():  # NaN until an update reports it (Prometheus' "no value")
        value = last.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        out.append(prom.gauge(f"spanrl_trainer_last_{key}", text, value if ok else math.nan))
    return out


def reloader_families(status: Mapping, history: list[dict], handled: int) -> list:
    """Families of the reloader: gauges ``spanrl_reloader_{served,target}_version``,
    ``_vllm_synced``, ``_pinned``; counters from its whole ``history`` (not the 50 entries
    ``/status`` shows): ``spanrl_reloader_announcements_total`` (``handled``),
    ``_reloads_total`` (entries reloaded into vLLM), ``_refused_checkpoints_total`` (did not
    verify), ``_gate_refusals_total``, ``_vllm_lost_total``; and the histogram
    ``spanrl_reloader_reload_seconds`` of every reload's ``reload_s``."""
    reload_s = [e["reload_s"] for e in history if isinstance(e.get("reload_s"), (int, float))]
    return [
        prom.gauge("spanrl_reloader_served_version", "policy version vLLM serves", status.get("served_version", 0)),
        prom.gauge("spanrl_reloader_target_version", "newest verified version", status.get("target_version", 0)),
        prom.gauge("spanrl_reloader_vllm_synced", "1 when vLLM serves the wanted version", bool(status.get("vllm_synced"))),
        prom.gauge("spanrl_reloader_pinned", "1 while an evaluation pin holds vLLM", status.get("pinned") is not None),
        prom.CounterMetricFamily("spanrl_reloader_announcements", "checkpoint announcements handled", value=handled),
        prom.CounterMetricFamily("spanrl_reloader_reloads", "reloads of vLLM that succeeded",
                                 value=sum(1 for e in history if e.get("reloaded"))),
        prom.CounterMetricFamily("spanrl_reloader_refused_checkpoints", "checkpoints that did not verify",
                                 value=sum(1 for e in history if "verified" in e and not e["verified"]
                                           and e.get("error") and not e.get("event"))),
        prom.CounterMetricFamily("spanrl_reloader_gate_refusals", "checkpoints the release gate refused",
                                 value=sum(1 for e in history if e.get("refused"))),
        prom.CounterMetricFamily("spanrl_reloader_vllm_lost", "times vLLM was found unreachable",
                                 value=sum(1 for e in history if e.get("event") == "vllm_lost")),
        prom.histogram_family("spanrl_reloader_reload_seconds", "vLLM reload time per reload", reload_s),
    ]
