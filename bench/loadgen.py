"""HTTP/1.1 load generator for the benchmarks: its own process, many keep-alive connections.

Raw asyncio protocols on uvloop (no HTTP client library on the hot path): a connection
sends its next request from the callback that completed the previous one, so the
generator costs ~30-60 us of CPU per request. Every request body is distinct (a counter
tag in the last message), so no cache along the way can answer it.

Workloads (several may run at once in one process):

``closed``  ``concurrency`` connections send back to back (wrk-style).
``rate``    open loop: requests are scheduled at ``rate``/s (evenly spaced) over a pool of
            ``concurrency`` connections; latency counts from the scheduled time, so a
            request that waited for a free connection is charged for it.
``hold``    ``concurrency`` streaming requests opened at ``ramp`` per second and held until
            the server ends them (memory per open stream).

Bodies: ``distinct`` (one ~N-token user message with a unique tag at the start of every
8th line), ``history`` (the same long N-token history every time plus a new short last
message with a unique tag), ``small`` (a short distinct message). Latency is to the last byte, TTFC to the first body byte.

    python -m bench.loadgen '<json spec>'   # prints JSON-line events, the last is the result

The spec: {"port": P, "workloads": [{...}], "warmup_s": 1, "duration_s": 5,
"cpu_pids": {"gateway": [pid, ...]}}; see :class:`Workload` for a workload's fields.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

SERVED = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass
class Workload:
    name: str = "load"
    mode: str = "closed"  # closed | rate | hold
    concurrency: int = 32
    rate: float = 0.0
    ramp: float = 2000.0  # connections opened per second (hold)
    body: str = "distinct"  # distinct | history | small
    prompt_tokens: int = 1000
    text: str = "english"
    stream: bool = False
    max_tokens: int = 16
    model: str = SERVED
    path: str = "/v1/chat/completions"


def _esc(s: str) -> bytes:
    return json.dumps(s)[1:-1].encode()


class BodyMaker:
    """Request bytes for one workload; ``make(i)`` differs for every ``i``."""

    def __init__(self, w: Workload, host: str, salt: str) -> None:
        from bench.texts import text

        tail = b'"}],"max_tokens":%d,"stream":%s' % (
            w.max_tokens,
            b"true" if w.stream else b"false",
        )
        if w.stream:
            tail += b',"stream_options":{"include_usage":true}'
        tail += b"}"
        model = json.dumps(w.model).encode()
        if w.body == "history":
            history = text(w.text, w.prompt_tokens)
            head = (
                b'{"model":%s,"messages":[{"role":"system","content":"You are a helpful '
                b'assistant."},{"role":"user","content":"%s"},{"role":"assistant","content":'
                b'"Here is a summary of that."},{"role":"user","content":"' % (model, _esc(history))
            )
            rest = _esc(" Now explain the second part again, more briefly, please.")
        elif w.body == "small":
            head = b'{"model":%s,"messages":[{"role":"user","content":"' % model
            rest = _esc(" Say hello.")
        else:
            head = b'{"model":%s,"messages":[{"role":"user","content":"' % model
            rest = b" " + _esc(text(w.text, w.prompt_tokens))
        # A distinct prompt carries its tag at the start of every 8th line too: the
        # gateway caches counts of line-aligned chunks of >= 1 KB, and a tag at the start
        # alone would leave every later chunk a cache hit. The tag starts with a letter,
        # so those lines still start where the chunker may cut.
        lines = rest.split(b"\\n")
        self._lines = (
            [b"\\n".join(lines[i : i + 8]) for i in range(0, len(lines), 8)]
            if w.body == "distinct"
            else [rest]
        )
        self._head = head
        self._rest = rest + tail
        self._tail = tail
        self._salt = salt.encode()
        self._req = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n" % (
            w.path.encode(),
            host.encode(),
        )
        self.size = len(head) + len(self._rest) + 24

    def parts(self) -> tuple[bytes, list[bytes], bytes]:
        """The body's head, its line groups (a tag goes before each) and its tail, for
        wrk's Lua script."""
        return self._head, self._lines, self._tail

    def make(self, i: int) -> bytes:
        tag = b"r%s-%dz " % (self._salt, i)
        if len(self._lines) > 1:
            rest = (b"\\nr%dz " % i).join(self._lines) + self._tail
        else:
            rest = self._rest
        body = b"%s%s%s" % (self._head, tag, rest)
        return b"%sContent-Length: %d\r\n\r\n%s" % (self._req, len(body), body)


