"""Prefix-aware routing against real simulated nodes: follow-up turns go back to the node
holding their history (approximate: from what was routed; precise: from KV events)."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import aiohttp

from kvgateway.core.prefix_keys import block_keys
from tests.support.eventually import eventually
from tests.support.fleet import ENCODINGS, MODEL, SERVED, NodeSpec, StartFleet

NODES: list[NodeSpec] = [
    ("small-1", "small", "gpu24-8b", {}),
    ("small-2", "small", "gpu24-8b", {}),
    ("small-3", "small", "gpu24-8b", {}),
]
SYSTEM = "You are a meticulous assistant for logistics company {i}. " * 30


async def _chat(
    s: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], **extra: Any
) -> tuple[str, str]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 48, **extra}
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
        return r.headers["x-gateway-backend"], data["choices"][0]["message"]["content"]


async def _conversation(s: aiohttp.ClientSession, url: str, i: int, turns: int) -> list[str]:
    messages = [{"role": "system", "content": SYSTEM.format(i=i)}]
    homes = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"Conversation {i}, question {t}: " * 40})
        backend, answer = await _chat(s, url, messages)
        homes.append(backend)
        messages.append({"role": "assistant", "content": answer})
    return homes


async def _conversations(fleet: Any) -> list[list[str]]:
    async with aiohttp.ClientSession() as s:
        return list(await asyncio.gather(*(_conversation(s, fleet.url, i, 4) for i in range(6))))


async def test_follow_up_turns_go_to_the_node_holding_their_history(start_fleet: StartFleet):
    fleet = await start_fleet(NODES, gateway={"routing": {"prefix_aware": True}})
    homes = await _conversations(fleet)
    for turns in homes:
        assert len(set(turns)) == 1, homes
    # Concurrent first turns still spread over the nodes by free budget.
    assert len({turns[0] for turns in homes}) >= 2, homes
    assert fleet.leaks() == {}
    assert fleet.state.prefix is not None
    stats = fleet.state.prefix.index.statistics(homes[0][0], fleet.state.clock())
    assert stats.approximate_blocks > 0 and not stats.precise


async def test_without_prefix_awareness_turns_move_between_nodes(start_fleet: StartFleet):
    fleet = await start_fleet(NODES, gateway={"routing": {"prefix_aware": False}})
    homes = await _conversations(fleet)
    assert any(len(set(turns)) > 1 for turns in homes), homes


async def test_a_session_id_keeps_short_prompts_together(start_fleet: StartFleet):
    fleet = await start_fleet(NODES, gateway={"routing": {"prefix_aware": True}})
    async with aiohttp.ClientSession() as s:
        seen = set()
        for i in range(5):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"hi {i}"}],
                "max_tokens": 4,
            }
            headers = {"x-session-id": "abc"}
            async with s.post(fleet.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200
                seen.add(r.headers["x-gateway-backend"])
    assert len(seen) == 1


async def test_precise_mode_follows_the_nodes_kv_events(start_fleet: StartFleet):
    nodes = [
        (name, tier, profile, {"kv_events_endpoint": "tcp://127.0.0.1:*"})
        for name, tier, profile, _ in NODES
    ]
    fleet = await start_fleet(nodes, gateway={"routing": {"prefix_aware": True}})
    assert fleet.state.prefix is not None
    index = fleet.state.prefix.index
    encoder = ENCODINGS.get(fleet.state.live().models[0].tokenizer.encoding)
    docs = [f"Document {i}: " + f"shipment {i} left the depot at dawn. " * 120 for i in range(3)]
    async with aiohttp.ClientSession() as s:

        async def complete(prompt: str) -> str:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 8}
            async with s.post(fleet.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                return r.headers["x-gateway-backend"]

        first = await asyncio.gather(*(complete(d) for d in docs))
        now = fleet.state.clock()
        assert all(index.is_precise(n, now) for n in fleet.nodes)
        # The index learns each document's blocks from the node's own events.
        for doc, home in zip(docs, first, strict=True):
            keys = block_keys(encoder.encode_ordinary(doc), 16)
            for _ in range(100):
                if index.matched_blocks(home, keys, fleet.state.clock()) >= len(keys) - 1:
                    break
                await asyncio.sleep(0.02)
            assert index.matched_blocks(home, keys, fleet.state.clock()) >= len(keys) - 1
        # Questions about each document go to the node whose cache holds it.
        again = await asyncio.gather(*(complete(d + " Question: when?") for d in docs))
        async with s.get(fleet.url + "/admin/backends") as r:
            view = await r.json()
    assert again == first
    assert view["prefix_aware"] is True
    assert all(b["prefix_index"]["precise"] for b in view["backends"])
    assert sum(b["prefix_index"]["precise_blocks"] for b in view["backends"]) > 0
    assert fleet.leaks() == {}


async def test_a_prefix_the_gateway_never_routed_draws_its_follow_ups(start_fleet: StartFleet):
    """Each document is sent straight to a different node (a client that bypasses the
    gateway, another replica): only the nodes' KV events say where they are, and the
    questions about each go there (kv_aware alone sends all three to one node)."""
    nodes = [
        (name, tier, profile, {"kv_events_endpoint": "tcp://127.0.0.1:*"})
        for name, tier, profile, _ in NODES
    ]
    fleet = await start_fleet(nodes, gateway={"routing": {"prefix_aware": True}})
    assert fleet.state.prefix is not None
    index = fleet.state.prefix.index
    encoder = ENCODINGS.get(fleet.state.live().models[0].tokenizer.encoding)
    homes = list(fleet.nodes)
    docs = [f"Manifest {i}: " + f"crate {i} was sealed at the quay. " * 120 for i in homes]
    async with aiohttp.ClientSession() as s:

        async def complete(url: str, prompt: str) -> str:
            body = {"model": SERVED if url != fleet.url else MODEL, "prompt": prompt}
            async with s.post(url + "/v1/completions", json={**body, "max_tokens": 8}) as r:
                assert r.status == 200, await r.text()
                return r.headers.get("x-gateway-backend", "")

        for doc, home in zip(docs, homes, strict=True):
            await complete(fleet.nodes[home].url, doc)
            keys = block_keys(encoder.encode_ordinary(doc), 16)
            for _ in range(100):
                if index.matched_blocks(home, keys, fleet.state.clock()) >= len(keys) - 1:
                    break
                await asyncio.sleep(0.02)
            assert index.event_holders(keys[-2]) == (home,)
        asked = [await complete(fleet.url, d + " Question: which quay?") for d in docs]
    assert asked == homes
    assert fleet.leaks() == {}


async def test_chat_follow_ups_stay_home_with_kv_events_whose_ids_cannot_match(
    start_fleet: StartFleet,
):
    # The gateway cannot reproduce the node's chat template: the node's events never
    # match a chat's keys, and routing falls back to what it sent where.
    nodes = [
        (name, tier, profile, {"kv_events_endpoint": "tcp://127.0.0.1:*"})
        for name, tier, profile, _ in NODES
    ]
    fleet = await start_fleet(nodes, gateway={"routing": {"prefix_aware": True}})
    homes = await _conversations(fleet)
    for turns in homes:
        assert len(set(turns)) == 1, homes
    now = fleet.state.clock()
    assert fleet.state.prefix is not None
    assert all(fleet.state.prefix.index.is_precise(n, now) for n in fleet.nodes)
    # Its stand-in keys guide routing only: no block is credited on them (the template
    # puts tools, roles and images where the stand-in layout does not).
    st = fleet.state
    raw = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": SYSTEM}], "max_tokens": 8}
    ).encode()
    counted = await st.planner.plan(raw, "chat")
    assert counted.demand.prefix is not None and counted.demand.prefix.keys
    assert not counted.demand.prefix.credit


async def test_a_prefix_held_by_a_running_stream_is_reserved_once(
    start_fleet: StartFleet, vocab_dirs
):
    # Credit needs the node's own ids: the model's tokenizer (or token-id prompts).
    qwen = str(vocab_dirs("qwen"))
    fleet = await start_fleet(
        [(name, tier, profile, {"tokenizer": qwen}) for name, tier, profile, _ in NODES[:1]],
        gateway={
            "models": [{"name": MODEL, "served_name": SERVED, "tokenizer": {"path": qwen}}],
            "routing": {"prefix_aware": True},
        },
    )
    b = fleet.backend("small-1")
    doc = "The depot ledger lists every pallet that left the harbor today. " * 150
    long = {"model": MODEL, "prompt": doc, "max_tokens": 300, "stream": True, "ignore_eos": True}
    async with (
        aiohttp.ClientSession() as s,
        s.post(fleet.url + "/v1/completions", json=long) as first,
    ):
        assert first.status == 200
        await first.content.readany()  # its first token: the prompt is in the cache
        alone = b.reserved_tokens
        body = {"model": MODEL, "prompt": doc + " Which pallets?", "max_tokens": 300}
        second = asyncio.create_task(s.post(fleet.url + "/v1/completions", json=body))
        await eventually(lambda: b.in_flight >= 2, interval=0.001, what="both in flight")
        # The second request reserved only what it does not share, not a second copy.
        assert b.reserved_tokens - alone < alone / 2
        async with await second as r:
            assert r.status == 200
            await r.read()
        await first.read()
    credited = fleet.state.metrics.registry.get_sample_value(
        "gateway_prefix_credited_tokens_total", {"model": MODEL}
    )
    assert credited is not None and credited > 1000
    assert fleet.leaks() == {}


async def test_chat_keys_match_the_nodes_events_with_the_models_tokenizer(
    start_fleet: StartFleet, vocab_dirs
):
    qwen = str(vocab_dirs("qwen"))
    nodes = [
        (name, tier, "gpu24-8b", {"kv_events_endpoint": "tcp://127.0.0.1:*", "tokenizer": qwen})
        for name, tier, _, _ in NODES
    ]
    fleet = await start_fleet(
        nodes,
        gateway={
            "models": [{"name": MODEL, "served_name": SERVED, "tokenizer": {"path": qwen}}],
            "routing": {"prefix_aware": True},
        },
    )
    homes = await _conversations(fleet)
    for turns in homes:
        assert len(set(turns)) == 1, homes
    # The gateway's keys of a chat are the node's own: its events match them exactly.
    assert fleet.state.prefix is not None
    index = fleet.state.prefix.index
    model = fleet.state.live().models[0]
    body = {"messages": [{"role": "system", "content": SYSTEM.format(i=0)}]}
    body["messages"].append({"role": "user", "content": "Conversation 0, question 0: " * 40})
    exact = fleet.state.counters.estimator_for(model.tokenizer).exact_chat_ids(body)
    assert exact is not None
    keys = block_keys(exact[0], 16)
    now = fleet.state.clock()
    assert index.is_precise(homes[0][0], now)
    assert index.matched_blocks(homes[0][0], keys, now) >= len(keys) - 1
    # ... and they are the keys routing uses for that request.
    st = fleet.state
    raw = json.dumps({"model": MODEL, **body, "max_tokens": 8}).encode()
    counted = await st.planner.plan(raw, "chat")
    hint = counted.demand.prefix
    assert hint is not None and len(hint.keys) >= len(keys) - 1
    assert hint.keys == tuple(keys[: len(hint.keys)])
    assert hint.credit  # the node's own ids: shared blocks may be credited
    # Not when the node hashes in what the ids lack, or reads nothing from its cache.
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with_image = [*body["messages"], {"role": "user", "content": [image]}]
    for extra in (
        {"cache_salt": "tenant-b"},
        {"prompt_logprobs": 1},
        {"messages": with_image},
    ):
        raw = json.dumps({"model": MODEL, **body, "max_tokens": 8, **extra}).encode()
        counted = await st.planner.plan(raw, "chat")
        assert counted.demand.prefix is not None and not counted.demand.prefix.credit, extra


async def test_truncated_prompts_are_not_credited_blocks_of_their_cut_head(
    start_fleet: StartFleet,
):
    # Followers share a 2,900-token head with a running request but ask the node to keep
    # their last 1,500 tokens: the node caches the tail, which shares nothing. Keyed on
    # the head, each would be credited ~1,500 tokens and the node would preempt (6 times
    # on this load).
    fleet = await start_fleet(NODES[:1], gateway={"routing": {"prefix_aware": True}})
    b = fleet.backend("small-1")
    rng = random.Random(7)
    head = [rng.randrange(1000, 100_000) for _ in range(2900)]

    def body(i: int, stream: bool = False) -> dict[str, Any]:
        tail = [rng.randrange(1000, 100_000) for _ in range(100 + 7 * i)]
        return {
            "model": MODEL,
            "prompt": head + tail,
            "max_tokens": 1500,
            "ignore_eos": True,
            "truncate_prompt_tokens": 1500,
            "stream": stream,
        }

    async with (
        aiohttp.ClientSession() as s,
        s.post(fleet.url + "/v1/completions", json=body(0, True)) as first,
    ):
        assert first.status == 200, await first.text()
        await first.content.readany()

        async def one(i: int) -> int:
            async with s.post(fleet.url + "/v1/completions", json=body(i)) as r:
                await r.read()
                return r.status

        statuses = await asyncio.gather(*(one(i) for i in range(1, 16)))
        await first.read()
    assert set(statuses) == {200}
    state = await fleet.nodes["small-1"].state()
    assert state["preemptions"] == 0
    assert b.reserved_tokens == 0 and fleet.leaks() == {}


async def test_a_prompt_being_prefilled_is_shared_from_its_admission(
    start_fleet: StartFleet, vocab_dirs
):
    """vLLM caches a prompt's full blocks when it schedules them, before they are
    computed: a request sharing a prompt still being prefilled (a Responses stream has
    announced itself, response.created, but has no output yet) is credited the blocks
    of the first's first prefill chunk, and the node, which hits them, preempts
    nothing."""
    qwen = str(vocab_dirs("qwen"))
    fleet = await start_fleet(
        [("small-1", "small", "gpu24-8b", {"tokenizer": qwen})],
        time_scale=1.0,  # a ~1.5k-token prefill takes ~0.3 s
        gateway={
            "models": [{"name": MODEL, "served_name": SERVED, "tokenizer": {"path": qwen}}],
            "routing": {"prefix_aware": True},
        },
    )
    b = fleet.backend("small-1")
    doc = "The depot ledger lists every pallet that left the harbor today. " * 150
    first_body = {"model": MODEL, "input": doc, "max_output_tokens": 50, "stream": True}
    async with (
        aiohttp.ClientSession() as s,
        s.post(fleet.url + "/v1/responses", json=first_body) as first,
    ):
        assert first.status == 200
        head = await first.content.readuntil(b"\n\n")
        assert b"response.created" in head  # announced; its prefill is still running
        alone = b.reserved_tokens
        body = {"model": MODEL, "input": doc + " Which pallets?", "max_output_tokens": 50}
        second = asyncio.create_task(s.post(fleet.url + "/v1/responses", json=body))
        await eventually(lambda: b.in_flight >= 2, interval=0.001, what="both in flight")
        # The ~1.5k-token prompt is one chunk: the second holds little beyond its tail.
        assert b.reserved_tokens - alone < alone * 0.5
        async with await second as r:
            assert r.status == 200
            await r.read()
        await first.read()
    node = await fleet.nodes["small-1"].state()
    assert float(node.get("preemptions", 0)) == 0
    assert fleet.leaks() == {}


async def test_a_chat_the_template_refuses_gets_the_nodes_400_with_prefix_awareness(
    start_fleet: StartFleet, vocab_dirs
):
    """Counting falls back to the stand-in when the model's template refuses a chat (the
    node refuses it too, with a 400 the client gets); keying its prefix must as well."""
    qwen = str(vocab_dirs("qwen"))
    fleet = await start_fleet(
        [(name, tier, profile, {"tokenizer": qwen}) for name, tier, profile, _ in NODES[:1]],
        gateway={
            "models": [{"name": MODEL, "served_name": SERVED, "tokenizer": {"path": qwen}}],
            "routing": {"prefix_aware": True},
        },
    )
    body = {"model": MODEL, "messages": [{"role": "ipython", "content": "42"}]}
    async with (
        aiohttp.ClientSession() as s,
        s.post(fleet.url + "/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 400 and "Unknown role" in (await r.json())["error"]["message"]
