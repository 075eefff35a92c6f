"""Tree packing: a micro-batch's rows that share a prefix, forwarded as one sequence with the
shared tokens once.

Where this sits in the update: ``train.completion_logprobs`` with a :class:`TreePack` of the
micro-batch (built once per micro-batch by :func:`pack_rows` from its right-padded rows) runs the
model once over ``TreePack.input_ids`` ``[1, N]`` instead of over ``[B, T]``, with each token's
own position id and a ``[1, 1, N, N]`` boolean attention mask that lets a token see only the
tokens of its own row before it (its ancestors in the prefix tree); :func:`unpack_hidden` then
gives each row's final hidden states back as ``[B, K, H]``, so the log-probs, the loss and the
gradients are those of the rows forwarded one by one (up to float rounding), with fewer tokens
forwarded. :func:`tree_budget_batches` groups rows that share prefixes into the same
micro-batch (lexicographic order) under a budget of packed tokens.

Why: the rows of one update share long prefixes — the system prompt and tool definitions of
every call of an agent role, and the whole question within a GRPO group. Measured on the RAG
agent's 0.5B samples (2026-12-07, iteration 0 of the 8-question setting): the `answerer`'s
467-token prompts share 253 tokens across all rows and 346 within a group; the `query_writer`'s
merged rows share 228 across all rows and their whole first prompt (248) within a group.

Source: AReaL's tree training (agentic rollouts whose turns share prefixes packed into one
forward, each token attending only to its own ancestors); here the tree is the prefix trie of a
micro-batch's rows, laid out by sorting the rows (each row after the first adds only the tokens
past its longest common prefix with the row before it, which is its longest common prefix with
any earlier row). A token's position id is its position in its own row, so rotary embeddings
see the same positions as in the row alone. Needs an attention implementation that takes a 4-D
boolean mask (transformers' ``sdpa`` and ``eager``; tests/unit/test_tree_pack.py checks the
installed transformers gives the unpacked log-probs and gradients).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TreePack:
    """A micro-batch's rows as one packed sequence.

    input_ids       [1, N] long   each distinct prefix-tree token once (N = :attr:`tokens`)
    position_ids    [1, N] long   each token's position in its row(s)
    attention_mask  [1, 1, N, N] bool   True where the row token attends to the column token
                                  (an ancestor in the tree or itself)
    index           [B, T] long   packed position of row b's token t (0 past the row's end)
    lengths         list of B row lengths
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    index: torch.Tensor
    lengths: list[int]

    @property
    def tokens(self) -> int:
        """Tokens forwarded packed (N)."""
        return int(self.input_ids.shape[1])

    @property
    def row_tokens(self) -> int:
        """Tokens the rows forwarded one by one would have (sum of the row lengths, no padding)."""
        return sum(self.lengths)


