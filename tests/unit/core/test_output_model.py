"""Learned output lengths (admission.output_reservation: learned)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgateway.core.output_model import ANY_KEY, CENSORED, OutputModel, OutputShape, bucket_of


def test_buckets_are_powers_of_two():
    assert [bucket_of(n) for n in (1, 2, 3, 16, 17, 1000, 1024, 1025)] == [
        1, 2, 4, 16, 32, 1024, 1024, 2048,
    ]  # fmt: skip


def _mean(m: OutputModel, key: str, max_tokens: int) -> float | None:
    shape = m.shape("llama", key, max_tokens)
    return None if shape is None else shape.outlook(-1, max_tokens, 0.5).expected


def test_nothing_is_known_until_enough_is_seen() -> None:
    m = OutputModel(min_samples=10)
    for i in range(9):
        m.observe("llama", "k1", 512, 100 + i)
    assert m.shape("llama", "k1", 512) is None
    m.observe("llama", "k1", 512, 109)
    shape = m.shape("llama", "k1", 512)
    # The 10 seen, and one more that may run to its cap.
    assert shape is not None and shape.size == 11


def test_one_answer_more_than_seen_may_run_to_its_cap() -> None:
    """The next answer outruns all n seen with chance 1 / (n + 1): with few seen, a
    running sequence may well run to its cap; with many, the model is what they show."""
    few = OutputModel(min_samples=4)
    many = OutputModel(min_samples=4)
    for v in (100, 110, 120, 130):
        few.observe("m", "k", 2048, v)
    for _ in range(100):
        for v in (100, 110, 120, 130):
            many.observe("m", "k", 2048, v)
    few_shape = few.shape("m", "k", 2048)
    many_shape = many.shape("m", "k", 2048)
    assert few_shape is not None and many_shape is not None
    assert few_shape.surviving(0, 2047) == pytest.approx(1 / 5)
    assert many_shape.surviving(0, 2047) == pytest.approx(1 / 401)


def test_a_client_is_learned_from_its_own_answers_only() -> None:
    """One key sending trivial prompts never says when another key's answers end."""
    m = OutputModel(min_samples=5)
    for _ in range(5):
        m.observe("llama", "k1", 500, 2)
    assert m.shape("llama", "k1", 400) is not None  # its own bucket (512)
    assert m.shape("llama", "k2", 400) is None  # another key: not from k1's
    assert m.shape("llama", ANY_KEY, 400) is None  # nor keyless requests
    assert m.shape("llama", "k1", 2000) is None  # another bucket: unknown
    assert m.shape("other", "k1", 500) is None


def test_past_the_longest_answer_seen_the_tail_falls_off_exponentially() -> None:
    """However few answers were seen, a running sequence may outlast them all: past the
    longest the chance falls off at the answers' mean excess over their median."""
    m = OutputModel(min_samples=8)
    for v in (10, 20, 30, 40, 50, 60, 70, 80):
        m.observe("m", "k", 512, v)
    shape = m.shape("m", "k", 512)
    assert shape is not None
    # The median is 50; 60, 70, 80 exceed it by 20 on average. (Of 9: the 8 seen and
    # one more that may run to its cap.)
    assert shape.surviving(0, 79) == pytest.approx(2 / 9)
    assert shape.surviving(0, 100) == pytest.approx((1 + math.exp(-20 / 20)) / 9)
    assert 0.0 < shape.surviving(90, 300) < shape.surviving(90, 120) < 1.0


def test_answers_cut_at_their_cap_keep_their_weight_to_the_cap() -> None:
    m = OutputModel(min_samples=4)
    for v in (10, 20, 512, 512):
        m.observe("m", "k", 512, v)
    shape = m.shape("m", "k", 512)
    assert shape is not None
    # Two cut of the 4 seen, and one more that may run to its cap: 3 of 5.
    assert shape.surviving(0, 5000) == pytest.approx(3 / 5, abs=1e-3)


def test_the_window_follows_a_change_of_workload() -> None:
    m = OutputModel(window=20, min_samples=10)
    for _ in range(20):
        m.observe("m", "k", 1024, 900)
    for _ in range(20):
        m.observe("m", "k", 1024, 50)
    shape = m.shape("m", "k", 1024)
    assert shape is not None and shape.outlook(-1, 1024, 0.5).expected < 100


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2048), min_size=20, max_size=400), st.integers(0, 2047))
def test_survival_is_what_was_seen_past_a_point(outputs: list[int], at: int) -> None:
    m = OutputModel(window=1000, min_samples=20)
    for o in outputs:
        m.observe("m", "k", 2048, o)
    shape = m.shape("m", "k", 2048)
    assert shape is not None
    finite = [o for o in outputs if o < 2048]
    if finite and at < max(finite):
        # Those seen past it, and one more that may run to its cap.
        past = sum(1 for o in outputs if o > at) + 1
        assert shape.surviving(-1, at) == pytest.approx(past / (len(outputs) + 1))


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        OutputModel(window=0)


def test_a_sequence_cut_at_its_cap_counts_as_running_to_the_askers_cap() -> None:
    """Requests capped at 129 that all ran to it were cut, not finished: a 256-token
    request of the same bucket learns nothing below 256 from them."""
    m = OutputModel(min_samples=10)
    for _ in range(64):
        m.observe("m", "k", 129, 129)
    shape = m.shape("m", "k", 256)
    assert shape is not None and shape.outlook(0, 256, 0.5).expected == 256
    assert shape.surviving(0, 255) == 1.0
    # Sequences that stopped on their own below their cap are learned as they are.
    for _ in range(640):
        m.observe("m", "k", 200, 90)
    shape = m.shape("m", "k", 256)
    assert shape is not None and shape.surviving(0, 100) < 0.1


def test_a_groups_shape_is_made_anew_once_a_thirty_second_of_its_answers_is_new() -> None:
    """Below 64 answers every answer is in the shape read next; from 64 the shape is kept
    until 1/32 of the ring is new (flights admitted meanwhile share one shape, which the
    projection reads in one pass), then holds every answer seen."""
    model = OutputModel(window=512, min_samples=4)
    group = model.group("m", "k", 1024)
    for i in range(63):
        model.observe("m", "k", 1024, 100 + i)
        shape = group.shape
        assert shape is None or shape.longest == 100 + i
    kept = group.shape
    model.observe("m", "k", 1024, 500)  # 1 new of 64
    model.observe("m", "k", 1024, 501)  # 2 of 65
    assert group.shape is kept
    model.observe("m", "k", 1024, 502)  # 3 of 66: 3 x 32 >= 66
    fresh = group.shape
    assert fresh is not kept and fresh is not None and fresh.longest == 502


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 600), min_size=1, max_size=60),
    censored=st.integers(0, 5),
    generated=st.integers(-1, 700),
    caps=st.lists(st.integers(1, 800), min_size=1, max_size=40),
)
def test_outlooks_read_at_once_are_the_outlooks_read_one_by_one(
    lengths: list[int], censored: int, generated: int, caps: list[int]
) -> None:
    """For every cap, the mean and variance read for many caps at once are the very
    floats one outlook gives (answers cut at their caps among those seen)."""
    shape = OutputShape(lengths + [CENSORED] * censored)
    mean, var = shape.outlook_many(generated, np.asarray(caps, dtype=np.int64))
    for k, cap in enumerate(caps):
        one = shape.outlook(generated, cap, 0.5)
        assert (float(mean[k]), float(var[k])) == (one.expected, one.variance)
