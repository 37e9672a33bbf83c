#!/usr/bin/env bash
# Installs the real Prometheus server and promtool (Debian package `prometheus`) when they are
# missing. Used by `make test` so the metrics and alert-rule tests run against the real tools.
# A no-op when both are already on PATH.
set -euo pipefail
if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
fail() {
  echo "install-prometheus: $*" >&2
  exit 1
}
command -v apt-get >/dev/null 2>&1 \
  || fail "promtool/prometheus missing and no apt-get here: install Prometheus (>= 2.37) by hand"
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || fail "not root and no sudo: run as root to install prometheus"
  SUDO=sudo
else
  SUDO=
fi
echo "install-prometheus: installing the Debian package prometheus (promtool + server)" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# --no-install-recommends keeps node-exporter & co. off the machine; we only need the binaries.
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# The package starts a system service on some machines; tests run their own on loopback.
if command -v systemctl >/dev/null 2>&1; then
  $SUDO systemctl stop prometheus >/dev/null 2>&1 || true
fi
command -v promtool >/dev/null 2>&1 || fail "the package installed no promtool on PATH"
command -v prometheus >/dev/null 2>&1 || fail "the package installed no prometheus on PATH"
