"""`gateway serve`: run the gateway in front of the backends a config describes."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial

from aiohttp import web

from kvgateway.commands.workers import (
    DRAIN_MARGIN_S,
    PARENT_POLL_S,
    bind_to_supervisor,
    supervise,
)
from kvgateway.config.argtypes import log_level, port_number, seconds
from kvgateway.config.ledger import redis_url_problem
from kvgateway.config.load import load_config
from kvgateway.config.model import GatewayConfig
from kvgateway.config.yamlread import ConfigError
from kvgateway.core.backends import DEFAULT_MAX_NUM_SEQS
from kvgateway.core.derived_limits import derive_all
from kvgateway.ledger.connect import LedgerConfigError
from kvgateway.server.app import STATE, create_app
from kvgateway.server.appkeys import WORKER_GAUGES
from kvgateway.server.observability import setup_logging
from kvgateway.server.protocol import GatewayRunner
from kvgateway.server.reload import Reloader, watch_file
from kvgateway.server.state import GatewayState
from kvgateway.server.tenants import tenant_holdings
from kvgateway.tokens.encoding import EncodingCache

log = logging.getLogger("kvgateway.server")

# How often a worker writes its queue depth to the shared metrics.
QUEUE_GAUGE_S = 1.0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the gateway",
        description="Run the OpenAI-compatible gateway in front of the fleet in --config.",
    )
    p.add_argument("--config", required=True, help="gateway YAML (see config/gateway.example.yaml)")
    p.add_argument("--host", help="listen address (default: server.host from the config)")
    p.add_argument(
        "--port", type=port_number, help="listen port (default: server.port from the config)"
    )
    p.add_argument("--watch", action="store_true", help="reload when the config file changes")
    p.add_argument(
        "--drain-delay-s",
        type=seconds,
        help="seconds /ready fails on SIGTERM before the listener closes "
        "(default: server.drain_delay_s from the config)",
    )
    p.add_argument(
        "--log-level", type=log_level, default="INFO", help="root log level (default INFO)"
    )
    p.add_argument(
        "--ledger-url",
        help="redis:// or rediss:// URL of the shared reservation ledger "
        "(default: ledger.url from the config; none: reservations stay in this process)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes sharing the port (SO_REUSEPORT); more than 1 needs the "
        "shared ledger (ledger.url in the config)",
    )
    # Set by --workers on each worker it starts.
    p.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    p.add_argument("--metrics-dir", help=argparse.SUPPRESS)
    p.add_argument("--worker-count", type=int, help=argparse.SUPPRESS)
    p.add_argument("--supervisor-pid", type=int, help=argparse.SUPPRESS)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    # Until the loop's handler is in, a SIGHUP (a reload asked early, or passed on by a
    # supervisor) would end the process: it is noted, and the reload runs once serving.
    reload_pending = threading.Event()
    signal.signal(signal.SIGHUP, lambda signum, frame: reload_pending.set())
    watch_parent: int | None = None
    if args.supervisor_pid is not None:
        # First of all: a worker whose supervisor is killed must not serve on.
        how = bind_to_supervisor(args.supervisor_pid)
        if how == "orphaned":
            sys.stderr.write(
                f"gateway: worker {args.worker_index}: supervisor {args.supervisor_pid} "
                "is gone; not starting\n"
            )
            return 1
        watch_parent = args.supervisor_pid if how == "poll" else None
    # The config's tokenizers, loaded once: the app counts with them, a reload keeps them.
    encodings = EncodingCache()
    try:
        config = load_config(args.config, encodings=encodings)
    except ConfigError as exc:
        sys.stderr.write(f"gateway: invalid config: {exc}\n")
        return 2
    problem = redis_url_problem(args.ledger_url) if args.ledger_url else None
    if problem is not None:
        sys.stderr.write(f"gateway: --ledger-url: {problem}\n")
        return 2
    overrides = partial(_with_overrides, args)
    config = overrides(config)
    if args.workers < 1:
        sys.stderr.write("gateway: --workers must be at least 1\n")
        return 2
    # A worker (re)started by the supervisor checks too: the file may have changed since
    # (a restarted worker without the ledger would reserve every node's whole budget).
    count = max(args.workers, args.worker_count or 1)
    if count > 1 and not config.ledger.shared:
        sys.stderr.write(
            f"gateway: --workers {count} needs the shared ledger: each worker "
            "would otherwise reserve every node's whole KV budget. Set ledger.url "
            "(redis://HOST:PORT/DB) in the config or pass --ledger-url, or run one worker.\n"
        )
        return 2
    setup_logging(config.server.log_format, args.log_level)
    if args.workers > 1:
        server = config.server  # with the command line's overrides
        drain_wait_s = server.drain_delay_s + server.shutdown_grace_s + DRAIN_MARGIN_S
        # Every worker, one restarted after the file changed too, listens where the
        # others do and shares their ledger (a reload keeps these; the file may not).
        args.host, args.port, args.ledger_url = server.host, server.port, config.ledger.url
        return supervise(args, args.workers, config.server.port, drain_wait_s)
    run(
        serve(
            config,
            config_path=args.config,
            overrides=overrides,
            reload_pending=reload_pending,
            watch=args.watch,
            worker=args.worker_index,
            metrics_dir=args.metrics_dir,
            parent=watch_parent,
            encodings=encodings,
        )
    )
    # Stopped and drained: a late SIGTERM (a group's, a supervisor's) must not turn the
    # clean exit into a kill while the interpreter tears down.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    return 0


def _with_overrides(args: argparse.Namespace, config: GatewayConfig) -> GatewayConfig:
    """The command line's settings over the file's: at start and at every reload."""
    server = replace(
        config.server,
        host=args.host or config.server.host,
        port=args.port if args.port is not None else config.server.port,
        drain_delay_s=(
            args.drain_delay_s if args.drain_delay_s is not None else config.server.drain_delay_s
        ),
    )
    config = replace(config, server=server)
    if args.ledger_url:
        config = replace(config, ledger=replace(config.ledger, url=args.ledger_url))
    if args.worker_count is not None:
        # Until Redis answers a worker has never seen the live count, and its blind share
        # must not assume fewer replicas than its own supervisor runs.
        floor = max(config.ledger.fallback_replicas, args.worker_count)
        config = replace(config, ledger=replace(config.ledger, fallback_replicas=floor))
    return config


def run(main: Awaitable[None]) -> None:
    """Run on uvloop when available, through a loop factory (no global policy)."""
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(_as_coroutine(main))


async def _as_coroutine(aw: Awaitable[None]) -> None:
    await aw


async def serve(
    config: GatewayConfig,
    *,
    config_path: str | None = None,
    overrides: Callable[[GatewayConfig], GatewayConfig] | None = None,
    reload_pending: threading.Event | None = None,
    watch: bool = False,
    ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    worker: int | None = None,
    metrics_dir: str | None = None,
    parent: int | None = None,
    encodings: EncodingCache | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM (or ``stop`` is set), then shut down in order:
    /ready fails, the listener closes, in-flight requests get ``shutdown_grace_s`` to
    finish, the rest are cancelled, then the upstream session and monitor close.
    ``parent``: also stop when this process is no longer our parent (a worker whose
    supervisor went, where the kernel cannot signal it)."""
    try:
        derived = derive_all(config)
    except ConfigError as exc:
        raise SystemExit(f"gateway: invalid config: {exc}") from exc
    try:
        app = create_app(
            config, derived=derived, worker=worker, metrics_dir=metrics_dir, encodings=encodings
        )
    except LedgerConfigError as exc:
        raise SystemExit(f"gateway: {exc}") from exc
    # Draining is ours (see _shutdown); aiohttp only has to close what is left.
    runner = GatewayRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(
        runner,
        config.server.host,
        config.server.port,
        backlog=2048,
        reuse_port=worker is not None,
    )
    await site.start()
    # What start-up built (config, tokenizers, templates, metrics, modules: ~70k objects)
    # lives as long as the process: out of the collector's sight, a full collection no
    # longer walks it (60-80 ms each, measured, a pause every request in flight shares).
    gc.collect()
    gc.freeze()
    url = f"http://{config.server.host}:{config.server.port}"
    log.info("gateway listening on %s (policy %s)", url, config.routing.policy)
    _warn_unknown_slots(app[STATE])
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    reloader = Reloader(app, config_path, overrides) if config_path is not None else None
    if reloader is not None:
        loop.add_signal_handler(signal.SIGHUP, reloader.request)
        if reload_pending is not None and reload_pending.is_set():
            reloader.request()  # asked while starting: the file may have changed since
    watcher = (
        asyncio.create_task(watch_file(reloader.request, config_path), name="config-watch")
        if watch and reloader is not None and config_path
        else None
    )
    orphan_watch = (
        asyncio.create_task(_watch_parent(parent, stop), name="supervisor-watch")
        if parent is not None
        else None
    )
    queue_gauge = (
        asyncio.create_task(_publish_worker_gauges(app), name="worker-gauges")
        if metrics_dir is not None
        else None
    )
    if ready is not None:
        ready(url)
    try:
        await stop.wait()
    finally:
        # Draining: a further signal (systemd's SIGTERM to the group beside the
        # supervisor's, a second Ctrl-C, a SIGHUP) must not end the process with its
        # default action and cut the streams the grace period is for.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, _already_stopping, sig)
        for task in (watcher, orphan_watch, queue_gauge):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if reloader is not None:
            await reloader.close()
        await _shutdown(app, runner, site, app[STATE].live())  # as last reloaded


