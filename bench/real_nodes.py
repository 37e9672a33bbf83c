"""Real vLLM nodes for the benchmarks: start them (or reuse kept ones) and read them.

``--real`` in ``bench.projection`` (and friends) runs against vLLM's CPU build
(``scripts/install-vllm.sh``) on the tiny random-weight models of
``tests/support/real_models.py``. Nodes left running by
``python -m tests.support.vllm_nodes NAME... --dir DIR`` are reused when
``KVGATEWAY_REAL_NODES=DIR`` is set; otherwise they are started here and stopped after.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.real_fleet import models_root
from tests.support.vllm_nodes import NodeSpec, RealNode, kept_node, running, vllm_missing


@contextlib.contextmanager
def real_nodes(specs: Sequence[NodeSpec]) -> Iterator[dict[str, RealNode]]:
    reason = vllm_missing()
    if reason is not None:
        raise SystemExit(reason)
    kept = os.environ.get("KVGATEWAY_REAL_NODES")
    if kept:
        found = {s.name: kept_node(Path(kept), s) for s in specs}
        if all(found.values()):
            yield {k: v for k, v in found.items() if v is not None}
            return
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    with running(specs, work, models_root()) as nodes:
        yield {n.spec.name: n for n in nodes}


def node_metric(node: RealNode, name: str) -> float:
    return node.metric(name)


@dataclass
class KvSampler:
    """Samples a node's ``vllm:kv_cache_usage_perc`` and ``vllm:num_requests_running``
    while a run goes on (mean KV use, mean batch)."""

    node: RealNode
    interval_s: float = 0.25
    samples: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _run(self) -> None:
        url = self.node.url + "/metrics"
        while not self._stop.is_set():
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
                for line in resp.read().decode().splitlines():
                    if line.startswith("vllm:kv_cache_usage_perc"):
                        self.samples.append(float(line.rsplit(" ", 1)[1]))
                    elif line.startswith("vllm:num_requests_running"):
                        self.running.append(float(line.rsplit(" ", 1)[1]))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> KvSampler:
        self._thread = threading.Thread(target=self._run, name="kv-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    @property
    def mean(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else 0.0

    @property
    def mean_running(self) -> float:
        return sum(self.running) / len(self.running) if self.running else 0.0


def wait_idle(node: RealNode, timeout: float = 120.0) -> None:
    """Until the node runs and queues nothing (a run's aborted requests have left)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.metric("vllm:num_requests_running") + node.metric("vllm:num_requests_waiting") == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"node {node.spec.name} still busy after {timeout} s")
