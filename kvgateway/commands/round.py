"""``gateway round``: one tuning round against one vLLM node, appended to a rounds file.

The measuring is :func:`kvgateway.commands.roundload.measure_round`; this module reads the
flags and the log, prints progress on stderr and writes the file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from kvgateway.commands.nodeclient import RoundError
from kvgateway.commands.roundload import measure_round
from kvgateway.commands.roundstats import Round, rounds_from_json, rounds_to_json
from kvgateway.config.argtypes import positive_int, positive_number

API_KEY_ENV = "VLLM_API_KEY"


def save_round(path: Path, new: Round) -> tuple[int, bool]:
    """Append ``new`` to the rounds file (replacing a round of the same name);
    returns (its position, whether it replaced one)."""
    rounds: list[Round] = []
    if path.exists():
        rounds = rounds_from_json(json.loads(path.read_text(encoding="utf-8")))
    index = next((i for i, r in enumerate(rounds) if r.name == new.name), None)
    replaced = index is not None
    if index is None:
        rounds.append(new)
        index = len(rounds) - 1
    else:
        rounds[index] = new
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rounds_to_json(rounds), indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return index, replaced


def _ladder(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1 or list(values) != sorted(set(values)):
        raise argparse.ArgumentTypeError(
            f"expected increasing positive integers like 1,2,4,8, got {text!r}"
        )
    return values


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "round",
        help="measure one vLLM node under a ladder of concurrencies and record it as a round",
        description=(
            "One tuning round against one vLLM node (real or simulated): read its limits "
            "(/v1/models max_model_len, /metrics vllm:cache_config_info KV blocks), then "
            "run a short closed-loop streaming load at each concurrency of the ladder and "
            "record TTFT p50/p99, generated tokens/s, preemptions (the node's counter), "
            "peak KV usage and 400s/errors/timeouts. Stops at the first step that preempts, "
            "times out or has no request succeed. With --log, the node's start-up log adds the "
            "flags it was started with (its non-default args), KV cache memory, peak memory, "
            "the device (a CPU node is advised in its own flags), a --num-gpu-blocks-override "
            "and vLLM's estimated maximum length. Progress goes to stderr; the round "
            "is appended to --out (a round of the same name is replaced). Compare rounds "
            "with `gateway rounds`."
        ),
    )
    parser.add_argument("--url", required=True, help="the node's base URL (http://HOST:PORT)")
    parser.add_argument("--name", required=True, help="this round's name, e.g. what changed")
    parser.add_argument("--log", metavar="FILE", help="the node's vLLM start-up log")
    parser.add_argument(
        "--ladder",
        type=_ladder,
        help="concurrencies to climb, e.g. 1,2,4,8,16 (default: powers of two up to the "
        "first at or above twice the requests the KV cache holds at once, at most 256)",
    )
    parser.add_argument(
        "--prompt-tokens", type=positive_int, help="per request (default: max_model_len/8, <=2048)"
    )
    parser.add_argument(
        "--output-tokens", type=positive_int, help="per request (default: 512 or what fits)"
    )
    parser.add_argument(
        "--duration",
        type=positive_number,
        default=30.0,
        help="seconds of load per step (default 30)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_number,
        default=60.0,
        help="seconds without a token before a request counts as timed out (default 60)",
    )
    parser.add_argument(
        "--time-scale",
        type=positive_number,
        default=1.0,
        help="for a simulated node run with --time-scale N: the same N, so durations and "
        "times are in the modelled hardware's seconds (default 1: a real node)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for the prompt token ids")
    parser.add_argument(
        "--api-key",
        help=f"for a node started with --api-key (default: ${API_KEY_ENV}, as vLLM reads it)",
    )
    parser.add_argument("--out", default="rounds.json", help="rounds file (default rounds.json)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    def progress(line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    log_text = None
    if args.log is not None:
        try:
            log_text = Path(args.log).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            progress(f"gateway round: error: --log: cannot read {args.log!r}: {exc.strerror}")
            return 2
    out = Path(args.out)
    if out.exists():
        try:
            rounds_from_json(json.loads(out.read_text(encoding="utf-8")))
        except (OSError, ValueError) as exc:
            progress(f"gateway round: error: --out {args.out}: {exc}")
            return 2
    try:
        result = asyncio.run(
            measure_round(
                args.url,
                args.name,
                ladder=args.ladder,
                prompt_tokens=args.prompt_tokens,
                output_tokens=args.output_tokens,
                duration_s=args.duration,
                timeout_s=args.timeout,
                time_scale=args.time_scale,
                log_text=log_text,
                seed=args.seed,
                progress=progress,
                api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
            )
        )
    except RoundError as exc:
        progress(f"gateway round: error: {exc}")
        return 1
    index, replaced = save_round(out, result)
    verb = "replaced" if replaced else "added"
    progress(f"round {result.name} {verb} as round {index + 1} in {out}")
    return 0
