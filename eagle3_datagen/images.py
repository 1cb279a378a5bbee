"""Image prompts: the images of a dataset's rows, checked with Pillow, stored once in the run by content, and sent
to the server from there.

A prompt names each image by `{sha256}.{format}` of its bytes (`{"type": "image", "image": NAME}` in a message's
content list), so the same picture under two paths is one image and one prompt, and a prompt id follows the
pixels, not where they were read. Requests carry the stored bytes as data URIs: a server needs no access to the
dataset's storage, and every backend sees the very bytes the prompt names.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import posixpath
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import fsspec
import httpx
from PIL import Image, UnidentifiedImageError

from eagle3_datagen.artifacts import sha256_hex
from eagle3_datagen.errors import Eagle3Error

IMAGES_DIR = "images"
IMAGE_TEXT_PLACEHOLDER = "<image>"  # LLaVA's and ShareGPT4V's mark of where a row's next image goes
_MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "gif": "image/gif", "webp": "image/webp",
                "bmp": "image/bmp", "tiff": "image/tiff"}


class ImageRejected(Eagle3Error, ValueError):
    """An image that cannot be used: missing, unreadable, corrupt or over the limits. Its row is rejected."""


@dataclass(frozen=True)
class ImageLimits:
    """What an image may weigh: bytes as read, pixels as its header declares (checked before decoding)."""

    max_bytes: int
    max_pixels: int
    fetch_timeout_s: float


def image_part(ref: Any) -> dict[str, Any]:
    """An image in a message's content: a stored image's name (or, while a row is read, its reference)."""
    return {"type": "image", "image": ref}


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


def image_names(messages: Iterable[dict[str, Any]]) -> list[str]:
    """The stored images a conversation shows, in order of appearance."""
    return [part["image"] for message in messages if isinstance(message.get("content"), list)
            for part in message["content"] if is_image_part(part)]


def image_path(name: str) -> str:
    """Where a stored image lies in the run."""
    return posixpath.join(IMAGES_DIR, name)


def within_bytes(size: int, limits: ImageLimits) -> None:
    """Refuses an image of `size` bytes (or already that many, while it streams) over the limit."""
    if size > limits.max_bytes:
        raise ImageRejected(f"image is over data.images.max_bytes {limits.max_bytes:,}")


def checked_image(data: bytes, limits: ImageLimits) -> str:
    """The image's format (its file extension) once Pillow has decoded it whole within the limits."""
    within_bytes(len(data), limits)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the limit checked is ours
        try:
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if width * height > limits.max_pixels:
                    raise ImageRejected(f"image is {width}x{height} = {width * height:,} pixels > "
                                        f"data.images.max_pixels {limits.max_pixels:,}")
                image.load()  # a truncated or corrupt file fails here, not in the server
                kind = (image.format or "").lower()
        except ImageRejected:
            raise
        except Image.DecompressionBombError as error:  # Pillow's own limit, far above ours, met on opening
            declared = re.search(r"\((\d+) pixels\)", str(error))
            pixels = f"{int(declared.group(1)):,} pixels" if declared else "over Pillow's limit"
            raise ImageRejected(f"image is {pixels} > data.images.max_pixels {limits.max_pixels:,}") from None
        except UnidentifiedImageError:
            raise ImageRejected("not an image Pillow can read") from None
        except (OSError, SyntaxError, ValueError) as error:
            raise ImageRejected(f"image is corrupt or truncated ({error})") from None
    if kind not in _MEDIA_TYPES:
        raise ImageRejected(f"image format {kind or 'unknown'} is not one servers take (png, jpeg, gif, webp, bmp)")
    return kind


def image_name(data: bytes, kind: str) -> str:
    return f"{sha256_hex(data)}.{kind}"


def name_matches(name: str, data: bytes) -> bool:
    """Whether stored bytes still hash to the name they are stored under."""
    return name.split(".", 1)[0] == sha256_hex(data)


def data_uri(name: str, data: bytes) -> str:
    return f"data:{_MEDIA_TYPES[name.rsplit('.', 1)[1]]};base64,{base64.b64encode(data).decode('ascii')}"


