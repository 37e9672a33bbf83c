"""The gateway modules one streamed chat completion passes through.

Every module on the request path is one more place a newcomer reads before changing it.
The bound is the count today: it may only fall (the aim is 25).
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import aiohttp

from tests.support.fleet import MODEL, StartFleet

# Modules of kvgateway (the simulated node aside) entered by one streamed chat.
MOST_MODULES = 36


async def _stream(url: str, session: aiohttp.ClientSession) -> None:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are brief."},
            {"role": "user", "content": "Name three colours."},
        ],
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.read()
    assert data.rstrip().endswith(b"data: [DONE]")


async def test_a_streamed_chat_enters_no_more_modules_than_it_did(start_fleet: StartFleet):
    quiet = {"health": {"interval_s": 60}, "load_feedback": {"interval_s": 60}}
    fleet = await start_fleet([("small-1", "small", "gpu24-8b", {})], gateway=quiet)
    seen: set[str] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name.startswith("kvgateway.") and not name.startswith("kvgateway.simulator"):
                seen.add(name)

    async with aiohttp.ClientSession() as session:
        await _stream(fleet.url, session)  # first use: caches filled, pools opened
        sys.setprofile(profile)
        try:
            await _stream(fleet.url, session)
        finally:
            sys.setprofile(None)
    assert len(seen) <= MOST_MODULES, f"{len(seen)} modules:\n" + "\n".join(sorted(seen))
