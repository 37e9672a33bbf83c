"""Runtime state of each backend: resolved limits, reservations, health and live load.

Mutated only from the event loop. Routing and admission read it synchronously, and every
read here is side-effect free; the health checker and the metrics scraper write health
and load; reservations change ``reserved_tokens`` / ``reserved_seqs`` / ``in_flight``
through :mod:`kvgateway.core.admission`, which also ends pauses (so its waiters hear of it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

from kvgateway.config.model import BackendConfig
from kvgateway.core.limits import Limits
from kvgateway.core.projection import NodeProjection


class PauseReason(StrEnum):
    """Why a healthy node takes no new work (live load feedback)."""

    NONE = ""
    KV_FULL = "kv_full"
    QUEUEING = "queueing"
    PREEMPTING = "preempting"


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
    pause_reason: PauseReason = PauseReason.NONE
    # When a timed pause (preemption cool-down) ends; 0 for pauses lifted by a scrape.
    paused_until: float = 0.0
    load: LoadSnapshot | None = None
    consecutive_failures: int = 0
    health_failures: int = 0
    health_successes: int = 0
    last_error: str = ""
    # Times (monotonic) the node refused or failed a request: 4xx/5xx answers, resets.
    rejection_times: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    # Requests admitted by the projected peak, and the part of ``reserved_tokens`` that
    # is what they hold now (the rest: requests holding their whole bound).
    projection: NodeProjection = field(default_factory=NodeProjection)
    projected_tokens: int = 0
    # Seconds per engine step, as its streams' reported counts advance (0: not seen yet):
    # turns the projection's steps into a wait a client can be told.
    step_s: float = 0.0
    # When the node last answered a request or reported a stream's progress (monotonic).
    served_at: float = 0.0
    # This gateway's requests on the node that have reported no progress yet (queued or
    # in prefill there, or answered whole): what its "waiting" gauge may be counting.
    unstarted: int = 0

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

    def resync_projected(self) -> int:
        """Make ``projected_tokens`` what the projection's flights hold now; the change."""
        block = self.limits.block_size
        now = self.projection.current_blocks(block) * block
        change, self.projected_tokens = now - self.projected_tokens, now
        return change

    def note_rejection(self, now: float) -> None:
        self.rejection_times.append(now)

    @property
    def starting(self) -> bool:
        """New and not probed to a verdict yet (a DNS member just added, a node booting):
        worth waiting for rather than refusing the request."""
        if self.draining or self.health_failures:
            return False
        return not self.ever_healthy or not self.limits.known

    def recent_rejections(self, now: float, window_s: float = 60.0) -> int:
        start = now - window_s
        return sum(1 for t in self.rejection_times if t >= start)

    def paused_at(self, now: float) -> bool:
        """Paused at ``now``: a timed pause counts as over once its time has come, even
        before :meth:`Admission.end_pause` clears it."""
        if not self.paused:
            return False
        return not (self.paused_until and now >= self.paused_until)

    def accepting(self, now: float) -> bool:
        """Takes new work at ``now``. A pure read: never changes the backend."""
        return self.usable and not self.paused_at(now)
