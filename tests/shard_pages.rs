//! Shard format 4 (format-spec/shard.md §1): every column chunk is written in
//! data pages v2 of at most `SHARD_PAGE_ROWS` rows, so that a read of a few
//! rows (one session's) skips the pages before them undecoded, and what is
//! read from the middle of a row group, across page boundaries, is exact.

mod common;

use common::*;
use parquet::column::page::Page;
use parquet::file::reader::{FileReader, SerializedFileReader};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;
use trajlog::limits::SHARD_PAGE_ROWS;
use trajlog::{Call, CompactOptions, Store};

/// Per shard file of `table`: per row group, per column, the rows of each
/// data page, after checking that every data page is a v2 page.
fn page_rows(dir: &Path, table: &str) -> Vec<Vec<Vec<Vec<u32>>>> {
    let mut files: Vec<_> =
        std::fs::read_dir(dir.join("shards").join(table)).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let reader = SerializedFileReader::new(std::fs::File::open(&f).unwrap()).unwrap();
        let kv = reader.metadata().file_metadata().key_value_metadata().unwrap().clone();
        let version = kv.iter().find(|k| k.key == "trajlog.shard_format_version").unwrap().value.clone();
        assert_eq!(version.as_deref(), Some("4"), "{}", f.display());
        let mut groups = Vec::new();
        for rg in 0..reader.num_row_groups() {
            let group = reader.get_row_group(rg).unwrap();
            let mut columns = Vec::new();
            for col in 0..group.num_columns() {
                let mut pages = Vec::new();
                for page in group.get_column_page_reader(col).unwrap() {
                    match page.unwrap() {
                        Page::DictionaryPage { .. } => {}
                        Page::DataPageV2 { num_rows, .. } => pages.push(num_rows),
                        Page::DataPage { .. } => panic!("{}: a v1 data page in column {col}", f.display()),
                    }
                }
                columns.push(pages);
            }
            groups.push(columns);
        }
        out.push(groups);
    }
    out
}

/// 704 calls, 8 to a session, in one row group per table file: each column
/// chunk of `steps` is at least three pages (more where ~1 MiB closes a page
/// first: the long prompts), none past `SHARD_PAGE_ROWS` rows, and its pages'
/// rows add up to the row group's.
#[test]
fn shards_are_written_in_v2_pages_of_at_most_the_page_rows() {
    let dir = tempdir();
    let calls = chained_calls(88, 8);
    let _store = compact_sealed(dir.path(), &calls, &CompactOptions::default());
    let steps = page_rows(dir.path(), "steps");
    assert_eq!(steps.len(), 1, "one file");
    assert_eq!(steps[0].len(), 1, "one row group");
    for pages in &steps[0][0] {
        assert!(pages.iter().all(|&r| r as usize <= SHARD_PAGE_ROWS), "{pages:?}");
        assert_eq!(pages.iter().sum::<u32>() as usize, calls.len());
        assert!(pages.len() >= calls.len().div_ceil(SHARD_PAGE_ROWS), "{pages:?}");
    }
    for file in page_rows(dir.path(), "trajectories") {
        for group in file {
            for pages in group {
                assert!(!pages.is_empty() && pages.iter().all(|&r| r as usize <= SHARD_PAGE_ROWS));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

    /// Random calls (any logprob bits, prompts of 0 to 200 tokens) in
    /// sessions of 1 to 19 calls, so that sessions start and end inside
    /// pages and straddle page boundaries: every session read from the
    /// shards (its rows only), every point read and a reopened read-only
    /// store give back each call bit for bit.
    #[test]
    fn reads_across_page_boundaries_are_exact(
        calls in prop::collection::vec(any_call("s"), 300..700),
        sizes in prop::collection::vec(1usize..20, 700),
    ) {
        let mut calls = calls;
        let (mut session, mut left) = (0usize, sizes[0]);
        for (i, c) in calls.iter_mut().enumerate() {
            if left == 0 {
                session += 1;
                left = sizes[session];
            }
            left -= 1;
            c.trace_id = format!("t{i}");
            c.session_id = format!("s{session}");
            c.session_uids.clear();
        }
        let dir = tempdir();
        let store = compact_sealed(dir.path(), &calls, &CompactOptions::default());
        let by_session: BTreeMap<&str, Vec<&Call>> = calls.iter().fold(BTreeMap::new(), |mut m, c| {
            m.entry(c.session_id.as_str()).or_default().push(c);
            m
        });
        let reopened = Store::open_read_only(dir.path()).unwrap();
        for snap in [store.snapshot(), reopened.snapshot()] {
            for (s, want) in &by_session {
                let got = snap.session(s, None, None).unwrap();
                prop_assert_eq!(got.len(), want.len(), "session {}", s);
                let by_id: BTreeMap<&str, &Call> = want.iter().map(|c| (c.trace_id.as_str(), *c)).collect();
                for v in &got {
                    prop_assert!(v.is_compacted());
                    assert_same(v, by_id[v.trace_id()]);
                }
            }
            for c in &calls {
                assert_same(&snap.get(&c.trace_id).unwrap().expect("present"), c);
            }
        }
        let pages = page_rows(dir.path(), "steps");
        prop_assert!(pages.iter().flatten().flatten().any(|p| p.len() > 1), "several pages in a chunk");
    }
}
