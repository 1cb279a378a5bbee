"""One storage layer for every artifact: a run folder on any fsspec filesystem (local by default, s3:// via s3fs).

Paths are always relative to the run's root and cannot escape it. Whole-file writes are atomic: a reader sees
the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import posixpath
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import IO, Any, TypeVar

import fsspec
from fsspec.core import url_to_fs

from eagle3_datagen.artifacts import SHARD_STAGES, ShardRef, artifact_path, lease_file, sha256_hex, shard_index_of
from eagle3_datagen.errors import ConfigurationError, UserError
from eagle3_datagen.s3_upload import s3_upload

T = TypeVar("T")
_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0)


class StoragePathError(ConfigurationError, ValueError):
    """A relative path that would leave the run's folder."""


class OutputNotWritable(ConfigurationError):
    """`output_uri` names a place this process cannot write."""


class WriterFenced(UserError):
    """This process held the run's lease, and another writer has taken it over since: it may write nothing more."""


class ArtifactChanged(UserError, ValueError):
    """A stage's input no longer matches the hash its producer recorded (and downstream caches are keyed on)."""


@dataclass(frozen=True)
class RunLocation:
    """Which run a stage works on: the folder `{output_uri}/{run_name}/`, and the `epoch` of the lease its writer
    holds (0: a reader's, or a run written without one), so that a stage on any process or node writes fenced."""

    output_uri: str
    run_name: str
    epoch: int = 0

    def store(self) -> RunStore:
        return RunStore(self.output_uri, self.run_name, self.epoch)


