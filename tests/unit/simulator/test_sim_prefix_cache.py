"""Prefix caching in the simulated engine, against hand-worked cases (vLLM V1 rules)."""

from __future__ import annotations

import hashlib
import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgateway.simulator.block_pool import (
    BlockPool,
    BlockRemoved,
    BlockStored,
    external_hash,
    hash_block_tokens,
    none_hash,
)
from kvgateway.simulator.cost import CostModel
from kvgateway.simulator.engine import EngineConfig, EngineCore, Sequence, StepResult

COST = CostModel(
    step_overhead_s=0.001, weight_read_s=0.01, prefill_s_per_token=1e-4, kv_read_s_per_token=0.0
)
ROOT = none_hash(None)


def core(blocks: int = 9, *, bs: int = 4, caching: bool = True, events: bool = False) -> EngineCore:
    return EngineCore(
        EngineConfig(
            num_gpu_blocks=blocks,
            block_size=bs,
            max_model_len=256,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            cost=COST,
            enable_prefix_caching=caching,
            enable_kv_events=events,
        )
    )


def add(c: EngineCore, ids: list[int], out: int = 1) -> Sequence:
    return c.add(prompt_token_ids=ids, target_tokens=out, target_reason="length", arrival=0.0)


def drain(c: EngineCore) -> list[StepResult]:
    results: list[StepResult] = []
    for _ in range(10_000):
        r = c.step(c.clock)
        if r is None:
            return results
        results.append(r)
    raise AssertionError("engine did not drain")


def test_block_hash_is_sha256_of_pickled_parent_tokens_and_extra_keys() -> None:
    expected = hashlib.sha256(
        pickle.dumps((ROOT, (1, 2, 3, 4), None), protocol=pickle.HIGHEST_PROTOCOL)
    ).digest()
    first = hash_block_tokens(ROOT, None, [1, 2, 3, 4])
    assert first == expected
    second = hash_block_tokens(ROOT, first, [5, 6, 7, 8])
    assert (
        second
        == hashlib.sha256(
            pickle.dumps((first, (5, 6, 7, 8), None), protocol=pickle.HIGHEST_PROTOCOL)
        ).digest()
    )
    # The same tokens under another parent, or with extra keys, are another block.
    assert hash_block_tokens(ROOT, None, [5, 6, 7, 8]) != second
    assert hash_block_tokens(ROOT, None, [1, 2, 3, 4], ("salt",)) != first
    assert external_hash(first) == int.from_bytes(first, "big") & (2**64 - 1)


def test_only_full_blocks_are_hashed_and_chained() -> None:
    c = core()
    seq = add(c, list(range(10)))
    c.kv.update_hashes(seq)
    h0 = hash_block_tokens(ROOT, None, [0, 1, 2, 3])
    assert seq.block_hashes == [h0, hash_block_tokens(ROOT, h0, [4, 5, 6, 7])]


def test_freed_blocks_go_fresh_first_and_cached_tail_first_to_the_back() -> None:
    # 8 usable blocks of 4. A 10-token prompt takes blocks 1, 2, 3; blocks 1 and 2 are
    # full and cached. Freed in reverse: 3 has no hash and goes to the front, then the
    # cached 2 and 1 go to the back, tail first (2 is evicted before 1).
    c = core()
    a = add(c, list(range(10)))
    drain(c)
    assert a.finish_reason == "length"
    assert c.kv.pool.free_order() == [3, 4, 5, 6, 7, 8, 2, 1]
    assert c.kv.pool.num_cached == 2 and c.used_blocks == 0


def test_a_shared_prefix_hits_and_only_the_rest_is_prefilled() -> None:
    c = core()
    add(c, list(range(10)))
    drain(c)
    b = add(c, [*range(8), 90, 91, 92, 93], out=2)
    r = c.step(c.clock)
    assert r is not None
    # 12 tokens, at most 11 may hit: the two cached blocks (8 tokens).
    assert b.num_computed == 12 and r.prefill_tokens == 4
    assert (c.kv.stats.queries, c.kv.stats.hits) == (10 + 12, 8)
    # Hit blocks 1 and 2 leave the free queue; the new block is the front one (3).
    table = c.kv.blocks_of(b.seq_id)[0]
    assert [blk.block_id for blk in table] == [1, 2, 3]
    assert c.kv.pool.free_order() == [4, 5, 6, 7, 8]


def test_a_fully_cached_prompt_still_recomputes_its_last_block() -> None:
    c = core()
    add(c, list(range(8)))
    drain(c)
    add(c, list(range(8)))
    r = c.step(c.clock)
    # 8 tokens: at most 7 may hit, so only block 0 (4 tokens); block 1 is recomputed.
    assert r is not None and r.prefill_tokens == 4
    assert c.kv.stats.hits == 4


def test_prefix_caching_off_never_hits() -> None:
    c = core(caching=False)
    add(c, list(range(10)))
    drain(c)
    add(c, list(range(10)))
    r = c.step(c.clock)
    assert r is not None and r.prefill_tokens == 10
    assert c.kv.pool.num_cached == 0 and c.kv.stats.hits == 0