@dataclass
class Stats:
    latencies: list[float] = field(default_factory=list)
    ttfc: list[float] = field(default_factory=list)
    other: dict[int, list[float]] = field(default_factory=dict)  # non-200 latencies
    statuses: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    done_in_window: int = 0
    sent: int = 0
    open_streams: int = 0
    max_open_streams: int = 0
    body_bytes: int = 0


class Conn(asyncio.Protocol):
    """One keep-alive connection; parses Content-Length and chunked responses."""

    def __init__(self, gen: Generator, wl: WorkloadRun) -> None:
        self.gen = gen
        self.wl = wl
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.reset()
        self.connected = asyncio.get_running_loop().create_future()
        self.closed = False

    def reset(self) -> None:
        self.busy = False
        self.in_head = True
        self.status = 0
        self.remaining = -1  # body bytes left (Content-Length)
        self.chunked = False
        self.chunk_left = -1  # bytes (incl. CRLF) left in the current chunk, -1: need size
        self.started = 0.0
        self.first = 0.0
        self.got = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if not self.connected.done():
            self.connected.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.connected.done():
            self.connected.set_exception(exc or ConnectionError("closed"))
        if self.busy:
            self.wl.stats.errors["closed_mid_response"] += 1
            self.finish(ok=False)

    def send(self, data: bytes, started: float) -> None:
        assert self.transport is not None
        self.reset()
        self.busy = True
        self.started = started
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        buf = self.buf
        buf += data
        if self.in_head:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end]).lower()
            del buf[: end + 4]
            self.in_head = False
            self.status = int(head[9:12])
            i = head.find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                self.remaining = int(head[i + 17 : j if j > 0 else None])
            elif b"\r\ntransfer-encoding: chunked" in head:
                self.chunked = True
            else:
                self.remaining = 0
        if buf and not self.first:
            self.first = now
            if self.wl.w.mode == "hold":
                self.wl.stream_opened(now - self.started)
        if not self.chunked:
            take = min(len(buf), self.remaining)
            self.got += take
            self.remaining -= take
            del buf[:take]
            if self.remaining == 0:
                self.finish(ok=True, now=now)
            return
        pos = 0
        n = len(buf)
        while pos < n:
            if self.chunk_left < 0:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = int(bytes(buf[pos:eol]).split(b";")[0], 16)
                if size == 0:
                    if n - eol < 4:
                        break  # the last chunk's final CRLF has not arrived yet
                    del buf[: eol + 4]
                    self.finish(ok=True, now=now)
                    return
                pos = eol + 2
                self.chunk_left = size + 2
            take = min(self.chunk_left, n - pos)
            self.got += take
            self.chunk_left -= take
            pos += take
            if self.chunk_left == 0:
                self.chunk_left = -1
        del buf[:pos]

    def finish(self, *, ok: bool, now: float = 0.0) -> None:
        if not self.busy:
            return
        self.busy = False
        now = now or time.perf_counter()
        self.wl.complete(self, ok, now)


