//! Raw YAML schema: what a config file says, before validation.
//!
//! Every scalar is read as its literal text (`value: 010` is the string `"010"`,
//! docs/design.md, "Configuration files") with its source location. Mappings are read key by key so that
//! every unknown, unsupported or misplaced key is *recorded* (with its line)
//! rather than stopping the parse at the first one; [`super::compile`] turns the
//! records into errors that name the file, line and descriptor path.
//!
//! Line positions are optional: a tree parsed from YAML has them, a tree
//! built from another representation (an xDS push) has none, and its errors
//! then name the resource and the descriptor path only.

use serde::Deserialize;
use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_saphyr::{Location, Spanned};
use std::fmt;

/// A scalar's literal text and the line it was written on (1-based; `None`
/// for a tree not parsed from YAML).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Text {
    /// The literal text.
    pub value: String,
    /// Its line, when it has one.
    pub line: Option<u32>,
    /// Byte offset in the file where the scalar starts (where an anchor
    /// defines it, for an alias), when known: the compiler reads the byte
    /// there to tell a quoted scalar (a string to the Go service) from a
    /// plain one.
    pub offset: Option<usize>,
}

impl Text {
    /// Text without a line (a tree built from another representation).
    #[must_use]
    pub fn new(value: impl Into<String>) -> Self {
        Self {
            value: value.into(),
            line: None,
            offset: None,
        }
    }
}

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = Spanned::<String>::deserialize(d)?;
        Ok(Self {
            line: Some(line_of(&s.referenced)),
            offset: s
                .defined
                .span()
                .byte_offset()
                .and_then(|o| usize::try_from(o).ok()),
            value: s.value,
        })
    }
}

/// A key that the schema does not accept at the level where it appeared.
#[derive(Debug, Clone)]
pub struct StrayKey {
    /// The key as written.
    pub name: String,
    /// Line of the key, 1-based, when known.
    pub line: Option<u32>,
}

/// A whole file: `domain` and `descriptors`.
#[derive(Debug, Default)]
pub struct RawFile {
    /// `domain:` text.
    pub domain: Option<Text>,
    /// `descriptors:` list.
    pub descriptors: Option<Vec<RawDescriptor>>,
    /// Keys that do not belong at the top level.
    pub stray: Vec<StrayKey>,
}

/// One node of the descriptor tree.
#[derive(Debug, Default)]
pub struct RawDescriptor {
    /// Line where the node starts, 1-based, when known.
    pub line: Option<u32>,
    /// `key:`
    pub key: Option<Text>,
    /// `value:`
    pub value: Option<Text>,
    /// A `value:` written as null (`~`, `null` or nothing), with its line
    /// when known, which is an error: it would silently turn an exact rule
    /// into a key-only one.
    pub null_value: Option<Option<u32>>,
    /// `rate_limit:` (boxed: descriptors nest, and a block held inline in
    /// every level's frame would make a file nested to the parser's depth
    /// limit overflow a 2 MiB stack in debug builds).
    pub rate_limit: Option<Box<RawRateLimit>>,
    /// `replaces:` written at descriptor level (also accepted inside `rate_limit`).
    pub replaces: Option<Vec<RawReplace>>,
    /// `shadow_mode:`
    pub shadow_mode: Option<Text>,
    /// `detailed_metric:`
    pub detailed_metric: Option<Text>,
    /// `share_threshold:`
    pub share_threshold: Option<Text>,
    /// `quota_mode:`
    pub quota_mode: Option<Text>,
    /// `value_to_metric:`
    pub value_to_metric: Option<Text>,
    /// `metadata:` with the line of its key (when known): any YAML value,
    /// typed (numbers, booleans, strings, lists, mappings); only a mapping
    /// is valid.
    pub metadata: Option<(Option<u32>, serde_json::Value)>,
    /// `descriptors:`
    pub descriptors: Option<Vec<RawDescriptor>>,
    /// `reservation:` (boxed, as `rate_limit`).
    pub reservation: Option<Box<RawReservation>>,
    /// Keys that do not belong on a descriptor.
    pub stray: Vec<StrayKey>,
}

