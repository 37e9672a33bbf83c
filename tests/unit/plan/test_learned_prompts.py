"""Learned mode reserves KV for what the nodes count, not the worst-case vocabulary."""

from __future__ import annotations

from dataclasses import replace

from kvgateway.config.model import ModelConfig
from kvgateway.plan.budget import LEARNED_PROMPT_SAMPLES, learned_prompts
from kvgateway.tokens.plans import TokenizerConfig
from kvgateway.tokens.prompt_estimate import PromptCalibration, PromptEstimate

MODEL = ModelConfig(name="m", served_name="m", aliases=(), tokenizer=TokenizerConfig())


def _estimate(bound: int, standin: int, *, exact: bool = False) -> PromptEstimate:
    return PromptEstimate(
        total=bound, longest=bound, each=(bound,), exact=exact, standin=standin, prompts=1
    )


def _taught(reports: int, ratio: float = 1.0) -> PromptCalibration:
    cal = PromptCalibration()
    for _ in range(reports):
        cal.observe("a", "m", 2_000, round(2_000 * ratio))
    return cal


def test_the_bound_stands_until_the_nodes_reported_enough() -> None:
    model = MODEL
    cal = _taught(LEARNED_PROMPT_SAMPLES - 1)
    assert learned_prompts(_estimate(1_300, 1_000), model, cal, [1_300]) == [1_300]


def test_the_nodes_prediction_replaces_the_bound_once_learned() -> None:
    model = MODEL
    assert learned_prompts(_estimate(1_300, 1_000), model, _taught(60), [1_300]) == [1_000]
    # A node that counts 10% more than the stand-in: reserved as it counts.
    got = learned_prompts(_estimate(1_300, 1_000), model, _taught(60, 1.1), [1_300])
    assert 1_095 <= got[0] <= 1_105
    # Never more than the bound.
    assert learned_prompts(_estimate(1_300, 1_000), model, _taught(60, 1.6), [1_300]) == [1_300]


def test_exact_counts_and_batches_are_left_alone() -> None:
    model = MODEL
    cal = _taught(60)
    assert learned_prompts(_estimate(1_000, 900, exact=True), model, cal, [1_000]) == [1_000]
    batch = replace(_estimate(2_600, 2_000), each=(1_300, 1_300), prompts=2)
    assert learned_prompts(batch, model, cal, [1_300, 1_300]) == [1_300, 1_300]
