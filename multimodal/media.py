"""Loading and validating images: data: URLs, file:// under an allowed directory, http(s)
(fetched asynchronously with a timeout and a size cap), or PIL images (offline).

Every failure is a MediaError, which the API server answers with a 400."""
from __future__ import annotations

import base64
import binascii
import io
import os
import stat
from urllib.parse import unquote, urlparse

from PIL import Image

MAX_IMAGE_BYTES = 32 << 20          # encoded bytes of one image
MAX_IMAGE_PIXELS = 64 << 20         # decoded width x height (decompression bombs, oversized inputs)
FETCH_TIMEOUT_S = 10.0
FORMATS = ("PNG", "JPEG", "WEBP")


class MediaError(ValueError):
    """An image a request cannot use."""


def decode_image(data: bytes) -> Image.Image:
    """Bytes of a PNG, JPEG or WebP -> an RGB PIL image; the size is checked before decoding."""
    if len(data) > MAX_IMAGE_BYTES:
        raise MediaError(f"the image has {len(data)} bytes; at most {MAX_IMAGE_BYTES} are accepted")
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:   # (PIL's own limit, far above ours)
        raise MediaError(f"the image has more than {MAX_IMAGE_PIXELS} pixels") from None
    except Exception:
        raise MediaError("the data is not a PNG, JPEG or WebP image") from None
    check_size(img)
    try:
        img.load()
    except Exception as e:
        raise MediaError(f"the image cannot be decoded: {e}") from None
    return to_rgb(img)


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white, as transformers' convert_to_rgb and vLLM do
    (convert("RGB") dropped the alpha: a transparent background became black)."""
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def check_size(img: Image.Image) -> None:
    w, h = img.size
    if w < 1 or h < 1:
        raise MediaError("the image is empty")
    if w * h > MAX_IMAGE_PIXELS:
        raise MediaError(f"the image is {w}x{h} pixels; at most {MAX_IMAGE_PIXELS} pixels are accepted")


def load_data_url(url: str) -> Image.Image:
    head, sep, payload = url.partition(",")
    head = head.lower()   # (URL schemes and MIME types are case-insensitive)
    if not sep or not head.startswith("data:"):
        raise MediaError("a data URL must look like data:image/png;base64,...")
    if not head.endswith(";base64"):
        raise MediaError("only base64 data URLs are supported")
    mime = head[5:-7].lower()
    if mime and not mime.startswith("image/"):
        raise MediaError(f"a data URL of type {mime!r} is not an image")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data URL is not valid base64") from None
    return decode_image(data)


def load_file_url(url: str, allowed_dir: str | None) -> Image.Image:
    return decode_image(read_file_url(url, allowed_dir, MAX_IMAGE_BYTES, "image"))


def read_file_url(url: str, allowed_dir: str | None, max_bytes: int, what: str) -> bytes:
    """The bytes of a file:// URL under allowed_dir (images and audio alike)."""
    if not allowed_dir:
        raise MediaError("file:// URLs are not allowed (the server was started without "
                         "--allowed-local-media-path)")
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):   # file://HOST/... names another machine's file
        raise MediaError(f"file:// URLs must name a local path (file:///path), not host {parsed.netloc[:64]!r}")
    path = unquote(parsed.path)
    if "\x00" in path:
        raise MediaError("the file path contains a NUL byte")
    path = os.path.realpath(path)
    root = os.path.realpath(allowed_dir)
    if os.path.commonpath([path, root]) != root:
        raise MediaError("the file is outside --allowed-local-media-path")
    try:
        with open(path, "rb", opener=_open_regular) as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise MediaError(f"the {what} has {size} bytes; at most {max_bytes} are accepted")
            return f.read(max_bytes + 1)
    except OSError:
        raise MediaError("the file cannot be read") from None


def _open_regular(path: str, flags: int) -> int:
    """open() that refuses anything but a regular file (a FIFO or a device would block the
    image thread, or never end), without blocking on it: O_NONBLOCK, checked, then cleared."""
    fd = os.open(path, flags | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise MediaError("the path is not a regular file")
    os.set_blocking(fd, True)
    return fd


async def fetch_http(url: str, timeout: float = FETCH_TIMEOUT_S, max_bytes: int = MAX_IMAGE_BYTES,
                     what: str = "image") -> bytes:
    """GET url with a total timeout, reading at most max_bytes."""
    import aiohttp
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.get(url) as resp:
                if resp.status != 200:
                    raise MediaError(f"fetching the {what} failed with HTTP {resp.status}")
                chunks, size = [], 0   # (read(n) returns what has arrived, not n bytes)
                async for chunk in resp.content.iter_chunked(1 << 16):
                    size += len(chunk)
                    if size > max_bytes:
                        raise MediaError(f"the {what} is larger than {max_bytes} bytes")
                    chunks.append(chunk)
    except MediaError:
        raise
    except Exception as e:
        raise MediaError(f"fetching the {what} failed: {type(e).__name__}") from None
    return b"".join(chunks)


async def load_image_url(url: str, allowed_dir: str | None, off_loop) -> Image.Image:
    """An image_url part's URL -> an RGB image. off_loop(fn, *args) runs the decoding away
    from the event loop (http(s) is fetched asynchronously first)."""
    if not isinstance(url, str) or not url:
        raise MediaError("image_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return await off_loop(load_data_url, url)
    if scheme == "file":
        return await off_loop(load_file_url, url, allowed_dir)
    if scheme in ("http", "https"):
        return await off_loop(decode_image, await fetch_http(url))
    raise MediaError(f"unsupported image URL scheme {scheme or url[:16]!r} (data:, file:, http(s): are)")


def as_image(obj) -> Image.Image:
    """Offline inputs: a PIL image (or bytes of one) -> RGB."""
    if isinstance(obj, Image.Image):
        check_size(obj)
        return to_rgb(obj)
    if isinstance(obj, (bytes, bytearray)):
        return decode_image(bytes(obj))
    raise MediaError(f"an image must be a PIL.Image or bytes, got {type(obj).__name__}")
