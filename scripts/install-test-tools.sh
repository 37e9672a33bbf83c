#!/usr/bin/env bash
# Installs the programs some tests drive, when they are missing (Debian packages):
#   promtool + prometheus  (package prometheus)     metrics, alert-rule and live-scrape tests
#   dnsmasq                (package dnsmasq-base)   DNS discovery tests (a DNS server on loopback)
#   redis-server           (package redis-server)   shared-ledger tests (tests start their own)
# `make test` runs it first. A no-op when all are on PATH.
# Where they cannot be installed (no apt-get, not root, no network) a developer's run goes on
# and those tests skip, saying why; with CI=true this script fails instead, so CI always runs them.
set -euo pipefail
PATH="$PATH:/usr/sbin:/sbin"
have() { command -v "$1" >/dev/null 2>&1; }
missing=()
have promtool && have prometheus || missing+=(prometheus)
have dnsmasq || missing+=(dnsmasq-base)
have redis-server || missing+=(redis-server)
[ ${#missing[@]} -eq 0 ] && exit 0

give_up() {
  case "${CI:-}" in
    1 | true | TRUE | yes)
      echo "install-test-tools: $* (CI=true: failing)" >&2
      exit 1
      ;;
  esac
  echo "install-test-tools: $*; the tests that need ${missing[*]} will be skipped" >&2
  exit 0
}
have apt-get || give_up "no apt-get here: install ${missing[*]} by hand"
if [ "$(id -u)" -ne 0 ]; then
  have sudo || give_up "not root and no sudo"
  SUDO=sudo
else
  SUDO=
fi
echo "install-test-tools: installing the Debian package(s) ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq || give_up "apt-get update failed"
# --no-install-recommends keeps node-exporter & co. off the machine; dnsmasq-base is the
# binary without the system service (which would take port 53).
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
  || give_up "apt-get install ${missing[*]} failed"
# The prometheus and redis-server packages start system services on some machines; tests
# run their own, on free ports.
if have systemctl; then
  $SUDO systemctl stop prometheus >/dev/null 2>&1 || true
  $SUDO systemctl stop redis-server >/dev/null 2>&1 || true
fi
for tool in promtool prometheus dnsmasq redis-server; do
  have "$tool" || give_up "the packages installed no $tool on PATH"
done
