"""Prefix-merged training rows: the calls of one attempt that extend each other, as one sequence.

Where this sits in the update: train.py's ``train_update`` gives each mini-batch's samples
(content order, advantages already computed by ``sample_advantages`` / ``token_advantages``)
and their loss weights (``losses.sequence_loss_weights``) to :func:`merge_calls` and
:func:`collate_rows` instead of ``batching.collate``; the rows then go through the same
forward and ``losses.ppo_clip_loss`` as per-call batches.

An agent's second call usually re-sends the first call's prompt, the model's answer, and what
came back (a tool result, a user turn): call k+1's ``prompt_token_ids`` start with call k's
``prompt_token_ids + completion_token_ids``. Trained per call, that shared prefix is forwarded
once per call. Merged, a chain of such calls is one row, the last call's ``prompt +
completion``; each call's completion tokens keep their place (same position, same tokens
before them), so under a causal model each of them gets the same log-prob as in its own
sequence. Tokens the policy did not sample (the first prompt, a tool result or user turn
inserted between two calls) are masked out of the loss; each completion token carries its
own call's advantage, behaviour log-prob and loss weight, so the loss and its gradient are
those of the calls trained one by one, with fewer tokens forwarded.

Sources: Agent Lightning v1's trajectory aggregation (``agentlightning/verl/daemon.py``,
``trace_aggregator = {"level": "trajectory"}``: consecutive turns of a rollout are merged while
``prompt + response`` of the next starts with the current context; inserted prompt tokens get
response mask 0; its mismatch diagnostics are "template", "retoken" and "others"), and AReaL's
tree training (agentic rollouts whose turns share prefixes packed into one forward, each token
attending only to its own ancestors). Here a chain is only ever a path (each call extends the
previous one), so a plain causal row is exact.

A chain breaks between consecutive calls of one attempt (``(rollout_id, attempt_id)``, calls in
``call_index`` order) for one of :data:`BREAK_CAUSES`:

- ``different_agent``: the two calls have different ``agent_name`` (two roles of a
  multi-agent attempt); checked first, whatever the tokens;
- ``template_rewrite``: the next prompt differs from ``prev prompt + prev completion`` inside
  the previous prompt (the history was re-rendered: a changed system turn, a dropped
  message, a context window cut);
- ``truncation``: the difference is at or after the seam and the previous completion was cut
  (its ``finish_reason`` is ``length``; when the transition does not record one, as
  ``transition`` v2 does not, a completion that does not end with one of ``stop_token_ids``);
- ``retokenisation``: the difference is at or after the seam of a completion that ended
  normally (the agent's text of the answer tokenised again differently from the sampled ids,
  or the template rendering the turn's end otherwise);
- ``same_prompt``: the next prompt is exactly the previous one (another choice of an ``n`` > 1
  request, which the proxy records as calls of their own, or a retried request): siblings,
  not a continuation; a row holds a path, not a tree (AReaL's tree attention would share them).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spanrl.trainer import batching

#: why two consecutive calls of one attempt are not one row (module docstring)
BREAK_CAUSES = ("template_rewrite", "retokenisation", "truncation", "different_agent", "same_prompt")


@dataclass
class MergedRow:
    """One training row: a chain of calls, as the last call's ``prompt + completion``.

    T = ``len(input_ids)``; every list below has T entries.
    input_ids          [T] token ids (the last call's prompt + completion)
    loss_mask          [T] 1.0 on the completion tokens of the covered calls, 0.0 elsewhere
                       (the first prompt and every token inserted between two calls)
    advantages         [T] the advantage of the token's own call (per token with prefix-tree
                       advantages), 0.0 where the mask is 0
    behaviour_logprobs [T] the token's behaviour log-prob (its call's record), 0.0 where the mask is 0
    token_sample       [T] the index (into the samples given) of the call the token was
                       sampled in, -1 where the mask is 0
    samples            the indices of the calls covered, in call order
    """

    input_ids: list[int]
    loss_mask: list[float]
    advantages: list[float]
    behaviour_logprobs: list[float]
    token_sample: list[int]
    samples: list[int]


@dataclass
class Merge:
    """What :func:`merge_calls` made: ``rows`` (ordered by their first sample's index),
    ``breaks`` (cause -> count, every cause present), ``links`` (pairs of consecutive calls
    merged), ``tokens`` (forwarded in the rows) and ``tokens_per_call`` (what the calls one
    by one would forward)."""

    rows: list[MergedRow]
    breaks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BREAK_CAUSES, 0))
    links: int = 0
    tokens: int = 0
    tokens_per_call: int = 0


def truncated(transition: dict, stop_token_ids: "set[int] | None" = None) -> bool:
    """Whether a call's completion was cut before it ended: its recorded ``finish_reason`` is
    ``length`` when it has one; else, with ``stop_token_ids``, a completion whose last token
    is none of them (vLLM's ``token_ids`` end with the end-of-sequence token when the model
    stopped; a stop string would also read as cut); else False.
    Example: completion [5, 2] with stop ids {2} -> False; [5, 6] -> True."""
    reason = transition.get("finish_reason")
    if reason is not None:
        return reason == "length"
    if stop_token_ids is None:
        return False
    comp = transition["completion_token_ids"]
    return not comp or int(comp[-1]) not in stop_token_ids


def break_cause(prev: dict, nxt: dict, stop_token_ids: "set[int] | None" = None) -> "str | None":
    """Why the call ``nxt`` (a transition dict) does not extend ``prev`` (the call before it
    in the same attempt), or None when it does: ``nxt``'s prompt starts with exactly
    ``prev``'s prompt + completion (module docstring for the causes and their order).
    Example: prev prompt [1, 2], completion [3]; next prompt [1, 2, 3, 4] -> None,
    [1, 9, 3, 4] -> "template_rewrite", [1, 2, 7, 4] -> "retokenisation", [1, 2] -> "same_prompt"."""
    if prev.get("agent_name") != nxt.get("agent_name"):
        return "different_agent"
    p = list(prev["prompt_token_ids"])
    context = p + list(prev["completion_token_ids"])
    prompt = list(nxt["prompt_token_ids"])
    if prompt[:len(context)] == context:
        return None
    first = next((j for j, (a, b) in enumerate(zip(prompt, context)) if a != b), min(len(prompt), len(context)))
    if first < len(p):
        return "template_rewrite"
    if prompt == p:
        return "same_prompt"
    return "truncation" if truncated(prev, stop_token_ids) else "retokenisation"


def _attempt(sample: dict, i: int) -> tuple:
    t = sample["transition"]
    if "rollout_id" not in t:  # a hand-made sample: a chain of its own
        return ("sample", i)
    return ("attempt", t["rollout_id"], t.get("attempt_id"))


def merge_calls(samples: list[dict], advantages: list, stop_token_ids: "set[int] | None" = None) -> Merge:
    """Merge an update's calls into rows (Agent Lightning v1's trajectory aggregation, with
    each call's own advantage and behaviour log-probs kept per token).

    ``samples``: Sample dicts (``transition`` with ``prompt_token_ids``,
    ``completion_token_ids``, ``behaviour_logprobs``, ``rollout_id``, ``attempt_id``,
    ``call_index``, ``sequence_id``, ``agent_name``); ``advantages[i]``: sample i's advantage,
    a float or a list of one float per completion token (as ``batching.collate``).
    ``stop_token_ids``: end-of-sequence ids, to tell a cut completion when the transition
    records no ``finish_reason`` (:func:`truncated`). The calls of an attempt, in
    ``(call_index, sequence_id)`` order, are walked pairwise: a call that extends the previous
    one (:func:`break_cause` None) joins its row, else it starts a new row and the break is
    counted by cause. A sample without ``rollout_id`` is a row of its own.
    Returns a :class:`Merge`; raises ValueError when the lengths of ``samples`` and
    ``advantages`` differ or a per-token advantage list has the wrong length.
    Example: calls A (prompt [1, 2], completion [3], advantage 0.5, behaviour [-0.1]) and B
    (prompt [1, 2, 3, 4], completion [5, 6], advantage 0.5, behaviour [-0.2, -0.3]) of one
    attempt -> one row, input_ids [1, 2, 3, 4, 5, 6], loss_mask [0, 0, 1, 0, 1, 1],
    behaviour [0, 0, -0.1, 0, -0.2, -0.3], token_sample [-1, -1, 0, -1, 1, 1]; 6 tokens
    forwarded instead of 3 + 6 = 9.
    """
    if len(samples) != len(advantages):
        raise ValueError(f"{len(samples)} samples for {len(advantages)} advantages")
    attempts: dict[tuple, list[int]] = {}
    for i, s in enumerate(samples):
        attempts.setdefault(_attempt(s, i), []).append(i)
    out = Merge(rows=[])
    for members in attempts.values():
        members.sort(key=lambda i: (samples[i]["transition"].get("call_index", 0),
                                    samples[i]["transition"].get("sequence_id", 0), i))
        row = None
        for prev, i in zip([None] + members[:-1], members):
            t = samples[i]["transition"]
            out.tokens_per_call += len(t["prompt_token_ids"]) + len(t["completion_token_ids"])
            cause = "first" if prev is None else break_cause(samples[prev]["transition"], t, stop_token_ids)
            if cause is None:
                out.links += 1
                _extend(row, t, i, advantages[i])
                continue
            if cause != "first":
                out.breaks[cause] += 1
            row = MergedRow([], [], [], [], [], [])
            out.rows.append(row)
            _extend(row, t, i, advantages[i])
    out.rows.sort(key=lambda r: r.samples[0])
    out.tokens = sum(len(r.input_ids) for r in out.rows)
    return out


def _extend(row: MergedRow, t: dict, i: int, advantage) -> None:
    """Append call ``i`` (transition ``t``) to ``row``, whose ``input_ids`` its prompt starts with."""
    comp = list(t["completion_token_ids"])
    if isinstance(advantage, (list, tuple)):
        if len(advantage) != len(comp):
            raise ValueError(f"{len(advantage)} token advantages for a completion of {len(comp)} tokens")
        adv = [float(a) for a in advantage]
    else:
        adv = [float(advantage)] * len(comp)
    inserted = list(t["prompt_token_ids"])[len(row.input_ids):]
    row.input_ids += inserted + comp
    row.loss_mask += [0.0] * len(inserted) + [1.0] * len(comp)
    row.advantages += [0.0] * len(inserted) + adv
    row.behaviour_logprobs += [0.0] * len(inserted) + [float(x) for x in t["behaviour_logprobs"]]
    row.token_sample += [-1] * len(inserted) + [i] * len(comp)
    row.samples.append(i)


def collate_rows(rows: list[MergedRow], samples: list[dict], weights: list[float],
                 pad_token_id: int = 0) -> tuple[batching.Batch, torch.Tensor]:
    """Right-pad merged rows into a ``batching.Batch`` (B rows, T = the longest row;
    ``completion_mask`` = the rows' loss masks, ``returns`` = each row's first call's
    ``episode_return``) and the per-token loss weights ``[B, T]``: ``weights[i]`` (sample i's
    weight, ``losses.sequence_loss_weights``) at each completion token of sample i, 0 elsewhere,
    so ``losses.ppo_clip_loss(..., token_weights=)`` sums each call's tokens as it would per call.
    Example: the row of :func:`merge_calls`' example with weights [1/3, 1/3] ->
    token weights [0, 0, 1/3, 0, 1/3, 1/3]."""
    if not rows:
        raise ValueError("collate_rows needs at least one row")
    B, T = len(rows), max(len(r.input_ids) for r in rows)
    input_ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    mask, behaviour, adv, token_w = (torch.zeros((B, T), dtype=torch.float32) for _ in range(4))
    returns = torch.zeros(B, dtype=torch.float32)
    for b, r in enumerate(rows):
        n = len(r.input_ids)
        input_ids[b, :n] = torch.tensor(r.input_ids, dtype=torch.long)
        attention_mask[b, :n] = 1
        mask[b, :n] = torch.tensor(r.loss_mask)
        behaviour[b, :n] = torch.tensor(r.behaviour_logprobs)
        adv[b, :n] = torch.tensor(r.advantages)
        token_w[b, :n] = torch.tensor([weights[i] if i >= 0 else 0.0 for i in r.token_sample])
        returns[b] = float(samples[r.samples[0]]["transition"]["episode_return"])
    return batching.Batch(input_ids, attention_mask, mask, behaviour, adv, returns), token_w
