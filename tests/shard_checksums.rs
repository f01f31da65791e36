//! Shard checksums (format-spec/shard.md §7, manifest.md §2): a flipped byte
//! anywhere in a `steps` shard is refused with a Corrupt error naming the file,
//! never served as a different value; `verify_shard` finds it.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use trajlog::format::manifest::{decode_manifest, ShardChecksum};
use trajlog::shard::reader::{verify_shard, ShardFile};
use trajlog::shard::schema::{decode_chunk_crcs, steps_schema_of, META_CHUNK_CRC32, META_FORMAT_VERSION};
use trajlog::{Call, CompactOptions, ErrorKind, Options, ShardCompression, Store};

/// A deterministic pseudo-random stream (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Sessions of chained calls with arbitrary logprob bits (NaN payloads, −0.0).
fn calls() -> Vec<Call> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut out = Vec::new();
    for s in 0..5 {
        let mut context: Vec<u32> = (0..40 + s * 7).map(|_| rng.next() as u32).collect();
        for k in 0..5 {
            let completion: Vec<u32> = (0..10 + (rng.next() % 30) as usize).map(|_| rng.next() as u32).collect();
            let logprobs = (k != 2).then(|| completion.iter().map(|_| f32::from_bits(rng.next() as u32)).collect());
            out.push(Call {
                trace_id: format!("t{s}-{k}"),
                session_id: format!("s{s}"),
                timestamp: (s * 100 + k) as f64 + 0.25,
                model: Some("m".into()),
                weight_version: Some(k as i64),
                prompt_token_ids: context.clone(),
                completion_token_ids: completion.clone(),
                logprobs,
                latency_ms: Some(1.5 * k as f64),
                messages: Some(format!(r#"[{{"role":"user","content":"turn {k}"}}]"#).into_bytes()),
                ..Default::default()
            });
            context.extend_from_slice(&completion);
            context.extend((0..3).map(|_| rng.next() as u32));
        }
    }
    out
}

/// A store whose calls are all compacted into one `steps` shard of several
/// row groups; returns its calls and the shard's path.
fn compacted_store(dir: &Path, compression: ShardCompression) -> (Vec<Call>, PathBuf) {
    let calls = calls();
    let store = Store::open(dir, Options::default()).unwrap();
    for c in &calls {
        store.append(c.clone()).unwrap();
    }
    for s in 0..5 {
        store.seal_session(&format!("s{s}")).unwrap();
    }
    let report = store.compact(&CompactOptions::default().compression(compression).steps_row_group_rows(4)).unwrap();
    assert_eq!(report.calls, calls.len() as u64);
    store.close().unwrap();
    let shards = Store::open_read_only(dir).unwrap().snapshot().shard_paths();
    assert_eq!(shards.len(), 1);
    (calls, shards[0].clone())
}

fn manifest_checksum(dir: &Path, shard: &Path) -> Option<ShardChecksum> {
    let m = decode_manifest(&std::fs::read(dir.join("MANIFEST")).unwrap()).unwrap();
    let name = shard.file_name().unwrap().to_str().unwrap();
    m.shards.iter().find(|s| s.path == format!("steps/{name}")).unwrap().checksum
}

/// The recorded column chunk ranges of a shard this build wrote (format 4).
fn chunk_ranges(shard: &Path) -> Vec<(u64, u64)> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let reader = SerializedFileReader::new(std::fs::File::open(shard).unwrap()).unwrap();
    let kv = reader.metadata().file_metadata().key_value_metadata().unwrap();
    let version = kv.iter().find(|k| k.key == META_FORMAT_VERSION).unwrap().value.clone();
    assert_eq!(version.as_deref(), Some("4"));
    let text = kv.iter().find(|k| k.key == META_CHUNK_CRC32).unwrap().value.clone().unwrap();
    let rgs = decode_chunk_crcs(&text).unwrap();
    assert!(rgs.len() >= 5, "several row groups");
    rgs.iter().flatten().map(|c| (c.offset, c.len)).collect()
}

