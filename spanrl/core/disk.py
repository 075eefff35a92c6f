"""Bytes on disk: what a directory tree holds (run folders, checkpoints, MinIO's data)."""
from __future__ import annotations

import os
from pathlib import Path


def tree_bytes(path: Path) -> int:
    """Bytes of the files at or below ``path`` (symbolic links not followed, their own size
    counted; 0 if ``path`` is gone). A file removed during the walk is skipped."""
    if path.is_symlink() or not path.is_dir():
        try:
            return path.lstat().st_size
        except OSError:
            return 0
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total
