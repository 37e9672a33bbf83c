"""The typed keys under which the app holds its state, monitor and metrics exposition
(aiohttp ``AppKey``)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry

from kvgateway.server.state import GatewayState
from kvgateway.server.worker_gauges import WorkerGauges
from kvgateway.upstream.dns import DnsDiscovery
from kvgateway.upstream.kv_events import KVEventHub
from kvgateway.upstream.monitor import Monitor

STATE = web.AppKey("state", GatewayState)
MONITOR = web.AppKey("monitor", Monitor)
# What /metrics exposes: the app's registry, or with `serve --workers N` every worker's
# series merged (prometheus-client multiprocess mode) plus this worker's live collectors.
EXPOSITION = web.AppKey("exposition", CollectorRegistry)
# With `serve --workers N`: this worker's holdings, published for the instance's sums.
WORKER_GAUGES = web.AppKey("worker_gauges", WorkerGauges)
KV_EVENTS = web.AppKey("kv_events", KVEventHub)
DNS = web.AppKey("dns", DnsDiscovery)
