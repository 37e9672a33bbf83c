"""`gateway demo`: a simulated vLLM fleet and the gateway in front of it, in one command.

The fleet is the embedded ``demo.yaml`` (also at ``config/demo.yaml`` in the repo): three
24 GB-class nodes, two 80 GB-class nodes and a CPU-offload node, all simulated on
loopback ports 9101-9301. ``--port-offset N`` moves the nodes (and, unless ``--port`` is
given, the gateway) by N ports, so a second demo can run beside the first. Ctrl-C stops
the gateway, then the nodes.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from importlib import resources

from kvgateway.commands.serve import run, serve
from kvgateway.config.argtypes import port_number
from kvgateway.config.load import load_config
from kvgateway.config.model import POLICIES, GatewayConfig, Policy
from kvgateway.config.yamlread import ConfigError
from kvgateway.server.observability import setup_logging
from kvgateway.simulator.fleet import start_fleet
from kvgateway.simulator.fleetconfig import NodeSpec, load_fleet_config


def demo_config_path() -> str:
    return str(resources.files("kvgateway").joinpath("data/demo.yaml"))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="run a simulated vLLM fleet with the gateway in front of it",
        description=(
            "Start the simulated fleet of the embedded demo config (or --config) and the "
            "gateway in front of it; print how to call it; stop everything on Ctrl-C."
        ),
    )
    p.add_argument(
        "--port",
        type=port_number,
        default=None,
        help="gateway port (default 8080 + --port-offset)",
    )
    p.add_argument(
        "--port-offset",
        type=int,
        default=0,
        metavar="N",
        help="add N to every simulated node's port (and to the default gateway port), "
        "to run beside another demo",
    )
    p.add_argument("--host", default="127.0.0.1", help="gateway address (default 127.0.0.1)")
    p.add_argument("--config", default=None, help="fleet + gateway YAML (default: embedded demo)")
    p.add_argument(
        "--policy",
        choices=POLICIES,
        help="override routing.policy (compare the baselines)",
    )
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_main)


def _banner(url: str, model: str) -> str:
    return f"""
KV-aware gateway ready at {url}  (Ctrl-C stops the gateway and the simulated fleet)

  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 64}}'

  python -c "import openai; c = openai.OpenAI(base_url='{url}/v1', api_key='none'); \\
print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hello!'}}]).choices[0].message.content)"

  Fleet state:  curl -s {url}/admin/backends      Live view:  gateway top --url {url}
  Metrics:      curl -s {url}/metrics
"""


def _main(args: argparse.Namespace) -> int:
    path = args.config or demo_config_path()
    offset: int = args.port_offset
    port = args.port if args.port is not None else 8080 + offset
    try:
        config = load_config(path)
        specs = load_fleet_config(path, port_offset=offset)
    except (ConfigError, ValueError) as exc:
        sys.stderr.write(f"gateway demo: invalid config: {exc}\n")
        return 2
    config = replace(
        with_node_urls(config, specs),
        server=replace(config.server, host=args.host, port=port),
    )
    if args.policy:
        config = replace(config, routing=replace(config.routing, policy=Policy(args.policy)))
    setup_logging(config.server.log_format, args.log_level)
    # A reload re-reads the file, whose node URLs are not shifted: only offer it unshifted.
    try:
        run(_demo(config, specs, path if offset == 0 else None))
    except OSError as exc:
        sys.stderr.write(f"gateway demo: {exc}\n{_clash_hint(offset, port)}\n")
        return 1
    return 0


def _clash_hint(offset: int, port: int) -> str:
    nxt = offset + 1000
    return (
        f"  A port is taken (another demo?). Run this one beside it with "
        f"`gateway demo --port-offset {nxt}` (nodes on their usual ports + {nxt}, the "
        f"gateway on {8080 + nxt}), or pick the gateway port alone with --port "
        f"(now {port})."
    )


def with_node_urls(config: GatewayConfig, specs: list[NodeSpec]) -> GatewayConfig:
    """``config`` with each simulated backend's URL where its node really listens."""
    urls = {spec.name: spec.url for spec in specs}
    tiers = tuple(
        replace(
            tier,
            backends=tuple(replace(b, url=urls.get(b.name, b.url)) for b in tier.backends),
        )
        for tier in config.tiers
    )
    return replace(config, tiers=tiers)


async def _demo(config: GatewayConfig, specs: list[NodeSpec], path: str | None) -> None:
    async with start_fleet(specs) as fleet:
        for node in fleet:
            sys.stderr.write(f"  simulated {node.describe()}\n")
        model = config.models[0].name

        def ready(url: str) -> None:
            sys.stdout.write(_banner(url, model))
            sys.stdout.flush()

        await serve(config, config_path=path, ready=ready)
