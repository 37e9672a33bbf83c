"""The load of ``gateway round``: measure one vLLM node under a ladder of concurrencies, as one round.

For each concurrency ``c`` of the ladder, ``c`` clients run a closed loop (each sends its
next request as soon as the last one ends) of streamed ``/v1/completions`` requests with
exactly ``--prompt-tokens`` prompt token ids (random ids, so no prefix is shared) and
``--output-tokens`` output tokens (``ignore_eos``). At the step's end the requests still
running are cut off (the node aborts them) and the node is given a moment to drain, so
every step starts from an empty engine. The node's own counters give generated tokens and
preemptions; ``/metrics`` is sampled for the peak KV usage. The ladder stops at the first
step that preempts, times out, or fails every request; all waits are bounded.

TTFT percentiles are over the requests that got a first token, plus those cut off while
waiting longer than the slowest first token seen (as lower bounds), so an overloaded step
does not look fast because its slowest requests never answered.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvgateway.capacity.logparse import parse_vllm_log
from kvgateway.commands.nodeclient import PROBE_TIMEOUT_S, NodeClient, RoundError
from kvgateway.commands.roundstats import (
    Round,
    StepResult,
    default_ladder,
    default_output_tokens,
    default_prompt_tokens,
    describe_step,
    effective_flags,
    flags_from_log,
    log_summary,
    percentile,
    stop_reason,
)

_DRAIN_WALL_S = 10.0
_ERROR_PAUSE_S = 0.01
_TOKEN_ID_RANGE = (1_000, 30_000)  # inside every common vocabulary


@dataclass(frozen=True, slots=True)
class LoadShape:
    prompt_tokens: int
    output_tokens: int
    duration_s: float  # node seconds per step
    timeout_s: float  # node seconds without a token before a request counts as timed out
    time_scale: float = 1.0


@dataclass(slots=True)
class _StepTally:
    requests: int = 0
    completed: int = 0
    bad_requests: int = 0
    errors: int = 0
    timeouts: int = 0
    streamed_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    waiting_cut: list[float] = field(default_factory=list)  # cut off before a first token
    peak_usage: float | None = None


def _event_kind(line: bytes, seen_token: bool) -> str | None:
    """Classify one SSE line as "token", "done", "error" or None (no news).

    After the first token only the end and errors matter, so the JSON is not parsed again.
    """
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return "done"
    if seen_token:
        return "error" if payload.startswith(b'{"error"') else "token"
    try:
        event = json.loads(payload)
    except ValueError:
        return "error"
    if not isinstance(event, dict) or "error" in event:
        return "error"
    for choice in event.get("choices") or ():
        if isinstance(choice, dict) and (
            choice.get("text") or (choice.get("delta") or {}).get("content")
        ):
            return "token"
    return None


async def _one_request(
    node: NodeClient, body: dict[str, Any], tally: _StepTally, deadline: float, idle_s: float
) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    got_first = False
    cut = asyncio.timeout_at(deadline)
    try:
        async with cut, node.session.post(f"{node.url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                await resp.read()
                if resp.status == 400:
                    tally.bad_requests += 1
                else:
                    tally.errors += 1
                await asyncio.sleep(_ERROR_PAUSE_S)
                return
            while True:
                async with asyncio.timeout(idle_s):
                    line = await resp.content.readline()
                if not line:
                    tally.errors += 1  # the stream ended without [DONE]
                    return
                kind = _event_kind(line, got_first)
                if kind == "token":
                    tally.streamed_tokens += 1
                    if not got_first:
                        got_first = True
                        tally.ttfts.append(loop.time() - start)
                elif kind == "done":
                    tally.completed += 1
                    return
                elif kind == "error":
                    tally.errors += 1
                    return
    except TimeoutError:
        if not cut.expired():
            tally.timeouts += 1
        elif not got_first:
            tally.waiting_cut.append(loop.time() - start)
    except (aiohttp.ClientError, ConnectionError):
        tally.errors += 1
        await asyncio.sleep(_ERROR_PAUSE_S)


async def _client(
    node: NodeClient,
    make_body: Callable[[], dict[str, Any]],
    tally: _StepTally,
    deadline: float,
    idle_s: float,
) -> None:
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        tally.requests += 1
        await _one_request(node, make_body(), tally, deadline, idle_s)


async def _sample_kv(node: NodeClient, tally: _StepTally, deadline: float, every: float) -> None:
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        try:
            usage = await node.kv_usage()
        except RoundError:
            usage = None  # a missed sample; the step goes on
        if usage is not None:
            tally.peak_usage = usage if tally.peak_usage is None else max(tally.peak_usage, usage)
        await asyncio.sleep(min(every, max(0.0, deadline - loop.time())))


async def _drain(node: NodeClient) -> None:
    """Wait (bounded) until the node has no request left from the step."""
    loop = asyncio.get_running_loop()
    until = loop.time() + _DRAIN_WALL_S
    while loop.time() < until:
        if (await node.counters())[2] == 0:
            return
        await asyncio.sleep(0.02)


def _body_factory(model: str, shape: LoadShape, rng: random.Random) -> Callable[[], dict[str, Any]]:
    lo, hi = _TOKEN_ID_RANGE

    def make() -> dict[str, Any]:
        return {
            "model": model,
            "prompt": [rng.randrange(lo, hi) for _ in range(shape.prompt_tokens)],
            "max_tokens": shape.output_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    return make


async def _heartbeat(
    tally: _StepTally,
    concurrency: int,
    shape: LoadShape,
    deadline: float,
    every: float,
    progress: Callable[[str], None],
) -> None:
    """A line every ``every`` wall seconds, so a long step on a real node is not silent."""
    loop = asyncio.get_running_loop()
    while deadline - loop.time() > every:
        await asyncio.sleep(every)
        done = shape.duration_s - (deadline - loop.time()) * shape.time_scale
        progress(
            f"{concurrency:>4} concurrent: {done:.0f}s of {shape.duration_s:g}s, "
            f"{tally.requests} requests, {tally.completed} done"
        )


async def run_step(
    node: NodeClient,
    shape: LoadShape,
    concurrency: int,
    make_body: Callable[[], dict[str, Any]],
    *,
    progress: Callable[[str], None] = lambda line: None,
    heartbeat_s: float = 10.0,
) -> StepResult:
    loop = asyncio.get_running_loop()
    scale = shape.time_scale
    pre0, gen0, _ = await node.counters()
    wall = shape.duration_s / scale
    start = loop.time()
    deadline = start + wall
    tally = _StepTally()
    idle_s = shape.timeout_s / scale
    async with asyncio.TaskGroup() as tg:
        for i in range(concurrency):
            tg.create_task(
                _client(node, make_body, tally, deadline, idle_s), name=f"round-client-{i}"
            )
        tg.create_task(_sample_kv(node, tally, deadline, wall / 20), name="round-kv-sampler")
        tg.create_task(
            _heartbeat(tally, concurrency, shape, deadline, heartbeat_s, progress),
            name="round-heartbeat",
        )
    elapsed = (loop.time() - start) * scale
    pre1, gen1, _ = await node.counters()
    await _drain(node)
    tokens = gen1 - gen0 if gen0 is not None and gen1 is not None else tally.streamed_tokens
    # Cut-off waits count only beside real first tokens (a step of 400s has no TTFT).
    slowest = max(tally.ttfts, default=float("inf"))
    ttfts = [t * scale for t in (*tally.ttfts, *(w for w in tally.waiting_cut if w > slowest))]
    p50, p99 = percentile(ttfts, 50), percentile(ttfts, 99)
    return StepResult(
        concurrency=concurrency,
        requests=tally.requests,
        completed=tally.completed,
        ttft_p50_s=None if p50 is None else round(p50, 4),
        ttft_p99_s=None if p99 is None else round(p99, 4),
        tokens_per_s=round(tokens / elapsed, 1) if elapsed > 0 else 0.0,
        preemptions=round(pre1 - pre0),
        peak_kv_usage=None if tally.peak_usage is None else round(tally.peak_usage, 4),
        bad_requests=tally.bad_requests,
        errors=tally.errors,
        timeouts=tally.timeouts,
    )


async def measure_round(
    url: str,
    name: str,
    *,
    ladder: Sequence[int] | None,
    prompt_tokens: int | None,
    output_tokens: int | None,
    duration_s: float,
    timeout_s: float,
    time_scale: float = 1.0,
    log_text: str | None = None,
    seed: int = 0,
    progress: Callable[[str], None] = lambda line: None,
    heartbeat_s: float = 10.0,
    api_key: str | None = None,
    clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
) -> Round:
    """Read the node's limits, then climb the ladder until it preempts or times out.

    ``started_at`` is the clock's time before the first request to the node.
    """
    started_at = clock().isoformat(timespec="seconds")
    timeout = aiohttp.ClientTimeout(sock_connect=PROBE_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(
        timeout=timeout, connector=connector, headers=headers
    ) as session:
        node = NodeClient(session, url)
        limits = await node.limits()
        prompt = prompt_tokens or default_prompt_tokens(limits.max_model_len)
        output = output_tokens or default_output_tokens(limits.max_model_len, prompt)
        steps = tuple(ladder or default_ladder(limits.kv_tokens, prompt + output))
        shape = LoadShape(prompt, output, duration_s, timeout_s, time_scale)
        progress(
            f"round {name}: {limits.model} at {node.url}: max_model_len "
            f"{limits.max_model_len}, KV {limits.kv_tokens:,} tokens "
            f"({limits.num_gpu_blocks} blocks x {limits.block_size}); "
            f"{prompt}+{output} tokens per request, {duration_s:g}s per step, "
            f"ladder {','.join(map(str, steps))}"
        )
        make_body = _body_factory(limits.model, shape, random.Random(seed))
        results: list[StepResult] = []
        stopped = None
        for c in steps:
            step = await run_step(
                node, shape, c, make_body, progress=progress, heartbeat_s=heartbeat_s
            )
            results.append(step)
            progress(describe_step(step))
            stopped = stop_reason(step)
            if stopped:
                progress(f"stopping: {stopped}")
                break
    facts = parse_vllm_log(log_text) if log_text is not None else None
    passed = flags_from_log(log_text or "")
    return Round(
        name=name,
        url=node.url,
        started_at=started_at,
        limits=limits,
        flags=effective_flags(limits, passed),
        passed_flags=passed,
        prompt_tokens=prompt,
        output_tokens=output,
        duration_s=duration_s,
        time_scale=time_scale,
        steps=tuple(results),
        log=log_summary(facts) if facts is not None and not facts.is_empty else None,
        stopped=stopped,
    )
