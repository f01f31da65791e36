#!/usr/bin/env bash
# Disk kept by an unfinished session (a straggler) spread over many
# segments, with and without the copy-forward collector
# (format-spec/shard.md §6.3).
#
# One store: ROUNDS rounds of SESSIONS finished sessions of 8 calls in the
# rLLM gateway's realistic shape (`trajlog generate`, sealed), and after
# each round one call of a straggler that never finishes: an agent session
# whose prompt grows by ~300 tokens a call (one-line lean traces through
# `trajlog ingest`). The store is copied, and each copy compacted: with
# `--no-copy-forward`, then with the default (`--copy-forward 0.25`). For
# each: wall time and peak RSS of the compaction, segments left, bytes of
# segments and shards on disk, the live data (`trajlog space`) and disk /
# live. One markdown table.
#
#   bash benches/straggler_space.sh              # 20 rounds of 300 sessions
#   ROUNDS=10 SESSIONS=100 bash benches/straggler_space.sh
#   TRAJLOG=target/release/trajlog DIR=/data KEEP=1 bash benches/straggler_space.sh
#
# Needs the release binary (cargo build --release) and /usr/bin/time. About
# 1.3 GB of disk and ~10 minutes with the defaults on the 2-core VM.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${TRAJLOG:-target/release/trajlog}"
[ -x "$bin" ] || { echo "error: $bin not found; run cargo build --release (or set TRAJLOG)" >&2; exit 1; }
[ -x /usr/bin/time ] || { echo "error: /usr/bin/time (GNU time) not found" >&2; exit 1; }
rounds="${ROUNDS:-20}"
sessions="${SESSIONS:-300}"
base="${DIR:-$(mktemp -d)}"
mkdir -p "$base"
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$base"/straggler-*' EXIT
src="$base/straggler-src"
rm -rf "$src" "$base"/straggler-off "$base"/straggler-on

# The straggler's call k: its prompt is the previous prompt, completion and a
# 100-token tool result (a prefix-delta chain), logprobs included.
straggler_call() {
    python3 - "$1" <<'EOF'
import json, sys
k = int(sys.argv[1])
prompt = list(range(2000))
for j in range(k):
    prompt += [10_000 + j * 300 + i for i in range(200)] + [50_000 + j * 100 + i for i in range(100)]
completion = [10_000 + k * 300 + i for i in range(200)]
print(json.dumps({
    "trace_id": f"straggler/{k}", "session_id": "straggler:0", "timestamp": float(k),
    "prompt_token_ids": prompt, "completion_token_ids": completion,
    "logprobs": [-(i % 17) / 8 for i in range(200)],
}))
EOF
}

echo "== building: $rounds rounds of $sessions sessions x 8 calls (gateway shape) + 1 straggler call each, in $src" >&2
started=$(date +%s.%N)
for ((r = 0; r < rounds; r++)); do
    "$bin" generate --store "$src" --sessions "$sessions" --steps 8 --shape gateway --first-session $((r * sessions)) --seed $((42 + r)) >/dev/null
    straggler_call "$r" | "$bin" ingest --store "$src" >/dev/null
done
build_s=$(awk "BEGIN { print $(date +%s.%N) - $started }")

rows=()
for mode in off on; do
    dir="$base/straggler-$mode"
    cp -r "$src" "$dir"
    flag=()
    [ "$mode" = off ] && flag=(--no-copy-forward)
    t="$base/.time"
    /usr/bin/time -o "$t" -f "%e %M" "$bin" compact --store "$dir" "${flag[@]}" >"$base/.out" 2>&1 || { cat "$base/.out" >&2; exit 1; }
    read -r secs kb <"$t"
    copied=$(sed -n 's/^copied \([0-9]*\) unfinished sessions forward (\([0-9]*\) calls, \(.*\)) out of.*/\1 (\2 calls, \3)/p' "$base/.out")
    segs=$(find "$dir" -maxdepth 1 -name 'seg-*.tlog' | wc -l)
    # Segments (written parts), shards, live data and disk / live as
    # `trajlog space` counts them.
    read -r seg_mb shard_mb live_mb ratio < <("$bin" space --store "$dir" --json | python3 -c '
import json, sys
d = json.load(sys.stdin)
print(d["segment_bytes"] >> 20, d["shard_bytes"] >> 20, d["live_bytes"] >> 20, "%.2f" % d["disk_over_live"])')
    rows+=("| $mode | ${copied:-none} | $secs s, $((kb / 1024)) MB | $segs | $seg_mb MB | $shard_mb MB | $live_mb MB | $ratio |")
done

echo
echo "store: $rounds rounds x $sessions sessions x 8 calls + a $rounds-call straggler, built in ${build_s%.*} s"
echo
echo "| copy-forward | copied | compaction | segments left | segments | shards | live data | disk / live |"
echo "|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
