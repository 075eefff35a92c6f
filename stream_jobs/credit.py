"""Credit assignment and group-relative advantages (the maths of the stream jobs).

Pure functions: no Faust, no Kafka. Names follow the papers.

- LightningRL (Agent Lightning, arXiv 2508.03680) s3.3.2: an agent execution is a
  sequence of policy-LLM calls; each call is one transition; the episode's final
  return R is given, whole, to every call ("identical credit assignment", not R/T).
- AIR (the same paper, s3.4.2): intermediate rewards i_t per call from span facts
  (stream_jobs/air.py). Every rule adds a call's own i_t to its credit
  (``r_t = credit_t(R) + i_t``), except ``return_to_go:<gamma>``, the discounted return
  G_t = sum_{k>=t} gamma**(k-t) i_k + gamma**(T-1-t) R (Sutton & Barto eq. 3.8 with the
  final return paid at the last call), which also passes future intermediate rewards back.
  With no AIR rules every i_t is 0 and each rule gives what it gave before AIR.
- GRPO (DeepSeekMath, arXiv 2402.03300) s4.1.2, outcome supervision: the advantage
  of every token of output i is (r_i - mean(r)) / std(r) over the group of outputs
  sampled for the same question.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from spanrl.stream_jobs.air import AirRules, finite_number

IDENTICAL = "identical"
RETURN_TO_GO = "return_to_go"


def identical_credit(episode_return: float, num_calls: int) -> list[float]:
    """Each of the episode's ``num_calls`` selected calls gets reward R (LightningRL s3.3.2)."""
    return [episode_return] * num_calls


def scaled_credit(episode_return: float, num_calls: int, factor: float) -> list[float]:
    """Each call gets ``factor * R`` (a replay variant of identical credit)."""
    return [factor * episode_return] * num_calls


def discounted_credit(episode_return: float, num_calls: int, gamma: float) -> list[float]:
    """Call t of T gets ``gamma**(T-1-t) * R``: the discounted return-to-go of a reward
    paid only at the end of the episode (Sutton & Barto, "Reinforcement Learning", eq. 3.8)."""
    return [gamma ** (num_calls - 1 - t) * episode_return for t in range(num_calls)]


def with_intermediate(credit: list[float], intermediate: list[float]) -> list[float]:
    """``r_t = credit_t + i_t``: each call's credit plus its own intermediate reward (AIR,
    arXiv 2508.03680 s3.4.2). Raises ValueError when the lists differ in length."""
    if len(credit) != len(intermediate):
        raise ValueError(f"{len(credit)} credits for {len(intermediate)} intermediate rewards")
    return [c + i for c, i in zip(credit, intermediate)]


def return_to_go_credit(episode_return: float, intermediate: list[float], gamma: float) -> list[float]:
    """Call t of T gets the discounted return-to-go
    ``G_t = sum_{k=t}^{T-1} gamma**(k-t) * i_k + gamma**(T-1-t) * R``: per-call rewards i_k
    (AIR) with the final return R paid at the last call (Sutton & Barto, "Reinforcement
    Learning", 2nd ed., eq. 3.8; REINFORCE++, arXiv 2501.03262 s3, uses this return per
    token). With every i_k = 0 it is :func:`discounted_credit`. Computed backwards,
    ``G_{T-1} = i_{T-1} + R``, ``G_t = i_t + gamma * G_{t+1}``; ``[]`` for T = 0.
    Example: R = 1, i = [-0.1, 0, -0.2], gamma = 0.5 -> [0.1, 0.4, 0.8]."""
    out, g = [0.0] * len(intermediate), None
    for t in range(len(intermediate) - 1, -1, -1):
        g = intermediate[t] + (episode_return if g is None else gamma * g)
        out[t] = g
    return out