/// A `rate_limit:` block.
#[derive(Debug, Default)]
pub struct RawRateLimit {
    /// Line where the block starts, 1-based, when known.
    pub line: Option<u32>,
    /// `unit:`
    pub unit: Option<Text>,
    /// `requests_per_unit:`
    pub requests_per_unit: Option<Text>,
    /// `burst:`
    pub burst: Option<Text>,
    /// `max_debt:`
    pub max_debt: Option<Text>,
    /// `algorithm:` (`token_bucket`, `fixed_window`, `sliding_window`).
    pub algorithm: Option<Text>,
    /// `name:`
    pub name: Option<Text>,
    /// `unlimited:`
    pub unlimited: Option<Text>,
    /// `replaces:`
    pub replaces: Option<Vec<RawReplace>>,
    /// Keys that do not belong in `rate_limit`.
    pub stray: Vec<StrayKey>,
}

/// A `reservation:` block (docs/design.md, "Reservations").
#[derive(Debug, Default)]
pub struct RawReservation {
    /// Line where the block starts, 1-based, when known.
    pub line: Option<u32>,
    /// `ttl_seconds:`
    pub ttl_seconds: Option<Text>,
    /// `max_open:`
    pub max_open: Option<Text>,
    /// Keys that do not belong in `reservation`.
    pub stray: Vec<StrayKey>,
}

/// One `replaces:` entry, `{name: ...}`.
#[derive(Debug, Default)]
pub struct RawReplace {
    /// Line of the entry, 1-based, when known.
    pub line: Option<u32>,
    /// `name:`
    pub name: Option<Text>,
    /// Keys other than `name`.
    pub stray: Vec<StrayKey>,
}

fn line_of(loc: &Location) -> u32 {
    u32::try_from(loc.line()).unwrap_or(u32::MAX)
}

macro_rules! map_visitor {
    ($ty:ident, $expect:literal, |$out:ident, $key:ident, $map:ident| $body:block) => {
        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl<'de> Visitor<'de> for V {
                    type Value = $ty;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str($expect)
                    }
                    fn visit_map<A: MapAccess<'de>>(self, mut $map: A) -> Result<$ty, A::Error> {
                        let mut $out = $ty::default();
                        while let Some($key) = $map.next_key::<Spanned<String>>()? {
                            if $out.line_unset() {
                                $out.set_line(line_of(&$key.referenced));
                            }
                            $body
                        }
                        Ok($out)
                    }
                }
                d.deserialize_map(V)
            }
        }
    };
}

trait LineSlot {
    fn line_unset(&self) -> bool;
    fn set_line(&mut self, line: u32);
}

impl LineSlot for RawFile {
    fn line_unset(&self) -> bool {
        false
    }
    fn set_line(&mut self, _: u32) {}
}

macro_rules! line_slot {
    ($($t:ident),*) => {$(
        impl LineSlot for $t {
            fn line_unset(&self) -> bool { self.line.is_none() }
            fn set_line(&mut self, line: u32) { self.line = Some(line); }
        }
    )*};
}
line_slot!(RawDescriptor, RawRateLimit, RawReservation, RawReplace);

fn stray<'de, A: MapAccess<'de>>(
    map: &mut A,
    key: &Spanned<String>,
    out: &mut Vec<StrayKey>,
) -> Result<(), A::Error> {
    map.next_value::<IgnoredAny>()?;
    out.push(StrayKey {
        name: key.value.clone(),
        line: Some(line_of(&key.referenced)),
    });
    Ok(())
}

map_visitor!(
    RawFile,
    "a mapping with `domain` and `descriptors`",
    |out, key, map| {
        match key.value.as_str() {
            "domain" => out.domain = map.next_value()?,
            "descriptors" => {
                out.descriptors = map
                    .next_value::<Option<SeqOf<RawDescriptor>>>()?
                    .map(|s| s.0)
            }
            _ => stray(&mut map, &key, &mut out.stray)?,
        }
    }
);

