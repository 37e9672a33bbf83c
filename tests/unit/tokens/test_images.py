"""Images priced as the model's processor prices them (Qwen2-VL's grid), checked against
transformers' own ``smart_resize``, with sizes read from real encoded images."""

from __future__ import annotations

import asyncio
import base64
import io
import random
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from kvgateway.tokens.encoding import EncodingCache
from kvgateway.tokens.exact import ExactCounter
from kvgateway.tokens.images import ImageGrid, ImagePricing, image_size, load_grid
from tests.support import vocab

# Loads real vocabularies (and transformers): the slow tier.
pytestmark = pytest.mark.slow


def _data_url(width: int, height: int, fmt: str) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, format=fmt)
    mime = {"JPEG": "jpeg", "PNG": "png", "GIF": "gif", "WEBP": "webp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def test_tokens_follow_transformers_smart_resize() -> None:
    rnd = random.Random(7)
    grid = ImageGrid()
    sizes = [(1920, 1080), (3840, 2160), (28, 28), (10, 10), (4000, 20), (640, 480)]
    sizes += [(rnd.randint(1, 5000), rnd.randint(1, 5000)) for _ in range(300)]
    for w, h in sizes:
        if max(w, h) / min(w, h) > 200:
            continue
        rh, rw = smart_resize(
            h, w, factor=28, min_pixels=grid.min_pixels, max_pixels=grid.max_pixels
        )
        assert grid.tokens(w, h) == (rh // 28) * (rw // 28), (w, h)
    # Two common sizes at transformers' default limits.
    assert grid.tokens(1920, 1080) == 2691 and grid.tokens(3840, 2160) == 10549
    # A processor refuses ratios over 200; priced as the largest image (never under).
    assert grid.tokens(5000, 10) == grid.max_tokens


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_sizes_are_read_from_each_formats_header(fmt: str) -> None:
    for w, h in ((1, 1), (33, 17), (1920, 1080), (640, 2000)):
        assert image_size(_data_url(w, h, fmt)) == (w, h)
    assert image_size("https://example.com/cat.png") is None
    assert image_size("data:image/png;base64,AAAA") is None


def test_unknown_sizes_cost_the_largest_image() -> None:
    pricing = ImagePricing(765, ImageGrid(28, 3136, 28 * 28 * 1280))
    remote = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    assert pricing.cost(remote) == 1280
    small = {"type": "image_url", "image_url": {"url": _data_url(56, 56, "PNG")}}
    assert pricing.cost(small) == 4
    assert pricing.bounds({"type": "input_audio", "input_audio": {}}) == (765, 1)  # a guess
    assert ImagePricing(765).cost(small) == 765


def test_a_model_directory_with_a_qwen2_vl_processor_prices_images_by_size(
    vocab_dirs: Callable[[str], Path], tmp_path: Path
) -> None:
    base = vocab_dirs("qwen")
    directory = vocab.variant(base, tmp_path / "vl", processor=vocab.QWEN2_VL_PROCESSOR)
    grid = load_grid(str(directory))
    assert grid == ImageGrid(28, 3136, 12845056)
    exact = ExactCounter(EncodingCache().model(str(directory)))
    flat = ExactCounter(EncodingCache().model(str(base)))

    def chat(url: str) -> dict[str, object]:
        part = {"type": "image_url", "image_url": {"url": url}}
        return {"messages": [{"role": "user", "content": [part, "what is it?"]}]}

    big = chat(_data_url(1920, 1080, "PNG"))
    assert exact.count_chat_sync(big) - flat.count_chat_sync(big) == 2691 - 765
    assert len(exact.prompt_ids(big)) == exact.count_chat_sync(big)
    # The ids' count is the count's, bound and floor alike (a remote image's size is
    # unknown: priced at its largest, at least its smallest).
    remote = chat("https://example.com/cat.png")
    for body in (big, remote):
        assert exact.counted_ids(body)[1] == asyncio.run(exact.count_chat(body))
    assert exact.counted_ids(remote)[1].floor is not None
    assert load_grid(str(base)) is None  # no processor config: the flat cost


def test_a_gif_frame_past_its_logical_screen_counts_at_the_size_pillow_opens() -> None:
    # The header claims a 28x28 screen; the first frame is 2000x1500. Pillow (what vLLM
    # opens images with) grows the image to the frame: it cost 4 tokens, not 3,834.
    buf = io.BytesIO()
    Image.new("P", (2000, 1500), 3).save(buf, format="GIF")
    data = bytearray(buf.getvalue())
    data[6:10] = struct.pack("<HH", 28, 28)
    url = "data:image/gif;base64," + base64.b64encode(bytes(data)).decode()
    opened = Image.open(io.BytesIO(bytes(data)))
    opened.load()
    assert image_size(url) == opened.size == (2000, 1500)
    # An animated GIF with extensions before its first frame.
    frames = [Image.new("P", (40, 30), c) for c in (1, 2)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], loop=0)
    url = "data:image/gif;base64," + base64.b64encode(buf.getvalue()).decode()
    assert image_size(url) == (40, 30)


def test_a_requests_mm_processor_kwargs_resize_its_images() -> None:
    # transformers' Qwen2VLImageProcessor with min_pixels 1003520 makes a 280x280 image
    # 1,296 tokens (100 at the directory's limits): the request's kwargs count.
    grid = ImageGrid(28, 3136, 12845056)
    pricing = ImagePricing(765, grid)
    part = {"type": "image_url", "image_url": {"url": _data_url(280, 280, "PNG")}}
    assert pricing.cost(part) == 100
    raised = pricing.for_request({"mm_processor_kwargs": {"min_pixels": 1003520}})
    assert raised.cost(part) == 1296
    by_size = pricing.for_request({"mm_processor_kwargs": {"size": {"shortest_edge": 1003520}}})
    assert by_size.cost(part) == 1296
    assert pricing.for_request({"mm_processor_kwargs": {"other": 1}}) is pricing
    # Processors disagree on which of size and the pixels wins, and take floats: the
    # largest reading prices the image (transformers' slow processor: size wins, and a
    # 6000x4000 image with max_pixels 1003520 but size's longest_edge 12845056 is 16,224).
    big = {"type": "image_url", "image_url": {"url": _data_url(6000, 4000, "PNG")}}
    both = {"max_pixels": 1003520, "size": {"shortest_edge": 3136, "longest_edge": 12845056}}
    assert pricing.for_request({"mm_processor_kwargs": both}).cost(big) == 16224
    floats = pricing.for_request({"mm_processor_kwargs": {"max_pixels": 25690112.0}})
    assert floats.cost(big) == 30602
    lowered = pricing.for_request({"mm_processor_kwargs": {"max_pixels": 1003520}})
    assert lowered.cost(big) == 16224  # a request never lowers the price here
    assert pricing.for_request({}) is pricing


async def test_an_image_of_unknown_size_makes_the_count_a_bound_not_a_count(
    vocab_dirs: Callable[[str], Path], tmp_path: Path
) -> None:
    # A remote URL: the node downloads the picture and prices it by its size; the
    # gateway cannot. It reserves the largest image, but does not call that the node's
    # count (a 16k-context node would be refused every remote image): near a limit the
    # node's own count decides, and nothing is calibrated from it.
    from kvgateway.tokens.counting import PromptCounter, TextCountCache
    from kvgateway.tokens.encoding import load_encoding
    from kvgateway.tokens.plans import EncodingSpec, TokenizerConfig
    from kvgateway.tokens.prompt_estimate import PromptEstimator

    config = {"image_processor_type": "Qwen2VLImageProcessor", "max_pixels": 12845056}
    directory = vocab.variant(vocab_dirs("qwen"), tmp_path / "vl", processor=config)
    exact = ExactCounter(EncodingCache().model(str(directory)))
    standin = PromptCounter(load_encoding(EncodingSpec()), TextCountCache(), None)
    estimator = PromptEstimator(TokenizerConfig(), standin, exact)
    remote = {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}}
    inline = {"type": "image_url", "image_url": {"url": _data_url(120, 90, "PNG")}}
    got = await estimator.chat({"messages": [{"role": "user", "content": [remote, "?"]}]})
    assert not got.exact and got.uncalibrated and got.standin == 0
    assert got.total - got.floor == 16384 - 4  # the largest image less the smallest
    known = await estimator.chat({"messages": [{"role": "user", "content": [inline, "?"]}]})
    assert known.exact and known.total == known.floor
