"""Counting modes: the gateway's prompt count against the node's own.

Simulated vLLM nodes count with real model vocabularies and chat templates
(``simulate: {tokenizer: DIR}``; the ``tokenizers`` library, as vLLM): a Qwen 2.5-style
model (byte-level BPE from dashscope's ``qwen.tiktoken``, ChatML template with tools)
and a Mistral v3-style model (SentencePiece with byte fallback from ``mistral-common``,
Mistral template). Each model has a small node (8k context, ~30k KV tokens, 16
sequences) and a large one (32k context, ~400k KV tokens). The gateway runs in this
process in front of them, in two modes:

- ``exact``: ``models[].tokenizer.path`` is the node's own directory;
- ``standin``: no directory: cl100k and its per-request upper bound (the default), the
  node's ``/tokenize`` near the largest context, re-admission after a node's 400.

Both modes get the same seeded mixed workload (``bench.counting_workload``) from
``--concurrency`` closed-loop clients, non-streaming. Reported per mode: requests, the
share whose ``x-gateway-prompt-tokens`` equals the node's ``usage.prompt_tokens``,
counts over and under, node 400s (relayed to the client, or refused and re-admitted by
the gateway), preemptions (the nodes' /metrics), and gateway refusals (400 / 429 / 503)
of requests the node would have served: its own count (``/tokenize``) plus
``max_tokens`` within the largest context.

    python -m bench.counting_modes [--requests 800] [--concurrency 16] [--modes exact,standin]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.counting_workload import Probe, Verdict, judge, node_counts, send, workload
from bench.harness import fleet_and_gateway, node_metrics
from bench.report import machine, save, table, verdict
from kvgateway.server.app import STATE
from kvgateway.tokens.exact import ExactCounter
from kvgateway.tokens.modeldir import load_model_tokenizer
from tests.support import vocab

MODELS = {
    # model name: (vocabulary builder, served name)
    "qwen": ("qwen", "Qwen/Qwen2.5-7B-Instruct"),
    "mistral": ("sentencepiece", "mistralai/Mistral-7B-Instruct-v0.3"),
}
SMALL, LARGE = 8_192, 32_768
TARGET_EXACT = 0.999
TARGET_WRONG_REFUSALS = 0.005


def fleet_config(dirs: dict[str, Path], *, exact: bool) -> dict[str, Any]:
    models = []
    backends: dict[str, list[dict[str, Any]]] = {"small": [], "large": []}
    for name, (kind, served) in MODELS.items():
        model: dict[str, Any] = {"name": name, "served_name": served}
        if exact:
            model["tokenizer"] = {"path": str(dirs[kind])}
        models.append(model)
        for tier, profile, seqs in (("small", "gpu24-8b", 16), ("large", "gpu80-8b", 256)):
            backends[tier].append(
                {
                    "name": f"{name}-{tier}",
                    "url": "http://127.0.0.1:1",
                    "model": name,
                    "max_num_seqs": seqs,
                    "simulate": {"profile": profile, "tokenizer": str(dirs[kind])},
                }
            )
    return {
        "models": models,
        "admission": {"default_output_tokens": 256, "queue_timeout_s": 10, "queue_size": 512},
        "routing": {"policy": "kv_aware"},
        "tiers": [{"name": t, "backends": bs} for t, bs in backends.items()],
    }


def build_probes(dirs: dict[str, Path], n: int, seed: int) -> list[Probe]:
    """The same seeded requests for both modes, the models' requests interleaved."""
    per_model = []
    for i, (name, (kind, _)) in enumerate(MODELS.items()):
        counter = ExactCounter(load_model_tokenizer(str(dirs[kind])))
        per_model.append(workload(name, counter, n // len(MODELS), seed + i, (SMALL, LARGE)))
    return [p for group in zip(*per_model, strict=True) for p in group]


async def run_mode(
    mode: str, dirs: dict[str, Path], probes: list[Probe], args: argparse.Namespace
) -> dict[str, Any]:
    probes = [dataclasses.replace(p, body=json.loads(json.dumps(p.body))) for p in probes]
    async with fleet_and_gateway(
        "kv_aware",
        time_scale=args.time_scale,
        seed=args.seed,
        data=fleet_config(dirs, exact=mode == "exact"),
    ) as run:
        started = time.monotonic()
        todo = iter(probes)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

            async def client() -> None:
                for p in todo:
                    await send(s, run.url, p, args.timeout)

            await asyncio.gather(*(client() for _ in range(args.concurrency)))
            wall = time.monotonic() - started
            nodes = {n.name: n.url for n in run.fleet}
            await node_counts(s, probes, lambda model: (nodes[f"{model}-large"], MODELS[model][1]))
        metrics = await node_metrics(run.fleet)
        readmitted = {b.name: len(b.rejection_times) for b in run.app[STATE].fleet.backends}
    if args.dump:
        with open(f"{args.dump}.{mode}.jsonl", "w", encoding="utf-8") as fh:
            for p in probes:
                fh.write(json.dumps(dataclasses.asdict(p)) + "\n")
    verdicts = {"all": judge(probes, LARGE)}
    for model in MODELS:
        verdicts[model] = judge([p for p in probes if p.model == model], LARGE)
    kinds: dict[str, int] = {}
    for p in probes:
        kinds[p.kind.split("/")[0]] = kinds.get(p.kind.split("/")[0], 0) + 1
    return {
        "mode": mode,
        "wall_s": wall,
        "kinds": kinds,
        "preemptions": int(sum(m["preemptions"] for m in metrics.values())),
        "preemptions_by_node": {k: int(v["preemptions"]) for k, v in metrics.items()},
        # Every node refusal the gateway saw (relayed, or read and re-admitted).
        "node_refusals_seen_by_gateway": sum(readmitted.values()),
        "verdicts": {k: dataclasses.asdict(v) for k, v in verdicts.items()},
        "summary": _figures(verdicts["all"]),
    }


def _figures(v: Verdict) -> dict[str, Any]:
    return {
        "exact_share": v.exact_share,
        "wrongly_refused_share": v.wrongly_refused_share,
    }


def build_dirs(root: Path) -> dict[str, Path]:
    return {kind: vocab.build(kind, root) for kind, _ in MODELS.values()}


def print_report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"Counting modes: {args.requests} mixed chats per mode ({', '.join(MODELS)}), "
        f"{args.concurrency} closed-loop clients, nodes at time_scale {args.time_scale:g}"
    )
    print("kinds: " + ", ".join(f"{k} {n}" for k, n in rows[0]["kinds"].items()))
    headers = (
        "mode",
        "model",
        "requests",
        "served",
        "equal",
        "equal %",
        "over",
        "under",
        "node 400",
        "preempt",
        "gw 400",
        "gw 429",
        "gw 503",
        "wrongly refused",
        "of servable %",
    )
    body = []
    for r in rows:
        for model, v in r["verdicts"].items():
            body.append(
                (
                    r["mode"],
                    model,
                    v["requests"],
                    v["served"],
                    v["exact"],
                    100 * v["exact"] / max(1, v["served"]),
                    v["over"],
                    v["under"],
                    v["node_400"] + (r["node_refusals_seen_by_gateway"] if model == "all" else 0),
                    r["preemptions"] if model == "all" else None,
                    v["refused"].get("400", 0),
                    v["refused"].get("429", 0),
                    v["refused"].get("503", 0),
                    v["wrongly_refused"],
                    100 * v["wrongly_refused"] / max(1, v["servable"]),
                )
            )
    print(table(headers, body, digits=2))
    for r in rows:
        v = r["verdicts"]["all"]
        node_400 = v["node_400"] + r["node_refusals_seen_by_gateway"]
        if r["mode"] == "exact":
            ok = v["exact"] / max(1, v["served"]) >= TARGET_EXACT and v["under"] == 0
            print(
                f"exact: gateway count == node count on {v['exact']}/{v['served']} served "
                f"({100 * v['exact'] / max(1, v['served']):.2f}%), {v['over']} over, "
                f"{v['under']} under (target >= {100 * TARGET_EXACT:g}%, never under): "
                f"{verdict(ok)}"
            )
        else:
            share = v["wrongly_refused"] / max(1, v["servable"])
            ok = (
                node_400 == 0
                and r["preemptions"] == 0
                and v["under"] == 0
                and share <= TARGET_WRONG_REFUSALS
            )
            print(
                f"standin: {node_400} node 400s, {r['preemptions']} preemptions, {v['under']} "
                f"under; {v['wrongly_refused']} of {v['servable']} servable requests refused "
                f"({100 * share:.2f}%, target <= {100 * TARGET_WRONG_REFUSALS:g}%; by kind "
                f"{v['wrongly_refused_kinds']}); over by up to {v['over_ratio_max']:.2f}x: "
                f"{verdict(ok)}"
            )


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=800, help="per mode, both models together")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--time-scale", type=float, default=20.0)
    p.add_argument("--timeout", type=float, default=120.0, help="client timeout, wall s")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--modes", default="exact,standin")
    p.add_argument("--dirs", help="where the tokenizer directories are built (default: temp)")
    p.add_argument("--dump", help="write every probe and its answer to DUMP.<mode>.jsonl")
    p.add_argument("--save", default="counting_modes", help="bench/results/<name>.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-vocab-") as tmp:
        dirs = build_dirs(Path(args.dirs or tmp))
        started = time.monotonic()
        probes = build_probes(dirs, args.requests, args.seed)
        print(f"workload built in {time.monotonic() - started:.1f} s")
        rows = [asyncio.run(run_mode(m, dirs, probes, args)) for m in args.modes.split(",")]
    print_report(rows, args)
    if args.save:
        save(args.save, {"machine": machine(), "args": vars(args), "modes": rows})
    return rows


if __name__ == "__main__":
    main()
