//! Random operator mistakes on a compacted store — delete, rename or truncate
//! a file, flip a byte, duplicate a segment, restore an old manifest — and
//! what open must do then: refuse with a clear error and change nothing, or
//! serve every record that is still intact exactly (a damaged one is an
//! error, never a wrong value); never delete a file it did not create.

mod common;

use common::{assert_same, files};
use proptest::prelude::*;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use trajlog::{Call, CompactOptions, ErrorKind, Options, Store, Target};

fn opts() -> Options {
    Options::default().segment_bytes(64 * 1024)
}

struct Base {
    dir: tempfile::TempDir,
    calls: Vec<Call>,
    /// The MANIFEST as it was before the second half was written and compacted.
    old_manifest: Vec<u8>,
}

/// One compacted store (sealed segments, shards, an active segment), built
/// once and copied for every case.
fn base() -> &'static Base {
    static BASE: OnceLock<Base> = OnceLock::new();
    BASE.get_or_init(|| {
        let dir = common::tempdir();
        let all = common::chained_calls(10, 5);
        let store = Store::open(dir.path(), opts()).expect("open");
        for c in &all[..25] {
            store.append(c.clone()).expect("append");
        }
        store.flush().expect("flush");
        let old_manifest = fs::read(dir.path().join("MANIFEST")).expect("manifest");
        for c in &all[25..] {
            store.append(c.clone()).expect("append");
        }
        for s in 0..5 {
            store.seal_session(&format!("s{s}")).expect("seal");
            store.set_reward(Target::Session(format!("s{s}")), s as f64).expect("reward");
        }
        let report = store.compact(&CompactOptions::default()).expect("compact");
        assert_eq!(report.sessions, 5);
        assert!(report.retired_segments > 0, "the base store must have retired segments");
        store.close().expect("close");
        Base { dir, calls: all, old_manifest }
    })
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).expect("mkdir");
    for e in fs::read_dir(from).expect("list") {
        let e = e.expect("entry");
        let (src, dst) = (e.path(), to.join(e.file_name()));
        if src.is_dir() {
            copy_dir(&src, &dst);
        } else {
            fs::copy(&src, &dst).expect("copy");
        }
    }
}

/// The files an operator could touch: MANIFEST, segments, shards.
fn targets(dir: &Path) -> Vec<PathBuf> {
    files(dir).into_keys().collect()
}

#[derive(Debug, Clone)]
enum Action {
    Delete(usize),
    Rename(usize, u32),
    Truncate(usize, f64),
    Flip(usize, f64, u8),
    DuplicateSegment(usize, u32),
    RestoreOldManifest,
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        1 => any::<usize>().prop_map(Action::Delete),
        1 => (any::<usize>(), 0u32..40).prop_map(|(i, n)| Action::Rename(i, n)),
        1 => (any::<usize>(), 0.0f64..1.0).prop_map(|(i, f)| Action::Truncate(i, f)),
        4 => (any::<usize>(), 0.0f64..1.0, 0u8..8).prop_map(|(i, f, b)| Action::Flip(i, f, b)),
        1 => (any::<usize>(), 0u32..40).prop_map(|(i, n)| Action::DuplicateSegment(i, n)),
        1 => Just(Action::RestoreOldManifest),
    ]
}

/// Apply `a`; returns whether it may have destroyed record bytes (so a
/// record may be gone without an error).
fn apply(dir: &Path, a: &Action) -> bool {
    let t = targets(dir);
    let pick = |i: usize| t[i % t.len()].clone();
    match a {
        Action::Delete(i) => {
            fs::remove_file(pick(*i)).expect("delete");
            true
        }
        Action::Rename(i, n) => {
            let from = pick(*i);
            let name = from.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let to = if name.ends_with(".tlog") {
                from.with_file_name(format!("seg-{:010}.tlog", n))
            } else if name.ends_with(".parquet") {
                from.with_file_name(format!("part-{:06}-{:04}.parquet", n, 0))
            } else {
                from.with_file_name(format!("{name}.old"))
            };
            fs::rename(&from, &to).expect("rename");
            true
        }
        Action::Truncate(i, f) => {
            let p = pick(*i);
            let len = fs::metadata(&p).expect("stat").len();
            let file = fs::OpenOptions::new().write(true).open(&p).expect("open");
            file.set_len((len as f64 * f) as u64).expect("truncate");
            true
        }
        Action::Flip(i, f, bit) => {
            let p = pick(*i);
            let mut bytes = fs::read(&p).expect("read");
            if !bytes.is_empty() {
                let at = ((bytes.len() as f64 * f) as usize).min(bytes.len() - 1);
                bytes[at] ^= 1 << bit;
                fs::write(&p, &bytes).expect("write");
            }
            true
        }
        Action::DuplicateSegment(i, n) => {
            let segs: Vec<PathBuf> = t.iter().filter(|p| p.extension().is_some_and(|e| e == "tlog")).cloned().collect();
            if let Some(from) = segs.get(i % segs.len().max(1)) {
                let to = from.with_file_name(format!("seg-{:010}.tlog", n));
                if !to.exists() {
                    fs::copy(from, &to).expect("copy");
                }
            }
            false
        }
        Action::RestoreOldManifest => {
            fs::write(dir.join("MANIFEST"), &base().old_manifest).expect("restore");
            false
        }
    }
}

