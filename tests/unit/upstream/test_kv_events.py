"""KV events: vLLM's wire format, a real ZMQ subscriber fed by a simulated node, resyncs,
catching up from the replay socket, a publisher that connects, and what is counted."""

from __future__ import annotations

import asyncio
import logging
import textwrap
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import msgspec
import pytest
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from kvgateway.config.load import parse_config_text
from kvgateway.config.yamlread import ConfigError
from kvgateway.core.cache_view import AllCleared, BlocksRemoved, BlocksStored
from kvgateway.core.prefix_index import PrefixIndex
from kvgateway.core.prefix_keys import block_keys
from kvgateway.server.telemetry import GatewayMetrics
from kvgateway.simulator.block_pool import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    hash_block_tokens,
)
from kvgateway.simulator.engine import EngineConfig, EngineCore
from kvgateway.simulator.kv_events import encode_batch
from kvgateway.simulator.tokenizer import ChatMessage
from kvgateway.upstream.kv_event_decode import (
    EventCount,
    EventDecodeError,
    SeqAction,
    classify_seq,
    decode_batch,
    replay_reply,
)
from kvgateway.upstream.kv_events import (
    KVEventHub,
    KVEventSource,
    KVEventSubscriber,
    kv_event_sources,
)
from tests.support.eventually import eventually
from tests.support.live import free_ports
from tests.support.sim import SimClient, SimFactory, chat

# vLLM's event structs as its source declares them (vllm/distributed/kv_events.py), in
# both layouts its events have shipped (array-like before 0.27, tagged maps since; the
# batch is array-like in both): used only to check our bytes against msgspec's.


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


def _stored_fields() -> dict[str, Any]:
    return {
        "__annotations__": {
            "block_hashes": list[int],
            "parent_block_hash": int | None,
            "token_ids": list[int],
            "block_size": int,
            "lora_id": int | None,
            "medium": str | None,
            "lora_name": str | None,
            "extra_keys": list[Any] | None,
            "group_idx": int | None,
            "kv_cache_spec_kind": str | None,
            "kv_cache_spec_sliding_window": int | None,
        },
        "extra_keys": None,
        "group_idx": None,
        "kv_cache_spec_kind": None,
        "kv_cache_spec_sliding_window": None,
    }


def _removed_fields() -> dict[str, Any]:
    return {
        "__annotations__": {
            "block_hashes": list[int],
            "medium": str | None,
            "group_idx": int | None,
        },
        "group_idx": None,
    }


MapStored = type("BlockStored", (MapEvent,), _stored_fields())
MapRemoved = type("BlockRemoved", (MapEvent,), _removed_fields())
MapCleared = type("AllBlocksCleared", (MapEvent,), {})
ArrayStored = type("BlockStored", (ArrayEvent,), _stored_fields())
ArrayRemoved = type("BlockRemoved", (ArrayEvent,), _removed_fields())
ArrayCleared = type("AllBlocksCleared", (ArrayEvent,), {})

EVENTS = (
    BlockStored(block_hashes=(11, 12), parent_block_hash=None, token_ids=(1,) * 8, block_size=4),
    BlockStored(block_hashes=(13,), parent_block_hash=12, token_ids=(2,) * 4, block_size=4),
    # A hybrid model's sliding-window group (vLLM names every event's group).
    BlockStored((11,), None, (1,) * 4, 4, group_idx=1, sliding_window=128),
    BlockRemoved(block_hashes=(11,)),
    BlockRemoved(block_hashes=(11,), group_idx=1),
    AllBlocksCleared(),
)


def _vllm_bytes(array_like: bool) -> bytes:
    stored, removed, cleared = (
        (ArrayStored, ArrayRemoved, ArrayCleared)
        if array_like
        else (MapStored, MapRemoved, MapCleared)
    )

    def extra(n: int) -> list[None] | None:  # since 0.27: one entry per block
        return None if array_like else [None] * n

    full = (0, "full_attention", None)  # group_idx, kind, window
    events = [
        stored([11, 12], None, [1] * 8, 4, None, "GPU", None, extra(2), *full),
        stored([13], 12, [2] * 4, 4, None, "GPU", None, extra(1), *full),
        stored([11], None, [1] * 4, 4, None, "GPU", None, extra(1), 1, "sliding_window", 128),
        removed([11], "GPU", 0),
        removed([11], "GPU", 1),
        cleared(),
    ]
    return msgspec.msgpack.encode(ArrayBatch(1.5, events, 0))


