"""``make bench``: every benchmark part in turn, then one summary of the targets.

Installs the comparison tools first (``scripts/install-bench-tools.sh``: nginx, wrk and
vllm-router; a fast no-op once installed), then runs each part as its own process so a
failure in one does not hide the others:

    overhead  - CPU per request and added latency: gateway vs nginx vs vllm-router
    counting  - token-counting throughput, 20-turn chats, event-loop lag
    scale     - decision time at 1,000 backends, 10k open streams, 2x overload
    fleet     - goodput / TTFT / 400s / preemptions per policy on simulated nodes

Results: ``bench/results/<part>.json``, ``overhead.png``, ``fleet.png`` and
``summary.json`` (targets met or missed, and how long each part took).

    python -m bench.run_all [--quick] [--parts overhead,counting,scale,fleet,hostile] [--no-install]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

from bench.procs import PYTHON, ROOT
from bench.report import RESULTS, machine, save, table

PARTS = ("overhead", "counting", "scale", "fleet", "hostile")


def targets_of(part: str) -> dict[str, Any]:
    path = RESULTS / f"{part}.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    t = data.get("targets") or data.get("summary", {}).get("targets") or {}
    return {k: v for k, v in t.items() if isinstance(v, bool) or v is None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="every part in its --quick mode")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--no-install", action="store_true", help="do not run install-bench-tools.sh")
    args = p.parse_args()
    start = time.monotonic()
    info = machine()
    if not args.no_install:
        subprocess.run(["bash", str(ROOT / "scripts" / "install-bench-tools.sh")], check=False)
    durations: dict[str, float] = {}
    codes: dict[str, int] = {}
    for part in args.parts.split(","):
        print(f"\n===== bench.{part} =====", flush=True)
        t0 = time.monotonic()
        cmd = [PYTHON, "-m", f"bench.{part}"] + (["--quick"] if args.quick else [])
        codes[part] = subprocess.run(cmd, cwd=ROOT, check=False).returncode
        durations[part] = time.monotonic() - t0
        print(f"(bench.{part}: {durations[part]:.0f} s, exit {codes[part]})", flush=True)
    total = time.monotonic() - start
    rows = []
    summary: dict[str, Any] = {
        "machine": info,
        "quick": args.quick,
        "seconds": {**durations, "total": total},
        "exit_codes": codes,
        "targets": {},
    }
    for part in args.parts.split(","):
        for name, ok in targets_of(part).items():
            summary["targets"][f"{part}: {name}"] = ok
            rows.append((part, name, "n/a" if ok is None else ("met" if ok else "MISSED")))
    print("\n===== targets =====")
    print(table(("part", "target", "result"), rows))
    print(
        "times: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in durations.items())
        + f"; total {total / 60:.1f} min"
    )
    save("summary", summary)
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
