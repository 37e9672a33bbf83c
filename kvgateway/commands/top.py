"""`gateway top`: a live terminal view of the fleet, read from ``GET /admin/backends``.

:func:`render` is a pure function (the admin JSON in, one text frame out) so it is
tested without sockets; :func:`run` is the thin I/O loop around it: one aiohttp session,
a bounded timeout per poll, an ANSI clear-and-redraw per frame. ``--once`` prints one
plain frame and exits, for scripts and bug reports.

The admin JSON comes over the network, so the renderer never trusts its shape: a missing
or mistyped field shows as ``-`` rather than crashing the view an operator is using
during an incident.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

API_KEY_ENV = "GATEWAY_API_KEY"
BAR_WIDTH = 20
# Clear screen and move the cursor home; redraw the whole frame each time.
CLEAR = "\x1b[H\x1b[2J"


class TopError(Exception):
    """The admin API could not be read; the message is meant for the operator."""


# --- pure rendering -----------------------------------------------------------------------


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _count(value: Any) -> str:
    """Compact token counts: 950, 12.3k, 1.20M."""
    n = _num(value)
    if n is None:
        return "-"
    if abs(n) >= 1_000_000:
        return f"{n / 1_000_000:.2f}M"
    if abs(n) >= 100_000:
        return f"{n / 1000:.0f}k"
    if abs(n) >= 1000:
        return f"{n / 1000:.1f}k"
    return f"{n:.0f}"


def _bar(used: float | None, total: float | None, width: int = BAR_WIDTH) -> str:
    if used is None or total is None or total <= 0:
        return "[" + "?" * width + "]    -"
    frac = max(0.0, used / total)
    filled = min(width, round(frac * width))
    if used > 0 and filled == 0:
        filled = 1  # any reservation at all is visible
    return "[" + "#" * filled + "." * (width - filled) + f"] {frac * 100:3.0f}%"


def backend_state(b: Mapping[str, Any]) -> str:
    """One word an operator can act on: why this backend does or does not take work."""
    if b.get("healthy") is not True:
        return "down"
    if b.get("draining") is True:
        return "draining"
    if b.get("accepting") is True:
        return "ok"
    reason = b.get("pause_reason")
    if isinstance(reason, str) and reason:
        return f"paused:{reason}"
    return "held"  # healthy but limits not known yet


def _load(b: Mapping[str, Any]) -> Mapping[str, Any]:
    load = b.get("load")
    return load if isinstance(load, Mapping) else {}


def _preemptions(b: Mapping[str, Any], before: Mapping[str, Any] | None) -> str:
    now = _num(_load(b).get("preemptions"))
    if now is None:
        return "-"
    text = f"{now:.0f}"
    if before is not None:
        prev = _num(_load(before).get("preemptions"))
        if prev is not None and now > prev:
            text += f" (+{now - prev:.0f})"
    return text


def _backends(state: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    items = state.get("backends")
    if not isinstance(items, Sequence) or isinstance(items, str):
        return []
    return [b for b in items if isinstance(b, Mapping)]


def _text(value: Any) -> str:
    return value if isinstance(value, str) and value else "-"


def render(
    state: Mapping[str, Any],
    *,
    url: str = "",
    previous: Mapping[str, Any] | None = None,
    width: int = 120,
) -> str:
    """One frame of the fleet view. ``previous`` (the last frame's state) adds the
    preemptions seen since then, which is what an operator watches for."""
    backends = _backends(state)
    before = {str(b.get("name")): b for b in _backends(previous)} if previous else {}
    accepting = sum(1 for b in backends if backend_state(b) == "ok")
    reserved = sum(_num(b.get("reserved_tokens")) or 0.0 for b in backends)
    budget = sum(_num(b.get("budget_tokens")) or 0.0 for b in backends)
    in_flight = sum(_num(b.get("in_flight")) or 0.0 for b in backends)
    queue = _num(state.get("queue_depth"))
    lines = [
        f"gateway {url}  policy {_text(state.get('policy'))}  "
        f"queue {'-' if queue is None else f'{queue:.0f}'}  "
        f"in flight {in_flight:.0f}  accepting {accepting}/{len(backends)} backends",
        f"fleet KV reserved {_bar(reserved, budget)} {_count(reserved)}/{_count(budget)}",
        "",
    ]
    name_w = max([len("BACKEND")] + [len(_text(b.get("name"))) for b in backends])
    tier_w = max([len("TIER")] + [len(_text(b.get("tier"))) for b in backends])
    state_w = max([len("STATE")] + [len(backend_state(b)) for b in backends])
    head = (
        f"{'BACKEND':<{name_w}}  {'TIER':<{tier_w}}  {'STATE':<{state_w}}  "
        f"{'RESERVED / BUDGET (KV tokens)':<{BAR_WIDTH + 20}}  {'NODE KV':>7}  "
        f"{'FLIGHT':>7}  {'WAIT':>4}  {'REJ':>4}  PREEMPT"
    )
    lines.append(head)
    for b in backends:
        load = _load(b)
        usage = _num(load.get("kv_usage"))
        waiting = _num(load.get("waiting"))
        flight = f"{_count(b.get('in_flight'))}/{_count(b.get('max_num_seqs'))}"
        kv = (
            f"{_bar(_num(b.get('reserved_tokens')), _num(b.get('budget_tokens')))} "
            f"{_count(b.get('reserved_tokens'))}/{_count(b.get('budget_tokens'))}"
        )
        lines.append(
            f"{_text(b.get('name')):<{name_w}}  {_text(b.get('tier')):<{tier_w}}  "
            f"{backend_state(b):<{state_w}}  {kv:<{BAR_WIDTH + 20}}  "
            f"{'-' if usage is None else f'{usage * 100:.0f}%':>7}  {flight:>7}  "
            f"{'-' if waiting is None else f'{waiting:.0f}':>4}  "
            f"{_count(b.get('recent_rejections')):>4}  "
            f"{_preemptions(b, before.get(str(b.get('name'))))}"
        )
    if not backends:
        lines.append("(no backends configured)")
    lines.extend(["", *_tier_lines(backends)])
    lines.extend(_tenant_lines(state, budget))
    return "\n".join(line[:width].rstrip() for line in lines) + "\n"


def _tier_lines(backends: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per-tier totals: whether a whole tier is full is what decides spill and queueing."""
    tiers: dict[str, list[Mapping[str, Any]]] = {}
    for b in backends:
        tiers.setdefault(_text(b.get("tier")), []).append(b)
    if not tiers:
        return []
    tier_w = max(len(t) for t in tiers)
    out = []
    for tier, members in tiers.items():
        used = sum(_num(b.get("reserved_tokens")) or 0.0 for b in members)
        total = sum(_num(b.get("budget_tokens")) or 0.0 for b in members)
        ok = sum(1 for b in members if backend_state(b) == "ok")
        offload = " offload" if any(b.get("offload") is True for b in members) else ""
        amounts = f"{_count(used)}/{_count(total)}" if total > 0 else "-"
        out.append(
            f"tier {tier:<{tier_w}}  {_bar(used, total)} {amounts}"
            f"  {ok}/{len(members)} accepting{offload}"
        )
    return out


def _tenant_lines(state: Mapping[str, Any], budget: float) -> list[str]:
    """Per tenant: its class, the KV it holds now (of the fleet's budget), requests in
    flight and its use over the last minute (this gateway process's own count)."""
    items = state.get("tenants")
    if not isinstance(items, Sequence) or isinstance(items, str):
        return []
    tenants = [t for t in items if isinstance(t, Mapping)]
    if not tenants:
        return []
    name_w = max([len("TENANT")] + [len(_text(t.get("name"))) for t in tenants])
    class_w = max([len("CLASS")] + [len(_text(t.get("class"))) for t in tenants])
    out = [
        "",
        f"{'TENANT':<{name_w}}  {'CLASS':<{class_w}}  {'KV HELD (of fleet budget)':<{BAR_WIDTH + 10}}"
        f"  {'FLIGHT':>6}  {'REQ/MIN':>7}  {'PROMPT/MIN':>10}  {'OUTPUT/MIN':>10}",
    ]
    for t in tenants:
        held = _num(t.get("kv_tokens"))
        kv = f"{_bar(held, budget or None)} {_count(held)}"
        out.append(
            f"{_text(t.get('name')):<{name_w}}  {_text(t.get('class')):<{class_w}}  "
            f"{kv:<{BAR_WIDTH + 10}}  {_count(t.get('in_flight')):>6}  "
            f"{_count(t.get('requests_last_minute')):>7}  "
            f"{_count(t.get('prompt_tokens_last_minute')):>10}  "
            f"{_count(t.get('output_tokens_last_minute')):>10}"
        )
    return out


# --- I/O ----------------------------------------------------------------------------------


def admin_url(base: str) -> str:
    return base.rstrip("/") + "/admin/backends"


async def fetch_state(
    session: aiohttp.ClientSession, base: str, api_key: str | None
) -> dict[str, Any]:
    """GET the admin state; every failure becomes one :class:`TopError` sentence."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = admin_url(base)
    try:
        async with session.get(url, headers=headers) as resp:
            if resp.status in (401, 403):
                raise TopError(f"{url}: HTTP {resp.status}; pass --api-key or ${API_KEY_ENV}")
            if resp.status != 200:
                raise TopError(f"{url}: HTTP {resp.status}")
            body = await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise TopError(f"{url}: {type(exc).__name__}: {exc}".rstrip(": ")) from exc
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise TopError(f"{url}: response is not JSON") from exc
    if not isinstance(data, dict) or not isinstance(data.get("backends"), list):
        raise TopError(f"{url}: response has no 'backends' list")
    return data


async def run(
    base: str, *, interval: float, once: bool, api_key: str | None, poll_timeout_s: float
) -> int:
    client_timeout = aiohttp.ClientTimeout(total=poll_timeout_s, connect=min(poll_timeout_s, 3.0))
    async with aiohttp.ClientSession(timeout=client_timeout) as session:
        if once:
            try:
                state = await fetch_state(session, base, api_key)
            except TopError as exc:
                sys.stderr.write(f"gateway top: {exc}\n")
                return 1
            sys.stdout.write(render(state, url=base, width=10_000))
            return 0
        previous: dict[str, Any] | None = None
        while True:
            width = shutil.get_terminal_size().columns
            try:
                state = await fetch_state(session, base, api_key)
                frame = render(state, url=base, previous=previous, width=width)
                previous = state
            except TopError as exc:
                frame = f"gateway {base}: unreachable\n{exc}\n"
            sys.stdout.write(f"{CLEAR}{frame}\nrefresh {interval:g}s, Ctrl-C to quit\n")
            sys.stdout.flush()
            await asyncio.sleep(interval)


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _main(args: argparse.Namespace) -> int:
    api_key: str | None = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:
        return asyncio.run(
            run(
                args.url,
                interval=args.interval,
                once=args.once,
                api_key=api_key,
                poll_timeout_s=args.timeout,
            )
        )
    except KeyboardInterrupt:
        return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "top",
        help="live terminal view of the fleet (KV reserved vs budget, health, queues)",
        description=(
            "Poll a running gateway's GET /admin/backends and draw one line per backend: "
            "tier, state, KV tokens reserved against its budget, the KV usage the node "
            "itself reports, requests in flight against its sequence cap, the node's "
            "queue, recent rejections and preemptions."
        ),
    )
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="gateway base URL")
    parser.add_argument("--interval", type=_positive, default=2.0, help="seconds between refreshes")
    parser.add_argument("--once", action="store_true", help="print one plain frame and exit")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"API key for a gateway that requires one (default: ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--timeout", type=_positive, default=5.0, help="seconds to wait for each poll"
    )
    parser.set_defaults(func=_main)