@pytest.mark.parametrize("array_like", [False, True])
def test_simulator_payload_is_byte_identical_to_vllm_structs(array_like: bool) -> None:
    ours = encode_batch(EVENTS, 1.5, array_like=array_like)
    assert ours == _vllm_bytes(array_like)
    # The batch is an array in every release (vLLM's EventBatch is array_like).
    assert ours[0] == 0x93
    decoded = decode_batch(ours)
    assert decoded.ts == 1.5 and decoded.data_parallel_rank == 0

    def extra(n: int) -> tuple[None, ...] | None:
        return None if array_like else (None,) * n

    assert decoded.events == (
        BlocksStored((11, 12), None, (1,) * 8, 4, "GPU", extra(2), 0, "full_attention"),
        BlocksStored((13,), 12, (2,) * 4, 4, "GPU", extra(1), 0, "full_attention"),
        BlocksStored((11,), None, (1,) * 4, 4, "GPU", extra(1), 1, "sliding_window", 128),
        BlocksRemoved((11,), "GPU", 0),
        BlocksRemoved((11,), "GPU", 1),
        AllCleared(),
    )


def test_decoder_reads_optional_vllm_fields_and_old_five_field_events() -> None:
    payload = msgspec.msgpack.encode(
        ArrayBatch(
            2.0,
            [MapStored([5], None, [3] * 4, 4, None, "GPU", "lora", [["lora", "salt"]], 0)],
        )
    )
    (event,) = decode_batch(payload).events
    assert isinstance(event, BlocksStored)
    assert event.extra_keys == (("lora", "salt"),) and event.group_idx == 0
    old = msgspec.msgpack.encode([3.0, [["BlockStored", [9], None, [4] * 4, 4, None]]])
    (event,) = decode_batch(old).events
    assert isinstance(event, BlocksStored) and event.medium is None


@pytest.mark.parametrize(
    ("last", "seq", "action"),
    [
        (None, 0, SeqAction.APPLY),
        (None, 5, SeqAction.GAP),
        (4, 5, SeqAction.APPLY),
        (4, 7, SeqAction.GAP),
        (9, 0, SeqAction.RESTART),
        (9, 3, SeqAction.DUPLICATE),
    ],
)
def test_sequence_numbers(last: int | None, seq: int, action: SeqAction) -> None:
    assert classify_seq(last, seq) is action


def frames(seq: int, *events: Any) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), encode_batch(events, 0.0)]


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)  # term() would wait forever for a socket a failed test left open


async def test_a_lost_batch_without_replay_resyncs_the_backend(
    zctx: zmq.asyncio.Context,
) -> None:
    index = PrefixIndex(resync_grace_s=0.0)
    counts: Counter[tuple[str, EventCount]] = Counter()
    sub = KVEventSubscriber(
        KVEventSource("n", "tcp://127.0.0.1:1"), index, zctx, tally=lambda *k: counts.update([k])
    )
    a, b, c = ([i] * 4 for i in (1, 2, 3))
    await sub.handle(frames(0, BlockStored((1,), None, tuple(a), 4)))
    await sub.handle(frames(1, BlockStored((2,), None, tuple(b), 4)))
    assert index.precise_keys("n") == set(block_keys(a, 4) + block_keys(b, 4))
    await sub.handle(frames(3, BlockStored((3,), None, tuple(c), 4)))  # batch 2 was lost
    assert index.precise_keys("n") == set(block_keys(c, 4))
    stats = sub.statistics()
    assert (stats.gaps, stats.resyncs, stats.last_seq) == (1, 1, 3)
    await sub.handle(frames(3, BlockRemoved((3,))))  # a duplicate: ignored
    assert index.precise_keys("n") == set(block_keys(c, 4))
    await sub.handle(frames(0, BlockStored((1,), None, tuple(a), 4)))  # publisher restart
    assert index.precise_keys("n") == set(block_keys(a, 4)) and sub.statistics().resyncs == 2
    await sub.handle([b"kv", b"short", b""])
    assert sub.statistics().decode_errors == 1
    # Every live message counted, the gap, the broken frame; no replay without a socket.
    assert counts == {
        ("n", EventCount.BATCHES): 6,
        ("n", EventCount.GAPS): 1,
        ("n", EventCount.DECODE_ERRORS): 1,
    }


