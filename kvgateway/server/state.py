"""What one running gateway holds: the four stages' owners, what the admin and metrics
endpoints read, and its lifecycle (draining, shutting down, the requests in progress).
Built in full by :func:`kvgateway.server.app.create_app`, the one composition root, once
its resources (HTTP session, counting pool) exist: nothing is attached later, and
nothing here builds anything."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvgateway.config.model import LiveConfig
from kvgateway.core.admission import Admission
from kvgateway.core.fleet import Fleet
from kvgateway.core.membership import DiscoveredMembers
from kvgateway.core.prefix_routing import PrefixRouter
from kvgateway.core.quota import QuotaLedger
from kvgateway.core.tenancy import Tenancy
from kvgateway.ledger.redis_ledger import RedisLedger
from kvgateway.plan.planner import Planner
from kvgateway.server.exchange import Exchange, Settle
from kvgateway.server.relay import Relay
from kvgateway.server.telemetry import GatewayMetrics, Tracing
from kvgateway.tokens.counters import TokenCounters
from kvgateway.tokens.prompt_estimate import PromptCalibration
from kvgateway.upstream.node_pool import NodePool

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Stages:
    """The owners of the four stages a request passes through."""

    planner: Planner
    admission: Admission
    relay: Relay
    settle: Settle


class GatewayState:
    def __init__(
        self,
        live: LiveConfig,
        stages: Stages,
        fleet: Fleet,
        metrics: GatewayMetrics,
        counters: TokenCounters,
        nodes: NodePool,
        *,
        calibration: PromptCalibration,
        quotas: QuotaLedger,
        tenancy: Tenancy,
        clock: Clock = time.monotonic,
        tracing: Tracing | None = None,
        ledger: RedisLedger | None = None,
        prefix: PrefixRouter | None = None,
    ) -> None:
        # The running config (``live()``); a reload sets ``live.value``.
        self.live = live
        self.planner = stages.planner
        self.admission = stages.admission
        self.relay = stages.relay
        self.settle = stages.settle
        self.tracing = tracing or Tracing()
        # Members of DNS-discovered backend groups; ``config`` lists them among the backends.
        self.members = DiscoveredMembers(live.value)
        self.fleet = fleet
        self.metrics = metrics
        self.counters = counters
        # The request path's own keep-alive connections to nodes (probes and the node
        # counter use the app's aiohttp session).
        self.nodes = nodes
        self.clock = clock
        # The shared ledger (None: reservations are this process's alone).
        self.ledger = ledger
        self.calibration = calibration
        self.quotas = quotas
        self.tenancy = tenancy
        # Prefix-aware placement (consulted only for requests planned with a prefix hint).
        self.prefix = prefix
        self.started_at_wall = time.time()
        # Shutdown phases: `draining` makes /ready fail while requests are still
        # served (load balancers stop sending); `shutting_down` refuses new requests.
        self.draining = False
        self.shutting_down = False
        # Requests in progress, by the task serving each (shutdown waits for them).
        self.active: dict[asyncio.Task[object], Exchange] = {}
        # Turn counter breaking ties between equally loaded nodes for pass-through calls.
        self.passthrough_turn = 0
