"""Offline check of admission with learned output lengths: one node, no sockets.

The node is 63 blocks of 128 tokens (node B of the real-vLLM benchmarks) and runs as
vLLM's scheduler does: waiting requests start in order while their blocks fit, every
running sequence grows a token a step, and when the blocks run out the newest running
one is preempted (its blocks freed; it resumes later). 32 clients keep a request each in
the gateway's queue, which admits in order while the node's projection
(:class:`~kvgateway.core.projection.NodeProjection`, the gateway's own) fits with it;
the node reports each sequence's progress a step late; every finished answer teaches
the gateway's :class:`~kvgateway.core.output_model.OutputModel`, from nothing at the
start. Prompts of 145-770 tokens, ``max_tokens`` 2,048, answers drawn from:

- ``geo``: geometric, mean 200 (the real benchmark's ``unknown`` workload);
- ``bimodal``: 90% geometric of mean 60, 10% of mean 1,500;
- ``lognormal``: median 120, sigma 1;
- ``fixed``: 280-320 tokens, nearly one length.

Printed per distribution: engine steps to serve every request, the mean batch and KV
use, and preemptions per 100 requests; ``--node`` also runs the node alone (every
request sent at once).

    python -m bench.learned_offline [--requests 500] [--seeds 3] [--dists geo,fixed]
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable

from kvgateway.core.flight import Flight
from kvgateway.core.output_model import OutputModel, z_of
from kvgateway.core.projection import NodeProjection

BLOCK, BUDGET, MAX_TOKENS, CLIENTS = 128, 63, 2048, 32


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


def lengths(dist: str, rng: random.Random) -> Callable[[], int]:
    def geo(mean: float) -> int:
        u = rng.random()
        return min(MAX_TOKENS, 1 + int(math.log(1 - u) / math.log(1 - 1 / mean)))

    draws: dict[str, Callable[[], int]] = {
        "geo": lambda: geo(200),
        "bimodal": lambda: geo(60) if rng.random() < 0.9 else geo(1500),
        "lognormal": lambda: max(1, min(MAX_TOKENS, int(rng.lognormvariate(math.log(120), 1)))),
        "fixed": lambda: rng.randint(280, 320),
    }
    return draws[dist]


def run(dist: str, seed: int, requests: int, node_alone: bool = False) -> dict[str, float]:
    rng = random.Random(seed)
    draw = lengths(dist, rng)
    todo = [(i, rng.randint(145, 770), draw()) for i in range(requests)]
    model, proj, z = OutputModel(), NodeProjection(), z_of(0.001)
    queue, todo = todo[:CLIENTS], todo[CLIENTS:]
    node_waiting: list[list[int]] = []  # [id, prompt, length, generated]
    running: list[list[int]] = []
    reports: list[tuple[int, int, int]] = []
    done = step = preempted = 0
    batch = kv = 0.0
    while done < requests:
        while queue:
            rid, prompt, length = queue[0]
            f = Flight(rid, prompt, 1, MAX_TOKENS, shape=model.group("m", "k", MAX_TOKENS).shape)
            if not node_alone and not proj.fits(BLOCK, BUDGET, z, (f,)):
                break
            queue.pop(0)
            proj.add(f)
            node_waiting.append([rid, prompt, length, 0])
        used = sum(_blocks(s[1] + s[3] + 1) for s in running)
        while (
            node_waiting and used + _blocks(node_waiting[0][1] + node_waiting[0][3] + 1) <= BUDGET
        ):
            s = node_waiting.pop(0)
            running.append(s)
            used += _blocks(s[1] + s[3] + 1)
        for s in running:
            s[3] += 1
        while sum(_blocks(s[1] + s[3]) for s in running) > BUDGET:
            node_waiting.insert(0, running.pop())
            preempted += 1
        batch += len(running)
        kv += sum(_blocks(s[1] + s[3]) for s in running) / BUDGET
        for s in [s for s in running if s[3] >= s[2]]:
            running.remove(s)
            proj.remove(s[0])
            model.observe("m", "k", MAX_TOKENS, s[2])
            done += 1
            if todo:
                queue.append(todo.pop(0))
        reports += [(step + 1, s[0], s[3]) for s in running]
        for _, rid, generated in [r for r in reports if r[0] <= step]:
            proj.progress(rid, generated)
        reports = [r for r in reports if r[0] > step]
        step += 1
    return {"steps": step, "batch": batch / step, "kv": kv / step, "preempted": preempted}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--dists", default="geo,bimodal,lognormal,fixed")
    p.add_argument("--node", action="store_true", help="also the node alone")
    a = p.parse_args()
    print(f"{a.requests} requests x {a.seeds} seeds; preemption_risk 0.001")
    print(f"{'answers':<10} {'mode':<8} {'steps':>7} {'batch':>6} {'kv':>5} {'preempt/100':>12}")
    for dist in a.dists.split(","):
        for alone in (False, True) if a.node else (False,):
            rs = [run(dist, s, a.requests, alone) for s in range(a.seeds)]
            mean = {k: sum(r[k] for r in rs) / len(rs) for k in rs[0]}
            print(
                f"{dist:<10} {'node' if alone else 'gateway':<8} {mean['steps']:>7.0f} "
                f"{mean['batch']:>6.2f} {mean['kv']:>5.2f} "
                f"{100 * mean['preempted'] / a.requests:>12.2f}"
            )


if __name__ == "__main__":
    main()
