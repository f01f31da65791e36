//! JSON objects whose key order and values are kept verbatim.
//!
//! The gateway never round-trips an agent's or an upstream's JSON through a
//! value tree: an object is read as its keys in order, each with the verbatim
//! text of its value ([`Obj`]), edited in place, and written back. So the
//! forwarded request keeps the client's key order (rLLM's `raw_request` order,
//! contract §2.1) and numbers keep their exact decimal text (token ids and
//! logprobs reach the store as the upstream printed them).

use serde::de::{Deserialize, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::value::RawValue;
use std::fmt;

/// A JSON object: keys in document order, values as verbatim JSON text.
#[derive(Debug, Clone, Default)]
pub struct Obj(pub Vec<(String, Box<RawValue>)>);

/// Reads an object's members (a repeated key: the last one wins, as in
/// Python's json).
struct ObjVisitor;

impl<'de> Visitor<'de> for ObjVisitor {
    type Value = Obj;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Obj, A::Error> {
        let mut out = Vec::with_capacity(map.size_hint().unwrap_or(0));
        while let Some((k, v)) = map.next_entry::<String, Box<RawValue>>()? {
            if let Some(slot) = out.iter_mut().find(|(ok, _): &&mut (String, Box<RawValue>)| *ok == k) {
                slot.1 = v;
            } else {
                out.push((k, v));
            }
        }
        Ok(Obj(out))
    }
}

impl<'de> Deserialize<'de> for Obj {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(ObjVisitor)
    }
}

/// A list's items each read as an object in one pass over the list: None
/// when the value is not a list, an item None when it is not an object.
pub fn objects(v: &RawValue) -> Option<Vec<Option<Obj>>> {
    let mut de = serde_json::Deserializer::from_str(v.get());
    let found = ObjectsSeed.deserialize(&mut de).ok()?;
    de.end().ok()?;
    found
}

/// Any value, read as [`objects`] reads it: a list's items as objects (an
/// item None when it is not one); None, the value consumed, when it is not
/// a list.
pub struct ObjectsSeed;

/// The scalar visits of a visitor whose value is an `Option`: a scalar
/// (bool, number, string, null) gives None.
macro_rules! scalars_are_none {
    () => {
        fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    };
}

struct Item;
impl<'de> Visitor<'de> for Item {
    type Value = Option<Obj>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        ObjVisitor.visit_map(map).map(Some)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(None)
    }
    scalars_are_none!();
}
impl<'de> DeserializeSeed<'de> for Item {
    type Value = Option<Obj>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ObjectsSeed {
    type Value = Option<Vec<Option<Obj>>>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element_seed(Item)? {
            out.push(item);
        }
        Ok(Some(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(None)
    }
    scalars_are_none!();
}
impl<'de> DeserializeSeed<'de> for ObjectsSeed {
    type Value = Option<Vec<Option<Obj>>>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

/// An object with the objects of its list member `key` read in the same
/// pass ([`Obj::parse_with_objects`]); `rebuilt`: every item of that list
/// was an object, and the member holds their texts as [`Obj::to_raw`]
/// writes them (not yet compared with the source).
struct WithObjects<'k> {
    key: &'k str,
}

struct WithObjectsOut {
    obj: Obj,
    items: Option<Vec<Option<Obj>>>,
    /// `key` was there.
    seen: bool,
    rebuilt: bool,
}

impl<'de> Visitor<'de> for WithObjects<'_> {
    type Value = WithObjectsOut;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = WithObjectsOut { obj: Obj::default(), items: None, seen: false, rebuilt: false };
        while let Some(k) = map.next_key::<String>()? {
            let v = if k == self.key {
                let items = map.next_value_seed(ObjectsSeed)?;
                // A repeated key: the text is not what one member writes, so
                // the caller reads the object again.
                out.rebuilt = !out.seen && items.as_ref().is_some_and(|l| l.iter().all(Option::is_some));
                out.seen = true;
                let written: Vec<Box<RawValue>> = items.iter().flatten().flatten().map(Obj::to_raw).collect();
                out.items = items;
                raw_list(&written)
            } else {
                map.next_value::<Box<RawValue>>()?
            };
            out.obj.set(&k, v);
        }
        Ok(out)
    }
}

/// Written as [`Obj::to_json`] writes it (values verbatim), so that
/// [`Obj::to_raw`] is that text as a [`RawValue`] without parsing it again.
impl Serialize for Obj {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

impl Obj {
    /// [`Obj::to_json`] as a [`RawValue`]: its members are raw values, so
    /// the text is valid JSON as written and is not parsed again
    /// (`serde_json::value::to_raw_value` does not re-check).
    pub fn to_raw(&self) -> Box<RawValue> {
        serde_json::value::to_raw_value(self).unwrap_or_else(|_| raw(self.to_json()))
    }

