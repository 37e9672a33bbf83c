"""What an image costs the node in prompt tokens.

A flat cost per image (``tokenizer.image_tokens``) undercounts large images on models
whose processor sizes its grid by the picture: the Qwen2-VL family resizes each image to
a multiple of ``patch_size * merge_size`` pixels between ``min_pixels`` and
``max_pixels`` and spends one token per ``(patch_size * merge_size)²`` pixels (a
1920x1080 picture: 2,691 tokens at the default limits; 3840x2160: 10,549). When the
model's directory holds such a processor's ``preprocessor_config.json``, an image is
priced as the node's processor prices it: by its size, read from the headers of a
``data:`` URL (PNG, GIF, JPEG, WebP), else (a remote URL, or bytes that do not say) as the
largest image the processor makes. Pure functions; no I/O but reading the config file.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Image processors that size the grid by the picture, as Qwen2-VL's does.
_GRID_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast")
# transformers' Qwen2-VL defaults.
_MIN_PIXELS = 56 * 56
_MAX_PIXELS = 28 * 28 * 16384
_MAX_RATIO = 200


@dataclass(frozen=True, slots=True)
class ImageGrid:
    """A Qwen2-VL-style processor: ``factor`` = patch_size * merge_size pixels a side per
    token, images resized to between ``min_pixels`` and ``max_pixels``."""

    factor: int = 28
    min_pixels: int = _MIN_PIXELS
    max_pixels: int = _MAX_PIXELS

    @property
    def min_tokens(self) -> int:
        """Tokens of the smallest image the processor makes (at least min_pixels)."""
        return max(1, -(-self.min_pixels // (self.factor * self.factor)))

    @property
    def max_tokens(self) -> int:
        """Tokens of the largest image the processor makes (its resize keeps the area at
        most max_pixels)."""
        return self.max_pixels // (self.factor * self.factor)

    def tokens(self, width: int, height: int) -> int:
        """transformers' ``smart_resize`` (Qwen2-VL), then one token per factor² pixels.
        A picture the processor refuses (aspect ratio over 200) is priced as the largest:
        the node answers 400, never more."""
        f = self.factor
        if width < 1 or height < 1 or max(width, height) / min(width, height) > _MAX_RATIO:
            return self.max_tokens
        h = round(height / f) * f
        w = round(width / f) * f
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(f, math.floor(height / beta / f) * f)
            w = max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / f) * f
            w = math.ceil(width * beta / f) * f
        return (h // f) * (w // f)


def load_grid(directory: str) -> ImageGrid | None:
    """The grid of the model directory's image processor, if it sizes by the picture."""
    path = Path(directory).expanduser() / "preprocessor_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    kind = config.get("image_processor_type")
    if kind not in _GRID_PROCESSORS:
        return None
    given = config.get("size")
    size: dict[str, Any] = given if isinstance(given, dict) else {}
    patch = _positive(config.get("patch_size"), 14)
    merge = _positive(config.get("merge_size"), 2)
    lo = _positive(config.get("min_pixels", size.get("shortest_edge")), _MIN_PIXELS)
    hi = _positive(config.get("max_pixels", size.get("longest_edge")), _MAX_PIXELS)
    return ImageGrid(patch * merge, lo, max(lo, hi))


def with_request(grid: ImageGrid, kwargs: Any) -> ImageGrid:
    """``grid`` as a request's ``mm_processor_kwargs`` may set it (``min_pixels`` /
    ``max_pixels``, or ``size``'s shortest and longest edge). transformers' slow and
    fast Qwen2-VL processors read these in different orders (``size`` over the pixels,
    or the instance's pixels over a request's ``size``), so each limit is the largest
    any of them may take: an image costs at least what the node's processor makes of it,
    and a request only ever raises its price here."""
    if not isinstance(kwargs, dict):
        return grid
    given = kwargs.get("size")
    size: dict[str, Any] = given if isinstance(given, dict) else {}
    lows = [kwargs.get("min_pixels"), size.get("shortest_edge")]
    highs = [kwargs.get("max_pixels"), size.get("longest_edge")]
    lo = max([grid.min_pixels, *(_pixels(v) for v in lows)])
    hi = max([grid.max_pixels, *(_pixels(v) for v in highs)])
    if (lo, hi) == (grid.min_pixels, grid.max_pixels):
        return grid
    return ImageGrid(grid.factor, lo, max(lo, hi))


