"""A hybrid (sliding-window + full attention) node: two KV-cache groups share one pool."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from kvgateway.capacity.layout import discovered_usable_tokens
from kvgateway.capacity.presets import preset_arch
from kvgateway.simulator.cost import CostModel
from kvgateway.simulator.engine import EngineConfig, EngineCore, SeqState, Sequence
from kvgateway.simulator.fleetconfig import node_spec
from kvgateway.simulator.profiles import get_profile
from kvgateway.simulator.server import create_node_app

COST = CostModel(
    step_overhead_s=0.001, weight_read_s=0.01, prefill_s_per_token=1e-4, kv_read_s_per_token=0.0
)


def core(
    windows: tuple[int | None, ...],
    blocks: int = 17,
    *,
    events: bool = False,
    mml: int = 256,
    seqs: int = 8,
    batch: int = 64,
) -> EngineCore:
    return EngineCore(
        EngineConfig(
            num_gpu_blocks=blocks,
            block_size=4,
            max_model_len=mml,
            max_num_seqs=seqs,
            max_num_batched_tokens=batch,
            cost=COST,
            kv_windows=windows,
            enable_kv_events=events,
        )
    )


def add(c: EngineCore, ids: list[int], out: int) -> Sequence:
    return c.add(prompt_token_ids=ids, target_tokens=out, target_reason="length", arrival=0.0)


def drain(c: EngineCore) -> None:
    for _ in range(10_000):
        if c.step(c.clock) is None:
            return
        c.kv.check()
    raise AssertionError("engine did not drain")


def test_every_group_takes_a_block_per_block_of_prompt() -> None:
    # 16 usable blocks of 4 and two groups: 32 tokens of short requests, not 64.
    c = core((None, 8))
    assert c.config.kv_tokens == 32
    first = add(c, [1] * 20, 4)
    second = add(c, [2] * 20, 4)
    c.step(c.clock)
    assert first.state is SeqState.RUNNING and first.num_blocks == 10
    # 6 blocks left: the second prompt (10 blocks) waits; a one-group pool would take it.
    assert second.state is SeqState.WAITING
    one = core((None,))
    a, b = add(one, [1] * 20, 4), add(one, [2] * 20, 4)
    one.step(one.clock)
    assert a.state is SeqState.RUNNING and b.state is SeqState.RUNNING


def test_sliding_window_blocks_leave_the_table_once_out_of_the_window() -> None:
    c = core((None, 8))
    seq = add(c, [3] * 20, 24)
    c.step(c.clock)  # the prompt: its blocks are dropped at the next allocation, as vLLM
    assert seq.num_blocks == 10
    for _ in range(24):
        c.step(c.clock)
        c.kv.check()
        if seq.state is SeqState.FINISHED:
            break
        full, sliding = c.kv.blocks_of(seq.seq_id)
        null = c.kv.pool.null_block
        live = [b for b in sliding if b is not null]
        # The window's last 7 tokens span at most 3 blocks, plus the block being written.
        assert len(full) == -(-seq.num_computed // 4) or len(full) == -(-seq.num_tokens // 4)
        assert len(live) <= 4, (seq.num_computed, len(live))
    drain(c)
    assert seq.finish_reason == "length" and c.used_blocks == 0


def test_decode_growth_preempts_on_the_hybrid_node_where_one_group_would_not() -> None:
    # Two requests of 12 + 20 tokens: the full-attention group alone needs 8 + 8 blocks,
    # all 16; the sliding-window group needs a few more, so the hybrid node preempts.
    hybrid = core((None, 8))
    for i in range(2):
        add(hybrid, [10 + i] * 12, 20)
    drain(hybrid)
    assert hybrid.num_preemptions > 0
    plain = core((None,))
    for i in range(2):
        add(plain, [10 + i] * 12, 20)
    drain(plain)
    assert plain.num_preemptions == 0


def test_a_hit_needs_the_window_blocks_cached_in_the_sliding_group() -> None:
    c = core((None, 8))
    add(c, list(range(16)), 1)
    drain(c)
    seq = add(c, [*range(16), 90, 91, 92, 93], 2)
    r = c.step(c.clock)
    # 20 tokens, at most 19 hit: 4 full blocks; the sliding group has the last
    # cdiv(8 - 1, 4) = 2 of them, so the hit stands and the slots before are null.
    assert r is not None and r.prefill_tokens == 4 and c.kv.stats.hits == 16
    full, sliding = c.kv.blocks_of(seq.seq_id)
    null = c.kv.pool.null_block
    assert [b is null for b in sliding[:4]] == [True, True, False, False]
    assert all(b is not null for b in full)
    c.kv.check()


def test_gateway_usable_tokens_for_a_hybrid_architecture() -> None:
    profile = get_profile("gpu24-gptoss-20b")
    arch = preset_arch("gpt-oss-20b")
    tokens = discovered_usable_tokens(profile.num_gpu_blocks, profile.block_size, arch)
    assert tokens == profile.kv_tokens == (21_110 - 1) // 2 * 16
    # Gemma 3 27B: 52 sliding + 10 full layers -> 7 groups of 10 layers.
    gemma = discovered_usable_tokens(21_110, 16, preset_arch("gemma-3-27b"))
    assert gemma == 21_109 // 7 * 16
    assert discovered_usable_tokens(21_110, 16) == 21_109 * 16


async def test_hybrid_node_reports_its_pool_blocks_and_group_capacity(aiohttp_client) -> None:
    spec = node_spec("gpu24-gptoss-20b", overrides={"num_gpu_blocks": 65, "max_model_len": 512})
    client: TestClient[web.Request, web.Application] = await aiohttp_client(
        create_node_app(spec.settings)
    )
    metrics = await (await client.get("/metrics")).text()
    info = next(line for line in metrics.splitlines() if line.startswith("vllm:cache_config_info"))
    assert 'num_gpu_blocks="65"' in info and 'sliding_window="128"' in info
    state = await (await client.get("/sim/state")).json()
    assert state["kv_tokens"] == 64 // 2 * 16


def test_groups_are_numbered_by_first_layer_and_events_name_their_group() -> None:
    # vLLM groups layers by spec in layer order: gpt-oss's layer 0 is sliding-window, so
    # that group is 0 and full attention is 1; every cache event says which it is.
    from kvgateway.capacity.layout import kv_layout
    from kvgateway.simulator.block_pool import BlockRemoved, BlockStored

    layout = kv_layout(preset_arch("gpt-oss-20b"), 1, "auto")
    assert [g.sliding_window for g in layout.groups] == [128, None]
    c = core((8, None), 17, events=True)
    seq = add(c, list(range(20)), 12)
    stored = []
    removed = []
    for _ in range(50):
        r = c.step(c.clock)
        if r is None:
            break
        stored += [e for e in r.kv_events if isinstance(e, BlockStored)]
        removed += [e for e in r.kv_events if isinstance(e, BlockRemoved)]
    assert seq.state is SeqState.FINISHED
    kinds = {(e.group_idx, e.kind, e.sliding_window) for e in stored}
    assert kinds == {(0, "sliding_window", 8), (1, "full_attention", None)}
    # Only the sliding-window group drops blocks while the request runs (out of window);
    # they are cached and free, not evicted, so nothing is removed yet.
    assert removed == []
    full_hashes = [h for e in stored if e.group_idx == 1 for h in e.block_hashes]
    assert len(full_hashes) == (20 + 12 - 1) // 4


def test_a_request_touches_every_groups_hits_before_taking_new_blocks() -> None:
    # The pool nearly full of cached blocks: a request hitting a 32-token prefix in both
    # groups touches all groups' hits first, as vLLM does; were its sliding-window group
    # (0) to take its new blocks first, it would pop and evict its own full-attention hits.
    c = core((8, None), 25, events=True)
    prefix = list(range(1000, 1032))  # 8 blocks
    add(c, prefix, 1)
    drain(c)
    c.add(prompt_token_ids=list(range(5000, 5016)), target_tokens=1, target_reason="length",
          arrival=c.clock)  # fmt: skip
    drain(c)
    c.kv.pool.take_events()
    b = c.add(prompt_token_ids=prefix + list(range(7000, 7028)), target_tokens=2,
              target_reason="length", arrival=c.clock)  # fmt: skip
    r = c.step(c.clock)
    assert r is not None
    own = {h for h in b.block_hashes[:8]}
    from kvgateway.simulator.block_pool import BlockRemoved, external_hash

    evicted = [e for e in r.kv_events if isinstance(e, BlockRemoved) and e.group_idx == 1]
    assert not [e for e in evicted if set(e.block_hashes) & {external_hash(h) for h in own}]
    sliding, full = c.kv.blocks_of(b.seq_id)
    null = c.kv.pool.null_block
    assert not ({id(x) for x in sliding} & {id(x) for x in full}) - {id(null)}
    c.kv.check()


def test_the_hybrid_profile_numbers_its_groups_as_vllm() -> None:
    settings = get_profile("gpu24-gptoss-20b")
    from kvgateway.capacity.layout import kv_layout

    layout = kv_layout(preset_arch("gpt-oss-20b"), 1, "auto")
    assert settings.kv_windows == tuple(g.sliding_window for g in layout.groups) == (128, None)


def test_a_preset_hybrid_node_has_its_sliding_window_group() -> None:
    # gateway simulate --preset gpt-oss-20b: two groups, as vLLM forms them; with one
    # full-attention group the node would hold twice the tokens a vLLM node holds.
    from kvgateway.simulator.sizing import ServeFlags, size_node

    node = size_node("gpt-oss-20b", 80, ServeFlags())
    assert node.settings.kv_windows == (128, None)
    assert node.settings.kv_tokens == (node.settings.num_gpu_blocks - 1) // 2 * 16


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_gateways_view_of_a_hybrid_node_predicts_its_prefix_hits(seed: int) -> None:
    # A hybrid node's events (sliding-window group 0, full attention 1), through the wire
    # format into the gateway's precise prefix view: before each request, the blocks the
    # view says it will hit are the blocks the node hits. Following only the full
    # group would over-predict (a hit also needs the window's blocks before its end).
    import random

    from kvgateway.core.prefix_index import PrefixIndex
    from kvgateway.core.prefix_keys import block_keys
    from kvgateway.simulator.kv_events import encode_batch
    from kvgateway.upstream.kv_event_decode import decode_batch

    rng = random.Random(seed)
    c = core((8, None), 120, events=True, mml=512, seqs=6, batch=32)
    index = PrefixIndex()
    prefixes = [list(range(1000 * k, 1000 * k + rng.randint(8, 60))) for k in range(1, 8)]
    wrong = 0
    for _ in range(150):
        ids = rng.choice(prefixes) + [rng.randint(1, 999) for _ in range(rng.randint(1, 20))]
        believed = index.matched_blocks("n", block_keys(ids, 4)[: (len(ids) - 1) // 4], c.clock)
        seq = add(c, ids, rng.randint(1, 6))
        _, hit = c.kv.get_computed_blocks(seq)
        wrong += believed * 4 != hit
        for _ in range(rng.randint(0, 4)):
            r = c.step(c.clock)
            if r is None:
                break
            if r.kv_events:
                index.apply_events(
                    "n", decode_batch(encode_batch(r.kv_events, r.end)).events, r.end
                )
    assert wrong == 0
