//! Segment header and footer (format-spec/segment.md §1, §4, §5).
//!
//! ```text
//! header (64 bytes)  frames ...  footer body  trailer (32 bytes)
//! ```
//! The footer carries the segment's index: one entry per frame with the fields
//! the in-memory indexes need, so opening a store reads footers, not records.

use super::{align8, Cursor, DecodeError, PutLe, FORMAT_VERSION};

pub const SEGMENT_MAGIC: [u8; 8] = *b"TRJLSEG\0";
pub const FOOTER_MAGIC: [u8; 8] = *b"TRJLFTR\0";
pub const TRAILER_MAGIC: [u8; 8] = *b"TRJLEND\0";
pub const HEADER_BYTES: u64 = 64;
pub const TRAILER_BYTES: u64 = 32;

/// The fixed segment header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    pub format_version: u32,
    pub segment_id: u64,
    pub created_unix_ms: u64,
}

pub fn encode_header(h: &SegmentHeader) -> [u8; HEADER_BYTES as usize] {
    let mut out = Vec::with_capacity(HEADER_BYTES as usize);
    out.extend_from_slice(&SEGMENT_MAGIC);
    out.put_u32(h.format_version);
    out.put_u32(HEADER_BYTES as u32);
    out.put_u64(h.segment_id);
    out.put_u64(h.created_unix_ms);
    out.resize(60, 0);
    let crc = crc32fast::hash(&out);
    out.put_u32(crc);
    let mut arr = [0u8; HEADER_BYTES as usize];
    arr.copy_from_slice(&out);
    arr
}

pub fn decode_header(buf: &[u8]) -> Result<SegmentHeader, DecodeError> {
    let mut c = Cursor::new(buf);
    let magic = c.bytes(8, "segment magic")?;
    if magic != SEGMENT_MAGIC {
        return Err(DecodeError::new(0, "not a trajlog segment (bad magic)"));
    }
    let format_version = c.u32("format version")?;
    let header_len = c.u32("header length")?;
    let segment_id = c.u64("segment id")?;
    let created_unix_ms = c.u64("created time")?;
    let _reserved = c.bytes(28, "reserved")?;
    let crc = c.u32("header crc")?;
    let head = buf.get(..60).ok_or_else(|| DecodeError::new(0, "short header"))?;
    if crc32fast::hash(head) != crc {
        return Err(DecodeError::new(60, "segment header crc mismatch"));
    }
    if u64::from(header_len) != HEADER_BYTES {
        return Err(DecodeError::new(12, format!("header length {header_len}, expected {HEADER_BYTES}")));
    }
    Ok(SegmentHeader { format_version, segment_id, created_unix_ms })
}

/// One footer entry: where a frame is and what the indexes need of it.
#[derive(Debug, Clone, PartialEq)]
pub struct FooterEntry {
    pub frame_offset: u64,
    pub body_len: u32,
    pub kind: u8,
    /// Reward entries of segment format 4 and later: 1 + the reward's target
    /// (1 a trace, 2 a session), with the value in `timestamp`, so that an
    /// open needs no record body. 0 for every other entry, and for rewards
    /// in older footers (read the record; format-spec/segment.md §4).
    pub reward_target: u8,
    /// Calls: the call's timestamp. Rewards with `reward_target` set: the
    /// value. Other annotations: 0.
    pub timestamp: f64,
    /// Calls: the trace id. Annotations: the target id (trace or session).
    pub id: String,
    /// Calls: the session id. Annotations: empty.
    pub session_id: String,
    pub session_uids: Vec<String>,
}

