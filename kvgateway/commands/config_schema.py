"""`gateway config-schema`: the config format as a JSON Schema, for editors."""

from __future__ import annotations

import argparse
import json
import sys

from kvgateway.config.schema import config_schema


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "config-schema",
        help="print a JSON Schema of the config file (for editor completion and checks)",
        description=(
            "Print a JSON Schema (draft 2020-12) of the gateway YAML, derived from the "
            "loader itself. Point your editor at it, e.g. with the YAML language server: "
            "`# yaml-language-server: $schema=gateway.schema.json` as the file's first line. "
            "`gateway check` remains the full validation (model names, URLs, env references)."
        ),
    )
    p.add_argument("--output", "-o", help="write to this file instead of stdout")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    text = json.dumps(config_schema(), indent=2) + "\n"
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError as exc:
            sys.stderr.write(
                f"gateway config-schema: cannot write {args.output!r}: {exc.strerror}\n"
            )
            return 1
    else:
        sys.stdout.write(text)
    return 0
