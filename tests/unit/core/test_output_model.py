"""Learned output lengths (admission.output_reservation: learned)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgateway.core.output_model import ANY_KEY, OutputModel, bucket_of


def test_buckets_are_powers_of_two():
    assert [bucket_of(n) for n in (1, 2, 3, 16, 17, 1000, 1024, 1025)] == [
        1, 2, 4, 16, 32, 1024, 1024, 2048,
    ]  # fmt: skip


def test_max_tokens_until_enough_is_known_then_the_quantile():
    m = OutputModel(min_samples=10)
    for i in range(9):
        m.observe("llama", "k1", 512, 100 + i)
    assert m.reservation("llama", "k1", 512, 0.01) == 512
    m.observe("llama", "k1", 512, 109)
    # 10 samples 100..109: the 0.9 quantile is the 9th value.
    assert m.quantile("llama", "k1", 512, 0.9) == 108
    assert m.reservation("llama", "k1", 512, 0.01) == 109
    assert m.reservation("llama", "k1", 512, 0.0) == 512  # no risk accepted: max_tokens


def test_a_client_is_learned_from_its_own_answers_only():
    """A new client borrowed the model-wide group, which any one key could fill: a key
    sending trivial prompts made every other key's flood be booked at ~2 tokens each
    (545 preemptions in the engine against 0)."""
    m = OutputModel(min_samples=5)
    for _ in range(5):
        m.observe("llama", "k1", 500, 2)
    assert m.reservation("llama", "k1", 400, 0.05) == 2  # its own bucket (512)
    assert m.reservation("llama", "k2", 400, 0.05) == 400  # another key: not from k1's
    assert m.reservation("llama", ANY_KEY, 400, 0.05) == 400  # nor keyless requests
    assert m.reservation("llama", "k1", 2000, 0.05) == 2000  # another bucket: unknown
    assert m.reservation("other", "k1", 500, 0.05) == 500


def test_never_more_than_max_tokens_and_never_zero():
    m = OutputModel(min_samples=3)
    for _ in range(3):
        m.observe("m", ANY_KEY, 600, 0)
    assert m.reservation("m", ANY_KEY, 600, 0.01) == 1
    for _ in range(3):
        m.observe("m", ANY_KEY, 1000, 5000)  # clipped to its own max_tokens
    assert m.reservation("m", ANY_KEY, 520, 0.01) <= 520


def test_the_window_follows_a_change_of_workload():
    m = OutputModel(window=20, min_samples=10)
    for _ in range(20):
        m.observe("m", "k", 1024, 900)
    for _ in range(20):
        m.observe("m", "k", 1024, 50)
    assert m.reservation("m", "k", 1024, 0.01) == 50


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2048), min_size=50, max_size=400), st.floats(0.001, 0.5))
def test_reservation_covers_all_but_about_risk_of_what_was_seen(outputs, risk):
    m = OutputModel(window=1000, min_samples=50)
    for o in outputs:
        m.observe("m", "k", 2048, o)
    reserved = m.reservation("m", "k", 2048, risk)
    over = sum(1 for o in outputs if o > reserved)
    assert over <= risk * len(outputs) + 1e-6


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        OutputModel(window=0)


def test_learned_reservation_on_a_lognormal_workload_saves_most_of_max_tokens():
    rnd = random.Random(3)
    m = OutputModel()
    draws = [min(1024, int(rnd.lognormvariate(5.0, 0.8))) for _ in range(2000)]
    for o in draws[:1000]:
        m.observe("m", "k", 1024, o)
    reserved = m.reservation("m", "k", 1024, 0.01)
    assert reserved < 1024
    over = sum(1 for o in draws[1000:] if o > reserved) / 1000
    assert over < 0.03  # held out: close to the 1% asked for


def test_a_sequence_cut_at_its_cap_counts_as_running_to_the_askers_cap():
    # Requests capped at 129 all ran to it: they were cut, not finished. A 256-token
    # request in the same bucket learns nothing below 256 from them (it reserved 160
    # and its node preempted).
    m = OutputModel(min_samples=10)
    for _ in range(64):
        m.observe("m", "k", 129, 129)
    assert m.reservation("m", "k", 256, 0.01) == 256
    assert m.reservation("m", "k", 129, 0.01) == 129
    shape = m.shape("m", "k", 256)
    assert shape is not None and shape.outlook(0, 256, 0.5).expected == 256
    # Sequences that stopped on their own below their cap are learned as they are.
    for _ in range(640):
        m.observe("m", "k", 200, 90)
    assert m.reservation("m", "k", 256, 0.05) == 90
