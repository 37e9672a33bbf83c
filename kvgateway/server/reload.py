"""Hot reload: apply a new config file to a running gateway, or keep the old one.

Triggered by SIGHUP and, with ``--watch``, by the file changing. A :class:`Reloader`
owns one task that does the work: the signal handler only wakes it, so a reload never
runs on the signal handler's stack, and any failure is logged and counted there. In-flight
requests keep their reservations on the backend objects they hold; see
:meth:`kvgateway.core.fleet.Fleet.apply`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Sequence

from aiohttp import web

from kvgateway import __version__
from kvgateway.config.load import load_config
from kvgateway.config.model import BackendConfig, GatewayConfig
from kvgateway.config.yamlread import ConfigError
from kvgateway.core.backends import Observed
from kvgateway.core.derived_limits import derive_all
from kvgateway.core.fleet import ReloadSummary
from kvgateway.server.appkeys import DNS, KV_EVENTS, MONITOR, STATE
from kvgateway.upstream.kv_events import kv_event_sources

log = logging.getLogger("kvgateway.server.reload")


def reload_config(
    app: web.Application,
    path: str,
    overrides: Callable[[GatewayConfig], GatewayConfig] | None = None,
) -> bool:
    """Load ``path`` and apply it (with ``overrides``: the command line's settings over
    the file's, as at start); False (old config kept) when it is invalid."""
    state = app[STATE]
    try:
        base = load_config(path, encodings=state.counters.encodings)
        if overrides is not None:
            base = overrides(base)
        # Members of DNS groups that survive the reload are kept, not drained.
        new = state.members.preview(base)
        derived = derive_all(new)
        for model in new.models:
            state.counters.encodings.get(model.tokenizer.encoding)
    except (ConfigError, ValueError) as exc:
        state.metrics.reloads.labels(result="invalid").inc()
        log.error("reload of %s rejected, still serving the previous config: %s", path, exc)
        return False
    old = state.live()
    if (new.server.host, new.server.port) != (old.server.host, old.server.port):
        log.warning(
            "server.host/port changes need a restart; keeping %s:%s",
            old.server.host,
            old.server.port,
        )
    if new.ledger.shared and new.ledger != old.ledger:
        log.warning("ledger settings take effect on restart; the running ledger is unchanged")
    for changed in restart_only(old, new):
        log.warning("%s takes effect on restart; keeping the running value", changed)
    summary = apply_config(app, new, derived)
    if new.routing.policy != old.routing.policy:
        build = state.metrics.build_info
        build.labels(version=__version__, policy=old.routing.policy).set(0)
        build.labels(version=__version__, policy=new.routing.policy).set(1)
    # Only once applied: a DNS group added, removed or changed is looked up from now on
    # with its new settings, from the members it has.
    state.members.rebase(base)
    app[DNS].update(new.dns_groups, state.members.members)
    state.metrics.reloads.labels(result="ok").inc()
    log.info(
        "reloaded %s: added=%s removed=%s changed=%s",
        path,
        list(summary.added),
        list(summary.removed),
        list(summary.changed),
    )
    return True


def restart_only(old: GatewayConfig, new: GatewayConfig) -> list[str]:
    """Settings a reload changed that only a restart applies (the listener's keep-alive,
    the log format, the DNS resolver, tracing); host, port and the ledger are said apart."""
    out = [
        f"server.{key}"
        for key in ("keepalive_timeout_s", "log_format")
        if getattr(new.server, key) != getattr(old.server, key)
    ]
    out += [key for key in ("discovery", "tracing") if getattr(new, key) != getattr(old, key)]
    return out


def apply_config(
    app: web.Application, new: GatewayConfig, derived: dict[str, Observed] | None = None
) -> ReloadSummary:
    """Make ``new`` the running config: the fleet adds, keeps and drains backends, the
    monitor follows, and waiters are offered whatever changed. Reloads and DNS
    membership changes both come through here."""
    state = app[STATE]
    summary = state.fleet.apply(new, derive_all(new) if derived is None else derived)
    state.live.value = new
    app[MONITOR].sync()
    app[KV_EVENTS].follow(kv_event_sources(new))
    # What was learned of backends no longer in service goes (DNS members come and go).
    present = {b.name for b in state.fleet.active}
    state.calibration.keep_backends(present)
    if state.prefix is not None:
        state.prefix.index.keep_backends(present)
    state.admission.rebalance()
    return summary


class FleetMembers:
    """Where DNS discovery sends a group's members: applied as a config (see
    :class:`kvgateway.core.membership.DiscoveredMembers`)."""

    def __init__(self, app: web.Application) -> None:
        self._app = app

    def set_members(self, group: str, members: Sequence[BackendConfig]) -> None:
        state = self._app[STATE]
        summary = apply_config(self._app, state.members.set_members(group, members))
        if summary.added or summary.removed:
            log.info(
                "dns group %s: added=%s draining=%s",
                group,
                list(summary.added),
                list(summary.removed),
            )


class Reloader:
    """Runs reloads of one config file on its own task, one at a time."""

    def __init__(
        self,
        app: web.Application,
        path: str,
        overrides: Callable[[GatewayConfig], GatewayConfig] | None = None,
    ) -> None:
        self._app = app
        self._path = path
        self._overrides = overrides
        self._wanted = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="config-reload")

    def request(self) -> None:
        """Ask for a reload (safe to call from a signal handler)."""
        self._wanted.set()

    async def _run(self) -> None:
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            try:
                reload_config(self._app, self._path, self._overrides)
            except Exception:
                self._app[STATE].metrics.reloads.labels(result="error").inc()
                log.exception("reload of %s failed; still serving the previous config", self._path)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def watch_file(reload: Callable[[], None], path: str, interval: float = 1.0) -> None:
    """Call ``reload`` (:meth:`Reloader.request`) when the file's mtime or size changes
    (polling: works on every filesystem and inside ConfigMap volumes, whose symlinks swap
    atomically)."""

    def stamp() -> tuple[float, int] | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_mtime, st.st_size)

    last = stamp()
    while True:
        await asyncio.sleep(interval)
        now = stamp()
        if now is not None and now != last:
            last = now
            reload()
