//! [`Store::refresh`] of a read-only store: what the writer appended since
//! the last load, applied to the view's index, instead of a whole open.
//!
//! A refresh is incremental when the writer has only appended since: the
//! manifest lists the same shards, and the same segments in the same states
//! except that the last one may have been sealed, with new segments after
//! them. It then replays the records past the end of what the view holds
//! (the rest of the last segment, the new segments) onto a copy of the
//! view's index (a persistent map: an O(1) copy), with the replay rules of
//! an open (`recovery::apply_entry`). Its work is the new records plus one
//! read of the written part of the active segment, whatever the history.
//! Anything else — a publication, a retirement, a repair, damage or a
//! rebuilt footer in what it reads — makes it a whole load, as an open.

use super::recovery::{apply_entry, read_manifest};
use super::*;
use crate::format::manifest::{Manifest, SegmentState};
use crate::segment::recovery::RecoveryEventKind;

/// Whether a manifest read after `before` only adds to it: the same shards,
/// the same segments in the same states (the last one may have been sealed
/// since), maybe more segments.
fn only_appended(before: &Manifest, now: &Manifest) -> bool {
    if now.shards != before.shards || now.pending != before.pending || now.segments.len() < before.segments.len() {
        return false;
    }
    let last = before.segments.len().saturating_sub(1);
    before
        .segments
        .iter()
        .zip(&now.segments)
        .enumerate()
        .all(|(i, (a, b))| a.id == b.id && (a.state == b.state || (i == last && a.state == SegmentState::Active)))
}

