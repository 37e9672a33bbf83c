"""Hot reload: apply a new config file to a running gateway, or keep the old one.

Triggered by SIGHUP and, with ``--watch``, by the file changing. In-flight requests keep
their reservations on the backend objects they hold; see :meth:`kvgateway.core.fleet.Fleet.apply`.
"""

from __future__ import annotations

import asyncio
import logging
import os

from aiohttp import web

from kvgateway.config.load import load_config
from kvgateway.config.yamlread import ConfigError

log = logging.getLogger("kvgateway.server.reload")


def reload_config(app: web.Application, path: str) -> bool:
    from kvgateway.core.derived_limits import derive_all
    from kvgateway.server.app import MONITOR, STATE

    state = app[STATE]
    try:
        new = load_config(path)
        derived = derive_all(new)
        for model in new.models:
            state.counters.for_model(model)
    except (ConfigError, ValueError) as exc:
        state.metrics.reloads.labels(result="invalid").inc()
        log.error("reload of %s rejected, still serving the previous config: %s", path, exc)
        return False
    old = state.config
    if (new.server.host, new.server.port) != (old.server.host, old.server.port):
        log.warning(
            "server.host/port changes need a restart; keeping %s:%s",
            old.server.host,
            old.server.port,
        )
    summary = state.fleet.apply(new, derived)
    state.config = new
    app[MONITOR].sync()
    state.admission.rebalance()
    state.metrics.reloads.labels(result="ok").inc()
    log.info(
        "reloaded %s: added=%s removed=%s changed=%s",
        path,
        list(summary.added),
        list(summary.removed),
        list(summary.changed),
    )
    return True


async def watch_file(app: web.Application, path: str, interval: float = 1.0) -> None:
    """Reload when the file's mtime or size changes (polling: works on every filesystem
    and inside ConfigMap volumes, whose symlinks swap atomically)."""

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
            try:
                reload_config(app, path)
            except Exception:
                log.exception("reload of %s failed; still serving the previous config", path)
