"""Memory and time of point reads from compacted shards, as a trainer does
them: read N sessions one by one with `store.session(sid)` and hold each
call's zero-copy `completion_token_ids`, then read the same sessions as dicts
(`session_dicts`, not held). Prints RSS (VmRSS) after 1, 10, 50 and N held.

    python benches/hold_sessions.py STORE [N]

STORE: a compacted store, e.g. `trajlog generate --store /tmp/sgw --sessions
4000` (the gateway shape) then `trajlog compact --store /tmp/sgw`.
"""

import sys
import time

import trajlog


def rss_mb() -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) // 1024


def main() -> None:
    path = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    store = trajlog.Store(path, read_only=True)
    ids = [d["session_id"] for d in store.sessions()][:n]
    print(f"{len(ids)} sessions; RSS after open {rss_mb()} MB")
    held = []
    started = time.perf_counter()
    for i, sid in enumerate(ids):
        held.append([c.completion_token_ids for c in store.session(sid)])
        if i + 1 in (1, 10, 50, len(ids)):
            print(f"{i + 1} sessions held: {rss_mb()} MB, {time.perf_counter() - started:.2f} s")
    held.clear()
    started = time.perf_counter()
    for sid in ids:
        store.session_dicts(sid)
    print(f"{len(ids)} session_dicts (not held): {time.perf_counter() - started:.2f} s")


if __name__ == "__main__":
    main()
