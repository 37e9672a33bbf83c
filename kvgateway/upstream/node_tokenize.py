"""Asking a node for its own count of a prompt (vLLM's ``POST /tokenize``).

Planning asks (:func:`kvgateway.plan.planner.worth_asking`) when the gateway counts with
a stand-in and the stand-in's safe upper bound comes near the largest context on offer:
the bound would refuse (or over-reserve) a request the node may well serve, so one
healthy node of the model is asked for the exact count before
anything is reserved (another node when the first fails). That includes prompts the
stand-in itself counts past the context when their text is one it overcounts (non-ASCII:
CJK, Cyrillic, Arabic, emoji). Bounded in time (TIMEOUT_S per node, ATTEMPTS nodes);
answers cached by body; a node without the endpoint (404/405) is not asked again. Any
failure keeps the bound (safe).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import OrderedDict
from typing import Any

import aiohttp

from kvgateway.config.model import ModelConfig
from kvgateway.core.backends import Backend
from kvgateway.core.fleet import Fleet
from kvgateway.tokens.node_count import tokenize_body, tokenize_count

log = logging.getLogger("kvgateway.upstream.node_tokenize")

# Per node asked. A loaded node took up to 1.4 s to count a 32k-token prompt in
# bench.counting_modes (2 cores shared by 4 nodes and the gateway); at 2 s, 3-6 of ~80
# asks per run timed out and the bound refused prompts the node would have served.
TIMEOUT_S = 4.0
# Nodes asked at most (the next one when the first fails or is too slow).
ATTEMPTS = 2
CACHE_ENTRIES = 4096


class NodeTokenizer:
    def __init__(self, session: aiohttp.ClientSession, fleet: Fleet) -> None:
        self._session = session
        self._fleet = fleet
        self._cache: OrderedDict[bytes, int] = OrderedDict()
        self._without: set[str] = set()  # backends that lack /tokenize

    async def count(self, model: ModelConfig, body: dict[str, Any], *, chat: bool) -> int | None:
        """The node's count of ``body``'s prompt, or None (no node could say in time)."""
        backends = self._pick(model.name)[:ATTEMPTS]
        if not backends:
            return None  # before serializing: a 100k-token body costs ms on the loop
        request = tokenize_body(body, model.served_name, chat=chat)
        data = json.dumps(request, sort_keys=True, separators=(",", ":")).encode()
        key = hashlib.blake2b(data, digest_size=16).digest()
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        for backend in backends:
            got = await self._ask(backend, data)
            if got is not None:
                self._cache[key] = got
                while len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
                return got
        return None

    def _pick(self, model: str) -> list[Backend]:
        """Nodes to ask, best first: the longest context, then the least busy."""
        pool = [b for b in self._fleet.for_model(model) if b.usable and b.name not in self._without]
        return sorted(pool, key=lambda b: (-b.context_limit, b.in_flight))

    async def _ask(self, b: Backend, data: bytes) -> int | None:
        try:
            async with asyncio.timeout(TIMEOUT_S):
                async with self._session.post(
                    b.config.url + "/tokenize",
                    data=data,
                    headers={"Content-Type": "application/json"},
                ) as r:
                    if r.status in (404, 405):
                        self._without.add(b.name)
                        log.info("backend %s has no /tokenize; counting with the bound", b.name)
                        return None
                    if r.status != 200:
                        return None
                    return tokenize_count(await r.json(content_type=None))
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, TypeError) as exc:
            log.debug("backend %s: /tokenize failed: %s", b.name, type(exc).__name__)
            return None
