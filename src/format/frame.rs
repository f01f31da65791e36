//! Record framing (format-spec/segment.md §2).
//!
//! ```text
//! 0  u32  body_len   (> 0; 0 marks the end of data)
//! 4  u32  crc32(body_len as 4 LE bytes ++ body)
//! 8  body            (body_len bytes)
//!    zero padding to the next multiple of 8
//! ```
//! Frames start 8-aligned, so a body starts 8-aligned and its token columns can
//! be viewed in place.

use super::{align8, Cursor, DecodeError};
use crate::limits::RECORD_BYTES_MAX;

/// Bytes before the body.
pub const FRAME_HEADER_BYTES: u64 = 8;

/// CRC of a frame: covers the length word and the body.
pub fn frame_crc(body: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&(body.len() as u32).to_le_bytes());
    h.update(body);
    h.finalize()
}

/// Total bytes a frame with a body of `body_len` bytes takes, padding included.
pub fn frame_bytes(body_len: u64) -> u64 {
    align8(FRAME_HEADER_BYTES + body_len)
}

/// Append a frame holding `body` to `out` (which must be 8-aligned in the file).
pub fn write_frame(out: &mut Vec<u8>, body: &[u8]) {
    debug_assert!(!body.is_empty() && body.len() as u64 <= RECORD_BYTES_MAX);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&frame_crc(body).to_le_bytes());
    out.extend_from_slice(body);
    super::PutLe::pad_to(out, 8);
}

/// What is at a frame position.
#[derive(Debug, PartialEq, Eq)]
pub enum FrameRead<'a> {
    /// A complete frame whose CRC matches: its body and the offset of the next frame.
    Frame { body: &'a [u8], next: u64 },
    /// A zero length word, or fewer than 8 bytes left: the clean end of data.
    End,
}

/// Read the frame at `offset` of `buf`. A torn or corrupt frame is an error
/// (recovery truncates there; readers refuse to serve it).
pub fn read_frame(buf: &[u8], offset: u64) -> Result<FrameRead<'_>, DecodeError> {
    let start = usize::try_from(offset).map_err(|_| DecodeError::new(0, "frame offset overflows usize"))?;
    if !start.is_multiple_of(8) {
        return Err(DecodeError::new(start, "frame offset is not 8-aligned"));
    }
    if buf.len().saturating_sub(start) < FRAME_HEADER_BYTES as usize {
        return Ok(FrameRead::End);
    }
    let mut c = Cursor::at(buf, start);
    let body_len = c.u32("frame length")?;
    let crc = c.u32("frame crc")?;
    if body_len == 0 {
        return Ok(FrameRead::End);
    }
    if u64::from(body_len) > RECORD_BYTES_MAX {
        return Err(DecodeError::new(
            start,
            format!("frame length {body_len} is over RECORD_BYTES_MAX ({RECORD_BYTES_MAX})"),
        ));
    }
    let next = offset + frame_bytes(u64::from(body_len));
    if (buf.len() as u64) < next {
        // Writers always write the padding: a frame without it is torn.
        return Err(DecodeError::new(
            start,
            format!("frame runs past the end of data (ends at {next}, data ends at {}): torn write", buf.len()),
        ));
    }
    let body = c.bytes(body_len as usize, "frame body")?;
    let actual = frame_crc(body);
    if actual != crc {
        return Err(DecodeError::new(
            start,
            format!("frame crc mismatch (stored {crc:#010x}, computed {actual:#010x})"),
        ));
    }
    Ok(FrameRead::Frame { body, next })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_bytes() {
        let mut out = Vec::new();
        write_frame(&mut out, b"abc");
        // len=3, crc32([3,0,0,0,'a','b','c']), body, 5 bytes padding
        let crc = frame_crc(b"abc").to_le_bytes();
        let mut expect = vec![3, 0, 0, 0];
        expect.extend_from_slice(&crc);
        expect.extend_from_slice(b"abc\0\0\0\0\0");
        assert_eq!(out, expect);
        assert_eq!(read_frame(&out, 0), Ok(FrameRead::Frame { body: b"abc", next: 16 }));
        assert_eq!(read_frame(&out, 16), Ok(FrameRead::End));
    }

    #[test]
    fn torn_and_flipped_frames_are_errors() {
        let mut out = Vec::new();
        write_frame(&mut out, b"hello world");
        for cut in 8..out.len() {
            assert!(read_frame(&out[..cut], 0).is_err(), "cut at {cut}");
        }
        for bit in 0..(8 + 11) * 8 {
            let mut bad = out.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            match read_frame(&bad, 0) {
                Ok(FrameRead::Frame { body, .. }) => panic!("flipped bit {bit} served {body:?}"),
                Ok(FrameRead::End) | Err(_) => {}
            }
        }
    }
}
