//! The one public error type.
//!
//! Few kinds, chosen by what the caller should do about them (slatedb RFC-0007);
//! the detail goes in the message. Messages are lowercase, name the field, the
//! limit or the file and offset, and say what to do.

use std::fmt;
use std::path::PathBuf;

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, by what the caller should do about it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The operating system failed an I/O call; retrying may help. The
    /// `io::Error` is kept: see [`Error::io_error`] (EIO, EACCES, …).
    Io,
    /// The disk (or the user's quota) is full: ENOSPC or EDQUOT. Free space,
    /// then reopen the store (a failed write poisons it: every pending and
    /// later write of that store returns this kind, with the ENOSPC/EDQUOT
    /// `io::Error` as its source).
    StorageFull,
    /// Bytes on disk failed validation (CRC, magic, bounds). Run `trajlog verify`.
    Corrupt { path: PathBuf, offset: u64 },
    /// The directory was written by an incompatible format version.
    Incompatible,
    /// A caller-supplied value is malformed; fix the input.
    InvalidInput { field: String },
    /// A caller-supplied value is over a named limit (see `limits`).
    LimitExceeded { limit: &'static str, value: u64, max: u64 },
    /// Another process holds the writer lock on this store directory.
    Locked,
    /// The store was closed, or opened read-only and a write was attempted.
    Closed,
    /// A write or fsync failed earlier (EIO, …; a full disk is
    /// `StorageFull` instead), or the writer thread died; the store refuses
    /// further writes. The failure's `io::Error`, if any, is the source.
    /// Reopen the store to recover to the last durable record.
    Poisoned,
    /// The thing asked for does not exist.
    NotFound,
}

/// The crate's error: a kind to match on, a message for people, and the
/// operating system's error when one caused it ([`std::error::Error::source`]).
#[derive(Debug, Clone)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    source: Option<std::sync::Arc<std::io::Error>>,
}

/// Errors compare by kind and message (an `io::Error` has no equality).
impl PartialEq for Error {
    fn eq(&self, other: &Self) -> bool {
        self.kind == other.kind && self.message == other.message
    }
}

/// ENOSPC and EDQUOT on Linux.
const ENOSPC: i32 = 28;
const EDQUOT: i32 = 122;

impl Error {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into(), source: None }
    }

    /// The operating system's error behind this one, if any (also through a
    /// poisoned store: the error that poisoned it).
    pub fn io_error(&self) -> Option<&std::io::Error> {
        self.source.as_deref()
    }

    /// What went wrong, by what to do about it.
    pub fn kind(&self) -> &ErrorKind {
        &self.kind
    }

    /// The human-readable message (without the kind prefix).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// An I/O error, with what was being done; ENOSPC and EDQUOT get the kind
    /// [`ErrorKind::StorageFull`], and the `io::Error` stays the source.
    pub fn io(context: impl fmt::Display, err: std::io::Error) -> Self {
        let full = matches!(err.raw_os_error(), Some(ENOSPC | EDQUOT))
            || matches!(err.kind(), std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded);
        let kind = if full { ErrorKind::StorageFull } else { ErrorKind::Io };
        Self { kind, message: format!("{context}: {err}"), source: Some(std::sync::Arc::new(err)) }
    }

    pub(crate) fn corrupt(path: impl Into<PathBuf>, offset: u64, what: impl fmt::Display) -> Self {
        let path = path.into();
        let message =
            format!("corrupt data in {} at offset {offset}: {what}; run `trajlog verify` on the store", path.display());
        Self::new(ErrorKind::Corrupt { path, offset }, message)
    }

    /// Bad input in `field` (for adapters that validate on trajlog's behalf:
    /// the CLI, the Python binding).
    pub fn invalid(field: impl Into<String>, what: impl fmt::Display) -> Self {
        let field = field.into();
        let message = format!("invalid {field}: {what}");
        Self::new(ErrorKind::InvalidInput { field }, message)
    }

    pub(crate) fn limit(limit: &'static str, field: &str, value: u64, max: u64) -> Self {
        Self::new(
            ErrorKind::LimitExceeded { limit, value, max },
            format!("{field} is {value}, over the limit {limit} = {max}; split the input or raise nothing (limits are fixed by the format)"),
        )
    }

    /// The error of a store poisoned by `cause`; keeps `cause`'s `io::Error`.
    /// Its kind is `Poisoned` (reopen the store), except when the disk was
    /// full: that stays `StorageFull`, since space must be freed first.
    pub(crate) fn poisoned(cause: &Error) -> Self {
        let kind = match cause.kind {
            ErrorKind::StorageFull => ErrorKind::StorageFull,
            _ => ErrorKind::Poisoned,
        };
        Self {
            kind,
            message: format!("store is poisoned by an earlier write failure ({cause}); no further writes are accepted — reopen the store to recover"),
            source: cause.source.clone(),
        }
    }

    /// The error every call on a closed store returns.
    pub fn closed() -> Self {
        Self::new(ErrorKind::Closed, "store is closed")
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// One thing wrong in a store's files, with where (damage found by a read,
/// an open or `trajlog verify`).
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// The file.
    pub path: PathBuf,
    /// The byte offset in it.
    pub offset: u64,
    /// What is wrong there.
    pub what: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_keep_their_cause_and_a_full_disk_has_its_own_kind() {
        let full = Error::io("write seg", std::io::Error::from_raw_os_error(ENOSPC));
        assert_eq!(full.kind(), &ErrorKind::StorageFull);
        assert_eq!(full.io_error().and_then(std::io::Error::raw_os_error), Some(ENOSPC));
        let eio = Error::io("write seg", std::io::Error::from_raw_os_error(5));
        assert_eq!(eio.kind(), &ErrorKind::Io);
        assert_eq!(eio.io_error().and_then(std::io::Error::raw_os_error), Some(5));
        // A store poisoned by a full disk says so by its kind; by EIO, it is
        // poisoned. Both keep the cause.
        let full_poisoned = Error::poisoned(&full);
        assert_eq!(full_poisoned.kind(), &ErrorKind::StorageFull);
        assert!(full_poisoned.message().contains("poisoned"), "{full_poisoned}");
        assert_eq!(full_poisoned.io_error().and_then(std::io::Error::raw_os_error), Some(ENOSPC));
        assert!(std::error::Error::source(&full_poisoned).is_some());
        let poisoned = Error::poisoned(&eio);
        assert_eq!(poisoned.kind(), &ErrorKind::Poisoned);
        assert_eq!(poisoned.io_error().and_then(std::io::Error::raw_os_error), Some(5));
        assert!(std::error::Error::source(&poisoned).is_some());
        assert!(Error::closed().io_error().is_none());
    }
}
