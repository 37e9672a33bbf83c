"""The Redis client for the shared ledger, from the config: every call bounded, no
silent retries (a slow Redis must turn into the local-share fallback, not a long wait)."""

from __future__ import annotations

import os
import socket

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from kvgateway.config.ledger import LedgerConfig

# What a Redis call that failed raises: each caller falls back on its own, never fails
# a request.
REDIS_FAILURES = (RedisError, OSError, TimeoutError)

# Connections to Redis per replica (each call holds one for ~0.1-1 ms; the listener one).
POOL_CONNECTIONS = 32


class LedgerConfigError(Exception):
    """The ledger cannot be set up as configured (say so at start-up)."""


def redis_client(cfg: LedgerConfig) -> Redis:
    password = None
    if cfg.password_env:
        password = os.environ.get(cfg.password_env)
        if password is None:
            raise LedgerConfigError(
                f"ledger.password_env names {cfg.password_env!r}, which is not set"
            )
    # hiredis parses the replies when installed (a dependency); no retries: a failed
    # call falls back at once and the heartbeat finds out when Redis is back. Calls wait
    # (up to timeout_s) for one of POOL_CONNECTIONS connections rather than fail: with
    # redis-py's default pool (100 connections, then an error) 128 admissions at once
    # threw a healthy replica into the fallback.
    pool = BlockingConnectionPool.from_url(
        cfg.url,
        max_connections=POOL_CONNECTIONS,
        timeout=cfg.timeout_s,
        password=password,
        socket_timeout=cfg.timeout_s,
        socket_connect_timeout=cfg.timeout_s,
        retry=Retry(NoBackoff(), 0),
        client_name="kvgateway",
    )
    return Redis.from_pool(pool)  # owns the pool: aclose() closes its connections


def default_replica_id(port: int, worker: int | None = None) -> str:
    """Host name and port: stable across restarts of the same replica (a StatefulSet pod,
    a systemd unit), so a restart replaces its old holdings instead of adding to them."""
    rid = f"{socket.gethostname()}:{port}"
    return rid if worker is None else f"{rid}/w{worker}"