@dataclass(frozen=True)
class CreditRule:
    """A parsed credit rule: ``name`` as written in transitions, ``assign(R, T) -> rewards``
    (the credit of each call from R alone); ``gamma`` set for ``return_to_go``, whose
    credit is :func:`return_to_go_credit`; ``air``: the AIR rules in force (None: none),
    named ``air_rules`` in transitions (see :meth:`with_air`)."""

    name: str
    assign: Callable[[float, int], list[float]]
    gamma: float | None = None
    air: AirRules | None = None

    def __call__(self, episode_return: float, num_calls: int,
                 intermediate: list[float] | None = None) -> list[float]:
        """Reward of each of the ``num_calls`` calls given R and their intermediate
        rewards (default: none, all 0)."""
        intermediate = [0.0] * num_calls if intermediate is None else list(intermediate)
        if len(intermediate) != num_calls:
            raise ValueError(f"{len(intermediate)} intermediate rewards for {num_calls} calls")
        if self.gamma is not None:
            return return_to_go_credit(episode_return, intermediate, self.gamma)
        credit = self.assign(episode_return, num_calls)
        return credit if not any(intermediate) else with_intermediate(credit, intermediate)

    def with_air(self, air: AirRules | None) -> "CreditRule":
        """This rule with AIR rules ``air`` (stream_jobs/air.py; None: no intermediate rewards)."""
        return CreditRule(self.name, self.assign, self.gamma, air)

    @property
    def air_name(self) -> str:
        """The AIR rules as written in transitions: ``""`` when none."""
        return self.air.describe() if self.air is not None else ""


def parse_credit_rule(rule: str | None) -> CreditRule:
    """Parse ``"identical"`` (default, also for ``None``/``""``), ``"scaled:<factor>"``,
    ``"discounted:<gamma>"`` or ``"return_to_go:<gamma>"`` (0 <= gamma <= 1). Anything else
    raises ValueError. AIR rules are added with :meth:`CreditRule.with_air`."""
    text = (rule or IDENTICAL).strip()
    kind, _, arg = text.partition(":")
    if kind == IDENTICAL and not arg:
        return CreditRule(IDENTICAL, identical_credit)
    if kind in ("scaled", "discounted", RETURN_TO_GO) and arg:
        x = finite_number(arg, f"credit rule {text!r}")
        if kind == "scaled":
            return CreditRule(f"scaled:{x:g}", lambda r, n: scaled_credit(r, n, x))
        if not 0.0 <= x <= 1.0:
            raise ValueError(f"credit rule {text!r}: gamma must be in [0, 1]")
        if kind == RETURN_TO_GO:
            return CreditRule(f"{RETURN_TO_GO}:{x:g}", lambda r, n: discounted_credit(r, n, x), gamma=x)
        return CreditRule(f"discounted:{x:g}", lambda r, n: discounted_credit(r, n, x))
    raise ValueError(
        f"unknown credit rule {text!r}; expected identical | scaled:<factor> | discounted:<gamma> "
        f"| return_to_go:<gamma>"
    )


class InvalidReward(ValueError):
    """A reward value that cannot be a return (NaN or infinite)."""


def episode_return(rewards: Iterable[Mapping]) -> float | None:
    """The episode's final return R from its reward events, in the order received.

    R is the value of the *last* event with ``final=True`` (a re-emitted final reward
    replaces the earlier one). Reward events with ``final=False`` are NOT added to R;
    they stay on the reward topic for replays with another reward function (AIR's
    intermediate rewards come from span facts instead: stream_jobs/air.py). Returns ``None`` when no
    final reward was received. Raises :class:`InvalidReward` if R is NaN or infinite.
    """
    final = None
    for event in rewards:
        if event.get("final", True):
            final = event
    if final is None:
        return None
    value = float(final["value"])
    if not math.isfinite(value):
        raise InvalidReward(f"final reward {value!r} is not finite")
    return value


def grpo_advantages(returns: list[float], eps: float = 1e-6) -> list[float]:
    """GRPO outcome advantages A_i = (R_i - mean(R)) / (std(R) + eps).

    DeepSeekMath, arXiv 2402.03300 s4.1.2 ("normalized reward ... subtracting the
    group average and dividing by the group standard deviation"). The paper does not
    say which std; we use the *population* std (divide by G, not G-1), so returns
    [1, 0, 0, 1] give advantages [1, -1, -1, 1] / (1 + eps). (TRL and verl call
    ``torch.std``, which divides by G-1.) With G=1 there is no baseline: advantage 0.
    """
    g = len(returns)
    if g <= 1:
        return [0.0] * g
    mean, std = group_stats(returns)
    return [(r - mean) / (std + eps) for r in returns]


def group_stats(returns: list[float]) -> tuple[float, float]:
    """(mean, population std) of a group's returns; (0, 0) for an empty group."""
    g = len(returns)
    if g == 0:
        return 0.0, 0.0
    mean = sum(returns) / g
    var = sum((r - mean) ** 2 for r in returns) / g
    return mean, math.sqrt(var)
