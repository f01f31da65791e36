#!/usr/bin/env bash
# rLLM's model-gateway tests (vendored in compat/rllm-model-gateway), run
# unchanged against `trajlog serve` through compat/trajlog_serve_plugin.py.
#   bash compat/run-rllm-suite.sh [--rllm] [pytest args...]
# --rllm runs them against rLLM's own Python gateway instead (the baseline).
# Needs the release binary (cargo build --release) or TRAJLOG_BIN, and a venv
# with tests/python/requirements.txt (PYTHON, default .venv/bin/python).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
python="${PYTHON:-$repo/.venv/bin/python}"
plugin=(-p trajlog_serve_plugin)
if [ "${1:-}" = "--rllm" ]; then
    plugin=()
    shift
fi
export TRAJLOG_BIN="${TRAJLOG_BIN:-$repo/target/release/trajlog}"
cd "$here/rllm-model-gateway"
# The files that exercise a gateway over HTTP or ASGI with the mock upstream.
# Left out: test_training_workflow.py (needs litellm), test_cumulative_token_mode.py
# (rLLM's re-rendering mode, out of scope), tests of rLLM's Python internals,
# and the integration tests that need a real vLLM on a GPU.
PYTHONPATH="$here/rllm-model-gateway/src:$here${PYTHONPATH:+:$PYTHONPATH}" \
    "$python" -m pytest -q -p no:cacheprovider "${plugin[@]}" \
    tests/unit/test_gateway_client.py \
    tests/integration/test_sampling_enforcement_e2e.py \
    tests/unit/test_server.py \
    tests/unit/test_error_resilience.py \
    tests/unit/test_concurrent_sessions.py \
    "$@"