    /// Parse `text` as an object; None when it is not a JSON object.
    pub fn parse(text: &str) -> Option<Obj> {
        serde_json::from_str(text).ok()
    }

    /// [`Obj::parse`] and [`objects`] of its member `key` in one pass over
    /// `text`. When `key` is there, only if `text` (without the whitespace
    /// around it) is exactly what writing that object gives ([`Obj::to_raw`]:
    /// compact JSON without repeated keys, what vLLM writes), since the
    /// member is written again from its items; that text is then returned
    /// as a raw value too. None otherwise (read it the two-pass way, which
    /// keeps every value's text as it came).
    #[allow(clippy::type_complexity, reason = "the three results of one pass, named in the doc")]
    pub fn parse_with_objects(text: &str, key: &str) -> Option<(Obj, Option<Vec<Option<Obj>>>, Option<Box<RawValue>>)> {
        let mut de = serde_json::Deserializer::from_str(text);
        let found = de.deserialize_map(WithObjects { key }).ok()?;
        de.end().ok()?;
        if !found.seen {
            return Some((found.obj, None, None));
        }
        if !found.rebuilt {
            return None;
        }
        let written = found.obj.to_raw();
        (written.get() == text.trim_matches([' ', '\t', '\n', '\r'])).then_some((found.obj, found.items, Some(written)))
    }

    /// Parse bytes as an object; None when not UTF-8 JSON object.
    pub fn parse_bytes(bytes: &[u8]) -> Option<Obj> {
        serde_json::from_slice(bytes).ok()
    }

    /// The value of `key`, None when absent.
    pub fn get(&self, key: &str) -> Option<&RawValue> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| &**v)
    }

    /// The value of `key` unless absent or `null`.
    pub fn get_some(&self, key: &str) -> Option<&RawValue> {
        self.get(key).filter(|v| v.get() != "null")
    }

    pub fn contains(&self, key: &str) -> bool {
        self.0.iter().any(|(k, _)| k == key)
    }

    /// Set `key` to verbatim JSON `value`: in place when present, appended otherwise.
    pub fn set(&mut self, key: &str, value: Box<RawValue>) {
        match self.0.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.0.push((key.to_owned(), value)),
        }
    }

    /// Remove `key`; whether it was there.
    pub fn remove(&mut self, key: &str) -> bool {
        let before = self.0.len();
        self.0.retain(|(k, _)| k != key);
        self.0.len() != before
    }

    /// Compact JSON text (values verbatim).
    pub fn to_json(&self) -> String {
        let mut out = String::from("{");
        for (i, (k, v)) in self.0.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&string(k));
            out.push(':');
            out.push_str(v.get());
        }
        out.push('}');
        out
    }
}

/// `s` as a JSON string literal.
pub fn string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_owned())
}

/// Verbatim JSON text as a boxed raw value (for [`Obj::set`]); the text must
/// be valid JSON, which every caller builds itself.
pub fn raw(text: String) -> Box<RawValue> {
    RawValue::from_string(text).unwrap_or_default()
}

/// Whether a JSON value is truthy the way Python's `bool()` sees it
/// (`true`, a non-zero number, a non-empty string, list or object).
pub fn truthy(v: &RawValue) -> bool {
    let t = v.get().trim();
    match t {
        "null" | "false" | "\"\"" | "[]" | "{}" => false,
        _ if t.starts_with('[') => serde_json::from_str::<Vec<&RawValue>>(t).map(|l| !l.is_empty()).unwrap_or(true),
        _ if t.starts_with('{') => Obj::parse(t).map(|o| !o.0.is_empty()).unwrap_or(true),
        _ if t.starts_with(|c: char| c == '-' || c.is_ascii_digit()) => {
            t.parse::<f64>().map(|x| x != 0.0).unwrap_or(true)
        }
        _ => true,
    }
}

/// The items of a JSON list, verbatim; None when `v` is not a list.
pub fn list(v: &RawValue) -> Option<Vec<&RawValue>> {
    serde_json::from_str(v.get()).ok()
}

/// Raw values as one JSON list, written without parsing it again
/// (`to_raw_value` writes each value verbatim and does not re-check).
pub fn raw_list<T: std::ops::Deref<Target = RawValue>>(items: &[T]) -> Box<RawValue> {
    let refs: Vec<&RawValue> = items.iter().map(|v| &**v).collect();
    serde_json::value::to_raw_value(&refs).unwrap_or_else(|_| raw(join_list(refs.iter().map(|v| v.get()))))
}

/// Join verbatim JSON texts into a list.
pub use trajlog::trace_json::join_list;
