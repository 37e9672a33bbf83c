#!/usr/bin/env bash
# The whole suite after lint: mypy beside the main tier, the timing tests alone, then the
# real-vLLM tier. The main tier runs 3 workers on 2 cores (it spends a sixth of its time
# waiting on sockets and timers); mypy (one core, ~45 s from an empty cache) takes some
# of that, and its errors fail the run once the main tier is done.
# The real tier's nodes but the one whose engine a test kills start in the background as
# the main tier begins: S and L (which every real module uses), then the other
# vocabularies and the hybrid model. A node's start-up is mostly imports on one core
# (~30 CPU seconds; three take ~50 s beside each other on an idle machine, ~2.6 GB each),
# which the main tier absorbs better than the real tier, whose first vocabulary test
# would otherwise wait ~70 s for them. They stop when this script ends, however it ends.
# Where vLLM is not installed nothing starts early and the real tier says why it skips
# (under CI=true it fails).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
nodes=$(mktemp -d /tmp/kvgateway-test-nodes.XXXXXX)
keeper=
typecheck=
cleanup() {
    if [ -n "$keeper" ]; then kill "$keeper" 2>/dev/null || true; fi
    if [ -n "$typecheck" ]; then kill "$typecheck" 2>/dev/null || true; fi
    "$BIN/python" -m tests.support.vllm_nodes --stop --dir "$nodes" || true
    rm -rf "$nodes"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if "$BIN/python" -c 'import sys; from tests.support.vllm_nodes import vllm_missing; sys.exit(vllm_missing() is not None)'; then
    "$BIN/python" -m tests.support.vllm_nodes S L --then llama mistral H --dir "$nodes" \
        >"$nodes/keep.log" 2>&1 &
    keeper=$!
fi

"$BIN/mypy" >"$nodes/mypy.log" 2>&1 &
typecheck=$!

"$BIN/pytest" -n 3 -q -m "not real_vllm and not timing"
status=0
wait "$typecheck" || status=$?
typecheck=
cat "$nodes/mypy.log"
if [ "$status" -ne 0 ]; then
    echo "mypy failed" >&2
    exit "$status"
fi
# Tests that compare latencies, alone on the machine (beside the parallel tier, the
# CPU it takes moves their timings more than what they measure).
"$BIN/pytest" -q -m "timing and not real_vllm"

if [ -n "$keeper" ]; then
    # Bounded: the keeper gives up after the nodes' start-up timeout.
    if ! wait "$keeper"; then
        echo "early start of the nodes failed; the real tier starts its own:" >&2
        # Which node, and how (its exit status or the start-up timeout), then its log's end.
        { grep -h -E "vLLM node .* (exited with|not ready)" "$nodes/keep.log" >&2; } || true
        tail -n 40 "$nodes/keep.log" >&2 || true
        # The root cause is in the failed node's own log, before the traceback above.
        { grep -h -E "ERROR|Killed|MemoryError|No space" "$nodes"/vllm-*.log 2>/dev/null | tail -n 20 >&2; } || true
    fi
    keeper=
fi
KVGATEWAY_REAL_NODES="$nodes${KVGATEWAY_REAL_NODES:+:$KVGATEWAY_REAL_NODES}" \
    "$BIN/pytest" -q -m real_vllm tests/real_vllm
