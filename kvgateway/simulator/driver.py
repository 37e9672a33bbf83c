"""Runs an :class:`EngineCore` in simulated time on the event loop.

One owned task per node. It sleeps on an event while the engine has nothing to do (no
busy loop), otherwise runs a step, sleeps until that step's end in wall time
(``duration / time_scale``) and then hands the step's tokens to the waiting HTTP
handlers. When the loop falls behind (many streams, high ``time_scale``) it runs up to
``_MAX_BURST`` due steps back to back and delivers them in one pass, so handlers wake
once per burst rather than once per step. It never lags more than ``_MAX_LAG_WALL_S``:
beyond that the simulated GPU is considered idle for the difference (reported as
``lag_trimmed_s`` in ``/sim/state``; if it grows, the machine cannot keep up with the
chosen ``time_scale``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from kvgateway.simulator.engine import EngineCore, SeqState, Sequence, StepResult
from kvgateway.simulator.generation import OutputSampler
from kvgateway.simulator.kv_events import KVEventPublisher
from kvgateway.simulator.metrics import NodeMetrics
from kvgateway.simulator.settings import NodeSettings

log = logging.getLogger("kvgateway.simulator.driver")

_MAX_BURST = 256
_MAX_LAG_WALL_S = 0.02


class RequestHandle:
    """One HTTP request's view of its ``n`` sequences, filled in by the driver."""

    __slots__ = (
        "_event",
        "_finish_sent",
        "emitted",
        "error",
        "finish",
        "pending",
        "prompt_tokens",
        "seqs",
    )

    def __init__(self, seqs: list[Sequence], prompt_tokens: int) -> None:
        n = len(seqs)
        self.seqs = seqs
        self.prompt_tokens = prompt_tokens
        self.pending = [0] * n
        self.emitted = [0] * n
        self.finish: list[str | None] = [None] * n
        self._finish_sent = [False] * n
        self.error: str | None = None
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()

    def take(self) -> list[tuple[int, int, int, str | None]]:
        """News since the last call: (choice index, first token index, count, finish)."""
        self._event.clear()
        news: list[tuple[int, int, int, str | None]] = []
        for i, count in enumerate(self.pending):
            finish = self.finish[i]
            if count == 0 and (finish is None or self._finish_sent[i]):
                continue
            start = self.emitted[i]
            self.emitted[i] += count
            self.pending[i] = 0
            if finish is not None:
                self._finish_sent[i] = True
            news.append((i, start, count, finish))
        return news

    @property
    def has_news(self) -> bool:
        return self._event.is_set()

    @property
    def done(self) -> bool:
        return self.error is not None or all(self._finish_sent)

    @property
    def completion_tokens(self) -> int:
        return sum(self.emitted)


