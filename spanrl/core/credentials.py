"""The stack's secrets in its state directory, and the checkpoint signature.

Secrets (``state_dir/secrets/``, the directory mode 0700, each file mode 0600, created with
``O_EXCL`` so that two starts never write different ones): ``agent_token`` and
``admin_token`` (the bearer tokens of spanrl/core/edge.py) and ``checkpoint_key`` (the key the
trainer signs each checkpoint manifest with and the reloader verifies; no other service reads
it). :func:`ensure_secrets` makes the missing ones at the stack's first start (``spanrl stack
up``) and leaves existing ones as they are; :func:`read_secret` is how a process on the same
machine finds them (spanrl/core/settings.py: the environment first, then these files).

Signature (:func:`sign`, :func:`verify`): HMAC-SHA256 (RFC 2104, FIPS 198-1) of the manifest's
exact bytes, hex, in ``manifest.sig`` beside ``manifest.json``. The manifest lists the sha256
of every file, so the signature covers the weights; a store writer without the key can
neither forge nor alter one (trainer/checkpoint.py :func:`verify_signature`).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

SECRETS_DIR = "secrets"
AGENT_TOKEN = "agent_token"
ADMIN_TOKEN = "admin_token"
CHECKPOINT_KEY = "checkpoint_key"
ALL = (AGENT_TOKEN, ADMIN_TOKEN, CHECKPOINT_KEY)
#: bytes of randomness per secret (256 bits; ``secrets.token_urlsafe``)
SECRET_BYTES = 32


def secrets_dir(state_dir: Path) -> Path:
    return Path(state_dir) / SECRETS_DIR


def read_secret(state_dir: Path, name: str) -> str | None:
    """The secret ``name`` of the stack at ``state_dir`` (stripped), None when there is none
    (no file, an empty one, or one this user may not read)."""
    return read_file(secrets_dir(state_dir) / name)


def read_file(path: Path) -> str | None:
    """A secret file's value (stripped); None when missing, empty or unreadable."""
    try:
        value = Path(path).read_text().strip()
    except (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError):
        return None
    return value or None


def ensure_secrets(state_dir: Path, names: tuple[str, ...] = ALL) -> list[str]:
    """Create each missing secret of ``names`` (random, :data:`SECRET_BYTES`), mode 0600 in a
    0700 directory; returns the names created now (empty on a later start)."""
    d = secrets_dir(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    made = []
    for name in names:
        path = d / name
        if read_secret(state_dir, name) is not None:
            continue
        path.unlink(missing_ok=True)  # an empty file left by a crash
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another start made it meanwhile
            continue
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(SECRET_BYTES) + "\n")
        made.append(name)
    return made


def sign(key: bytes, data: bytes) -> str:
    """Hex HMAC-SHA256 of ``data`` keyed by ``key``."""
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def verify(key: bytes, data: bytes, signature: str) -> bool:
    """Whether ``signature`` is :func:`sign` of ``data`` (constant-time comparison)."""
    return hmac.compare_digest(sign(key, data).encode(), signature.strip().encode())
