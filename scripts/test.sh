#!/usr/bin/env bash
# The whole test suite — the README's test command, and what CI runs.
# Needs a Rust toolchain (cargo, rustfmt, clippy) and Python 3 with venv; it
# installs the Python test dependencies itself into .venv (from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step says when it starts (seconds into the run), so that a slow step is
# plain in the log: CI's whole run should stay well under 40 minutes.
step() { printf '\n== %s (%s GB free, %d s into the run)\n' "$*" "$(free_gb)" "$SECONDS"; }
free_gb() { df -Pk . | awk 'NR==2 {printf "%d", $4 / 1024 / 1024}'; }
# The whole run builds a debug and a fuzz target tree, the wheel, and a venv
# (about 8 GB with torch). Say what the disk holds, so that a full disk is
# plain in the log, and name the disk when a step fails.
trap 'echo "error: a step failed; the disk now has $(free_gb) GB free" >&2' ERR
echo "disk: $(free_gb) GB free at the start"
# One non-incremental build per profile: incremental caches only pay off when
# the same crate is rebuilt, and they cost about a GB here.
export CARGO_INCREMENTAL=0

step "format check"
cargo fmt --all -- --check

step "clippy (deny warnings), the workspace and the lean library"
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo clippy -p trajlog --lib --no-default-features --locked -- -D warnings

step "the library alone pulls in no SQLite, clap or indicatif"
if cargo tree -p trajlog --no-default-features -e normal --locked | grep -E "rusqlite|libsqlite3|clap|indicatif"; then
    echo "error: the core library depends on what only the CLI or the migration needs" >&2
    exit 1
fi

step "tests (unit, property, recovery, crash, integration, doc; every crate)"
cargo test --workspace --locked

# The steps below run the CLI and `trajlog serve` from the binary that step
# built (the test profile, opt-level 1), rather than a release build of every
# crate again (~7 minutes here). The benches are compiled in that profile too:
# it links them against the dependencies already built.
step "benches compile (test profile)"
cargo test --workspace --locked --benches --no-run
bin_dir="$PWD/target/ci-bin"
mkdir -p "$bin_dir"
cp target/debug/trajlog "$bin_dir/trajlog"
export TRAJLOG_BIN="$bin_dir/trajlog"
# The debug tree is not used again below. Where the disk is short, it goes, so
# that the fuzz and Python builds have room (a local rerun then builds it
# again).
if [ "$(free_gb)" -lt 20 ]; then
    echo "disk: $(free_gb) GB free; removing target/debug (not needed by the steps below)"
    rm -rf target/debug
fi

step "fuzz (each target ${FUZZ_SECONDS:-10} s over its seed corpus; stable toolchain)"
FUZZ_SECONDS="${FUZZ_SECONDS:-10}" bash scripts/fuzz.sh

step "python tests (the binding; pyarrow, DuckDB, HF datasets read the shards)"
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import pytest, pyarrow, duckdb, datasets, numpy, aiosqlite, fastapi, uvicorn, httpx, openai, pytest_asyncio, yaml" 2>/dev/null; then
    python3 -m venv .venv
    .venv/bin/pip install --quiet --no-cache-dir --upgrade pip
    .venv/bin/pip install --quiet --no-cache-dir -r tests/python/requirements.txt
fi
# torch, for the real multi-worker DataLoader tests, and torchdata (small,
# pure Python) for the StatefulDataLoader resume tests. The torch wheel brings
# ~3 GB of CUDA libraries (~80 s to install here); skipped, with a warning (and
# the tests then report themselves skipped), when the disk has under 12 GB free.
if ! .venv/bin/python -c "import torch, torchdata" 2>/dev/null; then
    free_kb=$(df -Pk . | awk 'NR==2 {print $4}')
    if [ "${free_kb:-0}" -gt $((12 * 1024 * 1024)) ]; then
        .venv/bin/pip install --quiet --no-cache-dir torch \
            || echo "warning: installing torch failed; the DataLoader tests will be skipped"
        .venv/bin/pip install --quiet --no-cache-dir torchdata \
            || echo "warning: installing torchdata failed; the StatefulDataLoader tests will be skipped"
    else
        echo "warning: under 12 GB free; not installing torch/torchdata, the DataLoader tests will be skipped"
    fi
fi
# The Python package, built and installed the way users do it (maturin via pip).
.venv/bin/pip install --quiet ./python
# pytest exits 5 when it collected no test: that is a failure here too.
.venv/bin/python -m pytest -q tests/python python/tests

step "rLLM's model-gateway tests, unchanged, against trajlog serve (compat/)"
bash compat/run-rllm-suite.sh

step "bench-gateway smoke run"
"$TRAJLOG_BIN" bench-gateway --sessions 2 --turns 2 --calls 8 --async-serve

step "demo smoke run"
demo_dir="$(mktemp -d)/store"
"$TRAJLOG_BIN" demo --dir "$demo_dir" --sessions 16 --steps 6
"$TRAJLOG_BIN" verify --store "$demo_dir"
rm -rf "$(dirname "$demo_dir")"

echo
echo "disk: $(free_gb) GB free at the end; the run took $SECONDS s"
echo "all checks passed"
