"""``/v1/chat/completions`` and ``/v1/completions`` handlers: engine in, vLLM format out.

A request is validated like vLLM does (model, then token count against
``max_model_len``), submitted to the engine driver as ``n`` sequences, and answered
either as SSE chunks, one per decode step and choice, or as one JSON body. Whatever
happens (client gone, error, cancellation) the sequences are released from the engine
in ``finally``, so a disconnect frees their KV blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from kvgateway.simulator import protocol as p
from kvgateway.simulator import wire
from kvgateway.simulator.context_rule import (
    check_characters,
    check_request_limits,
    check_sampling,
    check_token_ids,
    output_budget,
    truncated,
)
from kvgateway.simulator.driver import RequestHandle
from kvgateway.simulator.errors import (
    ApiError,
    bad_request,
    engine_dead,
    error_body,
    injected_error,
    queue_full,
)
from kvgateway.simulator.generation import filler_text, token_json, token_text
from kvgateway.simulator.node import NODE_KEY, SimNode
from kvgateway.simulator.tokenizer import TemplateError

# How often a fault-injected hang checks whether its client is gone.
_HANG_POLL_S = 0.05
# Llama 3 <|begin_of_text|>: what an empty completion prompt becomes.
_BOS_ID = 128_000


class ClientGone(Exception):
    """The client closed the connection; the request is aborted."""


async def handle_chat(request: web.Request) -> web.StreamResponse:
    node: SimNode = request.app[NODE_KEY]
    body = p.parse_json(await request.read())
    req = p.parse_chat(body)
    node.check_model(req.model)
    if not req.messages:
        raise bad_request(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
        )
    _check_before_tokenizing(node, req)
    vocabulary = node.tokenizer.vocabulary
    try:
        if vocabulary is not None and req.truncate_prompt_tokens is None:
            # The rendered text is at least the messages' (rendered again only then).
            limit = node.settings.max_model_len * vocabulary.max_chars_per_token
            if sum(len(m.text) for m in req.messages) > limit // 2:
                chars = node.tokenizer.rendered_chars(body)
                check_characters(chars, node.settings.max_model_len, vocabulary.max_chars_per_token)
        prompt_ids = await node.tokenizer.encode_chat_request_async(body, req.messages)
    except TemplateError as exc:
        raise bad_request(str(exc)) from exc
    return await _generate(request, node, req, prompt_ids, chat=True)


async def handle_completion(request: web.Request) -> web.StreamResponse:
    node: SimNode = request.app[NODE_KEY]
    body = p.parse_json(await request.read())
    req = p.parse_completion(body)
    node.check_model(req.model)
    _check_before_tokenizing(node, req)
    vocabulary = node.tokenizer.vocabulary
    if req.prompt_token_ids is not None:
        prompt_ids = list(req.prompt_token_ids)
        if vocabulary is not None:
            check_token_ids(prompt_ids, vocabulary.max_token_id)
    else:
        text = req.prompt or ""
        if vocabulary is not None and req.truncate_prompt_tokens is None:
            check_characters(len(text), node.settings.max_model_len, vocabulary.max_chars_per_token)
        prompt_ids = await node.tokenizer.encode_completion_request_async(body, text)
    if not prompt_ids:
        prompt_ids = [_BOS_ID]  # vLLM adds BOS; an empty prompt is one token
    # Token ids are checked at their full length; text is encoded at most max_input + 1.
    return await _generate(
        request, node, req, prompt_ids, chat=False, text=req.prompt_token_ids is None
    )


def _check_before_tokenizing(node: SimNode, req: p.GenerationRequest) -> None:
    check_request_limits(
        node.settings.max_model_len,
        req.max_tokens,
        req.truncate_prompt_tokens,
        overflow=node.settings.context_overflow,
        field=req.max_tokens_field,
    )


async def _generate(
    request: web.Request,
    node: SimNode,
    req: p.GenerationRequest,
    prompt_ids: list[int],
    *,
    chat: bool,
    text: bool = True,
) -> web.StreamResponse:
    settings = node.settings
    overflow = settings.context_overflow
    prompt_ids = truncated(
        prompt_ids, req.truncate_prompt_tokens, settings.max_model_len, req.max_tokens, overflow
    )
    budget = output_budget(
        settings.max_model_len,
        len(prompt_ids),
        req.max_tokens,
        text=text,
        overflow=overflow,
        field=req.max_tokens_field,
    )
    check_sampling(req.n, budget, req.min_tokens)
    fault = node.faults.consume()
    if fault is not None and fault.hang_s:
        await _sleep_unless_gone(request, fault.hang_s)
    if fault is not None and fault.status is not None:
        raise injected_error(fault.status)
    drop_after = fault.drop_after_chunks if fault is not None else None
    if drop_after is not None and not req.stream:
        _drop(request)
        return web.Response(status=499)
    if node.driver.dead is not None:
        raise engine_dead()
    limit = settings.max_num_queued_reqs
    if limit is not None and node.driver.in_flight + req.n > limit:
        raise queue_full()

    fmt = wire.ChunkFormat(
        chat=chat,
        id=wire.new_id("chatcmpl" if chat else "cmpl"),
        created=wire.now_ts(),
        model=settings.model,
        fingerprint=node.fingerprint,
    )
    poll = node.disconnect_poll_s
    handle = node.driver.submit(
        prompt_ids, budget, n=req.n, ignore_eos=req.ignore_eos, min_tokens=req.min_tokens
    )
    try:
        if req.stream:
            return await _stream(
                request,
                handle,
                fmt,
                req=req,
                drop_after=drop_after,
                poll=poll,
                interval=settings.stream_interval,
            )
        return await _collect(request, handle, fmt, poll=poll)
    except ClientGone:
        # Nobody is listening; aiohttp discards whatever is returned on a closed socket.
        return web.Response(status=499)
    finally:
        node.driver.release(handle)


async def wait_news(request: web.Request, handle: RequestHandle, poll: float | None) -> None:
    """Wait for tokens; with ``poll`` also notice a client that is gone.

    aiohttp cancels handlers on disconnect only if the runner asks for it
    (``handler_cancellation=True``, as ``fleet.start_node`` does); other runners, such as
    the test server, need the poll.
    """
    if poll is None:
        await handle.wait()
        return
    while not handle.has_news:
        _check_client(request)
        try:
            async with asyncio.timeout(poll):
                await handle.wait()
        except TimeoutError:
            pass


def _check_client(request: web.Request) -> None:
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ClientGone


async def _sleep_unless_gone(request: web.Request, seconds: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (left := deadline - loop.time()) > 0:
        _check_client(request)
        await asyncio.sleep(min(left, _HANG_POLL_S))


def _drop(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


async def _collect(
    request: web.Request, handle: RequestHandle, fmt: wire.ChunkFormat, *, poll: float | None
) -> web.Response:
    finish: list[str | None] = [None] * len(handle.seqs)
    while True:
        for index, _start, _count, reason in handle.take():
            if reason is not None:
                finish[index] = reason
        if handle.error is not None:
            raise ApiError(500, handle.error, "InternalServerError")
        if handle.done:
            break
        await wait_news(request, handle, poll)
    make = wire.chat_message_choice if fmt.chat else wire.completion_choice
    choices = [
        make(i, filler_text(0, handle.emitted[i]), finish[i]) for i in range(len(handle.seqs))
    ]
    return wire.json_response(fmt.body(choices, handle.prompt_tokens, handle.completion_tokens))


async def _stream(
    request: web.Request,
    handle: RequestHandle,
    fmt: wire.ChunkFormat,
    *,
    req: p.GenerationRequest,
    drop_after: int | None,
    poll: float | None,
    interval: int,
) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200,
        headers={"Content-Type": "text/event-stream; charset=utf-8"},
    )
    with contextlib.suppress(ClientGone):
        try:
            await resp.prepare(request)
        except ConnectionError as exc:  # gone before the headers went out
            raise ClientGone from exc
        await _stream_events(
            request, resp, handle, fmt, req=req, drop_after=drop_after, poll=poll, interval=interval
        )
    return resp


async def _stream_events(
    request: web.Request,
    resp: web.StreamResponse,
    handle: RequestHandle,
    fmt: wire.ChunkFormat,
    *,
    req: p.GenerationRequest,
    drop_after: int | None,
    poll: float | None,
    interval: int,
) -> None:
    choices = len(handle.seqs)
    started = [False] * choices
    unsent = [0] * choices  # generated, not yet streamed (--stream-interval)
    sent = 0
    while True:
        events: list[str] = []
        news = handle.take()
        if fmt.chat and news and not any(started):
            # vLLM sends every choice's role with the request's first output.
            usage_from = handle.prompt_tokens if req.continuous_usage else None
            events.extend(wire.sse(fmt.role(i, usage_from)) for i in range(choices))
        for index, start, count, reason in news:
            first_output = not started[index]
            started[index] = True
            unsent[index] += count
            # What piled up since the choice's last chunk goes out as one chunk (vLLM's
            # API server merges the outputs it has not streamed yet), with
            # --stream-interval N only once N have piled up: the first output and the
            # finish go at once.
            if reason is None and not first_output and unsent[index] < interval:
                continue
            tokens, unsent[index] = unsent[index], 0
            first = start + count - tokens
            if tokens == 1 and reason is None and not req.continuous_usage:
                events.append(fmt.token_event(index, token_json(first)))
                continue
            text = "".join(token_text(first + k) for k in range(tokens))
            chunk = fmt.chunk([fmt.delta(index, text, reason)])
            if req.continuous_usage:
                # This choice's output so far, as vLLM reports it per chunk.
                chunk["usage"] = fmt.running_usage(handle.prompt_tokens, first + tokens)
            if reason is not None and not req.include_usage:
                # The last chunk carries the fingerprint (the usage chunk when one follows).
                chunk["system_fingerprint"] = fmt.fingerprint
            events.append(wire.sse(chunk))
        if handle.error is not None:
            events.append(wire.sse(error_body(handle.error, "InternalServerError", 500)))
        if drop_after is not None and sent + len(events) >= drop_after:
            await _write(resp, "".join(events[: drop_after - sent]))
            _drop(request)
            raise ClientGone
        if events:
            await _write(resp, "".join(events))
            sent += len(events)
        if handle.done:
            break
        await wait_news(request, handle, poll)
    if req.include_usage and handle.error is None:
        final = fmt.final_usage(handle.prompt_tokens, handle.completion_tokens)
        await _write(resp, wire.sse(final))  # vLLM yields the usage chunk and [DONE] apart
    await _write(resp, wire.SSE_DONE)
    try:
        await resp.write_eof()
    except ConnectionError as exc:
        raise ClientGone from exc


async def _write(resp: web.StreamResponse, data: str) -> None:
    if not data:
        return
    try:
        await resp.write(data.encode())
    except ConnectionError as exc:
        raise ClientGone from exc
