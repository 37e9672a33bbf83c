"""The least a counting proxy in Python can cost: the overhead benchmark's floor.

What every request through the gateway must at least pay on this machine, with none of
the gateway's own work: aiohttp's server reads the request, ``json.loads`` parses it, the
prompt is counted as the gateway counts it (the model's chat template and tokenizer with
``--tokenizer DIR``, else the cl100k stand-in over the messages' text), the body goes to
the upstream on a kept-alive connection (the gateway's own HTTP/1.1 client,
``kvgateway.upstream.node_pool``: aiohttp's client costs ~0.4 ms/request more here) and
its answer back to the client whole. No admission, routing, metrics, limits, retries, timeouts or access log.
The gateway's CPU per request minus this one's is what its own work costs.

    python -m bench.floor_proxy --port 9001 --upstream http://127.0.0.1:9000 [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from typing import Any

import uvloop
from aiohttp import web

from kvgateway.tokens.encoding import EncodingCache
from kvgateway.tokens.exact import ExactCounter
from kvgateway.tokens.plans import EncodingSpec
from kvgateway.upstream.node_pool import NodePool


def counter(tokenizer: str | None) -> Callable[[dict[str, Any]], int]:
    """The prompt count of a chat body: exact with ``tokenizer``, else the stand-in's."""
    cache = EncodingCache()
    if tokenizer is not None:
        return ExactCounter(cache.model(tokenizer)).count_chat_sync
    enc = cache.get(EncodingSpec())

    def standin(body: dict[str, Any]) -> int:
        texts = [m.get("content") for m in body.get("messages", ())]
        return sum(len(enc.encode_ordinary(t)) for t in texts if isinstance(t, str))

    return standin


def create_app(upstream: str, count: Callable[[dict[str, Any]], int]) -> web.Application:
    pool = NodePool()
    origin = pool.origin(upstream)
    headers = {"Content-Type": "application/json"}

    async def stop(app: web.Application) -> None:
        pool.close()

    async def chat(request: web.Request) -> web.Response:
        raw = await request.read()
        tokens = count(json.loads(raw))
        conn = await pool.request(upstream, request.path, raw, headers, connect_s=5.0)
        chunks = []
        while chunk := await conn.readany(30.0):
            chunks.append(chunk)
        status = conn.status
        pool.release(conn, origin)
        return web.Response(
            status=status,
            body=b"".join(chunks),
            content_type="application/json",
            headers={"x-prompt-tokens": str(tokens)},
        )

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="http://HOST:PORT of the node")
    p.add_argument("--tokenizer", help="the model's tokenizer directory (exact counting)")
    args = p.parse_args()
    app = create_app(args.upstream.rstrip("/"), counter(args.tokenizer))
    uvloop.install()
    asyncio.run(_serve(app, args.port))


async def _serve(app: web.Application, port: int) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    main()