def as_sent(messages: list[dict[str, Any]], read: Callable[[str], bytes]) -> list[dict[str, Any]]:
    """The messages as a request carries them: each stored image as an OpenAI `image_url` part with its bytes."""
    if not image_names(messages):
        return messages
    return [{**message, "content": [
        {"type": "image_url", "image_url": {"url": data_uri(part["image"], read(image_path(part["image"])))}}
        if is_image_part(part) else part for part in message["content"]]}
        if isinstance(message.get("content"), list) else message for message in messages]


class ImageReader:
    """The bytes an image reference in a row points at: a data URI, a URL (http, https, s3, file), a path
    relative to the dataset, or a Parquet/`datasets` image value ({bytes, path}, never decoded: see load_rows)."""

    def __init__(self, base: Path, limits: ImageLimits) -> None:
        self.base = base
        self.limits = limits
        self.files_read: dict[str, list[int]] = {}  # local files by path: [size, mtime_ns] when read

    def read(self, ref: Any) -> bytes:
        if isinstance(ref, dict) and ref.get("bytes") is not None:
            return bytes(ref["bytes"])
        if isinstance(ref, dict) and isinstance(ref.get("path"), str):
            return self.read(ref["path"])
        if not isinstance(ref, str) or not ref.strip():
            raise ImageRejected(f"image reference is {type(ref).__name__}, not a URL, path or bytes")
        if ref.startswith("data:"):
            return _data_uri_bytes(ref)
        scheme = urlsplit(ref).scheme
        if scheme in ("http", "https"):
            return self._fetch(ref)
        if scheme == "file":
            return self._file(Path(unquote(urlsplit(ref).path)))
        if scheme and len(scheme) > 1:  # s3:// and any other fsspec filesystem; "c:" is a drive, not a scheme
            return self._remote(ref)
        return self._file(self.base / ref)

    def _file(self, path: Path) -> bytes:
        try:
            stat = path.stat()
            within_bytes(stat.st_size, self.limits)
            data = path.read_bytes()
            self.files_read[str(path.resolve())] = [stat.st_size, stat.st_mtime_ns]
            return data
        except FileNotFoundError:
            raise ImageRejected(f"image file {path} does not exist") from None
        except (IsADirectoryError, PermissionError) as error:
            raise ImageRejected(f"image file {path} cannot be read ({error.strerror})") from None

    def _fetch(self, url: str) -> bytes:
        try:
            with httpx.stream("GET", url, timeout=self.limits.fetch_timeout_s, follow_redirects=True) as response:
                if response.status_code != 200:
                    raise ImageRejected(f"image URL {_shown(url)} answered HTTP {response.status_code}")
                data = bytearray()
                for chunk in response.iter_bytes():
                    data += chunk
                    within_bytes(len(data), self.limits)
                return bytes(data)
        except httpx.HTTPError as error:
            raise ImageRejected(f"image URL {_shown(url)} did not answer ({type(error).__name__})") from None

    def _remote(self, url: str) -> bytes:
        try:
            with fsspec.open(url, "rb") as handle:
                data = handle.read(self.limits.max_bytes + 1)
        except FileNotFoundError:
            raise ImageRejected(f"image {_shown(url)} does not exist") from None
        except (OSError, ValueError, ImportError) as error:
            raise ImageRejected(f"image {_shown(url)} cannot be read ({type(error).__name__})") from None
        within_bytes(len(data), self.limits)
        return data


def files_fingerprint(files: dict[str, list[int]]) -> str:
    """sha256 of each recorded local image file's size and modification time as they are now (a missing one as
    such): what the prompt stage's cache follows beside the dataset's own bytes, so a picture redrawn in place is
    read again."""
    now = {}
    for path in sorted(files):
        try:
            stat = Path(path).stat()
            now[path] = [stat.st_size, stat.st_mtime_ns]
        except OSError:
            now[path] = None
    return sha256_hex(json.dumps(now, sort_keys=True).encode())


def _data_uri_bytes(uri: str) -> bytes:
    header, _, payload = uri.partition(",")
    if not header.endswith(";base64"):
        raise ImageRejected("image data URI is not base64")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error:
        raise ImageRejected("image data URI is not valid base64") from None


def _shown(url: str) -> str:
    """A URL as a log may show it: no credentials, no query (signed URLs carry secrets there)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}{parts.path}"
