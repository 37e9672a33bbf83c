"""Pure health and load-feedback decisions."""

from kvgateway.config.model import HealthConfig, LoadFeedbackConfig
from kvgateway.upstream.feedback import (
    apply_metrics,
    apply_probe,
    expire_stale,
    request_failed,
    request_served,
)
from kvgateway.upstream.vllm_metrics import ScrapedMetrics
from tests.support.backends import backend, healthy, paused

FB = LoadFeedbackConfig(kv_high_watermark=0.9, kv_low_watermark=0.7, preemption_cooldown_s=5)


def test_health_thresholds():
    cfg = HealthConfig(unhealthy_threshold=2, healthy_threshold=2)
    b = backend("a", healthy=True)
    assert not apply_probe(b, False, "refused", cfg).became_unhealthy
    assert apply_probe(b, False, "refused", cfg).became_unhealthy and not b.healthy
    assert not apply_probe(b, True, "", cfg).became_healthy
    assert apply_probe(b, True, "", cfg).became_healthy and b.healthy


def test_kv_watermark_hysteresis():
    b = backend("a")
    apply_metrics(b, ScrapedMetrics(kv_usage=0.5), 0.0, FB)
    assert not paused(b)
    apply_metrics(b, ScrapedMetrics(kv_usage=0.93), 1.0, FB)
    assert paused(b) and b.pause_reason == "kv_full" and not b.accepting(1.0)
    apply_metrics(b, ScrapedMetrics(kv_usage=0.8), 2.0, FB)
    assert paused(b)  # still above the low watermark
    assert apply_metrics(b, ScrapedMetrics(kv_usage=0.6), 3.0, FB) is True
    assert not paused(b)


def test_queue_must_persist_two_scrapes():
    b = backend("a")
    apply_metrics(b, ScrapedMetrics(waiting=3), 0.0, FB)
    assert not paused(b)
    apply_metrics(b, ScrapedMetrics(waiting=2), 1.0, FB)
    assert paused(b) and b.pause_reason == "queueing"
    apply_metrics(b, ScrapedMetrics(waiting=0), 2.0, FB)
    assert not paused(b)


def test_new_preemptions_pause_for_a_cooldown():
    b = backend("a")
    apply_metrics(b, ScrapedMetrics(preemptions=4), 0.0, FB)
    apply_metrics(b, ScrapedMetrics(preemptions=6), 1.0, FB)
    assert paused(b) and b.pause_reason == "preempting"
    apply_metrics(b, ScrapedMetrics(preemptions=6), 2.0, FB)
    assert paused(b)  # cooling down until t=6
    assert b.accepting(6.5)  # the cool-down ends by itself even without a scrape


def test_a_preemption_pause_ends_once_the_node_has_taken_its_preempted_work_back():
    b = backend("a")
    apply_metrics(b, ScrapedMetrics(preemptions=4, waiting=0), 0.0, FB)
    apply_metrics(b, ScrapedMetrics(preemptions=5, waiting=1), 1.0, FB)
    assert paused(b) and b.pause_reason == "preempting"
    apply_metrics(b, ScrapedMetrics(preemptions=5, waiting=1), 2.0, FB)
    assert paused(b)  # the preempted request still waits on the node
    assert apply_metrics(b, ScrapedMetrics(preemptions=5, waiting=0), 3.0, FB) is True
    assert not paused(b)


def test_kv_use_the_gateways_own_book_explains_pauses_nothing():
    """The watermarks judge the KV other clients hold: a node the gateway itself filled
    to its budget is full by design, and its book keeps it there."""
    b = backend("a", kv=10_000)
    b.reserved_tokens = 9_300
    apply_metrics(b, ScrapedMetrics(kv_usage=0.97), 0.0, FB)
    assert not paused(b)
    # 2,000 tokens the book knows nothing of: someone else fills the node.
    b.reserved_tokens = 7_700
    apply_metrics(b, ScrapedMetrics(kv_usage=0.97), 1.0, FB)
    assert paused(b) and b.pause_reason == "kv_full"


def test_stale_scrape_never_halts_the_node():
    b = backend("a")
    apply_metrics(b, ScrapedMetrics(kv_usage=0.99), 0.0, FB)
    assert paused(b)
    assert expire_stale(b, FB.stale_after_s + 1, FB) is True
    assert not paused(b) and b.load is None


def test_disabled_feedback_records_but_never_pauses():
    b = backend("a")
    cfg = LoadFeedbackConfig(enabled=False)
    apply_metrics(b, ScrapedMetrics(kv_usage=1.0, waiting=10), 0.0, cfg)
    apply_metrics(b, ScrapedMetrics(kv_usage=1.0, waiting=10), 1.0, cfg)
    assert not paused(b) and b.load is not None


def test_a_slow_probe_of_a_node_whose_streams_progress_takes_nothing_out() -> None:
    """A node busy on its cores can miss a 2 s /health while it serves: its streams'
    reports say it is alive, so the failed probe counts neither way."""
    cfg = HealthConfig(interval_s=5.0, unhealthy_threshold=2)
    b = backend("a")
    request_served(b, now=100.0)
    for t in (101.0, 104.0):
        apply_probe(b, False, "no answer within 2s", cfg, now=t)
    assert b.healthy and b.health_failures == 0
    assert b.last_error == "no answer within 2s"
    # Nothing served for longer than a probe interval: the failures count.
    for t in (106.0, 111.0):
        apply_probe(b, False, "no answer within 2s", cfg, now=t)
    assert not b.healthy


def test_a_connect_timeout_to_a_node_whose_streams_progress_ejects_nothing() -> None:
    """A node's API server starved of CPU may take seconds to accept while its engine
    serves: a timed-out connect then says it is busy. A refused connect, or a timed-out
    one to a node that has served nothing lately, counts toward ejection."""
    cfg = HealthConfig(interval_s=5.0, eject_after_failures=2)
    b = backend("a")
    request_served(b, now=100.0)
    for t in (101.0, 102.0, 103.0):
        assert not request_failed(b, "no connection within 3s", t, cfg, slow=True)
    assert b.healthy and b.consecutive_failures == 0
    assert not request_failed(b, "ConnectionRefusedError", 104.0, cfg)
    assert request_failed(b, "ConnectionRefusedError", 104.5, cfg) and not healthy(b)
    quiet = backend("q")
    request_served(quiet, now=100.0)
    request_failed(quiet, "no connection within 3s", 110.0, cfg, slow=True)
    assert request_failed(quiet, "no connection within 3s", 111.0, cfg, slow=True)


def test_requests_waiting_behind_the_gateways_own_unstarted_ones_pause_nothing() -> None:
    """A burst the gateway sent waits on the node behind a big prefill for a step or two:
    its own requests that have not started explain the node's waiting gauge. Waiting
    beyond them (someone else's queue), two scrapes in a row, pauses the node."""
    b = backend("a")
    b.unstarted = 3
    apply_metrics(b, ScrapedMetrics(waiting=3), 0.0, FB)
    apply_metrics(b, ScrapedMetrics(waiting=2), 1.0, FB)
    assert not paused(b)
    apply_metrics(b, ScrapedMetrics(waiting=5), 2.0, FB)
    apply_metrics(b, ScrapedMetrics(waiting=4), 3.0, FB)
    assert paused(b) and b.pause_reason == "queueing"