/// Encode the footer body + trailer of a segment of `format_version`;
/// `footer_offset` is where the body starts (8-aligned, right after the last
/// frame). Before format 4 a reward entry holds neither target nor value.
pub fn encode_footer(out: &mut Vec<u8>, footer_offset: u64, entries: &[FooterEntry], format_version: u32) {
    let rewards_in_footer = format_version >= super::FORMAT_REWARDS_IN_FOOTER;
    debug_assert_eq!(footer_offset % 8, 0);
    let start = out.len();
    out.extend_from_slice(&FOOTER_MAGIC);
    out.put_u32(entries.len() as u32);
    out.put_u32(0);
    for e in entries {
        encode_entry(out, &e.as_ref(), rewards_in_footer);
    }
    out.pad_to(8);
    let body = out.get(start..).unwrap_or_default();
    let footer_len = body.len() as u64;
    let footer_crc = crc32fast::hash(body);
    let mut trailer = Vec::with_capacity(TRAILER_BYTES as usize);
    trailer.put_u64(footer_offset);
    trailer.put_u64(footer_len);
    trailer.put_u32(footer_crc);
    let trailer_crc = crc32fast::hash(&trailer);
    trailer.put_u32(trailer_crc);
    trailer.extend_from_slice(&TRAILER_MAGIC);
    out.extend_from_slice(&trailer);
}

/// Encode one footer entry (segment.md §4) as a footer of a format with
/// rewards in the footer (`rewards_in_footer`, 4 and later) or without.
/// The backlog index file keeps the entries it replays in this encoding.
pub fn encode_entry(out: &mut Vec<u8>, e: &FooterEntryRef<'_>, rewards_in_footer: bool) {
    out.put_u64(e.frame_offset);
    out.put_u32(e.body_len);
    out.put_u8(e.kind);
    let kept = rewards_in_footer || e.reward_target == 0;
    out.put_u8(if kept { e.reward_target } else { 0 });
    out.put_u16(e.session_uids.len() as u16);
    out.put_f64(if kept { e.timestamp } else { 0.0 });
    out.put_str16(e.id);
    out.put_str16(e.session_id);
    for uid in e.session_uids.iter() {
        out.put_str16(uid);
    }
}

/// A sealed segment's trailer, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trailer {
    pub footer_offset: u64,
    pub footer_len: u64,
    pub footer_crc: u32,
}

/// Read the trailer at the end of `file` (a whole segment). `None` when the
/// segment is not sealed (no valid trailer there).
pub fn read_trailer(file: &[u8]) -> Option<Trailer> {
    let at = file.len().checked_sub(TRAILER_BYTES as usize)?;
    decode_trailer(file.get(at..)?, file.len() as u64)
}

/// Decode the last [`TRAILER_BYTES`] of a segment of `file_len` bytes.
pub fn decode_trailer(tail: &[u8], file_len: u64) -> Option<Trailer> {
    if file_len < HEADER_BYTES + TRAILER_BYTES || tail.len() != TRAILER_BYTES as usize {
        return None;
    }
    let mut c = Cursor::new(tail);
    let footer_offset = c.u64("footer offset").ok()?;
    let footer_len = c.u64("footer length").ok()?;
    let footer_crc = c.u32("footer crc").ok()?;
    let trailer_crc = c.u32("trailer crc").ok()?;
    let magic = c.bytes(8, "trailer magic").ok()?;
    if magic != TRAILER_MAGIC || crc32fast::hash(tail.get(..20)?) != trailer_crc {
        return None;
    }
    if footer_offset < HEADER_BYTES || footer_offset.checked_add(footer_len)? != file_len - TRAILER_BYTES {
        return None;
    }
    Some(Trailer { footer_offset, footer_len, footer_crc })
}

/// Decode and check the footer that `trailer` points at.
pub fn decode_footer(file: &[u8], trailer: &Trailer) -> Result<Vec<FooterEntry>, DecodeError> {
    Ok(check_footer(file, trailer)?.iter().map(FooterEntryRef::into_entry).collect())
}

/// A footer entry read in place from a footer [`check_footer`] passed: the
/// fields of [`FooterEntry`], its strings borrowed from the segment's bytes.
/// An open replays a footer through these, so that the millions of seals
/// and rewards a large store carries cost no allocation each
/// (store/recovery.rs).
#[derive(Debug, Clone, Copy)]
pub struct FooterEntryRef<'a> {
    pub frame_offset: u64,
    pub body_len: u32,
    pub kind: u8,
    pub reward_target: u8,
    pub timestamp: f64,
    pub id: &'a str,
    pub session_id: &'a str,
    pub session_uids: Uids<'a>,
}

