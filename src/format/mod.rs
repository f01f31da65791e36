//! Codecs for every byte trajlog puts on disk — pure functions, no I/O.
//!
//! Each submodule implements one section of `format-spec/`:
//! [`frame`] (segment.md §2), [`segment`] header/footer (segment.md §1, §4),
//! [`record`] (record.md), [`manifest`] (manifest.md). All integers are
//! little-endian. Decoders never panic on any input; they return [`DecodeError`]
//! with the offset (relative to the buffer they were given) and what was wrong,
//! and the storage layer turns that into `ErrorKind::Corrupt { path, offset }`.

pub mod docs;
pub mod frame;
pub mod manifest;
pub mod record;
pub mod segment;

#[cfg(target_endian = "big")]
compile_error!("trajlog views little-endian columns in place and supports little-endian targets only");

/// The segment format version written by this build (format-spec/segment.md §1).
/// Version 6 adds the docs block's `logprobs.content` reference (record.md
/// §7.2, reference 8); version 5 adds the session-moved record (kind 5, record.md §3) of the
/// copy-forward collector; version 4 puts rewards' targets and values in footer entries (segment.md
/// §4); version 3 added messages deltas to docs blocks (record.md §7.2,
/// references 6 and 7); version 2 added docs blocks.
pub const FORMAT_VERSION: u32 = 6;
/// The first segment format whose docs blocks may hold reference 8.
pub const FORMAT_CONTENT_REF: u32 = 6;
/// The first segment format that may hold session-moved records.
pub const FORMAT_MOVE_SESSION: u32 = 5;
/// The first segment format whose footer entries carry rewards' targets and
/// values.
pub const FORMAT_REWARDS_IN_FOOTER: u32 = 4;
/// The oldest segment format version this build reads (version 1 has no
/// docs blocks).
pub const FORMAT_VERSION_MIN: u32 = 1;

/// A decoding failure: where (relative offset) and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError {
    pub offset: u64,
    pub what: String,
}

impl DecodeError {
    pub(crate) fn new(offset: usize, what: impl Into<String>) -> Self {
        Self { offset: offset as u64, what: what.into() }
    }
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (at relative offset {})", self.what, self.offset)
    }
}

/// Bounds-checked little-endian reader over a byte slice. Every accessor returns
/// an error instead of panicking, so decoders built on it are total.
pub(crate) struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub(crate) fn at(buf: &'a [u8], pos: usize) -> Self {
        Self { buf, pos }
    }

    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// The whole buffer this cursor reads.
    pub(crate) fn buf(&self) -> &'a [u8] {
        self.buf
    }

    pub(crate) fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).filter(|&end| end <= self.buf.len()).ok_or_else(|| {
            DecodeError::new(
                self.pos,
                format!("{what}: {n} bytes run past the end ({} left)", self.buf.len().saturating_sub(self.pos)),
            )
        })?;
        let out =
            self.buf.get(self.pos..end).ok_or_else(|| DecodeError::new(self.pos, format!("{what}: out of bounds")))?;
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], DecodeError> {
        let b = self.bytes(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    pub(crate) fn u8(&mut self, what: &str) -> Result<u8, DecodeError> {
        Ok(self.array::<1>(what)?[0])
    }
    pub(crate) fn u16(&mut self, what: &str) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    pub(crate) fn u32(&mut self, what: &str) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    pub(crate) fn u64(&mut self, what: &str) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    pub(crate) fn i64(&mut self, what: &str) -> Result<i64, DecodeError> {
        Ok(i64::from_le_bytes(self.array(what)?))
    }
    pub(crate) fn f64(&mut self, what: &str) -> Result<f64, DecodeError> {
        Ok(f64::from_le_bytes(self.array(what)?))
    }

    /// A UTF-8 string of `len` bytes.
    pub(crate) fn str(&mut self, len: usize, what: &str) -> Result<&'a str, DecodeError> {
        let start = self.pos;
        let b = self.bytes(len, what)?;
        std::str::from_utf8(b).map_err(|e| DecodeError::new(start, format!("{what}: not UTF-8 ({e})")))
    }

    /// A string prefixed by its u16 byte length.
    pub(crate) fn str16(&mut self, what: &str) -> Result<&'a str, DecodeError> {
        let len = self.u16(what)? as usize;
        self.str(len, what)
    }

    /// `n` little-endian u32 values viewed in place: fails (never UB) when the
    /// bytes are not 4-aligned in memory.
    pub(crate) fn u32s(&mut self, n: usize, what: &str) -> Result<&'a [u32], DecodeError> {
        let start = self.pos;
        let len = n.checked_mul(4).ok_or_else(|| DecodeError::new(start, format!("{what}: length overflows")))?;
        let b = self.bytes(len, what)?;
        bytemuck::try_cast_slice(b).map_err(|e| {
            DecodeError::new(start, format!("{what}: cannot view in place ({e:?}); the buffer must be 4-byte aligned"))
        })
    }

    pub(crate) fn f32s(&mut self, n: usize, what: &str) -> Result<&'a [f32], DecodeError> {
        let start = self.pos;
        let len = n.checked_mul(4).ok_or_else(|| DecodeError::new(start, format!("{what}: length overflows")))?;
        let b = self.bytes(len, what)?;
        bytemuck::try_cast_slice(b).map_err(|e| {
            DecodeError::new(start, format!("{what}: cannot view in place ({e:?}); the buffer must be 4-byte aligned"))
        })
    }
}

/// Little-endian writer helpers (encoders cannot fail except on limits checked
/// before encoding).
pub(crate) trait PutLe {
    fn put_u8(&mut self, v: u8);
    fn put_u16(&mut self, v: u16);
    fn put_u32(&mut self, v: u32);
    fn put_u64(&mut self, v: u64);
    fn put_f64(&mut self, v: f64);
    fn put_str16(&mut self, s: &str);
    fn pad_to(&mut self, align: usize);
}

impl PutLe for Vec<u8> {
    fn put_u8(&mut self, v: u8) {
        self.push(v);
    }
    fn put_u16(&mut self, v: u16) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_u32(&mut self, v: u32) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_u64(&mut self, v: u64) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_f64(&mut self, v: f64) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    /// Caller guarantees `s.len() <= u16::MAX` (ids are limited to `ID_BYTES_MAX`).
    fn put_str16(&mut self, s: &str) {
        debug_assert!(s.len() <= u16::MAX as usize);
        self.put_u16(s.len() as u16);
        self.extend_from_slice(s.as_bytes());
    }
    fn pad_to(&mut self, align: usize) {
        while !self.len().is_multiple_of(align) {
            self.push(0);
        }
    }
}

/// Round `n` up to a multiple of 8.
pub(crate) const fn align8(n: u64) -> u64 {
    (n + 7) & !7
}
