"""``gateway rounds``: compare the tuning rounds of a rounds file (``gateway round``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvgateway.commands.roundsplot import PlotUnavailable, plot_rounds
from kvgateway.commands.roundsreport import render, report_json
from kvgateway.commands.roundstats import RoundsFileError, rounds_from_json


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "rounds",
        help="compare tuning rounds side by side, with a verdict per change and the next step",
        description=(
            "Show the rounds `gateway round` recorded side by side (KV tokens, flags, "
            "memory from the log, and per concurrency: tokens/s, TTFT p50/p99, preemptions, "
            "peak KV usage), a verdict per change (did it raise the best tokens/s beyond the "
            "run-to-run noise, measured by repeated rounds or given with --noise, or only "
            "move the preemptions to a higher concurrency; inconclusive without a noise "
            "estimate) and the next step in `gateway plan`'s order with the node's flag "
            "to change."
        ),
    )
    parser.add_argument("file", help="rounds file written by `gateway round`")
    parser.add_argument(
        "--noise",
        type=_fraction,
        metavar="FRACTION",
        help="run-to-run noise of best tokens/s on this node, e.g. 0.08, when the file has "
        "no repeats to measure it (a verdict without either is inconclusive)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--plot",
        metavar="PNG",
        help="also write tokens/s and TTFT p99 against concurrency, one line per round "
        "(needs matplotlib)",
    )
    parser.set_defaults(func=run)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value


def _fail(message: str, code: int = 2) -> int:
    sys.stderr.write(f"gateway rounds: error: {message}\n")
    return code


def run(args: argparse.Namespace) -> int:
    try:
        rounds = rounds_from_json(json.loads(Path(args.file).read_text(encoding="utf-8")))
    except OSError as exc:
        return _fail(f"cannot read {args.file!r}: {exc.strerror or exc}")
    except json.JSONDecodeError as exc:
        return _fail(f"{args.file} is not JSON: {exc}")
    except RoundsFileError as exc:
        return _fail(f"{args.file}: {exc}")
    if not rounds:
        return _fail(f"{args.file} holds no rounds")
    sys.stdout.write(
        (
            json.dumps(report_json(rounds, args.noise), indent=2)
            if args.json
            else render(rounds, args.noise)
        )
        + "\n"
    )
    if args.plot:
        try:
            plot_rounds(rounds, Path(args.plot))
        except PlotUnavailable as exc:
            return _fail(str(exc), 1)
        except OSError as exc:
            return _fail(f"--plot: cannot write {args.plot!r}: {exc.strerror or exc}")
        sys.stderr.write(f"plot written to {args.plot}\n")
    return 0
