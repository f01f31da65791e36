#!/usr/bin/env bash
# The whole test suite — the README's test command, and what CI runs.
# Needs a Rust toolchain (cargo, rustfmt, clippy) and Python 3 with venv; it
# installs the Python test dependencies itself into .venv (from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s\n' "$*"; }

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

step "fuzz (each target ${FUZZ_SECONDS:-10} s over its seed corpus; stable toolchain)"
FUZZ_SECONDS="${FUZZ_SECONDS:-10}" bash scripts/fuzz.sh

step "benches compile"
cargo bench --workspace --locked --no-run

step "python tests (the binding; pyarrow, DuckDB, HF datasets read the shards)"
cargo build --release --locked --quiet
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import pytest, pyarrow, duckdb, datasets, numpy, aiosqlite, fastapi, uvicorn, httpx, openai, pytest_asyncio, yaml" 2>/dev/null; then
    python3 -m venv .venv
    .venv/bin/pip install --quiet --upgrade pip
    .venv/bin/pip install --quiet -r tests/python/requirements.txt
fi
# torch, for the real multi-worker DataLoader test. The PyPI wheel brings ~3 GB
# of CUDA libraries (~80 s to install here); skipped, with a warning (and the
# test then reports itself skipped), when the disk has under 12 GB free.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    free_kb=$(df -Pk . | awk 'NR==2 {print $4}')
    if [ "${free_kb:-0}" -gt $((12 * 1024 * 1024)) ]; then
        .venv/bin/pip install --quiet --no-cache-dir torch \
            || echo "warning: installing torch failed; the DataLoader test will be skipped"
    else
        echo "warning: under 12 GB free; not installing torch, the DataLoader test will be skipped"
    fi
fi
# The Python package, built and installed the way users do it (maturin via pip).
.venv/bin/pip install --quiet ./python
# pytest exits 5 when it collected no test: that is a failure here too.
TRAJLOG_BIN="$PWD/target/release/trajlog" .venv/bin/python -m pytest -q tests/python python/tests

step "rLLM's model-gateway tests, unchanged, against trajlog serve (compat/)"
bash compat/run-rllm-suite.sh

step "bench-gateway smoke run (release)"
target/release/trajlog bench-gateway --sessions 2 --turns 2 --calls 8

step "demo smoke run (release)"
demo_dir="$(mktemp -d)/store"
cargo run --release --locked --quiet -- demo --dir "$demo_dir" --sessions 16 --steps 6
cargo run --release --locked --quiet -- verify --store "$demo_dir"
rm -rf "$(dirname "$demo_dir")"

echo
echo "all checks passed"