class EngineDriver:
    def __init__(
        self,
        settings: NodeSettings,
        metrics: NodeMetrics,
        *,
        clock: Callable[[], float],
        publisher: KVEventPublisher | None = None,
        wall_clock: Callable[[], float] = time.time,
        output_ids: Seq[int] = (),
    ) -> None:
        self.settings = settings
        self.core = EngineCore(settings.engine_config(), output_ids)
        self._metrics = metrics
        self._clock = clock
        self._publisher = publisher
        self._wall_clock = wall_clock
        self._t0 = clock()
        self._scale = settings.time_scale
        self._max_lag = _MAX_LAG_WALL_S * settings.time_scale
        self._sampler = OutputSampler(settings, random.Random(settings.seed))
        self._routes: dict[int, tuple[RequestHandle, int]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.dead: str | None = None
        self.lag_trimmed_s = 0.0
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"sim-engine:{self.settings.name}")

    async def stop(self) -> None:
        """Cancel the step loop and fail every request still in flight."""
        task, self._task = self._task, None
        if self.dead is None:
            self.dead = "the simulated engine was shut down"
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all(self.dead)

    def sim_now(self) -> float:
        return (self._clock() - self._t0) * self._scale

    # -- requests ------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self.core.running) + len(self.core.waiting)

    def submit(
        self,
        prompt_token_ids: list[int],
        budget: int,
        *,
        n: int = 1,
        ignore_eos: bool = False,
        min_tokens: int = 0,
    ) -> RequestHandle:
        now = self.sim_now()
        seqs: list[Sequence] = []
        for _ in range(n):
            plan = self._sampler.plan(budget, ignore_eos=ignore_eos, min_tokens=min_tokens)
            seqs.append(
                self.core.add(
                    prompt_token_ids=prompt_token_ids,
                    target_tokens=plan.tokens,
                    target_reason=plan.reason,
                    arrival=now,
                )
            )
        handle = RequestHandle(seqs, len(prompt_token_ids))
        if self.dead is not None:
            handle.error = self.dead
        for i, seq in enumerate(seqs):
            self._routes[seq.seq_id] = (handle, i)
        self._wake.set()
        return handle

    def release(self, handle: RequestHandle) -> None:
        """Abort whatever the request still has in the engine; idempotent."""
        now = self.sim_now()
        aborted = False
        for seq in handle.seqs:
            self._routes.pop(seq.seq_id, None)
            if seq.state is not SeqState.FINISHED and self.core.abort(seq, now):
                aborted = True
                self.finished["abort"] += 1
                self._metrics.record_finished(seq)
        if aborted:
            self._wake.set()  # freed blocks may admit a waiting request

    # -- the step loop -------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("simulated engine %s died", self.settings.name)
            self.dead = f"engine died: {exc.__class__.__name__}: {exc}"
            self._fail_all(self.dead)

    async def _loop(self) -> None:
        core = self.core
        while True:
            if not core.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            now = self.sim_now()
            not_before = now - self._max_lag
            if core.running and core.clock < not_before:
                self.lag_trimmed_s += (not_before - core.clock) / self._scale
            results: list[StepResult] = []
            while len(results) < _MAX_BURST:
                result = core.step(not_before)
                if result is None:
                    break
                results.append(result)
                if result.end > now:
                    break
            if not results:
                # Stalled (head of the queue cannot fit): only an arrival or an abort
                # can change that, and both set the wake event.
                self._wake.clear()
                await self._wake.wait()
                continue
            delay = (results[-1].end - self.sim_now()) / self._scale
            if delay > 0:
                await asyncio.sleep(delay)
            self._deliver(results)

    def _deliver(self, results: list[StepResult]) -> None:
        routes = self._routes
        touched: set[RequestHandle] = set()
        record_finished = self._metrics.record_finished
        publisher = self._publisher
        for r in results:
            if publisher is not None and r.kv_events:
                publisher.publish(r.kv_events, self._wall_clock())
            counted = 0
            for seq in r.sampled:
                counted += seq.num_preemptions - seq.preemptions_counted
                seq.preemptions_counted = seq.num_preemptions
            self._metrics.record_step(
                preemptions=counted,
                prompt_tokens=r.prompt_tokens_done,
                generation_tokens=len(r.sampled),
                ttfts=r.ttfts,
                itls=r.inter_token_latencies,
            )
            for seq in r.sampled:
                route = routes.get(seq.seq_id)
                if route is not None:
                    route[0].pending[route[1]] += 1
                    touched.add(route[0])
            for seq in r.finished:
                record_finished(seq)
                reason = seq.finish_reason or "stop"
                self.finished[reason] = self.finished.get(reason, 0) + 1
                route = routes.pop(seq.seq_id, None)
                if route is not None:
                    route[0].finish[route[1]] = reason
                    touched.add(route[0])
        for handle in touched:
            handle.notify()

    def _fail_all(self, message: str) -> None:
        handles = {route[0] for route in self._routes.values()}
        for handle in handles:
            handle.error = message
            handle.notify()

    # -- introspection -------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        core = self.core
        cfg = core.config
        return {
            "name": self.settings.name,
            "model": self.settings.model,
            "profile": self.settings.profile,
            "sim_time": round(self.sim_now(), 6),
            "engine_clock": round(core.clock, 6),
            "time_scale": self._scale,
            "running": len(core.running),
            "waiting": len(core.waiting),
            "num_gpu_blocks": cfg.num_gpu_blocks,
            "block_size": cfg.block_size,
            "usable_blocks": cfg.usable_blocks,
            "used_blocks": core.used_blocks,
            "free_blocks": core.free_blocks,
            "kv_usage": core.usage,
            "kv_tokens": cfg.kv_tokens,
            "max_model_len": cfg.max_model_len,
            "max_num_seqs": cfg.max_num_seqs,
            "preemptions": core.num_preemptions,
            "cached_blocks": core.kv.pool.num_cached,
            "prefix_cache_queries": core.kv.stats.queries,
            "prefix_cache_hits": core.kv.stats.hits,
            "kv_events_endpoint": self._publisher.endpoint if self._publisher else None,
            "steps": core.num_steps,
            "finished": dict(self.finished),
            "lag_trimmed_s": round(self.lag_trimmed_s, 6),
            "dead": self.dead,
        }
