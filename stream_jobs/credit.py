"""Credit assignment and group-relative advantages (the maths of the stream jobs).

Pure functions: no Faust, no Kafka. Names follow the papers.

- LightningRL (Agent Lightning, arXiv 2508.03680) s3.3.2: an agent execution is a
  sequence of policy-LLM calls; each call is one transition; the episode's final
  return R is given, whole, to every call ("identical credit assignment", not R/T).
- GRPO (DeepSeekMath, arXiv 2402.03300) s4.1.2, outcome supervision: the advantage
  of every token of output i is (r_i - mean(r)) / std(r) over the group of outputs
  sampled for the same question.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

IDENTICAL = "identical"


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


@dataclass(frozen=True)
class CreditRule:
    """A parsed credit rule: ``name`` as written in transitions, ``assign(R, T) -> rewards``."""

    name: str
    assign: Callable[[float, int], list[float]]

    def __call__(self, episode_return: float, num_calls: int) -> list[float]:
        return self.assign(episode_return, num_calls)


def parse_credit_rule(rule: str | None) -> CreditRule:
    """Parse ``"identical"`` (default, also for ``None``/``""``), ``"scaled:<factor>"``
    or ``"discounted:<gamma>"`` (0 <= gamma <= 1). Anything else raises ValueError."""
    text = (rule or IDENTICAL).strip()
    kind, _, arg = text.partition(":")
    if kind == IDENTICAL and not arg:
        return CreditRule(IDENTICAL, identical_credit)
    if kind in ("scaled", "discounted") and arg:
        try:
            x = float(arg)
        except ValueError:
            raise ValueError(f"credit rule {text!r}: {arg!r} is not a number") from None
        if not math.isfinite(x):
            raise ValueError(f"credit rule {text!r}: parameter must be finite")
        if kind == "scaled":
            return CreditRule(f"scaled:{x:g}", lambda r, n: scaled_credit(r, n, x))
        if not 0.0 <= x <= 1.0:
            raise ValueError(f"credit rule {text!r}: gamma must be in [0, 1]")
        return CreditRule(f"discounted:{x:g}", lambda r, n: discounted_credit(r, n, x))
    raise ValueError(
        f"unknown credit rule {text!r}; expected identical | scaled:<factor> | discounted:<gamma>"
    )


class InvalidReward(ValueError):
    """A reward value that cannot be a return (NaN or infinite)."""


def episode_return(rewards: Iterable[Mapping]) -> float | None:
    """The episode's final return R from its reward events, in the order received.

    R is the value of the *last* event with ``final=True`` (a re-emitted final reward
    replaces the earlier one). Intermediate rewards (``final=False``, AIR in
    LightningRL s3.3) are NOT added to R under the default rule; they stay on the
    reward topic for replays with another reward function. Returns ``None`` when no
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
