"""A fake vLLM node that answers at once: the fixed upstream every proxy is measured against.

Serves ``POST /v1/chat/completions`` (a canned OpenAI answer, or a canned SSE stream
when the body asks for ``"stream": true``), ``GET /health``, ``GET /v1/models`` (with
``max_model_len``) and a minimal vLLM-style ``GET /metrics`` (``vllm:cache_config_info``
and zeroed load gauges), so the gateway discovers its limits as it would a real node.
Answers from a bare asyncio protocol on uvloop (no framework: its CPU is taken from
the proxies it measures), in its own process:

    python -m bench.fake_upstream --port 9000 [--delay-ms 0] [--stream-events 20]
        [--stream-interval 0] [--max-model-len 131072] [--num-gpu-blocks 10000000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
from typing import cast

import uvloop

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


class _Answers:
    """The canned answers, and which one a request gets."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.head, self.usage_tail, self.events, self.done = _canned(args)
        self.whole_stream = b"".join(self.events)
        self.output_tokens = args.output_tokens
        self.stream_events = args.stream_events
        self.delay = args.delay_ms / 1000
        self.interval = args.stream_interval
        self.split = args.stream_split or args.stream_interval > 0
        self.models = json.dumps(
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
        self.metrics = metrics_page(args.num_gpu_blocks, 16)

    def plain(self, body: bytes) -> bytes:
        # Usage as vLLM reports it, without tokenizing: bytes / 8 underestimates every
        # prompt, so the gateway's usage-based correction (it only ever scales its own
        # count up) stays at 1 and reservations are what it counted.
        prompt_tokens = len(body) // 8
        return b'%s,"usage":{"prompt_tokens":%d,"total_tokens":%d,%s' % (
            self.head,
            prompt_tokens,
            prompt_tokens + self.output_tokens,
            self.usage_tail,
        )

    def stream_tail(self, body: bytes) -> bytes:
        return (
            b'data: {"id":"chatcmpl-fake","object":"chat.completion.chunk","choices":[],'
            b'"usage":{"prompt_tokens":%d,"completion_tokens":%d}}\n\n'
            % (len(body) // 8, self.stream_events)
        ) + self.done


def _is_stream(body: bytes) -> bool:
    return b'"stream":true' in body or b'"stream": true' in body


class _Conn(asyncio.Protocol):
    """One client connection: HTTP/1.x requests in turn (Content-Length or chunked
    bodies), answered from ``_Answers`` without a framework. Written for cheapness: on
    these 2 shared cores the fake node's CPU is taken from the proxies it measures (a real
    node runs elsewhere), and aiohttp's server cost ~0.3 ms a request here."""

    def __init__(self, answers: _Answers) -> None:
        self.answers = answers
        self.buf = bytearray()
        self.busy = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        while self.transport is not None and not self.busy:
            request = self._take()
            if request is None:
                return
            self._answer(*request)

    def _take(self) -> tuple[str, str, bool, bytes] | None:
        """The next whole request in the buffer (method, path, HTTP/1.1 kept alive, body)."""
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > 65536:
                self._close()
            return None
        lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ", 2)
        except ValueError:
            self._close()
            return None
        length, chunked, close = 0, False, version != "HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding":
                chunked = "chunked" in value.lower()
            elif name == "connection":
                v = value.strip().lower()
                close = v == "close" or (close and v != "keep-alive")
        start = end + 4
        if chunked:
            body = bytearray()
            at = start
            while True:
                eol = buf.find(b"\r\n", at)
                if eol < 0:
                    return None
                size = int(bytes(buf[at:eol]).split(b";")[0], 16)
                if size == 0:
                    trailer = buf.find(b"\r\n\r\n", eol)
                    if trailer < 0:
                        return None
                    del buf[: trailer + 4]
                    break
                if len(buf) < eol + 2 + size + 2:
                    return None
                body += buf[eol + 2 : eol + 2 + size]
                at = eol + 2 + size + 2
            return method, target.split("?")[0], not close, bytes(body)
        if len(buf) < start + length:
            return None
        body = bytes(buf[start : start + length])
        del buf[: start + length]
        return method, target.split("?")[0], not close, body

    def _answer(self, method: str, path: str, keep: bool, body: bytes) -> None:
        a = self.answers
        if method == "POST" and path == "/v1/chat/completions":
            if not a.delay and not (a.split and _is_stream(body)):
                if _is_stream(body):
                    self._reply(keep, b"text/event-stream", a.whole_stream + a.stream_tail(body))
                else:
                    self._reply(keep, b"application/json", a.plain(body))
                return
            self.busy = True
            asyncio.get_running_loop().create_task(self._slow(keep, body))
        elif method == "GET" and path == "/health":
            self._reply(keep, b"text/plain", b"")
        elif method == "GET" and path == "/v1/models":
            self._reply(keep, b"application/json", a.models)
        elif method == "GET" and path == "/metrics":
            self._reply(keep, b"text/plain", a.metrics)
        else:
            self._reply(keep, b"text/plain", b"not found", status=b"404 Not Found")

    def _reply(self, keep: bool, ctype: bytes, payload: bytes, status: bytes = b"200 OK") -> None:
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n%s"
            % (status, ctype, len(payload), b"" if keep else b"Connection: close\r\n", payload)
        )
        if not keep:
            self._close()

    async def _slow(self, keep: bool, body: bytes) -> None:
        """An answer that waits (``--delay-ms``) or streams event by event."""
        a = self.answers
        try:
            if a.delay:
                await asyncio.sleep(a.delay)
            if self.transport is None:
                return
            if not _is_stream(body):
                self._reply(keep, b"application/json", a.plain(body))
                return
            if not a.split:
                self._reply(keep, b"text/event-stream", a.whole_stream + a.stream_tail(body))
                return
            # Kept alive: chunked; else (HTTP/1.0, or Connection: close) up to the close.
            self.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n%s\r\n"
                % (b"Transfer-Encoding: chunked\r\n" if keep else b"Connection: close\r\n")
            )
            for ev in [*a.events, a.stream_tail(body)]:
                if self.transport is None:
                    return
                self.transport.write(b"%x\r\n%s\r\n" % (len(ev), ev) if keep else ev)
                if a.interval > 0:
                    await asyncio.sleep(a.interval)
            if keep and self.transport is not None:
                self.transport.write(b"0\r\n\r\n")
            elif not keep:
                self._close()
        finally:
            self.busy = False
            if self.transport is not None:
                self._next()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


async def start(args: argparse.Namespace) -> asyncio.Server:
    """The fake node listening on 127.0.0.1:``args.port`` (0: any free port)."""
    answers = _Answers(args)
    return await asyncio.get_running_loop().create_server(
        lambda: _Conn(answers), "127.0.0.1", args.port, backlog=16384, reuse_address=True
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    async with await start(args) as server:
        await server.serve_forever()


def main() -> None:
    args = parse_args()
    from bench.procs import raise_nofile

    raise_nofile()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(args))


if __name__ == "__main__":
    main()
