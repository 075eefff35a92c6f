"""Release gate: serve a new checkpoint only if it is not worse than the incumbent on
held-out rollouts (the design notes spanrl started from: "a resource update should pass
held-out rollouts or regression checks before runners use it broadly").

The rule (pure, :func:`gate_decision`): both policies run the same held-out tasks
greedily; per task the candidate's reward minus the incumbent's; the candidate is
refused when the whole 95% paired-bootstrap interval of the mean difference lies below
``-tolerance``, i.e. when it is worse by more than ``tolerance`` with 95% confidence.
Ties and noise-sized differences are served: on a few dozen tasks a point-estimate rule
would refuse many checkpoints that are as good as the incumbent and stall training's
progress reaching the agents; the gate is there to stop regressions.

The plumbing is in ``trainer/reloader.py`` (``SPANRL_RELOADER_GATE*`` settings). What runs
the held-out episodes is a :data:`GateEvaluation` the reloader is given or resolves from
``SPANRL_RELOADER_GATE_EVALUATION`` (by default the control plane's evaluator,
``spanrl.infra.evaluation.gate_rewards``, which loads the agent and the task set through
the agent spec loader, spanrl/infra/agents.py: a math task set or ``REF:SPLIT`` of any
AgentSpec, the agent a runner or a spec by ``module:attribute``): the trainer imports neither.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from spanrl.core import intervals

if TYPE_CHECKING:
    from spanrl.core.settings import ReloaderConfig, Settings

#: ``await evaluation(cfg, settings, name)`` -> per-task mean reward (task id -> reward) of the
#: policy vLLM serves now, on tasks ``[cfg.gate_offset, cfg.gate_offset + cfg.gate_tasks)`` of
#: ``cfg.gate_task_set`` (seed ``cfg.gate_seed``), agent ``cfg.gate_agent``, greedy, at most
#: ``cfg.gate_concurrency`` at once; ``name`` labels its records
GateEvaluation = Callable[["ReloaderConfig", "Settings", str], Awaitable[dict[str, float]]]

ACCEPT = "not_worse"
REFUSE = "worse_beyond_tolerance"


@dataclass(frozen=True)
class GateDecision:
    """``accept``: serve the candidate; ``reason``: ``not_worse`` | ``worse_beyond_tolerance``;
    ``difference``: mean (candidate - incumbent) reward per task with its 95% interval
    (``spanrl.core.intervals.Interval.as_dict()``); means of both over the shared tasks."""

    accept: bool
    reason: str
    difference: dict
    tolerance: float
    incumbent_mean: float
    candidate_mean: float
    tasks: int

    def as_dict(self) -> dict:
        return asdict(self)


def gate_decision(incumbent: dict[str, float], candidate: dict[str, float], tolerance: float = 0.0,
                  seed: int = 0) -> GateDecision:
    """Decide on ``candidate`` from per-task mean rewards (task id -> reward) of both policies.

    Raises ValueError when they share no task or ``tolerance`` is negative.
    Example: incumbent {a: 1, b: 0, c: 1}, candidate {a: 0, b: 0, c: 0} -> differences
    [-1, 0, -1]; every bootstrap mean lies in [-1, 0], with probability 1/27 exactly 0, so
    the interval's upper end is 0 (not below -0) and a tolerance-0 gate serves it; with
    six such tasks (P(0) = 1/729 < 2.5%) the upper end is below 0 and it is refused.
    """
    if tolerance < 0:
        raise ValueError("tolerance must be >= 0")
    shared = sorted(set(incumbent) & set(candidate))
    if not shared:
        raise ValueError("the incumbent and the candidate share no task")
    a = [incumbent[k] for k in shared]
    b = [candidate[k] for k in shared]
    diff = intervals.paired_difference(a, b, seed=seed)
    refuse = diff.high < -tolerance
    return GateDecision(not refuse, REFUSE if refuse else ACCEPT, diff.as_dict(), tolerance,
                        sum(a) / len(a), sum(b) / len(b), len(shared))
