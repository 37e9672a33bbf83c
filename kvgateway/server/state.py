"""Everything one running gateway holds, built once in :func:`kvgateway.server.app.create_app`."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import aiohttp

from kvgateway.config.model import GatewayConfig, ModelConfig
from kvgateway.core.admission import Admission
from kvgateway.core.fleet import Fleet
from kvgateway.core.routing import Decision, Demand, Wait
from kvgateway.server.metrics import GatewayMetrics
from kvgateway.tokens.counting import PromptCounter, TextCountCache
from kvgateway.tokens.encoding import EncodingCache, EncodingSpec

Clock = Callable[[], float]


@dataclass(slots=True)
class Counters:
    """One PromptCounter (with its own cache) per encoding."""

    encodings: EncodingCache
    executor: ThreadPoolExecutor | None
    cache_chars: int = 32 * 1024 * 1024
    inline_chars: int = 24_000
    _by_spec: dict[EncodingSpec, PromptCounter] = field(default_factory=dict)

    def for_model(self, model: ModelConfig) -> PromptCounter:
        spec = model.tokenizer.encoding
        counter = self._by_spec.get(spec)
        if counter is None:
            counter = PromptCounter(
                self.encodings.get(spec),
                TextCountCache(self.cache_chars),
                self.executor,
                inline_chars=self.inline_chars,
                chunked=spec.chunk_safe,
            )
            self._by_spec[spec] = counter
        return counter


class GatewayState:
    def __init__(
        self,
        config: GatewayConfig,
        fleet: Fleet,
        metrics: GatewayMetrics,
        counters: Counters,
        *,
        clock: Clock = time.monotonic,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.metrics = metrics
        self.counters = counters
        self.clock = clock
        self.started_at = clock()
        self.started_at_wall = time.time()
        # Shutdown phases: `draining` makes /ready fail while requests are still
        # served (load balancers stop sending); `shutting_down` refuses new requests.
        self.draining = False
        self.shutting_down = False
        self.shutdown_reason = ""
        self.active: set[asyncio.Task[object]] = set()
        self.session: aiohttp.ClientSession | None = None
        # Backend-reported prompt tokens / gateway estimate, per model (EWMA).
        self.estimate_ratio: dict[str, float] = {}
        self.admission = Admission(
            index_for=self.fleet.index,
            adjust=self.fleet.adjust,
            policy=lambda: self.config.routing.policy,
            offload_overflow=lambda: self.config.routing.offload_overflow,
            queue_size=lambda: self.config.admission.queue_size,
            clock=clock,
            on_decision=self._count_decision,
        )

    def _count_decision(self, decision: Decision, demand: Demand) -> None:
        # Admissions are counted with their tier when granted; refusals (too long, no
        # backend) as rejections by the handler. Here: the requests that had to queue.
        if isinstance(decision, Wait):
            self.metrics.decisions.labels(tier="-", reason="queued").inc()

    def http(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("the upstream client session is not open (app not started)")
        return self.session

    def scaled_prompt(self, model: str, counted: int) -> int:
        """The counted prompt, grown by the configured margin and by how much the
        backends' own tokenizers have been counting above our estimate."""
        cfg = self.config.resolve_model(model)
        margin = cfg.tokenizer.estimate_margin if cfg else 0.0
        ratio = max(1.0, min(self.estimate_ratio.get(model, 1.0), 2.0))
        return math.ceil(counted * (1.0 + margin) * ratio)

    def observe_usage(self, model: str, estimated: int, reported: int) -> None:
        if estimated <= 0 or reported <= 0:
            return
        ratio = reported / estimated
        self.metrics.estimate_ratio.labels(model=model).observe(ratio)
        prev = self.estimate_ratio.get(model, 1.0)
        self.estimate_ratio[model] = 0.9 * prev + 0.1 * ratio
