"""Self-imitation: the positive-advantage samples of the last few updates, trained again.

Self-Imitation Learning (Oh, Guo, Singh and Lee, ICML 2018, "Self-Imitation Learning", s3)
adds to the policy gradient a term that imitates the agent's own past actions whose return
beat the value estimate, ``-log pi(a|s) * (R - V(s))+``, from a replay buffer. Here the value
estimate is the GRPO group's baseline, so ``(R - V)+`` is a sample's own positive advantage;
the buffer holds the samples whose advantage was > 0 in each of the last ``updates`` updates,
each with the advantage its update gave it (a float, or with prefix-tree advantages the row of
per-token values), and every later update trains them again beside its new samples under the
same PPO-clipped loss. Their behaviour log-probs stay those of the policy that sampled them, so
the clip stops the push once a token is ``1 + clip_eps`` times as likely as when it was sampled:
what the policy drifted away from is pulled back, what it already gained is left alone.

Why (docs/measured/learning-archive.md): rewarded completions of an early iteration lose likelihood as
later updates move the policy (for samples of ``pi_0`` the mean log-likelihood change under any
``pi_T`` is ``-KL(pi_0 || pi_T) <= 0``); a sample trained once is pushed up by one update only.

The buffer lives in the trainer's memory, bounded by ``updates`` (each update's positives, a
few dozen samples in the demo); a restarted trainer starts with an empty one. Replayed samples
are not records read again: the trainer's consumed offsets and the chaos ledger never see them.
"""
from __future__ import annotations

from collections import deque

#: how replayed samples are trained (``SPANRL_TRAINER_SELF_IMITATION_LOSS``): ``clipped``, the
#: update's PPO-clipped loss against their own behaviour log-probs; ``sil``, SIL's own unclipped
#: ``-log pi * A+`` (losses.self_imitation_loss), in micro-batches of their own
REPLAY_LOSSES = ("clipped", "sil")

def check_replay_loss(loss: str) -> str:
    """``loss`` if it is one of :data:`REPLAY_LOSSES`; else ValueError naming the known ones."""
    if loss not in REPLAY_LOSSES:
        raise ValueError(f"unknown self-imitation loss {loss!r}; known: {', '.join(REPLAY_LOSSES)}")
    return loss


#: one replayed sample: the sample record, the advantage its update trained it with, and with
#: prefix-tree advantages the per-completion-token values it was trained with (else None)
Entry = tuple[dict, float, "list[float] | None"]


def positive_entries(samples: list[dict], advantages: list[float],
                     token_advantages: list[list[float]] | None = None) -> list[Entry]:
    """The entries of an update's samples whose own advantage is > 0 (SIL's ``(R - V)+ > 0``),
    each as ``(sample, advantages[i], token_advantages[i] or None)``: what it was trained with.
    ``samples``, ``advantages`` (and ``token_advantages``) are aligned; raises ValueError when
    their lengths differ.
    Example: advantages [+0.5, 0, -0.25, +0.1] -> entries of samples 0 and 3."""
    if len(samples) != len(advantages) or (token_advantages is not None and len(token_advantages) != len(samples)):
        raise ValueError(f"{len(samples)} samples for {len(advantages)} advantages"
                         + ("" if token_advantages is None else f" and {len(token_advantages)} token rows"))
    return [(s, float(a), None if token_advantages is None else list(token_advantages[i]))
            for i, (s, a) in enumerate(zip(samples, advantages)) if a > 0]


class SelfImitationBuffer:
    """The positive-advantage entries of the last ``updates`` updates (oldest dropped first).

    ``entries()`` is what the next update replays; ``add(entries)`` appends one update's (an
    update with no positive sample still takes a slot, so "the last N updates" counts updates).
    ``weight`` (SIL's ``beta^sil``, Oh et al. 2018 eq. 3) scales a replayed entry's advantage
    when it is trained again (:meth:`replay_advantage`); 1: as its update trained it.
    ``loss`` (one of :data:`REPLAY_LOSSES`): the loss the replayed entries are trained under.
    Raises ValueError for ``updates`` < 1, ``weight`` <= 0 or an unknown ``loss``."""

    def __init__(self, updates: int, weight: float = 1.0, loss: str = "clipped"):
        if updates < 1:
            raise ValueError(f"a self-imitation buffer holds >= 1 update, got {updates}")
        if not weight > 0:
            raise ValueError(f"a self-imitation weight is > 0, got {weight}")
        check_replay_loss(loss)
        self.updates = updates
        self.weight = float(weight)
        self.loss = loss
        self._per_update: deque[list[Entry]] = deque(maxlen=updates)

    def add(self, entries: list[Entry]) -> None:
        self._per_update.append(list(entries))

    def entries(self) -> list[Entry]:
        return [e for update in self._per_update for e in update]

    def __len__(self) -> int:
        return sum(len(u) for u in self._per_update)

    def replay_advantage(self, entry: Entry) -> "float | list[float]":
        """The advantage ``entry`` is trained with when replayed: its update's advantage (float,
        or with prefix-tree advantages the per-token row) times ``weight``.
        Example: weight 2.0, entry advantage +0.25 -> +0.5; row [0.1, 0.3] -> [0.2, 0.6]."""
        _, adv, row = entry
        if row is None:
            return adv * self.weight
        return [v * self.weight for v in row]