class RunStore:
    """The folder `{output_uri}/{run_name}/` and the only way stages read and write artifacts.

    A store of a lease's `epoch` is fenced: before each write or removal it checks that no later writer has taken
    the run over (the next epoch's lease file), and refuses with `WriterFenced` if one has.
    """

    def __init__(self, output_uri: str, run_name: str, epoch: int = 0) -> None:
        self.epoch = epoch
        self.fs, base = url_to_fs(output_uri)
        self._local = "file" in _protocols(self.fs)
        self._s3 = "s3" in _protocols(self.fs)
        self._bucket_made = False
        self.root = posixpath.join(base.rstrip("/"), run_name)
        self.uri = self.fs.unstrip_protocol(self.root) if not self._local else self.root

    def check_writable(self) -> None:
        """Fail before any work, naming output_uri, if the run folder cannot be created and written."""
        probe = f".write-check-{uuid.uuid4().hex}"
        try:
            self.write_bytes(probe, b"")
            self.fs.rm(self.path(probe))
        except Exception as error:
            fix = _fix_for_unwritable(error, self._local)
            if fix is None:
                raise
            raise OutputNotWritable(
                f"output_uri: cannot write the run folder {self.uri} ({type(error).__name__}: {error}): {fix}"
            ) from None

    @classmethod
    def at(cls, run_uri: str) -> RunStore:
        """The store of an existing run given its folder, e.g. `runs/demo` or `s3://bucket/prefix/demo`."""
        parent, _, name = run_uri.rstrip("/").rpartition("/")
        return cls(parent or ".", name)

    def path(self, rel: str) -> str:
        """Absolute path of `rel` inside the run folder; refuses anything that would escape it."""
        norm = posixpath.normpath(rel)
        if rel.startswith("/") or norm == ".." or norm.startswith("../") or "\\" in rel:
            raise StoragePathError(f"storage path {rel!r} leaves the run folder")
        return posixpath.join(self.root, norm)

    def _retrying(self, operation: Callable[[], T]) -> T:
        """Object stores hiccup (a restarted gateway, a dropped connection): retry with backoff, ~30 s in all."""
        for attempt in range(len(_BACKOFF_S) + 1):
            try:
                return operation()
            except (FileNotFoundError, PermissionError):  # asking again gets the same answer
                raise
            except (OSError, TimeoutError):
                if self._local or attempt == len(_BACKOFF_S):
                    raise
                time.sleep(_BACKOFF_S[attempt])
        raise AssertionError("unreachable")

    def exists(self, rel: str) -> bool:
        return self._retrying(lambda: self.fs.exists(self.path(rel)))

    def read_bytes(self, rel: str) -> bytes:
        return self._retrying(lambda: self.fs.cat_file(self.path(rel)))

    def read_text(self, rel: str) -> str:
        return self.read_bytes(rel).decode("utf-8")

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_bytes(rel))

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Atomic whole-file write: a temporary sibling then a rename (local), or one PUT (object stores)."""
        self.write_buffers(rel, [data])

    def check_fence(self) -> None:
        """Refuse, in one line, a write of a writer whose lease another has taken over since."""
        if self.epoch and self._retrying(lambda: self.fs.exists(self.path(lease_file(self.epoch + 1)))):
            raise WriterFenced(f"run {self.uri}: another process took it over (lease epoch {self.epoch + 1} in "
                               f"{lease_file(self.epoch + 1)}); this one stops writing, and what it wrote is kept")

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Write `rel` only if it does not exist (a hard link locally, a conditional PUT on S3); False if it did."""
        target = self.path(rel)
        self._make_folder(posixpath.dirname(target))
        if self._local:  # written whole beside it, then linked: a reader never sees it half-written
            tmp = f"{target}.tmp-{uuid.uuid4().hex}"
            with open(tmp, "wb") as handle:
                handle.write(data)
            try:
                os.link(tmp, target)
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
            return True
        if not self._s3:  # no atomic create on other stores (memory://): exclusive within one process only
            if self.fs.exists(target):
                return False
            self.fs.pipe_file(target, data)
            return True
        bucket, _, key = target.partition("/")

        def put() -> bool:
            try:
                self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
            except Exception as error:  # s3fs turns botocore's ClientError into an OSError of its own choosing
                if any(word in f"{error!r} {error.__cause__!r}" for word in ("PreconditionFailed", "412")):
                    return False
                raise
            return True

        return self._retrying(put)

    def write_buffers(self, rel: str, buffers: list[bytes | memoryview]) -> None:
        """`write_bytes` of the buffers' bytes in turn; on local disk and S3 they are never joined in memory."""
        self.check_fence()
        target = self.path(rel)
        self._make_folder(posixpath.dirname(target))
        if self._s3:  # never a half-written object: one PUT, or a multipart upload completed at its end
            self._retrying(lambda: s3_upload(self.fs, target, buffers))
            return
        if not self._local:
            data = buffers[0] if len(buffers) == 1 else b"".join(buffers)
            self._retrying(lambda: self.fs.pipe_file(target, data))
            return
        tmp = f"{target}.tmp-{uuid.uuid4().hex}"
        with self.fs.open(tmp, "wb") as handle:
            for buffer in buffers:
                handle.write(buffer)
        self.fs.mv(tmp, target)

    def _make_folder(self, folder: str) -> None:
        """A local folder before each write; on an object store, which has no folders, its bucket once."""
        if not self._bucket_made:
            self.fs.makedirs(folder, exist_ok=True)
            self._bucket_made = not self._local

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, text.encode("utf-8"))

    def write_json(self, rel: str, value: Any) -> None:
        self.write_bytes(rel, (json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode())

    def write_shard(self, stage: str, index: int, records: list[dict[str, Any]], **provenance: Any) -> ShardRef:
        """Write one JSONL shard of a stage atomically; returns the reference the next stage reads it by."""
        data = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records).encode()
        return self.write_shard_bytes(stage, index, data, len(records), **provenance)

    def write_shard_bytes(self, stage: str, index: int, data: bytes, num_records: int,
                          **provenance: Any) -> ShardRef:
        """Write one shard of a stage in any format (a Parquet table, say) atomically, then its completion marker;
        returns its reference. `provenance` (what it was made from) goes into the marker."""
        path = artifact_path(stage, index)
        self.remove(marker_path(path))  # a marker only ever vouches for the file written before it
        self.write_bytes(path, data)
        ref = ShardRef(stage, index, path, num_records, sha256_hex(data))
        self.write_json(marker_path(path), {**asdict(ref), "bytes": len(data), **provenance})
        return ref

    def read_marker(self, path: str) -> dict[str, Any] | None:
        """The completion marker of the shard file at `path`, if it still vouches for that file.

        A marker is a few hundred bytes: a re-run learns what is finished from markers and one size check per
        file, without reading the shards (gigabytes on a large run). A file replaced or moved since its marker
        was written has another size or none, and the marker is ignored.
        """
        try:
            found = self.read_json(marker_path(path))
        except FileNotFoundError:
            return None
        return found if self.size(path) == found.get("bytes") else None

    def add_to_marker(self, marker: dict[str, Any], **facts: Any) -> None:
        """Keep what a later step learnt from a shard (the report's counts) in its marker, beside what it vouches."""
        self.write_json(marker_path(marker["path"]), {**marker, **facts})

    def size(self, rel: str) -> int | None:
        """Bytes of a file, without reading it (None if absent)."""
        try:
            return int(self._retrying(lambda: self.fs.size(self.path(rel))))
        except FileNotFoundError:
            return None

    def read_shard(self, ref: ShardRef) -> bytes:
        """The one way a stage reads the previous stage's output: refused if it changed since it was written.

        A changed file's completion marker is dropped (if it still vouches for the content `ref` names), so the
        producer's next run looks at the file again instead of trusting the marker forever.
        """
        data = self.read_bytes(ref.path)
        if sha256_hex(data) != ref.sha256:
            marker = marker_path(ref.path)
            if self.exists(marker) and self.read_json(marker).get("sha256") == ref.sha256:
                self.remove(marker)
            raise ArtifactChanged(
                f"{ref.path} changed since the {ref.stage} stage wrote it: run the pipeline again so the "
                f"{ref.stage} stage looks at it anew (finished work elsewhere is kept)"
            )
        return data

    def read_shard_records(self, ref: ShardRef) -> Iterator[dict[str, Any]]:
        """The JSONL records of a shard, checked now and parsed as they are iterated: a stage holds one shard's
        bytes, never all its parsed records at once."""
        return iter_jsonl(self.read_shard(ref))

    def read_jsonl(self, rel: str) -> list[dict[str, Any]]:
        return parse_jsonl(self.read_bytes(rel))

    def write_jsonl(self, rel: str, rows: list[dict[str, Any]]) -> int:
        """The rows as JSON Lines; returns the file's bytes."""
        data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()
        self.write_bytes(rel, data)
        return len(data)

    @contextmanager
    def open(self, rel: str, mode: str = "rb", **kwargs: Any) -> Iterator[IO[Any]]:
        """A streaming handle (multipart upload on S3 for large writes)."""
        target = self.path(rel)
        if "w" in mode or "a" in mode:
            self.check_fence()
            self._make_folder(posixpath.dirname(target))
        with self.fs.open(target, mode, **kwargs) as handle:
            yield handle

    def list(self, rel_dir: str, suffix: str = "") -> list[str]:
        """Relative paths of the files directly in `rel_dir` ending with `suffix`, sorted.

        Listed afresh: another process may have written here since (s3fs would answer from its listing cache).
        """
        return [posixpath.join(rel_dir, n) for n in self._names_in(rel_dir) if n.endswith(suffix) and ".tmp-" not in n]

    def remove_all_but(self, rel_dir: str, kept: set[str]) -> None:
        """Every file and folder directly in `rel_dir` not named in `kept`: what an earlier attempt left there, the
        temporary files of a killed write included."""
        for name in self._names_in(rel_dir):
            if name not in kept:
                self.remove(posixpath.join(rel_dir, name))

    def _names_in(self, rel_dir: str) -> list[str]:
        folder = self.path(rel_dir)
        self.fs.invalidate_cache(folder)
        try:
            return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(folder, detail=False))
        except FileNotFoundError:
            return []

    def sizes(self, rel_dir: str) -> dict[str, int]:
        """Every file under `rel_dir`, at any depth, and its bytes: one listing (paginated on an object store),
        no file read. Listed afresh, like `list`."""
        folder = self.path(rel_dir)
        self.fs.invalidate_cache(folder)
        found = self._retrying(lambda: self.fs.find(folder, detail=True)) if self.fs.exists(folder) else {}
        return {posixpath.relpath(path, self.root): int(info["size"]) for path, info in found.items()
                if info.get("type") != "directory" and ".tmp-" not in path}

    def shard_files_outside(self, shards: set[int]) -> list[str]:
        """Every later stage's files and folders (`SHARD_STAGES`) of shards not in `shards`: left by an earlier
        shard layout."""
        return [rel for stage in SHARD_STAGES for rel in self.list(stage)
                if (index := shard_index_of(posixpath.basename(rel))) is not None and index not in shards]

    def remove(self, rel: str) -> None:
        """The file or folder `rel`, if there (no request to ask first)."""
        self.check_fence()
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(rel), recursive=True)

    def local_path(self, rel: str) -> str | None:
        """The plain filesystem path when the run lives on local disk (for appending partial files)."""
        return self.path(rel) if self._local else None