def _pixels(value: Any) -> int:
    """A pixel count as transformers takes it (an int or a float), else 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    return int(value) if math.isfinite(value) and value > 0 else 0


def _positive(value: Any, default: int) -> int:
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default
    )


@dataclass(frozen=True, slots=True)
class ImagePricing:
    """Tokens a media part costs: ``flat`` each, or an image by its size on a grid."""

    flat: int = 765
    grid: ImageGrid | None = None

    def for_request(self, body: dict[str, Any]) -> ImagePricing:
        """The pricing a request's ``mm_processor_kwargs`` make of this one."""
        if self.grid is None or "mm_processor_kwargs" not in body:
            return self
        grid = with_request(self.grid, body.get("mm_processor_kwargs"))
        return self if grid is self.grid else ImagePricing(self.flat, grid)

    def cost(self, part: Any) -> int:
        return self.bounds(part)[0]

    def bounds(self, part: Any) -> tuple[int, int]:
        """What ``part`` costs at most and at least: the same when its size is known (or
        the cost is flat); an image of unknown size (a remote URL) costs at most the
        largest image the processor makes and at least the smallest."""
        if self.grid is None:
            return self.flat, self.flat
        if not _is_image(part):
            # Video and audio on a model whose processor sizes by the input: the flat
            # cost is a guess, not the node's count (a bound with no floor beyond 1).
            return self.flat, 1
        size = image_size(_url(part))
        if size is None:
            return self.grid.max_tokens, self.grid.min_tokens
        cost = self.grid.tokens(*size)
        return cost, cost


def _is_image(part: Any) -> bool:
    if not isinstance(part, dict):
        return False
    kind = part.get("type")
    return kind in ("image_url", "input_image", "image") or (kind is None and "image_url" in part)


def _url(part: dict[str, Any]) -> str:
    value = part.get("image_url", part.get("image"))
    if isinstance(value, dict):
        value = value.get("url")
    return value if isinstance(value, str) else ""


def image_size(url: str) -> tuple[int, int] | None:
    """(width, height) of a ``data:`` URL's image, from its format's header; None when
    the URL is remote or its bytes do not say."""
    if not url.startswith("data:"):
        return None
    head, _, payload = url.partition(",")
    if not head.endswith(";base64"):
        return None
    try:
        data = base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError):
        return None
    return _png(data) or _gif(data) or _webp(data) or _jpeg(data)


def _png(d: bytes) -> tuple[int, int] | None:
    if d[:8] == b"\x89PNG\r\n\x1a\n" and d[12:16] == b"IHDR" and len(d) >= 24:
        w, h = struct.unpack(">II", d[16:24])
        return w, h
    return None


def _gif(d: bytes) -> tuple[int, int] | None:
    """The logical screen, grown to the first frame's extent as Pillow grows it (a frame
    may reach past the screen: a 28x28 screen holding a 2000x1500 frame is 2000x1500 to
    Pillow, and so to the node). None when the blocks do not lead to a frame."""
    if d[:6] not in (b"GIF87a", b"GIF89a") or len(d) < 13:
        return None
    sw, sh = struct.unpack("<HH", d[6:10])
    i = 13 + (3 << ((d[10] & 7) + 1) if d[10] & 0x80 else 0)
    while i < len(d):
        block = d[i]
        if block == 0x2C:  # image descriptor: left, top, width, height
            if i + 9 > len(d):
                return None
            left, top, w, h = struct.unpack("<HHHH", d[i + 1 : i + 9])
            return max(sw, left + w), max(sh, top + h)
        if block == 0x21:  # extension: its label, then sub-blocks until an empty one
            i += 2
            while i < len(d) and d[i]:
                i += d[i] + 1
            i += 1
            continue
        return None  # the trailer before any frame, or not a GIF block
    return None


def _webp(d: bytes) -> tuple[int, int] | None:
    if d[:4] != b"RIFF" or d[8:12] != b"WEBP" or len(d) < 30:
        return None
    chunk = d[12:16]
    if chunk == b"VP8X":
        w = 1 + int.from_bytes(d[24:27], "little")
        h = 1 + int.from_bytes(d[27:30], "little")
        return w, h
    if chunk == b"VP8 " and d[23:26] == b"\x9d\x01\x2a":
        w, h = struct.unpack("<HH", d[26:30])
        return w & 0x3FFF, h & 0x3FFF
    if chunk == b"VP8L" and d[20] == 0x2F:
        bits = int.from_bytes(d[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


# JPEG start-of-frame markers (baseline, progressive, ...); not DHT/JPG/DAC.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg(d: bytes) -> tuple[int, int] | None:
    if d[:2] != b"\xff\xd8":
        return None
    i = 2
    while i + 9 < len(d):
        if d[i] != 0xFF:
            return None
        marker = d[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        length = int.from_bytes(d[i + 2 : i + 4], "big")
        if marker in _SOF:
            h, w = struct.unpack(">HH", d[i + 5 : i + 9])
            return w, h
        if length < 2:
            return None
        i += 2 + length
    return None