fn assert_names(err: &trajlog::Error, shard: &Path, at: u64) {
    match err.kind() {
        ErrorKind::Corrupt { path, .. } => {
            assert_eq!(path.file_name(), shard.file_name(), "flip at {at}: {err}");
            assert!(err.message().contains(&*shard.file_name().unwrap().to_string_lossy()), "{err}");
        }
        other => panic!("flip at {at}: expected a Corrupt error naming the shard, got {other:?}: {err}"),
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every call reads back exactly, or is refused naming the shard.
fn check_reads(dir: &Path, shard: &Path, calls: &[Call], at: u64) {
    let store = match Store::open_read_only(dir) {
        Ok(s) => s,
        Err(e) => return assert_names(&e, shard, at),
    };
    let snap = store.snapshot();
    for want in calls {
        let view = match snap.get(&want.trace_id) {
            Ok(Some(v)) => v,
            Ok(None) => {
                // Only as damage confined and reported, naming the shard.
                assert!(
                    snap.damage().iter().any(|p| p.path.file_name() == shard.file_name()),
                    "flip at {at}: {} is missing and no damage is reported",
                    want.trace_id
                );
                continue;
            }
            Err(e) => {
                assert_names(&e, shard, at);
                continue;
            }
        };
        let got = match view.to_call() {
            Ok(c) => c,
            Err(e) => {
                assert_names(&e, shard, at);
                continue;
            }
        };
        let id = &want.trace_id;
        assert_eq!(got.trace_id, want.trace_id, "flip at {at}");
        assert_eq!(got.session_id, want.session_id, "flip at {at}: {id}");
        assert_eq!(got.prompt_token_ids, want.prompt_token_ids, "flip at {at}: prompt of {id}");
        assert_eq!(got.completion_token_ids, want.completion_token_ids, "flip at {at}: completion of {id}");
        assert_eq!(
            got.logprobs.as_deref().map(bits),
            want.logprobs.as_deref().map(bits),
            "flip at {at}: logprobs of {id}"
        );
        assert_eq!(got.timestamp.to_bits(), want.timestamp.to_bits(), "flip at {at}: {id}");
        assert_eq!((got.weight_version, &got.model), (want.weight_version, &want.model), "flip at {at}: {id}");
        assert_eq!(got.latency_ms.map(f64::to_bits), want.latency_ms.map(f64::to_bits), "flip at {at}: {id}");
        assert_eq!(got.messages, want.messages, "flip at {at}: {id}");
    }
    // A full scan either visits exact calls or stops at a Corrupt error.
    let by_id: BTreeMap<&str, &Call> = calls.iter().map(|c| (c.trace_id.as_str(), c)).collect();
    let scan = snap.for_each_call(|v| {
        let got = v.to_call()?;
        let want = by_id[got.trace_id.as_str()];
        assert_eq!(got.prompt_token_ids, want.prompt_token_ids, "flip at {at}: scan");
        assert_eq!(got.logprobs.as_deref().map(bits), want.logprobs.as_deref().map(bits), "flip at {at}: scan");
        Ok(())
    });
    if let Err(e) = scan {
        assert_names(&e, shard, at);
    }
}

/// Flip one byte at each of `positions` in turn (restoring it after), and
/// check reads and `verify_shard`.
fn flip_each(dir: &Path, shard: &Path, calls: &[Call], positions: &[u64], chunk_bytes: &[(u64, u64)]) {
    let original = std::fs::read(shard).unwrap();
    let expected = manifest_checksum(dir, shard);
    let in_chunk = |at: u64| chunk_bytes.iter().any(|&(o, l)| (o..o + l).contains(&at));
    for &at in positions {
        let mut bad = original.clone();
        bad[at as usize] ^= 1 << (at % 8);
        std::fs::write(shard, &bad).unwrap();
        check_reads(dir, shard, calls, at);
        let problems = verify_shard(shard, expected);
        assert!(!problems.is_empty(), "verify_shard misses a flip at {at}");
        assert!(problems.iter().all(|p| p.path == shard), "{problems:?}");
        if in_chunk(at) || at < 4 {
            // The chunk checksums live in the file: found without the manifest too.
            assert!(!verify_shard(shard, None).is_empty(), "verify_shard(None) misses a flip at {at}");
        }
    }
    std::fs::write(shard, &original).unwrap();
    assert!(verify_shard(shard, expected).is_empty());
    check_reads(dir, shard, calls, u64::MAX);
}

/// Positions: the first, middle and last byte of every column chunk, the
/// leading magic, every 5th byte of the footer and its last 8 bytes.
fn positions(shard: &Path, chunks: &[(u64, u64)]) -> Vec<u64> {
    let len = std::fs::metadata(shard).unwrap().len();
    let data_end = chunks.iter().map(|&(o, l)| o + l).max().unwrap();
    let mut at: Vec<u64> = vec![0, 3];
    for &(o, l) in chunks {
        at.extend([o, o + l / 2, o + l - 1]);
    }
    at.extend((data_end..len - 8).step_by(5));
    at.extend(len - 8..len);
    at.sort_unstable();
    at.dedup();
    at
}

#[test]
fn intact_shard_verifies_and_covers_every_byte() {
    let dir = tempfile::tempdir().unwrap();
    let (calls, shard) = compacted_store(dir.path(), ShardCompression::Uncompressed);
    let chunks = chunk_ranges(&shard);
    let len = std::fs::metadata(&shard).unwrap().len();
    // The column chunks lie back to back from byte 4 to the footer.
    let mut at = 4;
    for &(o, l) in &chunks {
        assert_eq!(o, at);
        at = o + l;
    }
    let bytes = std::fs::read(&shard).unwrap();
    let footer_len = u32::from_le_bytes(bytes[bytes.len() - 8..bytes.len() - 4].try_into().unwrap()) as u64;
    assert_eq!(at + footer_len + 8, len, "nothing between the column chunks and the footer");
    let checksum = manifest_checksum(dir.path(), &shard).expect("manifest v3 records the checksum");
    assert_eq!(checksum.len, len);
    assert_eq!(checksum.footer_crc32, crc32fast::hash(&bytes[(at as usize)..]));
    assert!(verify_shard(&shard, Some(checksum)).is_empty());
    let traj = shard.parent().unwrap().parent().unwrap().join("trajectories").join(shard.file_name().unwrap());
    assert!(verify_shard(&traj, manifest_checksum_traj(dir.path(), &traj)).is_empty());
    check_reads(dir.path(), &shard, &calls, u64::MAX);
}

fn manifest_checksum_traj(dir: &Path, traj: &Path) -> Option<ShardChecksum> {
    let m = decode_manifest(&std::fs::read(dir.join("MANIFEST")).unwrap()).unwrap();
    let name = traj.file_name().unwrap().to_str().unwrap();
    let entry = m.shards.iter().find(|s| s.path == format!("trajectories/{name}")).unwrap();
    assert!(entry.checksum.is_some());
    entry.checksum
}

#[test]
fn a_flipped_byte_is_never_served_uncompressed() {
    let dir = tempfile::tempdir().unwrap();
    let (calls, shard) = compacted_store(dir.path(), ShardCompression::Uncompressed);
    let chunks = chunk_ranges(&shard);
    let at = positions(&shard, &chunks);
    flip_each(dir.path(), &shard, &calls, &at, &chunks);
}

#[test]
fn a_flipped_byte_is_never_served_zstd() {
    let dir = tempfile::tempdir().unwrap();
    let (calls, shard) = compacted_store(dir.path(), ShardCompression::Zstd(1));
    let chunks = chunk_ranges(&shard);
    let at: Vec<u64> = positions(&shard, &chunks).into_iter().step_by(3).collect();
    flip_each(dir.path(), &shard, &calls, &at, &chunks);
}

#[test]
fn length_and_footer_are_checked_against_the_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let (_, shard) = compacted_store(dir.path(), ShardCompression::default());
    let checksum = manifest_checksum(dir.path(), &shard).unwrap();
    let original = std::fs::read(&shard).unwrap();
    // One byte longer, or shorter.
    let mut longer = original.clone();
    longer.push(0);
    std::fs::write(&shard, &longer).unwrap();
    let err = ShardFile::open(&shard, 0, Some(checksum)).unwrap_err();
    assert_names(&err, &shard, 0);
    assert!(err.message().contains("the manifest says"), "{err}");
    assert!(Store::open_read_only(dir.path()).is_err() || !verify_shard(&shard, Some(checksum)).is_empty());
    std::fs::write(&shard, &original[..original.len() - 1]).unwrap();
    assert_names(&ShardFile::open(&shard, 0, Some(checksum)).unwrap_err(), &shard, 0);
    // A different footer crc in the manifest.
    std::fs::write(&shard, &original).unwrap();
    let wrong = ShardChecksum { footer_crc32: checksum.footer_crc32 ^ 1, ..checksum };
    let err = ShardFile::open(&shard, 0, Some(wrong)).unwrap_err();
    assert!(err.message().contains("fails its crc32"), "{err}");
    assert!(ShardFile::open(&shard, 0, Some(checksum)).is_ok());
    assert!(ShardFile::open(&shard, 0, None).is_ok());
}

#[test]
fn a_store_open_decodes_a_footer_at_its_first_read_and_checks_it_again() {
    let dir = tempfile::tempdir().unwrap();
    let (calls, shard) = compacted_store(dir.path(), ShardCompression::default());
    let checksum = manifest_checksum(dir.path(), &shard);
    assert!(checksum.is_some());
    // Deferred: the length checked now, the footer read, checked against
    // the manifest's crc32 and decoded at the first read.
    let f = ShardFile::open_deferred(&shard, 0, checksum).unwrap();
    assert!(!f.is_decoded());
    assert_eq!(f.rows().unwrap(), calls.len() as u64);
    assert!(f.is_decoded());
    assert!(ShardFile::open(&shard, 0, checksum).unwrap().is_decoded());
    // Without the manifest's checksum there is nothing to check now: decoded now.
    assert!(ShardFile::open_deferred(&shard, 0, None).unwrap().is_decoded());
    // A store's open (through the shard index file) reads no footer; a
    // footer damaged before the open (the open succeeds: it checks lengths)
    // or after it is refused at the first read, naming the file, never
    // decoded into other row groups.
    let original = std::fs::read(&shard).unwrap();
    let footer_len = u32::from_le_bytes(original[original.len() - 8..original.len() - 4].try_into().unwrap()) as usize;
    let at = original.len() - 8 - footer_len / 2;
    let mut damaged = original.clone();
    damaged[at] ^= 0x40;
    std::fs::write(&shard, &damaged).unwrap();
    let before = Store::open_read_only(dir.path()).unwrap();
    let err = before.snapshot().session("s1", None, None).unwrap_err();
    assert_names(&err, &shard, at as u64);
    drop(before);
    std::fs::write(&shard, &original).unwrap();
    let store = Store::open_read_only(dir.path()).unwrap();
    std::fs::write(&shard, &damaged).unwrap();
    let err = store.snapshot().session("s1", None, None).unwrap_err();
    assert_names(&err, &shard, at as u64);
    assert!(err.message().contains("the manifest says"), "{err}");
    // Mended, the same store reads it (nothing of the failure was kept).
    std::fs::write(&shard, &original).unwrap();
    let snap = store.snapshot();
    let got = snap.session("s1", None, None).unwrap();
    let want: Vec<&Call> = calls.iter().filter(|c| c.session_id == "s1").collect();
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.trace_id(), w.trace_id);
        assert_eq!(g.prompt().unwrap(), w.prompt_token_ids);
        assert_eq!(g.completion_token_ids(), w.completion_token_ids.as_slice());
    }
}

