"""Real vLLM nodes for the benchmarks: start them (or reuse kept ones) and read them.

``--real`` in ``bench.projection`` (and friends) runs against vLLM's CPU build
(``scripts/install-vllm.sh``) on the tiny random-weight models of
``tests/support/real_models.py``. Nodes left running by
``python -m tests.support.vllm_nodes NAME... --dir DIR`` are reused when
``KVGATEWAY_REAL_NODES=DIR`` is set; otherwise they are started here and stopped after.
"""

from __future__ import annotations

import contextlib
import json
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


def pin(nodes: Sequence[RealNode], node_cpus: set[int], own_cpus: set[int]) -> None:
    """Every thread of every process in the nodes' process groups onto ``node_cpus``,
    this process (and what it starts from now on: the gateway) onto ``own_cpus``.

    vLLM's CPU engine core and worker poll each other with ``sched_yield`` while they
    serve; a process sharing their CPU then waits for it for seconds at a time (a
    10 ms sleeper beside a serving node overslept by up to 7 s on this machine, on
    either CPU; none with the node on the other CPU). The node alone hardly needs the
    second CPU (192 answers in 109 s on one, 100 s on two), so a comparison of the node
    alone with the node behind a gateway keeps the node on its own CPU."""
    groups = {n.group for n in nodes if n.group is not None}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.getpgid(int(pid)) not in groups:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), node_cpus)
    os.sched_setaffinity(0, own_cpus)


def node_metric(node: RealNode, name: str) -> float:
    return node.metric(name)


@dataclass
class KvSampler:
    """Samples a node's ``vllm:kv_cache_usage_perc``, ``vllm:num_requests_running`` and
    ``vllm:num_requests_waiting`` while a run goes on (mean KV use, mean batch), and
    with ``gateway`` set that gateway's queue depth and the blocks its projection says
    the node holds now: ``series`` keeps every reading (seconds since the start, KV use,
    running, waiting, gateway queue, the node's preemptions so far, gateway blocks)."""

    node: RealNode
    interval_s: float = 0.25
    gateway: str | None = None
    samples: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    series: list[tuple[float, ...]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            node = _read(self.node.url + "/metrics")
            queue = _read(self.gateway + "/metrics") if self.gateway else {}
            blocks = self._gateway_blocks() if self.gateway else 0.0
            if node:
                kv = node.get("vllm:kv_cache_usage_perc", 0.0)
                run = node.get("vllm:num_requests_running", 0.0)
                self.samples.append(kv)
                self.running.append(run)
                self.series.append(
                    (
                        round(time.monotonic() - t0, 2),
                        kv,
                        run,
                        node.get("vllm:num_requests_waiting", 0.0),
                        queue.get("gateway_queue_depth", 0.0),
                        node.get("vllm:num_preemptions_total", 0.0),
                        blocks,
                    )
                )
            self._stop.wait(self.interval_s)

    def _gateway_blocks(self) -> float:
        """The blocks the gateway's projection says its flights on this node hold now."""
        with (
            contextlib.suppress(OSError, ValueError),
            urllib.request.urlopen(f"{self.gateway}/admin/backends", timeout=2) as r,
        ):
            for b in json.loads(r.read()).get("backends", []):
                if b.get("name") == self.node.spec.name:
                    return float((b.get("projected") or {}).get("blocks_now", 0))
        return 0.0

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


def _read(url: str) -> dict[str, float]:
    """A Prometheus text page as name -> value (the first sample of each name)."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=2) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                out.setdefault(name, float(line.rsplit(" ", 1)[1]))
    return out
