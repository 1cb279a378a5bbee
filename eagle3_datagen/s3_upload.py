"""An S3 upload that reads the file's buffers where they lie.

s3fs's `pipe_file` takes one `bytes`: a hidden-state part (its tensors as several buffers) was joined into a copy
(0.06 s for 139 MB here), then sliced into more copies, one per multipart chunk. Here each request's body is a
window on the buffers (`RunStore.write_buffers` sends every S3 write through it).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import io
import itertools
from collections.abc import Sequence
from typing import Any

from fsspec.asyn import sync

PART_BYTES = 50 << 20  # a multipart upload's chunk, as s3fs's own; an object under two of them is one PUT


class BuffersReader(io.RawIOBase):
    """The bytes `start:end` of buffers laid end to end, as the seekable file botocore takes as a body (it
    refuses a memoryview): each read copies only what it returns."""

    def __init__(self, buffers: Sequence[memoryview], start: int, end: int) -> None:
        super().__init__()
        self._buffers, self._start, self._end, self._position = buffers, start, end, start
        self._offsets = list(itertools.accumulate((len(buffer) for buffer in buffers), initial=0))

    def __len__(self) -> int:
        return self._end - self._start

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position - self._start

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: self._start, io.SEEK_CUR: self._position, io.SEEK_END: self._end}[whence]
        self._position = min(max(base + offset, self._start), self._end)
        return self.tell()

    def read(self, size: int | None = -1) -> bytes:
        end = self._end if size is None or size < 0 else min(self._end, self._position + size)
        pieces = []
        number = bisect.bisect_right(self._offsets, self._position) - 1  # the buffer the position is in
        while self._position < end:
            offset = self._offsets[number]
            piece = self._buffers[number][self._position - offset:end - offset]
            pieces.append(piece)
            self._position += len(piece)
            number += 1
        return pieces[0].tobytes() if len(pieces) == 1 else b"".join(pieces)

    def readinto(self, target: Any) -> int:
        data = self.read(len(target))
        target[:len(data)] = data
        return len(data)


def s3_upload(fs: Any, path: str, buffers: Sequence[bytes | memoryview]) -> None:
    """Write the buffers' bytes in turn as the object `path` of the s3fs filesystem `fs`, never joined: one PUT, or
    a multipart upload of `PART_BYTES` chunks sent at once (completed only when every chunk is stored)."""
    views = [memoryview(buffer).cast("B") for buffer in buffers]
    try:
        sync(fs.loop, _upload, fs, path, views)
    finally:
        fs.invalidate_cache(path)


async def _upload(fs: Any, path: str, views: list[memoryview]) -> None:
    bucket, key, _ = fs.split_path(path)
    size = sum(len(view) for view in views)
    if size < 2 * PART_BYTES:
        await fs._call_s3("put_object", Bucket=bucket, Key=key, Body=BuffersReader(views, 0, size))
        return
    upload_id = (await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key))["UploadId"]
    at_once = asyncio.Semaphore(fs.max_concurrency)

    async def chunk(number: int, start: int) -> dict[str, Any]:
        async with at_once:
            body = BuffersReader(views, start, min(start + PART_BYTES, size))
            stored = await fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id,
                                       PartNumber=number, Body=body)
        return {"PartNumber": number, "ETag": stored["ETag"]}

    try:
        parts = await asyncio.gather(*(chunk(number, start)
                                       for number, start in enumerate(range(0, size, PART_BYTES), start=1)))
        await fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                          MultipartUpload={"Parts": list(parts)})
    except BaseException:
        await _abort(fs, bucket, key, upload_id)
        raise


async def _abort(fs: Any, bucket: str, key: str, upload_id: str) -> None:
    """Free the stored chunks of an upload that will not complete (the object itself never appears)."""
    with contextlib.suppress(Exception):  # the store's lifecycle rules free them; the upload's error is the news
        await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
