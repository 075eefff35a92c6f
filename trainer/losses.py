"""RL losses of the trainer: pure torch functions over padded batches.

Algorithm logic only (no DeepSpeed, no Kafka). Every tensor is right-padded
``[B, T]`` (B sequences, T positions of ``prompt + completion`` tokens) with a float
``completion_mask`` that is 1.0 exactly at completion-token positions. Position ``t``
of a log-prob tensor holds ``log pi(input_ids[t] | input_ids[:t])``.

Token-mean convention: a loss is the sum over every completion token of the batch
divided by ``normaliser`` (default: the number of completion tokens in the batch,
``completion_mask.sum()``), i.e. a mean over all completion tokens of the batch, not
a mean of per-sequence means (DAPO, arXiv 2503.14476 s3.3 "token-level loss"). To
accumulate gradients over micro-batches pass the token count of the whole update as
``normaliser`` so the micro-batch losses add up to the token mean of the update.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor, normaliser: float | torch.Tensor | None = None) -> torch.Tensor:
    """Sum of ``x`` over ``mask`` divided by ``normaliser`` (default ``mask.sum()``, at least 1)."""
    if normaliser is None:
        normaliser = mask.sum().clamp(min=1.0)
    return masked_sum(x, mask) / normaliser


def tempered(x: torch.Tensor, temperature: float | None) -> torch.Tensor:
    """``x / temperature``: the logits of the distribution a call sampled at ``temperature``
    was drawn from, ``softmax(logits / T)`` (vLLM's sampler divides the logits by the
    request's temperature before sampling, vllm/v1/sample/sampler.py ``apply_temperature``;
    verl's actor divides its logits by the rollout temperature before its log-probs likewise,
    verl/workers/actor/dp_actor.py). ``temperature`` None or 1: ``x`` itself (the same
    tensor). Raises ValueError for a temperature that is not > 0."""
    if temperature is None or temperature == 1:
        return x
    if not temperature > 0:
        raise ValueError(f"a sampling temperature must be > 0, got {temperature}")
    return x / temperature


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor,
                   temperature: float | None = None) -> torch.Tensor:
    """Log-probs of the tokens actually in ``input_ids`` under ``logits`` (divided by
    ``temperature``, :func:`tempered`: the log-probs of tokens sampled at that temperature).

    logits ``[B, T, V]`` (position t predicts token t+1), input_ids ``[B, T]``,
    completion_mask ``[B, T]``. Returns ``[B, T]`` float32: entry ``t`` is
    ``log softmax(logits[t-1] / temperature)[input_ids[t]]`` where the mask is 1, else 0
    (position 0 has no prediction and is never a completion token).
    """
    # log pi(x_t | x_<t) = logit_{t-1}[x_t] - logsumexp(logit_{t-1})
    shifted = tempered(logits[:, :-1, :].float(), temperature)
    targets = input_ids[:, 1:].unsqueeze(-1)
    logp = shifted.gather(-1, targets).squeeze(-1) - torch.logsumexp(shifted, dim=-1)
    out = F.pad(logp, (1, 0), value=0.0)
    return out * completion_mask


class _TargetLogprob(torch.autograd.Function):
    """``log softmax(h @ W.T / temperature)[target]`` per row, computed ``chunk`` rows at a
    time (the float32 logits divided by the temperature, as :func:`token_logprobs` divides
    them); only the inputs and one logsumexp per row are kept for backward, which recomputes
    each chunk's logits (see :func:`chunked_token_logprobs`)."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk, temperature):
        n = h.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        target_logit = torch.empty(n, dtype=torch.float32, device=h.device)
        for s in range(0, n, chunk):
            logits = tempered((h[s:s + chunk] @ weight.T).float(), temperature)  # [c, V], as the lm_head then .float()
            lse[s:s + chunk] = torch.logsumexp(logits, dim=-1)
            target_logit[s:s + chunk] = logits.gather(-1, targets[s:s + chunk, None]).squeeze(-1)
            del logits
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.chunk, ctx.temperature = chunk, temperature
        return target_logit - lse

    @staticmethod
    def backward(ctx, grad):
        h, weight, targets, lse = ctx.saved_tensors
        chunk, temperature = ctx.chunk, ctx.temperature
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for s in range(0, h.shape[0], chunk):
            hc, g = h[s:s + chunk], grad[s:s + chunk].float()
            # d logp / d (logits / T) = onehot(target) - softmax(logits / T); d (logits / T) / d logits = 1 / T
            dlogits = torch.exp(tempered((hc @ weight.T).float(), temperature) - lse[s:s + chunk, None])
            dlogits.mul_(-g[:, None])
            dlogits[torch.arange(hc.shape[0], device=h.device), targets[s:s + chunk]] += g
            dlogits = tempered(dlogits, temperature)
            if grad_h is not None:
                grad_h[s:s + chunk] = dlogits.to(h.dtype) @ weight
            if grad_w is not None:
                grad_w += dlogits.T @ hc.float()
            del dlogits
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