def node_cached_prefix(core: EngineCore, ids: list[int]) -> int:
    """Leading blocks of ``ids`` the node holds, from its own block pool."""
    pool, bs, n = core.kv.pool, core.config.block_size, 0
    parent = None
    for i in range(len(ids) // bs):
        parent = hash_block_tokens(core.kv._root, parent, ids[i * bs : (i + 1) * bs])
        if pool.get_cached_block(parent, 0) is None:
            break
        n += 1
    return n


async def _events_node(sim: SimFactory) -> SimClient:
    return await sim(
        num_gpu_blocks=40,
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
        kv_events_topic="kv",
    )


async def test_subscriber_state_matches_the_nodes_own_cache(
    sim: SimFactory, zctx: zmq.asyncio.Context
) -> None:
    node = await _events_node(sim)
    publisher = node.node.publisher
    assert publisher is not None and publisher.endpoint and publisher.replay_endpoint
    index = PrefixIndex()
    source = KVEventSource("sim", publisher.endpoint, "kv", publisher.replay_endpoint)
    sub = KVEventSubscriber(source, index, zctx)
    sub.start()
    try:
        await asyncio.wait_for(sub.connected.wait(), 5.0)
        system = "You are a careful assistant. " * 12
        prompts = [
            [ChatMessage("system", system), ChatMessage("user", f"question {i} " * (40 + 10 * i))]
            for i in range(6)
        ]
        for i, messages in enumerate(prompts):
            body = {
                "model": node.node.settings.model,
                "messages": [{"role": m.role, "content": m.text} for m in messages],
                "max_tokens": 8 + i,
            }
            status, _ = await node.post("/v1/chat/completions", body)
            assert status == 200
        await node.wait_idle()
        core = node.node.driver.core
        await eventually(
            lambda: index.precise_engine_hashes("sim") == core.kv.pool.cached_external_hashes()
        )
        assert publisher.next_seq > 0
        # 40 blocks cannot hold every prompt: some blocks were evicted and reported so.
        assert index.statistics("sim", now=0.0).removed > 0
        bs = node.node.settings.block_size
        for messages in prompts:
            ids = node.node.tokenizer.encode_chat(messages)
            assert index.matched_blocks("sim", block_keys(ids, bs), now=0.0) == (
                node_cached_prefix(core, ids)
            )
        assert sub.statistics().decode_errors == 0
    finally:
        await sub.close()


async def test_a_gap_is_filled_from_the_nodes_replay_socket(
    sim: SimFactory, zctx: zmq.asyncio.Context
) -> None:
    node = await _events_node(sim)
    publisher = node.node.publisher
    assert publisher is not None and publisher.endpoint and publisher.replay_endpoint
    for i in range(3):
        status, _ = await node.post("/v1/chat/completions", chat(f"prompt number {i} " * 8))
        assert status == 200
    await node.wait_idle()
    assert publisher.next_seq >= 3
    index = PrefixIndex()
    source = KVEventSource("sim", "tcp://127.0.0.1:1", "kv", publisher.replay_endpoint)
    counts: Counter[EventCount] = Counter()
    sub = KVEventSubscriber(source, index, zctx, tally=lambda _, what: counts.update([what]))
    # Nothing seen yet and batch N arrives: 0..N-1 come from the replay socket.
    last = publisher.next_seq - 1
    await sub.handle(frames(last + 1, AllBlocksCleared()))
    stats = sub.statistics()
    assert (stats.gaps, stats.replayed, stats.resyncs) == (1, last + 1, 0)
    assert counts == {
        EventCount.BATCHES: 1,  # the live one; replayed batches are not counted as received
        EventCount.GAPS: 1,
        EventCount.REPLAYS_ASKED: 1,
        EventCount.REPLAYS_ANSWERED: 1,
    }
    # Replay from a start the buffer still holds works too; a cleared cache is empty.
    assert index.precise_keys("sim") == frozenset()


async def test_a_disconnect_resyncs(sim: SimFactory, zctx: zmq.asyncio.Context) -> None:
    node = await _events_node(sim)
    publisher = node.node.publisher
    assert publisher is not None and publisher.endpoint
    index = PrefixIndex()
    sub = KVEventSubscriber(KVEventSource("sim", publisher.endpoint, "kv"), index, zctx)
    sub.start()
    try:
        await asyncio.wait_for(sub.connected.wait(), 5.0)
        await publisher.close()
        await eventually(lambda: sub.statistics().resyncs >= 1)
        assert not sub.connected.is_set()
    finally:
        await sub.close()


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "step", "step", "abort"]),
            st.integers(0, 3),
            st.integers(1, 40),
            st.integers(1, 10),
            st.booleans(),
        ),
        min_size=1,
        max_size=50,
    ),
    array_like=st.booleans(),
)
def test_events_keep_the_index_equal_to_the_engines_cache(
    ops: list[tuple[str, int, int, int, bool]], array_like: bool
) -> None:
    c = EngineCore(
        EngineConfig(
            num_gpu_blocks=24,
            block_size=4,
            max_model_len=512,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            enable_kv_events=True,
        )
    )
    index = PrefixIndex()
    prefixes = [[100 + p] * (5 * p + 2) for p in range(4)]
    prompts: list[list[int]] = []
    seqs = []

    def publish(r: Any) -> None:
        if r is not None and r.kv_events:
            batch = decode_batch(encode_batch(r.kv_events, 0.0, array_like=array_like))
            index.apply_events("n", batch.events, now=0.0)

    for n, (op, prefix, own, out, _) in enumerate(ops):
        if op == "add":
            ids = prefixes[prefix] + [n] * own
            if len(ids) <= 80:
                prompts.append(ids)
                seqs.append(
                    c.add(
                        prompt_token_ids=ids, target_tokens=out, target_reason="length", arrival=0.0
                    )
                )
        elif op == "step":
            publish(c.step(c.clock))
        elif seqs:
            c.abort(seqs[prefix % len(seqs)], c.clock)
        assert index.precise_engine_hashes("n") == c.kv.pool.cached_external_hashes()
        for ids in prompts[-3:]:
            assert index.matched_blocks("n", block_keys(ids, 4), now=0.0) == (
                node_cached_prefix(c, ids)
            )
    assert index.statistics("n", now=0.0).orphans == 0


