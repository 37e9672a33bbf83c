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
import json
from typing import Any

from aiohttp import web

from kvgateway.simulator import protocol as p
from kvgateway.simulator.driver import RequestHandle
from kvgateway.simulator.generation import filler_text, token_json, token_text
from kvgateway.simulator.node import NODE_KEY, SimNode
from kvgateway.simulator.tokenizer import TemplateError

# How often a fault-injected hang checks whether its client is gone.
_HANG_POLL_S = 0.05
# Llama 3 <|begin_of_text|>: what an empty completion prompt becomes.
_BOS_ID = 128_000


class ClientGone(Exception):
    """The client closed the connection; the request is aborted."""


class _Format:
    """Builds one response's chunks; the per-token event is a string template because a
    busy node writes tens of thousands of them per second."""

    __slots__ = ("_head", "chat", "created", "id", "model")

    def __init__(self, *, chat: bool, id: str, created: int, model: str) -> None:
        self.chat = chat
        self.id = id
        self.created = created
        self.model = model
        head = json.dumps(self.chunk([]), separators=(",", ":"))
        self._head = "data: " + head.removesuffix("]}")  # ends with `"choices":[`

    def token_event(self, index: int, token_index: int) -> str:
        """``sse(chunk([delta(index, token_text(token_index), None)]))``, pre-serialized."""
        text = token_json(token_index)
        if self.chat:
            body = f'{{"index":{index},"delta":{{"content":{text}}},"logprobs":null,"finish_reason":null}}'
        else:
            body = (
                f'{{"index":{index},"text":{text},"logprobs":null,'
                f'"finish_reason":null,"stop_reason":null}}'
            )
        return f"{self._head}{body}]}}\n\n"

    @property
    def object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def delta(self, index: int, text: str, finish: str | None) -> dict[str, Any]:
        if self.chat:
            return {
                "index": index,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish,
                **({"stop_reason": None} if finish else {}),
            }
        return {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }

    def role(self, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }


async def handle_chat(request: web.Request) -> web.StreamResponse:
    node: SimNode = request.app[NODE_KEY]
    body = p.parse_json(await request.read())
    req = p.parse_chat(body)
    node.check_model(req.model)
    try:
        prompt_ids = await node.tokenizer.encode_chat_request_async(body, req.messages)
    except TemplateError as exc:
        raise p.bad_request(str(exc)) from exc
    return await _generate(request, node, req, prompt_ids, chat=True)


async def handle_completion(request: web.Request) -> web.StreamResponse:
    node: SimNode = request.app[NODE_KEY]
    body = p.parse_json(await request.read())
    req = p.parse_completion(body)
    node.check_model(req.model)
    if req.prompt_token_ids is not None:
        prompt_ids = list(req.prompt_token_ids)
    else:
        prompt_ids = await node.tokenizer.encode_completion_request_async(body, req.prompt or "")
    if not prompt_ids:
        prompt_ids = [_BOS_ID]  # vLLM adds BOS; an empty prompt is one token
    # Token ids are checked at their full length; text is encoded at most max_input + 1.
    return await _generate(
        request, node, req, prompt_ids, chat=False, text=req.prompt_token_ids is None
    )


def _truncated(
    ids: list[int],
    keep: int | None,
    max_model_len: int,
    max_tokens: int | None,
    overflow: str = "clamp",
) -> list[int]:
    """``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: as many as fit
    beside ``max_tokens`` in vLLM <= 0.31; the context less one in vLLM >= 0.32, which
    then cuts max_tokens to fit; vllm/renderers/params.py ``_token_truncation``); more
    than max_model_len is refused (``_validate_truncation_size``); vLLM truncates on the
    left."""
    if keep is None or keep == 0:
        return ids
    if keep == -1:
        if overflow == "clamp":
            keep = max(1, max_model_len - 1)
        else:
            keep = max(1, max_model_len - (max_tokens or 0))
    if keep > max_model_len:
        raise p.bad_request(
            f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
            f"({max_model_len}). Please, select a smaller truncation size.",
            "truncate_prompt_tokens",
        )
    return ids[-keep:] if len(ids) > keep else ids


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
    prompt_ids = _truncated(
        prompt_ids,
        req.truncate_prompt_tokens,
        settings.max_model_len,
        req.max_tokens,
        settings.context_overflow,
    )
    prompt_tokens = len(prompt_ids)
    budget = p.output_budget(
        settings.max_model_len,
        prompt_tokens,
        req.max_tokens,
        text=text,
        overflow=settings.context_overflow,
    )
    fault = node.faults.consume()
    if fault is not None and fault.hang_s:
        await _sleep_unless_gone(request, fault.hang_s)
    if fault is not None and fault.status is not None:
        raise p.injected_error(fault.status)
    drop_after = fault.drop_after_chunks if fault is not None else None
    if drop_after is not None and not req.stream:
        _drop(request)
        return web.Response(status=499)
    limit = settings.max_num_queued_reqs
    if limit is not None and node.driver.in_flight + req.n > limit:
        raise p.queue_full(node.driver.in_flight, limit)

    fmt = _Format(
        chat=chat,
        id=p.new_id("chatcmpl" if chat else "cmpl"),
        created=p.now_ts(),
        model=settings.model,
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
    request: web.Request, handle: RequestHandle, fmt: _Format, *, poll: float | None
) -> web.Response:
    finish: list[str | None] = [None] * len(handle.seqs)
    while True:
        for index, _start, _count, reason in handle.take():
            if reason is not None:
                finish[index] = reason
        if handle.error is not None:
            raise p.ApiError(500, handle.error, "InternalServerError")
        if handle.done:
            break
        await wait_news(request, handle, poll)
    make = p.chat_message_choice if fmt.chat else p.completion_choice
    choices = [
        make(i, filler_text(0, handle.emitted[i]), finish[i]) for i in range(len(handle.seqs))
    ]
    body: dict[str, Any] = {
        "id": fmt.id,
        "object": "chat.completion" if fmt.chat else "text_completion",
        "created": fmt.created,
        "model": fmt.model,
        "choices": choices,
        "usage": {**p.usage(handle.prompt_tokens, handle.completion_tokens)},
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }
    if fmt.chat:
        body["usage"]["prompt_tokens_details"] = None
    return p.json_response(body)


async def _stream(
    request: web.Request,
    handle: RequestHandle,
    fmt: _Format,
    *,
    req: p.GenerationRequest,
    drop_after: int | None,
    poll: float | None,
    interval: int,
) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200,
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"},
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
    fmt: _Format,
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
        for index, start, count, reason in handle.take():
            if fmt.chat and not started[index]:
                # vLLM sends the role with the first output of each choice.
                role = fmt.chunk([fmt.role(index)])
                if req.continuous_usage:
                    role["usage"] = p.usage(handle.prompt_tokens, 0)
                events.append(p.sse(role))
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
                events.append(fmt.token_event(index, first))
                continue
            text = "".join(token_text(first + k) for k in range(tokens))
            chunk = fmt.chunk([fmt.delta(index, text, reason)])
            if req.continuous_usage:
                # This choice's output so far, as vLLM reports it per chunk.
                chunk["usage"] = p.usage(handle.prompt_tokens, first + tokens)
            events.append(p.sse(chunk))
        if handle.error is not None:
            error = p.error_body(handle.error, "InternalServerError", 500)
            events.append(p.sse(error))
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
        final = fmt.chunk([])
        final["usage"] = p.usage(handle.prompt_tokens, handle.completion_tokens)
        await _write(resp, p.sse(final))  # vLLM yields the usage chunk and [DONE] apart
    await _write(resp, p.SSE_DONE)
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
