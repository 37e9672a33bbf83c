"""One access line per request, text or JSON, never with prompts or keys."""

from __future__ import annotations

import json
import logging

import aiohttp

from kvgateway.server.observability import _JsonFormatter, _TextFormatter
from tests.support.fleet import MODEL, StartFleet

SECRET_PROMPT = "the secret prompt text"


async def test_access_line_fields_and_no_secrets(start_fleet: StartFleet, caplog):
    fleet = await start_fleet(
        [("only", "small", "gpu24-8b", {})],
        gateway={"server": {"api_keys": ["sk-topsecret"], "access_log": True}},
    )
    caplog.set_level(logging.INFO, logger="kvgateway.access")
    async with aiohttp.ClientSession() as s:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": SECRET_PROMPT}],
            "max_tokens": 5,
        }
        headers = {"Authorization": "Bearer sk-topsecret", "x-request-id": "req-123"}
        async with s.post(fleet.url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200
            assert r.headers["x-request-id"] == "req-123"
    records = [r for r in caplog.records if r.name == "kvgateway.access"]
    assert len(records) == 1
    rec = records[0]
    fields = rec.access
    for key in (
        "request_id",
        "model",
        "tier",
        "backend",
        "prompt_tokens",
        "reserved_tokens",
        "status",
        "latency_ms",
        "ttft_ms",
    ):
        assert key in fields
    assert fields["request_id"] == "req-123" and fields["status"] == 200
    assert fields["backend"] == "only" and fields["prompt_tokens"] > 0
    line_json = json.loads(_JsonFormatter().format(rec))
    assert line_json["logger"] == "kvgateway.access" and line_json["status"] == 200
    line_text = _TextFormatter("%(message)s").format(rec)
    assert "request_id=req-123" in line_text and "status=200" in line_text
    everything = caplog.text + json.dumps(line_json) + line_text
    assert SECRET_PROMPT not in everything and "sk-topsecret" not in everything