def check_tree_packing(tree_packing: bool, logprob_chunk: int) -> None:
    """ValueError when ``tree_packing`` is on with ``logprob_chunk`` 0: the packed forward's full
    logits would be ``[N, V]`` (trainer/train.py's chunked log-probs read only the rows' windows)."""
    if tree_packing and not logprob_chunk:
        raise ValueError("tree_packing needs logprob_chunk > 0 (the packed forward's full logits would be [N, V])")


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of token lists ``a`` and ``b``.
    Example: [1, 2, 3], [1, 2, 4, 5] -> 2."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def pack_rows(rows: list[list[int]], width: int | None = None) -> TreePack:
    """The prefix-tree packing of ``rows`` (token-id lists, each non-empty); ``index`` is
    ``[B, width]`` (default: the longest row's length), to line up with a padded batch.

    Rows are laid out in lexicographic order; each adds the tokens past its longest common
    prefix with the row before it (a row equal to or a prefix of an earlier one adds nothing).
    Token ``t`` of row ``b`` sits at packed position ``index[b, t]``; the attention mask lets
    packed token ``i`` see packed token ``j`` iff some row holds both with ``j`` at or before
    ``i`` — exactly the tokens before it in its own row, so a causal model gives every row's
    tokens the hidden states of that row forwarded alone.

    Example: rows [[5, 6, 7], [5, 6, 8, 9]] -> input_ids [[5, 6, 7, 8, 9]], position_ids
    [[0, 1, 2, 2, 3]], index [[0, 1, 2, 0], [0, 1, 3, 4]]; token 8 (packed 3) sees 5, 6 and
    itself, not 7. Raises ValueError for no rows or an empty row.
    """
    if not rows:
        raise ValueError("pack_rows needs at least one row")
    if any(len(r) == 0 for r in rows):
        raise ValueError("pack_rows got an empty row")
    order = sorted(range(len(rows)), key=lambda r: rows[r])
    T = max(len(r) for r in rows)
    if width is not None:
        if width < T:
            raise ValueError(f"width {width} < the longest row's {T} tokens")
        T = width
    index = torch.zeros((len(rows), T), dtype=torch.long)
    ids: list[int] = []
    pos: list[int] = []
    prev = None
    for r in order:
        row = rows[r]
        shared = common_prefix(rows[prev], row) if prev is not None else 0
        if shared:
            index[r, :shared] = index[prev, :shared]
        start = len(ids)
        ids.extend(row[shared:])
        pos.extend(range(shared, len(row)))
        index[r, shared:len(row)] = torch.arange(start, start + len(row) - shared)
        prev = r
    N = len(ids)
    mask = torch.zeros((N, N), dtype=torch.bool)
    for r, row in enumerate(rows):
        idx = index[r, :len(row)]
        mask[idx[:, None], idx[None, :]] |= torch.ones((len(row), len(row)), dtype=torch.bool).tril()
    return TreePack(torch.tensor([ids], dtype=torch.long), torch.tensor([pos], dtype=torch.long),
                    mask[None, None], index, [len(r) for r in rows])


def pack_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> TreePack:
    """:func:`pack_rows` of a right-padded batch (``batching.Batch``'s ``input_ids`` and
    ``attention_mask``, ``[B, T]``): row b is ``input_ids[b, :attention_mask[b].sum()]``."""
    lengths = attention_mask.sum(dim=1).tolist()
    return pack_rows([input_ids[b, :n].tolist() for b, n in enumerate(lengths)], width=input_ids.shape[1])


def unpack_hidden(hidden: torch.Tensor, pack: TreePack, window: int) -> torch.Tensor:
    """Each row's trailing ``window`` positions of the packed model output ``hidden``
    (``[1, N, H]``: final hidden states or logits), as ``[B, window, H]`` aligned with the
    right-padded batch's ``[:, -window:]`` columns; positions past a row's end get packed
    position 0's values (padding: the caller masks them). Differentiable (a gather: the
    gradients of shared tokens add up)."""
    idx = pack.index[:, -window:].to(hidden.device)
    return hidden[0][idx]


def tree_budget_batches(rows: list[list[int]], max_tokens: int, max_size: int) -> list[list[int]]:
    """Indices of ``rows`` grouped into micro-batches for tree packing: in lexicographic order
    (rows that share prefixes side by side), each micro-batch at most ``max_size`` rows and at
    most ``max_tokens`` packed tokens (a row longer than that alone gets a micro-batch of its
    own). The packed-token count bounds activation memory as ``batching.length_budget_batches``'s
    padded count does without packing.

    Example: rows [[1, 2, 3], [9, 9], [1, 2, 4]], max_tokens 4, max_size 8 -> [[0, 2], [1]]
    (rows 0 and 2 pack into 4 tokens: 1, 2, 3, 4).
    Raises ValueError for limits < 1.
    """
    if max_tokens < 1 or max_size < 1:
        raise ValueError("micro-batch limits must be >= 1")
    order = sorted(range(len(rows)), key=lambda r: rows[r])
    batches: list[list[int]] = []
    used = 0
    for k, r in enumerate(order):
        new = len(rows[r]) - (common_prefix(rows[order[k - 1]], rows[r]) if batches and k else 0)
        if batches and len(batches[-1]) < max_size and used + new <= max_tokens:
            batches[-1].append(r)
            used += new
        else:
            batches.append([r])
            used = len(rows[r])
    return batches
