//! Moving documents out of a call's `extra` object into their own `steps`
//! columns and splicing them back (format-spec/shard.md §2.1, shard format 3).
//!
//! Pure text operations, no I/O. `extra` holds, for an rLLM gateway trace,
//! `raw_request` and `raw_response` (the request body and vLLM's whole
//! response: most of a call's bytes) and trajlog's [`KEY_ORDER`] member. In a
//! shard they are taken out of `extra` into the `raw_request`, `raw_response`
//! and `key_order` columns, as their JSON text exactly as stored, and the
//! `extra_splice` column records the byte offset in the remaining `extra`
//! where each one goes back.
//!
//! Invariant: `join(split(e)) == e`, byte for byte, for every text `e`. A
//! member is moved only when its frame is compact (`"key":value` with a `,`
//! or `{` right before it and a `,` or `}` right after it), the key occurs
//! once, and its value is not `null`; [`split`] checks the round trip before
//! it hands anything back, and moves nothing when it fails. Whitespace and key
//! order anywhere else in `extra` are kept as they are.

use crate::trace_json::{json_string, KEY_ORDER};
use serde_json::value::RawValue;

/// The members moved out of `extra`, in splice order: their `steps` column and
/// their key in `extra`.
pub const MOVED: [(&str, &str); 3] = [("key_order", KEY_ORDER), ("raw_request", "raw_request"), ("raw_response", "raw_response")];

/// A call's `extra` as a shard stores it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SplitExtra {
    /// What is left of `extra` (`None` when the call had none).
    pub extra: Option<String>,
    /// The value text of each member of [`MOVED`], in its order; `None` where
    /// it was not moved.
    pub moved: [Option<String>; 3],
    /// One byte offset into the text it is inserted in per moved member, in
    /// [`MOVED`] order (format-spec/shard.md §2.1); empty when none was moved.
    pub splice: Vec<u32>,
}

