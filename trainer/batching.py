"""Sample records -> right-padded training tensors. Pure; no re-tokenisation, ever.

A Sample (schemas/avro/sample.v2.avsc) holds the exact token ids vLLM consumed
(``prompt_token_ids``) and produced (``completion_token_ids``) with the behaviour
log-prob of each completion token. Sequence i of a batch is
``prompt_i + completion_i``; completion token j sits at position ``P_i + j``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class BadSample(ValueError):
    """A sample that cannot be trained on; ``reason`` is a short code for logs/counters."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class Batch:
    """Right-padded batch; B sequences, T = longest ``len(prompt) + len(completion)``.

    input_ids          [B, T] long   prompt + completion ids, ``pad_token_id`` after
    attention_mask     [B, T] long   1 on real tokens
    completion_mask    [B, T] float  1.0 on completion tokens only
    behaviour_logprobs [B, T] float  log-prob under the behaviour policy at completion
                                     positions, 0 elsewhere
    advantages         [B, T] float  the sample's advantage at completion positions, 0 elsewhere
    returns            [B]    float  episode_return of each sample (for logging)
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_mask.sum())


def check_sample(sample: dict, max_tokens: int | None = None, vocab_size: int | None = None) -> None:
    """Raise :class:`BadSample` when a Sample cannot be trained on.

    Reasons: ``empty_completion``, ``logprob_mismatch``, ``empty_prompt``, ``oversize`` (prompt +
    completion over ``max_tokens``), ``token_id_out_of_vocab`` (a prompt or completion token id
    outside ``[0, vocab_size)``, the trained model's embedding rows: a sample of another model,
    e.g. a topic replayed into a trainer of a smaller vocabulary, which the embedding would
    otherwise fail on with an IndexError mid-update).
    """
    t = sample["transition"]
    n = len(t["completion_token_ids"])
    if n == 0:
        raise BadSample("empty_completion", "no completion tokens")
    if len(t["behaviour_logprobs"]) != n:
        raise BadSample("logprob_mismatch",
                        f"{len(t['behaviour_logprobs'])} behaviour log-probs for {n} completion tokens")
    if not t["prompt_token_ids"]:
        raise BadSample("empty_prompt", "no prompt tokens")
    total = len(t["prompt_token_ids"]) + n
    if max_tokens is not None and total > max_tokens:
        raise BadSample("oversize", f"{total} tokens > max_tokens {max_tokens}")
    if vocab_size is not None:
        for part in ("prompt_token_ids", "completion_token_ids"):
            bad = [x for x in t[part] if not 0 <= x < vocab_size]
            if bad:
                raise BadSample("token_id_out_of_vocab", f"{len(bad)} {part} outside [0, {vocab_size}) "
                                f"(first {bad[0]}): a sample of another model?")


def collate(samples: list[dict], pad_token_id: int = 0, advantages: list[float] | None = None) -> Batch:
    """Stack Sample dicts into a :class:`Batch`.

    ``advantages`` overrides each sample's ``advantage`` (e.g. REINFORCE++ batch
    normalisation): a float per sample (every completion token gets it) or a list of one
    float per completion token (``losses.prefix_tree_advantages``); default: the sample's own
    GRPO advantage. Raises ValueError for a per-token list of the wrong length.
    """
    B = len(samples)
    if B == 0:
        raise ValueError("collate needs at least one sample")
    lengths = [len(s["transition"]["prompt_token_ids"]) + len(s["transition"]["completion_token_ids"]) for s in samples]
    T = max(lengths)
    input_ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    completion_mask = torch.zeros((B, T), dtype=torch.float32)
    behaviour = torch.zeros((B, T), dtype=torch.float32)
    adv = torch.zeros((B, T), dtype=torch.float32)
    returns = torch.zeros(B, dtype=torch.float32)
    for i, s in enumerate(samples):
        t = s["transition"]
        P, C = len(t["prompt_token_ids"]), len(t["completion_token_ids"])
        input_ids[i, :P + C] = torch.tensor(list(t["prompt_token_ids"]) + list(t["completion_token_ids"]))
        attention_mask[i, :P + C] = 1
        completion_mask[i, P:P + C] = 1.0
        behaviour[i, P:P + C] = torch.tensor(t["behaviour_logprobs"], dtype=torch.float32)
        a = s["advantage"] if advantages is None else advantages[i]
        if isinstance(a, (list, tuple)):
            if len(a) != C:
                raise ValueError(f"{len(a)} token advantages for a completion of {C} tokens")
            adv[i, P:P + C] = torch.tensor(a, dtype=torch.float32)
        else:
            adv[i, P:P + C] = float(a)
        returns[i] = float(t["episode_return"])
    return Batch(input_ids, attention_mask, completion_mask, behaviour, adv, returns)


def token_budget_batches(samples: list[dict], max_padded_tokens: int, max_size: int) -> list[list[int]]:
    """Indices of ``samples`` packed into micro-batches, longest first, so that each
    micro-batch's padded size ``len(batch) * longest`` stays within ``max_padded_tokens``
    (a single longer sample gets a micro-batch of its own) and holds at most ``max_size``
    samples. Bounds activation memory by tokens, not by a sample count.
    """
    lengths = [len(s["transition"]["prompt_token_ids"]) + len(s["transition"]["completion_token_ids"]) for s in samples]
    return length_budget_batches(lengths, max_padded_tokens, max_size)


def length_budget_batches(lengths: list[int], max_padded_tokens: int, max_size: int) -> list[list[int]]:
    """:func:`token_budget_batches` of sequences of the given ``lengths`` (e.g. prefix-merged
    rows, trainer/prefix_merge.py). Example: lengths [3, 5, 2], budget 8, size 4 -> [[1], [0, 2]]."""
    if max_padded_tokens < 1 or max_size < 1:
        raise ValueError("micro-batch limits must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < max_size and \
                (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_padded_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def completion_window(batch: Batch) -> int:
    """Number K of trailing positions that hold every completion token of ``batch`` plus the
    position just before the first one (which predicts it); logits are needed only there."""
    first = int(batch.completion_mask.argmax(dim=1).min())  # earliest completion position
    return batch.input_ids.shape[1] - max(first - 1, 0)


def micro_batches(samples: list, size: int) -> list[list]:
    """Consecutive chunks of at most ``size`` samples (bounds activation memory)."""
    if size < 1:
        raise ValueError("micro-batch size must be >= 1")
    return [samples[i:i + size] for i in range(0, len(samples), size)]


# ---- group batching: updates cut by a count of complete groups ------------------------------

def _group_key(sample: dict) -> tuple[str, str, int, int]:
    """``(group_id, rollout_id, the rollout's selected calls, the group's rollouts)`` of a Sample."""
    t = sample["transition"]
    return sample["group_id"], t["rollout_id"], int(t["rollout_transition_count"]), int(sample["group_rollouts"])


def group_cut(samples: Sequence[dict | None], groups: int, stalled_after: int | None = None) -> int | None:
    """Where ``groups`` batching cuts the next update: the length of the shortest prefix of
    ``samples`` (the trainer's buffer in reading order; None: an entry that was not decodable)
    that holds at least ``groups`` complete groups and no incomplete one; None while there is
    none (read more). The cut depends on the samples and their order only, never on time, and
    each group's samples go to one update.

    A group (``group_id``) is complete when it holds ``group_rollouts`` rollouts, each with its
    ``rollout_transition_count`` samples (the stream job emits a closed group's samples
    together). A group that cannot complete (a sample dead-lettered or refused, a late member
    whose group was trained before) would hold every update back: once ``stalled_after``
    (default ``2 * groups``) groups are complete, the shortest prefix with ``groups`` complete
    groups is cut anyway, with what the stalled group has so far.

    Example: buffer ``a1 a2 b1 c1 b2`` (group a: one rollout of two calls; b: one rollout of two
    calls, c: one of one call): ``group_cut(buffer, 1) == 2`` (a), ``group_cut(buffer, 2) == 5``
    (a, c complete at 4 but b is open there), ``group_cut(buffer[:4], 3) is None``.
    """
    if groups < 1:
        raise ValueError("groups per update must be >= 1")
    stalled_after = 2 * groups if stalled_after is None else stalled_after
    seen: dict[str, dict[str, int]] = {}  # group -> rollout -> its samples read
    wanted: dict[str, dict[str, int]] = {}  # group -> rollout -> its samples in all
    rollouts: dict[str, int] = {}  # group -> its rollouts
    done: set[str] = set()  # the complete groups
    stalled_cut = None
    for i, sample in enumerate(samples):
        if sample is not None:
            gid, rid, n_calls, n_rollouts = _group_key(sample)
            calls = seen.setdefault(gid, {})
            calls[rid] = calls.get(rid, 0) + 1
            wanted.setdefault(gid, {})[rid] = n_calls
            rollouts[gid] = max(rollouts.get(gid, 0), n_rollouts)
            if len(calls) >= rollouts[gid] and calls == wanted[gid]:
                done.add(gid)
            else:
                done.discard(gid)
        if len(done) >= groups:
            if len(done) == len(seen):
                return i + 1
            stalled_cut = stalled_cut or i + 1
        if len(done) >= stalled_after and stalled_cut is not None:
            return stalled_cut
    return None
