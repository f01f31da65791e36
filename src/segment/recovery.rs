//! Loading a segment at open: sealed segments are read through their footer;
//! the unsealed tail is scanned frame by frame (format-spec/segment.md §6).
//!
//! What is found is told apart and reported as [`SegmentEvent`]s: a torn tail
//! (bytes after the last valid frame of the active segment that hold no valid
//! frame: an interrupted write), damage (an invalid region followed by valid
//! frames), a footer rebuilt from the frames, and regions an earlier
//! skip-corrupted open left out of a footer. Damage refuses the load unless
//! the caller asks to skip it; nothing here writes to a file.

use crate::error::{Error, Result};
use crate::format::frame::{frame_bytes, read_frame, FrameRead};
use crate::format::record::{
    decode_annotation, decode_call, KIND_CALL, KIND_DELETE_SESSION, KIND_MOVE_SESSION, KIND_REWARD, KIND_SEAL,
};
use crate::format::segment::{
    check_footer, decode_footer, decode_header, decode_trailer, FooterEntry, FooterEntryRef, FOOTER_MAGIC, HEADER_BYTES,
    TRAILER_BYTES,
};
use crate::format::{DecodeError, FORMAT_VERSION, FORMAT_VERSION_MIN};
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
            reward_target: 0,
            timestamp: c.timestamp,
            id: c.trace_id.to_owned(),
            session_id: c.session_id.to_owned(),
            session_uids: c.session_uids.iter().map(|s| (*s).to_owned()).collect(),
        });
    }
    let ann = decode_annotation(body)?;
    let (id, reward_target, timestamp) = match ann {
        Annotation::Reward { target: Target::Trace(id), value } => (id, 1, value),
        Annotation::Reward { target: Target::Session(id), value } => (id, 2, value),
        Annotation::Seal { session_id }
        | Annotation::DeleteSession { session_id }
        | Annotation::MoveSession { session_id } => (session_id, 0, 0.0),
    };
    Ok(FooterEntry {
        frame_offset,
        body_len,
        kind: body.first().copied().unwrap_or_default(),
        reward_target,
        timestamp,
        id,
        session_id: String::new(),
        session_uids: Vec::new(),
    })
}

/// The annotation a footer entry stands for, when the entry holds all of it:
/// a seal or a deletion (only a target), or a reward whose target and value
/// the footer carries (since segment format 4, format-spec/segment.md §4).
/// `None` for calls and for rewards of older footers (read their record).
pub fn annotation_of_entry(e: &FooterEntry) -> Option<Annotation> {
    annotation_of_entry_ref(&e.as_ref())
}

/// [`annotation_of_entry`] of an entry read in place.
pub fn annotation_of_entry_ref(e: &FooterEntryRef<'_>) -> Option<Annotation> {
    let id = || e.id.to_owned();
    match (e.kind, e.reward_target) {
        (KIND_SEAL, _) => Some(Annotation::Seal { session_id: id() }),
        (KIND_DELETE_SESSION, _) => Some(Annotation::DeleteSession { session_id: id() }),
        (KIND_MOVE_SESSION, _) => Some(Annotation::MoveSession { session_id: id() }),
        (KIND_REWARD, 1) => Some(Annotation::Reward { target: Target::Trace(id()), value: e.timestamp }),
        (KIND_REWARD, 2) => Some(Annotation::Reward { target: Target::Session(id()), value: e.timestamp }),
        _ => None,
    }
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
    next_valid_frame_below(bytes, from, bytes.len() as u64)
}

/// [`next_valid_frame`] for frames that start below `limit`: a frame starts
/// with a non-zero length word, so none starts at or past [`data_extent`]
/// (which spares a search through a preallocated, zero-filled tail).
fn next_valid_frame_below(bytes: &[u8], from: u64, limit: u64) -> Option<u64> {
    let mut at = (from + 8) & !7;
    while at < limit && at + 8 <= bytes.len() as u64 {
        if let Ok(Some(_)) = frame_entry(bytes, at) {
            return Some(at);
        }
        at += 8;
    }
    None
}

