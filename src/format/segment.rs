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
        out.put_u64(e.frame_offset);
        out.put_u32(e.body_len);
        out.put_u8(e.kind);
        let kept = rewards_in_footer || e.reward_target == 0;
        out.put_u8(if kept { e.reward_target } else { 0 });
        out.put_u16(e.session_uids.len() as u16);
        out.put_f64(if kept { e.timestamp } else { 0.0 });
        out.put_str16(&e.id);
        out.put_str16(&e.session_id);
        for uid in &e.session_uids {
            out.put_str16(uid);
        }
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
    // Each entry takes at least 28 bytes: bound the allocation by the input.
    let mut entries = Vec::with_capacity((count as usize).min(body.len() / 28));
    let mut last_end = HEADER_BYTES;
    for _ in 0..count {
        let at = c.pos();
        let frame_offset = c.u64("entry frame offset").map_err(rebase)?;
        let body_len = c.u32("entry body length").map_err(rebase)?;
        let kind = c.u8("entry kind").map_err(rebase)?;
        let reward_target = c.u8("entry reward target").map_err(rebase)?;
        if reward_target > 2 || (reward_target != 0 && kind != crate::format::record::KIND_REWARD) {
            return Err(DecodeError::new(start + at + 13, "bad footer entry reward target"));
        }
        let n_uids = c.u16("entry uid count").map_err(rebase)?;
        let timestamp = c.f64("entry timestamp").map_err(rebase)?;
        if reward_target != 0 && timestamp.is_nan() {
            return Err(DecodeError::new(start + at + 16, "footer entry reward value is NaN"));
        }
        let id = c.str16("entry id").map_err(rebase)?.to_owned();
        let session_id = c.str16("entry session id").map_err(rebase)?.to_owned();
        let mut session_uids = Vec::with_capacity(usize::from(n_uids).min(64));
        for _ in 0..n_uids {
            session_uids.push(c.str16("entry session uid").map_err(rebase)?.to_owned());
        }
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
        last_end = frame_offset.saturating_add(super::frame::frame_bytes(u64::from(body_len)));
        entries.push(FooterEntry { frame_offset, body_len, kind, reward_target, timestamp, id, session_id, session_uids });
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
    Ok(entries)
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
        assert_eq!(&bytes[..16], b"TRJLSEG\0\x04\0\0\0\x40\0\0\0");
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
        assert!(decode(&[entry(64, 10), entry(80, 10)]).is_err(), "overlap");
        assert!(decode(&[entry(64, 10), entry(124, 10)]).is_err(), "misaligned");
        assert!(decode(&[entry(64, 10), entry(120, 30)]).is_err(), "runs into the footer");
        assert!(decode(&[entry(64, 10), entry(u64::MAX - 7, 10)]).is_err(), "past the footer");
    }
}
