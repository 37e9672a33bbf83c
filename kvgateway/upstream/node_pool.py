"""Keep-alive connections to nodes, per origin, for the request path (:mod:`.http1`).

A connection whose response was read to its end goes back to its origin's idle list
(most recent first, closed after ``idle_s`` unused); anything else is closed. A request
on a reused connection that the node closed before answering a byte (the keep-alive
race: it closed an idle connection as the request went out) is sent once more on a new
connection.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvgateway.upstream.http1 import ConnectFailed, Connection, ConnectTimedOut, Disconnected

# A connect deadline seen this much later than set was missed by the loop, not the node.
LATE_S = 0.5


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a backend URL points: the pool's key, and what each request needs of it."""

    scheme: str
    host: str
    port: int
    netloc: str
    base_path: str

    @classmethod
    def of(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.netloc, parts.path.rstrip("/"))


class NodePool:
    """Keep-alive connections per node origin (scheme, host, port), most recent first."""

    def __init__(self, *, idle_s: float = 30.0, max_idle: int = 512) -> None:
        self._idle_s = idle_s
        self._max_idle = max_idle
        self._idle: dict[Origin, list[Connection]] = {}
        self._origins: dict[str, Origin] = {}
        self._ssl: ssl.SSLContext | None = None

    def origin(self, url: str) -> Origin:
        o = self._origins.get(url)
        if o is None:
            if len(self._origins) > 4096:
                self._origins.clear()
            o = self._origins[url] = Origin.of(url)
        return o

    async def request(
        self,
        url: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        connect_s: float,
    ) -> Connection:
        """POST ``body`` to ``url + path``; returns the connection once the response head
        is in (the caller reads the body, then :meth:`release` s it)."""
        o = self.origin(url)
        head = _request_head(o, path, len(body), headers)
        conn = self._take(o)
        if conn is not None:
            try:
                await conn.send(head, body)
                return conn
            except Disconnected:
                conn.close()
                if conn.received:
                    raise
            except BaseException:
                conn.close()
                raise
        conn = await self._connect(o, connect_s)
        try:
            await conn.send(head, body)
        except BaseException:
            conn.close()
            raise
        return conn

    def release(self, conn: Connection, origin: Origin, *, ending: bool = False) -> None:
        """Back to the pool if its response was read to the end, or (``ending``: its
        reader saw the stream's own end marker) only the body's end may still come, which
        the connection reads on its own; else closed. (A stream whose client left is
        closed: that is how the node learns to abort it.)"""
        if not (conn.reusable or (ending and conn.ending)):
            conn.close()
            return
        idle = self._idle.setdefault(origin, [])
        if len(idle) >= self._max_idle:
            idle[:] = [c for c in idle if not c.closed]  # the node closed some meanwhile
        if len(idle) >= self._max_idle:
            conn.close()
            return
        loop = asyncio.get_running_loop()
        conn.idle_handle = loop.call_later(self._idle_s, self._expire_idle, conn, origin)
        idle.append(conn)

    def _take(self, o: Origin) -> Connection | None:
        idle = self._idle.get(o)
        if not idle:
            self._idle.pop(o, None)  # no empty list kept per origin ever seen
            return None
        for i in range(len(idle) - 1, -1, -1):  # the most recently used first
            conn = idle[i]
            if conn.reusable:
                del idle[i]
                if conn.idle_handle is not None:
                    conn.idle_handle.cancel()
                    conn.idle_handle = None
                return conn
            if not conn.ending:  # closed by the node, or more came than the body's end
                del idle[i]
                conn.close()
        return None  # none ready (a stream's body end may still be on its way)

    def _expire_idle(self, conn: Connection, o: Origin) -> None:
        idle = self._idle.get(o)
        if idle is not None and conn in idle:
            idle.remove(conn)
            if not idle:
                del self._idle[o]  # an origin gone for good (a DNS member) leaves nothing
        conn.close()

    async def _connect(self, o: Origin, timeout: float) -> Connection:
        loop = asyncio.get_running_loop()
        ctx = None
        if o.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ctx = self._ssl
        began = loop.time()
        try:
            return await _open(o, ctx, timeout)
        except TimeoutError as exc:
            # A deadline this loop saw late (it was busy past it) may have cut a connect
            # the kernel had made: one more try. Seen on time, the node is slow.
            if loop.time() - began <= timeout + LATE_S:
                raise ConnectTimedOut(f"no connection within {timeout:g}s") from exc
        try:
            return await _open(o, ctx, timeout)
        except TimeoutError as exc:
            raise ConnectTimedOut(f"no connection within {timeout:g}s") from exc

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


def _request_head(o: Origin, path: str, length: int, headers: Mapping[str, str]) -> bytes:
    lines = [
        f"POST {o.base_path}{path} HTTP/1.1",
        f"Host: {o.netloc}",
        f"Content-Length: {length}",
        "User-Agent: kv-gateway",
    ]
    for name, value in headers.items():
        # A header carrying a line break would split the request: such a value (it can
        # only come from a client's trace context) is not forwarded.
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            continue
        lines.append(f"{name}: {value}")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("latin-1", "replace")


async def _open(o: Origin, ctx: ssl.SSLContext | None, timeout: float) -> Connection:
    """A new connection to ``o`` within ``timeout`` (TimeoutError otherwise)."""
    loop = asyncio.get_running_loop()
    conn = Connection(loop)
    try:
        async with asyncio.timeout(timeout):
            await loop.create_connection(
                lambda: conn, o.host, o.port, ssl=ctx, server_hostname=o.host if ctx else None
            )
    except TimeoutError:
        conn.close()
        raise
    except (OSError, ssl.SSLError) as exc:
        conn.close()
        raise ConnectFailed(f"{exc.__class__.__name__}: {exc}") from exc
    return conn
