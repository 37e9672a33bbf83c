"""Asking a live node for its limits and load: ``GET /v1/models`` and ``GET /metrics``."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import aiohttp

from kvgateway.config.model import BackendConfig
from kvgateway.core.backends import Observed, kv_groups_from_capacity, usable_tokens
from kvgateway.upstream.client import read_capped
from kvgateway.upstream.vllm_metrics import ScrapedMetrics, parse_node_metrics

log = logging.getLogger("kvgateway.upstream.probe")

_MAX_METRICS_BYTES = 8 * 1024 * 1024


class ProbeError(Exception):
    """A node could not be asked (refused, timed out, bad answer)."""


@dataclass(frozen=True, slots=True)
class Probe:
    observed: Observed
    metrics: ScrapedMetrics | None


async def fetch_max_model_len(
    session: aiohttp.ClientSession, cfg: BackendConfig, timeout: float
) -> int | None:
    data = await _get_json(session, f"{cfg.url}/v1/models", timeout)
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list):
        raise ProbeError(f"{cfg.url}/v1/models: expected an OpenAI model list")
    for m in models:
        if isinstance(m, dict) and m.get("id") == cfg.served_model:
            value = m.get("max_model_len")
            return value if isinstance(value, int) and value > 0 else None
    served = [m.get("id") for m in models if isinstance(m, dict)]
    raise ProbeError(f"{cfg.url} does not serve model {cfg.served_model!r} (it serves {served})")


async def fetch_metrics(
    session: aiohttp.ClientSession, cfg: BackendConfig, timeout: float
) -> ScrapedMetrics:
    text = await _get_text(session, f"{cfg.url}/metrics", timeout)
    try:
        return parse_node_metrics(text)
    except ValueError as exc:
        raise ProbeError(f"{cfg.url}/metrics: unparseable ({exc})") from exc


async def probe(session: aiohttp.ClientSession, cfg: BackendConfig, timeout: float) -> Probe:
    """Limits the node reports; /metrics is optional (a node may not expose it)."""
    mml = await fetch_max_model_len(session, cfg, timeout)
    metrics: ScrapedMetrics | None
    try:
        metrics = await fetch_metrics(session, cfg, timeout)
    except ProbeError as exc:
        log.info("backend %s: no usable /metrics (%s)", cfg.name, exc)
        metrics = None
    kv = groups = None
    if metrics is not None and metrics.num_gpu_blocks is not None and metrics.block_size:
        kv = usable_tokens(metrics.num_gpu_blocks, metrics.block_size)
        groups = kv_groups_from_capacity(
            metrics.num_gpu_blocks, metrics.block_size, mml, metrics.kv_cache_size_tokens
        )
    observed = Observed(
        max_model_len=mml,
        kv_cache_tokens=kv,
        block_size=metrics.block_size if metrics else None,
        num_gpu_blocks=metrics.num_gpu_blocks if metrics else None,
        kv_groups=groups,
        node_kv_tokens=metrics.kv_cache_size_tokens if metrics else None,
    )
    return Probe(observed, metrics)


async def _get_text(session: aiohttp.ClientSession, url: str, timeout: float) -> str:
    try:
        async with asyncio.timeout(timeout):
            async with session.get(url) as resp:
                if resp.status != 200:
                    raise ProbeError(f"{url}: HTTP {resp.status}")
                raw = await read_capped(resp.content, _MAX_METRICS_BYTES)
                return raw.decode("utf-8", "replace")
    except TimeoutError as exc:
        raise ProbeError(f"{url}: no answer within {timeout:g}s") from exc
    except aiohttp.ClientError as exc:
        raise ProbeError(f"{url}: {exc.__class__.__name__}: {exc}") from exc
    except ValueError as exc:
        raise ProbeError(f"{url}: answer too large ({exc})") from exc


async def _get_json(session: aiohttp.ClientSession, url: str, timeout: float) -> object:
    text = await _get_text(session, url, timeout)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ProbeError(f"{url}: invalid JSON") from exc
