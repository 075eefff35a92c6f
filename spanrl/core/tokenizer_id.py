"""A tokenizer's identity: the name of the base model whose tokenizer made a call's token
ids and a sha256 over the files that fix what each id means. Recorded with every proxy call
(span schema v2, ``llm.tokenizer`` / ``llm.tokenizer_sha256``) so that token ids outlive the
model: a replay that trains ids onto a model whose tokenizer hash differs is refused
(spanrl/infra/replay.py) instead of training on ids that mean other text.

Hashed: the vocabulary and merge files, added and special tokens (:data:`FILES`, those
present). Not hashed: ``tokenizer_config.json`` and chat templates, which change how
messages become ids but not what an id means (and which a re-save may reformat). Trainer
checkpoints copy these files from the base model unchanged (trainer/train.py
``save_checkpoint``), so every version of a run has its base's hash.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
         "special_tokens_map.json")


def tokenizer_sha256(model_dir: Path | str) -> str | None:
    """sha256 of ``name NUL sha256(file) LF`` for each of :data:`FILES` present in
    ``model_dir``, in :data:`FILES` order; None when none is (no tokenizer there)."""
    h = hashlib.sha256()
    found = False
    for name in FILES:
        path = Path(model_dir) / name
        if path.is_file():
            found = True
            h.update(f"{name}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())
    return h.hexdigest() if found else None


def mismatch(recorded: Iterable[tuple[str | None, str | None]], target_name: str, target_sha256: str | None
             ) -> str | None:
    """Why token ids recorded with ``recorded`` tokenizers (``(name, sha256)`` pairs, None for
    calls recorded before the identity was kept) cannot train a model whose tokenizer is
    ``target_sha256``; None when they can. Unknown identities (None) are not a mismatch
    (they cannot be checked); a target without a tokenizer hash cannot be checked either. Pure."""
    if target_sha256 is None:
        return None
    other = sorted({(n or "?", h) for n, h in recorded if h is not None and h != target_sha256})
    if not other:
        return None
    names = ", ".join(f"{n} (tokenizer sha256 {h[:12]}…)" for n, h in other)
    return (f"the recorded token ids were made by {names}, not by the tokenizer of {target_name} "
            f"(sha256 {target_sha256[:12]}…): their ids mean other text to it. Re-tokenise the recorded "
            "messages with the new model (docs/replay.md) instead of training the ids")
