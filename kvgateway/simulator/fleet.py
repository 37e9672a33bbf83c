"""Running simulated nodes on loopback ports: in this process, or one process each.

In-process (default) every node is its own aiohttp runner and site on the current event
loop, which is what tests and ``gateway demo`` want. ``processes=True`` starts each node
as ``python -m kvgateway.simulator --node-json ...`` so a benchmark on a small machine does
not run every node's engine and streams on one core; the child prints ``READY <url>``
once it listens.

    async with start_fleet(load_fleet_config("config/demo.yaml")) as fleet:
        fleet.urls            # {"small-1": "http://127.0.0.1:9101", ...}
        fleet["small-1"].node  # the SimNode (in-process only): faults, driver, metrics
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field

from aiohttp import web

from kvgateway.simulator.fleetconfig import NodeSpec
from kvgateway.simulator.node import NODE_KEY, SimNode
from kvgateway.simulator.server import create_node_app
from kvgateway.simulator.settings import NodeSettings, validate
from kvgateway.tokens.encoding import EncodingCache

log = logging.getLogger("kvgateway.simulator.fleet")

# Open streams get this long to finish when a node stops; the engine fails them first,
# so in practice they end at once.
SHUTDOWN_TIMEOUT_S = 5.0
PROCESS_STOP_TIMEOUT_S = 10.0


@dataclass(slots=True)
class RunningNode:
    spec: NodeSpec
    url: str
    app: web.Application | None
    _stop: Callable[[], Awaitable[None]] = field(repr=False)
    _stopped: bool = field(default=False, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def settings(self) -> NodeSettings:
        return self.spec.settings

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def node(self) -> SimNode:
        """The node's internals; only for nodes running in this process."""
        if self.app is None:
            raise RuntimeError(f"node {self.name} runs in another process")
        return self.app[NODE_KEY]

    async def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            await self._stop()

    def describe(self) -> str:
        s = self.settings
        return (
            f"{self.name:<12} {self.url:<24} profile={s.profile} "
            f"max_model_len={s.max_model_len} kv_tokens={s.kv_tokens} "
            f"({s.num_gpu_blocks} blocks x {s.block_size}) max_num_seqs={s.max_num_seqs} "
            f"time_scale={s.time_scale:g}"
        )


class SimulatedFleet:
    def __init__(self, nodes: Iterable[RunningNode]) -> None:
        self.nodes: list[RunningNode] = list(nodes)

    @property
    def urls(self) -> dict[str, str]:
        return {n.name: n.url for n in self.nodes}

    def __getitem__(self, name: str) -> RunningNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def __iter__(self) -> Iterator[RunningNode]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)


async def start_node(
    spec: NodeSpec,
    *,
    encodings: EncodingCache | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> RunningNode:
    """Serve one node on ``spec.host:spec.port`` (port 0: any free port) in this loop."""
    # This runner cancels handlers on disconnect, so they need not poll for it.
    app = create_node_app(spec.settings, encodings=encodings, clock=clock, disconnect_poll_s=None)
    runner = web.AppRunner(
        app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT_S, access_log=None
    )
    await runner.setup()
    try:
        sock = _listen(spec.host, spec.port)
    except BaseException:
        await runner.cleanup()
        raise
    try:
        await web.SockSite(runner, sock).start()
    except BaseException:
        sock.close()
        await runner.cleanup()
        raise
    spec = dataclasses.replace(spec, port=int(sock.getsockname()[1]))
    log.info("simulated node %s listening on %s", spec.name, spec.url)

    async def stop() -> None:
        # Stop accepting, then give connections the loop has just accepted two turns to
        # register before the site closes: on Python 3.11 asyncio fails to wrap (and
        # never closes) a socket accepted just before its server closed, and aiohttp's
        # shutdown never sees it. A node restarted under load hits exactly that window.
        loop = asyncio.get_running_loop()
        # (RuntimeError covers loops without remove_reader support.)
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            loop.remove_reader(sock.fileno())
        for _ in range(3):
            await asyncio.sleep(0)
        await runner.cleanup()

    return RunningNode(spec, spec.url, app, stop)


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket we own, so that stopping can pause accepting before closing."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=128)


def spec_to_json(spec: NodeSpec) -> str:
    return json.dumps(
        {"host": spec.host, "port": spec.port, "settings": dataclasses.asdict(spec.settings)}
    )


def spec_from_json(text: str) -> NodeSpec:
    data = json.loads(text)
    settings = NodeSettings(**data["settings"])
    validate(settings, "node")
    return NodeSpec(settings, str(data["host"]), int(data["port"]))


async def start_node_process(spec: NodeSpec, *, ready_timeout: float = 30.0) -> RunningNode:
    """Serve one node from a child process; returns once it listens."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvgateway.simulator",
        "--node-json",
        spec_to_json(spec),
        stdout=asyncio.subprocess.PIPE,
    )

    async def stop() -> None:
        await _terminate(proc)

    try:
        assert proc.stdout is not None
        async with asyncio.timeout(ready_timeout):
            line = (await proc.stdout.readline()).decode().strip()
    except BaseException:
        await stop()
        raise
    if not line.startswith("READY "):
        await stop()
        raise RuntimeError(
            f"simulated node {spec.name} did not start (exit code {proc.returncode})"
        )
    url = line.split(" ", 1)[1]
    port = int(url.rsplit(":", 1)[1])
    return RunningNode(dataclasses.replace(spec, port=port), url, None, stop)


async def _terminate(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(PROCESS_STOP_TIMEOUT_S):
            await proc.wait()
    except TimeoutError:
        log.warning("simulated node process %s ignored SIGTERM; killing it", proc.pid)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


@contextlib.asynccontextmanager
async def start_fleet(
    specs: Iterable[NodeSpec],
    *,
    processes: bool = False,
    encodings: EncodingCache | None = None,
    ready_timeout: float = 30.0,
) -> AsyncIterator[SimulatedFleet]:
    """Start every node; on exit (or if one fails to start) stop them in reverse order."""
    encodings = encodings or EncodingCache()
    async with contextlib.AsyncExitStack() as stack:
        nodes: list[RunningNode] = []
        for spec in specs:
            if processes:
                node = await start_node_process(spec, ready_timeout=ready_timeout)
            else:
                node = await start_node(spec, encodings=encodings)
            stack.push_async_callback(node.stop)
            nodes.append(node)
        yield SimulatedFleet(nodes)
