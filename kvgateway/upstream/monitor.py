"""Background watch of every backend: health probes, limit discovery, load scrapes.

One named task per backend, owned by :class:`Monitor`, started and stopped with the app
and re-synced on reload. Each watcher is supervised: a crash is logged, reported through
``on_crash`` (a metric) and the watcher restarted after a short pause, so a bug never
silently freezes one backend's health. Every request it makes is bounded by a timeout.
A timed pause (preemption cool-down) is ended through :class:`Admission`, at its time,
so the waiters queued for that backend are served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aiohttp

from kvgateway.config.model import GatewayConfig
from kvgateway.core.admission import Admission
from kvgateway.core.backends import Backend, LimitSource
from kvgateway.core.fleet import Fleet
from kvgateway.tasks import stop_tasks
from kvgateway.upstream import feedback, probe
from kvgateway.upstream.client import read_capped

log = logging.getLogger("kvgateway.upstream.monitor")

_HEALTH_BODY_MAX = 64 * 1024

RESTART_DELAY_S = 1.0
CLOSE_S = 5.0


class Monitor:
    def __init__(
        self,
        *,
        fleet: Fleet,
        admission: Admission,
        session: aiohttp.ClientSession,
        config: Callable[[], GatewayConfig],
        clock: Callable[[], float],
        on_crash: Callable[[Backend], None] = lambda b: None,
        restart_delay_s: float = RESTART_DELAY_S,
    ) -> None:
        self._fleet = fleet
        self._admission = admission
        self._session = session
        self._config = config
        self._clock = clock
        self._on_crash = on_crash
        self._restart_delay_s = restart_delay_s
        self._tasks: dict[int, asyncio.Task[None]] = {}

    def sync(self) -> None:
        """Start a watcher for every active backend, stop those of removed ones."""
        active = {id(b): b for b in self._fleet.active}
        for key in list(self._tasks):
            if key not in active:
                self._tasks.pop(key).cancel()
        for key, b in active.items():
            if key not in self._tasks:
                self._tasks[key] = asyncio.create_task(self._supervise(b), name=f"monitor:{b.name}")

    async def probe_all_once(self) -> None:
        """One health check + discovery round for every backend (used at start-up)."""
        await asyncio.gather(*(self._check(b) for b in self._fleet.active))

    async def close(self) -> None:
        """Stop the watchers, waiting at most :data:`CLOSE_S` (a probe's client may lose
        a cancel that lands as its answer does; the watcher then ends with the process)."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        await stop_tasks(tasks, CLOSE_S, "backend watchers", log)

    async def _supervise(self, b: Backend) -> None:
        while not b.draining:
            try:
                await self._watch(b)
            except Exception:
                log.exception("backend %s: watcher crashed; restarting it", b.name)
                self._on_crash(b)
                await asyncio.sleep(self._restart_delay_s)

    async def _watch(self, b: Backend) -> None:
        cfg = self._config()
        next_health = 0.0
        next_load = 0.0
        next_discovery = self._clock() + cfg.health.rediscover_interval_s
        while not b.draining:
            cfg = self._config()
            fb = cfg.load_feedback
            if self._clock() >= next_health:
                await self._check(b)
                next_health = self._clock() + cfg.health.interval_s
            if b.healthy and self._clock() >= next_discovery:
                # A node restarted between two probes (say with a new --max-model-len)
                # never looked unhealthy: ask it again now and then.
                await self._discover(b, periodic=True)
                next_discovery = self._clock() + cfg.health.rediscover_interval_s
            if fb.enabled and b.healthy and self._clock() >= next_load:
                await self._scrape(b)
                next_load = self._clock() + fb.interval_s
            now = self._clock()
            if feedback.expire_stale(b, now, fb):
                self._admission.rebalance()
            self._admission.end_pause(b, now)
            wake = next_health
            if b.healthy:  # scrapes and rediscovery wait for health: no wake-up before
                wake = min(wake, next_discovery, next_load if fb.enabled else wake)
            if b.paused and b.paused_until:
                wake = min(wake, b.paused_until)
            await asyncio.sleep(max(0.01, wake - self._clock()))

    async def _check(self, b: Backend) -> None:
        cfg = self._config().health
        ok, error = await _health(self._session, b, cfg.timeout_s)
        if not ok and not b.ever_healthy:
            log.debug("backend %s not ready yet: %s", b.name, error)
        change = feedback.apply_probe(b, ok, error, cfg, self._clock())
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
            self._admission.rebalance()

    async def _discover(self, b: Backend, *, periodic: bool = False) -> None:
        """Ask the node for its limits. ``periodic``: the routine rediscovery of a node
        that stayed healthy (not one that just came back, maybe restarted)."""
        if not b.config.discover:
            return
        try:
            found = await probe.probe(self._session, b.config, self._config().health.timeout_s)
        except probe.ProbeError as exc:
            log.warning("backend %s: discovery failed: %s", b.name, exc)
            return
        # A /metrics that failed on a routine rediscovery says nothing new of the pool:
        # the last report stands (a blip once made the node unusable until the next
        # probe). Not for a node that came back, or now reports another context length:
        # it may have restarted with a smaller pool, unknown until /metrics answers.
        observed = found.observed
        seen = self._fleet.discovered(b)
        if (
            found.metrics is None
            and periodic
            and seen is not None
            and seen.max_model_len == observed.max_model_len
        ):
            observed = observed.keeping_pool_of(seen)
        if self._fleet.set_discovered(b, observed):
            log.info(
                "backend %s limits: max_model_len=%s (%s) kv_cache_tokens=%s (%s)",
                b.name,
                b.limits.max_model_len.value,
                b.limits.max_model_len.source,
                b.limits.kv_cache_tokens.value,
                b.limits.kv_cache_tokens.source,
            )
            self._admission.rebalance()

    async def _scrape(self, b: Backend) -> None:
        fb = self._config().load_feedback
        try:
            m = await probe.fetch_metrics(self._session, b.config, fb.timeout_s)
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
        if feedback.apply_metrics(b, m, self._clock(), fb):
            self._admission.rebalance()
        if b.pause_reason != was:
            if b.paused:
                log.warning("backend %s: no new work (%s)", b.name, b.pause_reason)
            else:
                log.info("backend %s takes work again", b.name)
        # A node restarted with a different pool: learn its new limits.
        seen = self._fleet.discovered(b)
        if restarted or (
            m.num_gpu_blocks is not None
            and seen is not None
            and b.limits.kv_cache_tokens.source is LimitSource.DISCOVERED
            and (m.num_gpu_blocks, m.block_size) != (seen.num_gpu_blocks, seen.block_size)
        ):
            await self._discover(b)


async def _health(session: aiohttp.ClientSession, b: Backend, timeout: float) -> tuple[bool, str]:
    try:
        async with asyncio.timeout(timeout):
            async with session.get(f"{b.config.url}/health") as resp:
                # vLLM answers with an empty body; read a little (so the connection can
                # be reused), never a node's endless answer.
                with contextlib.suppress(ValueError):
                    await read_capped(resp.content, _HEALTH_BODY_MAX)
                if resp.status == 200:
                    return True, ""
                return False, f"HTTP {resp.status}"
    except TimeoutError:
        return False, f"no answer within {timeout:g}s"
    except aiohttp.ClientError as exc:
        return False, f"{exc.__class__.__name__}"
