"""Where the gateway keeps its reservations: this process, or a Redis its replicas share."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True, slots=True)
class LedgerConfig:
    """Where reservations are kept: in this process (``url`` empty) or in a Redis that
    every replica shares, so that their sum per backend never exceeds its budget."""

    url: str = ""
    # The name of an environment variable holding the Redis password (never the password).
    password_env: str = ""
    # A replica that stops refreshing its lease for this long loses its reservations.
    lease_s: float = 10.0
    # Bound on every Redis call; past it the replica falls back to its local share. It
    # is measured on the replica's event loop, so it includes the loop's own lag: at
    # 0.25 s a one-worker replica saturated at 128 concurrent requests fell back every
    # few seconds with Redis idle (bench.overhead --ledger, c128).
    timeout_s: float = 1.0
    # Identity of this replica in the ledger (default: host name, port and worker index);
    # a replica restarting with the same identity starts from zero, not on top of its past.
    replica_id: str = ""
    # Prefix of every Redis key, so several fleets can share one Redis.
    namespace: str = "kvgw"
    # The replica count the blind share assumes until Redis has answered once (a replica
    # that starts while Redis is down has never seen the real count).
    fallback_replicas: int = 2
    # What a finished request held stays recorded in Redis this long as this replica's
    # credit: the next request that fits in it is admitted without a Redis round trip.
    # 0: every admission asks Redis.
    credit_hold_s: float = 0.05
    # Credit kept per backend: at most this many times the room of the request released
    # last. Releases come in bursts (one event-loop turn finishes many answers); what is
    # over goes back to Redis at once, and a replica refused there takes it all back.
    credit_max_requests: int = 32

    @property
    def shared(self) -> bool:
        return bool(self.url)


def redis_url_problem(url: str) -> str | None:
    """What is wrong with ``url`` as the ledger's Redis (None: nothing)."""
    expected = f"expected redis://HOST:PORT/DB or rediss://..., got {url!r}"
    try:
        parts = urlsplit(url)
        _ = parts.port  # read lazily: a port that is not a number or past 65535 raises
    except ValueError:
        return expected
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        return expected
    db = parts.path.strip("/")
    if db and not db.isdigit():
        return f"the database after the host must be a number, got {url!r}"
    return None
