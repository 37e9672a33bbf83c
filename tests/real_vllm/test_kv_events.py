"""KV events from real vLLM nodes: the gateway reads them (live and replayed), its prefix
index holds what each node holds, and prefix-aware routing follows it.

Other clients may use the same nodes meanwhile: every prompt here is distinctive (a
fresh random seed), and a node's counters are compared as deltas: exactly across a
window in which the node looked up no prompt but ours, else as lower bounds.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import aiohttp
import pytest
import zmq.asyncio
from aiohttp.test_utils import TestServer

from kvgateway.config.load import parse_config
from kvgateway.core.prefix_index import PrefixIndex
from kvgateway.core.prefix_keys import block_keys
from kvgateway.core.prefix_routing import PrefixRouter
from kvgateway.server.app import KV_EVENTS, create_app
from kvgateway.upstream.kv_event_decode import EventCount
from kvgateway.upstream.kv_events import KVEventSource, KVEventSubscriber
from tests.support.eventually import eventually
from tests.support.real_fleet import (
    ENCODINGS,
    StartGateway,
    backend_entry,
    gateway_config,
    state_of,
)
from tests.support.vllm_nodes import CPU_BLOCK, RealNode, http_json, post_status

pytestmark = pytest.mark.real_vllm

WORDS = (
    "amber", "basil", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo",
    "juniper", "kestrel", "lagoon", "meadow", "nectar", "onyx", "prairie", "quartz", "raven",
)  # fmt: skip


def words(n: int) -> str:
    """``n`` random words after a fresh seed: blocks no other prompt shares."""
    seed = uuid.uuid4().hex
    rnd = random.Random(seed)
    return f"[{seed}] " + " ".join(rnd.choice(WORDS) for _ in range(n))


def chat(messages: list[dict[str, str]], max_tokens: int = 4) -> dict[str, Any]:
    return {"model": "qwen", "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def follow_up(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation one turn on (a fixed answer: the history is what the client sends)."""
    return [*messages, {"role": "assistant", "content": "Noted."}, user(words(60))]


async def node_ids(node: RealNode, messages: list[dict[str, str]]) -> list[int]:
    """The node's own token ids of a chat prompt (its /tokenize, with its template)."""
    body = {"model": "qwen", "messages": messages, "add_generation_prompt": True}
    doc = await asyncio.to_thread(http_json, node.url + "/tokenize", body)
    assert isinstance(doc, dict)
    return list(doc["tokens"])


async def post_node(node: RealNode, body: dict[str, Any]) -> None:
    status, doc = await asyncio.to_thread(post_status, node.url + "/v1/chat/completions", body)
    assert status == 200, doc


async def metric(node: RealNode, name: str) -> float:
    return await asyncio.to_thread(node.metric, name)


async def cache_counts(node: RealNode) -> tuple[float, float]:
    """(prompt tokens looked up, tokens found) in the node's prefix cache so far."""
    queries = await metric(node, "vllm:prefix_cache_queries_total")
    return queries, await metric(node, "vllm:prefix_cache_hits_total")


async def hit_alone(node: RealNode, messages: list[dict[str, str]], tokens: int) -> float | None:
    """Tokens the node took from its cache for this prompt (``tokens`` long), sent to it
    directly; None when another client's prompt was looked up in the same window."""
    q0, h0 = await cache_counts(node)
    await post_node(node, chat(messages))

    async def counted() -> tuple[float, float]:
        q, h = await cache_counts(node)
        assert q - q0 >= tokens, (q - q0, tokens)
        return q, h

    q1, h1 = await eventually(counted, timeout=10)
    return h1 - h0 if q1 - q0 == tokens else None


def one_tier(*nodes: RealNode, **sections: Any) -> dict[str, Any]:
    """A prefix-aware gateway with ``nodes`` in one tier (routing moves work within a tier):
    kv_aware alone sends every fresh prompt to the freest, L."""
    config = gateway_config(list(nodes), **sections)
    config["routing"] = {"policy": "kv_aware", "prefix_aware": True}
    config["tiers"] = [{"name": "pool", "backends": [backend_entry(n) for n in nodes]}]
    return config