def test_lru_eviction_reuses_the_least_recent_tail_first_and_reports_it() -> None:
    c = core(events=True)
    add(c, list(range(8)), out=1)  # caches 2 blocks: tokens 0-3 and 4-7
    first = drain(c)
    stored = [e for r in first for e in r.kv_events]
    assert len(stored) == 1 and isinstance(stored[0], BlockStored)
    assert stored[0].parent_block_hash is None and stored[0].token_ids == tuple(range(8))
    h0, h1 = stored[0].block_hashes
    # 8 usable blocks: 2 cached-free at the back. A 28-token prompt needs 7 blocks: the 6
    # fresh ones, then the LRU front of the cached ones: the tail (tokens 4-7) goes first.
    add(c, [100 + i for i in range(28)], out=1)
    r = c.step(c.clock)
    assert r is not None
    removed = [e for e in r.kv_events if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved(block_hashes=(h1,))]
    assert c.kv.pool.cached_external_hashes() >= {h0}


def test_a_preempted_sequence_finds_its_own_blocks_again() -> None:
    # 8 usable blocks of 4. Two sequences of 12 tokens (3 blocks each) decode until the
    # pool is short; the newest is preempted, and when readmitted it hits the blocks it
    # cached before (counted apart, as vLLM's preempted stats).
    c = core(blocks=9)
    add(c, [1] * 12, out=8)
    b = add(c, [2] * 12, out=8)
    drain(c)
    assert b.num_preemptions >= 1 and b.finish_reason == "length"
    s = c.kv.stats
    assert s.requests == 2 and s.preempted_requests >= 1 and s.preempted_hits > 0
    assert c.used_blocks == 0
    c.kv.check()


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "add", "add", "step", "step", "abort"]),
            st.integers(0, 3),  # which shared prefix
            st.integers(1, 30),  # own suffix length
            st.integers(1, 12),  # output tokens
        ),
        min_size=1,
        max_size=60,
    ),
    blocks=st.integers(6, 24),
)
def test_blocks_are_never_leaked_or_double_freed(
    ops: list[tuple[str, int, int, int]], blocks: int
) -> None:
    c = core(blocks=blocks, events=True)
    prefixes = [[p] * (4 * p + 3) for p in range(4)]
    seqs: list[Sequence] = []
    for n, (op, prefix, suffix, out) in enumerate(ops):
        if op == "add":
            ids = prefixes[prefix] + [1000 + n] * suffix
            if len(ids) + out - 1 <= 256:
                seqs.append(add(c, ids, out))
        elif op == "step":
            c.step(c.clock)
        elif seqs:
            c.abort(seqs[prefix % len(seqs)], c.clock)
        c.kv.check()
    for seq in seqs:
        if seq.num_tokens > (blocks - 1) * 4:
            c.abort(seq, c.clock)  # bigger than the pool: would stall forever
    for _ in range(5_000):
        if not c.has_work():
            break
        if c.step(c.clock) is None:
            break
        c.kv.check()
    for seq in list(c.waiting) + list(c.running):
        c.abort(seq, c.clock)
    c.kv.check()
    assert c.free_blocks == c.config.usable_blocks
    assert all(b.ref_cnt == 0 for b in c.kv.pool.blocks[1:])


def test_pool_refuses_to_free_a_block_twice() -> None:
    pool = BlockPool(4, enable_caching=True, enable_events=False)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    try:
        pool.free_blocks([block])
    except AssertionError:
        pass
    else:
        raise AssertionError("a double free went unnoticed")


def test_a_waiting_head_looked_up_every_step_is_counted_once() -> None:
    # vLLM records prefix-cache stats at admission, and so does the simulator: counting
    # every lookup of a head blocked for lack of blocks would make 31 "requests" of 2 and
    # inflate the hit rate.
    c = core(21)
    prefix = list(range(100, 140))  # 10 blocks
    add(c, [*prefix, 1], 30)
    c.step(0.0)
    add(c, prefix + [2] * 40, 1)  # hits 10 blocks, needs 10 more: waits for the first
    drain(c)
    s = c.kv.stats
    assert (s.requests, s.queries, s.hits) == (2, 41 + 80, 40)


def test_the_first_blocks_parent_is_vllms_none_hash(monkeypatch) -> None:
    """vLLM >= 0.30 seeds NONE_HASH with PYTHONHASHSEED, else "vllm-none-hash" (sha256,
    its default hash); the simulator seeds it the same way, or no event hash would match
    a real node's."""
    import hashlib
    import pickle

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    want = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL))
    assert none_hash(None) == want.digest()
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert none_hash(None) == hashlib.sha256(pickle.dumps("0", protocol=5)).digest()


def test_hash_seed_setting_is_the_nodes_pythonhashseed(monkeypatch) -> None:
    """``hash_seed`` seeds NONE_HASH as the node's PYTHONHASHSEED would, whatever this
    process's own: a simulated twin of a node started with PYTHONHASHSEED=0 stores the
    same block hashes for the same tokens."""
    import dataclasses

    from kvgateway.simulator.engine import EngineCore
    from kvgateway.simulator.profiles import TINY

    def first_hashes(engine: EngineCore) -> list[bytes]:
        seq = engine.add(
            target_tokens=1,
            target_reason="length",
            arrival=0.0,
            prompt_token_ids=list(range(100, 140)),
        )
        engine.step(0.0)
        return seq.block_hashes[:2]

    monkeypatch.setenv("PYTHONHASHSEED", "7")
    twin = first_hashes(EngineCore(dataclasses.replace(TINY, hash_seed="0").engine_config()))
    other = first_hashes(EngineCore(TINY.engine_config()))
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert twin == first_hashes(EngineCore(TINY.engine_config())) != other
    assert len(twin) == 2