/// The view after the records appended since `view` was loaded from
/// `before`, with the manifest it reflects; `None` when that takes a whole
/// load (see the module's documentation), which the caller then does.
pub(super) fn refresh_view(
    dir: &Path,
    recovery: RecoveryMode,
    before: &Manifest,
    view: &View,
) -> Result<Option<(View, Manifest)>> {
    if recovery == RecoveryMode::AbsoluteConsistency {
        // It checks the whole store at each load.
        return Ok(None);
    }
    let Some(manifest) = read_manifest(dir)? else { return Ok(None) };
    if !only_appended(before, &manifest) {
        return Ok(None);
    }
    // Where each segment to read starts: the last one the view holds, past
    // its visible end, unless it was sealed when read; then the new ones.
    let mut from: Vec<(u64, SegmentState, u64)> = Vec::new();
    if let Some(ms) = before.segments.last() {
        let Some(seg) = view.segments.get(&ms.id) else { return Ok(None) };
        if !seg.sealed {
            let state = manifest.segments.get(before.segments.len() - 1).map_or(ms.state, |s| s.state);
            from.push((ms.id, state, seg.visible_len));
        }
    }
    for ms in manifest.segments.get(before.segments.len()..).unwrap_or_default() {
        from.push((ms.id, ms.state, 0));
    }
    let on_damage = match recovery {
        RecoveryMode::SkipCorrupted => OnDamage::Skip,
        _ => OnDamage::Refuse,
    };
    let last = manifest.segments.last().map(|s| s.id);
    let mut index = view.index.clone();
    let mut segments = view.segments.clone();
    let mut damage = Vec::new();
    let mut rewards = Vec::new();
    for (id, state, start) in from {
        // A segment retired meanwhile, or damage: a whole load says so.
        let Ok(seg) = load_segment(dir, id, state == SegmentState::Sealed, on_damage) else { return Ok(None) };
        let torn_only = seg.events.iter().all(|e| e.kind == RecoveryEventKind::TornTailCut);
        if !torn_only || !seg.applied_from_footer.is_empty() || (!seg.sealed && Some(id) != last) {
            return Ok(None);
        }
        let r = SegmentRef::new(seg.id, seg.path.clone(), seg.map.clone(), seg.data_end, seg.sealed);
        // No record written since the last load is compacted: the shards
        // are the same.
        for e in seg.entries.iter().filter(|e| e.frame_offset >= start) {
            apply_entry(&mut index, &r, &e.as_ref(), &mut damage, &mut rewards, &|_| false, None);
        }
        segments.insert(id, r);
    }
    let damage = if damage.is_empty() {
        view.damage.clone()
    } else {
        Arc::new(view.damage.iter().cloned().chain(damage).collect())
    };
    Ok(Some((View { index, segments, shards: view.shards.clone(), damage }, manifest)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compact::{CompactOptions, Selection};

    fn call(session: &str, n: usize) -> Call {
        Call {
            trace_id: format!("{session}/{n}"),
            session_id: session.to_owned(),
            timestamp: n as f64,
            prompt_token_ids: (0..=n as u32).collect(),
            completion_token_ids: vec![100 + n as u32, 7],
            logprobs: Some(vec![-0.5 - n as f32, f32::from_bits(0x8000_0001)]),
            ..Default::default()
        }
    }

    /// Everything a reader can ask, as text: sessions (calls, seal,
    /// reward) and every call's ids, tokens, logprob bits and reward.
    fn state(store: &Store) -> Vec<String> {
        let snap = store.snapshot();
        let mut out: Vec<String> = snap
            .sessions()
            .iter()
            .map(|s| format!("session {} {} {} {:?}", s.session_id, s.calls, s.sealed, s.reward.map(f64::to_bits)))
            .collect();
        snap.for_each_call(|c| {
            let lp: Vec<u32> = c.logprobs().unwrap_or_default().iter().map(|x| x.to_bits()).collect();
            let prompt = c.prompt()?;
            let reward = snap.trace_reward(c.trace_id()).map(f64::to_bits);
            out.push(format!(
                "call {} {} {prompt:?} {:?} {lp:?} {reward:?}",
                c.trace_id(),
                c.session_id(),
                c.completion_token_ids()
            ));
            Ok(())
        })
        .expect("every call reads");
        out.sort();
        out.push(format!("count {}", snap.call_count()));
        out
    }

    /// Whether the next refresh of `ro` is incremental.
    fn incremental(ro: &Store) -> bool {
        let point = lock(&ro.read_point).clone().expect("a read-only store has a read point");
        let view = lock(&ro.inner.view).clone();
        refresh_view(ro.dir(), ro.options().recovery, &point, &view).expect("refresh").is_some()
    }

    /// Refresh `ro` and check it answers as a fresh read-only open does.
    fn refresh_matches_open(ro: &Store) {
        ro.refresh().expect("refresh");
        let fresh = Store::open_read_only(ro.dir()).expect("open");
        assert_eq!(state(ro), state(&fresh));
    }

    #[test]
    fn a_refresh_after_appends_replays_only_them_and_matches_an_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path(), Options::default()).expect("open");
        for n in 0..5 {
            store.append(call("a", n)).expect("append");
        }
        store.flush().expect("flush");
        let ro = Store::open_read_only(dir.path()).expect("open read-only");
        assert_eq!(ro.snapshot().call_count(), 5);
        // Appends to the active segment and to several later ones,
        // annotations, a deletion.
        for n in 5..60 {
            store.append(call("a", n)).expect("append");
            store.append(call("b", n)).expect("append");
            if n % 20 == 0 {
                store.roll().expect("roll");
            }
        }
        store.set_reward(Target::Session("a".into()), 0.25).expect("reward");
        store.set_reward(Target::Trace("b/7".into()), -1.5).expect("reward");
        store.seal_session("b").expect("seal");
        store.append(call("c", 0)).expect("append");
        store.delete_session("c").expect("delete");
        store.flush().expect("flush");
        assert!(store.snapshot().segments().len() >= 3, "the appends rolled segments");
        assert!(incremental(&ro));
        refresh_matches_open(&ro);
        assert_eq!(ro.snapshot().call_count(), 5 + 2 * 55);
        // Nothing new: still incremental, nothing changes.
        assert!(incremental(&ro));
        refresh_matches_open(&ro);
        // The last segment sealed by a roll, then more.
        store.roll().expect("roll");
        assert!(incremental(&ro));
        refresh_matches_open(&ro);
        store.append(call("d", 0)).expect("append");
        store.flush().expect("flush");
        assert!(incremental(&ro));
        refresh_matches_open(&ro);
    }

    #[test]
    fn a_publication_or_retirement_makes_the_refresh_a_whole_load() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path(), Options::default()).expect("open");
        for n in 0..8 {
            store.append(call("a", n)).expect("append");
            store.append(call("b", n)).expect("append");
        }
        store.seal_session("a").expect("seal");
        store.flush().expect("flush");
        let ro = Store::open_read_only(dir.path()).expect("open read-only");
        store.compact(&CompactOptions::default().selection(Selection::SealedOnly)).expect("compact");
        assert!(!incremental(&ro), "the shards changed");
        refresh_matches_open(&ro);
        assert!(ro.snapshot().get("a/3").expect("get").expect("present").is_compacted());
    }

    /// [`state`], with each session's calls in the order it lists them,
    /// and each trace id's live call.
    fn full_state(store: &Store) -> Vec<String> {
        let mut out = state(store);
        let snap = store.snapshot();
        for s in snap.sessions() {
            let calls = snap.session(&s.session_id, None, None).expect("session");
            let ids: Vec<String> = calls.iter().map(|c| format!("{}@{:?}", c.trace_id(), c.loc)).collect();
            out.push(format!("list {} {ids:?}", s.session_id));
            for c in &calls {
                let live = snap.get(c.trace_id()).expect("get").map(|v| (v.loc, v.session_id().to_owned()));
                out.push(format!("live {} {live:?}", c.trace_id()));
            }
        }
        out
    }

    #[test]
    fn a_read_only_open_holds_untouched_sessions_of_sealed_segments_cold_and_thaws_what_a_refresh_names() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path(), Options::default()).expect("open");
        let with = |mut c: Call, f: &dyn Fn(&mut Call)| {
            f(&mut c);
            c
        };
        for n in 0..4 {
            for s in 0..8 {
                store.append(call(&format!("s{s}"), n)).expect("append");
            }
            // Kept out of the layer: a call of two sessions, a trace id
            // appended twice, a trace reward, a deletion, a call in the
            // active segment.
            store.append(with(call("multi", n), &|c| c.session_uids = vec!["multi-b".into()])).expect("append");
            store.append(call("twice", n)).expect("append");
            store.append(call("rewarded", n)).expect("append");
            store.append(call("deleted", n)).expect("append");
            store.roll().expect("roll");
        }
        store.append(with(call("twice", 9), &|c| c.trace_id = "twice/1".into())).expect("append");
        store.set_reward(Target::Trace("rewarded/2".into()), 0.5).expect("reward");
        store.delete_session("deleted").expect("delete");
        store.seal_session("s0").expect("seal");
        store.set_reward(Target::Session("s0".into()), 1.25).expect("reward");
        store.set_reward(Target::Session("s1".into()), -2.0).expect("reward");
        store.set_reward(Target::Session("s1".into()), 3.0).expect("reward");
        store.roll().expect("roll");
        store.append(call("s7", 9)).expect("append");
        store.flush().expect("flush");

        let ro = Store::open_read_only(dir.path()).expect("open read-only");
        let layers = ro.snapshot().index_layers();
        assert_eq!(layers.cold_calls, 7 * 4, "s0..s6 are cold, s7 has a call in the active segment: {layers:?}");
        assert_eq!(store.snapshot().index_layers().cold_calls, 0, "a writer keeps its maps");
        assert_eq!(full_state(&ro), full_state(&store));
        assert!(ro.snapshot().is_sealed("s0"));
        assert_eq!(ro.snapshot().session_reward("s1"), Some(3.0));

        // Records that name cold sessions or their trace ids thaw them.
        store.append(call("s1", 9)).expect("append");
        store.seal_session("s2").expect("seal");
        store.set_reward(Target::Session("s3".into()), 4.0).expect("reward");
        store.set_reward(Target::Trace("s4/1".into()), 5.0).expect("reward");
        store.delete_session("s5").expect("delete");
        store.append(with(call("s6", 10), &|c| c.trace_id = "s6/2".into())).expect("append");
        store.flush().expect("flush");
        assert!(incremental(&ro));
        ro.refresh().expect("refresh");
        assert_eq!(full_state(&ro), full_state(&store));
        assert_eq!(ro.snapshot().index_layers().cold_calls, 4, "only s0 is left cold");
        refresh_matches_open(&ro);
        let fresh = Store::open_read_only(dir.path()).expect("open read-only");
        assert_eq!(full_state(&fresh), full_state(&store));
    }

    #[test]
    fn a_refresh_thaws_a_frozen_session_a_record_names() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let store = Store::open(dir.path(), Options::default()).expect("open");
            for n in 0..6 {
                store.append(call("a", n)).expect("append");
                store.append(call("b", n)).expect("append");
            }
            store.seal_session("a").expect("seal");
            store.seal_session("b").expect("seal");
            store.compact(&CompactOptions::default()).expect("compact");
        }
        let store = Store::open(dir.path(), Options::default()).expect("reopen");
        let ro = Store::open_read_only(dir.path()).expect("open read-only");
        assert!(ro.snapshot().index_layers().frozen_calls > 0, "the compacted sessions are frozen");
        store.set_reward(Target::Session("a".into()), 2.0).expect("reward");
        store.set_reward(Target::Trace("a/2".into()), 3.0).expect("reward");
        store.delete_session("b").expect("delete");
        store.flush().expect("flush");
        assert!(incremental(&ro));
        refresh_matches_open(&ro);
        let snap = ro.snapshot();
        assert_eq!(snap.session_reward("a"), Some(2.0));
        assert_eq!(snap.trace_reward("a/2"), Some(3.0));
        assert!(snap.session("b", None, None).expect("session").is_empty());
        assert_eq!(snap.call_count(), 6);
    }
}
