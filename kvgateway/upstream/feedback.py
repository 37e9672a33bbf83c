"""Backend health and load, decided in one place: pure functions of what was seen.

:mod:`kvgateway.upstream.monitor` does the probes' and scrapes' I/O; the request path
reports what its requests met (:func:`request_failed`, :func:`request_served`).

Health: ``unhealthy_threshold`` failed probes in a row take a backend out,
``healthy_threshold`` good ones bring it back; ``eject_after_failures`` failed requests
in a row (connect errors, 5xx, a stream cut or ended by an in-band error) take it out
until a probe succeeds.

Load feedback: the node's own gauges override the gateway's accounting when they say
the node is in trouble, since other clients may share it:

* KV usage the gateway's own book does not explain, at or above the high watermark,
  pauses new work until it falls below the low watermark (hysteresis);
* requests waiting on the node beyond the gateway's own unstarted ones, in two scrapes
  in a row (someone else's queue is not draining);
* new preemptions pause it until the node has nothing waiting, or for a cool-down.

A stale or failed scrape never pauses anything: the gateway's own accounting holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgateway.config.model import HealthConfig, LoadFeedbackConfig
from kvgateway.core.backends import Backend, LoadSnapshot, PauseReason
from kvgateway.upstream.vllm_metrics import ScrapedMetrics


@dataclass(frozen=True, slots=True)
class HealthChange:
    became_healthy: bool = False
    became_unhealthy: bool = False


def apply_probe(
    b: Backend, ok: bool, error: str, cfg: HealthConfig, now: float = 0.0
) -> HealthChange:
    """A health probe's answer. A probe that fails while the node's streams report
    progress says only that its API server was slow to answer (a node busy on 2 cores
    misses a 2 s probe): it counts as no answer, neither way."""
    if not ok and serving(b, now, cfg):
        b.last_error = error
        return HealthChange()
    if ok:
        b.health_successes += 1
        b.health_failures = 0
        if not b.healthy and b.health_successes >= cfg.healthy_threshold:
            b.healthy = True
            b.ever_healthy = True
            b.consecutive_failures = 0
            return HealthChange(became_healthy=True)
        return HealthChange()
    b.health_successes = 0
    b.health_failures += 1
    b.last_error = error
    if b.healthy and b.health_failures >= cfg.unhealthy_threshold:
        b.healthy = False
        return HealthChange(became_unhealthy=True)
    return HealthChange()


def serving(b: Backend, now: float, cfg: HealthConfig) -> bool:
    """``b``'s streams reported progress within a probe interval: it is alive, whatever
    a slow probe or a slow connect says."""
    return bool(b.served_at) and now - b.served_at < cfg.interval_s


def request_failed(
    b: Backend,
    error: str,
    now: float,
    cfg: HealthConfig,
    *,
    may_eject: bool = True,
    slow: bool = False,
) -> bool:
    """A request failed on ``b`` (the node's doing: connect, 5xx, a broken stream);
    ``may_eject`` False for a failure that says little of the node's health (a
    timeout of a request that may simply be long); ``slow`` for a connect that timed
    out, which says nothing of a node that is :func:`serving`. True when this ejected
    ``b``."""
    b.note_rejection(now)
    b.last_error = error
    if slow and serving(b, now, cfg):
        return False
    b.consecutive_failures += 1
    if may_eject and b.healthy and b.consecutive_failures >= cfg.eject_after_failures:
        b.healthy = False
        return True
    return False


def request_served(b: Backend, now: float) -> None:
    """A request got its whole answer from ``b``: its run of failures ends (a stream cut
    after its head is a failure in that run, not a success)."""
    b.consecutive_failures = 0
    b.served_at = now


def apply_metrics(b: Backend, m: ScrapedMetrics, now: float, cfg: LoadFeedbackConfig) -> bool:
    """Record a scrape and decide whether the node takes new work; returns True when it
    just became able to take work again (waiters should be offered it).

    The gateway's own book already keeps what it sends within the node's budget, so the
    KV watermarks judge only use the book does not explain (other clients of the node):
    a node full of the gateway's own sequences is not paused; likewise, requests waiting
    on the node count only beyond the gateway's own that have not started there. A preemption pauses new
    work until the node has taken back what it preempted (nothing waiting there) or the
    cool-down has passed, whichever comes first."""
    prev = b.load
    b.load = LoadSnapshot(now, m.kv_usage, m.running, m.waiting, m.preemptions)
    if not cfg.enabled:
        return False
    was_paused = b.paused
    reason = PauseReason.NONE
    until = 0.0
    if m.kv_usage is not None and _unexplained(b, m.kv_usage, cfg):
        limit = (
            cfg.kv_low_watermark
            if was_paused and b.pause_reason is PauseReason.KV_FULL
            else cfg.kv_high_watermark
        )
        if m.kv_usage >= limit:
            reason = PauseReason.KV_FULL
    # Waiting requests beyond this gateway's own that have not started there (a burst
    # waits behind a big prefill for a step or two): someone else's queue.
    if not reason and m.waiting is not None and m.waiting - b.unstarted > cfg.max_waiting:
        prev_waiting = prev.waiting if prev is not None else None
        if prev_waiting is not None and prev_waiting - b.unstarted > cfg.max_waiting:
            reason = PauseReason.QUEUEING
    if (
        not reason
        and prev is not None
        and prev.preemptions is not None
        and m.preemptions is not None
        and m.preemptions > prev.preemptions
    ):
        reason = PauseReason.PREEMPTING
        until = now + cfg.preemption_cooldown_s
    if (
        not reason
        and was_paused
        and b.pause_reason is PauseReason.PREEMPTING
        and now < b.paused_until
        and (m.waiting is None or m.waiting > 0)
    ):
        return False  # still cooling down: the node has not taken its preempted work back
    b.paused = bool(reason)
    b.pause_reason = reason
    b.paused_until = until
    return was_paused and not b.paused


def _unexplained(b: Backend, usage: float, cfg: LoadFeedbackConfig) -> bool:
    """The node's KV use is more than the gateway's own book there can explain, by more
    than the watermark's own headroom (a scrape and the book are moments apart)."""
    total = b.kv_cache_tokens
    if total <= 0:
        return True
    return usage * total - b.reserved_tokens > (1.0 - cfg.kv_high_watermark) * total


def expire_stale(b: Backend, now: float, cfg: LoadFeedbackConfig) -> bool:
    """Forget a scrape older than ``stale_after_s``; returns True if that un-paused."""
    if b.load is None or now - b.load.at <= cfg.stale_after_s:
        return False
    b.load = None
    was = b.paused
    b.paused = False
    b.pause_reason = PauseReason.NONE
    return was
