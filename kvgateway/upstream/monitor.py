"""Background watch of every backend: health probes, limit discovery, load scrapes.

One named task per backend, owned by :class:`Monitor`, started and stopped with the app
and re-synced on reload. Every request it makes is bounded by a timeout; a failure only
changes that backend's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from kvgateway.core.backends import Backend
from kvgateway.core.limits import usable_tokens
from kvgateway.server.state import GatewayState
from kvgateway.upstream import feedback, probe

log = logging.getLogger("kvgateway.upstream.monitor")


class Monitor:
    def __init__(self, state: GatewayState) -> None:
        self._state = state
        self._tasks: dict[int, asyncio.Task[None]] = {}

    def sync(self) -> None:
        """Start a watcher for every active backend, stop those of removed ones."""
        active = {id(b): b for b in self._state.fleet.active}
        for key in list(self._tasks):
            if key not in active:
                self._tasks.pop(key).cancel()
        for key, b in active.items():
            if key not in self._tasks:
                self._tasks[key] = asyncio.create_task(self._watch(b), name=f"monitor:{b.name}")

    async def probe_all_once(self) -> None:
        """One health check + discovery round for every backend (used at start-up)."""
        await asyncio.gather(*(self._check(b) for b in self._state.fleet.active))

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def _watch(self, b: Backend) -> None:
        st = self._state
        next_health = 0.0
        next_load = 0.0
        next_discovery = st.clock() + st.config.health.rediscover_interval_s
        while not b.draining:
            now = st.clock()
            if now >= next_health:
                await self._check(b)
                next_health = st.clock() + st.config.health.interval_s
            if b.healthy and st.clock() >= next_discovery:
                # A node restarted between two probes (say with a new --max-model-len)
                # never looked unhealthy: ask it again now and then.
                await self._discover(b)
                next_discovery = st.clock() + st.config.health.rediscover_interval_s
            fb = st.config.load_feedback
            if fb.enabled and b.healthy and st.clock() >= next_load:
                await self._scrape(b)
                next_load = st.clock() + fb.interval_s
            if feedback.expire_stale(b, st.clock(), fb):
                st.admission.rebalance()
            delay = min(next_health, next_load if fb.enabled else next_health) - st.clock()
            await asyncio.sleep(max(0.05, delay))

    async def _check(self, b: Backend) -> None:
        st = self._state
        cfg = st.config.health
        ok, error = await _health(st.http(), b, cfg.timeout_s)
        if not ok and not b.ever_healthy:
            log.debug("backend %s not ready yet: %s", b.name, error)
        change = feedback.apply_probe(b, ok, error, cfg)
        if change.became_unhealthy:
            log.warning("backend %s is unhealthy: %s", b.name, error)
        if ok and (change.became_healthy or not b.limits.known):
            await self._discover(b)
        if change.became_healthy:
            log.info(
                "backend %s is healthy (max_model_len=%s, kv_cache_tokens=%s)",
                b.name,
                b.limits.max_model_len.value,
                b.limits.kv_cache_tokens.value,
            )
            st.admission.rebalance()

    async def _discover(self, b: Backend) -> None:
        st = self._state
        if not b.config.discover:
            return
        try:
            found = await probe.probe(st.http(), b.config, st.config.health.timeout_s)
        except probe.ProbeError as exc:
            log.warning("backend %s: discovery failed: %s", b.name, exc)
            return
        if st.fleet.set_discovered(b, found.observed):
            log.info(
                "backend %s limits: max_model_len=%s (%s) kv_cache_tokens=%s (%s)",
                b.name,
                b.limits.max_model_len.value,
                b.limits.max_model_len.source,
                b.limits.kv_cache_tokens.value,
                b.limits.kv_cache_tokens.source,
            )
            st.admission.rebalance()

    async def _scrape(self, b: Backend) -> None:
        st = self._state
        fb = st.config.load_feedback
        try:
            m = await probe.fetch_metrics(st.http(), b.config, fb.timeout_s)
        except probe.ProbeError as exc:
            log.debug("backend %s: scrape failed: %s", b.name, exc)
            return
        was = b.pause_reason
        prev = b.load
        restarted = (
            prev is not None
            and prev.preemptions is not None
            and m.preemptions is not None
            and m.preemptions < prev.preemptions
        )
        if feedback.apply_metrics(b, m, st.clock(), fb):
            st.admission.rebalance()
        if b.pause_reason != was:
            if b.paused:
                log.warning("backend %s: no new work (%s)", b.name, b.pause_reason)
            else:
                log.info("backend %s takes work again", b.name)
        # A node restarted with a different pool: learn its new limits.
        disc = b.limits.kv_cache_tokens
        if restarted or (
            m.num_gpu_blocks is not None
            and m.block_size
            and disc.source == "discovered"
            and usable_tokens(m.num_gpu_blocks, m.block_size) != disc.value
        ):
            await self._discover(b)


async def _health(session: aiohttp.ClientSession, b: Backend, timeout: float) -> tuple[bool, str]:
    try:
        async with asyncio.timeout(timeout):
            async with session.get(f"{b.config.url}/health") as resp:
                await resp.read()
                if resp.status == 200:
                    return True, ""
                return False, f"HTTP {resp.status}"
    except TimeoutError:
        return False, f"no answer within {timeout:g}s"
    except aiohttp.ClientError as exc:
        return False, f"{exc.__class__.__name__}"