def chunked_token_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, input_ids: torch.Tensor,
                           completion_mask: torch.Tensor, chunk: int = 256,
                           temperature: float | None = None) -> torch.Tensor:
    """:func:`token_logprobs` of ``logits = hidden @ lm_head_weight.T`` without ever holding
    the ``[B, T, V]`` logits: only positions whose next token is a completion token are
    scored, ``chunk`` of them at a time, each keeping its target logit and its logsumexp
    (backward recomputes the chunk's logits). Peak extra memory ~3 x ``chunk`` x V float32
    instead of ~3 x B x T x V; one more ``[chunk, H] x [H, V]`` matmul per chunk in backward.

    hidden ``[B, T, H]`` (the final hidden states, after the last norm: position t predicts
    token t+1), lm_head_weight ``[V, H]`` (an lm_head without bias or logit soft-capping),
    input_ids ``[B, T]``, completion_mask ``[B, T]``. Returns ``[B, T]`` float32, the same
    values (and gradients w.r.t. ``hidden`` and the weight) as ``token_logprobs`` up to float
    rounding. With ``temperature``, the log-probs of :func:`token_logprobs` at that
    temperature (each chunk's float32 logits divided by it, as there).
    Raises ValueError for ``chunk`` < 1 or a temperature that is not > 0.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    tempered(hidden[:0], temperature)  # a temperature that is not > 0 raises before any work
    scored = completion_mask[:, 1:] > 0  # [B, T-1]: positions t-1 that predict a completion token t
    logp = _TargetLogprob.apply(hidden[:, :-1][scored], lm_head_weight, input_ids[:, 1:][scored], chunk,
                                temperature)
    out = torch.zeros(scored.shape, dtype=torch.float32, device=hidden.device).masked_scatter(scored, logp)
    return F.pad(out, (1, 0), value=0.0) * completion_mask


def ppo_clip_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    clip_eps: float = 0.2,
    normaliser: float | torch.Tensor | None = None,
    kl_coef: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    ratio_cap: float | None = None,
) -> torch.Tensor:
    """PPO-clip / GRPO surrogate, token mean over the batch (see module doc).

    All inputs ``[B, T]``; ``advantages`` is the sequence advantage broadcast per token.
    With ``kl_coef > 0`` and ``ref_logp`` adds ``kl_coef * k3(pi || pi_ref)`` per token.
    ``token_weights`` ``[B, T]`` (zero off the completion): the loss is
    ``sum(per_token * token_weights)`` instead of the token mean (``normaliser`` unused);
    see :func:`sequence_loss_weights`. ``ratio_cap`` (c > 1; None: off): dual-clip, the
    per-token loss of a negative advantage is at most ``-c * A`` (:func:`dual_clip`), which
    bounds the importance ratio where PPO's clip does not.
    """
    # PPO clipped objective: Schulman et al. 2017 (arXiv 1707.06347) eq. 7;
    # GRPO: Shao et al. 2024 (arXiv 2402.03300) eq. 3, ratio against the behaviour
    # policy that generated the tokens (vLLM's log-probs).
    ratio = torch.exp(logp - behaviour_logp)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.max(pg_loss1, pg_loss2)
    if ratio_cap is not None:
        per_token = dual_clip(per_token, advantages, ratio_cap)
    if kl_coef and ref_logp is not None:
        per_token = per_token + kl_coef * k3_reference_kl(logp, ref_logp)
    if token_weights is not None:
        return masked_sum(per_token, completion_mask * token_weights)
    return masked_mean(per_token, completion_mask, normaliser)


def self_imitation_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    token_weights: torch.Tensor,
    kl_coef: float = 0.0,
    ref_logp: torch.Tensor | None = None,
) -> torch.Tensor:
    """Self-Imitation Learning's policy loss for replayed samples, unclipped:
    ``sum(-log pi(a|s) * max(A, 0) * token_weights)`` (Oh et al. 2018, ICML, eq. 2, with the
    sample's replayed advantage as ``(R - V)+``), plus ``kl_coef * k3(pi || pi_ref)`` per token
    as in :func:`ppo_clip_loss`. Its gradient per token is ``-max(A, 0) * w``, whatever the
    ratio to the behaviour policy: no clip ends the push (the PPO clip stops a positive
    advantage's gradient once the ratio passes ``1 + clip_eps``). All ``[B, T]``; a scalar.
    Example: logp [-1, -2], A [0.5, -0.5], weights [0.25, 0.25] -> 0.25 * 0.5 * 1 = 0.125."""
    per_token = -logp * advantages.clamp(min=0.0)
    if kl_coef and ref_logp is not None:
        per_token = per_token + kl_coef * k3_reference_kl(logp, ref_logp)
    return masked_sum(per_token, completion_mask * token_weights)


def dual_clip(per_token: torch.Tensor, advantages: torch.Tensor, ratio_cap: float) -> torch.Tensor:
    """Dual-clip PPO (Ye et al. 2020, arXiv 1912.09729, eq. 5): for a negative advantage the
    clipped objective ``min(r A, clip(r) A)`` is unbounded as the ratio r grows (a token the
    behaviour policy made unlikely); the dual clip takes ``max(., c A)``, so the per-token
    loss is ``min(loss, -c A)`` where A < 0 and unchanged where A >= 0. ``[B, T]`` tensors;
    raises ValueError unless c > 1. Example: A = -1, r = 5, eps 0.2, c = 3: PPO loss 5 -> 3."""
    if not ratio_cap > 1.0:
        raise ValueError(f"ratio_cap must be > 1, got {ratio_cap!r}")
    return torch.where(advantages < 0, torch.minimum(per_token, -ratio_cap * advantages), per_token)


LOSS_AGGREGATIONS = ("token_mean", "sequence_mean", "per_rollout_mean")


def sequence_loss_weights(rollout_keys: list, completion_lengths: list[int], agg: str = "token_mean") -> list[float]:
    """Weight ``w_i`` of every completion token of sample ``i`` in an update's loss
    ``sum_i w_i sum_t loss_it`` (the weights of all tokens sum to 1).

    - ``token_mean``: ``w_i = 1 / N``, N = completion tokens of the update (DAPO's token-level
      loss, arXiv 2503.14476 s3.3): a rollout with many calls weighs more.
    - ``sequence_mean``: every sample (one LLM call) weighs the same and its tokens share that
      weight, ``w_i = 1 / (S * L_i)`` with S samples in the update: GRPO's own objective, the
      mean over outputs of per-output token means (DeepSeekMath, arXiv 2402.03300 eq. 3).
    - ``per_rollout_mean``: every rollout weighs the same and its tokens share its weight,
      ``w_i = 1 / (R * L_r(i))`` with R rollouts in the update and ``L_r`` the completion
      tokens of rollout r (Agent Lightning's ``per_rollout_mean`` loss option): a failed
      rollout that used every turn no longer outweighs a short successful one.

    ``rollout_keys[i]``: the rollout (e.g. ``(rollout_id, attempt_id)``) of sample i;
    ``completion_lengths[i] > 0``. Raises ValueError for an unknown ``agg`` or mismatched
    lengths. Example: lengths [2, 2, 4] of rollouts [a, a, b] give token_mean [1/8]*3 and
    per_rollout_mean [1/8, 1/8, 1/8]; lengths [1, 1, 6] give [1/8]*3 and [1/4, 1/4, 1/12];
    sequence_mean of lengths [2, 2, 4]: [1/6, 1/6, 1/12].
    """
    if len(rollout_keys) != len(completion_lengths):
        raise ValueError("one rollout key per completion length")
    if agg == "token_mean":
        n = sum(completion_lengths)
        return [1.0 / n] * len(completion_lengths)
    if agg == "sequence_mean":
        s = len(completion_lengths)
        return [1.0 / (s * length) for length in completion_lengths]
    if agg == "per_rollout_mean":
        per_rollout: dict = {}
        for key, length in zip(rollout_keys, completion_lengths):
            per_rollout[key] = per_rollout.get(key, 0) + length
        r = len(per_rollout)
        return [1.0 / (r * per_rollout[key]) for key in rollout_keys]
    raise ValueError(f"unknown loss aggregation {agg!r}; known: {', '.join(LOSS_AGGREGATIONS)}")


def reference_kl(logp: torch.Tensor, ref_logp: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Token mean of the k3 estimator of KL(pi_theta || pi_ref) on the sampled tokens,
    ``exp(ref - logp) - (ref - logp) - 1`` (>= 0; DeepSeekMath, arXiv 2402.03300 eq. 4, the
    term :func:`ppo_clip_loss` adds with ``kl_coef``). ``[B, T]`` tensors; a scalar.
    Example: logp = log 0.5, ref = log 0.25 per token -> 0.5 - log 0.5 - 1 = 0.1931."""
    return masked_mean(k3_reference_kl(logp, ref_logp), completion_mask)


def k3_reference_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per token, the unbiased k3 estimator of KL(pi_theta || pi_ref) on the sampled tokens,
    ``exp(ref - logp) - (ref - logp) - 1`` (GRPO, DeepSeekMath arXiv 2402.03300 eq. 4); ``[B, T]``."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1.0


def approx_kl(logp: torch.Tensor, behaviour_logp: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Token mean of the k3 estimator of KL(behaviour || current)."""
    # k3 = (r - 1) - log r: J. Schulman, "Approximating KL Divergence" (2020 blog); CleanRL ppo.py
    log_ratio = logp - behaviour_logp
    ratio = torch.exp(log_ratio)
    return masked_mean((ratio - 1.0) - log_ratio, completion_mask)


def clip_fraction(logp: torch.Tensor, behaviour_logp: torch.Tensor, completion_mask: torch.Tensor,
                  clip_eps: float = 0.2) -> torch.Tensor:
    """Fraction of completion tokens whose ratio lies outside ``[1-eps, 1+eps]`` (CleanRL ``clipfracs``)."""
    ratio = torch.exp(logp - behaviour_logp)
    return masked_mean(((ratio - 1.0).abs() > clip_eps).float(), completion_mask)


def dr_grpo_advantages(returns: list[float], group_means: list[float]) -> list[float]:
    """Dr. GRPO advantages ``A_i = R_i - mean_group(R)``: GRPO's group baseline without the
    division by the group's std (Liu et al. 2025, "Understanding R1-Zero-Like Training",
    arXiv 2503.20783 s3.1: dividing by std weighs groups of nearly equal rewards up, a
    question-level difficulty bias). ``returns[i]``: sample i's episode return R;
    ``group_means[i]``: the mean return of its group (the sample's ``group_mean``).
    Example: a format-only group R = [0.1]*5 + [0] has mean 0.0833: A = [+0.0167]*5 + [-0.0833]
    (GRPO: [+0.447]*5 + [-2.236]); a group [1, 0] gives [+0.5, -0.5] (GRPO: [+1, -1]).
    Raises ValueError when the lists differ in length."""
    if len(returns) != len(group_means):
        raise ValueError(f"{len(returns)} returns for {len(group_means)} group means")
    return [float(r) - float(m) for r, m in zip(returns, group_means)]


def negative_weighted_advantages(advantages: list[float], negative_weight: float = 1.0) -> list[float]:
    """Advantages with the negative ones scaled: ``A_i' = A_i`` if ``A_i >= 0`` else
    ``negative_weight * A_i``. The policy-gradient objective split into positive and negative
    sample reinforcement, weighted (Zhu et al. 2025, "The Surprising Effectiveness of Negative
    Reinforcement in LLM Reasoning", arXiv 2506.01347, eq. 5's W-REINFORCE weighs the positive
    term by lambda; here the negative term is weighed, so the advantages' scale stays that of
    the positive samples). ``negative_weight`` 1: the plain objective; 0: positive samples only
    (reinforcing correct responses raises pass@1 and lowers diversity, their s4); in between:
    less of the push-down on tokens that punished completions share with rewarded ones.
    Example: [+0.5, -0.25, -0.25] with 0.5 -> [+0.5, -0.125, -0.125].
    Raises ValueError when ``negative_weight`` is outside [0, 1]."""
    if not 0.0 <= negative_weight <= 1.0:
        raise ValueError(f"negative_weight must be in [0, 1], got {negative_weight}")
    return [float(a) if a >= 0 else negative_weight * float(a) for a in advantages]


def prefix_tree_advantages(tree_keys: list, completions: list[list[int]], returns: list[float],
                           advantages: list[float], scales: list[float]) -> list[list[float]]:
    """Per-token advantages from the prefix tree that a group's completions form: a token
    that other completions of the same prompt share, with the same tokens before it, is one
    decision taken once, so it gets the value of everything below it, not its own return.

    The samples with equal ``tree_keys[i]`` (a group and one prompt: e.g. ``(group_id,
    prompt token ids)``) share a root; ``S(i, t)`` is the set of them whose completion starts
    with ``completions[i][:t + 1]``, and its value ``V(i, t)`` the mean of their ``returns``.
    Token ``t`` of sample ``i`` gets ``A[i][t] = advantages[i] + scales[i] * (V(i, t) - R_i)``:
    with ``advantages[i] = scales[i] * (R_i - b)`` (GRPO / Dr. GRPO, baseline b the group
    mean) that is ``scales[i] * (V(i, t) - b)``, TreeRL's global advantage of the node (Hou et
    al. 2025, "TreeRL: LLM Reinforcement Learning with On-Policy Tree Search", arXiv
    2506.11902 s3.2: a node's value is the mean correctness of the leaves below it, its
    advantage that value minus the root's) on the tree that i.i.d. samples form by their
    common prefixes. Tokens after a completion's last shared prefix keep ``advantages[i]``
    (their subtree is the completion alone); a prefix that every completion of the root
    shares gets ``scales[i] * (mean(R) - b)``, 0 when the root holds the whole group. Where
    GRPO pushes a shared token up for the rewarded completions and down for the punished
    ones and relies on the sum to cancel (it does only inside one optimizer step), this
    hands each shared token its net value once.
    Shapes: ``completions[i]`` a list of C_i token ids -> ``A[i]`` a list of C_i floats.
    Example: one root, completions [[5, 6], [5, 7], [8]], returns [1, 0, 0], Dr. GRPO
    (b = 1/3, scales 1, advantages [2/3, -1/3, -1/3]) -> [[1/6, 2/3], [1/6, -1/3], [-1/3]]:
    the shared first token 5 gets (1 + 0) / 2 - 1/3.
    Raises ValueError when the lists differ in length."""
    n = len(tree_keys)
    if not (len(completions) == len(returns) == len(advantages) == len(scales) == n):
        raise ValueError(f"lengths differ: {n} keys, {len(completions)} completions, {len(returns)} returns, "
                         f"{len(advantages)} advantages, {len(scales)} scales")
    # one trie per root: node = (token id path) -> [sum of returns, count], as nested dicts
    roots: dict = {}
    for key, comp, r in zip(tree_keys, completions, returns):
        node = roots.setdefault(key, {})
        for tok in comp:
            child = node.get(tok)
            if child is None:
                child = node[tok] = [0.0, 0, {}]
            child[0] += float(r)
            child[1] += 1
            node = child[2]
    out = []
    for key, comp, r, a, c in zip(tree_keys, completions, returns, advantages, scales):
        node, row = roots[key], []
        for tok in comp:
            total, count, below = node[tok]
            row.append(float(a) + float(c) * (total / count - float(r)))
            node = below
        out.append(row)
    return out


def zero_variance_samples(group_stds: list[float], group_rollouts: list[int], eps: float = 1e-9) -> list[bool]:
    """Which samples belong to a group whose rollouts all got the same return (std 0 with
    more than one member): their GRPO advantage is 0, they give no policy gradient but cost a
    full forward and backward. DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476
    s3.2) keeps only groups with 0 < accuracy < 1; dropping such samples before the update is
    the filtering half of it (no over-sampling to refill the batch). Groups of one are not
    zero-variance here (they get the batch baseline, :func:`singleton_batch_advantages`).
    Example: stds [0, 0.5, 0], rollouts [6, 6, 1] -> [True, False, False]."""
    if len(group_stds) != len(group_rollouts):
        raise ValueError(f"{len(group_stds)} group stds for {len(group_rollouts)} group sizes")
    return [abs(float(s)) <= eps and int(n) > 1 for s, n in zip(group_stds, group_rollouts)]


def mini_batch_indices(keys: list, n: int) -> list[list[int]]:
    """Split an update's samples into ``n`` mini-batches, one optimizer step each (PPO's
    epochs x mini-batches, Schulman et al. 2017 s5 / CleanRL ``num_minibatches``), in a
    deterministic order: sample indices sorted by ``keys[i]`` (any sortable key, e.g.
    ``(task_id, rollout_id, sequence_id)``), then cut into ``n`` consecutive parts whose sizes
    differ by at most one (the first ``len % n`` get one more). The same samples in any
    arrival order give the same mini-batches. ``n`` is capped at the number of samples; raises
    ValueError for n < 1. Example: keys [c, a, b, d, e], n 2 -> [[1, 2, 0], [3, 4]]."""
    if n < 1:
        raise ValueError(f"mini_batches must be >= 1, got {n}")
    order = sorted(range(len(keys)), key=lambda i: keys[i])
    n = max(1, min(n, len(order)))
    size, extra = divmod(len(order), n)
    out, start = [], 0
    for j in range(n):
        end = start + size + (1 if j < extra else 0)
        out.append(order[start:end])
        start = end
    return [m for m in out if m]


def reinforce_pp_advantages(returns: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ advantages: returns normalised over the whole batch, no critic, no groups.

    Hu et al. 2025 (arXiv 2501.03262) s3.2 "advantage normalization" (global batch).
    The per-token KL-in-reward term of the paper is left to ``ppo_clip_loss(kl_coef=)``.
    """
    r = returns.float()
    return (r - r.mean()) / (r.std(unbiased=False) + eps)


def singleton_batch_advantages(group_advantages: torch.Tensor, returns: torch.Tensor,
                               group_rollouts: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages, with the REINFORCE++ batch baseline for samples of a group of one.

    A group of one rollout (a production agent's rollout with no task label, a task whose
    group timed out with one member) has GRPO advantage 0: it would never train. Such samples
    get ``(R - mean_batch R) / (std_batch R + eps)`` instead, the returns normalised over the
    whole batch (Hu et al. 2025, arXiv 2501.03262 s3.2, as :func:`reinforce_pp_advantages`);
    samples of larger groups keep their group advantage (arXiv 2402.03300 s4.1.2).

    group_advantages, returns, group_rollouts: ``[N]`` (a sample's ``advantage``,
    ``transition.episode_return``, ``group_rollouts``). Returns ``[N]`` float32.
    """
    baseline = reinforce_pp_advantages(returns, eps)
    return torch.where(group_rollouts <= 1, baseline, group_advantages.float())