#[test]
fn unknown_shard_format_is_incompatible() {
    use parquet::arrow::ArrowWriter;
    use parquet::file::metadata::KeyValue;
    use parquet::file::properties::WriterProperties;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("part-000001-0000.parquet");
    for (version, incompatible) in [(5, true), (0, true), (1, false)] {
        let props = WriterProperties::builder()
            .set_key_value_metadata(Some(vec![KeyValue::new(META_FORMAT_VERSION.into(), version.to_string())]))
            .build();
        let schema = steps_schema_of(version);
        let mut w = ArrowWriter::try_new(std::fs::File::create(&path).unwrap(), schema.clone(), Some(props)).unwrap();
        w.write(&arrow_array::RecordBatch::new_empty(schema)).unwrap();
        w.close().unwrap();
        let result = ShardFile::open(&path, 0, None);
        if incompatible {
            let err = result.unwrap_err();
            assert_eq!(err.kind(), &ErrorKind::Incompatible, "{version}: {err}");
        } else {
            assert!(result.is_ok(), "format 1 files carry no checksums and still open");
        }
    }
    // Formats 2 to 4 without their checksum list are corrupt, not silently unchecked.
    for version in [2, 3, 4] {
        let props = WriterProperties::builder()
            .set_key_value_metadata(Some(vec![KeyValue::new(META_FORMAT_VERSION.into(), version.to_string())]))
            .build();
        let schema = steps_schema_of(version);
        let mut w = ArrowWriter::try_new(std::fs::File::create(&path).unwrap(), schema.clone(), Some(props)).unwrap();
        w.write(&arrow_array::RecordBatch::new_empty(schema)).unwrap();
        w.close().unwrap();
        let err = ShardFile::open(&path, 0, None).unwrap_err();
        assert!(matches!(err.kind(), ErrorKind::Corrupt { .. }), "{err}");
        assert!(err.message().contains(META_CHUNK_CRC32), "{err}");
    }
}
