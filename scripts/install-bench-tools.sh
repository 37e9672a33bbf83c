#!/usr/bin/env bash
# Installs what `make bench` compares the gateway with, when it is missing:
#   nginx (Debian package nginx-light: the floor), wrk (Debian: a C load generator, used as
#   a cross-check of bench/loadgen.py), and vllm-router (PyPI, Rust: the fastest peer) in
#   its own virtualenv bench/.router-venv so it cannot disturb the project's dependencies.
# A fast no-op once everything is there. A tool that cannot be installed is reported and
# skipped (exit 0): the benchmark then prints why that column is empty.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROUTER_VENV="$ROOT/bench/.router-venv"
PYTHON="${PYTHON:-python3}"
log() { echo "install-bench-tools: $*" >&2; }

missing_debs=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing_debs+=(nginx-light)
command -v wrk >/dev/null 2>&1 || missing_debs+=(wrk)
if [ "${#missing_debs[@]}" -gt 0 ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    log "no apt-get here: install ${missing_debs[*]} by hand (their columns are skipped)"
  else
    SUDO=
    if [ "$(id -u)" -ne 0 ]; then
      if command -v sudo >/dev/null 2>&1; then SUDO=sudo; else SUDO=none; fi
    fi
    if [ "$SUDO" = none ]; then
      log "not root and no sudo: install ${missing_debs[*]} by hand (their columns are skipped)"
    else
      log "installing Debian packages: ${missing_debs[*]}"
      export DEBIAN_FRONTEND=noninteractive
      $SUDO apt-get update -qq || log "apt-get update failed; trying the install anyway"
      $SUDO apt-get install -y -qq --no-install-recommends "${missing_debs[@]}" >/dev/null \
        || log "apt-get install ${missing_debs[*]} failed (their columns are skipped)"
      # The package may start a system nginx on :80; the benchmark runs its own on loopback.
      if command -v systemctl >/dev/null 2>&1; then
        $SUDO systemctl disable --now nginx >/dev/null 2>&1 || true
      fi
    fi
  fi
fi

if [ ! -x "$ROUTER_VENV/bin/vllm-router" ] && [ ! -f "$ROUTER_VENV/.install-failed" ]; then
  log "installing vllm-router (PyPI) into bench/.router-venv"
  rm -rf "$ROUTER_VENV"
  "$PYTHON" -m venv "$ROUTER_VENV"
  if "$ROUTER_VENV/bin/pip" install --quiet --disable-pip-version-check vllm-router \
    >"$ROUTER_VENV/install.log" 2>&1 && [ -x "$ROUTER_VENV/bin/vllm-router" ]; then
    log "vllm-router $("$ROUTER_VENV/bin/pip" show vllm-router 2>/dev/null | sed -n 's/^Version: //p') installed"
  else
    # Remember the failure so later runs stay fast; delete bench/.router-venv to retry.
    touch "$ROUTER_VENV/.install-failed"
    log "vllm-router could not be installed (see bench/.router-venv/install.log)"
  fi
fi
exit 0
