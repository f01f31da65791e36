//! Finding where a JSON value ends in text known to be valid JSON, without
//! parsing it: the span scanner of docs blocks (format/docs.rs) and of the
//! gateway's logprobs reader (crates/serve). Each function returns None
//! (never panics) on text that is not valid JSON where it looks.

/// The first index at or after `i` that is not JSON whitespace.
pub fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// End (exclusive) of the string literal starting at `i` (a `"`).
pub fn string_end(b: &[u8], i: usize) -> Option<usize> {
    if b.get(i) != Some(&b'"') {
        return None;
    }
    let mut j = i + 1;
    loop {
        // Straight to the next quote or backslash.
        j += b.get(j..)?.iter().position(|&c| c == b'"' || c == b'\\')?;
        match b.get(j)? {
            b'"' => return Some(j + 1),
            _ => j += 2,
        }
    }
}

/// End (exclusive) of the JSON value starting at `i`.
pub fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                // Straight to the next byte that opens, closes or quotes.
                j += b.get(j..)?.iter().position(|&c| matches!(c, b'"' | b'{' | b'[' | b'}' | b']'))?;
                match *b.get(j)? {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    _ => {
                        depth = depth.checked_sub(1)?;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                }
                j += 1;
            }
        }
        _ => {
            let len = b.get(i..)?.iter().position(|&c| matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'));
            let j = len.map_or(b.len(), |n| i + n);
            (j > i).then_some(j)
        }
    }
}