def _warn_unknown_slots(state: GatewayState) -> None:
    """Class floors keep sequence slots as well as KV: on a node whose max_num_seqs is
    neither configured nor derived (vLLM does not report it), slots are judged against
    vLLM's default, and a floor cannot hold them if the node runs with fewer."""
    if not any(c.floor_share > 0 for c in state.live().auth.classes):
        return
    unknown = [b.name for b in state.fleet.backends if b.limits.max_num_seqs.value is None]
    if unknown:
        log.warning(
            "class floors hold sequence slots only where max_num_seqs is known; set it on "
            "backends %s (their nodes' --max-num-seqs; %d assumed)",
            ", ".join(unknown),
            DEFAULT_MAX_NUM_SEQS,
        )


def _already_stopping(sig: signal.Signals) -> None:
    log.info("%s while shutting down: ignored (the drain goes on)", sig.name)


async def _watch_parent(parent: int, stop: asyncio.Event) -> None:
    # A parent's end is no event this loop can await: it is looked for.
    while os.getppid() == parent:  # noqa: ASYNC110
        await asyncio.sleep(PARENT_POLL_S)
    log.warning("supervisor %d is gone; shutting down", parent)
    stop.set()


async def _publish_worker_gauges(app: web.Application) -> None:
    """With workers, a scrape reaches one of them: what each holds (its queue, its
    reservations per backend and per tenant) and how it finds each backend are written
    here every second, for /metrics to sum (or take the lowest of) over the live workers
    (a single process reads its own at the scrape)."""
    state = app[STATE]
    gauges = app[WORKER_GAUGES]
    others = state.ledger.others_tokens if state.ledger is not None else None
    while True:
        state.metrics.queue_depth.set(state.admission.queue_depth)
        holdings = tenant_holdings(state.tenancy, state.quotas, state.clock())
        gauges.publish(state.fleet.backends, others, holdings, state.clock())
        await asyncio.sleep(QUEUE_GAUGE_S)


