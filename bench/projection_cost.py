"""CPU of one admission against a node's projection, by how many flights it holds.

One cycle: a newcomer checked against the node's projected curve (``fits``), added,
the node's use read, and the oldest flight removed. Three kinds of flights on the node:

- ``unseen``: non-streamed answers (their holding never changes: summed once);
- ``unstarted``: streamed, no progress reported yet (each reaches its bound);
- ``running``: streamed, each at its own point of its answer, so each ends at its own
  step and the curve is read at every end (in one pass: no learned lengths);
- ``learned``: running, with learned output lengths (each step read on its own).

Printed: microseconds of CPU per cycle, in this process, for each kind and count; then
what a queue walk pays per waiter once the node's curve is read (running flights with
learned lengths): a check that admits and one that is refused; a newcomer credited the
shared blocks every flight holds (a common system prompt), checked again with nothing
changed and after a change; an admission in a burst (newcomers with learned lengths added
one after another, none started); and a whole walk of 100 and 1,000 waiters of one client,
none fitting.

With ``--fleet``: CPU per routed arrival on a saturated fleet whose every node's flights
just reported progress (``bench.scale``'s synthetic fleet; see :func:`fleet_ms`).

    python -m bench.projection_cost [--flights 32,128,256] [--block 16] [--fleet 10,100]
"""

from __future__ import annotations

import argparse
import random
import time

from bench.scale import synthetic_gateway
from kvgateway.core.demand import Demand, demand_tokens
from kvgateway.core.flight import Flight
from kvgateway.core.output_model import LearnedLengths, OutputShape, z_of
from kvgateway.core.projection import NodeProjection
from kvgateway.core.reservation import Reservation

KINDS = ("unseen", "unstarted", "running", "learned")
_SHAPE = OutputShape([20 + (k * 37) % 400 for k in range(64)])


def _flight(fid: int, kind: str) -> Flight:
    shape = _SHAPE if kind == "learned" else None
    return Flight(fid, prompt=1000, n=1, bound=400, seen=kind != "unseen", shape=shape)


def cycle_us(kind: str, flights: int, block: int, seconds: float = 0.5) -> float:
    """Mean CPU microseconds of one admission cycle with ``flights`` on the node."""
    proj = NodeProjection()
    for i in range(flights):
        proj.add(_flight(i, kind))
        if kind in ("running", "learned"):
            proj.progress(i, 1 + (i * 7) % 390)
    fid, cycles = flights, 0
    start = time.process_time()
    while time.process_time() - start < seconds:
        newcomer = _flight(fid, kind)
        proj.fits(block, 10**9, 0.0, (newcomer,))
        proj.add(newcomer)
        if kind in ("running", "learned"):
            proj.progress(fid, 1)
        proj.current_blocks(block)
        proj.remove(fid - flights)
        fid += 1
        cycles += 1
    return (time.process_time() - start) / cycles * 1e6


def check_us(flights: int, block: int, admit: bool, seconds: float = 0.5) -> float:
    """Mean CPU microseconds of one waiter's check against ``flights`` running with
    learned lengths, the curve already read; ``admit``: a budget it fits in, else one
    just under the node's current peak."""
    proj = NodeProjection()
    for i in range(flights):
        proj.add(_flight(i, "learned"))
        proj.progress(i, 1 + (i * 7) % 390)
    budget = 10**9 if admit else int(proj.peak(block, 2.0).blocks) - 1
    fid, checks = flights, 0
    start = time.process_time()
    while time.process_time() - start < seconds:
        proj.fits(block, budget, 2.0, (_flight(fid, "learned"),))
        fid += 1
        checks += 1
    return (time.process_time() - start) / checks * 1e6


def credited_us(flights: int, block: int, changed: bool, seconds: float = 0.5) -> float:
    """Mean CPU microseconds of one check of a newcomer credited a system prompt's 8
    blocks that every one of ``flights`` (running, learned lengths) holds; ``changed``:
    the node's flights changed just before each (nothing kept from the last check)."""
    keys = tuple(range(1, 9))
    proj = NodeProjection()
    for i in range(flights):
        proj.add(
            Flight(i, 1000, 1, 400, shape=_SHAPE, keys=keys, scheduled=8, credited=8 * (i > 0))
        )
        proj.progress(i, 1 + (i * 7) % 390)
    checks = 0
    start = time.process_time()
    while time.process_time() - start < seconds:
        if changed:
            proj.progress(0, 1)
        newcomer = Flight(flights + checks, 1000, 1, 400, shape=_SHAPE, keys=keys, credited=8)
        proj.fits(block, 10**9, 2.0, (newcomer,))
        checks += 1
    return (time.process_time() - start) / checks * 1e6


def walk_ms(flights: int, waiters: int, block: int, seconds: float = 0.5) -> float:
    """Mean CPU milliseconds of one queue walk: ``waiters`` of one client (one learned
    shape and bound, prompts of 100-2,000 tokens) checked in turn against ``flights``
    running with learned lengths, the node's curve just changed, none fitting."""
    proj = NodeProjection()
    for i in range(flights):
        proj.add(_flight(i, "learned"))
        proj.progress(i, 1 + (i * 7) % 390)
    budget = int(proj.peak(block, 2.0).blocks)
    prompts = [100 + (k * 7919) % 1900 for k in range(waiters)]
    walks = 0
    start = time.process_time()
    while time.process_time() - start < seconds:
        proj.progress(0, 1)  # a change, as the release that starts a walk is
        for k, prompt in enumerate(prompts):
            newcomer = Flight(flights + k, prompt, 1, 400, shape=_SHAPE)
            proj.fits(block, budget, 2.0, (newcomer,))
        walks += 1
    return (time.process_time() - start) / walks * 1e3


