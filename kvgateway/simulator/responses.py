"""``POST /v1/responses``: OpenAI's Responses API as vLLM serves it, through the engine.

The request's ``instructions`` and ``input`` (a string, or items: messages, function
calls and their outputs, reasoning) become the chat request vLLM renders for them
(:mod:`kvgateway.tokens.responses_input`), counted and admitted like a chat completion, with
``max_output_tokens`` as the output budget. The answer is one ``message`` output item;
streamed, it is vLLM's event sequence (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` per token, then the matching ``.done`` events and
``response.completed``), each as ``event: <type>`` plus ``data: <json>`` with a growing
``sequence_number``. Shapes follow ``vllm/entrypoints/openai/responses``.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvgateway.simulator import protocol as p
from kvgateway.simulator import wire
from kvgateway.simulator.completions import ClientGone, wait_news
from kvgateway.simulator.context_rule import check_sampling, output_budget
from kvgateway.simulator.driver import RequestHandle
from kvgateway.simulator.errors import ApiError, bad_request, engine_dead
from kvgateway.simulator.generation import filler_text, token_text
from kvgateway.simulator.node import NODE_KEY
from kvgateway.simulator.tokenizer import ChatMessage, TemplateError
from kvgateway.tokens.responses_input import chat_body


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    model: str | None
    messages: tuple[ChatMessage, ...]
    # The chat request vLLM renders for it (kvgateway.tokens.responses_input.chat_body).
    chat: dict[str, Any]
    instructions: str | None
    max_output_tokens: int | None
    stream: bool
    temperature: float | None
    top_p: float | None


def _message_text(message: dict[str, Any]) -> str:
    """What the simulator's own tokenizer counts of a converted message (without the
    model's template): its text, reasoning and tool calls."""
    texts: list[str] = []
    content = message.get("content")
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        texts.extend(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    if isinstance(message.get("reasoning"), str):
        texts.append(message["reasoning"])
    for call in message.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            texts.extend(v for v in (fn.get("name"), fn.get("arguments")) if isinstance(v, str))
    return "\n".join(texts)


def parse_responses(body: dict[str, Any]) -> ResponsesRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string.", "model")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string.", "instructions")
    raw = body.get("input")
    if isinstance(raw, list) and raw:
        for i, item in enumerate(raw):
            if not isinstance(item, dict):
                raise bad_request(f"input[{i}] must be an object.", "input")
            content = item.get("content")
            if content is not None and not isinstance(content, str | list):
                raise bad_request(
                    f"input[{i}].content must be a string or a list of parts.", "input"
                )
    elif not isinstance(raw, str):
        raise bad_request("input must be a string or a non-empty list of items.", "input")
    # The chat request vLLM renders (function calls, their outputs and reasoning as vLLM
    # converts them): the model's template renders it when the node has one.
    chat = chat_body(body)
    messages = tuple(
        ChatMessage(m["role"], _message_text(m))
        for m in chat["messages"]
        if isinstance(m.get("role"), str)
    )
    max_out = body.get("max_output_tokens")
    if max_out is not None and (
        isinstance(max_out, bool) or not isinstance(max_out, int) or max_out < 1
    ):
        raise bad_request("max_output_tokens must be a positive integer.", "max_output_tokens")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean.", "stream")
    temperature, top_p = body.get("temperature"), body.get("top_p")
    return ResponsesRequest(
        model=model,
        messages=messages,
        chat=chat,
        instructions=instructions,
        max_output_tokens=max_out,
        stream=stream,
        temperature=temperature if isinstance(temperature, int | float) else None,
        top_p=top_p if isinstance(top_p, int | float) else None,
    )


class _Shapes:
    """The response object and its output item, at any stage."""

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.req = req
        self.model = model
        self.id = f"resp_{wire.new_id('x')[2:]}"
        self.item_id = f"msg_{wire.new_id('x')[2:]}"
        self.created_at = wire.now_ts()

    def text_part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [self.text_part(text)]
        return {
            "id": self.item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def response(
        self, status: str, output: list[dict[str, Any]], handle: RequestHandle | None
    ) -> dict[str, Any]:
        usage = None
        incomplete = None
        if handle is not None:
            prompt, completion = handle.prompt_tokens, handle.completion_tokens
            usage = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion,
            }
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        req = self.req
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "output": output,
            "usage": usage,
            "incomplete_details": incomplete,
            "error": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None,
            "metadata": None,
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "prompt": None,
            "reasoning": None,
            "service_tier": "auto",
            "background": False,
            "store": False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_logprobs": None,
            "text": None,
            "tool_choice": "auto",
            "tools": [],
            "truncation": "disabled",
            "user": None,
        }


