"""Fingerprints of models and tokenizers, so caches and manifests follow the files, not their names."""

from __future__ import annotations

import hashlib
from pathlib import Path

from fsspec.core import url_to_fs

_SMALL_FILE_BYTES = 64 << 20
_CHUNK_BYTES = 16 << 20
_VERSION_KEYS = ("ETag", "etag", "md5Hash", "LastModified", "mtime")  # what changes with an object's content


def fingerprint(path_or_id: str, whole: bool = False) -> str:
    """sha256 over a local file or folder (content for small files, name+size for big
    weight files, which a copy keeps; content for every file when `whole`).

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
        if whole or stat.st_size <= _SMALL_FILE_BYTES:
            with file.open("rb") as stream:
                while chunk := stream.read(_CHUNK_BYTES):
                    digest.update(chunk)
    return digest.hexdigest()


def data_fingerprint(source: str) -> str:
    """What the prompt stage's cache follows: every byte of a local dataset (a file edited in place, whatever its
    size, is read again), or each object's name, size and ETag in an object store (s3://…), whose ETag changes
    with the content. A hub id is its name (pin a revision)."""
    if "://" not in source or source.startswith("file://"):
        return fingerprint(source.removeprefix("file://"), whole=True)
    fs, path = url_to_fs(source)
    digest = hashlib.sha256()
    for name, info in sorted(fs.find(path, detail=True).items()):
        version = next((info[key] for key in _VERSION_KEYS if info.get(key)), None)
        digest.update(f"{name}\0{info.get('size')}\0{version}\0".encode())
    return digest.hexdigest()