async def test_hub_subscribes_and_detaches_backends(sim: SimFactory) -> None:
    node = await _events_node(sim)
    publisher = node.node.publisher
    assert publisher is not None and publisher.endpoint
    index = PrefixIndex()
    hub = KVEventHub(index)
    source = KVEventSource("sim", publisher.endpoint, "kv")
    try:
        await hub.sync([source])
        sub = hub.subscriber("sim")
        assert sub is not None
        await asyncio.wait_for(sub.connected.wait(), 5.0)
        assert index.is_precise("sim", now=0.0)
        await hub.sync([])
        assert hub.subscriber("sim") is None and not index.is_precise("sim", now=0.0)
    finally:
        await hub.close()


# -- malformed events: a bad batch resyncs the backend, the reader lives on ------------


def _stored(h: int, parent: int | None, tokens: list[int], **over: Any) -> dict[str, Any]:
    event = {
        "type": "BlockStored",
        "block_hashes": [h],
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return event | over


def _payload(*events: Any) -> bytes:
    return msgspec.msgpack.encode({"ts": 1.0, "events": list(events), "data_parallel_rank": 0})


@pytest.mark.parametrize(
    "bad",
    [
        {"block_size": 0},
        {"block_size": -4},
        {"block_size": True},
        {"block_size": "4"},
        {"token_ids": [2**64 - 1] * 4},
        {"token_ids": [2**63] * 4},
        {"token_ids": [1, 2, 3, 4.5]},
        {"token_ids": "abcd"},
        {"block_hashes": 7},
        {"block_hashes": [1.5]},
        {"parent_block_hash": [1]},
        {"extra_keys": [1]},
        {"medium": 5},
        {"group_idx": "0"},
    ],
)
def test_decoder_rejects_events_the_index_cannot_hold(bad: dict[str, Any]) -> None:
    with pytest.raises(EventDecodeError, match="malformed BlockStored"):
        decode_batch(_payload(_stored(1, None, [1, 2, 3, 4], **bad)))


def test_decoder_accepts_the_edges_of_what_the_index_can_hold() -> None:
    top = [2**63 - 1, -(2**63), 0, 1]
    (event,) = decode_batch(_payload(_stored(2**64 - 1, -(2**63), top, block_size=1))).events
    assert isinstance(event, BlocksStored) and event.token_ids == tuple(top)
    with pytest.raises(EventDecodeError, match="malformed BlockRemoved"):
        decode_batch(_payload({"type": "BlockRemoved", "block_hashes": "ab", "medium": "GPU"}))


class _Publisher:
    """A real vLLM-like ZMQ publisher on loopback. XPUB, so a test can wait for the
    subscription to arrive instead of losing its first batches to PUB's slow joiner."""

    def __init__(
        self, ctx: zmq.asyncio.Context, topic: bytes = b"kv", host: str = "127.0.0.1"
    ) -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IPV6, 1)
        self.sock.bind(f"tcp://{host}:*")
        # pyzmq types getsockopt int | bytes; LAST_ENDPOINT is a bytes option.
        self.endpoint: str = cast(bytes, self.sock.getsockopt(zmq.LAST_ENDPOINT)).decode()
        self.topic = topic
        self.seq = 0

    async def subscribed(self) -> None:
        msg = await asyncio.wait_for(self.sock.recv(), 5.0)
        assert msg == b"\x01" + self.topic

    async def send(self, *events: Any) -> None:
        frames = [self.topic, self.seq.to_bytes(8, "big"), _payload(*events)]
        await self.sock.send_multipart(frames)
        self.seq += 1


