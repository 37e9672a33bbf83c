"""The simulator held to the real engine: a simulated twin of node S (its served name,
model directory, blocks, block size, max-num-seqs, max-model-len, max-num-batched-tokens
2048 as S's log shows, prefix caching, KV events, NONE_HASH seed PYTHONHASHSEED=0) gets
S's requests and must answer as S does on everything the gateway relies on.

Left out, each for a reason: generated text (S runs random weights, the simulator streams
filler words), timings and histogram sums (it models timing, not numerics), ids, times
and the fingerprint's hash (random, or a hash of vLLM's whole config), and how many chunks
a stream takes (both merge what the reader has not taken; that depends on timing). Other
agents use S too: counters are compared as deltas of our requests (exactly when nothing
else ran meanwhile), events by their tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from kvgateway.simulator.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvgateway.simulator.kv_events import encode_batch
from kvgateway.simulator.node import NODE_KEY
from kvgateway.simulator.server import create_node_app
from kvgateway.simulator.settings import NodeSettings
from tests.support.real_fleet import ENCODINGS
from tests.support.real_models import VLLM_VENV
from tests.support.vllm_nodes import CPU_BLOCK, RealNode

pytestmark = pytest.mark.real_vllm

CHAT, CMPL, TOK = "/v1/chat/completions", "/v1/completions", "/tokenize"
L = 4096  # S's max_model_len
# Labels saying how the tier sized S's pool: the CPU build's VLLM_CPU_KVCACHE_SPACE (None
# on a GPU), --num-gpu-blocks-override (a simulated pool is its size), its forced float32.
CPU_ONLY_LABELS = {"kv_cache_memory_bytes", "num_gpu_blocks_override", "mamba_ssm_cache_dtype"}
# The vllm: families the gateway, its commands and dashboards read (grep "vllm:").
_READ = """num_requests_running num_requests_waiting kv_cache_usage_perc num_preemptions
prompt_tokens generation_tokens request_success prefix_cache_queries prefix_cache_hits
time_to_first_token_seconds e2e_request_latency_seconds inter_token_latency_seconds
request_queue_time_seconds cache_config_info"""
READ_FAMILIES = {f"vllm:{name}" for name in _READ.split()}


def chat(content: Any = "hello there", **extra: Any) -> dict[str, Any]:
    return {"model": "qwen", "messages": [{"role": "user", "content": content}], **extra}


def cmpl(prompt: Any = "hello there", **extra: Any) -> dict[str, Any]:
    return {"model": "qwen", "prompt": prompt, **extra}


@dataclasses.dataclass
class Pair:
    real: RealNode
    sim_url: str
    sim_events: str
    sim_replay: str
    session: aiohttp.ClientSession

    async def both(self, path: str, body: Any = None) -> tuple[Any, Any]:
        return await self.call(self.real.url, path, body), await self.call(self.sim_url, path, body)

    async def call(self, url: str, path: str, body: Any = None) -> tuple[int, Any]:
        if body is None:
            async with self.session.get(url + path) as r:
                text = await r.text()
                return r.status, text if path == "/metrics" else json.loads(text or "null")
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        async with self.session.post(url + path, data=data, headers=headers) as r:
            if r.content_type == "text/event-stream":
                text = await r.text()
                events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
                return r.status, [e if e == "[DONE]" else json.loads(e) for e in events]
            return r.status, await r.json(content_type=None)

    async def metrics(self, url: str) -> str:
        return str((await self.call(url, "/metrics"))[1])


@pytest.fixture
async def pair(qwen_fleet: dict[str, RealNode], aiohttp_server: Any) -> AsyncIterator[Pair]:
    real = qwen_fleet["S"]
    spec = real.spec
    settings = dataclasses.replace(
        NodeSettings(),
        name="twin",
        model=spec.served_name,
        model_root=str(real.model_dir),
        tokenizer=str(real.model_dir),
        max_model_len=spec.max_model_len,
        num_gpu_blocks=spec.num_blocks,
        block_size=CPU_BLOCK,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=2048,
        hash_seed="0",
        seed=1,
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
    )
    server = await aiohttp_server(create_node_app(settings, encodings=ENCODINGS))
    publisher = server.app[NODE_KEY].publisher
    assert publisher is not None and publisher.endpoint and publisher.replay_endpoint
    url = str(server.make_url("")).rstrip("/")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield Pair(real, url, publisher.endpoint, publisher.replay_endpoint, session)


def scrub(obj: Any) -> Any:
    """``obj`` without what differs by nature: ids, times, generated text, the hash."""
    if isinstance(obj, list | tuple):
        return [scrub(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    return {k: scrub(_scrubbed(k, v)) for k, v in obj.items()}


def _scrubbed(key: str, value: Any) -> Any:
    if key == "id" and re.fullmatch(r"[a-z]+-[0-9a-f]{16}", str(value)):
        return value.split("-")[0]  # vLLM's random_uuid
    if key == "system_fingerprint":
        assert re.fullmatch(r"vllm-0\.32\.0-[0-9a-f]{8}", value), value
        return "<fp>"
    if key == "created" or (key in ("content", "text") and isinstance(value, str)):
        return "<>"  # a random model's token may even read "" (half a UTF-8 character)
    return value


def cache_labels(text: str) -> dict[str, str]:
    (info,) = [f for f in text_string_to_metric_families(text) if f.name.endswith("config_info")]
    return {k: v for k, v in info.samples[0].labels.items() if k not in CPU_ONLY_LABELS}


async def test_limits_and_tokenize(pair: Pair) -> None:
    for path in ("/v1/models", "/version", "/v1/models/qwen", "/health"):
        real, sim = await pair.both(path)
        assert scrub(real) == scrub(sim), path
    for body in (
        {"model": "qwen", "prompt": "hello world, ß€😀", "return_token_strs": True},
        {"model": "qwen", "prompt": "hello", "add_special_tokens": False},
        {"model": "qwen", "messages": [{"role": "user", "content": "hi"}]},
        {**chat(), "add_generation_prompt": False},
    ):
        real, sim = await pair.both(TOK, body)
        assert real == sim, body
    real, sim = [cache_labels(await pair.metrics(u)) for u in (pair.real.url, pair.sim_url)]
    assert real == sim


async def test_usage_finish_reasons_and_clamping(pair: Pair) -> None:
    for path, body in (
        (CHAT, chat(max_tokens=4, ignore_eos=True)),
        (CHAT, chat(max_completion_tokens=3, max_tokens=9, ignore_eos=True)),
        (CHAT, chat(max_tokens=2, ignore_eos=True, n=2)),
        (CMPL, cmpl(max_tokens=4, ignore_eos=True)),
        (CMPL, cmpl(max_tokens="3", ignore_eos="true")),  # pydantic's lax types
        (CMPL, cmpl([64] * (L - 6), max_tokens=16, ignore_eos=True)),  # cut to 6
        (CMPL, cmpl([64] * (L + 9), max_tokens=4, truncate_prompt_tokens=-1, ignore_eos=True)),
    ):
        real, sim = await pair.both(path, body)
        assert real[0] == 200 and scrub(real) == scrub(sim), (body, real, sim)


def stream_shape(events: list[Any]) -> dict[int, tuple[Any, list[Any], set[str]]]:
    """Per choice (-1: the usage chunk) its last chunk, its role chunk and the kinds of its
    others, without per-chunk counts: how many chunks it takes depends on timing."""
    runs: dict[int, list[Any]] = {}
    for event in events[:-1]:
        shape = scrub(event)
        if shape["choices"] and "usage" in shape:
            shape["usage"] = {**shape["usage"], "completion_tokens": 0, "total_tokens": 0}
        runs.setdefault(shape["choices"][0]["index"] if shape["choices"] else -1, []).append(shape)
    roles = {i: [x for x in r if "'role'" in str(x)] for i, r in runs.items()}
    return {i: (r[-1], roles[i], {str(x) for x in r[len(roles[i]) : -1]}) for i, r in runs.items()}


async def test_streams(pair: Pair) -> None:
    usage, continuous = {"include_usage": True}, {"continuous_usage_stats": True}
    for options in (None, usage, {**usage, **continuous}):
        x: dict[str, Any] = {"stream": True, "max_tokens": 3, "ignore_eos": True}
        x |= {"stream_options": options} if options else {}
        for path, body in ((CHAT, chat(**x)), (CMPL, cmpl(**x)), (CHAT, chat(**x, n=2))):
            (real_status, real), (sim_status, sim) = await pair.both(path, body)
            assert real_status == sim_status == 200 and real[-1] == sim[-1] == "[DONE]"
            ours, theirs = stream_shape(real), stream_shape(sim)
            assert {i: v[:2] for i, v in ours.items()} == {i: v[:2] for i, v in theirs.items()}
            # A choice whose tokens came as one chunk has nothing before its last.
            assert all(v[2] == theirs[i][2] for i, v in ours.items() if v[2] and theirs[i][2])
            # Continuous usage counts each choice's own output: 3 at its finish.
            finishes = [e for e in real + sim if e != "[DONE]" and e["choices"]]
            finishes = [e for e in finishes if e["choices"][0]["finish_reason"] and "usage" in e]
            assert {e["usage"]["completion_tokens"] for e in finishes} <= {3}


ERRORS: dict[str, tuple[str, Any]] = {
    "unknown model": (CHAT, chat(model="nope", max_tokens=2)),
    "unknown model (tokenize)": (TOK, {"model": "nope", "prompt": "hi"}),
    "unknown model before n=0": (CHAT, chat(model="nope", n=0)),
    "n=0": (CHAT, chat(max_tokens=2, n=0)),
    "max_tokens -1": (CMPL, cmpl(max_tokens=-1)),
    "max_tokens past the context": (CMPL, cmpl(max_tokens=L + 1)),
    "max_completion_tokens past the context": (CHAT, chat(max_completion_tokens=L + 1)),
    "prompt past the context": (CMPL, cmpl(" a" * (L + 900), max_tokens=4)),
    "prompt past the context (chat)": (CHAT, chat(" a" * (L + 900), max_tokens=4)),
    "prompt past the context (ids)": (CMPL, cmpl([64] * (L + 900), max_tokens=4)),
    "ids one past the context": (CMPL, cmpl([64] * (L + 1), max_tokens=4)),
    "prompt at the limit (ids)": (CMPL, cmpl([64] * L, max_tokens=4)),
    "prompt at the limit (chat)": (CHAT, chat(" a" * (L - 19))),  # + 19 template tokens
    "characters past the bound": (CMPL, cmpl("a" * 600_000, max_tokens=2)),
    "characters past the bound (chat)": (CHAT, chat("a" * 600_000, max_tokens=2)),
    "token id out of vocabulary": (CMPL, cmpl([151_936], max_tokens=2)),
    "min_tokens above the cut": (CMPL, cmpl([64] * (L - 6), max_tokens=16, min_tokens=10)),
    "min_tokens -1": (CMPL, cmpl(max_tokens=2, min_tokens=-1)),
    "truncation past the context": (CMPL, cmpl(max_tokens=2, truncate_prompt_tokens=L + 1)),
    "truncation below -1": (CMPL, cmpl(max_tokens=2, truncate_prompt_tokens=-2)),
    "stream_options, no stream": (CMPL, cmpl(max_tokens=2, stream_options={"include_usage": 1})),
    "max_tokens 'abc'": (CMPL, cmpl(max_tokens="abc")),
    "max_tokens 1.5": (CHAT, chat(max_tokens=1.5)),
    "two bad fields": (CHAT, chat(max_tokens="x", n=1.5)),
    "ignore_eos 'maybe'": (CMPL, cmpl(max_tokens=2, ignore_eos="maybe")),
    "model 5": (CMPL, cmpl(model=5, max_tokens=2)),
    "stream_options 5": (CMPL, cmpl(max_tokens=2, stream=True, stream_options=5)),
    "missing messages": (CHAT, {"model": "qwen", "max_tokens": 2}),
    "empty conversation": (CHAT, {"model": "qwen", "messages": [], "max_tokens": 2}),
    "missing prompt": (CMPL, {"model": "qwen", "max_tokens": 2}),
    "empty prompt": (CMPL, cmpl("", max_tokens=2)),
    "prompt []": (CMPL, cmpl([], max_tokens=2)),
    "prompt 5": (CMPL, cmpl(5, max_tokens=2)),
    "tokenize without prompt or messages": (TOK, {"model": "qwen"}),
    "bad JSON": (CHAT, b'{"model": "qwen", '),
    "array body": (CMPL, b"[1, 2]"),
    "null body": (CMPL, b"null"),
    "no body": (CMPL, b""),
}
# Not compared: a malformed message (pydantic lists one error per branch of vLLM's
# message union, 11 to 22 of them; the simulator names the first) and negative token
# ids (the same for the prompt union); both are 400 "Bad Request" on either node.


async def test_errors_word_for_word(pair: Pair) -> None:
    answers = {name: await pair.both(path, body) for name, (path, body) in ERRORS.items()}
    assert all(real[0] >= 400 for real, _ in answers.values())
    differ = {name: answer for name, answer in answers.items() if answer[0] != answer[1]}
    assert not differ, json.dumps(differ, indent=1, ensure_ascii=False)


def counters(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_total", "_count")) and family.name in READ_FAMILIES:
                reason = s.labels.get("finished_reason", "")
                out[f"{s.name}{reason}"] = out.get(f"{s.name}{reason}", 0.0) + s.value
    return out


def families(text: str) -> dict[str, tuple[str, str, set[str], set[str]]]:
    """Type, help, label names and histogram bounds of each family read."""
    found = [f for f in text_string_to_metric_families(text) if f.name in READ_FAMILIES]
    ns = [{k for s in f.samples for k in s.labels} for f in found]
    bs = [{s.labels["le"] for s in f.samples if "le" in s.labels} for f in found]
    return {f.name: (f.type, f.documentation, n, b) for f, n, b in zip(found, ns, bs, strict=True)}


async def test_metrics_read_by_the_gateway(pair: Pair) -> None:
    ours = [pair.real.url, pair.sim_url]
    real_page, sim_page = [families(await pair.metrics(url)) for url in ours]
    assert real_page == sim_page and set(real_page) == READ_FAMILIES
    twice = (CMPL, cmpl(random.sample(range(1000, 100_000), 300), max_tokens=4, ignore_eos=True))
    requests = [twice, twice, (CHAT, chat(max_tokens=3, ignore_eos=True))]
    deltas = []
    for url in ours:
        before = counters(await pair.metrics(url))
        for path, body in requests:
            assert (await pair.call(url, path, body))[0] == 200
        after = counters(await pair.metrics(url))
        deltas.append({k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k)})
    real, sim = deltas
    assert sim["vllm:prefix_cache_hits_total"] == 256  # 2 blocks of the repeated prompt
    finished = sum(v for k, v in real.items() if k.startswith("vllm:request_success_total"))
    if finished == len(requests):  # nothing else ran on S meanwhile
        assert real == sim
    else:
        assert all(real.get(k, 0) >= v for k, v in sim.items()), (real, sim)


END_SEQ = (-1).to_bytes(8, "big", signed=True)


async def published(ctx: zmq.asyncio.Context, url: str, endpoint: str, pair: Pair) -> list[Any]:
    """What a node publishes serving three prompts of 2,500 new tokens (the third evicts)."""
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.subscribe(b"")
    await asyncio.sleep(0.5)  # ZMQ's slow joiner
    for prompt in PROMPTS:
        assert (await pair.call(url, CMPL, cmpl(prompt, max_tokens=1)))[0] == 200
    frames = []
    while True:
        try:
            async with asyncio.timeout(2.0):
                frames.append(await sub.recv_multipart())
        except TimeoutError:
            sub.close(linger=0)
            return frames


async def replayed(ctx: zmq.asyncio.Context, endpoint: str, start: bytes) -> list[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    await sock.send_multipart([b"", start])
    replies: list[list[bytes]] = []
    async with asyncio.timeout(30):
        while not replies or replies[-1][-2] != END_SEQ:
            replies.append(await sock.recv_multipart())
    sock.close(linger=0)
    return replies


_BASE = random.randrange(1000, 100_000)
PROMPTS = [[_BASE + i * 3000 + j for j in range(2500)] for i in range(3)]


async def test_kv_events_on_the_wire(pair: Pair) -> None:
    """Same frames, same payload layout, and (the same NONE_HASH seed) the same block
    hashes and parents for the same tokens; replay as the node publishes."""
    ctx = zmq.asyncio.Context()
    ours = {t for p in PROMPTS for t in p}
    views = []
    try:
        for url, endpoint, replay in (
            (pair.real.url, pair.real.events_endpoint, pair.real.replay_endpoint),
            (pair.sim_url, pair.sim_events, pair.sim_replay),
        ):
            assert endpoint and replay
            frames = await published(ctx, url, endpoint, pair)
            assert frames and {len(f) for f in frames} == {3}
            assert {f[0] for f in frames} == {b""} and {len(f[1]) for f in frames} == {8}
            batches = [msgspec.msgpack.decode(f[2]) for f in frames]
            assert all(len(b) == 3 and isinstance(b[0], float) and b[2] == 0 for b in batches)
            events = [e for b in batches for e in b[1]]
            stored = [e for e in events if "token_ids" in e and set(e["token_ids"]) <= ours]
            removed = [e for e in events if e["type"] == "BlockRemoved"]
            assert stored and removed
            replies = await replayed(ctx, replay, frames[0][1])
            assert replies[-1] == [b"", b"", END_SEQ, b""]
            by_seq = {r[2]: r for r in replies[:-1]}
            assert all(by_seq[f[1]] == [b"", *f] for f in frames)
            shapes = {str([(k, type(v)) for k, v in e.items()]) for e in [*stored, *removed]}
            chains = [(e["block_hashes"], e["parent_block_hash"], e["token_ids"]) for e in stored]
            views.append((shapes, chains, {len(e["block_hashes"]) for e in removed}))
    finally:
        ctx.destroy(linger=0)
    assert views[0] == views[1]


VLLM_ENCODE = """
import sys, msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
no = dict(lora_id=None, medium="GPU", lora_name=None)
events = [
    BlockStored(block_hashes=[1, 2**64 - 1], parent_block_hash=None, token_ids=[5] * 4, **no,
                block_size=2, extra_keys=[None] * 2, group_idx=0,
                kv_cache_spec_kind="full_attention"),
    BlockStored(block_hashes=[3], parent_block_hash=7, token_ids=[6, 7], block_size=2, **no,
                extra_keys=[None], group_idx=1, kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=128),
    BlockRemoved(block_hashes=[9], medium="GPU", group_idx=1),
    AllBlocksCleared(),
]
batch = KVEventBatch(ts=1.25, events=events, data_parallel_rank=0)
sys.stdout.write(msgspec.msgpack.Encoder().encode(batch).hex())
"""


def test_kv_event_payload_is_vllms_own_encoding() -> None:
    """Byte for byte what vLLM's own structs encode, AllBlocksCleared included (a real
    node sends it only on a prefix-cache reset, which S does not serve)."""
    run = [str(VLLM_VENV / "bin" / "python"), "-c", VLLM_ENCODE]
    theirs = subprocess.run(run, capture_output=True, text=True, timeout=300, check=True).stdout
    events: list[KVEvent] = [
        BlockStored((1, 2**64 - 1), None, (5,) * 4, 2),
        BlockStored((3,), 7, (6, 7), 2, group_idx=1, sliding_window=128),
        BlockRemoved((9,), group_idx=1),
        AllBlocksCleared(),
    ]
    assert encode_batch(events, 1.25).hex() == theirs