/// Open (writable or not) and check the promise.
fn check_open(dir: &Path, writable: bool, destructive: bool) -> Result<(), TestCaseError> {
    let before = files(dir);
    let opened = if writable { Store::open(dir, opts()) } else { Store::open_read_only(dir) };
    let store = match opened {
        Err(e) => {
            prop_assert!(!e.message().is_empty());
            prop_assert!(
                matches!(
                    e.kind(),
                    ErrorKind::Corrupt { .. } | ErrorKind::NotFound | ErrorKind::Incompatible | ErrorKind::Io
                ),
                "unexpected kind: {e}"
            );
            let after = files(dir);
            let changed: Vec<&PathBuf> =
                before.keys().chain(after.keys()).filter(|p| before.get(*p) != after.get(*p)).collect();
            prop_assert!(changed.is_empty(), "a refused open changed {:?}: {}", changed, e);
            return Ok(());
        }
        Ok(s) => s,
    };
    // Nothing that existed before was deleted (a record-less file with a torn
    // header may be set aside, bytes intact, in lost+found/).
    for (p, bytes) in &before {
        if !p.exists() {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let aside = dir.join("lost+found").join(&name);
            prop_assert!(fs::read(&aside).ok().as_ref() == Some(bytes), "{} was deleted by the open", p.display());
        }
    }
    let snap = store.snapshot();
    let all = &base().calls;
    let known: std::collections::HashSet<&str> = all.iter().map(|c| c.trace_id.as_str()).collect();
    for info in snap.sessions() {
        for v in snap.session_each(&info.session_id, None, None).into_iter().flatten() {
            prop_assert!(known.contains(v.trace_id()), "a call nobody appended: {}", v.trace_id());
        }
    }
    let mut present = 0;
    for c in all {
        match snap.get(&c.trace_id) {
            Err(e) => prop_assert!(matches!(e.kind(), ErrorKind::Corrupt { .. } | ErrorKind::NotFound), "{e}"),
            Ok(None) => prop_assert!(destructive, "{} vanished without damage", c.trace_id),
            Ok(Some(v)) => match v.to_call() {
                Err(e) => prop_assert!(matches!(e.kind(), ErrorKind::Corrupt { .. } | ErrorKind::NotFound), "{e}"),
                Ok(_) => {
                    assert_same(&v, c);
                    present += 1;
                }
            },
        }
    }
    if !destructive {
        prop_assert_eq!(present, all.len());
    }
    drop(snap);
    if writable {
        // A store that opened takes appends and keeps them.
        let probe = Call { trace_id: "probe".into(), session_id: "probe".into(), ..Default::default() };
        if store.append_durable(probe).is_ok() {
            prop_assert!(store.snapshot().get("probe").map(|v| v.is_some()).unwrap_or(false));
        }
    }
    Ok(())
}

proptest! {
    // More cases: TRAJLOG_OPERATOR_CASES=2000 cargo test --test operator
    #![proptest_config(ProptestConfig {
        cases: std::env::var("TRAJLOG_OPERATOR_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn operator_mistakes_are_refused_or_served_exactly(actions in prop::collection::vec(action(), 1..3)) {
        let work = common::tempdir();
        copy_dir(base().dir.path(), work.path());
        let mut destructive = false;
        for a in &actions {
            destructive |= apply(work.path(), a);
        }
        check_open(work.path(), false, destructive)?;
        check_open(work.path(), true, destructive)?;
    }
}