@pytest.fixture
async def publisher(zctx: zmq.asyncio.Context) -> AsyncIterator[Callable[[], _Publisher]]:
    """Publishers closed at teardown whatever the test did (zctx.term() waits for them)."""
    made: list[_Publisher] = []

    def make() -> _Publisher:
        made.append(_Publisher(zctx))
        return made[-1]

    yield make
    for pub in made:
        pub.sock.close(linger=0)


@pytest.mark.parametrize(
    "bad",
    [{"block_size": 0}, {"token_ids": [2**64 - 1] * 4}],
    ids=["block_size_0", "token_2_64_minus_1"],
)
async def test_a_malformed_event_resyncs_and_the_subscriber_lives_on(
    zctx: zmq.asyncio.Context,
    publisher: Callable[[], _Publisher],
    bad: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    pub = publisher()
    index = PrefixIndex(resync_grace_s=0.0)
    sub = KVEventSubscriber(KVEventSource("n", pub.endpoint, "kv"), index, zctx)
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    sub.start()
    try:
        await pub.subscribed()
        await pub.send(_stored(1, None, a))
        await eventually(lambda: index.precise_keys("n") == set(block_keys(a, 4)))
        await pub.send(_stored(2, 1, b, **bad))  # malformed: the view can no longer be trusted
        await eventually(lambda: sub.statistics().last_seq == 1)
        assert index.precise_keys("n") == frozenset()
        await pub.send(_stored(3, None, b))
        await pub.send(_stored(4, 3, c))
        await pub.send({"type": "BlockRemoved", "block_hashes": [99], "medium": "GPU"})
        await eventually(lambda: sub.statistics().last_seq == 4)
        assert index.precise_keys("n") == set(block_keys(b + c, 4))
        stats = sub.statistics()
        assert (stats.batches, stats.decode_errors, stats.resyncs) == (4, 1, 1)
        assert index.statistics("n", now=0.0).resyncs == 1
        assert "resync (undecodable batch 1: malformed BlockStored" in caplog.text
        await pub.send({"type": "AllBlocksCleared"})
        await eventually(lambda: index.precise_keys("n") == frozenset())
    finally:
        await sub.close()  # must not raise


async def test_malformed_batches_are_logged_at_a_bounded_rate(
    zctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    now = [0.0]
    index = PrefixIndex(resync_grace_s=0.0)
    source = KVEventSource("n", "tcp://127.0.0.1:1")
    sub = KVEventSubscriber(source, index, zctx, clock=lambda: now[0], error_log_interval_s=10.0)
    bad = _payload(_stored(1, None, [1] * 4, block_size=0))
    for seq in range(5):
        await sub.handle([b"kv", seq.to_bytes(8, "big"), bad])
        now[0] += 1.0
    assert sub.statistics().decode_errors == 5 and sub.statistics().resyncs == 5
    lines = [r.getMessage() for r in caplog.records if "undecodable" in r.getMessage()]
    assert len(lines) == 1
    now[0] = 20.0
    await sub.handle([b"kv", (5).to_bytes(8, "big"), bad])
    lines = [r.getMessage() for r in caplog.records if "undecodable" in r.getMessage()]
    assert len(lines) == 2 and "4 more like it not logged" in lines[1]


class _FlakyIndex(PrefixIndex):
    """An index that fails in ways nobody foresaw: applying a batch holding block hash
    666, and clearing the view of backend ``bad``."""

    def apply_events(self, backend: str, events: Any, now: float) -> None:
        events = tuple(events)
        super().apply_events(backend, events, now)
        if any(isinstance(e, BlocksStored) and 666 in e.block_hashes for e in events):
            raise RuntimeError("unforeseen")

    def clear(self, backend: str, now: float) -> None:
        if backend == "bad":
            raise RuntimeError("clear failed")
        super().clear(backend, now)


async def test_a_batch_that_fails_to_apply_resyncs_and_the_subscriber_lives_on(
    zctx: zmq.asyncio.Context, publisher: Callable[[], _Publisher]
) -> None:
    pub = publisher()
    index = _FlakyIndex(resync_grace_s=0.0)
    sub = KVEventSubscriber(KVEventSource("n", pub.endpoint, "kv"), index, zctx)
    a, b = [1] * 4, [2] * 4
    sub.start()
    try:
        await pub.subscribed()
        await pub.send(_stored(1, None, a))
        await pub.send(_stored(666, 1, b))  # half-applied, then fails
        await pub.send(_stored(2, None, b))
        await eventually(lambda: sub.statistics().last_seq == 2)
        assert index.precise_keys("n") == set(block_keys(b, 4))
        stats = sub.statistics()
        assert (stats.apply_errors, stats.decode_errors, stats.resyncs) == (1, 0, 1)
    finally:
        await sub.close()


async def test_close_does_not_raise_a_failed_tasks_exception(
    zctx: zmq.asyncio.Context,
    publisher: Callable[[], _Publisher],
    caplog: pytest.LogCaptureFixture,
) -> None:
    pub = publisher()
    sub = KVEventSubscriber(KVEventSource("bad", pub.endpoint, "kv"), _FlakyIndex(), zctx)
    sub.start()
    try:
        await pub.subscribed()
        await asyncio.wait_for(sub.connected.wait(), 5.0)
        pub.sock.close(linger=0)  # the disconnect's resync fails: the monitor task dies
        await eventually(lambda: not sub.connected.is_set())
        await asyncio.sleep(0)
    finally:
        await sub.close()
    assert "had failed" in caplog.text and "clear failed" in caplog.text


async def test_hub_closes_every_subscriber_even_after_one_failed(
    publisher: Callable[[], _Publisher],
) -> None:
    bad, good = publisher(), publisher()
    hub = KVEventHub(_FlakyIndex())
    try:
        await hub.sync(
            [KVEventSource("bad", bad.endpoint, "kv"), KVEventSource("good", good.endpoint, "kv")]
        )
        await bad.subscribed()
        await good.subscribed()
        bad_sub = hub.subscriber("bad")
        assert bad_sub is not None
        await asyncio.wait_for(bad_sub.connected.wait(), 5.0)
        bad.sock.close(linger=0)
        await eventually(lambda: not bad_sub.connected.is_set())
        await asyncio.sleep(0)
    finally:
        await hub.close()  # must not raise, and must close "good" too
    # The good subscriber's socket went away: its publisher sees the unsubscription.
    assert await asyncio.wait_for(good.sock.recv(), 5.0) == b"\x00kv"
    assert hub.subscriber("good") is None


async def test_a_publisher_on_an_ipv6_address_is_subscribed_to(zctx: zmq.asyncio.Context) -> None:
    """A DNS member with an IPv6 address subscribes at tcp://[addr]:PORT and hears its
    events: libzmq ignores that endpoint without its IPv6 option, and would never
    deliver them."""
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    pub = _Publisher(zctx, host="[::1]")
    index = PrefixIndex(resync_grace_s=0.0)
    assert pub.endpoint.startswith("tcp://[::1]:")
    sub = KVEventSubscriber(KVEventSource("n", pub.endpoint, "kv"), index, zctx)
    a = [5] * 4
    sub.start()
    try:
        await pub.subscribed()
        await pub.send(_stored(1, None, a))
        await eventually(lambda: index.precise_keys("n") == set(block_keys(a, 4)))
    finally:
        await sub.close()
        pub.sock.close(linger=0)


# -- replay at every link, a publisher that connects, silence, counters, config ---------


def test_replay_replies_in_both_layouts() -> None:
    seq = (7).to_bytes(8, "big")
    end = (-1).to_bytes(8, "big", signed=True)
    assert replay_reply([b"", b"kv", seq, b"p"]) == (7, b"p")  # vLLM >= 0.27
    assert replay_reply([b"", seq, b"p"]) == (7, b"p")
    assert replay_reply([b"", b"", end, b""]) == (-1, b"")
    assert replay_reply([b"", b"short", b"p"]) is None
    assert replay_reply([b"", seq]) is None


async def test_a_subscriber_starting_beside_a_serving_node_learns_its_cache_by_replay(
    sim: SimFactory, zctx: zmq.asyncio.Context
) -> None:
    """A gateway that (re)starts, or a replica that joins, while the node already holds
    prompts: no new batch tells it what the node holds, the replay socket does, and the
    node's prefixes draw their follow-ups from the start."""
    node = await _events_node(sim)
    publisher = node.node.publisher
    assert publisher is not None and publisher.endpoint and publisher.replay_endpoint
    for i in range(4):
        status, _ = await node.post("/v1/chat/completions", chat(f"held before {i} " * 30))
        assert status == 200
    await node.wait_idle()
    core = node.node.driver.core
    assert core.kv.pool.cached_external_hashes()
    index = PrefixIndex()
    source = KVEventSource("sim", publisher.endpoint, "kv", publisher.replay_endpoint)
    sub = KVEventSubscriber(source, index, zctx)
    sub.start()
    try:
        await eventually(
            lambda: index.precise_engine_hashes("sim") == core.kv.pool.cached_external_hashes()
        )
        stats = sub.statistics()  # what it knows came by replay, from batch 0 on
        assert stats.replayed == publisher.next_seq and stats.resyncs == 0
        # The live stream carries on from there.
        status, _ = await node.post("/v1/chat/completions", chat("held after " * 30))
        assert status == 200
        await node.wait_idle()
        await eventually(
            lambda: index.precise_engine_hashes("sim") == core.kv.pool.cached_external_hashes()
        )
        assert sub.statistics().gaps == 0
    finally:
        await sub.close()


async def test_a_bound_subscriber_hears_a_publisher_that_connects(
    zctx: zmq.asyncio.Context,
) -> None:
    """vLLM connects its publisher when its endpoint names a host (tcp://10.0.0.5:5557);
    a gateway that connects too hears nothing. kv_events_bind: the gateway binds."""
    (port,) = free_ports(1)
    endpoint = f"tcp://127.0.0.1:{port}"
    index = PrefixIndex()
    sub = KVEventSubscriber(KVEventSource("n", endpoint, "kv", bind=True), index, zctx)
    sub.start()
    pub = zctx.socket(zmq.XPUB)
    try:
        pub.setsockopt(zmq.LINGER, 0)
        pub.connect(endpoint)  # as vLLM's ZmqEventPublisher does with a concrete host
        assert await asyncio.wait_for(pub.recv(), 5.0) == b"\x01kv"  # subscribed
        await asyncio.wait_for(sub.connected.wait(), 5.0)
        a = [3] * 4
        await pub.send_multipart([b"kv", (0).to_bytes(8, "big"), _payload(_stored(1, None, a))])
        await eventually(lambda: index.precise_keys("n") == set(block_keys(a, 4)))
    finally:
        pub.close(linger=0)
        await sub.close()


async def test_a_node_sent_prompts_without_a_batch_back_is_warned_about(
    zctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    now = [0.0]
    index = PrefixIndex()
    source = KVEventSource("n", "tcp://10.0.0.5:5557")
    sub = KVEventSubscriber(source, index, zctx, clock=lambda: now[0], silence_s=30.0)
    index.attach_events("n")
    caplog.set_level(logging.WARNING)
    assert not sub.check_silence()  # nothing sent there: nothing awaited
    index.record_routed("n", block_keys(list(range(16)), 4), now=10.0)
    now[0] = 39.0
    assert not sub.check_silence()
    now[0] = 40.0
    assert sub.check_silence() and sub.check_silence()
    lines = [r.getMessage() for r in caplog.records if "no batch in" in r.getMessage()]
    assert len(lines) == 1  # at a bounded rate
    assert "connected to tcp://10.0.0.5:5557, no peer connected" in lines[0]
    assert "kv_events_bind" in lines[0]
    await sub.handle(frames(0, AllBlocksCleared()))  # a batch: the stream is heard
    assert not sub.check_silence()


def test_counters_are_the_gateways_metrics_per_backend() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    for what in (EventCount.BATCHES, EventCount.BATCHES, EventCount.REPLAYS_ASKED):
        metrics.count_kv_event("n", what)
    value = registry.get_sample_value
    assert value("gateway_kv_event_batches_total", {"backend": "n"}) == 2
    assert value("gateway_kv_event_replays_asked_total", {"backend": "n"}) == 1
    assert value("gateway_kv_event_gaps_total", {"backend": "n"}) is None
    metrics.forget_backends(set())
    metrics.forget_backends(set())  # gone twice: dropped
    assert value("gateway_kv_event_batches_total", {"backend": "n"}) is None


CONFIG = """
models:
  - {name: m, served_name: org/M}
tiers:
  - name: small
    backends:
      - {name: a, url: "http://127.0.0.1:9000", model: m, BACKEND}
"""


def _config(backend: str, rest: str = ""):
    return parse_config_text(CONFIG.replace("BACKEND", backend) + textwrap.dedent(rest))


def test_kv_events_bind_reaches_the_subscriber_and_may_name_every_interface() -> None:
    cfg = _config('kv_events: "tcp://*:5557", kv_events_bind: true')
    assert kv_event_sources(cfg) == [KVEventSource("a", "tcp://*:5557", bind=True)]
    cfg = _config('kv_events: "tcp://10.0.0.1:5557"')
    assert kv_event_sources(cfg) == [KVEventSource("a", "tcp://10.0.0.1:5557")]


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("kv_events_bind: true", "tiers[0].backends[0].kv_events_bind: needs kv_events"),
        ('kv_events: "tcp://*:5557"', "tiers[0].backends[0].kv_events: expected tcp://"),
        ('kv_events: "tcp://h:1", kv_events_bind: maybe', "backends[0].kv_events_bind: "),
    ],
)
def test_kv_events_bind_errors_name_the_path(backend: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(backend)
    assert message in str(err.value)


def test_a_dns_group_cannot_bind_one_address_for_all_its_members() -> None:
    text = CONFIG.replace(
        '{name: a, url: "http://127.0.0.1:9000", model: m, BACKEND}',
        '{name: g, dns: vllm.svc, model: m, kv_events: "tcp://vllm.svc:5557", '
        "kv_events_bind: true}",
    )
    with pytest.raises(ConfigError) as err:
        parse_config_text(text)
    assert "tiers[0].backends[0].kv_events_bind: a dns group's members" in str(err.value)


def _nested(depth: int) -> bytes:
    """A batch whose one event's extra keys hold lists nested ``depth`` deep."""
    head = msgspec.msgpack.encode([1.0, [_stored(2, None, [2] * 4, extra_keys=[0])]])
    assert head.endswith(b"\x91\x00")  # the last field: a one-element list holding 0
    return head[:-1] + b"\x91" * depth + b"\xc0"


async def test_a_batch_nested_past_any_vllm_layout_does_not_stop_the_reader(
    zctx: zmq.asyncio.Context, publisher: Callable[[], _Publisher]
) -> None:
    """A batch nested 600 deep is distrusted (the view resyncs) and the reader goes on
    reading: it never dies, leaving a stale view trusted as precise."""
    pub = publisher()
    index = PrefixIndex(resync_grace_s=0.0)
    sub = KVEventSubscriber(KVEventSource("n", pub.endpoint, "kv"), index, zctx)
    sub.start()
    try:
        await pub.subscribed()
        await pub.send(_stored(1, None, [1] * 4))
        await eventually(lambda: index.precise_keys("n") == set(block_keys([1] * 4, 4)))
        await pub.sock.send_multipart([b"kv", (1).to_bytes(8, "big"), _nested(600)])
        pub.seq = 2
        await pub.send(_stored(3, None, [3] * 4))
        await eventually(lambda: sub.statistics().last_seq == 2, timeout=2.0)
        assert index.precise_keys("n") == set(block_keys([3] * 4, 4))
    finally:
        await sub.close()


async def test_a_live_batch_before_the_catch_up_keeps_what_the_buffer_holds() -> None:
    """A node's replay buffer that no longer reaches batch 0 (vLLM keeps the last
    10,000): a live batch arriving before the link's catch-up applies what the buffer
    holds before it, as the catch-up would, not a resync that drops it all."""
    index = PrefixIndex(resync_grace_s=0.0)
    source = KVEventSource("n", "tcp://127.0.0.1:1", "kv", replay_endpoint="tcp://127.0.0.1:2")
    sub = KVEventSubscriber(source, index, zmq.asyncio.Context.instance())
    a, b = [1] * 4, [2] * 4
    buffer = [(20_000, _payload(_stored(1, None, a))), (20_001, _payload(_stored(2, 1, b)))]

    async def replay_socket(start: int, timeout_s: float) -> list[tuple[int, bytes]]:
        return [(seq, payload) for seq, payload in buffer if seq >= start]

    sub._fetch = replay_socket  # type: ignore[method-assign]
    await sub.handle([b"kv", (20_002).to_bytes(8, "big"), _payload(_stored(3, None, [3] * 4))])
    await sub.catch_up()
    assert set(block_keys(a + b, 4)) <= index.precise_keys("n")
