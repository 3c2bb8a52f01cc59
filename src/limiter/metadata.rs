//! The response's dynamic metadata (`--response-dynamic-metadata`), with the
//! Go reference service's shape (its `ratelimitToMetadata`), so Envoy configs
//! that read it with `%DYNAMIC_METADATA(envoy.filters.http.ratelimit:...)%`
//! work unchanged:
//!
//! ```text
//! { "domain": "rl",
//!   "descriptors": [ { "entries": ["service=service_1"],
//!                      "limit": "requests_per_unit:5 unit:MINUTE",   (with an override)
//!                      "hitsAddend": 0 } ],                          (when set)
//!   "hitsAddend": 2,                                                 (when not 0)
//!   "metadata": { ... } }                                            (when any)
//! ```
//!
//! `metadata` merges the config `metadata` of every descriptor whose rule is
//! not over its limit, in request order: the first value of a key wins, and
//! nested mappings are merged key by key.

use super::request::Request;
use crate::config::Metadata;
use serde_json::Value;

/// The dynamic metadata of `req`, merging `passed` (the metadata of the
/// rules not over their limit, in request order).
#[must_use]
pub fn response_metadata<'a>(
    req: &Request<'_>,
    passed: impl IntoIterator<Item = &'a Metadata>,
) -> Metadata {
    let mut out = Metadata::new();
    out.insert("domain".into(), Value::String(req.domain.to_owned()));
    let descriptors = req
        .descriptors
        .iter()
        .map(|d| {
            let mut m = Metadata::new();
            m.insert(
                "entries".into(),
                Value::Array(
                    d.entries
                        .iter()
                        .map(|(k, v)| Value::String(format!("{k}={v}")))
                        .collect(),
                ),
            );
            if let Some(o) = &d.limit {
                let unit = o.unit.as_ref().map_or("UNKNOWN", |u| u.proto_name());
                m.insert(
                    "limit".into(),
                    Value::String(format!(
                        "requests_per_unit:{} unit:{unit}",
                        o.requests_per_unit
                    )),
                );
            }
            if let Some(h) = d.hits_addend {
                m.insert("hitsAddend".into(), Value::from(h));
            }
            Value::Object(m)
        })
        .collect();
    out.insert("descriptors".into(), Value::Array(descriptors));
    if req.hits_addend != 0 {
        out.insert("hitsAddend".into(), Value::from(req.hits_addend));
    }
    let mut merged = Metadata::new();
    for m in passed {
        merge(&mut merged, m);
    }
    if !merged.is_empty() {
        out.insert("metadata".into(), Value::Object(merged));
    }
    out
}

/// Adds `src` to `dest`: keys `dest` lacks are added; where both hold a
/// mapping the two are merged; otherwise `dest`'s value stays.
fn merge(dest: &mut Metadata, src: &Metadata) {
    for (k, v) in src {
        match (dest.get_mut(k), v) {
            (Some(Value::Object(d)), Value::Object(s)) => merge(d, s),
            (Some(_), _) => {}
            (None, _) => {
                dest.insert(k.clone(), v.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Unit;
    use crate::limiter::{Descriptor, Override};
    use serde_json::json;

    fn map(v: Value) -> Metadata {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn the_shape_follows_the_go_service() {
        let mut d = Descriptor::new(vec![("service", "s1"), ("path", "/x")]);
        d.limit = Some(Override {
            requests_per_unit: 5,
            unit: Ok(Unit::Minute),
        });
        d.hits_addend = Some(0);
        let req = Request {
            domain: "rl",
            descriptors: vec![d, Descriptor::new(vec![("k", "v")])],
            hits_addend: 2,
        };
        let out = response_metadata(&req, []);
        assert_eq!(
            Value::Object(out),
            json!({
                "domain": "rl",
                "descriptors": [
                    {"entries": ["service=s1", "path=/x"],
                     "limit": "requests_per_unit:5 unit:MINUTE", "hitsAddend": 0},
                    {"entries": ["k=v"]}
                ],
                "hitsAddend": 2
            })
        );
    }

    #[test]
    fn metadata_merges_first_value_wins_and_nested_maps_merge() {
        let a = map(json!({"name": "a", "nested": {"x": 1}, "list": [1]}));
        let b = map(json!({"name": "b", "nested": {"x": 2, "y": 3}, "extra": true}));
        let req = Request {
            domain: "d",
            descriptors: vec![],
            hits_addend: 0,
        };
        let out = response_metadata(&req, [&a, &b]);
        assert_eq!(
            out["metadata"],
            json!({"name": "a", "nested": {"x": 1, "y": 3}, "list": [1], "extra": true})
        );
        assert!(!out.contains_key("hitsAddend"));
    }
}
