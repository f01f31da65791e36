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
    /// The operating system failed an I/O call; retrying may help.
    Io,
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
    /// A write or fsync failed earlier; the store refuses further writes.
    /// Reopen the store to recover to the last durable record.
    Poisoned,
    /// The thing asked for does not exist.
    NotFound,
}

/// The crate's error: a kind to match on and a message for people.
#[derive(Debug, Clone, PartialEq)]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

impl Error {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into() }
    }

    /// What went wrong, by what to do about it.
    pub fn kind(&self) -> &ErrorKind {
        &self.kind
    }

    /// The human-readable message (without the kind prefix).
    pub fn message(&self) -> &str {
        &self.message
    }

    pub(crate) fn io(context: impl fmt::Display, err: std::io::Error) -> Self {
        Self::new(ErrorKind::Io, format!("{context}: {err}"))
    }

    pub(crate) fn corrupt(path: impl Into<PathBuf>, offset: u64, what: impl fmt::Display) -> Self {
        let path = path.into();
        let message =
            format!("corrupt data in {} at offset {offset}: {what}; run `trajlog verify` on the store", path.display());
        Self::new(ErrorKind::Corrupt { path, offset }, message)
    }

    pub(crate) fn invalid(field: impl Into<String>, what: impl fmt::Display) -> Self {
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

    pub(crate) fn poisoned(cause: &str) -> Self {
        Self::new(
            ErrorKind::Poisoned,
            format!("store is poisoned by an earlier write failure ({cause}); no further writes are accepted — reopen the store to recover"),
        )
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

impl std::error::Error for Error {}