async def ask(gw: TestServer, messages: list[dict[str, str]]) -> str:
    """The backend the gateway sent the chat to."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(gw.make_url("/v1/chat/completions"), json=chat(messages)) as resp,
    ):
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-gateway-backend"]


async def gateway_metrics(gw: TestServer) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(gw.make_url("/metrics")) as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("gateway_kv_event_"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def counted(doc: dict[str, float], what: EventCount, backend: str) -> float:
    return doc.get(f'gateway_kv_event_{what}_total{{backend="{backend}"}}', 0.0)


# -- decoding a real node's stream ------------------------------------------------------


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def test_live_events_and_the_replay_decode_into_what_the_node_holds(
    qwen_fleet: dict[str, RealNode], zctx: zmq.asyncio.Context
) -> None:
    """A subscriber reads node S's live batches without a decode error; a second one,
    never connected, rebuilds the same prompt's blocks from the replay socket alone."""
    node = qwen_fleet["S"]
    assert node.events_endpoint and node.replay_endpoint
    source = KVEventSource("S", node.events_endpoint, replay_endpoint=node.replay_endpoint)
    counts: dict[EventCount, int] = dict.fromkeys(EventCount, 0)

    def tally(backend: str, what: EventCount) -> None:
        assert backend == "S"
        counts[what] += 1

    live_index = PrefixIndex()
    live = KVEventSubscriber(source, live_index, zctx, tally=tally)
    live.start()
    try:
        await asyncio.wait_for(live.connected.wait(), 10)
        # The catch-up at start asked for (and got) the node's buffer.
        await eventually(lambda: counts[EventCount.REPLAYS_ANSWERED] >= 1, timeout=15)
        messages = [user(words(300))]
        ids = await node_ids(node, messages)
        keys = block_keys(ids, CPU_BLOCK)
        assert len(keys) >= 3
        await post_node(node, chat(messages))
        await eventually(
            lambda: live_index.matched_blocks("S", keys, now=0.0) == len(keys), timeout=10
        )
        assert counts[EventCount.BATCHES] >= 1
        assert counts[EventCount.DECODE_ERRORS] == live.statistics().decode_errors == 0
        assert live_index.event_block_size("S") == CPU_BLOCK

        replayed_index = PrefixIndex()
        replayed = KVEventSubscriber(source, replayed_index, zctx)
        await replayed.catch_up()  # its socket never opened: the replay is all it has
        stats = replayed.statistics()
        assert stats.replayed > 0 and stats.decode_errors == 0 and stats.resyncs == 0
        assert replayed_index.matched_blocks("S", keys, now=0.0) == len(keys)
        assert replayed_index.event_holders(keys[-1]) == ("S",)
    finally:
        await live.close()