/// The top-level members of a JSON object, each as its key and its value's
/// byte range in `text`; `None` if `text` is not exactly one JSON object.
fn members(text: &str) -> Option<Vec<(String, usize, usize)>> {
    struct Members;
    impl<'de> serde::de::Visitor<'de> for Members {
        type Value = Vec<(String, &'de RawValue)>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(kv) = map.next_entry::<String, &'de RawValue>()? {
                out.push(kv);
            }
            Ok(out)
        }
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let found = serde::de::Deserializer::deserialize_map(&mut de, Members).ok()?;
    de.end().ok()?;
    let base = text.as_ptr() as usize;
    let mut out = Vec::with_capacity(found.len());
    for (k, v) in found {
        // A borrowed RawValue is a slice of `text`: its position is its address.
        let start = (v.get().as_ptr() as usize).checked_sub(base)?;
        let end = start.checked_add(v.get().len())?;
        if text.get(start..end) != Some(v.get()) {
            return None;
        }
        out.push((k, start, end));
    }
    Some(out)
}

/// Take the member `key` out of `text` when its frame is compact: returns
/// the text without it, its value, and the offset where it goes back.
/// `all` lists `text`'s members (key, value range) and is updated to the
/// returned text's (so that `text` is parsed once for every cut).
fn cut(text: &str, all: &mut Vec<(String, usize, usize)>, key: &str) -> Option<(String, String, u32)> {
    let mut found = all.iter().enumerate().filter(|(_, (k, _, _))| k == key);
    let (index, &(_, start, end)) = found.next()?;
    if found.next().is_some() {
        return None;
    }
    let value = text.get(start..end)?;
    if value == "null" {
        return None;
    }
    let head = format!("{}:", json_string(key));
    let key_start = start.checked_sub(head.len())?;
    if text.get(key_start..start)? != head {
        return None;
    }
    let bytes = text.as_bytes();
    let before = *bytes.get(key_start.checked_sub(1)?)?;
    let after = *bytes.get(end)?;
    if !matches!(after, b',' | b'}') {
        return None;
    }
    let (from, to) = match (before, after) {
        (b',', _) => (key_start - 1, end),
        (b'{', b',') => (key_start, end + 1),
        (b'{', _) => (key_start, end),
        _ => return None,
    };
    let at = u32::try_from(from).ok()?;
    let rest = format!("{}{}", text.get(..from)?, text.get(to..)?);
    let value = value.to_owned();
    // The other members keep their bytes; those after the cut move left.
    all.remove(index);
    for (_, s, e) in all.iter_mut() {
        if *s >= to {
            *s -= to - from;
            *e -= to - from;
        }
    }
    Some((rest, value, at))
}

/// Put the member `key` with value text `value` back into `text` at byte
/// `at` (format-spec/shard.md §2.1); `None` if `at` is not a position in
/// `text` (a damaged shard).
pub fn insert(text: &str, at: u32, key: &str, value: &str) -> Option<String> {
    let at = usize::try_from(at).ok()?;
    let (head, tail) = (text.get(..at)?, text.get(at..)?);
    let key = json_string(key);
    let mut out = String::with_capacity(text.len() + key.len() + value.len() + 2);
    out.push_str(head);
    if head.ends_with('{') {
        out.push_str(&key);
        out.push(':');
        out.push_str(value);
        if !tail.starts_with('}') {
            out.push(',');
        }
    } else {
        out.push(',');
        out.push_str(&key);
        out.push(':');
        out.push_str(value);
    }
    out.push_str(tail);
    Some(out)
}

/// Split `extra` for a shard row; `join` of the result gives `extra` back
/// byte for byte (checked here).
pub fn split(extra: Option<&str>) -> SplitExtra {
    let Some(original) = extra else { return SplitExtra::default() };
    let mut out = SplitExtra { extra: Some(original.to_owned()), ..SplitExtra::default() };
    // Cheap test first: most calls carry none of the keys.
    if !MOVED.iter().any(|(_, key)| original.contains(&format!("{}:", json_string(key)))) {
        return out;
    }
    let Some(mut all) = members(original) else { return out };
    let mut text = original.to_owned();
    for (i, (_, key)) in MOVED.iter().enumerate() {
        if let Some((rest, value, at)) = cut(&text, &mut all, key) {
            text = rest;
            if let Some(slot) = out.moved.get_mut(i) {
                *slot = Some(value);
            }
            out.splice.push(at);
        }
    }
    if out.splice.is_empty() {
        return out;
    }
    let moved = [out.moved[0].as_deref(), out.moved[1].as_deref(), out.moved[2].as_deref()];
    if join(&text, moved, &out.splice).as_deref() != Some(original) {
        // Never expected (the frames were checked); kept verbatim if it happens.
        return SplitExtra { extra: Some(original.to_owned()), ..SplitExtra::default() };
    }
    out.extra = Some(text);
    out
}

/// Rebuild `extra` from a shard row: the moved members are put back in
/// reverse [`MOVED`] order, each at its `splice` offset. `None` when the
/// offsets do not fit the row (one per moved member, each inside the text).
pub fn join(extra: &str, moved: [Option<&str>; 3], splice: &[u32]) -> Option<String> {
    let present: Vec<(&str, &str)> =
        MOVED.iter().zip(moved).filter_map(|(&(_, key), value)| Some((key, value?))).collect();
    if present.len() != splice.len() {
        return None;
    }
    let mut text = extra.to_owned();
    for (&(key, value), &at) in present.iter().zip(splice).rev() {
        text = insert(&text, at, key, value)?;
    }
    Some(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(e: &str) -> SplitExtra {
        let s = split(Some(e));
        let moved = [s.moved[0].as_deref(), s.moved[1].as_deref(), s.moved[2].as_deref()];
        let back = join(s.extra.as_deref().unwrap_or_default(), moved, &s.splice);
        assert_eq!(back.as_deref(), Some(e), "{s:?}");
        s
    }

    #[test]
    fn golden_splits() {
        let s = round_trip(r#"{"\u0000key_order":["b","a"],"raw_request":{"x":1},"raw_response":[2],"token_counts":{}}"#);
        assert_eq!(s.extra.as_deref(), Some(r#"{"token_counts":{}}"#));
        assert_eq!(s.moved, [Some(r#"["b","a"]"#.into()), Some(r#"{"x":1}"#.into()), Some("[2]".into())]);
        assert_eq!(s.splice, vec![1, 1, 1]);

        let s = round_trip(r#"{"a":1,"raw_response":{"y":[1, 2]},"raw_request":"q"}"#);
        assert_eq!(s.extra.as_deref(), Some(r#"{"a":1}"#));
        assert_eq!(s.splice, vec![34, 6]);

        let s = round_trip(r#"{"raw_request":{}}"#);
        assert_eq!(s.extra.as_deref(), Some("{}"));
        assert_eq!(s.splice, vec![1]);
    }

    #[test]
    fn kept_where_not_removable() {
        for e in [
            r#"{"raw_request": {}}"#,
            r#"{ "raw_request":{}}"#,
            r#"{"raw_request":{} }"#,
            r#"{"raw_request":null,"raw_response":null}"#,
            r#"{"raw_request":1,"raw_request":2}"#,
            r#"{"raw\u005frequest":1}"#,
            "{\n  \"raw_response\": {\"a\": 1}\n}",
            "[1]",
            "not json",
            "",
            r#"{"a":{"raw_request":1}}"#,
        ] {
            let s = round_trip(e);
            assert!(s.splice.is_empty(), "{e}: {s:?}");
            assert_eq!(s.extra.as_deref(), Some(e));
        }
        assert_eq!(split(None), SplitExtra::default());
    }

    #[test]
    fn whitespace_elsewhere_stays() {
        let e = "{ \"a\" : [1, 2] ,\"raw_request\":{\"m\": [ ]},\"raw_response\":{}, \"z\":null}";
        let s = round_trip(e);
        assert_eq!(s.extra.as_deref(), Some("{ \"a\" : [1, 2] , \"z\":null}"));
        let e = "  {\"raw_request\":1, \"b\":2}  ";
        let s = round_trip(e);
        assert_eq!(s.extra.as_deref(), Some("  { \"b\":2}  "));
    }

    use proptest::prelude::*;

    /// A JSON object of random members (the moved keys likely, repeats
    /// possible) with random whitespace around every token.
    fn any_object() -> impl Strategy<Value = String> {
        let key = prop_oneof![
            Just(KEY_ORDER.to_owned()),
            Just("raw_request".to_owned()),
            Just("raw_response".to_owned()),
            Just("token_counts".to_owned()),
            "[a-zé]{0,3}",
        ];
        let value = prop_oneof![
            Just("null".to_owned()),
            Just(r#"{"a":[1,{"raw_request":2}]}"#.to_owned()),
            Just("\"x,}{\"".to_owned()),
            Just("[ ]".to_owned()),
            (-5i32..5).prop_map(|n| n.to_string()),
        ];
        let ws = prop_oneof![4 => Just(""), 1 => Just(" "), 1 => Just("\n  ")];
        prop::collection::vec((key, value, ws.clone(), ws.clone(), ws.clone()), 0..6).prop_flat_map(move |members| {
            ws.clone().prop_map(move |end| {
                let mut out = String::from("{");
                for (i, (k, v, a, b, c)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(a);
                    out.push_str(&json_string(k));
                    out.push_str(b);
                    out.push(':');
                    out.push_str(c);
                    out.push_str(v);
                }
                out.push_str(end);
                out.push('}');
                out
            })
        })
    }

    proptest! {
        #[test]
        fn split_then_join_is_the_identity(e in any_object()) {
            let s = round_trip(&e);
            // Whatever was moved is no longer a member of what is left.
            if let Some(left) = s.extra.as_deref() {
                let keys: Vec<String> = members(left).unwrap_or_default().into_iter().map(|(k, _, _)| k).collect();
                for ((_, key), moved) in MOVED.iter().zip(&s.moved) {
                    prop_assert!(moved.is_none() || !keys.iter().any(|k| k == key));
                }
            }
        }
    }

    #[test]
    fn damaged_offsets_are_refused() {
        assert_eq!(join("{}", [None, Some("1"), None], &[]), None);
        assert_eq!(join("{}", [None, Some("1"), None], &[3]), None);
        assert_eq!(join("{}", [None, None, None], &[1]), None);
        assert_eq!(join("{\"é\":1}", [None, Some("1"), None], &[3]), None);
        assert_eq!(join("{}", [None, Some("1"), None], &[1]).as_deref(), Some(r#"{"raw_request":1}"#));
    }
}
