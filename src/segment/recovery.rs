//! Loading a segment at open: sealed segments are read through their footer;
//! the unsealed tail is scanned frame by frame and stops at the first torn or
//! corrupt frame (format-spec/segment.md §6).

use crate::error::{Error, Result};
use crate::format::frame::{read_frame, FrameRead};
use crate::format::record::{decode_annotation, decode_call, KIND_CALL};
use crate::format::segment::{decode_footer, decode_header, decode_trailer, FooterEntry, HEADER_BYTES, TRAILER_BYTES};
use crate::format::{DecodeError, FORMAT_VERSION};
use crate::record::{Annotation, Target};
use crate::storage::mmap::Mapping;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Index fields of a frame body (what a footer entry would hold).
pub fn entry_of_body(frame_offset: u64, body: &[u8]) -> Result<FooterEntry, DecodeError> {
    let body_len = body.len() as u32;
    if body.first() == Some(&KIND_CALL) {
        let c = decode_call(body)?;
        return Ok(FooterEntry {
            frame_offset,
            body_len,
            kind: KIND_CALL,
            timestamp: c.timestamp,
            id: c.trace_id.to_owned(),
            session_id: c.session_id.to_owned(),
            session_uids: c.session_uids.iter().map(|s| (*s).to_owned()).collect(),
        });
    }
    let ann = decode_annotation(body)?;
    let id = match &ann {
        Annotation::Reward { target: Target::Trace(id) | Target::Session(id), .. } => id.clone(),
        Annotation::Seal { session_id } | Annotation::DeleteSession { session_id } => session_id.clone(),
    };
    Ok(FooterEntry {
        frame_offset,
        body_len,
        kind: body.first().copied().unwrap_or_default(),
        timestamp: 0.0,
        id,
        session_id: String::new(),
        session_uids: Vec::new(),
    })
}

/// Result of scanning frames from the header.
#[derive(Debug)]
pub struct Scan {
    pub entries: Vec<FooterEntry>,
    /// End of the last good frame.
    pub valid_end: u64,
    /// Why the scan stopped before a clean end, if it did.
    pub stopped_by: Option<DecodeError>,
    /// [`scan_frames_past_damage`] only: invalid frames it went past (where
    /// and why), each followed by valid frames.
    pub skipped: Vec<DecodeError>,
}

/// The frame at `at` as a footer entry, or why it is invalid.
fn frame_entry(bytes: &[u8], at: u64) -> Result<Option<(FooterEntry, u64)>, DecodeError> {
    match read_frame(bytes, at) {
        Ok(FrameRead::End) => Ok(None),
        Err(e) => Err(DecodeError { offset: at, what: e.what }),
        Ok(FrameRead::Frame { body, next }) => match entry_of_body(at, body) {
            Ok(entry) => Ok(Some((entry, next))),
            Err(e) => Err(DecodeError { offset: at, what: format!("record does not decode: {}", e.what) }),
        },
    }
}

/// Scan frames of `bytes` starting after the header, up to the first invalid one.
pub fn scan_frames(bytes: &[u8]) -> Scan {
    let mut entries = Vec::new();
    let mut at = HEADER_BYTES;
    loop {
        match frame_entry(bytes, at) {
            Ok(None) => return Scan { entries, valid_end: at, stopped_by: None, skipped: Vec::new() },
            Err(e) => return Scan { entries, valid_end: at, stopped_by: Some(e), skipped: Vec::new() },
            Ok(Some((entry, next))) => {
                entries.push(entry);
                at = next;
            }
        }
    }
}

/// The next 8-aligned offset after `from` where a valid frame (CRC and record
/// decoding) starts, if any. Frames are CRC-checked, so a false match in
/// damaged bytes takes a 1-in-2^32 accident.
pub fn next_valid_frame(bytes: &[u8], from: u64) -> Option<u64> {
    let mut at = (from + 8) & !7;
    while at + 8 <= bytes.len() as u64 {
        if let Ok(Some(_)) = frame_entry(bytes, at) {
            return Some(at);
        }
        at += 8;
    }
    None
}

/// Scan every valid frame of `bytes` (a segment whose footer cannot be used),
/// going past invalid ones: damage stays confined to the frames it touches.
/// `valid_end` is the end of the last valid frame.
pub fn scan_frames_past_damage(bytes: &[u8]) -> Scan {
    let mut entries = Vec::new();
    let mut skipped = Vec::new();
    let mut at = HEADER_BYTES;
    let mut valid_end = HEADER_BYTES;
    loop {
        match frame_entry(bytes, at) {
            Ok(Some((entry, next))) => {
                entries.push(entry);
                at = next;
                valid_end = next;
            }
            invalid => {
                let why = invalid.err();
                match next_valid_frame(bytes, at) {
                    Some(next) => {
                        skipped.push(
                            why.unwrap_or(DecodeError {
                                offset: at,
                                what: "zero bytes where a frame should be".into(),
                            }),
                        );
                        at = next;
                    }
                    None => return Scan { entries, valid_end, stopped_by: why, skipped },
                }
            }
        }
    }
}

/// A segment as found on disk.
#[derive(Debug)]
pub struct LoadedSegment {
    pub id: u64,
    pub path: Arc<PathBuf>,
    pub map: Arc<Mapping>,
    pub entries: Vec<FooterEntry>,
    /// End of the last valid frame.
    pub data_end: u64,
    pub sealed: bool,
    /// For an unsealed segment: why the scan stopped early (a torn tail).
    pub torn: Option<DecodeError>,
    /// For a sealed segment whose footer or trailer was unusable: what was
    /// found wrong (the index was rebuilt from the frames, past damaged ones).
    pub damage: Vec<DecodeError>,
}

