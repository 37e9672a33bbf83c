"""A fake vLLM node that answers at once: the fixed upstream every proxy is measured against.

Serves ``POST /v1/chat/completions`` (a canned OpenAI answer, or a canned SSE stream
when the body asks for ``"stream": true``), ``GET /health``, ``GET /v1/models`` (with
``max_model_len``) and a minimal vLLM-style ``GET /metrics`` (``vllm:cache_config_info``
and zeroed load gauges), so the gateway discovers its limits as it would a real node.
Runs on uvloop in its own process:

    python -m bench.fake_upstream --port 9000 [--delay-ms 0] [--stream-events 20]
        [--stream-interval 0] [--max-model-len 131072] [--num-gpu-blocks 10000000]
"""

from __future__ import annotations

import argparse
import asyncio
import json

import uvloop
from aiohttp import web

SERVED = "meta-llama/Llama-3.1-8B-Instruct"


def _canned(args: argparse.Namespace) -> tuple[bytes, bytes, list[bytes], bytes]:
    body_head = json.dumps(
        {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 1700000000,
            "model": SERVED,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok " * args.output_tokens},
                    "finish_reason": "length",
                }
            ],
        },
        separators=(",", ":"),
    ).encode()[:-1]  # reopen the object to append usage
    usage_tail = b'"completion_tokens":%d}}' % args.output_tokens

    def chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
        data = {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": SERVED,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": "ok "}) for _ in range(args.stream_events)]
    events.append(chunk({}, "length"))
    return body_head, usage_tail, events, b"data: [DONE]\n\n"


def metrics_page(num_gpu_blocks: int, block_size: int) -> bytes:
    return (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",'
        f'num_gpu_blocks="{num_gpu_blocks}"}} 1.0\n'
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="{SERVED}"}} 0.0\n'
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="{SERVED}"}} 0.0\n'
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="{SERVED}"}} 0.0\n'
    ).encode()


def create_app(args: argparse.Namespace) -> web.Application:
    head, usage_tail, events, done = _canned(args)
    whole_stream = b"".join(events) + done
    delay = args.delay_ms / 1000
    models = json.dumps(
        {
            "object": "list",
            "data": [
                {
                    "id": SERVED,
                    "object": "model",
                    "owned_by": "fake",
                    "max_model_len": args.max_model_len,
                }
            ],
        }
    ).encode()
    metrics = metrics_page(args.num_gpu_blocks, 16)

    async def chat(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if delay:
            await asyncio.sleep(delay)
        # Usage as vLLM reports it, without tokenizing: bytes / 8 underestimates every
        # prompt, so the gateway's usage-based correction (it only ever scales its own
        # count up) stays at 1 and reservations are what it counted.
        prompt_tokens = len(raw) // 8
        if b'"stream":true' not in raw and b'"stream": true' not in raw:
            body = b'%s,"usage":{"prompt_tokens":%d,"total_tokens":%d,%s' % (
                head,
                prompt_tokens,
                prompt_tokens + args.output_tokens,
                usage_tail,
            )
            return web.Response(body=body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        usage = (
            b'data: {"id":"chatcmpl-fake","object":"chat.completion.chunk","choices":[],'
            b'"usage":{"prompt_tokens":%d,"completion_tokens":%d}}\n\n'
            % (prompt_tokens, args.stream_events)
        )
        if args.stream_interval <= 0 and not args.stream_split:
            await resp.write(whole_stream[: -len(done)] + usage + done)
        else:
            for ev in events:
                await resp.write(ev)
                if args.stream_interval > 0:
                    await asyncio.sleep(args.stream_interval)
            await resp.write(usage + done)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=b"")

    async def list_models(request: web.Request) -> web.Response:
        return web.Response(body=models, content_type="application/json")

    async def get_metrics(request: web.Request) -> web.Response:
        return web.Response(body=metrics, content_type="text/plain")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/metrics", get_metrics)
    return app


async def serve(args: argparse.Namespace) -> None:
    runner = web.AppRunner(create_app(args), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port, backlog=16384)
    await site.start()
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--delay-ms", type=float, default=0.0, help="wait before answering")
    p.add_argument("--output-tokens", type=int, default=16, help="tokens in a non-stream answer")
    p.add_argument("--stream-events", type=int, default=20, help="content events per stream")
    p.add_argument(
        "--stream-interval", type=float, default=0.0, help="seconds between stream events"
    )
    p.add_argument(
        "--stream-split",
        action="store_true",
        help="write each event separately even without an interval",
    )
    p.add_argument("--max-model-len", type=int, default=131_072)
    p.add_argument("--num-gpu-blocks", type=int, default=10_000_000)
    args = p.parse_args()
    from bench.procs import raise_nofile

    raise_nofile()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(args))


if __name__ == "__main__":
    main()
