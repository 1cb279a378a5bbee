"""Pictures for the image-prompt tests: a good PNG, and the kinds of bad image a dataset holds."""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image


def png(colour: str = "red", size: tuple[int, int] = (40, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def truncated_png() -> bytes:
    """A PNG cut off inside its pixel data: its header reads, its pixels do not."""
    return png(size=(64, 64))[:60]


def huge_png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height pixels, with next to no data: a decompression bomb's shape."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")