/// Read a whole file into an 8-aligned buffer (so token columns in it can be
/// viewed in place while scanning).
pub(crate) fn read_aligned(file: &File, len: u64, path: &Path) -> Result<Vec<u64>> {
    let words =
        usize::try_from(len.div_ceil(8)).map_err(|_| Error::invalid("segment length", "does not fit in memory"))?;
    let mut buf = vec![0u64; words];
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut buf);
    let bytes = bytes.get_mut(..len as usize).ok_or_else(|| Error::invalid("segment length", "overflows"))?;
    file.read_exact_at(bytes, 0).map_err(|e| Error::io(format!("read {}", path.display()), e))?;
    Ok(buf)
}

/// Load segment `id` of `dir`. `must_be_sealed`: the manifest says it is sealed,
/// so a missing footer is corruption, not a torn tail.
///
/// A sealed segment never changes, so it is mapped whole. An unsealed one is
/// read with `pread` and scanned, and only its valid frames are mapped: bytes
/// past them may be cut off later by the writer's recovery, and a mapping must
/// never cover bytes that can vanish (see `storage::mmap`).
pub fn load_segment(dir: &Path, id: u64, must_be_sealed: bool) -> Result<LoadedSegment> {
    let path = crate::storage::segment_path(dir, id);
    let file = File::open(&path).map_err(|e| Error::io(format!("open segment {}", path.display()), e))?;
    let len = file.metadata().map_err(|e| Error::io(format!("stat {}", path.display()), e))?.len();
    let mut head = [0u8; HEADER_BYTES as usize];
    let head = head.get_mut(..len.min(HEADER_BYTES) as usize).unwrap_or_default();
    file.read_exact_at(head, 0).map_err(|e| Error::io(format!("read {}", path.display()), e))?;
    let header = decode_header(head).map_err(|e| Error::corrupt(&path, e.offset, e.what))?;
    if header.segment_id != id {
        return Err(Error::corrupt(
            &path,
            16,
            format!("header says segment {}, file name says {id}", header.segment_id),
        ));
    }
    if header.format_version != FORMAT_VERSION {
        return Err(Error::new(
            crate::error::ErrorKind::Incompatible,
            format!(
                "{} has format version {}, this build reads {FORMAT_VERSION}; use a matching trajlog",
                path.display(),
                header.format_version
            ),
        ));
    }
    let mut tail = [0u8; TRAILER_BYTES as usize];
    let trailer = if len >= HEADER_BYTES + TRAILER_BYTES {
        file.read_exact_at(&mut tail, len - TRAILER_BYTES)
            .map_err(|e| Error::io(format!("read {}", path.display()), e))?;
        decode_trailer(&tail, len)
    } else {
        None
    };
    if let Some(trailer) = trailer {
        let map = Arc::new(Mapping::map(&file, len, &path)?);
        let (entries, damage) = match decode_footer(map.bytes(), &trailer) {
            Ok(entries) => (entries, Vec::new()),
            Err(e) => {
                // The footer is an index of the frames: rebuild it from them
                // (format-spec/segment.md §6).
                let frames = map.bytes().get(..trailer.footer_offset as usize).unwrap_or(map.bytes());
                let scan = scan_frames_past_damage(frames);
                let mut damage = vec![DecodeError {
                    offset: e.offset,
                    what: format!("footer unusable ({}); its index was rebuilt from the frames", e.what),
                }];
                damage.extend(scan.skipped);
                damage.extend(scan.stopped_by.filter(|s| s.offset < trailer.footer_offset));
                (scan.entries, damage)
            }
        };
        let path = Arc::new(path);
        let data_end = trailer.footer_offset;
        return Ok(LoadedSegment { id, path, map, entries, data_end, sealed: true, torn: None, damage });
    }
    if must_be_sealed {
        // The manifest says sealed, but the trailer is damaged: the frames are
        // all there is to go by.
        let map = Arc::new(Mapping::map(&file, len, &path)?);
        let scan = scan_frames_past_damage(map.bytes());
        let mut damage = vec![DecodeError {
            offset: len,
            what: "sealed segment has no valid trailer; its index was rebuilt from the frames".into(),
        }];
        damage.extend(scan.skipped);
        let path = Arc::new(path);
        let data_end = scan.valid_end;
        return Ok(LoadedSegment { id, path, map, entries: scan.entries, data_end, sealed: true, torn: None, damage });
    }
    let buf = read_aligned(&file, len, &path)?;
    let bytes: &[u8] = bytemuck::cast_slice(&buf);
    let bytes = bytes.get(..len as usize).unwrap_or(bytes);
    let scan = scan_frames(bytes);
    if let Some(stop) = &scan.stopped_by {
        // A torn tail has nothing valid after it. Valid frames after an
        // invalid one mean damage in the middle of the log: cutting the log
        // there would drop acknowledged records, so refuse.
        if next_valid_frame(bytes, stop.offset).is_some() {
            let later = scan_frames_past_damage(bytes).entries.iter().filter(|e| e.frame_offset > stop.offset).count();
            return Err(Error::corrupt(
                &path,
                stop.offset,
                format!(
                    "{}; {later} valid records follow it, so this is damage in the middle of the log, not a torn tail. trajlog refuses to cut them off: copy the store aside, and see README \"When files are damaged or missing\"",
                    stop.what
                ),
            ));
        }
    }
    drop(buf);
    let map = Arc::new(Mapping::map(&file, scan.valid_end, &path)?);
    Ok(LoadedSegment {
        id,
        path: Arc::new(path),
        map,
        entries: scan.entries,
        data_end: scan.valid_end,
        sealed: false,
        torn: scan.stopped_by,
        damage: Vec::new(),
    })
}