/// The session uids of a [`FooterEntryRef`].
#[derive(Debug, Clone, Copy)]
pub enum Uids<'a> {
    /// `count` u16-length-prefixed strings in a checked footer.
    InFooter { bytes: &'a [u8], count: u16 },
    /// Those of an owned entry.
    Owned(&'a [String]),
}

impl<'a> Uids<'a> {
    pub fn len(&self) -> usize {
        match self {
            Uids::InFooter { count, .. } => usize::from(*count),
            Uids::Owned(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The uids, in order.
    pub fn iter(&self) -> impl Iterator<Item = &'a str> + 'a {
        let (mut footer, owned) = match *self {
            Uids::InFooter { bytes, count } => (Some((Cursor::new(bytes), count)), None),
            Uids::Owned(v) => (None, Some(v.iter().map(String::as_str))),
        };
        // A checked footer parses again (a failure, which cannot happen,
        // ends the list early).
        let in_footer = std::iter::from_fn(move || {
            let (c, left) = footer.as_mut()?;
            if *left == 0 {
                return None;
            }
            *left -= 1;
            c.str16("entry session uid").ok()
        });
        in_footer.chain(owned.into_iter().flatten())
    }
}

impl FooterEntryRef<'_> {
    /// The owned entry, strings copied.
    pub fn into_entry(self) -> FooterEntry {
        FooterEntry {
            frame_offset: self.frame_offset,
            body_len: self.body_len,
            kind: self.kind,
            reward_target: self.reward_target,
            timestamp: self.timestamp,
            id: self.id.to_owned(),
            session_id: self.session_id.to_owned(),
            session_uids: self.session_uids.iter().map(str::to_owned).collect(),
        }
    }
}

impl FooterEntry {
    /// This entry as a [`FooterEntryRef`].
    pub fn as_ref(&self) -> FooterEntryRef<'_> {
        FooterEntryRef {
            frame_offset: self.frame_offset,
            body_len: self.body_len,
            kind: self.kind,
            reward_target: self.reward_target,
            timestamp: self.timestamp,
            id: &self.id,
            session_id: &self.session_id,
            session_uids: Uids::Owned(&self.session_uids),
        }
    }
}

/// A footer that passed [`check_footer`]: its entries are read in place.
#[derive(Debug, Clone)]
pub struct CheckedFooter<'a> {
    /// The entries, after the footer's magic, count and reserved word.
    entries: &'a [u8],
    /// Where they start in the segment.
    offset: usize,
    count: u32,
    /// Whether an entry holds a reward's target and value (segment format
    /// 4 and later write them).
    pub has_reward_targets: bool,
    /// The regions between frames that no entry indexes (offset, length):
    /// damage an earlier skip-corrupted open left out (segment.md §6).
    pub gaps: Vec<(u64, u64)>,
}

impl<'a> CheckedFooter<'a> {
    /// The footer whose entries are the `count` at `range` of `file`, which
    /// [`check_footer`] passed before (as [`CheckedFooter::range`] said).
    /// Entries that do not parse (not a checked footer) end the iteration.
    pub fn checked_before(file: &'a [u8], range: std::ops::Range<usize>, count: u32) -> CheckedFooter<'a> {
        let offset = range.start;
        let entries = file.get(range).unwrap_or_default();
        CheckedFooter { entries, offset, count, has_reward_targets: false, gaps: Vec::new() }
    }

    /// Where its entries lie in the segment.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.entries.len()
    }

    /// How many entries it holds.
    pub fn entry_count(&self) -> u32 {
        self.count
    }

    /// The entries, in frame order, without allocating.
    pub fn iter(&self) -> impl Iterator<Item = FooterEntryRef<'a>> + 'a {
        let mut c = Cursor::new(self.entries);
        let mut left = self.count;
        // The footer was checked whole: a parse failure (which cannot
        // happen) ends the iteration.
        std::iter::from_fn(move || {
            if left == 0 {
                return None;
            }
            left -= 1;
            parse_entry(&mut c).ok()
        })
    }
}

/// One entry at the cursor; its uids are skipped over (checked) and kept
/// as the bytes they lie in.
fn parse_entry<'a>(c: &mut Cursor<'a>) -> Result<FooterEntryRef<'a>, DecodeError> {
    let frame_offset = c.u64("entry frame offset")?;
    let body_len = c.u32("entry body length")?;
    let kind = c.u8("entry kind")?;
    let reward_target = c.u8("entry reward target")?;
    let n_uids = c.u16("entry uid count")?;
    let timestamp = c.f64("entry timestamp")?;
    let id = c.str16("entry id")?;
    let session_id = c.str16("entry session id")?;
    let uids_start = c.pos();
    for _ in 0..n_uids {
        c.str16("entry session uid")?;
    }
    let bytes = c.buf().get(uids_start..c.pos()).unwrap_or_default();
    let session_uids = Uids::InFooter { bytes, count: n_uids };
    Ok(FooterEntryRef { frame_offset, body_len, kind, reward_target, timestamp, id, session_id, session_uids })
}

