"""A node whose context leaves less than a request's max_tokens serves it with max_tokens
cut (vLLM >= 0.32), and the gateway may route it there when the learned answers say the
cut is all but never reached: the request holds, and is sent, the cut."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgateway.config.model import Policy
from kvgateway.core.demand import Demand, cut_to, demand_tokens
from kvgateway.core.output_model import CENSORED, CUT_SAMPLES, OutputModel, OutputShape
from kvgateway.core.routing import ModelIndex, Routed, RouterState, route
from kvgateway.errors import Saturated
from tests.support.backends import admission_over, backend, demand


def _fleet():
    return [
        backend("s1", tier="small", tier_index=0, max_model_len=8192, kv=30000),
        backend("l1", tier="large", tier_index=1, max_model_len=32768, kv=400000, seqs=128),
        backend("o1", tier="offload", tier_index=2, offload=True, max_model_len=131072, kv=200000),
    ]


def _learned(answers: list[int], max_tokens: int) -> OutputModel:
    m = OutputModel()
    for a in answers:
        m.observe("m", "k", max_tokens, a)
    return m


def _cuttable(prompt: int, output: int, answers: list[int], risk: float = 0.001) -> Demand:
    lengths = _learned(answers, output).group("m", "k", output)
    return replace(demand(prompt, output), lengths=lengths, clamp_risk=risk)


def _decide(backends, d):
    return route(Policy.KV_AWARE, ModelIndex(backends), d, RouterState(), 0.0)


def test_a_cut_is_taken_only_where_learned_answers_never_reach_it() -> None:
    short = [100 + i for i in range(40)]
    # 1,000 + 8,192 passes the small node's 8k context: the large tier holds it whole.
    r = _decide(_fleet(), demand(1000, 8192))
    assert isinstance(r, Routed) and r.backend.name == "l1"
    # Answers of ~100 tokens: the small node's cut to 7,192 is never reached.
    r = _decide(_fleet(), _cuttable(1000, 8192, short))
    assert isinstance(r, Routed) and r.backend.name == "s1" and r.reason == "fit"
    # Answers of ~5,000 tokens: a cut at 7,192 is under twice the longest seen.
    r = _decide(_fleet(), _cuttable(1000, 8192, [5000 + i for i in range(40)]))
    assert isinstance(r, Routed) and r.backend.name == "l1"
    # Too few answers seen to say, or no risk accepted: no cut.
    r = _decide(_fleet(), _cuttable(1000, 8192, short[: CUT_SAMPLES - 1]))
    assert isinstance(r, Routed) and r.backend.name == "l1"
    r = _decide(_fleet(), _cuttable(1000, 8192, short, risk=0.0))
    assert isinstance(r, Routed) and r.backend.name == "l1"


def test_a_cut_keeps_long_max_tokens_off_the_offload_tier() -> None:
    """32,000 beside a 1,000-token prompt passes every GPU context; cut to the 32k one's
    31,768 it fits there, where the offload tier would have taken it whole."""
    r = _decide(_fleet(), demand(1000, 32000))
    assert isinstance(r, Routed) and r.backend.name == "o1"
    r = _decide(_fleet(), _cuttable(1000, 32000, [2000 + 10 * i for i in range(64)]))
    assert isinstance(r, Routed) and r.backend.name == "l1"


def test_answers_that_ran_to_their_cap_forbid_a_cut() -> None:
    answers = [100] * 40 + [8192]  # one ran to its cap: it would have gone on
    r = _decide(_fleet(), _cuttable(1000, 8192, answers))
    assert isinstance(r, Routed) and r.backend.name == "l1"


def test_an_answer_cut_by_its_nodes_context_is_learned_as_running_on() -> None:
    m = OutputModel(min_samples=1)
    m.observe("m", "k", 8192, 7000, cap=7000)
    m.observe("m", "k", 8192, 6999, cap=7000)
    shape = m.shape("m", "k", 8192)
    assert shape is not None and shape.longest == 6999


def test_the_cut_demand_holds_what_the_cut_leaves() -> None:
    d = _cuttable(1000, 8192, [100] * 40)
    cut = cut_to(d, 8192, 16)
    assert cut is not None and cut.output_tokens == 7192
    assert cut.tokens == demand_tokens([1000], 7192, 1, 16) and cut.clamp_risk == 0.0
    assert cut_to(d, 32768, 16) is d  # fits whole: unchanged
    assert cut_to(d, 1000, 16) is None  # no room for any output


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 20_000), min_size=1, max_size=300),
    st.integers(0, 5),
    st.sampled_from([0.001, 0.01, 0.05, 0.2]),
)
def test_a_shortest_cut_is_passed_at_most_with_the_accepted_chance(
    answers: list[int], ran_on: int, risk: float
) -> None:
    """Of n lengths (one assumed, ``ran_on`` seen running to their caps), the chance an
    answer passes the cut, as the shape models it, is at most the risk: the answers seen
    past it, those that ran on, and the assumed one's exponential tail past the longest."""
    shape = OutputShape([*answers, *([CENSORED] * ran_on), CENSORED])
    cut = shape.shortest_cut(risk, assumed=1)
    n = len(answers) + ran_on + 1
    if cut is None:
        assert n * risk <= ran_on
        return
    top = max(answers)
    passing: float
    if cut < top:
        passing = ran_on + 1 + sum(1 for a in answers if a > cut)
    else:
        median = sorted(answers)[len(answers) // 2]
        excess = [a - median for a in answers if a > median]
        tail = max(1.0, sum(excess) / len(excess)) if excess else 1.0
        passing = ran_on + math.exp(-(cut - top) / tail)
    assert passing / n <= risk * (1 + 1e-9)


async def test_admission_holds_and_reports_the_cut() -> None:
    adm = admission_over(_fleet())
    d = replace(_cuttable(1000, 8192, [100] * 40), projected=True)
    r = await adm.admit(d, 1.0)
    assert r.backend.name == "s1" and r.output_cut == 7192
    assert r.flight is not None and r.flight.bound == 7192
    assert r.tokens == demand_tokens([1000], 7192, 1, 16)
    r.release()
    whole = await adm.admit(replace(demand(1000, 2000), projected=True), 1.0)
    assert whole.output_cut is None


@pytest.mark.parametrize("risk", [0.0, 0.001])
def test_multi_sequence_demands_are_cut_per_sequence(risk: float) -> None:
    d = replace(
        demand(1000, 8192, n=3),
        lengths=_learned([100] * 40, 8192).group("m", "k", 8192),
        clamp_risk=risk,
    )
    cut = cut_to(d, 8192, 16)
    if not risk:
        assert cut is None
    else:
        assert cut is not None and cut.tokens == demand_tokens([1000], 7192, 3, 16)


async def test_a_request_a_cut_will_serve_waits_for_its_answers_to_be_learned() -> None:
    """Only the offload node holds 1,000 + 32,000 whole, and its KV only one such: its
    soonest room, when the running one ends, is far past the deadline. A request no cut
    can serve is refused at once; one the small node will serve cut once its group has
    learned enough answers waits, and the answer that completes the group re-offers the
    queue: it is served there, cut."""
    small = backend("s1", max_model_len=8192, kv=30000)
    offload = backend(
        "o1", tier="offload", tier_index=1, offload=True, max_model_len=131072, kv=40000
    )
    offload.step_s = 0.25
    adm = admission_over([small, offload])
    first = await adm.admit(replace(demand(1000, 32000), projected=True), 1.0)
    assert first.backend is offload
    adm.progress(first, 1)  # running: its end, and so the soonest room, is known
    with pytest.raises(Saturated, match="projected"):
        await adm.admit(replace(demand(1000, 32000), projected=True), 5.0)

    model = OutputModel()
    waiting = replace(
        demand(1000, 32000),
        projected=True,
        lengths=model.group("m", "k", 32000),
        clamp_risk=0.001,
    )
    task = asyncio.create_task(adm.admit(waiting, 5.0))
    await asyncio.sleep(0)
    assert not task.done() and adm.queue_depth == 1
    learned = [model.observe("m", "k", 32000, 100 + i) for i in range(CUT_SAMPLES)]
    assert learned == [False] * (CUT_SAMPLES - 1) + [True]
    adm.rebalance()
    r = await asyncio.wait_for(task, 1.0)
    assert r.backend is small and r.output_cut == 8192 - 1000
    r.release()
    first.release()