async def _shutdown(
    app: web.Application, runner: web.AppRunner, site: web.TCPSite, config: GatewayConfig
) -> None:
    """uvicorn's order: fail readiness, stop accepting, drain with a deadline, end the
    rest with a reason, close resources.

    While in-flight work drains, requests that still arrive on connections already open
    are served (the nodes are fine), answered with ``Connection: close``; idle keep-alive
    connections are closed at once, so clients reconnect to another replica.
    """
    state = app[STATE]
    server = config.server
    state.draining = True
    if server.drain_delay_s > 0:
        log.info("shutting down: /ready fails for %gs first", server.drain_delay_s)
        await asyncio.sleep(server.drain_delay_s)
    await site.stop()
    if runner.server is not None:
        runner.server.pre_shutdown()  # idle connections close now, busy ones after this answer
    loop = asyncio.get_running_loop()
    deadline = loop.time() + server.shutdown_grace_s
    log.info(
        "listener closed; waiting up to %gs for %d in-flight request(s)",
        server.shutdown_grace_s,
        len(state.active),
    )
    while state.active and loop.time() < deadline:
        await asyncio.wait(set(state.active), timeout=deadline - loop.time())
    state.shutting_down = True
    if state.active:
        log.warning("ending %d request(s) still running after the grace period", len(state.active))
        # Their deadlines move to now: each ends with a proper answer (503, or an error
        # event on a stream) and releases what it holds; nothing is un-cancelled.
        left = dict(state.active)
        for ex in left.values():
            ex.end_now()
        await asyncio.wait(set(left), timeout=2.0)
    await runner.cleanup()
    log.info("gateway stopped")