map_visitor!(
    RawDescriptor,
    "a descriptor mapping (`key`, `value`, `rate_limit`, ...)",
    |out, key, map| {
        match key.value.as_str() {
            "key" => out.key = map.next_value()?,
            "value" => {
                out.value = map.next_value()?;
                if out.value.is_none() {
                    out.null_value = Some(Some(line_of(&key.referenced)));
                }
            }
            "rate_limit" => out.rate_limit = map.next_value()?,
            "reservation" => out.reservation = map.next_value()?,
            "replaces" => {
                out.replaces = map.next_value::<Option<SeqOf<RawReplace>>>()?.map(|s| s.0)
            }
            "shadow_mode" => out.shadow_mode = map.next_value()?,
            "detailed_metric" => out.detailed_metric = map.next_value()?,
            "share_threshold" => out.share_threshold = map.next_value()?,
            "quota_mode" => out.quota_mode = map.next_value()?,
            "value_to_metric" => out.value_to_metric = map.next_value()?,
            "metadata" => {
                out.metadata = Some((Some(line_of(&key.referenced)), map.next_value()?));
            }
            "descriptors" => {
                out.descriptors = map
                    .next_value::<Option<SeqOf<RawDescriptor>>>()?
                    .map(|s| s.0)
            }
            _ => stray(&mut map, &key, &mut out.stray)?,
        }
    }
);

map_visitor!(
    RawRateLimit,
    "a rate_limit mapping (`unit`, `requests_per_unit`, ...)",
    |out, key, map| {
        match key.value.as_str() {
            "unit" => out.unit = map.next_value()?,
            "requests_per_unit" => out.requests_per_unit = map.next_value()?,
            "burst" => out.burst = map.next_value()?,
            "max_debt" => out.max_debt = map.next_value()?,
            "algorithm" => out.algorithm = map.next_value()?,
            "name" => out.name = map.next_value()?,
            "unlimited" => out.unlimited = map.next_value()?,
            "replaces" => {
                out.replaces = map.next_value::<Option<SeqOf<RawReplace>>>()?.map(|s| s.0)
            }
            _ => stray(&mut map, &key, &mut out.stray)?,
        }
    }
);

map_visitor!(
    RawReservation,
    "a reservation mapping (`ttl_seconds`, `max_open`)",
    |out, key, map| {
        match key.value.as_str() {
            "ttl_seconds" => out.ttl_seconds = map.next_value()?,
            "max_open" => out.max_open = map.next_value()?,
            _ => stray(&mut map, &key, &mut out.stray)?,
        }
    }
);

map_visitor!(
    RawReplace,
    "a replaces entry `{name: ...}`",
    |out, key, map| {
        match key.value.as_str() {
            "name" => out.name = map.next_value()?,
            _ => stray(&mut map, &key, &mut out.stray)?,
        }
    }
);

/// A sequence (an explicit `null` is read as absent by the `Option` around it).
struct SeqOf<T>(Vec<T>);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for SeqOf<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = SeqOf<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<SeqOf<T>, A::Error> {
                let mut v = Vec::new();
                while let Some(x) = seq.next_element()? {
                    v.push(x);
                }
                Ok(SeqOf(v))
            }
        }
        d.deserialize_seq(V(std::marker::PhantomData))
    }
}

/// Most YAML nodes one config file may have: room for about a million rules,
/// while still bounding what a runaway file can make the loader allocate.
pub const MAX_NODES: usize = 10_000_000;

/// Parses one file's text. `Ok(None)` for an empty document. Nesting is
/// limited to serde-saphyr's default depth (64 levels), so a hostile file is an
/// error, never a stack overflow.
///
/// # Errors
/// The YAML syntax or shape error, with its location, or a breached budget.
pub fn parse(text: &str) -> Result<Option<RawFile>, serde_saphyr::Error> {
    let options = serde_saphyr::options! {
        budget: serde_saphyr::budget! { max_nodes: MAX_NODES, max_events: 4 * MAX_NODES },
    };
    serde_saphyr::from_str_with_options::<Option<RawFile>>(text, options)
}
