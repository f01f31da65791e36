//! The shard index file's tables (format-spec/shard-index.md): the fixed
//! layout read through `bytemuck` casts, as trajlog does, against the same
//! rows archived with rkyv (the design card's suggestion; issue "The engine
//! at production scale" asks for the two to be measured). Run:
//! `cargo bench --bench index_layout [-- ROWS]` (default 10,000,000).
//!
//! One table of ROWS frozen rows (40 bytes: log position, timestamp, trace
//! id offset and length, session), sorted by log position, is written both
//! ways to a file, which is then mapped as an open maps it. For each way:
//! the open (map and get a typed slice: a cast after an alignment check, or
//! rkyv's validated `access`, or its `access_unchecked`), the bytes on
//! disk, the pages the open leaves resident, and 1,000,000 binary searches
//! by log position. The file is in the page cache (just written), as for an
//! open after a compaction.

use std::time::Instant;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable, rkyv::Archive, rkyv::Serialize)]
struct Row {
    segment: u64,
    offset: u64,
    timestamp: f64,
    trace: u64,
    trace_len: u32,
    session: u32,
}

fn rss_file_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let line = status.lines().find(|l| l.starts_with("RssFile:")).unwrap_or("");
    line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0)
}

fn map(path: &std::path::Path) -> memmap2::Mmap {
    let f = std::fs::File::open(path).expect("open");
    // SAFETY: a file this program wrote and no one changes while mapped.
    unsafe { memmap2::Mmap::map(&f) }.expect("mmap")
}

/// 1,000,000 binary searches over `n` rows for the log position of a random
/// row (`want_of(row number)`), `loc(i)` the position of row `i`; returns
/// the seconds and how many were found.
fn probes(n: usize, want_of: impl Fn(u64) -> (u64, u64), loc: impl Fn(usize) -> (u64, u64)) -> (f64, u64) {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let started = Instant::now();
    let mut found = 0u64;
    for _ in 0..1_000_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let want = want_of(x % (n as u64));
        let (mut lo, mut hi) = (0usize, n);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if loc(mid) < want {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        found += u64::from(lo < n && loc(lo) == want);
    }
    (started.elapsed().as_secs_f64(), found)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let n: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(10_000_000);
    let loc_of = |i: u64| (1 + i / 10_000, (i % 10_000) * 64);
    let rows: Vec<Row> = (0..n as u64)
        .map(|i| Row {
            segment: loc_of(i).0,
            offset: loc_of(i).1,
            timestamp: i as f64,
            trace: i * 20,
            trace_len: 20,
            session: (i / 8) as u32,
        })
        .collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let fixed = dir.path().join("fixed.bin");
    let archived = dir.path().join("rkyv.bin");
    std::fs::write(&fixed, bytemuck::cast_slice::<Row, u8>(&rows)).expect("write");
    let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(&rows).expect("rkyv");
    std::fs::write(&archived, &bytes).expect("write");
    drop(bytes);
    println!("{n} rows of {} bytes", std::mem::size_of::<Row>());
    println!("| layout | bytes on disk | open | resident after open | 1M lookups |");
    println!("|---|---|---|---|---|");

    let before = rss_file_kb();
    let started = Instant::now();
    let m = map(&fixed);
    let table: &[Row] = bytemuck::try_cast_slice(&m[..]).expect("aligned");
    let open = started.elapsed().as_secs_f64();
    let resident = rss_file_kb().saturating_sub(before);
    let (t, found) = probes(table.len(), loc_of, |i| (table[i].segment, table[i].offset));
    let size = std::fs::metadata(&fixed).map(|m| m.len()).unwrap_or(0);
    println!("| fixed, bytemuck cast | {size} | {:.3} ms | {resident} kB | {t:.3} s ({found} found) |", open * 1e3);
    drop(m);

    for checked in [true, false] {
        let before = rss_file_kb();
        let started = Instant::now();
        let m = map(&archived);
        let table = if checked {
            rkyv::access::<rkyv::Archived<Vec<Row>>, rkyv::rancor::Error>(&m[..]).expect("valid")
        } else {
            // SAFETY: the bytes rkyv::to_bytes wrote above, unchanged.
            unsafe { rkyv::access_unchecked::<rkyv::Archived<Vec<Row>>>(&m[..]) }
        };
        let open = started.elapsed().as_secs_f64();
        let resident = rss_file_kb().saturating_sub(before);
        let (t, found) = probes(table.len(), loc_of, |i| (table[i].segment.to_native(), table[i].offset.to_native()));
        let size = std::fs::metadata(&archived).map(|m| m.len()).unwrap_or(0);
        let how = if checked { "rkyv, `access` (validated)" } else { "rkyv, `access_unchecked` (unsafe)" };
        println!("| {how} | {size} | {:.3} ms | {resident} kB | {t:.3} s ({found} found) |", open * 1e3);
    }
}