def _fix_for_unwritable(error: Exception, local: bool) -> str | None:
    """What to change when the run folder cannot be written; None for an error that is not about the folder."""
    if not local and "Credential" in type(error).__name__:  # botocore's NoCredentialsError and its kin
        return ("no credentials for it in this process's environment: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(and AWS_ENDPOINT_URL_S3 for a store other than AWS), or AWS_PROFILE naming a profile in "
                "~/.aws/credentials, where the run (its worker) runs")
    if not local and isinstance(error, PermissionError):
        return ("the store refuses these credentials: check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
                "AWS_PROFILE) where the run runs, and that they may write there")
    if isinstance(error, OSError | ValueError):
        return "set output_uri to a folder or bucket this process can write"
    return None


def marker_path(path: str) -> str:
    """`generations/shard-00003.jsonl` → `generations/shard-00003.done.json`."""
    return posixpath.splitext(path)[0] + ".done.json"


def iter_jsonl(data: bytes) -> Iterator[dict[str, Any]]:
    """The records of a JSON Lines file's bytes, one at a time (blank lines skipped)."""
    return (json.loads(line) for line in io.BytesIO(data) if line.strip())


def parse_jsonl(data: bytes) -> list[dict[str, Any]]:
    """The records of a JSON Lines file's bytes (blank lines skipped)."""
    return list(iter_jsonl(data))


def _protocols(fs: fsspec.AbstractFileSystem) -> set[str]:
    proto = fs.protocol
    return {proto} if isinstance(proto, str) else set(proto)