/// The end of the last non-zero byte of `bytes` (0 if all are zero). The
/// active segment is preallocated with zeros, so no data lies past it.
pub fn data_extent(bytes: &[u8]) -> u64 {
    let mut end = bytes.len();
    while let Some(block) = end.checked_sub(64).and_then(|from| bytes.get(from..end)) {
        if block.iter().any(|&b| b != 0) {
            break;
        }
        end -= 64;
    }
    bytes.get(..end).and_then(|b| b.iter().rposition(|&x| x != 0)).map_or(0, |i| i as u64 + 1)
}

/// Scan every valid frame of `bytes` (a segment whose footer cannot be used),
/// going past invalid ones: damage stays confined to the frames it touches.
/// `valid_end` is the end of the last valid frame.
pub fn scan_frames_past_damage(bytes: &[u8]) -> Scan {
    let mut entries = Vec::new();
    let mut skipped = Vec::new();
    let mut at = HEADER_BYTES;
    let mut valid_end = HEADER_BYTES;
    let limit = data_extent(bytes);
    loop {
        match frame_entry(bytes, at) {
            Ok(Some((entry, next))) => {
                entries.push(entry);
                at = next;
                valid_end = next;
            }
            invalid => {
                let why = invalid.err();
                match next_valid_frame_below(bytes, at, limit) {
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

/// What recovery found in a segment, and did or will do about it
/// (format-spec/segment.md §6; reported by `Store::recovery_report`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RecoveryEventKind {
    /// Non-zero bytes after the last valid frame of the active segment that
    /// hold no valid frame: an interrupted write. A writable open cuts them
    /// off (read-only opens leave them out of their view and do not report
    /// them: beside a live writer they may be a write in progress).
    TornTailCut,
    /// An invalid region followed by valid frames (or, in a sealed segment,
    /// a frame whose CRC fails), left out of the index by a
    /// `RecoveryMode::SkipCorrupted` open. Its bytes stay in the file.
    CorruptedRecordSkipped,
    /// A region between two entries of a sealed segment's footer: an earlier
    /// skip-corrupted open left it out of the index. Its bytes are still in
    /// the file; nothing was done now.
    SkippedEarlier,
    /// A sealed segment's footer or trailer was unusable: its index was
    /// rebuilt from the frames (nothing written).
    FooterRebuilt,
}

/// One thing recovery found in a segment.
#[derive(Debug, Clone, PartialEq)]
pub struct SegmentEvent {
    pub kind: RecoveryEventKind,
    /// Where in the file (for a rebuilt footer: where the footer starts).
    pub offset: u64,
    /// Bytes concerned: cut off (torn tail: up to the last non-zero byte),
    /// skipped (up to the next valid frame), or the footer and trailer.
    pub len: u64,
    /// Why, in words.
    pub what: String,
}

impl SegmentEvent {
    /// The event as a store's recovery report (and `trajlog repair`) says it.
    pub fn report(&self, segment: u64, path: &Path) -> crate::RecoveryEvent {
        crate::RecoveryEvent {
            kind: self.kind,
            segment,
            path: path.to_path_buf(),
            offset: self.offset,
            len: self.len,
            what: self.what.clone(),
        }
    }
}

/// A segment as found on disk.
#[derive(Debug)]
pub struct LoadedSegment {
    pub id: u64,
    pub path: Arc<PathBuf>,
    pub map: Arc<Mapping>,
    /// Index entries of the valid frames (skipped ones left out); empty
    /// when they are left in the footer ([`LoadedSegment::in_footer`]).
    pub entries: Vec<FooterEntry>,
    /// A sealed segment loaded with [`load_segment_in_place`] whose footer
    /// passed its checks: where its entries lie in `map`, and how many.
    /// [`LoadedSegment::entry_refs`] reads them.
    pub in_footer: Option<(std::ops::Range<usize>, u32)>,
    /// End of the last valid frame.
    pub data_end: u64,
    pub sealed: bool,
    /// What recovery found, in file order (a rebuilt footer first).
    pub events: Vec<SegmentEvent>,
    /// Annotations whose record is damaged, kept in the index and applied
    /// from their footer entry (what is wrong with each, by offset). Only a
    /// skip-corrupted load of a sealed segment checks those frames.
    pub applied_from_footer: Vec<(u64, String)>,
}

impl LoadedSegment {
    /// Its entries, in frame order: those of `entries`, or read in place
    /// from the footer.
    pub fn entry_refs(&self) -> Box<dyn Iterator<Item = FooterEntryRef<'_>> + '_> {
        match &self.in_footer {
            Some((range, count)) => {
                Box::new(crate::format::segment::CheckedFooter::checked_before(self.map.bytes(), range.clone(), *count).iter())
            }
            None => Box::new(self.entries.iter().map(FooterEntry::as_ref)),
        }
    }

    /// Did this load skip damaged regions of an unsealed segment? Its index
    /// then has gaps, which only a sealed segment's footer can record: the
    /// writer seals it before appending (format-spec/segment.md §6).
    pub fn skipped_damage(&self) -> bool {
        !self.sealed && self.events.iter().any(|e| e.kind == RecoveryEventKind::CorruptedRecordSkipped)
    }
}

/// What to do about damage (an invalid region with valid frames after it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnDamage {
    /// Refuse the load: an error naming the segment, the offset and how many
    /// valid frames follow. Sealed segments are read through their footer
    /// without reading their frames.
    Refuse,
    /// Leave damaged regions out of the index and report them; also check
    /// every frame of sealed segments against their footer.
    Skip,
}

/// The refusal of damage in the middle of the log: `later` valid frames
/// follow the invalid one at `offset` in segment `id`.
pub fn damage_error(path: &Path, id: u64, offset: u64, what: &str, later: usize, sealed: bool) -> Error {
    let why = if later > 0 {
        format!("{later} valid records follow it in segment {id}, so this is damage in the middle of the log, not a torn tail")
    } else {
        format!(
            "segment {id} is sealed (its frames were complete when it was sealed), so this is damage, not a torn tail"
        )
    };
    let sealed_note = if sealed { " (a sealed segment is never written to)" } else { "" };
    Error::corrupt(
        path,
        offset,
        format!(
            "{what}; {why}. Nothing was changed. trajlog refuses to drop records silently: copy the store aside, then open it with recovery mode skip-corrupted (RecoveryMode::SkipCorrupted, `--recovery skip-corrupted`) to leave the damaged bytes out of the index{sealed_note} and keep every valid record; see README \"When files are damaged or missing\""
        ),
    )
}

/// The damaged regions `scan` went past, each up to the next valid frame.
fn skipped_regions(scan: &Scan) -> Vec<SegmentEvent> {
    scan.skipped
        .iter()
        .map(|d| {
            let next = scan.entries.iter().map(|e| e.frame_offset).find(|&o| o > d.offset).unwrap_or(d.offset);
            SegmentEvent {
                kind: RecoveryEventKind::CorruptedRecordSkipped,
                offset: d.offset,
                len: next - d.offset,
                what: d.what.clone(),
            }
        })
        .collect()
}

/// The frames of an active segment (format-spec/segment.md §6.4).
#[derive(Debug)]
pub struct ActiveScan {
    /// Every valid frame, past damaged regions.
    pub entries: Vec<FooterEntry>,
    /// End of the last valid frame.
    pub valid_end: u64,
    /// Invalid regions followed by valid frames: damage, not a torn tail.
    pub damaged: Vec<SegmentEvent>,
    /// Non-zero bytes after the last valid frame holding no valid frame.
    pub torn: Option<SegmentEvent>,
}

/// Scan an active segment: up to the end of its data, telling a torn tail
/// from damage. A zero length word ends the data only if nothing valid
/// follows it: a zeroed region with valid frames after it is damage too.
pub fn scan_active(bytes: &[u8]) -> ActiveScan {
    let extent = data_extent(bytes);
    let first = scan_frames(bytes);
    let damaged_inside = first.valid_end < extent && next_valid_frame_below(bytes, first.valid_end, extent).is_some();
    let scan = if damaged_inside { scan_frames_past_damage(bytes) } else { first };
    let torn = (extent > scan.valid_end).then(|| SegmentEvent {
        kind: RecoveryEventKind::TornTailCut,
        offset: scan.valid_end,
        len: extent - scan.valid_end,
        what: scan.stopped_by.as_ref().map_or_else(
            || "non-zero bytes after the end-of-data marker, and no valid frame among them".to_owned(),
            |e| e.what.clone(),
        ),
    });
    ActiveScan { damaged: skipped_regions(&scan), valid_end: scan.valid_end, entries: scan.entries, torn }
}

/// Regions between the entries of a decoded footer (which are in frame
/// order): damage a skip-corrupted open left out of the index. `(offset, len)`.
pub fn footer_gaps(entries: &[FooterEntry]) -> Vec<(u64, u64)> {
    let mut gaps = Vec::new();
    let mut end = HEADER_BYTES;
    for e in entries {
        if e.frame_offset > end {
            gaps.push((end, e.frame_offset - end));
        }
        end = e.frame_offset.saturating_add(frame_bytes(u64::from(e.body_len)));
    }
    gaps
}

/// Events for the regions an earlier skip-corrupted open left out of a
/// footer (`gaps`, from [`footer_gaps`]).
fn skipped_earlier(gaps: Vec<(u64, u64)>) -> impl Iterator<Item = SegmentEvent> {
    gaps.into_iter().map(|(offset, len)| SegmentEvent {
        kind: RecoveryEventKind::SkippedEarlier,
        offset,
        len,
        what: "left out of the footer by an earlier skip-corrupted open; the bytes are still in the file".into(),
    })
}

/// What [`check_footer_frames`] keeps, skips and applies from entries.
type CheckedFooter = (Vec<FooterEntry>, Vec<SegmentEvent>, Vec<(u64, String)>);

/// Check every frame a valid footer indexes (`OnDamage::Skip`). Returns the
/// entries of valid frames — and of damaged annotations whose entry holds
/// all of them (seals, deletions, rewards since segment format 4), which are
/// applied from their entry (format-spec/segment.md §6.5) and listed as
/// such — and the damaged ones left out; `None` if a valid frame disagrees
/// with its entry (then the footer is not trusted and is rebuilt from the
/// frames).
fn check_footer_frames(frames: &[u8], entries: Vec<FooterEntry>) -> Option<CheckedFooter> {
    let mut kept = Vec::with_capacity(entries.len());
    let mut skipped = Vec::new();
    let mut applied = Vec::new();
    for e in entries {
        match frame_entry(frames, e.frame_offset) {
            Ok(Some((found, _))) if footer_entry_matches(&e, &found) => kept.push(e),
            Ok(Some(_)) => return None,
            invalid => {
                let what = invalid.err().map_or_else(|| "no frame where the footer points".to_owned(), |d| d.what);
                if annotation_of_entry(&e).is_some() {
                    applied.push((e.frame_offset, what));
                    kept.push(e);
                    continue;
                }
                let record =
                    if e.kind == KIND_CALL { format!("call {:?}", e.id) } else { format!("reward on {:?}", e.id) };
                skipped.push(SegmentEvent {
                    kind: RecoveryEventKind::CorruptedRecordSkipped,
                    offset: e.frame_offset,
                    len: frame_bytes(u64::from(e.body_len)),
                    what: format!("{what} ({record}, by the footer)"),
                });
            }
        }
    }
    Some((kept, skipped, applied))
}

/// Whether a footer's entry is the one of its frame (`scanned`). A reward
/// entry written before segment format 4 holds neither target nor value
/// (segment.md §4): it matches the frame's entry without them.
pub fn footer_entry_matches(footer: &FooterEntry, scanned: &FooterEntry) -> bool {
    footer == scanned
        || (footer.kind == KIND_REWARD
            && footer.reward_target == 0
            && footer.timestamp == 0.0
            && *footer == FooterEntry { reward_target: 0, timestamp: 0.0, ..scanned.clone() })
}

/// Rebuild a sealed segment's index from `frames` (its footer or trailer is
/// unusable: `why`). With `tail_is_frames`, the bytes end exactly where the
/// frames end, so an invalid frame at the end is damage too. Without (no
/// valid trailer: `frames` is the whole file), the footer's bytes follow the
/// frames and end the scan, so the scan must end at the footer's magic: the
/// bytes from the end of the last valid frame up to the first footer magic
/// after it are frames lost to damage, and with no footer magic at all the
/// end of the frames cannot be told, which is damage too (never a silent
/// loss of the last frames). Also returns where the footer starts (the
/// end of the bytes when none was found).
fn rebuild_index(
    path: &Path,
    id: u64,
    frames: &[u8],
    tail_is_frames: bool,
    on_damage: OnDamage,
) -> Result<(Vec<FooterEntry>, Vec<SegmentEvent>, u64, u64)> {
    let scan = scan_frames_past_damage(frames);
    let mut damaged = skipped_regions(&scan);
    let end = frames.len() as u64;
    let mut footer_at = end;
    if tail_is_frames {
        if let Some(d) = scan.stopped_by.as_ref().filter(|d| d.offset < end) {
            damaged.push(SegmentEvent {
                kind: RecoveryEventKind::CorruptedRecordSkipped,
                offset: d.offset,
                len: end - d.offset,
                what: d.what.clone(),
            });
        }
    } else {
        let last = scan.valid_end;
        let found = footer_start(frames, last);
        footer_at = found.unwrap_or(last);
        // Without a footer magic, where the frames end cannot be told: all
        // that follows the last valid frame may be lost frames.
        if found.is_none_or(|at| at > last) {
            let what = match found {
                Some(at) => {
                    let why = scan.stopped_by.as_ref().map_or("zero bytes where a frame should be", |d| &d.what);
                    format!("{why}: the bytes up to the footer at offset {at} are damaged frames")
                }
                None => "no footer follows the last valid frame (the trailer and the footer's first bytes are \
                         damaged): the frames' end cannot be told, so frames after it may be lost"
                    .to_owned(),
            };
            let len = found.unwrap_or(end) - last;
            damaged.push(SegmentEvent { kind: RecoveryEventKind::CorruptedRecordSkipped, offset: last, len, what });
        }
    }
    if let (Some(first), OnDamage::Refuse) = (damaged.first(), on_damage) {
        let later = scan.entries.iter().filter(|e| e.frame_offset > first.offset).count();
        let what =
            format!("{} (found while rebuilding the index of a sealed segment whose footer is unusable)", first.what);
        return Err(damage_error(path, id, first.offset, &what, later, true));
    }
    Ok((scan.entries, damaged, scan.valid_end, footer_at))
}

/// The first 8-aligned offset at or after `from` where a footer body starts
/// (its magic, then a reserved zero word, format-spec/segment.md §4).
pub(crate) fn footer_start(bytes: &[u8], from: u64) -> Option<u64> {
    let from = usize::try_from(from.next_multiple_of(8)).ok()?;
    (from..bytes.len().saturating_sub(16)).step_by(8).map(|at| at as u64).find(|&at| {
        let at = at as usize;
        bytes.get(at..at + 8) == Some(&FOOTER_MAGIC[..]) && bytes.get(at + 12..at + 16) == Some(&[0u8; 4][..])
    })
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
/// so a missing footer is corruption, not a torn tail. `on_damage`: what to do
/// about an invalid region followed by valid frames (format-spec/segment.md §6).
///
/// A sealed segment never changes, so it is mapped whole. An unsealed one is
/// read with `pread` and scanned, and only up to its last valid frame is
/// mapped: bytes past it may be cut off later by the writer's recovery, and a
/// mapping must never cover bytes that can vanish (see `storage::mmap`).
/// Damaged regions before that point are never cut (a skip-corrupted writer
/// seals the segment with them in place).
pub fn load_segment(dir: &Path, id: u64, must_be_sealed: bool, on_damage: OnDamage) -> Result<LoadedSegment> {
    load_segment_with(dir, id, must_be_sealed, on_damage, false)
}

/// [`load_segment`], but a sealed segment whose footer passes every check
/// keeps its entries in the footer ([`LoadedSegment::in_footer`]) instead
/// of decoding them into `entries`: an open replays them in place, with no
/// allocation per entry (a large store's open replays millions of carried
/// seals and rewards). Only with [`OnDamage::Refuse`]; anything else loads
/// as [`load_segment`] does.
pub fn load_segment_in_place(dir: &Path, id: u64, must_be_sealed: bool, on_damage: OnDamage) -> Result<LoadedSegment> {
    load_segment_with(dir, id, must_be_sealed, on_damage, on_damage == OnDamage::Refuse)
}

/// Segment `id`'s trailer as its file in `dir` ends now (its last
/// `TRAILER_BYTES`, read without mapping it): what a cache of the
/// segment's footer is keyed to. `None` when it cannot be read or does
/// not decode.
pub fn trailer_on_disk(dir: &Path, id: u64) -> Option<crate::format::segment::Trailer> {
    let f = File::open(crate::storage::segment_path(dir, id)).ok()?;
    let len = f.metadata().ok()?.len();
    let mut tail = [0u8; crate::format::segment::TRAILER_BYTES as usize];
    let at = len.checked_sub(tail.len() as u64)?;
    f.read_exact_at(&mut tail, at).ok()?;
    crate::format::segment::decode_trailer(&tail, len)
}

/// A sealed segment mapped without reading its footer, for an open that
/// has what the footer says elsewhere (the annotation cache, which checked
/// the trailer): no entries; `footer_offset` is where its frames end.
pub fn map_sealed_unread(dir: &Path, id: u64, footer_offset: u64) -> Result<LoadedSegment> {
    let path = crate::storage::segment_path(dir, id);
    let file = File::open(&path).map_err(|e| Error::io(format!("open segment {}", path.display()), e))?;
    let len = file.metadata().map_err(|e| Error::io(format!("stat {}", path.display()), e))?.len();
    let map = Arc::new(Mapping::map(&file, len, &path)?);
    Ok(LoadedSegment {
        id,
        path: Arc::new(path),
        map,
        entries: Vec::new(),
        in_footer: None,
        data_end: footer_offset.min(len),
        sealed: true,
        events: Vec::new(),
        applied_from_footer: Vec::new(),
    })
}

fn load_segment_with(
    dir: &Path,
    id: u64,
    must_be_sealed: bool,
    on_damage: OnDamage,
    in_place: bool,
) -> Result<LoadedSegment> {
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
    if !(FORMAT_VERSION_MIN..=FORMAT_VERSION).contains(&header.format_version) {
        return Err(Error::new(
            crate::error::ErrorKind::Incompatible,
            format!(
                "{} has format version {}, this build reads {FORMAT_VERSION_MIN} to {FORMAT_VERSION}; use a matching trajlog",
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
        let footer_offset = trailer.footer_offset;
        let frames = map.bytes().get(..footer_offset as usize).unwrap_or(map.bytes());
        let rebuilt = |what: String| SegmentEvent {
            kind: RecoveryEventKind::FooterRebuilt,
            offset: footer_offset,
            len: len - footer_offset,
            what,
        };
        if in_place {
            let old_format = header.format_version < crate::format::FORMAT_REWARDS_IN_FOOTER;
            match check_footer(map.bytes(), &trailer) {
                // A footer with reward targets its format has not: decoded
                // below, which says so and rebuilds it.
                Ok(f) if !(old_format && f.has_reward_targets) => {
                    let events = skipped_earlier(f.gaps.clone()).collect();
                    let in_footer = Some((f.range(), f.entry_count()));
                    return Ok(LoadedSegment {
                        id,
                        path: Arc::new(path),
                        map: map.clone(),
                        entries: Vec::new(),
                        in_footer,
                        data_end: footer_offset,
                        sealed: true,
                        events,
                        applied_from_footer: Vec::new(),
                    });
                }
                _ => {}
            }
        }
        let footer = decode_footer(map.bytes(), &trailer).map_err(|e| (e.offset, e.what)).and_then(|entries| {
            // Rewards' targets and values are in footers since segment format 4.
            match entries.iter().find(|e| e.reward_target != 0) {
                Some(e) if header.format_version < crate::format::FORMAT_REWARDS_IN_FOOTER => Err((
                    footer_offset,
                    format!(
                        "the entry of the reward at offset {} has a target, which segment format {} footers have not",
                        e.frame_offset, header.format_version
                    ),
                )),
                _ => Ok(entries),
            }
        });
        // Regions an earlier skip left out, as the footer records them.
        let gaps = footer.as_deref().map(footer_gaps).unwrap_or_default();
        let checked = match (footer, on_damage) {
            (Ok(entries), OnDamage::Refuse) => Ok((entries, Vec::new(), Vec::new())),
            (Ok(entries), OnDamage::Skip) => check_footer_frames(frames, entries)
                .ok_or((footer_offset, "the footer disagrees with a valid frame".to_owned())),
            (Err(e), _) => Err(e),
        };
        let (entries, events, applied_from_footer) = match checked {
            Ok((entries, skipped, applied)) => {
                let mut events: Vec<SegmentEvent> = skipped_earlier(gaps).chain(skipped).collect();
                events.sort_by_key(|e| e.offset);
                (entries, events, applied)
            }
            Err((at, what)) => {
                // The footer is an index of the frames: rebuild it from them
                // (format-spec/segment.md §6).
                let (entries, damaged, _, _) = rebuild_index(&path, id, frames, true, on_damage)?;
                let what = format!("footer unusable at offset {at} ({what}); its index was rebuilt from the frames");
                (entries, std::iter::once(rebuilt(what)).chain(damaged).collect(), Vec::new())
            }
        };
        let path = Arc::new(path);
        let data_end = footer_offset;
        return Ok(LoadedSegment { id, path, map, entries, in_footer: None, data_end, sealed: true, events, applied_from_footer });
    }
    if must_be_sealed {
        // The manifest says sealed, but the trailer is damaged: the frames are
        // all there is to go by.
        let map = Arc::new(Mapping::map(&file, len, &path)?);
        let (entries, damaged, data_end, footer_at) = rebuild_index(&path, id, map.bytes(), false, on_damage)?;
        let what = "sealed segment has no valid trailer; its index was rebuilt from the frames".to_owned();
        let start = SegmentEvent { kind: RecoveryEventKind::FooterRebuilt, offset: footer_at, len: len - footer_at, what };
        let events = std::iter::once(start).chain(damaged).collect();
        let path = Arc::new(path);
        return Ok(LoadedSegment {
            id,
            path,
            map,
            entries,
            in_footer: None,
            data_end,
            sealed: true,
            events,
            applied_from_footer: Vec::new(),
        });
    }
    // Only the written part is read: past the end of the file's last data
    // region (a preallocated active segment is a sparse file) every byte
    // reads as zero, which a scan would take as the end of data anyway.
    // If the scan found a torn tail or damage there, the whole file is read
    // again and scanned: a file system may report zero blocks that were
    // written as holes (ZFS with compression), so a frame ending in zeros
    // could look cut off at that point.
    let written = crate::storage::written_len(&file, len);
    let mut buf = read_aligned(&file, written, &path)?;
    let mut scan = scan_active(bytemuck::cast_slice::<u64, u8>(&buf).get(..written as usize).unwrap_or_default());
    if written < len && (scan.torn.is_some() || !scan.damaged.is_empty()) {
        buf = read_aligned(&file, len, &path)?;
        scan = scan_active(bytemuck::cast_slice::<u64, u8>(&buf).get(..len as usize).unwrap_or_default());
    }
    if let (Some(first), OnDamage::Refuse) = (scan.damaged.first(), on_damage) {
        // A torn tail has nothing valid after it. Valid frames after an
        // invalid one mean damage in the middle of the log: cutting the log
        // there would drop acknowledged records, so refuse.
        let later = scan.entries.iter().filter(|e| e.frame_offset > first.offset).count();
        return Err(damage_error(&path, id, first.offset, &first.what, later, false));
    }
    drop(buf);
    let map = Arc::new(Mapping::map(&file, scan.valid_end, &path)?);
    let events = scan.damaged.into_iter().chain(scan.torn).collect();
    Ok(LoadedSegment {
        id,
        path: Arc::new(path),
        map,
        entries: scan.entries,
        in_footer: None,
        data_end: scan.valid_end,
        applied_from_footer: Vec::new(),
        sealed: false,
        events,
    })
}
