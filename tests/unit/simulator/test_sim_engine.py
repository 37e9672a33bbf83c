"""The scheduler core, without sockets or clocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgateway.simulator.cost import CostModel
from kvgateway.simulator.engine import (
    EngineConfig,
    EngineCore,
    SeqState,
    Sequence,
    StepResult,
)

COST = CostModel(
    step_overhead_s=0.001, weight_read_s=0.01, prefill_s_per_token=1e-4, kv_read_s_per_token=0.0
)


def core(
    blocks: int = 9, *, bs: int = 4, seqs: int = 8, batch: int = 64, mml: int = 256
) -> EngineCore:
    return EngineCore(
        EngineConfig(
            num_gpu_blocks=blocks,
            block_size=bs,
            max_model_len=mml,
            max_num_seqs=seqs,
            max_num_batched_tokens=batch,
            cost=COST,
        )
    )


def add(c: EngineCore, prompt: int, out: int, arrival: float = 0.0) -> Sequence:
    return c.add(prompt_tokens=prompt, target_tokens=out, target_reason="length", arrival=arrival)


def state_of(seq: Sequence) -> SeqState:
    # Read through a call: mypy would keep an asserted state narrowed across step().
    return seq.state


def step(c: EngineCore) -> StepResult:
    result = c.step(c.clock)
    assert result is not None
    return result


def run_all(c: EngineCore, limit: int = 10_000) -> list[StepResult]:
    results: list[StepResult] = []
    for _ in range(limit):
        if not c.has_work():
            return results
        r = c.step(c.clock)
        if r is None:
            return results
        results.append(r)
    raise AssertionError("engine did not drain")


def test_block_zero_is_reserved() -> None:
    c = core(blocks=5, bs=4)  # 4 usable blocks = 16 tokens
    assert c.config.usable_blocks == 4
    assert c.config.kv_tokens == 16
    assert c.free_blocks == 4
    fits = add(c, 16, 2)
    r = step(c)
    assert r.sampled == (fits,)
    assert fits.state is SeqState.RUNNING and c.free_blocks == 0 and c.usage == 1.0
    c.abort(fits, c.clock)
    assert c.usage == 0.0


def test_prompt_larger_than_pool_stalls_the_queue() -> None:
    c = core(blocks=5, bs=4)  # 16 usable tokens
    big = add(c, 17, 1)
    small = add(c, 4, 1)
    assert c.step(0.0) is None  # nothing can be scheduled, and the clock stays put
    assert c.clock == 0.0
    assert big.state is SeqState.WAITING and small.state is SeqState.WAITING
    assert list(c.waiting) == [big, small]  # FCFS: the small one does not overtake
    assert c.has_work()


def test_admission_needs_the_whole_prompt_and_takes_blocks_chunk_by_chunk() -> None:
    # vLLM's waiting loop (scheduler_reserve_full_isl, on by default) admits a request
    # only if its whole sequence fits the free blocks, then allocate_slots hands out the
    # blocks of each scheduled chunk: a 24-token prompt under an 8-token budget holds 2.
    c = core(blocks=11, bs=4, batch=8)  # 10 usable blocks
    first = add(c, 24, 8)
    second = add(c, 20, 4)  # 5 blocks: never fits beside the first's 6
    r = step(c)
    assert state_of(first) is SeqState.RUNNING and first.num_blocks == 2
    assert r.prefill_tokens == 8 and first.num_computed == 8 and first.output_tokens == 0
    step(c)
    assert first.num_blocks == 4 and first.num_computed == 16
    while first.state is not SeqState.FINISHED:
        step(c)
        assert state_of(second) is SeqState.WAITING or state_of(first) is SeqState.FINISHED
    run_all(c)
    assert second.state is SeqState.FINISHED and c.num_preemptions == 0


def test_decodes_growing_during_a_chunked_prefill_preempt_it() -> None:
    # Admitted with room for its whole prompt, a prefill still takes its blocks chunk by
    # chunk: a running request's decode takes blocks meanwhile, the pool runs out, and
    # the newest running request (the one prefilling) is preempted, as on vLLM.
    c = core(blocks=11, bs=4, batch=4)  # 10 usable blocks; 3 prompt tokens per step
    old = add(c, 12, 24)  # 9 blocks at its end
    while old.output_tokens == 0:
        step(c)
    new = add(c, 24, 4, arrival=c.clock)  # 6 blocks: 7 are free now
    step(c)
    assert state_of(new) is SeqState.RUNNING and new.num_blocks == 1
    preempted: list[Sequence] = []
    for _ in range(200):
        r = c.step(c.clock)
        if r is None:
            break
        preempted += r.preempted
    assert preempted == [new] and new.num_preemptions == 1
    assert old.state is SeqState.FINISHED and new.state is SeqState.FINISHED
    assert c.used_blocks == 0


def test_admission_stops_at_max_num_seqs() -> None:
    c = core(blocks=100, seqs=2)
    a, b, d = (add(c, 4, 10) for _ in range(3))
    step(c)
    assert [s.state for s in (a, b, d)] == [SeqState.RUNNING, SeqState.RUNNING, SeqState.WAITING]
    assert len(c.running) == 2


def test_chunked_prefill_shares_the_budget_with_decodes() -> None:
    c = core(blocks=100, batch=32)
    a = add(c, 8, 100)
    step(c)  # a: prefill done, first token out
    assert a.output_tokens == 1
    b = add(c, 100, 5, arrival=c.clock)
    r = step(c)
    # a decodes one token, b gets the remaining 31 tokens of the budget.
    assert r.decode_tokens == 1 and r.prefill_tokens == 31
    assert b.num_computed == 31 and b.output_tokens == 0
    steps = 1
    while b.output_tokens == 0:
        step(c)
        steps += 1
    assert steps == 4  # 31 + 31 + 31 + 7 prompt tokens, one decode for `a` in each step
    assert b.first_token_at is not None and b.first_token_at > a.first_token_at  # type: ignore[operator]


def test_decode_grows_blocks_and_usage_returns_to_zero() -> None:
    c = core(blocks=20, bs=4)
    s = add(c, 4, 9)  # KV holds 4 + 9 - 1 = 12 tokens at the end = 3 blocks
    peak = 0
    while c.has_work():
        step(c)
        peak = max(peak, c.used_blocks)
    assert s.state is SeqState.FINISHED and s.finish_reason == "length"
    assert s.output_tokens == 9
    assert peak == 3
    assert c.used_blocks == 0 and c.usage == 0.0


def test_preemption_takes_the_newest_and_requeues_it_at_the_front() -> None:
    # 6 usable blocks of 4 tokens. Three 8-token prompts take 2 blocks each: full.
    c = core(blocks=7, bs=4)
    old = add(c, 8, 20)
    mid = add(c, 8, 20)
    new = add(c, 8, 20)
    step(c)  # all three admitted and prefilled, one token each
    assert [s.state for s in (old, mid, new)] == [SeqState.RUNNING] * 3
    assert c.free_blocks == 0
    late = add(c, 4, 1, arrival=c.clock)  # waiting behind them
    r = step(c)
    # `old` needs a 3rd block for token 9: the newest running sequence is preempted.
    assert r.preempted == (new,)
    assert new.state is SeqState.WAITING and new.num_computed == 0 and new.num_blocks == 0
    assert list(c.waiting) == [new, late]  # at the front, ahead of a later arrival
    assert c.num_preemptions == 1 and new.num_preemptions == 1
    # `mid` fit in the block `new` freed; nothing was admitted in a step that preempted.
    assert [s for s in c.running] == [old, mid]
    assert late.state is SeqState.WAITING


def test_preempted_sequence_recomputes_and_keeps_its_output() -> None:
    c = core(blocks=7, bs=4)
    seqs = [add(c, 8, 12) for _ in range(3)]
    outputs_before: dict[int, int] = {}
    results: list[StepResult] = []
    for _ in range(2000):
        r = c.step(c.clock)
        if r is None:
            break
        results.append(r)
        for s in r.preempted:
            outputs_before.setdefault(s.seq_id, s.output_tokens)
        if not c.has_work():
            break
    assert outputs_before, "the pool was overcommitted: someone must have been preempted"
    assert all(s.state is SeqState.FINISHED and s.output_tokens == 12 for s in seqs)
    tokens = sum(len(r.sampled) for r in results)
    assert tokens == 36  # every output token exactly once, despite recomputation
    assert c.used_blocks == 0


def test_sequence_bigger_than_pool_preempts_itself_and_stalls() -> None:
    c = core(blocks=5, bs=4)  # 16 tokens
    s = add(c, 12, 30)  # grows past the pool while decoding
    results = run_all(c)
    assert results[-1].preempted == (s,)
    assert s.state is SeqState.WAITING and c.has_work()
    assert c.step(c.clock) is None  # stalled for good, as in vLLM
    assert c.free_blocks == 4


def test_abort_frees_blocks_wherever_the_sequence_is() -> None:
    c = core(blocks=11, bs=4, seqs=1)
    running = add(c, 16, 50)
    waiting = add(c, 16, 50)
    step(c)
    assert c.used_blocks == 4
    assert c.abort(running, c.clock) and c.used_blocks == 0
    assert running.finish_reason == "abort" and running.state is SeqState.FINISHED
    assert not c.abort(running, c.clock)  # idempotent
    assert c.abort(waiting, c.clock) and not c.has_work()


def test_a_request_arriving_later_waits_for_its_arrival() -> None:
    c = core()
    s = add(c, 4, 2, arrival=5.0)
    r = step(c)  # idle engine: starts at the arrival, not before
    assert r.start == 5.0 and s.scheduled_at == 5.0
    s2 = add(c, 4, 2, arrival=100.0)
    step(c)  # `s` decodes; `s2` has not arrived yet in simulated time
    assert s2.state is SeqState.WAITING


def test_cost_model_bigger_batches_are_slower_per_step_but_faster_overall() -> None:
    cost = CostModel(
        step_overhead_s=0.002,
        weight_read_s=0.016,
        prefill_s_per_token=2e-4,
        kv_read_s_per_token=1.3e-7,
    )
    one = cost.step_duration(1, 2000)
    sixteen = cost.step_duration(16, 16 * 2000)
    assert sixteen > one
    assert 16 / sixteen > 4 * (1 / one)
    assert cost.step_duration(0, 0) == 0.0
    # A 2048-token prefill chunk is compute bound: ~0.41 s at 200 us/token.
    assert cost.step_duration(2048, 2048) == pytest.approx(0.002 + 0.4096 + 2048 * 1.3e-7)


def test_timestamps_follow_step_durations() -> None:
    c = core(blocks=100)
    s = add(c, 10, 3)
    results = run_all(c)
    assert [r.start for r in results[1:]] == [r.end for r in results[:-1]]
    assert s.first_token_at == results[0].end
    assert results[0].ttfts == (results[0].end,)
    assert results[1].inter_token_latencies == (results[1].end - results[0].end,)
    assert s.finished_at == results[-1].end


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 40), st.booleans()), min_size=1, max_size=25
    ),
    st.integers(2, 6),
    st.integers(4, 64),
)
def test_block_accounting_invariants(
    requests: list[tuple[int, int, bool]], seqs: int, batch: int
) -> None:
    c = core(blocks=30, bs=4, seqs=seqs, batch=batch)  # 116 tokens: any one request fits
    added = []
    for prompt, out, abort_later in requests:
        added.append((add(c, prompt, out, arrival=c.clock), abort_later))
        for _ in range(3):
            c.step(c.clock)
            held = sum(s.num_blocks for s in c.running)
            assert held + c.free_blocks == c.config.usable_blocks
            assert all(s.num_blocks == 0 for s in c.waiting)
            assert len(c.running) <= seqs
        if abort_later and added:
            c.abort(added[0][0], c.clock)
    run_all(c)
    assert not c.has_work()
    assert c.free_blocks == c.config.usable_blocks
    for s, _ in added:
        assert s.state is SeqState.FINISHED
        if s.finish_reason != "abort":
            assert s.output_tokens == s.target_tokens
