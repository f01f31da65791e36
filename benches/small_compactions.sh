#!/usr/bin/env bash
# Many small compactions (one per training step, as a trainer that compacts
# what each step finished): shard files and rows written, with merging
# (format-spec/shard.md §6.2) at each fanout of MODES and without
# (`--no-merge`).
# Each round generates SESSIONS new sessions (8 calls each; SHAPE lean by
# default, or gateway: the rLLM gateway's realistic traces) and compacts;
# one markdown table, one row per mode.
#
#   bash benches/small_compactions.sh              # 64 rounds of 50 sessions
#   ROUNDS=200 SESSIONS=20 bash benches/small_compactions.sh
#   MODES="merge-4 merge-16 no-merge" bash benches/small_compactions.sh
#   SHAPE=gateway ROUNDS=24 SESSIONS=4 bash benches/small_compactions.sh
#   TRAJLOG=target/release/trajlog bash benches/small_compactions.sh
#
# Needs the release binary (cargo build --release). The stores go in a
# temporary directory, removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${TRAJLOG:-target/release/trajlog}"
[ -x "$bin" ] || { echo "error: $bin not found; run cargo build --release (or set TRAJLOG)" >&2; exit 1; }
rounds="${ROUNDS:-64}"
sessions="${SESSIONS:-50}"
base="$(mktemp -d)"
trap 'rm -rf "$base"' EXIT

shape="${SHAPE:-lean}"
prompt=()
[ "$shape" = lean ] && prompt=(--prompt-tokens 100)
rows=()
for mode in ${MODES:-merge-8 merge-4 no-merge}; do
    dir="$base/$mode"
    case "$mode" in
        no-merge) flags=(--no-merge) ;;
        merge-*) flags=(--merge-fanout "${mode#merge-}") ;;
        *) echo "error: mode $mode is not no-merge or merge-N" >&2; exit 1 ;;
    esac
    max_files=0
    moved=0
    compact_s=0
    for ((r = 0; r < rounds; r++)); do
        "$bin" generate --store "$dir" --sessions "$sessions" --first-session $((r * sessions)) \
            --steps 8 --shape "${SHAPE:-lean}" "${prompt[@]}" >/dev/null 2>&1
        started=$(date +%s.%N)
        out=$("$bin" compact --store "$dir" "${flags[@]}")
        compact_s=$(awk "BEGIN { print $compact_s + $(date +%s.%N) - $started }")
        m=$(sed -n 's/.*: \([0-9]*\) live calls written again.*/\1/p' <<<"$out")
        moved=$((moved + ${m:-0}))
        files=$(find "$dir/shards" -name 'part-*.parquet' | wc -l)
        [ "$files" -gt "$max_files" ] && max_files=$files
    done
    files=$(find "$dir/shards" -name 'part-*.parquet' | wc -l)
    calls=$((rounds * sessions * 8))
    wa=$(awk "BEGIN { printf \"%.2f\", ($calls + $moved) / $calls }")
    rows+=("| $mode | $rounds × $sessions $shape sessions ($calls calls) | $files | $max_files | $moved | $wa | $(printf '%.1f' "$compact_s") s |")
    echo "== $mode done" >&2
done
echo
echo "| mode | rounds | shard files at the end | most at once | rows written again | rows written / rows compacted | compaction time, all rounds |"
echo "|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
