#!/usr/bin/env bash
# Regenerates requirements.lock: the gateway's runtime dependencies (pyproject.toml's
# [project].dependencies, no extras) pinned with the sha256 of every published file, so the
# image (see Dockerfile) installs exactly these with `pip install --require-hashes`.
# Run after changing dependencies in pyproject.toml, with the project's Python (3.11):
#   scripts/lock-requirements.sh          (uses .venv/bin/pip-compile; make install gives it)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP_COMPILE="${PIP_COMPILE:-.venv/bin/pip-compile}"
# Resolve against the public index only: a machine's own pip.conf (extra indexes, local
# wheel folders, constraints) must not leak into the lock. The header names this script.
env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
  CUSTOM_COMPILE_COMMAND="scripts/lock-requirements.sh" "$PIP_COMPILE" \
  --rebuild \
  --quiet \
  --generate-hashes \
  --strip-extras \
  --no-emit-index-url \
  --no-emit-trusted-host \
  --no-emit-find-links \
  --newline=lf \
  --output-file requirements.lock \
  pyproject.toml