/// Check the footer that `trailer` points at — its crc32, magic, every
/// entry (in frame order, frames not overlapping, below the footer) and
/// that nothing trails them — without decoding it into owned entries.
pub fn check_footer<'a>(file: &'a [u8], trailer: &Trailer) -> Result<CheckedFooter<'a>, DecodeError> {
    let start = usize::try_from(trailer.footer_offset).map_err(|_| DecodeError::new(0, "footer offset overflows"))?;
    let end = start
        .checked_add(trailer.footer_len as usize)
        .ok_or_else(|| DecodeError::new(start, "footer length overflows"))?;
    let body =
        file.get(start..end).ok_or_else(|| DecodeError::new(start, "footer runs past the end of the segment"))?;
    if crc32fast::hash(body) != trailer.footer_crc {
        return Err(DecodeError::new(start, "footer crc mismatch"));
    }
    let rebase = |e: DecodeError| DecodeError::new(start + e.offset as usize, e.what);
    let mut c = Cursor::new(body);
    let magic = c.bytes(8, "footer magic").map_err(rebase)?;
    if magic != FOOTER_MAGIC {
        return Err(DecodeError::new(start, "bad footer magic"));
    }
    let count = c.u32("footer entry count").map_err(rebase)?;
    let _reserved = c.u32("reserved").map_err(rebase)?;
    let entries_at = c.pos();
    let mut last_end = HEADER_BYTES;
    let mut has_reward_targets = false;
    let mut gaps = Vec::new();
    for _ in 0..count {
        let at = c.pos();
        let e = parse_entry(&mut c).map_err(rebase)?;
        if e.reward_target > 2 || (e.reward_target != 0 && e.kind != crate::format::record::KIND_REWARD) {
            return Err(DecodeError::new(start + at + 13, "bad footer entry reward target"));
        }
        if e.reward_target != 0 && e.timestamp.is_nan() {
            return Err(DecodeError::new(start + at + 16, "footer entry reward value is NaN"));
        }
        has_reward_targets |= e.reward_target != 0;
        let frame_offset = e.frame_offset;
        // Entries are in frame order and frames do not overlap. A gap between
        // two entries is a damaged region a skip-corrupted recovery left out
        // of the index (format-spec/segment.md §4, §6).
        if frame_offset < last_end || !frame_offset.is_multiple_of(8) || frame_offset >= trailer.footer_offset {
            return Err(DecodeError::new(
                start + at,
                format!(
                    "entry frame offset {frame_offset}, expected an 8-aligned offset from {last_end} below the footer"
                ),
            ));
        }
        if frame_offset > last_end {
            gaps.push((last_end, frame_offset - last_end));
        }
        last_end = frame_offset.saturating_add(super::frame::frame_bytes(u64::from(e.body_len)));
    }
    if align8(c.pos() as u64) != body.len() as u64 {
        return Err(DecodeError::new(start + c.pos(), "footer has trailing bytes"));
    }
    if last_end != trailer.footer_offset {
        return Err(DecodeError::new(
            start,
            format!("footer entries end at {last_end}, footer starts at {}", trailer.footer_offset),
        ));
    }
    let entries = body.get(entries_at..c.pos()).unwrap_or_default();
    Ok(CheckedFooter { entries, offset: start + entries_at, count, has_reward_targets, gaps })
}

