"""Command line entry point: `gateway <command>`.

Each command lives next to the code it drives and registers itself through a
``register(subparsers)`` function that sets ``func`` on its parser; this module
only assembles them, so commands stay independent of each other.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence

# Every module exposes register(subparsers) -> None.
_COMMAND_MODULES: tuple[str, ...] = (
    "kvgateway.commands.serve",
    "kvgateway.commands.demo",
    "kvgateway.commands.check",
    "kvgateway.commands.config_schema",
    "kvgateway.capacity.cli",
    "kvgateway.simulator.cli",
    "kvgateway.commands.top",
    "kvgateway.commands.round",
    "kvgateway.commands.rounds",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gateway",
        description=(
            "KV-capacity-aware OpenAI-compatible gateway for vLLM fleets: counts every "
            "prompt, reserves prompt+output tokens against each node's KV cache and routes "
            "only to nodes where the request fits."
        ),
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _version() -> str:
    from kvgateway import __version__

    return f"gateway {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Output piped into `head` and the like: not an error. Silence the flush at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
