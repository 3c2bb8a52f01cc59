//! Bucket key encoding: `<prefix>` followed by an injective encoding of the
//! domain and the request's entries.
//!
//! Shape: `<prefix>d<len>:<domain>` then, per entry, `|k<len>:<key>` and one of
//! `=v<len>:<value>` (a per-value bucket), `=p<len>:<pattern>` (a wildcard rule
//! with `share_threshold`, one bucket for every value) or `=h<sha256 hex>` (a
//! value longer than [`MAX_VERBATIM_VALUE_BYTES`] bytes, so keys stay short and
//! secrets sent as descriptor values are not stored verbatim).
//!
//! When the entries part is longer than [`MAX_VERBATIM_ENTRIES_BYTES`] (long
//! entry keys, which a request's own `limit` override can bring, or many
//! entries), it is replaced by `#<sha256 hex>` of itself, so no request can
//! make a key longer than the prefix, the domain (from the config) and 65
//! bytes, whatever it sends.
//!
//! Each component is length-prefixed, so the encoding is injective: `key a_b`
//! and `key a, value b` can never share a bucket. `{`, `}` and `%` in client
//! text are percent-escaped before measuring, so no client character can form a
//! Redis Cluster hash tag and move a key to another slot (docs/design.md, "Keys"). The rate
//! is never part of the key: a config change must not reset a bucket (docs/design.md, "Reloads").

use sha2::{Digest, Sha256};

/// Values longer than this many bytes are stored as their SHA-256.
pub const MAX_VERBATIM_VALUE_BYTES: usize = 64;

/// An entries part longer than this many bytes is stored as its SHA-256.
pub const MAX_VERBATIM_ENTRIES_BYTES: usize = 256;

