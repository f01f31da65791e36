#!/usr/bin/env bash
# Build the fuzz targets with libFuzzer coverage instrumentation on the stable
# toolchain (no nightly, no cargo-fuzz needed) and run each for a while over a
# scratch copy of its committed seed corpus (fuzz/corpus/<target>).
#
#   bash scripts/fuzz.sh                 # every target, FUZZ_SECONDS each (default 15)
#   FUZZ_SECONDS=600 bash scripts/fuzz.sh record_decode     # one target, longer
#
# A crash stops the script with a non-zero exit; the input is saved under
# fuzz/artifacts/<target>/. Copy it to fuzz/regressions/<target>/ so that
# `cargo test` replays it from then on. Prints executions and executions/s per
# target. With a nightly toolchain, `cargo +nightly fuzz run <target>` (with
# AddressSanitizer) works too.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${FUZZ_SECONDS:-15}"
triple="$(rustc -vV | sed -n 's/^host: //p')"
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"
target_dir="$PWD/target/fuzz"
# --target keeps the instrumentation off build scripts and proc macros.
cargo build --quiet --release --manifest-path fuzz/Cargo.toml --target "$triple" --target-dir "$target_dir"
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(record_decode segment_scan footer_decode manifest_decode store_recovery trace_json)
fi
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
printf '%-16s %8s %12s %10s %8s\n' target seconds executions "exec/s" corpus
for t in "${targets[@]}"; do
    mkdir -p "$scratch/$t" "fuzz/artifacts/$t"
    cp fuzz/corpus/"$t"/* "$scratch/$t/"
    log="$scratch/$t.log"
    if ! "$target_dir/$triple/release/$t" "$scratch/$t" -max_total_time="$seconds" -print_final_stats=1 \
        -rss_limit_mb=2048 -artifact_prefix="fuzz/artifacts/$t/" >"$log" 2>&1; then
        tail -40 "$log"
        echo "fuzz target $t failed; the input is in fuzz/artifacts/$t/" >&2
        exit 1
    fi
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
    printf '%-16s %8s %12s %10s %8s\n' "$t" "$seconds" "${execs:-?}" "${rate:-?}" "$(ls "$scratch/$t" | wc -l)"
done
