"""What one running gateway holds, built in full by :func:`kvgateway.server.app.create_app`
once its resources (HTTP session, counting pool) exist: nothing is attached later."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

from kvgateway.config.model import GatewayConfig
from kvgateway.core.admission import Admission
from kvgateway.core.demand import Demand
from kvgateway.core.fleet import Fleet
from kvgateway.core.membership import DiscoveredMembers
from kvgateway.core.output_model import OutputModel
from kvgateway.core.prefix_routing import PrefixRouter
from kvgateway.core.quota import LocalQuotaLedger, QuotaLedger
from kvgateway.core.routing import Decision, Wait
from kvgateway.core.tenancy import Tenancy
from kvgateway.ledger.redis_ledger import RedisLedger
from kvgateway.plan.planner import Planner
from kvgateway.server.exchange import Exchange
from kvgateway.server.metrics import GatewayMetrics
from kvgateway.server.relay import Relay
from kvgateway.server.settle import Settle
from kvgateway.server.tracing import Tracing
from kvgateway.tokens.calibration import PromptCalibration
from kvgateway.tokens.counters import TokenCounters
from kvgateway.upstream.node_pool import NodePool
from kvgateway.upstream.node_tokenize import NodeTokenizer

Clock = Callable[[], float]


class GatewayState:
    def __init__(
        self,
        config: GatewayConfig,
        fleet: Fleet,
        metrics: GatewayMetrics,
        counters: TokenCounters,
        session: aiohttp.ClientSession,
        *,
        clock: Clock = time.monotonic,
        tracing: Tracing | None = None,
        quota_ledger: QuotaLedger | None = None,
        ledger: RedisLedger | None = None,
        prefix: PrefixRouter | None = None,
        nodes: NodePool | None = None,
    ) -> None:
        self.config = config
        self.tracing = tracing or Tracing()
        # Members of DNS-discovered backend groups; ``config`` lists them among the backends.
        self.members = DiscoveredMembers(config)
        self.fleet = fleet
        self.metrics = metrics
        self.counters = counters
        # The request path's own keep-alive connections to nodes (probes and the node
        # counter use ``session``).
        self.nodes = nodes if nodes is not None else NodePool()
        self.clock = clock
        # The shared ledger (None: reservations are this process's alone).
        self.ledger = ledger
        self.started_at_wall = time.time()
        # Shutdown phases: `draining` makes /ready fail while requests are still
        # served (load balancers stop sending); `shutting_down` refuses new requests.
        self.draining = False
        self.shutting_down = False
        # Requests in progress, by the task serving each (shutdown waits for them).
        self.active: dict[asyncio.Task[object], Exchange] = {}
        # Turn counter breaking ties between equally loaded nodes for pass-through calls.
        self.passthrough_turn = 0
        self.calibration = PromptCalibration(
            lambda model, ratio: metrics.estimate_ratio.labels(model=model).observe(ratio)
        )
        # Per-minute quotas: in this process unless a shared ledger is given.
        self.quotas: QuotaLedger = quota_ledger if quota_ledger is not None else LocalQuotaLedger()
        self.tenancy = Tenancy(lambda: self.config.auth)
        # Prefix-aware placement (consulted only for requests planned with a prefix hint).
        self.prefix = prefix
        # The learned output lengths: Settle teaches them, Plan reads them.
        outputs = OutputModel()
        # The four stages a request passes through, each built with what it needs.
        self.planner = Planner(
            lambda: self.config,
            counters,
            self.calibration,
            fleet,
            # Asked for a node's own count when a stand-in bound comes near a limit.
            node_counter=NodeTokenizer(session, fleet),
            outputs=outputs,
        )
        self.admission = Admission.for_fleet(
            fleet,
            lambda: self.config,
            clock,
            on_decision=self._count_decision,
            tenancy=self.tenancy,
            ledger=ledger,
            prefix=prefix,
        )
        self.relay = Relay(clock, lambda: self.config.health)
        self.settle = Settle(
            self.calibration,
            outputs,
            self.quotas,
            self.tenancy,
            metrics,
            clock,
            lambda: self.config.server.access_log,
        )

    def _count_decision(self, decision: Decision, demand: Demand) -> None:
        # Admissions are counted with their tier when the exchange ends; here: the
        # requests that had to queue (whether or not they were served in the end).
        if isinstance(decision, Wait):
            self.metrics.decisions.labels(tier="-", reason="queued").inc()
