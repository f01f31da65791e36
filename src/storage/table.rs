//! Fixed-width tables that live either in memory or in a mapped file (the
//! shard index, format-spec/shard-index.md): one type for both, so the
//! index layers read a table the same way whether an open built it or
//! mapped it.

use super::mmap::Mapping;
use bytemuck::Pod;
use std::sync::Arc;

/// A slice of `T`s, owned or in a mapping.
pub(crate) enum Table<T> {
    Owned(Vec<T>),
    /// `len` elements at byte `start` of `map`; checked when made
    /// ([`Table::mapped`]): in bounds and aligned for `T`.
    Mapped { map: Arc<Mapping>, start: usize, len: usize },
}

impl<T: Pod> Table<T> {
    /// `len` elements of `T` at byte `start` of `map`, if they lie in it
    /// and are aligned for `T`.
    pub(crate) fn mapped(map: &Arc<Mapping>, start: usize, len: usize) -> Option<Table<T>> {
        let bytes = len.checked_mul(std::mem::size_of::<T>())?;
        let slice = map.bytes().get(start..start.checked_add(bytes)?)?;
        bytemuck::try_cast_slice::<u8, T>(slice).ok()?;
        Some(Table::Mapped { map: map.clone(), start, len })
    }

    pub(crate) fn as_slice(&self) -> &[T] {
        match self {
            Table::Owned(v) => v,
            Table::Mapped { map, start, len } => {
                let end = start.saturating_add(len.saturating_mul(std::mem::size_of::<T>()));
                // Checked in `mapped`: never empty for a non-empty table.
                map.bytes().get(*start..end).and_then(|b| bytemuck::try_cast_slice(b).ok()).unwrap_or(&[])
            }
        }
    }

    /// Whether this table lies in `map` (the same mapping object).
    pub(crate) fn is_in(&self, map: &Arc<Mapping>) -> bool {
        matches!(self, Table::Mapped { map: m, .. } if Arc::ptr_eq(m, map))
    }

    /// Bytes of the heap this table holds (a mapped one holds none).
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Table::Owned(v) => v.capacity() * std::mem::size_of::<T>(),
            Table::Mapped { .. } => 0,
        }
    }
}

impl<T: Pod> std::ops::Deref for Table<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<T: Pod> Clone for Table<T> {
    /// An owned table's rows copied; a mapped one's mapping shared.
    fn clone(&self) -> Self {
        match self {
            Table::Owned(v) => Table::Owned(v.clone()),
            Table::Mapped { map, start, len } => Table::Mapped { map: map.clone(), start: *start, len: *len },
        }
    }
}

impl<T: Pod + PartialEq> PartialEq for Table<T> {
    /// Equal rows, wherever they are.
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl<T> Default for Table<T> {
    fn default() -> Self {
        Table::Owned(Vec::new())
    }
}

impl<T: Pod> From<Vec<T>> for Table<T> {
    fn from(v: Vec<T>) -> Self {
        Table::Owned(v)
    }
}

impl<T: Pod + std::fmt::Debug> std::fmt::Debug for Table<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Table::Owned(v) => write!(f, "Table::Owned({} rows)", v.len()),
            Table::Mapped { start, len, .. } => write!(f, "Table::Mapped({len} rows at byte {start})"),
        }
    }
}
