"""Runtime state of each backend: resolved limits, reservations, health and live load.

Mutated only from the event loop. Routing and admission read it synchronously; the
health checker and the metrics scraper write health and load; reservations change
``reserved_tokens`` / ``reserved_seqs`` / ``in_flight`` through :mod:`kvgateway.core.admission`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvgateway.config.model import BackendConfig


@dataclass(frozen=True, slots=True)
class Limit:
    value: int | None
    source: str  # "config", "discovered", "derived" or "unknown"


@dataclass(frozen=True, slots=True)
class Limits:
    max_model_len: Limit
    kv_cache_tokens: Limit
    max_num_seqs: Limit
    block_size: int = 16
    warnings: tuple[str, ...] = ()

    @property
    def known(self) -> bool:
        return self.max_model_len.value is not None and self.kv_cache_tokens.value is not None


@dataclass(slots=True)
class LoadSnapshot:
    """What the node's own /metrics said at ``at`` (monotonic seconds)."""

    at: float
    kv_usage: float | None
    running: float | None
    waiting: float | None
    preemptions: float | None


# Used when neither config, node nor capacity block names a concurrency cap: vLLM's
# own default for --max-num-seqs on GPUs.
DEFAULT_MAX_NUM_SEQS = 256


@dataclass(slots=True, eq=False)
class Backend:
    config: BackendConfig
    tier_index: int
    limits: Limits
    budget_fraction: float
    reserved_tokens: int = 0
    reserved_seqs: int = 0
    in_flight: int = 0
    healthy: bool = False
    ever_healthy: bool = False
    draining: bool = False
    # Live load feedback: no new work while paused (node full, queueing or preempting).
    paused: bool = False
    pause_reason: str = ""
    paused_until: float = 0.0
    load: LoadSnapshot | None = None
    consecutive_failures: int = 0
    health_failures: int = 0
    health_successes: int = 0
    last_error: str = ""
    # Times (monotonic) the node refused or failed a request: 4xx/5xx answers, resets.
    rejection_times: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    # Ratio of the node's own prompt count to the gateway's estimate (EWMA).
    estimate_ratio: float = 1.0

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def tier(self) -> str:
        return self.config.tier

    @property
    def model(self) -> str:
        return self.config.model

    @property
    def offload(self) -> bool:
        return self.config.offload

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len.value or 0

    @property
    def kv_cache_tokens(self) -> int:
        return self.limits.kv_cache_tokens.value or 0

    @property
    def max_num_seqs(self) -> int:
        return self.limits.max_num_seqs.value or DEFAULT_MAX_NUM_SEQS

    @property
    def budget_tokens(self) -> int:
        return int(self.kv_cache_tokens * self.budget_fraction)

    @property
    def context_limit(self) -> int:
        """The longest single sequence this node can hold: its context or its whole pool."""
        if not self.limits.known:
            return 0
        return min(self.max_model_len, self.budget_tokens)

    @property
    def free_tokens(self) -> int:
        return self.budget_tokens - self.reserved_tokens

    @property
    def free_seqs(self) -> int:
        return self.max_num_seqs - self.reserved_seqs

    @property
    def usable(self) -> bool:
        """Healthy, limits known and not leaving the fleet."""
        return self.healthy and self.limits.known and not self.draining

    def note_rejection(self, now: float) -> None:
        self.rejection_times.append(now)

    def recent_rejections(self, now: float, window_s: float = 60.0) -> int:
        times = self.rejection_times
        while times and times[0] < now - window_s:
            times.popleft()
        return len(times)

    def accepting(self, now: float) -> bool:
        if not self.usable:
            return False
        if self.paused and now >= self.paused_until and self.pause_reason == "preempting":
            self.paused = False
            self.pause_reason = ""
        return not self.paused
