"""The Dockerfile, checked statically (no Docker engine here): slim Python 3.11 base,
`pip install .` from a build context that .dockerignore leaves complete, non-root user,
HEALTHCHECK on /health, a default command the real CLI accepts, tokenizer offline."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvgateway.cli import build_parser
from kvgateway.config.load import load_config
from tests.support.known import REPO


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends in a line continuation"
    return out


def _all(word: str) -> list[str]:
    return [rest for w, rest in instructions() if w == word]


def _exec_form(word: str) -> list[str]:
    (rest,) = _all(word)
    value = json.loads(rest)
    assert isinstance(value, list), f"{word} must use the exec (JSON) form"
    return [str(v) for v in value]


def dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents wins."""
    patterns = []
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:] if negate else line
        regex = re.escape(pattern.strip("/")).replace(r"\*\*", "\0").replace(r"\*", "[^/]*")
        regex = regex.replace(r"\?", "[^/]").replace("\0/", "(?:.*/)?").replace("\0", ".*")
        patterns.append((re.compile(regex + "$"), negate))
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for compiled, negate in patterns:
        if any(compiled.match(c) for c in candidates):
            excluded = not negate
    return excluded


def test_base_image_is_slim_python_311_pinned_by_digest() -> None:
    (base,) = _all("FROM")
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?@sha256:[0-9a-f]{64}", base), base


def _step(pattern: str) -> int:
    """Index of the one instruction whose text matches ``pattern``."""
    found = [i for i, (w, rest) in enumerate(instructions()) if re.search(pattern, f"{w} {rest}")]
    assert len(found) == 1, (pattern, found)
    return found[0]


def test_dependencies_are_installed_from_the_lock_in_their_own_layer() -> None:
    copy_lock = _step(r"^COPY requirements\.lock ")
    install_lock = _step(r"^RUN pip install --require-hashes --no-deps -r requirements\.lock$")
    copy_code = _step(r"^COPY kvgateway ")
    install_code = _step(r"\bpip install --no-deps --no-build-isolation \.(\s|$)")
    # The lock's layer comes before any source is copied: editing code reuses it.
    assert copy_lock < install_lock < copy_code < install_code
    assert not any(
        w == "COPY" and ("pyproject" in rest or "kvgateway" in rest)
        for w, rest in instructions()[:install_lock]
    )


def test_copied_sources_exist_and_survive_dockerignore() -> None:
    sources: list[str] = []
    for rest in _all("COPY"):
        words = [w for w in shlex.split(rest) if not w.startswith("--")]
        sources.extend(words[:-1])
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    # setuptools refuses to build without the readme pyproject names.
    assert pyproject["project"]["readme"] in sources
    assert "kvgateway" in sources
    for source in sources:
        path = REPO / source
        assert path.exists(), f"COPY {source}: missing from the repository"
        files = [path] if path.is_file() else [p for p in path.rglob("*.py")]
        assert files, source
        for f in files:
            rel = f.relative_to(REPO).as_posix()
            assert not dockerignore_excludes(rel), f"{rel} is needed but .dockerignore drops it"


def test_lock_pins_every_runtime_dependency_with_hashes() -> None:
    from packaging.requirements import Requirement

    text = (REPO / "requirements.lock").read_text()
    entries = re.findall(
        r"^([A-Za-z0-9_.-]+)==(\S+)((?:\s*;[^\\\n]*)?)\s*\\\n((?:\s+--hash=sha256:[0-9a-f]{64}\s*\\?\n?)+)",
        text,
        re.M,
    )
    pinned = {name.lower().replace("_", "-"): version for name, version, _, _ in entries}
    assert all(len(re.findall("sha256", hashes)) >= 1 for *_, hashes in entries)
    assert "scripts/lock-requirements.sh" in text  # the header names how to regenerate it
    assert "--find-links" not in text and "--index-url" not in text
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in map(Requirement, deps):
        name = dep.name.lower().replace("_", "-")
        assert name in pinned, (
            f"{name} is not in requirements.lock: run scripts/lock-requirements.sh"
        )
        assert dep.specifier.contains(pinned[name], prereleases=True), (name, pinned[name])
    lines = [ln for ln in text.splitlines() if re.match(r"^[A-Za-z0-9]", ln)]
    assert len(lines) == len(entries), "every pinned line carries its hashes"


@pytest.mark.parametrize("path", [".git/HEAD", ".venv/bin/python", "tests/__init__.py"])
def test_dockerignore_keeps_the_context_small(path: str) -> None:
    assert dockerignore_excludes(path)


def test_runs_as_non_root() -> None:
    users = _all("USER")
    assert users, "no USER: the container would run as root"
    user = users[-1].split(":")[0]
    assert user.isdigit() and int(user) != 0, "a numeric non-root uid (for runAsNonRoot)"
    last_user = max(i for i, (w, _) in enumerate(instructions()) if w == "USER")
    assert not any(w == "RUN" for w, _ in instructions()[last_user:]), "RUN after USER"


def test_entrypoint_and_cmd_are_a_valid_serve_on_the_exposed_port() -> None:
    entry = _exec_form("ENTRYPOINT")
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry == ["gateway"] and "gateway" in scripts
    args = build_parser().parse_args(_exec_form("CMD"))
    assert args.command == "serve" and args.host == "0.0.0.0"
    (exposed,) = _all("EXPOSE")
    assert int(exposed) == args.port == load_config(str(REPO / "config" / "demo.yaml")).server.port
    copied = {shlex.split(rest)[-1] for rest in _all("COPY")}
    assert args.config in copied, "the default config must be in the image"


def test_healthcheck_probes_health_on_the_exposed_port() -> None:
    (check,) = _all("HEALTHCHECK")
    (exposed,) = _all("EXPOSE")
    assert f"127.0.0.1:{exposed}/health" in check
    assert re.search(r"--timeout=\d+s", check) and "CMD" in check


def test_tokenizer_loads_without_network(tmp_path: Path) -> None:
    """The build's offline check, run here with every proxy pointing at a closed port
    and an empty tiktoken cache: the BPE file must come from the installed wheel.
    (tiktoken still copies the local file into its cache dir, hence /tmp is writable
    in the Kubernetes pod.)"""
    (offline,) = [r for r in _all("RUN") if r.startswith("--network=none")]
    argv = shlex.split(offline)[1:]
    assert argv[0] == "python"
    dead = "http://127.0.0.1:9"
    env = {
        **os.environ,
        "HTTP_PROXY": dead,
        "HTTPS_PROXY": dead,
        "http_proxy": dead,
        "https_proxy": dead,
        "TIKTOKEN_CACHE_DIR": str(tmp_path),
        "DATA_GYM_CACHE_DIR": str(tmp_path),
    }
    res = subprocess.run(
        [sys.executable, *argv[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
