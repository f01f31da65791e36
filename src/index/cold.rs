//! The cold layers of an [`Index`](super::Index): sessions whose calls are
//! all in sealed segments and that nothing else in the store names, in the
//! frozen layer's flat arrays (store/cold.rs decides which). An open
//! through the backlog index file maps that file's layer first; the
//! sessions of the segments the file does not list that qualify the same
//! way go to a second layer the open builds, instead of the maps. A session
//! and a trace id are in one layer at most.
//!
//! Sessions are numbered across the layers: the first layer's from 0, each
//! next layer's from the end of the one before, so the index's set of
//! thawed cold sessions is one set of numbers.

use super::frozen::{Frozen, FrozenRow};
use crate::format::record::Loc;
use std::sync::Arc;

/// One layer, with the number its first session has among all layers.
#[derive(Debug, Clone)]
struct Layer {
    frozen: Arc<Frozen>,
    first: u32,
}

/// The cold layers, oldest first; an O(1) clone.
#[derive(Debug, Clone, Default)]
pub(crate) struct ColdLayers {
    layers: Arc<Vec<Layer>>,
}

impl ColdLayers {
    /// Add `frozen` as the newest layer; its sessions and trace ids must be
    /// in no other. `false` (nothing added) when the session numbers would
    /// pass `u32`.
    pub(crate) fn push(&mut self, frozen: Frozen) -> bool {
        let first = match self.layers.last() {
            Some(l) => match l.first.checked_add(l.frozen.session_count()) {
                Some(f) => f,
                None => return false,
            },
            None => 0,
        };
        if first.checked_add(frozen.session_count()).is_none() {
            return false;
        }
        Arc::make_mut(&mut self.layers).push(Layer { frozen: Arc::new(frozen), first });
        true
    }

    /// Whether `other` is a clone of these layers (not merely equal ones).
    pub(crate) fn ptr_eq(&self, other: &ColdLayers) -> bool {
        Arc::ptr_eq(&self.layers, &other.layers)
    }

    /// Whether no layer holds a call.
    pub(crate) fn is_empty(&self) -> bool {
        self.layers.iter().all(|l| l.frozen.is_empty())
    }

    /// The calls of every layer (thawed sessions' included).
    pub(crate) fn len(&self) -> usize {
        self.layers.iter().map(|l| l.frozen.len()).sum()
    }

    /// The heap bytes of every layer.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.layers.iter().map(|l| l.frozen.heap_bytes()).sum()
    }

    /// How many layers.
    pub(crate) fn count(&self) -> usize {
        self.layers.len()
    }

    /// The oldest layer (an open's only one, unless it went through the
    /// backlog index file).
    pub(crate) fn first(&self) -> Option<&Frozen> {
        self.layers.first().map(|l| &*l.frozen)
    }

    /// Each layer with the number of its first session.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&Arc<Frozen>, u32)> + '_ {
        self.layers.iter().map(|l| (&l.frozen, l.first))
    }

    /// The layer of session `session` (a number across the layers), with
    /// the session's number in it.
    pub(crate) fn locate(&self, session: u32) -> Option<(&Arc<Frozen>, u32)> {
        let i = self.layers.partition_point(|l| l.first <= session).checked_sub(1)?;
        let l = self.layers.get(i)?;
        let local = session - l.first;
        (local < l.frozen.session_count()).then_some((&l.frozen, local))
    }

    /// The session named `name`, in layer `from` or a later one.
    pub(crate) fn session(&self, name: &str, from: usize) -> Option<u32> {
        self.layers.iter().skip(from).find_map(|l| l.frozen.session(name).map(|i| l.first + i))
    }

    /// The call with trace id `trace_id`, with its session, in layer `from`
    /// or a later one.
    pub(crate) fn trace(&self, trace_id: &str, from: usize) -> Option<(u32, &FrozenRow)> {
        self.layers.iter().skip(from).find_map(|l| l.frozen.trace(trace_id).map(|r| (l.first + r.session, r)))
    }

    /// Session `session`'s name ("" for no such session).
    pub(crate) fn session_name(&self, session: u32) -> &str {
        self.locate(session).map_or("", |(f, i)| f.session_name(i))
    }

    pub(crate) fn is_sealed(&self, session: u32) -> bool {
        self.locate(session).is_some_and(|(f, i)| f.is_sealed(i))
    }

    pub(crate) fn reward(&self, session: u32) -> Option<f64> {
        self.locate(session).and_then(|(f, i)| f.reward(i))
    }

    /// Every call of every layer, with its session's number and name.
    pub(crate) fn calls(&self) -> impl Iterator<Item = (u32, Loc, &str)> + '_ {
        self.layers.iter().flat_map(|l| {
            l.frozen.rows().iter().map(move |r| (l.first + r.session, r.loc(), l.frozen.session_name(r.session)))
        })
    }

    /// Give back the resident pages of the files the layers are mapped from.
    pub(crate) fn release_pages(&self) {
        for l in self.layers.iter() {
            l.frozen.release_pages();
        }
    }

    /// What failed of a layer's lazily checked blocks, once one did.
    pub(crate) fn table_damage(&self) -> Option<crate::error::Error> {
        self.layers.iter().find_map(|l| l.frozen.table_damage())
    }

    /// What failed of a layer's annotation cache blocks, once one did.
    pub(crate) fn cache_damage(&self) -> Option<crate::error::Error> {
        self.layers.iter().find_map(|l| l.frozen.cache_damage())
    }
}
