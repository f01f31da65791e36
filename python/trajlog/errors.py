"""Exceptions mirroring the Rust error kinds (same messages)."""


class TrajlogError(Exception):
    """Base class of every trajlog error."""


class IOFailure(TrajlogError, OSError):
    """The operating system failed an I/O call; retrying may help."""


class StorageFullError(IOFailure):
    """The disk (or quota) is full (ENOSPC/EDQUOT); free space, then reopen the store."""


class CorruptError(TrajlogError):
    """Bytes on disk failed validation; run `trajlog verify`."""


class IncompatibleError(TrajlogError):
    """The store was written by an incompatible format version."""


class InvalidInputError(TrajlogError, ValueError):
    """A value given to trajlog is malformed; nothing was written."""


class LimitExceededError(InvalidInputError):
    """A value is over a named limit (see the README's Limits); nothing was written."""


class LockedError(TrajlogError):
    """Another process holds the writer lock of this store."""


class ClosedError(TrajlogError):
    """The store is closed, or read-only and a write was attempted."""


class PoisonedError(TrajlogError):
    """An earlier write or fsync failed; reopen the store to recover."""


class NotFoundError(TrajlogError, LookupError):
    """The thing asked for does not exist."""