async def test_the_index_predicts_the_nodes_own_cache_hits(
    qwen_fleet: dict[str, RealNode], real_gateway: StartGateway
) -> None:
    """What the gateway's index says node L holds of a prompt is what L then takes from
    its cache (``vllm:prefix_cache_hits_total``), for a prompt it holds in part, one it
    holds whole, and one it has never seen."""
    node = qwen_fleet["L"]
    gw = await real_gateway(one_tier(node))
    index = cast(PrefixRouter, state_of(gw).prefix).index
    first = [user(words(400))]
    ids = await node_ids(node, first)
    await post_node(node, chat(first))
    await eventually(
        lambda: (
            index.matched_blocks("L", block_keys(ids, CPU_BLOCK), now=0.0) == len(ids) // CPU_BLOCK
        ),
        timeout=10,
    )
    second = follow_up(first)
    cases = [("part", second), ("whole", first), ("fresh", [user(words(400))])]
    for what, messages in cases:
        ids = await node_ids(node, messages)
        # vLLM computes the last prompt token again: the hit stops before its block.
        keys = block_keys(ids, CPU_BLOCK)[: (len(ids) - 1) // CPU_BLOCK]
        predicted = index.matched_blocks("L", keys, now=0.0) * CPU_BLOCK
        assert (what == "fresh") == (predicted == 0), (what, predicted)
        for _ in range(5):
            hit = await hit_alone(node, messages, len(ids))
            if hit is not None:
                break
            # Another client's prompt in the window: this one is cached now, retry it.
            predicted = index.matched_blocks("L", keys, now=0.0) * CPU_BLOCK
        assert hit == predicted, (what, hit, predicted)


# -- routing by the events ------------------------------------------------------------


@pytest.mark.parametrize(
    ("history_via", "gateway_starts"),
    [("node", "before"), ("node", "after"), ("replica", "before")],
)
async def test_a_follow_up_goes_to_the_node_holding_its_history(
    qwen_fleet: dict[str, RealNode],
    real_gateway: StartGateway,
    history_via: str,
    gateway_starts: str,
) -> None:
    """The history is on S, which kv_aware alone never picks (L is freer), put there by
    a client talking to S directly or by another gateway replica, before or after this
    gateway started (it then knows from S's replay socket). Every follow-up turn goes
    to S, found from S's events alone, and S takes the history from its cache."""
    s_node, l_node = qwen_fleet["S"], qwen_fleet["L"]
    config = one_tier(s_node, l_node)
    gw = await real_gateway(config) if gateway_starts == "before" else None
    messages = [user(words(500))]
    if history_via == "node":
        await post_node(s_node, chat(messages))
    else:
        replica = await real_gateway(one_tier(s_node))
        assert await ask(replica, messages) == "S"
    if gw is None:
        gw = await real_gateway(config)
    index = cast(PrefixRouter, state_of(gw).prefix).index
    ids = await node_ids(s_node, messages)
    await eventually(
        lambda: (
            index.matched_blocks("S", block_keys(ids, CPU_BLOCK), now=0.0) == len(ids) // CPU_BLOCK
        ),
        timeout=10,
    )
    for _ in range(3):
        messages = follow_up(messages)
        hits = await metric(s_node, "vllm:prefix_cache_hits_total")
        assert await ask(gw, messages) == "S"
        # At least the history's full blocks came from S's cache (others may add more).
        history = (len(ids) // CPU_BLOCK) * CPU_BLOCK
        await eventually(
            # mypy infers a lambda with defaults as one taking arguments.
            cast(
                "Callable[[], bool]",
                lambda h=hits, n=history: _rose(s_node, "vllm:prefix_cache_hits_total", h, n),
            ),
            timeout=10,
        )
        ids = await node_ids(s_node, messages)
        await eventually(
            cast(
                "Callable[[], bool]",
                lambda i=ids: (
                    index.matched_blocks("S", block_keys(i, CPU_BLOCK), now=0.0)
                    == len(i) // CPU_BLOCK
                ),
            ),
            timeout=10,
        )


def _rose(node: RealNode, name: str, before: float, by: float) -> bool:
    now = node.metric(name)
    assert now - before >= by, (name, now - before, by)
    return True


async def test_the_gateway_counts_each_nodes_events(
    qwen_fleet: dict[str, RealNode], real_gateway: StartGateway
) -> None:
    """gateway_kv_event_* per backend: the catch-up replay asked and answered, batches
    received as the node serves, no decode error. (A batch published while the
    subscription is still reaching the node is not delivered, as ZeroMQ's pub/sub
    does: the node serves a fresh prompt each try.)"""
    node = qwen_fleet["S"]
    gw = await real_gateway(one_tier(node))
    before = await gateway_metrics(gw)

    async def seen() -> dict[str, float]:
        await post_node(node, chat([user(words(300))]))
        doc = await gateway_metrics(gw)
        assert counted(doc, EventCount.BATCHES, "S") > counted(before, EventCount.BATCHES, "S")
        assert counted(doc, EventCount.REPLAYS_ANSWERED, "S") >= 1
        return doc

    doc = await eventually(seen, timeout=30, interval=1.0)
    assert counted(doc, EventCount.REPLAYS_ASKED, "S") >= counted(
        doc, EventCount.REPLAYS_ANSWERED, "S"
    )
    assert counted(doc, EventCount.DECODE_ERRORS, "S") == 0


# -- a node whose event endpoint names a host ------------------------------------------


async def _gateway(aiohttp_server: Any, config: dict[str, Any], silence_s: float) -> TestServer:
    app = create_app(
        parse_config(config, encodings=ENCODINGS),
        encodings=ENCODINGS,
        kv_events_silence_s=silence_s,
    )
    server: TestServer = await aiohttp_server(app)
    return server


async def test_a_node_that_connects_its_publisher_is_heard_only_by_a_binding_gateway(
    apart_node: RealNode, aiohttp_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Both sides connecting hear nothing: the gateway warns once prompts the node was sent
    should have shown up, and counts no batch. With ``kv_events_bind`` the gateway binds
    the address, the node connects to it, and its cache shows in the index."""
    node = apart_node
    entry = backend_entry(node)
    config = one_tier(node)
    config["tiers"][0]["backends"] = [entry]
    caplog.set_level(logging.WARNING, logger="kvgateway.upstream.kv_events")
    gw = await _gateway(aiohttp_server, config, silence_s=2.0)
    for _ in range(2):
        assert await ask(gw, [user(words(300))]) == "C"
    await eventually(lambda: "kv events of C: no batch in" in caplog.text, timeout=15)
    assert "kv_events_bind" in caplog.text
    assert counted(await gateway_metrics(gw), EventCount.BATCHES, "C") == 0
    await gw.close()

    config["tiers"][0]["backends"] = [{**entry, "kv_events_bind": True}]
    gw = await _gateway(aiohttp_server, config, silence_s=2.0)
    sub = gw.app[KV_EVENTS].subscriber("C")
    assert sub is not None
    await asyncio.wait_for(sub.connected.wait(), 10)  # the node's publisher connected
    index = cast(PrefixRouter, state_of(gw).prefix).index

    async def heard() -> bool:
        # A batch published before the node's socket took the subscription reaches the
        # index through the replay only: ask until one arrives live.
        messages = [user(words(300))]
        ids = await node_ids(node, messages)
        await post_node(node, chat(messages))
        await eventually(
            lambda: (
                index.matched_blocks("C", block_keys(ids, CPU_BLOCK), now=0.0)
                == len(ids) // CPU_BLOCK
            ),
            timeout=10,
        )
        return counted(await gateway_metrics(gw), EventCount.BATCHES, "C") >= 1

    await eventually(heard, timeout=30, interval=0.5)
    assert sub.statistics().decode_errors == 0