def burst_us(flights: int, block: int, seconds: float = 0.5) -> float:
    """Mean CPU microseconds of one admission in a burst: newcomers with learned lengths
    checked and added one after another to an empty node until ``flights`` are on it,
    none started yet (no token reported: a burst's first seconds)."""
    admissions = 0
    start = time.process_time()
    while time.process_time() - start < seconds:
        proj = NodeProjection()
        for i in range(flights):
            newcomer = Flight(i, 300 + (i * 7919) % 1700, 1, 2048, shape=_SHAPE)
            proj.fits(block, 10**9, 2.0, (newcomer,))
            proj.add(newcomer)
        admissions += flights
    return (time.process_time() - start) / admissions * 1e6


def _learned(rnd: random.Random, prompt: int) -> Demand:
    lengths = LearnedLengths(512, 32)
    for k in range(512):
        lengths.add(20 + (k * 37) % 600)
    return Demand(
        model="m",
        prompt_tokens=prompt,
        longest_prompt=prompt,
        output_tokens=2048,
        sequences=1,
        tokens=demand_tokens([prompt], 2048, 1, 16),
        projected=True,
        lengths=lengths,
        z=z_of(0.001),
    )


def fleet_ms(nodes: int, rounds: int = 10) -> tuple[float, float, float]:
    """A fleet of ``nodes`` (``bench.scale``'s tiers) filled by arrivals with learned
    lengths until 200 in a row are refused, every flight then started. Per round every
    flight reports a token more (a step on every node), then 4 arrivals that do not fit
    (7,000-token prompts) are routed. Returns (flights per node, CPU ms per round of
    reports, CPU ms per refused arrival)."""
    rnd = random.Random(nodes)
    state = synthetic_gateway(nodes, "kv_aware", rnd)
    adm, fleet = state.admission, state.fleet
    for b in fleet.backends:  # empty: the flights below fill it
        fleet.adjust(b, -b.reserved_tokens, -b.reserved_seqs, -b.in_flight)
    held: list[tuple[Reservation, list[int]]] = []
    misses = 0
    while misses < 200:
        r = adm.try_admit(_learned(rnd, rnd.randint(3000, 6000)))
        if isinstance(r, Reservation):
            held.append((r, [rnd.randint(1, 200)]))
            r.progress(held[-1][1][0])
            misses = 0
        else:
            misses += 1
    reports = arrivals = 0.0
    for _ in range(rounds):
        start = time.process_time()
        for r, generated in held:
            generated[0] += 1
            r.progress(generated[0])
        middle = time.process_time()
        for _ in range(4):
            assert not isinstance(adm.try_admit(_learned(rnd, 7000)), Reservation)
        reports += middle - start
        arrivals += time.process_time() - middle
    return len(held) / nodes, reports / rounds * 1e3, arrivals / (4 * rounds) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flights", default="32,128,256", help="flights on the node, comma-separated")
    p.add_argument("--block", type=int, default=16, help="the node's KV block size (tokens)")
    p.add_argument(
        "--fleet",
        default="",
        help="instead: fleets of these many nodes, saturated (comma-separated)",
    )
    args = p.parse_args(argv)
    if args.fleet:
        print(f"{'nodes':>6} {'flights/node':>12} {'reports ms':>11} {'arrival ms':>11}")
        for n in (int(x) for x in args.fleet.split(",")):
            per, reports, arrival = fleet_ms(n)
            print(f"{n:>6} {per:>12.1f} {reports:>11.2f} {arrival:>11.3f}")
        return 0
    counts = [int(x) for x in args.flights.split(",")]
    print(f"{'flights':>7} " + " ".join(f"{k + ' us':>13}" for k in KINDS))
    for n in counts:
        row = [cycle_us(k, n, args.block) for k in KINDS]
        print(f"{n:>7} " + " ".join(f"{v:>13.1f}" for v in row))
    print(f"\n{'flights':>7} {'admitted us':>13} {'refused us':>13}   (a waiter's check, learned)")
    for n in counts:
        print(
            f"{n:>7} {check_us(n, args.block, True):>13.1f} {check_us(n, args.block, False):>13.1f}"
        )
    print(f"\n{'flights':>7} {'kept us':>13} {'changed us':>13}   (a credited newcomer's check)")
    for n in counts:
        kept, changed = credited_us(n, args.block, False), credited_us(n, args.block, True)
        print(f"{n:>7} {kept:>13.1f} {changed:>13.1f}")
    print(f"\n{'flights':>7} {'admission us':>13}   (a burst of learned newcomers, unstarted)")
    for n in counts:
        print(f"{n:>7} {burst_us(n, args.block):>13.1f}")
    print(f"\n{'flights':>7} {'waiters':>7} {'walk ms':>9}   (a queue walk, none fitting)")
    for n in counts:
        for waiters in (100, 1000):
            print(f"{n:>7} {waiters:>7} {walk_ms(n, waiters, args.block):>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
