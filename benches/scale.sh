#!/usr/bin/env bash
# The engine as history grows (issue "The engine at production scale"): for
# each size, build a store of lean, small calls with `trajlog generate`
# (8 calls per session, 100-token first prompts: what grows with history is
# the index, not the payload), then time and measure peak RSS (GNU time) of:
#   open + list (`trajlog ls`, read-only) before and after compaction,
#   the first compaction (everything), a second one after 50 new sessions,
#   reading one session (`trajlog show`, from the shards), the two
#   whole-store scans (`trajlog export` of every call, `trajlog audit`),
#   the library's open, read-only and writable, with VmRSS right after it,
#   the first read of one session after a read-only open (8 calls, full
#   prompts, from the shards), and a read-only store's refresh after 1,000
#   appends (examples/open_cost.rs),
# and report bytes on disk. One markdown table, one row per size. Each store
# starts with one straggler: a session of one call, never sealed, so never
# compacted (as an agent that crashed mid-rollout leaves it); "on disk" and
# "segments left" show what it keeps after compaction.
#
#   bash benches/scale.sh                    # 200,000 and 1,000,000 calls
#   bash benches/scale.sh 100000 2000000     # calls per store
#   TRAJLOG=target/release/trajlog KEEP=1 SCALE_DIR=/data bash benches/scale.sh
#   TINY=1 bash benches/scale.sh 1000000 10000000   # tiny calls: 16-token first
#        prompts, ~8-token completions and turns (~380 bytes a call on disk),
#        so that 10M calls fit a small disk
#   SHAPE=gateway bash benches/scale.sh 20000   # the rLLM gateway's realistic
#        traces (chat history, raw request and response) at the default sizes
#   BATCH_CALLS=262144 bash benches/scale.sh     # the first compaction in
#        batches of that size (`trajlog compact --batch-calls`; default
#        1048576); BATCH_CALLS=none: in one (`--no-batches`): higher peak,
#        shorter
#
# Needs the release binaries (cargo build --release; cargo build --release
# --example open_cost) and /usr/bin/time. The
# stores go under SCALE_DIR (default: a temporary directory), removed at the
# end unless KEEP=1. About 1 GB of disk and ~1 minute per 200,000 calls here.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${TRAJLOG:-target/release/trajlog}"
[ -x "$bin" ] || { echo "error: $bin not found; run cargo build --release (or set TRAJLOG)" >&2; exit 1; }
[ -x /usr/bin/time ] || { echo "error: /usr/bin/time (GNU time) not found" >&2; exit 1; }
oc="${OPEN_COST:-target/release/examples/open_cost}"
[ -x "$oc" ] || { echo "error: $oc not found; run cargo build --release --example open_cost (or set OPEN_COST)" >&2; exit 1; }
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(200000 1000000)
base="${SCALE_DIR:-$(mktemp -d)}"
mkdir -p "$base"
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$base"/scale-*' EXIT

# measure LABEL CMD...: run CMD (stdout dropped), set m_LABEL to "S s, M MB"
# (wall seconds and peak RSS).
measure() {
    local label="$1"
    shift
    local t="$base/.time" err="$base/.stderr"
    if ! /usr/bin/time -o "$t" -f "%e %M" "$@" >/dev/null 2>"$err"; then
        cat "$err" >&2
        echo "error: $label failed: $*" >&2
        exit 1
    fi
    local s kb
    read -r s kb <"$t"
    printf -v "m_$label" '%s s, %d MB' "$s" "$((kb / 1024))"
}

# open_cost DIR [--writable]: "S s, M MB" (the open's wall time, VmRSS after it).
open_cost() {
    "$oc" "$@" | sed -n 's/^open ([a-z-]*): \([0-9.]*\) s;.*VmRSS \([0-9]*\) kB.*/\1 \2/p' |
        awk '{ printf "%s s, %d MB", $1, $2 / 1024 }'
}

call_shape=(--steps 8 --prompt-tokens 100 --shape lean)
[ "${TINY:-0}" = 1 ] && call_shape=(--steps 8 --prompt-tokens 16 --completion-tokens 8 --tool-tokens 8 --shape lean)
[ "${SHAPE:-lean}" = gateway ] && call_shape=(--steps 8 --shape gateway)
rows=()
for calls in "${sizes[@]}"; do
    sessions=$((calls / 8))
    dir="$base/scale-$calls"
    rm -rf "$dir"
    echo "== $calls calls ($sessions sessions) in $dir" >&2
    started=$(date +%s.%N)
    echo '{"trace_id":"straggler/0","session_id":"straggler:0","prompt_token_ids":[1,2,3],"completion_token_ids":[4,5],"logprobs":[-0.5,-0.25]}' |
        "$bin" ingest --store "$dir" >/dev/null
    "$bin" generate --store "$dir" --sessions "$sessions" "${call_shape[@]}" >&2
    gen_s=$(awk "BEGIN { print $(date +%s.%N) - $started }")
    measure ls_log "$bin" ls --store "$dir"
    batch=()
    case "${BATCH_CALLS:-}" in
        "") ;;
        none) batch=(--no-batches) ;;
        *) batch=(--batch-calls "$BATCH_CALLS") ;;
    esac
    measure compact1 "$bin" compact --store "$dir" "${batch[@]}"
    measure ls_shards "$bin" ls --store "$dir"
    "$bin" generate --store "$dir" --sessions 50 "${call_shape[@]}" --first-session "$sessions" >&2
    measure compact2 "$bin" compact --store "$dir"
    measure show "$bin" show --store "$dir" "task-$((sessions / 8 / 2)):0"
    measure export "$bin" export --store "$dir"
    measure audit "$bin" audit --store "$dir"
    # The library's open, read-only and writable (wall time, VmRSS right
    # after it), then a read-only store's refresh after 1,000 appends
    # (which stay in the store: measured last).
    open_ro=$(open_cost "$dir")
    open_w=$(open_cost "$dir" --writable)
    read1=$("$oc" "$dir" --session "task-$((sessions / 8 / 2)):0" | sed -n 's/^read session .* in \([0-9.]*\) ms$/\1 ms/p')
    refresh=$("$oc" "$dir" --refresh 1000 | sed -n 's/^refresh after 1000 appends: \([0-9.]*\) ms.*/\1 ms/p')
    disk=$(du -sm "$dir" | cut -f1)
    shards=$(du -sm "$dir/shards" | cut -f1)
    segs=$(find "$dir" -maxdepth 1 -name 'seg-*.tlog' | wc -l)
    segs_mb=$(find "$dir" -maxdepth 1 -name 'seg-*.tlog' -exec du -cm {} + | tail -1 | cut -f1)
    rows+=("| $calls | $(printf '%.0f' "$gen_s") s | $m_ls_log | $m_compact1 | $m_ls_shards | $m_compact2 | $m_show | $m_export | $m_audit | $open_ro | $open_w | $read1 | $refresh | $disk MB ($shards MB shards) | $segs ($segs_mb MB) |")
done
echo
echo "| calls | generate | open + ls (log) | compact all | open + ls (shards) | compact 50 new | show 1 session | export all | audit | open read-only (VmRSS after) | open writable | first read of 1 session | refresh after 1,000 appends | on disk | segments left |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
