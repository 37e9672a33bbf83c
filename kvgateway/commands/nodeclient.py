"""A vLLM node's HTTP surface as ``gateway round`` needs it: limits and counters.

Every call is bounded by a timeout; failures become :class:`RoundError`, once, here.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

from kvgateway.commands.roundstats import (
    GENERATION_TOKENS,
    NodeLimits,
    cache_labels,
    counter_total,
)
from kvgateway.core.backends import usable_tokens
from kvgateway.upstream.vllm_metrics import parse_node_metrics

PROBE_TIMEOUT_S = 10.0


class RoundError(Exception):
    """The node cannot be measured (unreachable, no model, no KV figures)."""


class NodeClient:
    """The node's HTTP surface, each call bounded."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = url.rstrip("/")

    async def get_text(self, path: str) -> str:
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                async with self.session.get(self.url + path) as resp:
                    if resp.status != 200:
                        raise RoundError(f"{self.url}{path}: HTTP {resp.status}")
                    return await resp.text()
        except TimeoutError as exc:
            raise RoundError(f"{self.url}{path}: no answer in {PROBE_TIMEOUT_S:g}s") from exc
        except aiohttp.ClientError as exc:
            raise RoundError(f"{self.url}{path}: {exc.__class__.__name__}: {exc}") from exc

    async def limits(self) -> NodeLimits:
        try:
            body = json.loads(await self.get_text("/v1/models"))
        except ValueError as exc:
            raise RoundError(f"{self.url}/v1/models: not JSON") from exc
        models = body.get("data") if isinstance(body, dict) else None
        first = models[0] if isinstance(models, list) and models else None
        model = first.get("id") if isinstance(first, dict) else None
        mml = first.get("max_model_len") if isinstance(first, dict) else None
        if not isinstance(model, str) or not isinstance(mml, int):
            raise RoundError(f"{self.url}/v1/models: no model with a max_model_len")
        text = await self.get_text("/metrics")
        try:
            metrics = parse_node_metrics(text)
            labels = cache_labels(text)
        except ValueError as exc:
            raise RoundError(f"{self.url}/metrics: unparseable ({exc})") from exc
        if metrics.num_gpu_blocks is None or not metrics.block_size:
            raise RoundError(f"{self.url}/metrics: no vllm:cache_config_info num_gpu_blocks")
        util = _float_or_none(labels.get("gpu_memory_utilization"))
        return NodeLimits(
            model=model,
            max_model_len=mml,
            num_gpu_blocks=metrics.num_gpu_blocks,
            block_size=metrics.block_size,
            kv_tokens=usable_tokens(metrics.num_gpu_blocks, metrics.block_size),
            cache_dtype=labels.get("cache_dtype"),
            gpu_memory_utilization=util,
        )

    async def counters(self) -> tuple[float, float | None, float]:
        """(preemptions, generated tokens or None, requests in the engine)."""
        text = await self.get_text("/metrics")
        try:
            m = parse_node_metrics(text)
            generated = counter_total(text, GENERATION_TOKENS)
        except ValueError as exc:
            raise RoundError(f"{self.url}/metrics: unparseable ({exc})") from exc
        return m.preemptions or 0.0, generated, (m.running or 0.0) + (m.waiting or 0.0)

    async def kv_usage(self) -> float | None:
        text = await self.get_text("/metrics")
        try:
            return parse_node_metrics(text).kv_usage
        except ValueError as exc:
            raise RoundError(f"{self.url}/metrics: unparseable ({exc})") from exc


def _float_or_none(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None
