"""Fingerprints of models and tokenizers, so caches and manifests follow the files, not their names."""

from __future__ import annotations

import hashlib
from pathlib import Path

_SMALL_FILE_BYTES = 64 << 20


def fingerprint(path_or_id: str) -> str:
    """sha256 over a local file or folder (content for small files, name+size for big
    weight files, which a copy keeps).

    A hub id that is not a local path is fingerprinted by its name only: pin a revision for exactness.
    """
    root = Path(path_or_id)
    digest = hashlib.sha256()
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    else:
        digest.update(f"id:{path_or_id}".encode())
        return digest.hexdigest()
    for file in files:
        stat = file.stat()
        rel = file.name if file == root else file.relative_to(root).as_posix()
        digest.update(f"{rel}\0{stat.st_size}\0".encode())
        if stat.st_size <= _SMALL_FILE_BYTES:
            digest.update(file.read_bytes())
    return digest.hexdigest()
