"""bench.fleet's ceiling for output-aware admission: the arithmetic the README quotes."""

from __future__ import annotations

import math
import random

from bench.fleet import OUTPUT_MEAN, OUTPUT_SIGMA, expected_output, learned_ceiling, shape


def test_an_oracle_books_what_the_answers_use() -> None:
    c = learned_ceiling(seed=3, samples=40_000)
    a, short, long = c["all"], c["short"], c["long"]
    assert a["requests"] == 40_000 == short["requests"] + long["requests"]
    # max_tokens books at least what an oracle books, and an oracle at least the KV in use.
    for row in (a, short, long):
        assert row["by_count"] >= 1.0
        assert 1.0 <= row["by_time_held"] <= row["by_kv_in_use"]
    # Short chats carry the slack (256-1,024 max_tokens on 200-2,000 prompts); long ones
    # are mostly prompt.
    assert short["by_count"] > long["by_count"]
    # The booked mean is the mix's mean prompt + max_tokens: 80% 200-2,000 + 256-1,024,
    # 18% 4k-16k + 256-1,024, 2% 24k-100k + 128-256.
    booked = 0.80 * (1_100 + 640) + 0.18 * (10_000 + 640) + 0.02 * (62_000 + 192)
    assert math.isclose(a["max_tokens_reservation_mean"], booked, rel_tol=0.03)
    # What the oracle saves per request is max_tokens less the answer (the prompts
    # cancel): it matches the closed form E[min(X, max_tokens)] the benchmark's
    # "offered" column uses, within sampling error.
    rnd = random.Random(3)
    caps = [shape(rnd)[1] for _ in range(40_000)]
    saved = sum(m - expected_output(m) for m in caps) / len(caps)
    measured = a["max_tokens_reservation_mean"] - a["oracle_reservation_mean"]
    assert math.isclose(measured, saved, rel_tol=0.03)
    assert OUTPUT_MEAN == 512.0 and OUTPUT_SIGMA == 1.0


def test_the_ceiling_is_drawn_from_the_mix_asked_for() -> None:
    """A reasoning model's answers (mean 1,500) under max_tokens of 8k-32k leave far
    more to an output-aware policy than today's mix: the ceiling follows --mix."""
    from bench.fleet import MIXES

    today = learned_ceiling(seed=3, samples=20_000)["all"]
    reasoning = learned_ceiling(seed=3, mix=MIXES["reasoning"], samples=20_000)["all"]
    assert today["by_time_held"] < 1.2
    assert reasoning["by_time_held"] > 4.0
    # Booked: prompts of 200-3,000 and max_tokens of 8,192-32,000 (mean 20,288).
    assert math.isclose(reasoning["max_tokens_reservation_mean"], 1_600 + 20_288, rel_tol=0.03)
