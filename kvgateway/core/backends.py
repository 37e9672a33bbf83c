"""Runtime state of each backend: resolved limits, reservations, health and live load.

Mutated only from the event loop. Routing and admission read it synchronously, and every
read here is side-effect free; the health checker and the metrics scraper write health
and load; reservations change ``reserved_tokens`` / ``reserved_seqs`` / ``in_flight``
through :mod:`kvgateway.core.admission`, which also ends pauses (so its waiters hear of it).

Each backend's :class:`Limits` are resolved from what is configured, discovered and
derived. Order of precedence, per limit: an explicit value in the backend's YAML entry; the
value the live node reports (``/v1/models`` -> ``max_model_len``; ``/metrics`` ->
``vllm:cache_config_info`` ``num_gpu_blocks`` x ``block_size``); the value derived from
the backend's ``capacity`` block (GPU memory, model architecture). Disagreements are
reported as warnings (``gateway check`` prints them, the server logs them).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from enum import StrEnum

from kvgateway.capacity.layout import kv_tokens_from_blocks
from kvgateway.config.model import BackendConfig
from kvgateway.core.projection import NodeProjection


class LimitSource(StrEnum):
    CONFIG = "config"
    DISCOVERED = "discovered"
    DERIVED = "derived"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Limit:
    value: int | None
    source: LimitSource


@dataclass(frozen=True, slots=True)
class Limits:
    max_model_len: Limit
    kv_cache_tokens: Limit
    max_num_seqs: Limit
    block_size: int = 16
    warnings: tuple[str, ...] = ()
    # KV-cache groups sharing the pool (hybrid attention: 2+), and the node's own
    # statement of its capacity in tokens of max_model_len requests (vLLM >= 0.32).
    kv_groups: int = 1
    node_kv_tokens: int | None = None

    @property
    def known(self) -> bool:
        return self.max_model_len.value is not None and self.kv_cache_tokens.value is not None


@dataclass(frozen=True, slots=True)
class Observed:
    """Limits from one source (a live node, or the capacity maths)."""

    max_model_len: int | None = None
    kv_cache_tokens: int | None = None
    max_num_seqs: int | None = None
    block_size: int | None = None
    # Discovered: the pool's size as the node reports it (vllm:cache_config_info).
    num_gpu_blocks: int | None = None
    # How many KV-cache groups share the pool (2+ for hybrid attention models): derived
    # from the model's architecture, or discovered as a lower bound from the node's own
    # capacity (:func:`kv_groups_from_capacity`).
    kv_groups: int | None = None
    # Discovered: vLLM >= 0.32's own capacity in tokens of max_model_len requests.
    node_kv_tokens: int | None = None

    def keeping_pool_of(self, earlier: Observed | None) -> Observed:
        """This report, with ``earlier``'s pool if this one has none."""
        if earlier is None or earlier.num_gpu_blocks is None or self.num_gpu_blocks is not None:
            return self
        return replace(
            self,
            kv_cache_tokens=earlier.kv_cache_tokens,
            block_size=earlier.block_size,
            num_gpu_blocks=earlier.num_gpu_blocks,
        )


def usable_tokens(num_gpu_blocks: int, block_size: int) -> int:
    """Tokens requests can use on a node that reports ``num_gpu_blocks`` (one KV group)."""
    return kv_tokens_from_blocks(num_gpu_blocks, block_size)


def _pick(
    name: str,
    configured: int | None,
    discovered: int | None,
    derived: int | None,
    warnings: list[str],
) -> Limit:
    if configured is not None and discovered is not None and configured != discovered:
        risk = (
            "the node will reject or preempt requests the gateway admits"
            if configured > discovered
            else "capacity is left unused"
        )
        warnings.append(
            f"{name}: configured {configured} but the node reports {discovered} ({risk}); "
            "using the configured value"
        )
    if derived is not None:
        actual = discovered if discovered is not None else configured
        if actual is not None and abs(derived - actual) > 0.05 * max(actual, 1):
            warnings.append(
                f"{name}: derived from the capacity block as {derived} but "
                f"{'the node reports' if discovered is not None else 'configured'} {actual}"
            )
    if configured is not None:
        return Limit(configured, LimitSource.CONFIG)
    if discovered is not None:
        return Limit(discovered, LimitSource.DISCOVERED)
    if derived is not None:
        return Limit(derived, LimitSource.DERIVED)
    return Limit(None, LimitSource.UNKNOWN)


def kv_groups_from_capacity(
    num_gpu_blocks: int, block_size: int, max_model_len: int | None, node_tokens: int | None
) -> int | None:
    """KV-cache groups a node has at least, from vLLM >= 0.32's own capacity
    (``kv_cache_size_tokens``: ``num_gpu_blocks / blocks per max_model_len request x
    max_model_len``): a request of max_model_len takes a full-attention group's
    ``ceil(len / block)`` blocks in each of its groups, a sliding-window group's fewer,
    so the blocks it takes over its full run are a lower bound of the groups. None
    when the node does not say (before 0.32)."""
    if not node_tokens or not max_model_len:
        return None
    per_request = num_gpu_blocks * max_model_len / node_tokens
    full = -(-max_model_len // block_size)
    return max(1, math.ceil(per_request / full - 0.01))


def _in_groups(disc: Observed, derived: Observed | None) -> Observed:
    """A node reports its whole block pool; for a hybrid model (several KV-cache groups,
    from the architecture, else at least what the node's own capacity says) each
    request's tokens take a block in every group, so the pool holds
    ``(blocks - 1) // groups * block_size`` tokens."""
    groups = derived.kv_groups if derived is not None else None
    groups = groups or disc.kv_groups
    if not groups or groups <= 1 or disc.num_gpu_blocks is None or not disc.block_size:
        return disc
    tokens = kv_tokens_from_blocks(disc.num_gpu_blocks, disc.block_size, groups)
    return replace(disc, kv_cache_tokens=tokens)


def resolve_limits(
    cfg: BackendConfig, discovered: Observed | None, derived: Observed | None
) -> Limits:
    disc = _in_groups(discovered or Observed(), derived)
    der = derived or Observed()
    warnings: list[str] = []
    mml = _pick("max_model_len", cfg.max_model_len, disc.max_model_len, der.max_model_len, warnings)
    kv = _pick(
        "kv_cache_tokens", cfg.kv_cache_tokens, disc.kv_cache_tokens, der.kv_cache_tokens, warnings
    )
    seqs = _pick("max_num_seqs", cfg.max_num_seqs, disc.max_num_seqs, der.max_num_seqs, warnings)
    block = disc.block_size or der.block_size or 16
    return Limits(
        max_model_len=mml,
        kv_cache_tokens=kv,
        max_num_seqs=seqs,
        block_size=block,
        warnings=tuple(warnings),
        kv_groups=der.kv_groups or disc.kv_groups or 1,
        node_kv_tokens=disc.node_kv_tokens,
    )


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