/// The header this build writes for a new segment.
pub fn new_header(segment_id: u64, created_unix_ms: u64) -> SegmentHeader {
    SegmentHeader { format_version: FORMAT_VERSION, segment_id, created_unix_ms }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_golden_prefix() {
        let h = new_header(7, 1000);
        let bytes = encode_header(&h);
        assert_eq!(&bytes[..16], b"TRJLSEG\0\x06\0\0\0\x40\0\0\0");
        assert_eq!(decode_header(&bytes), Ok(h));
        let mut bad = bytes;
        bad[20] ^= 1;
        assert!(decode_header(&bad).is_err());
    }

    #[test]
    fn footer_round_trip() {
        let entries = vec![
            FooterEntry {
                frame_offset: 64,
                body_len: 10,
                kind: 1,
                reward_target: 0,
                timestamp: 1.5,
                id: "t".into(),
                session_id: "s".into(),
                session_uids: vec!["u".into()],
            },
            FooterEntry {
                frame_offset: 88,
                body_len: 17,
                kind: 3,
                reward_target: 0,
                timestamp: 0.0,
                id: "s".into(),
                session_id: String::new(),
                session_uids: vec![],
            },
            FooterEntry {
                frame_offset: 120,
                body_len: 17,
                kind: crate::format::record::KIND_REWARD,
                reward_target: 2,
                timestamp: -0.25,
                id: "s".into(),
                session_id: String::new(),
                session_uids: vec![],
            },
        ];
        let mut file = vec![0u8; 152];
        encode_footer(&mut file, 152, &entries, crate::format::FORMAT_VERSION);
        let trailer = read_trailer(&file).unwrap();
        assert_eq!(decode_footer(&file, &trailer).unwrap(), entries);
        // Read in place: the same entries, borrowed; and again through the
        // range a load keeps.
        let checked = check_footer(&file, &trailer).unwrap();
        assert!(checked.has_reward_targets && checked.gaps.is_empty());
        assert_eq!(checked.iter().map(FooterEntryRef::into_entry).collect::<Vec<_>>(), entries);
        let again = CheckedFooter::checked_before(&file, checked.range(), checked.entry_count());
        assert_eq!(again.iter().map(FooterEntryRef::into_entry).collect::<Vec<_>>(), entries);
        assert_eq!(entries.iter().map(|e| e.as_ref().into_entry()).collect::<Vec<_>>(), entries);
        assert_eq!(checked.iter().next().map(|e| e.session_uids.iter().collect::<Vec<_>>()), Some(vec!["u"]));
        for cut in 0..file.len() {
            if let Some(t) = read_trailer(&file[..cut]) {
                let _ = decode_footer(&file[..cut], &t);
            }
        }
    }

    fn entry(frame_offset: u64, body_len: u32) -> FooterEntry {
        FooterEntry {
            frame_offset,
            body_len,
            kind: 1,
            reward_target: 0,
            timestamp: 0.0,
            id: "t".into(),
            session_id: "s".into(),
            session_uids: vec![],
        }
    }

    #[test]
    fn footer_gaps_are_skipped_regions_but_overlaps_are_refused() {
        // 64..88 one frame, 88..120 a skipped region, 120..144 one frame.
        let decode = |entries: &[FooterEntry]| {
            let mut file = vec![0u8; 144];
            encode_footer(&mut file, 144, entries, crate::format::FORMAT_VERSION);
            let trailer = read_trailer(&file).expect("trailer");
            decode_footer(&file, &trailer)
        };
        let gap = [entry(64, 10), entry(120, 10)];
        assert_eq!(decode(&gap).expect("a gap decodes"), gap);
        let mut file = vec![0u8; 144];
        encode_footer(&mut file, 144, &gap, crate::format::FORMAT_VERSION);
        let checked = check_footer(&file, &read_trailer(&file).expect("trailer")).expect("checks");
        assert_eq!(checked.gaps, vec![(88, 32)]);
        assert!(!checked.has_reward_targets);
        assert!(decode(&[entry(64, 10), entry(80, 10)]).is_err(), "overlap");
        assert!(decode(&[entry(64, 10), entry(124, 10)]).is_err(), "misaligned");
        assert!(decode(&[entry(64, 10), entry(120, 30)]).is_err(), "runs into the footer");
        assert!(decode(&[entry(64, 10), entry(u64::MAX - 7, 10)]).is_err(), "past the footer");
    }
}
