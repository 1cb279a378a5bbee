"""Fingerprints of models and tokenizers, so caches and manifests follow the files, not their names."""

from __future__ import annotations

import hashlib
from pathlib import Path

_SMALL_FILE_BYTES = 64 << 20


def fingerprint(path_or_id: str) -> str:
    """sha256 over a local folder's files (content for small files, name+size for big weight files).

    A hub id that is not a local folder is fingerprinted by its name only: pin a revision for exactness.
    """
    folder = Path(path_or_id)
    digest = hashlib.sha256()
    if not folder.is_dir():
        digest.update(f"id:{path_or_id}".encode())
        return digest.hexdigest()
    for file in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
        rel = file.relative_to(folder).as_posix()
        size = file.stat().st_size
        digest.update(f"{rel}\0{size}\0".encode())
        if size <= _SMALL_FILE_BYTES:
            digest.update(file.read_bytes())
    return digest.hexdigest()
