//! `trajlog verify`: a full scan of every segment the manifest lists — header,
//! every frame's CRC, every record's decoding, footer against frames, and every
//! prefix-delta parent link. Read-only; safe beside a running writer (whose
//! active tail may then show as torn).

use crate::error::{Error, Result};
use crate::format::manifest::{decode_manifest, SegmentState};
use crate::format::record::{decode_call, Loc, KIND_CALL};
use crate::format::segment::{decode_footer, decode_header, read_trailer};
use crate::segment::recovery::scan_frames;
use std::collections::HashSet;
use std::fs::File;
use std::path::{Path, PathBuf};

/// One thing wrong, with where.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    pub path: PathBuf,
    pub offset: u64,
    pub what: String,
}

/// What `verify_dir` found.
#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    pub segments: usize,
    pub records: u64,
    pub bytes: u64,
    pub problems: Vec<Problem>,
}

/// Verify the store in `dir`.
pub fn verify_dir(dir: &Path) -> Result<VerifyReport> {
    let manifest_path = dir.join("MANIFEST");
    let bytes = std::fs::read(&manifest_path).map_err(|e| Error::io(format!("read {}", manifest_path.display()), e))?;
    let mut report = VerifyReport::default();
    let manifest = match decode_manifest(&bytes) {
        Ok(m) => m,
        Err(e) => {
            report.problems.push(Problem { path: manifest_path, offset: e.offset, what: e.what });
            return Ok(report);
        }
    };
    let mut frames: HashSet<Loc> = HashSet::new();
    let mut parents: Vec<(PathBuf, Loc, Loc)> = Vec::new();
    for ms in &manifest.segments {
        let path = crate::storage::segment_path(dir, ms.id);
        let mut problem =
            |offset: u64, what: String| report.problems.push(Problem { path: path.clone(), offset, what });
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) => {
                problem(0, format!("cannot open: {e}"));
                continue;
            }
        };
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        // Read, not mapped: a live writer may cut its active segment's tail.
        let buf = crate::segment::recovery::read_aligned(&file, len, &path)?;
        let all: &[u8] = bytemuck::cast_slice(&buf);
        let data = all.get(..len as usize).unwrap_or(all);
        report.segments += 1;
        report.bytes += len;
        if let Err(e) = decode_header(data) {
            problem(e.offset, e.what);
            continue;
        }
        let trailer = read_trailer(data);
        let (limit, footer) = match trailer {
            Some(t) => match decode_footer(data, &t) {
                Ok(entries) => (t.footer_offset as usize, Some(entries)),
                Err(e) => {
                    problem(e.offset, e.what);
                    continue;
                }
            },
            None if ms.state == SegmentState::Sealed => {
                problem(len, "sealed segment has no valid footer".into());
                continue;
            }
            None => (data.len(), None),
        };
        let scan = scan_frames(data.get(..limit).unwrap_or(data));
        if let Some(e) = &scan.stopped_by {
            problem(e.offset, e.what.clone());
        }
        if let Some(entries) = footer {
            if scan.stopped_by.is_none() && (scan.valid_end != limit as u64 || entries != scan.entries) {
                problem(limit as u64, "footer index does not match the frames".into());
            }
        }
        report.records += scan.entries.len() as u64;
        for e in &scan.entries {
            let loc = Loc { segment: ms.id, offset: e.frame_offset };
            frames.insert(loc);
            if e.kind == KIND_CALL {
                let body = crate::format::frame::read_frame(data, e.frame_offset);
                if let Ok(crate::format::frame::FrameRead::Frame { body, .. }) = body {
                    if let Ok(rec) = decode_call(body) {
                        if let Some(p) = rec.parent {
                            parents.push((path.clone(), loc, p));
                        }
                    }
                }
            }
        }
    }
    for (path, loc, parent) in parents {
        if parent >= loc || !frames.contains(&parent) {
            report.problems.push(Problem {
                path,
                offset: loc.offset,
                what: format!("prefix-delta parent (segment {}, offset {}) is missing", parent.segment, parent.offset),
            });
        }
    }
    Ok(report)
}