async def handle_responses(request: web.Request) -> web.StreamResponse:
    node = request.app[NODE_KEY]
    req = parse_responses(p.parse_json(await request.read()))
    node.check_model(req.model)
    try:
        prompt_ids = await node.tokenizer.encode_chat_request_async(req.chat, req.messages)
    except TemplateError as exc:
        raise bad_request(str(exc)) from exc
    context = node.settings.max_model_len
    budget = output_budget(
        context,
        len(prompt_ids),
        req.max_output_tokens,
        overflow=node.settings.context_overflow,
        field="max_output_tokens",
    )
    if len(prompt_ids) >= context:  # responses/serving.py, _validate_generator_input
        raise ApiError(
            400,
            f"The engine prompt length {len(prompt_ids)} exceeds the max_model_len "
            f"{context}. Please reduce prompt.",
            "invalid_request_error",
            "input",
        )
    check_sampling(1, budget, 0)
    if node.driver.dead is not None:
        raise engine_dead()
    shapes = _Shapes(req, node.settings.model)
    handle = node.driver.submit(prompt_ids, budget, n=1, ignore_eos=False, min_tokens=0)
    poll = node.disconnect_poll_s
    try:
        if req.stream:
            return await _stream(request, handle, shapes, poll)
        finish = None
        while True:
            for _index, _start, _count, reason in handle.take():
                finish = reason or finish
            if handle.error is not None:
                raise ApiError(500, handle.error, "InternalServerError")
            if handle.done:
                break
            await wait_news(request, handle, poll)
        text = filler_text(0, handle.emitted[0])
        status = "incomplete" if finish == "length" else "completed"
        return wire.json_response(shapes.response(status, [shapes.item(text, status)], handle))
    except ClientGone:
        return web.Response(status=499)
    finally:
        node.driver.release(handle)


async def _stream(
    request: web.Request, handle: RequestHandle, shapes: _Shapes, poll: float | None
) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200,
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"},
    )
    seq = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    at = {"output_index": 0, "item_id": shapes.item_id}
    with contextlib.suppress(ClientGone):
        try:
            await resp.prepare(request)
        except ConnectionError as exc:
            raise ClientGone from exc
        await _write(
            resp,
            event("response.created", response=shapes.response("in_progress", [], None))
            + event("response.in_progress", response=shapes.response("in_progress", [], None))
            + event(
                "response.output_item.added", output_index=0, item=shapes.item(None, "in_progress")
            )
            + event(
                "response.content_part.added", **at, content_index=0, part=shapes.text_part("")
            ),
        )
        finish = None
        while True:
            events = []
            for _index, start, count, reason in handle.take():
                finish = reason or finish
                if count:
                    # One delta per engine output: what piled up since the last one goes
                    # as one (vLLM's API server merges the outputs it has not streamed).
                    text = "".join(token_text(start + k) for k in range(count))
                    events.append(
                        event("response.output_text.delta", **at, content_index=0,
                              delta=text, logprobs=[])
                    )  # fmt: skip
            if handle.error is not None:
                events.append(
                    event("error", code="InternalServerError", message=handle.error, param=None)
                )
                await _write(resp, "".join(events))
                return resp
            await _write(resp, "".join(events))
            if handle.done:
                break
            await wait_news(request, handle, poll)
        text = filler_text(0, handle.emitted[0])
        status = "incomplete" if finish == "length" else "completed"
        item = shapes.item(text, status)
        await _write(
            resp,
            event("response.output_text.done", **at, content_index=0, text=text, logprobs=[])
            + event(
                "response.content_part.done", **at, content_index=0, part=shapes.text_part(text)
            )
            + event("response.output_item.done", output_index=0, item=item)
            # Completed whatever the status ("incomplete" when cut at its budget).
            + event("response.completed", response=shapes.response(status, [item], handle)),
        )
        try:
            await resp.write_eof()
        except ConnectionError as exc:
            raise ClientGone from exc
    return resp


async def _write(resp: web.StreamResponse, data: str) -> None:
    if not data:
        return
    try:
        await resp.write(data.encode())
    except ConnectionError as exc:
        raise ClientGone from exc
