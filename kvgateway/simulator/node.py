"""One simulated node's parts, bundled for the HTTP handlers."""

from __future__ import annotations

import time
from collections.abc import Callable

from aiohttp import web

from kvgateway.simulator.driver import EngineDriver
from kvgateway.simulator.errors import model_not_found
from kvgateway.simulator.faults import FaultState
from kvgateway.simulator.generation import filler_words
from kvgateway.simulator.kv_events import KVEventPublisher
from kvgateway.simulator.metrics import NodeMetrics
from kvgateway.simulator.settings import NodeSettings
from kvgateway.simulator.tokenizer import NodeTokenizer
from kvgateway.simulator.wire import fingerprint
from kvgateway.tokens.encoding import EncodingCache


class SimNode:
    """Settings, engine driver, tokenizer, metrics and faults of one node."""

    def __init__(
        self,
        settings: NodeSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        encodings: EncodingCache | None = None,
        disconnect_poll_s: float | None = 0.05,
    ) -> None:
        self.settings = settings
        # None when the runner cancels handlers on disconnect (no polling needed).
        self.disconnect_poll_s = disconnect_poll_s
        self.metrics = NodeMetrics(settings)
        self.publisher = (
            KVEventPublisher(settings) if settings.kv_events_endpoint is not None else None
        )
        self.tokenizer = NodeTokenizer(settings, encodings or EncodingCache())
        self.driver = EngineDriver(
            settings,
            self.metrics,
            clock=clock,
            publisher=self.publisher,
            output_ids=_output_ids(self.tokenizer),
        )
        self.faults = FaultState()
        # The W3C trace context of the last request that carried one (vLLM's OpenTelemetry
        # integration would continue that trace): lets tests see propagation.
        self.last_traceparent: str | None = None
        self.created = int(time.time())
        # vLLM's system_fingerprint: one per server, from what defines the node.
        self.fingerprint = fingerprint(
            settings.served_root,
            settings.max_model_len,
            settings.num_gpu_blocks,
            settings.block_size,
            settings.max_num_seqs,
        )

    def check_model(self, model: str | None) -> None:
        """vLLM serves requests without a model with its only model; others get 404."""
        if model is not None and model != self.settings.model:
            raise model_not_found(model, self.settings.model)


def _output_ids(tokenizer: NodeTokenizer) -> tuple[int, ...]:
    """Token ids of the filler words the node streams, if each is one token."""
    ids = [tokenizer.encode(word) for word in filler_words()]
    return tuple(i[0] for i in ids) if all(len(i) == 1 for i in ids) else ()


NODE_KEY = web.AppKey("sim_node", SimNode)