class WorkloadRun:
    def __init__(self, gen: Generator, w: Workload, index: int) -> None:
        self.gen = gen
        self.w = w
        self.stats = Stats()
        self.bodies = BodyMaker(w, f"127.0.0.1:{gen.port}", f"{os.getpid()}.{index}")
        self.counter = 0
        self.conns: list[Conn] = []
        self.idle: list[Conn] = []
        self.backlog: list[float] = []  # scheduled start times waiting for a connection
        self.all_done = asyncio.get_running_loop().create_future()
        self.all_open = asyncio.get_running_loop().create_future()
        self.finished_holds = 0

    def next_request(self) -> bytes:
        self.counter += 1
        self.stats.sent += 1
        return self.bodies.make(self.counter)

    async def connect(self) -> Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            lambda: Conn(self.gen, self), "127.0.0.1", self.gen.port
        )
        self.conns.append(conn)
        return conn

    def stream_opened(self, ttfc: float) -> None:
        s = self.stats
        s.ttfc.append(ttfc)
        s.open_streams += 1
        s.max_open_streams = max(s.max_open_streams, s.open_streams)
        if s.open_streams == self.w.concurrency and not self.all_open.done():
            self.all_open.set_result(None)
            self.gen.event("all_open", workload=self.w.name)

    def complete(self, conn: Conn, ok: bool, now: float) -> None:
        s = self.stats
        gen = self.gen
        if ok:
            s.statuses[conn.status] += 1
        s.body_bytes += conn.got
        if self.w.mode == "hold":
            if conn.first:
                s.open_streams -= 1
            self.finished_holds += 1
            s.latencies.append(now - conn.started)
            if self.finished_holds >= self.w.concurrency and not self.all_done.done():
                self.all_done.set_result(None)
            return
        if gen.measuring and conn.started >= gen.window_start and now <= gen.window_end:
            s.done_in_window += 1
            if ok and conn.status == 200:
                s.latencies.append(now - conn.started)
                s.ttfc.append((conn.first or now) - conn.started)
            elif ok:
                s.other.setdefault(conn.status, []).append(now - conn.started)
        if conn.closed:
            return
        if now >= gen.window_end:
            self.idle.append(conn)
            return
        if self.w.mode == "closed":
            conn.send(self.next_request(), time.perf_counter())
        elif self.backlog:
            conn.send(self.next_request(), self.backlog.pop(0))
        else:
            self.idle.append(conn)

    async def run(self) -> None:
        w = self.w
        gen = self.gen
        if w.mode == "hold":
            await self._hold()
            return
        for _ in range(w.concurrency):
            self.idle.append(await self.connect())
        await gen.ready.wait()
        if w.mode == "closed":
            for conn in self.idle:
                conn.send(self.next_request(), time.perf_counter())
            self.idle.clear()
            return
        # Open loop, evenly spaced.
        interval = 1.0 / w.rate
        t = time.perf_counter()
        while t < gen.window_end:
            now = time.perf_counter()
            if t > now:
                await asyncio.sleep(t - now)
            if self.idle:
                self.idle.pop().send(self.next_request(), t)
            else:
                self.backlog.append(t)
            t += interval

    async def _hold(self) -> None:
        w = self.w
        gen = self.gen
        await gen.ready.wait()
        interval = 1.0 / w.ramp
        t = time.perf_counter()
        pending: list[asyncio.Task[None]] = []

        async def one() -> None:
            try:
                conn = await self.connect()
            except OSError as exc:
                self.stats.errors[f"connect:{exc.__class__.__name__}"] += 1
                self.finished_holds += 1
                return
            conn.send(self.next_request(), time.perf_counter())

        for i in range(w.concurrency):
            now = time.perf_counter()
            if t > now:
                await asyncio.sleep(t - now)
            pending.append(asyncio.create_task(one(), name=f"hold-{i}"))
            t += interval
        await asyncio.gather(*pending)
        if self.finished_holds >= w.concurrency and not self.all_done.done():
            self.all_done.set_result(None)
        await self.all_done


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