/// The value part of one entry of a bucket identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyValue<'a> {
    /// The request's own value (exact, key-only and wildcard rules).
    Value(&'a str),
    /// A wildcard pattern whose values share one bucket (`share_threshold`).
    Shared(&'a str),
}

fn push_escaped(out: &mut String, tag: char, s: &str) {
    let needs = s.bytes().any(|b| matches!(b, b'{' | b'}' | b'%'));
    if needs {
        let mut esc = String::with_capacity(s.len() + 8);
        for c in s.chars() {
            match c {
                '{' => esc.push_str("%7B"),
                '}' => esc.push_str("%7D"),
                '%' => esc.push_str("%25"),
                c => esc.push(c),
            }
        }
        push_part(out, tag, &esc);
    } else {
        push_part(out, tag, s);
    }
}

/// `{tag}{len}:{s}`, without the formatting machinery (it was the largest
/// part of encoding a key).
fn push_part(out: &mut String, tag: char, s: &str) {
    out.push(tag);
    let mut digits = [0u8; 20];
    let mut n = s.len();
    let mut i = digits.len();
    loop {
        i -= 1;
        // n % 10 < 10: the cast cannot truncate.
        #[allow(clippy::cast_possible_truncation)]
        let d = (n % 10) as u8;
        digits[i] = b'0' + d;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for &d in &digits[i..] {
        out.push(char::from(d));
    }
    out.push(':');
    out.push_str(s);
}

/// Encodes a bucket key. `entries` are the request's entries, in order.
#[must_use]
pub fn encode(prefix: &str, domain: &str, entries: &[(&str, KeyValue<'_>)]) -> String {
    let mut out = String::with_capacity(
        prefix.len() + domain.len() + 8 + entries.iter().map(|(k, _)| k.len() + 24).sum::<usize>(),
    );
    out.push_str(prefix);
    push_escaped(&mut out, 'd', domain);
    let start = out.len();
    for (k, v) in entries {
        out.push('|');
        push_escaped(&mut out, 'k', k);
        out.push('=');
        match v {
            KeyValue::Value(v) if v.len() > MAX_VERBATIM_VALUE_BYTES => {
                out.push('h');
                out.push_str(&hex::encode(Sha256::digest(v.as_bytes())));
            }
            KeyValue::Value(v) => push_escaped(&mut out, 'v', v),
            KeyValue::Shared(p) => push_escaped(&mut out, 'p', p),
        }
    }
    if out.len() - start > MAX_VERBATIM_ENTRIES_BYTES {
        // Verbatim entries always start with `|`, so `#` cannot collide.
        let digest = hex::encode(Sha256::digest(&out.as_bytes()[start..]));
        out.truncate(start);
        out.push('#');
        out.push_str(&digest);
    }
    out
}

/// What a reservation rule's bucket key carries in place of the id
/// entry's value (docs/design.md, "Reservations"): a shared pattern no
/// wildcard rule writes, so every id of the entries above lands in one
/// bucket, apart from the bucket of any rule on those entries alone.
pub const RESERVATION_VALUE: &str = "*reservation*";

/// The bucket key of a reservation rule for the entries above its id entry
/// and the id entry's key `id_key`.
#[must_use]
pub fn reservation_bucket(
    prefix: &str,
    domain: &str,
    above: &[(&str, KeyValue<'_>)],
    id_key: &str,
) -> String {
    let mut entries = above.to_vec();
    entries.push((id_key, KeyValue::Shared(RESERVATION_VALUE)));
    encode(prefix, domain, &entries)
}

/// The Redis key of the open reservations of the bucket under
/// `bucket_key`, in the same Redis Cluster hash slot: the bucket key with
/// `~r` appended when it has a hash tag of its own (the prefix's), else the
/// bucket key made the hash tag (client text never holds `{` or `}`).
#[must_use]
pub fn book_key(bucket_key: &str) -> String {
    let tagged = bucket_key
        .find('{')
        .is_some_and(|o| bucket_key[o + 1..].find('}').is_some_and(|c| c > 0));
    if tagged {
        format!("{bucket_key}~r")
    } else {
        format!("{{{bucket_key}}}~r")
    }
}

/// The starts of every bucket key a rule's buckets can have, from the
/// rule's levels (top down): the key up to its first level whose value
/// comes from the request (a key-only or per-value wildcard level), that
/// level's key included (`<prefix>d4:edge|k4:user=`); the whole key when
/// every level is fixed. A second start covers the domain's keys whose
/// entries were too long and are stored hashed (`<prefix>d4:edge#`). Keys
/// of the rule's descendants and of its overrides share the first start,
/// so holding by these starts may hold more than the rule's own buckets,
/// never fewer.
#[must_use]
pub fn rule_prefixes(
    prefix: &str,
    domain: &str,
    levels: &[crate::config::MetricLevel],
) -> [String; 2] {
    use crate::config::MetricLevelKind as K;
    let fixed: Vec<(&str, KeyValue<'_>)> = levels
        .iter()
        .map_while(|l| match &l.kind {
            K::Exact(v) => Some((l.key.as_str(), KeyValue::Value(v))),
            K::Wildcard {
                pattern,
                share_threshold: true,
            } => Some((l.key.as_str(), KeyValue::Shared(pattern))),
            K::KeyOnly | K::Wildcard { .. } => None,
        })
        .collect();
    let mut hashed = String::with_capacity(prefix.len() + domain.len() + 8);
    hashed.push_str(prefix);
    push_escaped(&mut hashed, 'd', domain);
    let mut start = encode(prefix, domain, &fixed);
    if start.len() > hashed.len() && start.as_bytes()[hashed.len()] == b'#' {
        // The fixed entries alone are hashed: every key of the rule is too.
        start.truncate(hashed.len());
        start.push('#');
    } else if let Some(open) = levels.get(fixed.len()) {
        start.push('|');
        push_escaped(&mut start, 'k', &open.key);
        start.push('=');
    }
    hashed.push('#');
    [start, hashed]
}

/// Makes `key` (from [`encode`]) the bucket of a per-request `limit`
/// override of `requests_per_unit` per `unit_secs`: appends
/// `!<requests_per_unit>/<unit_secs>`. The encoded entries end in a
/// length-prefixed value or a fixed-length digest, so the suffix cannot be
/// confused with them. Each override rate has its own bucket, apart from the
/// rule's (docs/design.md, "Overrides"): a bucket refilled at another rate
/// than its own would mint tokens.
pub fn push_override_rate(key: &mut String, requests_per_unit: u32, unit_secs: u64) {
    use std::fmt::Write as _;
    let _ = write!(key, "!{requests_per_unit}/{unit_secs}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Long client entry keys (brought by a `limit` override) or many
    /// entries cannot make a key long: past 256 bytes the entries part is
    /// hashed, and different entries still give different keys.
    #[test]
    fn lengths_of_any_number_of_digits_are_written_in_decimal() {
        let v = "x".repeat(64);
        let d = "d".repeat(100);
        let k = encode(
            "p:",
            &d,
            &[("k", KeyValue::Value(&v)), ("", KeyValue::Value(""))],
        );
        assert_eq!(k, format!("p:d100:{d}|k1:k=v64:{v}|k0:=v0:"));
    }

    #[test]
    fn long_entries_are_hashed() {
        let long = |i: u32| format!("{i:06}{}", "k".repeat(1_000_000));
        let (a, b) = (long(1), long(2));
        let ka = encode("rls:", "edge", &[(a.as_str(), KeyValue::Value("v"))]);
        let kb = encode("rls:", "edge", &[(b.as_str(), KeyValue::Value("v"))]);
        assert_eq!(ka.len(), "rls:d4:edge#".len() + 64, "{ka}");
        assert!(ka.starts_with("rls:d4:edge#"));
        assert_ne!(ka, kb);
        let many: Vec<(&str, KeyValue<'_>)> =
            (0..64).map(|_| ("key", KeyValue::Value("value"))).collect();
        assert_eq!(encode("p:", "d", &many).len(), "p:d1:d#".len() + 64);
        // Short entries stay readable.
        let k = encode("rls:", "edge", &[("api_key", KeyValue::Value("abc"))]);
        assert_eq!(k, "rls:d4:edge|k7:api_key=v3:abc");
    }

    #[test]
    fn underscore_does_not_merge_key_and_value() {
        let a = encode("rls:", "d", &[("a_b", KeyValue::Value(""))]);
        let b = encode("rls:", "d", &[("a", KeyValue::Value("b"))]);
        assert_ne!(a, b);
    }

    #[test]
    fn braces_never_form_a_hash_tag() {
        let k = encode("rls:", "d{x}", &[("{k}", KeyValue::Value("}{v}"))]);
        assert!(!k.contains('{') && !k.contains('}'), "{k}");
    }

    #[test]
    fn long_values_are_hashed() {
        let v = "s".repeat(65);
        let k = encode("rls:", "d", &[("token", KeyValue::Value(&v))]);
        assert!(!k.contains(&v));
        assert!(k.len() < 120);
        let v64 = "s".repeat(64);
        assert!(encode("rls:", "d", &[("token", KeyValue::Value(&v64))]).contains(&v64));
    }

    #[test]
    fn shared_pattern_differs_from_literal_value() {
        let a = encode("", "d", &[("p", KeyValue::Value("/a/*"))]);
        let b = encode("", "d", &[("p", KeyValue::Shared("/a/*"))]);
        assert_ne!(a, b);
    }

    proptest! {
        #[test]
        fn injective(a in proptest::collection::vec(("[a-z_{}%|=:]{0,4}", "[a-z_{}%|=:]{0,4}"), 0..4),
                     b in proptest::collection::vec(("[a-z_{}%|=:]{0,4}", "[a-z_{}%|=:]{0,4}"), 0..4),
                     da in "[a-z_{}]{0,3}", db in "[a-z_{}]{0,3}") {
            let ea: Vec<_> = a.iter().map(|(k, v)| (k.as_str(), KeyValue::Value(v.as_str()))).collect();
            let eb: Vec<_> = b.iter().map(|(k, v)| (k.as_str(), KeyValue::Value(v.as_str()))).collect();
            let same = da == db && a == b;
            prop_assert_eq!(encode("rls:", &da, &ea) == encode("rls:", &db, &eb), same);
        }
    }
}
