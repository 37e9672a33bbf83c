"""The typed keys under which the app holds its state and monitor (aiohttp ``AppKey``)."""

from __future__ import annotations

from aiohttp import web

from kvgateway.server.state import GatewayState
from kvgateway.upstream.kv_events import KVEventHub
from kvgateway.upstream.monitor import Monitor

STATE = web.AppKey("state", GatewayState)
MONITOR = web.AppKey("monitor", Monitor)
KV_EVENTS = web.AppKey("kv_events", KVEventHub)
