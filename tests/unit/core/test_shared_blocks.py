"""Credit for prompt blocks an in-flight request holds: accounting by hand, then the
property that matters, against the simulator's engine: credit never makes a node preempt."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgateway.core.admission import Admission, Reservation
from kvgateway.core.backends import Backend
from kvgateway.core.demand import Demand, PrefixHint, demand_tokens
from kvgateway.core.prefix_index import PrefixIndex
from kvgateway.core.prefix_keys import block_keys
from kvgateway.core.prefix_routing import PrefixRouter
from kvgateway.core.shared_blocks import Holding, SharedBlocks
from kvgateway.simulator.engine import EngineConfig, EngineCore
from tests.support.backends import admission_over, backend, demand


def test_a_ready_holder_credits_its_blocks_and_the_last_holder_pays_to_the_end():
    s = SharedBlocks()
    a = s.acquire("n", (1, 2, 3), 16)
    assert a.credited == 0
    early = s.acquire("n", (1, 2, 9), 16)
    assert early.credited == 0  # a is still prefilling: nothing is cached yet
    s.mark_ready(a)
    b = s.acquire("n", (1, 2, 4), 16)
    assert b.credited == 2
    assert s.statistics().paid_blocks == 3 + 3 + 1
    # a ends first: blocks 1 and 2 are still held, one copy of each stays charged.
    assert s.release(a) == 3  # its block 3, and one of the two copies of blocks 1 and 2
    # early paid for 1, 2 and 9, but b still holds 1 and 2 (uncharged): those stay.
    assert s.release(early) == 1
    assert s.release(b) == 3  # the last holder gives back 1, 2 and its own 4
    assert s.statistics() == s.statistics().__class__(0, 0, 0)


def test_release_is_counted_once():
    s = SharedBlocks()
    a = s.acquire("n", (1, 2), 16)
    assert s.release(a) == 2
    assert s.release(a) == 0
    s.mark_ready(a)  # after the end: no effect
    assert s.creditable("n", (1, 2)) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 6), st.integers(0, 2)), max_size=60))
def test_charge_covers_every_held_block_and_returns_to_zero(ops):
    s = SharedBlocks()
    live: list[Holding] = []
    charged = 0
    for prefix, length, action in ops:
        keys = tuple(prefix * 100 + i for i in range(length))
        if action == 0 or not live:
            h = s.acquire("n", keys, 16)
            charged += len(keys) - h.credited
            live.append(h)
        elif action == 1:
            s.mark_ready(live[length % len(live)])
        else:
            charged -= s.release(live.pop(length % len(live)))
        held = {k for h in live for k in h.keys}
        assert charged >= len(held)
        assert charged == s.statistics().paid_blocks
    for h in live:
        charged -= s.release(h)
    assert charged == 0 and s.statistics().held_blocks == 0


# -- against the simulator's engine -------------------------------------------------

BS = 16


def _node(blocks: int, seqs: int = 8) -> tuple[EngineCore, Backend, Admission]:
    """One node whose budget is the engine's whole pool, admitting with credit. A small
    step budget: long prompts are prefilled in chunks, as on a busy node."""
    engine = EngineCore(
        EngineConfig(
            num_gpu_blocks=blocks + 1, block_size=BS, max_num_seqs=seqs, max_num_batched_tokens=64
        )
    )
    b = backend("n", kv=engine.config.kv_tokens, seqs=seqs, max_model_len=4096)
    router = PrefixRouter(PrefixIndex(), shared=SharedBlocks())
    return engine, b, admission_over([b], clock=lambda: engine.clock, prefix=router)


def _request(ids: list[int], out: int) -> Demand:
    return replace(
        demand(len(ids), out),
        tokens=demand_tokens([len(ids)], out, 1, BS),
        prefix=PrefixHint(tuple(block_keys(ids, BS)), BS),
    )


def _drive(
    engine: EngineCore,
    b: Backend,
    adm: Admission,
    pending: list[tuple[Demand, list[int], int]],
    hold_after: int = 0,
) -> int:
    """Admit ``pending`` (demand, prompt ids, tokens it generates) in order as room
    appears (all but the first ``hold_after`` once the first has its first token), run the
    engine to the end; the credited tokens."""
    held_back = pending[hold_after:] if hold_after else []
    if hold_after:
        del pending[hold_after:]
    running: dict[int, tuple[Reservation, object]] = {}
    credited = 0
    steps = 0
    while pending or engine.has_work():
        while pending:
            d, ids, target = pending[0]
            r = adm.try_admit(d)
            if not isinstance(r, Reservation):
                break
            pending.pop(0)
            credited += r.holding.credited_tokens if r.holding else 0
            seq = engine.add(
                target_tokens=target,
                target_reason="length",
                arrival=engine.clock,
                prompt_token_ids=ids,
            )
            running[seq.seq_id] = (r, seq)
        result = engine.step(engine.clock)
        steps += 1
        assert steps < 20_000
        if result is None:
            assert not pending, "admitted work stalled with requests still waiting"
            break
        for seq in result.sampled:
            if seq.output_tokens == 1:
                running[seq.seq_id][0].prefill_done()
                pending += held_back
                held_back = []
        for seq in result.finished:
            running.pop(seq.seq_id)[0].release()
    assert b.reserved_tokens == 0 and b.in_flight == 0
    return credited


def _run(seed: int, blocks: int, prefix_lens: list[int], n: int) -> tuple[EngineCore, int]:
    """Admit ``n`` requests sharing a few prefixes onto one node with credit; run the
    engine; return it and the credited tokens."""
    rnd = random.Random(seed)
    engine, b, adm = _node(blocks)
    prefixes = [[rnd.randrange(1, 40_000) for _ in range(p)] for p in prefix_lens]
    pending = []
    for _ in range(n):
        # Some prompts are their prefix alone: a prompt of exactly k full blocks shares
        # only k - 1 with another (the node recomputes its last token).
        tail = rnd.choice([0, rnd.randrange(1, 40)])
        ids = rnd.choice(prefixes) + [rnd.randrange(1, 40_000) for _ in range(tail)]
        out = rnd.randrange(1, 300)
        # Many run to their max_tokens: the worst case the reservation must hold.
        pending.append((_request(ids, out), ids, rnd.choice([out, rnd.randrange(1, out + 1)])))
    return engine, _drive(engine, b, adm, pending)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 1_000_000),
    st.integers(40, 160),
    st.lists(st.integers(16, 400), min_size=1, max_size=3),
)
def test_credit_never_makes_the_node_preempt(seed, blocks, prefix_lens):
    prefix_lens = [min(p, blocks * BS // 3) for p in prefix_lens]
    engine, _ = _run(seed, blocks, prefix_lens, 30)
    assert engine.num_preemptions == 0


@pytest.mark.parametrize(("blocks", "holder_out"), [(60, 60), (40, 64), (48, 100)])
def test_identical_prompts_of_whole_blocks_never_make_the_node_preempt(blocks, holder_out):
    # A request holds a prompt of exactly 4 full blocks; 15 followers with the same
    # prompt arrive once it has its first token, each running to its max_tokens. Each
    # reuses 3 of the holder's blocks and allocates the 4th (vLLM recomputes the last
    # token): credited all 4, they overfilled the pool (1-4 preemptions).
    engine, b, adm = _node(blocks, seqs=16)
    ids = list(range(1000, 1000 + 4 * BS))
    pending = [(_request(ids, holder_out), ids, holder_out)]
    pending += [(_request(ids, 48), ids, 48) for _ in range(15)]
    credited = _drive(engine, b, adm, pending, hold_after=1)
    assert engine.num_preemptions == 0
    assert credited == 15 * 3 * BS


def test_credit_admits_more_at_once_when_prompts_share_a_prefix():
    engine, credited = _run(7, 200, [1200], 24)
    assert engine.num_preemptions == 0
    assert credited > 0