class Generator:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.port = int(spec["port"])
        self.warmup = float(spec.get("warmup_s", 1.0))
        self.duration = float(spec.get("duration_s", 5.0))
        self.hold_timeout = float(spec.get("hold_timeout_s", 120.0))
        self.hold_s = float(spec.get("hold_s", 3.0))
        self.cpu_pids: dict[str, list[int]] = spec.get("cpu_pids", {})
        self.workloads = [
            WorkloadRun(self, Workload(**w), i) for i, w in enumerate(spec["workloads"])
        ]
        self.ready = asyncio.Event()
        self.measuring = False
        self.window_start = float("inf")
        self.window_end = float("inf")

    def event(self, name: str, **kw: Any) -> None:
        print(json.dumps({"event": name, "t": time.time(), **kw}), flush=True)

    async def run(self) -> dict[str, Any]:
        from bench.procs import cpu_times, tree

        tasks = [asyncio.create_task(w.run(), name=f"workload-{w.w.name}") for w in self.workloads]
        await asyncio.sleep(0)
        holds = all(w.w.mode == "hold" for w in self.workloads)
        # Connections first (so connect costs are outside the window), then warm up.
        await asyncio.sleep(0.2)
        start = time.perf_counter()
        self.window_start = start + (0 if holds else self.warmup)
        self.window_end = float("inf") if holds else self.window_start + self.duration
        self.ready.set()
        await asyncio.sleep(max(0.0, self.window_start - time.perf_counter()))
        pids = {k: [p for pid in v for p in tree(pid)] for k, v in self.cpu_pids.items()}
        cpu0 = {k: cpu_times(v) for k, v in pids.items()}
        self_cpu0 = sum(os.times()[:2])
        self.measuring = True
        self.event("window_start")
        if holds:
            # Until every stream is open (or has ended), then ``hold_s`` more.
            try:
                async with asyncio.timeout(self.hold_timeout):
                    for w in self.workloads:
                        await asyncio.wait(
                            [w.all_open, w.all_done], return_when=asyncio.FIRST_COMPLETED
                        )
                    await asyncio.sleep(self.hold_s)
            except TimeoutError:
                self.event("hold_timeout")
        else:
            await asyncio.sleep(self.window_end - time.perf_counter())
        wall = time.perf_counter() - self.window_start
        cpu1 = {k: cpu_times(v) for k, v in pids.items()}
        self_cpu = sum(os.times()[:2]) - self_cpu0
        self.event("window_end")
        for t in tasks:
            t.cancel()
        out: dict[str, Any] = {
            "wall_s": wall,
            "cpu_s": {k: sum(cpu1[k]) - sum(cpu0[k]) for k in cpu0},
            "cpu_sys_s": {k: cpu1[k][1] - cpu0[k][1] for k in cpu0},
            "loadgen_cpu_s": self_cpu,
            "workloads": {},
        }
        for w in self.workloads:
            s = w.stats
            done = s.done_in_window if w.w.mode != "hold" else s.max_open_streams
            out["workloads"][w.w.name] = {
                "requests": done,
                "ok": len(s.latencies),
                "rps": done / wall if wall > 0 else 0.0,
                "statuses": {str(k): v for k, v in s.statuses.items()},
                "errors": dict(s.errors),
                "sent": s.sent,
                "body_bytes_sent_each": w.bodies.size,
                "p50_ms": _ms(_pct(s.latencies, 0.5)),
                "p99_ms": _ms(_pct(s.latencies, 0.99)),
                "max_ms": _ms(max(s.latencies, default=None)),
                "ttfc_p50_ms": _ms(_pct(s.ttfc, 0.5)),
                "ttfc_p99_ms": _ms(_pct(s.ttfc, 0.99)),
                "max_open_streams": s.max_open_streams,
                "non_200": {
                    str(k): {
                        "count": len(v),
                        "p50_ms": _ms(_pct(v, 0.5)),
                        "p99_ms": _ms(_pct(v, 0.99)),
                    }
                    for k, v in s.other.items()
                },
            }
        for w in self.workloads:
            for c in w.conns:
                if c.transport is not None:
                    c.transport.close()
        return out


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 3)


async def _main(spec: dict[str, Any]) -> None:
    gen = Generator(spec)
    result = await gen.run()
    print(json.dumps({"event": "result", **result}), flush=True)


def main() -> None:
    import uvloop

    from bench.procs import raise_nofile

    raise_nofile()
    spec = json.loads(sys.argv[1])
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_main(spec))


if __name__ == "__main__":
    main()
