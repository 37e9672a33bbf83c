"""Where the gateway's CPU goes per request: py-spy on a ``gateway serve`` process.

Runs the overhead setup (fake upstream, gateway process, load generator process) with
py-spy sampling the gateway, once per workload (``distinct``: every ~1k-token prompt
new; ``history``: the same long history with a new short message), and prints the
functions with the most samples, self and inclusive, plus the gateway's CPU per request
measured from /proc in the same window. py-spy samples wall-clock stacks of running
threads: on a busy 2-core machine a thread that is runnable but preempted inside a
socket write still counts, so compare with the ``kernel %`` column of bench.overhead
(most of the gateway's CPU is user space). Sampling does not pause the process
(``--nonblocking``), so some coroutine stacks come back cut short: self shares are sound,
inclusive shares are lower bounds.

Needs py-spy (``.venv/bin/pip install py-spy``; not a project dependency).

    python -m bench.profile_gateway [--seconds 10] [--concurrency 32] [--top 25]
        [--tokenizer qwen|DIR]
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import model_dirs, procs
from bench.overhead import gateway_yaml, run_loadgen

_FRAME = re.compile(r"(.*?) \((.*?)(?::\d+)?\)$")


def _name(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    path = m.group(2).split("site-packages/")[-1].split(str(procs.ROOT) + "/")[-1]
    return f"{m.group(1)} ({path})"


def analyse(raw: Path, top: int) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
    total = 0
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():  # a note py-spy writes among the stacks (e.g. lost samples)
            continue
        frames = [_name(f) for f in stack.split(";")]
        total += int(n)
        own[frames[-1]] += int(n)
        for f in set(frames):
            incl[f] += int(n)
    return total, own.most_common(top), incl.most_common(top + 12)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--tokenizer",
        help="count exactly with this model's tokenizer and chat template (as bench.overhead's "
        "--tokenizer); default the cl100k stand-in",
    )
    args = p.parse_args()
    tokenizer = model_dirs.tokenizer_dir(args.tokenizer) if args.tokenizer else None
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(pyspy).exists():
        sys.exit("py-spy is not installed: .venv/bin/pip install py-spy")
    procs.raise_nofile()
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp:
        work = Path(tmp)
        up_port, gw_port = procs.free_port(), procs.free_port()
        (work / "gateway.yaml").write_text(gateway_yaml(gw_port, up_port, tokenizer=tokenizer))
        with (
            procs.running(
                "fake-upstream",
                procs.fake_upstream_cmd(up_port),
                up_port,
            ),
            procs.running(
                "gateway",
                procs.gateway_cmd(work / "gateway.yaml"),
                gw_port,
            ) as gw,
        ):
            for body in ("distinct", "history"):
                raw = work / f"{body}.txt"
                spy = subprocess.Popen(
                    [
                        pyspy,
                        "record",
                        "-p",
                        str(gw.pid),
                        "-d",
                        str(int(args.seconds) + 1),
                        "-r",
                        "250",
                        "-f",
                        "raw",
                        "-o",
                        str(raw),
                        "--nonblocking",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                res = run_loadgen(
                    {
                        "port": gw_port,
                        "warmup_s": 0.5,
                        "duration_s": args.seconds,
                        "cpu_pids": {"gateway": [gw.pid]},
                        "workloads": [{"concurrency": args.concurrency, "body": body}],
                    }
                )
                spy.wait(timeout=60)
                n = res["workloads"]["load"]["requests"]
                cpu = res["cpu_s"]["gateway"]
                sys_share = res["cpu_sys_s"]["gateway"] / cpu if cpu else 0.0
                total, own, incl = analyse(raw, args.top)
                print(
                    f"\n== {body}: {n} requests, gateway CPU {1000 * cpu / max(1, n):.3f} ms/request "
                    f"({100 * sys_share:.0f}% kernel); {total} py-spy samples"
                )
                print("-- self")
                for f, c in own:
                    print(f"{100 * c / total:5.1f}%  {f}")
                print("-- inclusive")
                for f, c in incl:
                    print(f"{100 * c / total:5.1f}%  {f}")


if __name__ == "__main__":
    main()
