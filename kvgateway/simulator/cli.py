"""``gateway simulate``: run simulated vLLM nodes until SIGINT/SIGTERM.

    gateway simulate --config config/demo.yaml          # every node the config describes
    gateway simulate --profile gpu24-8b --port 9101     # one ad-hoc node
    gateway simulate --preset qwen3-8b --gpu-memory-gib 24 --max-model-len 26624
                                                        # one node sized like `gateway plan`

``python -m kvgateway.simulator --node-json JSON`` is the child-process form used by
``start_fleet(processes=True)``; it prints ``READY <url>`` once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from kvgateway.config.argtypes import port_number
from kvgateway.simulator.fleet import spec_from_json, start_fleet, start_node
from kvgateway.simulator.fleetconfig import NodeSpec, load_fleet_config, node_spec
from kvgateway.simulator.profiles import PROFILES
from kvgateway.simulator.settings import SettingsError, apply_overrides
from kvgateway.simulator.sizing import ServeFlags, StartupError, size_node

# Flag -> setting; only these may also be combined with --config (they apply to all).
_FLEET_FLAGS = {"time_scale": "time_scale", "seed": "seed"}
_SIZED_FLAGS = (
    "gpu_memory_gib",
    "max_num_batched_tokens",
    "gpu_memory_utilization",
    "kv_cache_dtype",
    "cpu_offload_gb",
)
_NODE_FLAGS = {
    "model": "model",
    "max_model_len": "max_model_len",
    "num_gpu_blocks": "num_gpu_blocks",
    "max_num_seqs": "max_num_seqs",
    "max_num_queued_reqs": "max_num_queued_reqs",
    "tokenizer": "tokenizer",
    "default_chat_template_kwargs": "default_chat_template_kwargs",
    "stream_interval": "stream_interval",
    "context_overflow": "context_overflow",
}


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="run simulated vLLM nodes (a whole fleet from --config, one --profile node, or "
        "one --preset node sized like `gateway plan`)",
        description=(
            "Run simulated vLLM V1 nodes on loopback ports: vLLM's HTTP API, /metrics and "
            "scheduler behaviour (KV blocks, chunked prefill, preemption) with timings "
            "modelled on real hardware. Profiles: "
            + ", ".join(f"{name}" for name in PROFILES)
            + "."
        ),
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", metavar="FILE", help="gateway YAML: start every simulate: node")
    source.add_argument("--profile", choices=sorted(PROFILES), help="start one ad-hoc node")
    source.add_argument(
        "--preset",
        metavar="NAME",
        help="start one node serving a `gateway plan` preset, its KV pool sized by the "
        "planner's maths from --gpu-memory-gib and the vLLM flags below (it prints "
        "vLLM-style start-up lines, and refuses to start as vLLM would)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="ad-hoc node: bind address")
    parser.add_argument(
        "--port", type=port_number, default=9101, help="ad-hoc node: port (0 = any)"
    )
    parser.add_argument("--name", default="sim", help="ad-hoc node: name")
    parser.add_argument("--model", help="ad-hoc node: served model name")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--num-gpu-blocks", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-queued-reqs", type=int)
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="ad-hoc node: count with this model tokenizer directory and its chat template",
    )
    parser.add_argument(
        "--default-chat-template-kwargs",
        metavar="JSON",
        help="ad-hoc node: what every chat template gets unless a request says otherwise "
        "(vLLM's flag), e.g. '{\"enable_thinking\": false}'",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        help="ad-hoc node: stream tokens this many at a time (vLLM's flag; default 1)",
    )
    parser.add_argument(
        "--context-overflow",
        choices=("clamp", "reject"),
        help="ad-hoc node: a max_tokens that does not fit beside the prompt is cut to "
        "what the context leaves (clamp, vLLM >= 0.32; default) or refused with a 400 "
        "(reject, vLLM <= 0.31)",
    )
    sized = parser.add_argument_group("--preset node (vLLM's flags; default: vLLM's defaults)")
    sized.add_argument("--gpu-memory-gib", type=float, help="per GPU, as torch sees it")
    sized.add_argument("--max-num-batched-tokens", type=int)
    sized.add_argument("--gpu-memory-utilization", type=float)
    sized.add_argument("--kv-cache-dtype", help="auto (default), fp8, ...")
    sized.add_argument("--cpu-offload-gb", type=float, help="GiB of weights kept in host RAM")
    parser.add_argument("--legacy-metrics", action="store_true", help="vllm:gpu_cache_usage_perc")
    parser.add_argument("--time-scale", type=float, help="simulated seconds per wall second")
    parser.add_argument("--seed", type=int, help="seed for output lengths")
    parser.add_argument(
        "--port-offset", type=int, default=0, help="--config: add this to every node's port"
    )
    parser.add_argument("--processes", action="store_true", help="run each node in its own process")
    parser.set_defaults(func=run)


def _overrides(args: argparse.Namespace, flags: dict[str, str]) -> dict[str, Any]:
    values = {setting: getattr(args, flag) for flag, setting in flags.items()}
    return {k: v for k, v in values.items() if v is not None}


def build_specs(args: argparse.Namespace) -> list[NodeSpec]:
    """Node specs from parsed flags; raises SettingsError (incl. config errors)."""
    fleet_overrides = _overrides(args, _FLEET_FLAGS)
    node_overrides = _overrides(args, _NODE_FLAGS)
    if args.legacy_metrics:
        node_overrides["legacy_metric_names"] = True
    if args.config:
        if node_overrides:
            raise SettingsError(
                "with --config, only --time-scale and --seed apply; set other fields in "
                "the backend's simulate: block"
            )
        return load_fleet_config(
            args.config, port_offset=args.port_offset, overrides=fleet_overrides
        )
    if args.preset:
        return [_sized_spec(args, {**node_overrides, **fleet_overrides})]
    given = [f for f in _SIZED_FLAGS if getattr(args, f) is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise SettingsError(f"{flag} applies only to a --preset node")
    if not args.profile:
        raise SettingsError("give --config FILE, --profile NAME or --preset NAME")
    return [
        node_spec(
            args.profile,
            name=args.name,
            host=args.host,
            port=args.port,
            overrides={**node_overrides, **fleet_overrides},
        )
    ]


def _sized_spec(args: argparse.Namespace, overrides: dict[str, Any]) -> NodeSpec:
    if args.gpu_memory_gib is None:
        raise SettingsError("--preset needs --gpu-memory-gib")
    flags = ServeFlags(
        max_model_len=overrides.pop("max_model_len", None),
        max_num_seqs=overrides.pop("max_num_seqs", None),
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_dtype=args.kv_cache_dtype or "auto",
        cpu_offload_gb=args.cpu_offload_gb or 0.0,
    )
    sized = size_node(args.preset, args.gpu_memory_gib, flags, name=args.name)
    for line in sized.log:
        print(line, flush=True)
    if "num_gpu_blocks" in overrides:
        raise SettingsError("--num-gpu-blocks: a --preset node sizes its own KV pool")
    settings = apply_overrides(sized.settings, overrides, "overrides")
    return NodeSpec(settings, args.host, args.port)


def run(args: argparse.Namespace) -> int:
    try:
        specs = build_specs(args)
    except StartupError as exc:
        for line in exc.log:
            print(line, flush=True)
        print("gateway simulate: error: vLLM would not start (the ERROR line)", file=sys.stderr)
        return 1
    except SettingsError as exc:
        print(f"gateway simulate: error: {exc}", file=sys.stderr)
        return 2
    if not specs:
        print("gateway simulate: the config has no backend with a simulate: block", file=sys.stderr)
        return 2
    try:
        _run_loop(lambda stop: _serve(specs, stop, processes=args.processes))
    except OSError as exc:
        print(f"gateway simulate: error: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve(specs: list[NodeSpec], stop: asyncio.Event, *, processes: bool) -> None:
    async with start_fleet(specs, processes=processes) as fleet:
        for node in fleet:
            print(node.describe(), flush=True)
        print(f"{len(fleet)} simulated node(s) ready; Ctrl-C to stop", flush=True)
        await stop.wait()
    print("simulated nodes stopped", flush=True)


def _run_loop(main: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
    """Run ``main(stop)`` on uvloop if available; SIGINT/SIGTERM set ``stop``."""

    async def wrapper() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await main(stop)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(wrapper())


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def child_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one node in its own process (``start_fleet(processes=True)``)."""
    parser = argparse.ArgumentParser(prog="python -m kvgateway.simulator")
    parser.add_argument("--node-json", required=True)
    args = parser.parse_args(argv)
    spec = spec_from_json(args.node_json)

    async def serve(stop: asyncio.Event) -> None:
        node = await start_node(spec)
        try:
            print(f"READY {node.url}", flush=True)
            await stop.wait()
        finally:
            await node.stop()

    with contextlib.suppress(KeyboardInterrupt):
        _run_loop(serve)
    return 0
