#!/usr/bin/env bash
# The whole test suite — the README's test command, and what CI runs.
# Needs only a Rust toolchain (cargo, rustfmt, clippy); installs nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s\n' "$*"; }

step "format check"
cargo fmt --all -- --check

step "clippy (deny warnings)"
cargo clippy --all-targets --locked -- -D warnings

step "tests (unit, property, recovery, crash, integration, doc)"
cargo test --locked

step "benches compile"
cargo bench --locked --no-run

step "demo smoke run (release)"
demo_dir="$(mktemp -d)/store"
cargo run --release --locked --quiet -- demo --dir "$demo_dir" --sessions 16 --steps 6
cargo run --release --locked --quiet -- verify --store "$demo_dir"
rm -rf "$(dirname "$demo_dir")"

echo
echo "all checks passed"
