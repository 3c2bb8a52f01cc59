//! The `/json` edge: the protobuf JSON mapping of `RateLimitRequest` and
//! `RateLimitResponse`, by hand (`envoy-types` has no serde support), straight
//! to and from the decision core's [`Request`] and [`Decision`].
//!
//! Requests follow the proto3 JSON rules a client library would produce:
//! lowerCamelCase field names, with the original snake_case names accepted
//! too; 64-bit integers (`hitsAddend` of a descriptor, a `UInt64Value`) as a
//! number or a decimal string; enums (`limit.unit`) by name (any case) or
//! number; `null` meaning "not set". Unknown fields are rejected, so a typo
//! (`hits_added`) is a 400 and not a silent default.
//!
//! Responses use lowerCamelCase names, enum names (`"OK"`, `"OVER_LIMIT"`,
//! `"MINUTE"`) and durations as `"<seconds>s"` strings. `limitRemaining` is
//! always present (also when 0) so callers need not know proto3's default
//! elision; unset messages (`currentLimit`, `durationUntilReset`) are omitted.

use crate::config::Unit;
use crate::limiter::{
    Code, CurrentLimit, Decision, Descriptor, DescriptorStatus, Override, Request,
};
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::time::Duration;

/// `RateLimitRequest` in protobuf JSON.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonRequest {
    /// The domain.
    #[serde(default, deserialize_with = "string_or_null")]
    pub domain: String,
    /// The descriptors, in order.
    #[serde(default, deserialize_with = "vec_or_null")]
    pub descriptors: Vec<JsonDescriptor>,
    /// Request-wide cost (0 or absent = 1).
    #[serde(
        default,
        rename = "hitsAddend",
        alias = "hits_addend",
        deserialize_with = "uint32"
    )]
    pub hits_addend: u32,
}

/// `RateLimitDescriptor` in protobuf JSON.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonDescriptor {
    /// `(key, value)` entries.
    #[serde(default, deserialize_with = "vec_or_null")]
    pub entries: Vec<JsonEntry>,
    /// Per-request limit override.
    #[serde(default)]
    pub limit: Option<JsonOverride>,
    /// This descriptor's own cost (even 0, a check that consumes nothing).
    #[serde(
        default,
        rename = "hitsAddend",
        alias = "hits_addend",
        deserialize_with = "opt_uint64"
    )]
    pub hits_addend: Option<u64>,
    /// Give `hits_addend` back to the bucket instead of taking it.
    #[serde(
        default,
        rename = "isNegativeHits",
        alias = "is_negative_hits",
        deserialize_with = "bool_or_null"
    )]
    pub is_negative_hits: bool,
}

/// One descriptor entry.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonEntry {
    /// Entry key.
    #[serde(default, deserialize_with = "string_or_null")]
    pub key: String,
    /// Entry value.
    #[serde(default, deserialize_with = "string_or_null")]
    pub value: String,
}

/// `RateLimitOverride` in protobuf JSON.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonOverride {
    /// Tokens per unit.
    #[serde(
        default,
        rename = "requestsPerUnit",
        alias = "requests_per_unit",
        deserialize_with = "uint32"
    )]
    pub requests_per_unit: u32,
    /// `SECOND` ... `YEAR` (a name in any case, or the enum number);
    /// `None` for `UNKNOWN` (0) or absent, which the core refuses.
    #[serde(default, deserialize_with = "unit")]
    pub unit: Option<Unit>,
}

impl JsonRequest {
    /// Parses a request body.
    ///
    /// # Errors
    /// A message naming what was wrong and where (line and column).
    pub fn parse(body: &[u8]) -> Result<Self, String> {
        // serde would also read a JSON array positionally; protobuf JSON has
        // only objects, and an array's errors would name the wrong field.
        match body.iter().find(|b| !b.is_ascii_whitespace()) {
            Some(b'{') => {}
            _ => {
                return Err(
                    "invalid RateLimitRequest JSON: expected a JSON object such as {\"domain\": ..., \"descriptors\": [...]}"
                        .into(),
                );
            }
        }
        serde_json::from_slice(body).map_err(|e| format!("invalid RateLimitRequest JSON: {e}"))
    }

    /// The decision-core view of this request (strings borrowed from it).
    #[must_use]
    pub fn to_request(&self) -> Request<'_> {
        Request {
            domain: &self.domain,
            hits_addend: self.hits_addend,
            descriptors: self
                .descriptors
                .iter()
                .map(|d| Descriptor {
                    entries: d
                        .entries
                        .iter()
                        .map(|e| (e.key.as_str(), e.value.as_str()))
                        .collect(),
                    limit: d.limit.as_ref().map(|l| Override {
                        requests_per_unit: l.requests_per_unit,
                        unit: l.unit.ok_or_else(|| "UNKNOWN".to_owned()),
                    }),
                    hits_addend: d.hits_addend,
                    is_negative_hits: d.is_negative_hits,
                })
                .collect(),
        }
    }
}

/// `RateLimitResponse` in protobuf JSON.
#[derive(Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct JsonResponse {
    /// `"OK"` or `"OVER_LIMIT"`.
    pub overall_code: &'static str,
    /// One status per request descriptor, in order.
    pub statuses: Vec<JsonStatus>,
    /// Headers for the client response (`retry-after` when over limit).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub response_headers_to_add: Vec<JsonHeader>,
    /// With `--response-dynamic-metadata`: the `Struct` as a JSON object.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dynamic_metadata: Option<crate::config::Metadata>,
}

/// `DescriptorStatus` in protobuf JSON.
#[derive(Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct JsonStatus {
    /// `"OK"` or `"OVER_LIMIT"`.
    pub code: &'static str,
    /// The rule's limit; absent for "no limit" and `unlimited`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub current_limit: Option<JsonLimit>,
    /// Whole tokens left (always present).
    pub limit_remaining: u32,
    /// `"<seconds>s"`: until the bucket is full again, or until the cost is
    /// available when over limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_until_reset: Option<String>,
}

/// `RateLimit` (the current limit) in protobuf JSON.
#[derive(Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct JsonLimit {
    /// `rate_limit.name` of the rule, when it has one.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// Tokens per unit.
    pub requests_per_unit: u32,
    /// `"SECOND"` ... `"YEAR"`.
    pub unit: &'static str,
}

/// `HeaderValue` in protobuf JSON.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct JsonHeader {
    /// Header name.
    pub key: String,
    /// Header value.
    pub value: String,
}

impl JsonResponse {
    /// The JSON form of a decision.
    #[must_use]
    pub fn from_decision(d: &Decision) -> Self {
        Self {
            overall_code: code_name(d.overall_code),
            statuses: d.statuses.iter().map(status).collect(),
            response_headers_to_add: d
                .response_headers_to_add
                .iter()
                .map(|h| JsonHeader {
                    key: h.key.to_string(),
                    value: h.value.clone(),
                })
                .collect(),
            dynamic_metadata: d.dynamic_metadata.clone(),
        }
    }

    /// Whether the overall code is `OVER_LIMIT`.
    #[must_use]
    pub fn is_over_limit(&self) -> bool {
        self.overall_code == "OVER_LIMIT"
    }
}

const fn code_name(c: Code) -> &'static str {
    match c {
        Code::Ok => "OK",
        Code::OverLimit => "OVER_LIMIT",
    }
}

fn status(s: &DescriptorStatus) -> JsonStatus {
    JsonStatus {
        code: code_name(s.code),
        current_limit: s.current_limit.as_ref().map(limit),
        limit_remaining: s.limit_remaining,
        duration_until_reset: s.duration_until_reset.as_ref().map(duration),
    }
}

fn limit(l: &CurrentLimit) -> JsonLimit {
    JsonLimit {
        name: l.name.clone(),
        requests_per_unit: l.requests_per_unit,
        unit: l.unit.proto_name(),
    }
}

/// A duration as proto3 JSON (`google.protobuf.Duration`): `"3s"`, `"1.500s"`.
#[must_use]
pub fn duration(d: &Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else {
        let frac = format!("{:09}", d.subsec_nanos());
        let frac = if frac.ends_with("000000") {
            &frac[..3]
        } else if frac.ends_with("000") {
            &frac[..6]
        } else {
            &frac[..]
        };
        format!("{}.{frac}s", d.as_secs())
    }
}

fn string_or_null<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

fn bool_or_null<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or_default())
}

fn vec_or_null<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Vec<T>, D::Error> {
    Ok(Option::<Vec<T>>::deserialize(d)?.unwrap_or_default())
}

/// Accepts a non-negative integer as a JSON number (integral) or decimal
/// string, or `null`, as proto3 JSON does for integer fields.
struct UintVisitor {
    max: u64,
    what: &'static str,
}

impl<'de> Visitor<'de> for UintVisitor {
    type Value = Option<u64>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: an integer from 0 to {} (a number or a decimal string)",
            self.what, self.max
        )
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        if v > self.max {
            return Err(E::invalid_value(de::Unexpected::Unsigned(v), &self));
        }
        Ok(Some(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        match u64::try_from(v) {
            Ok(u) => self.visit_u64(u),
            Err(_) => Err(E::invalid_value(de::Unexpected::Signed(v), &self)),
        }
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        // 1e3 is a valid proto3 JSON integer; 1.5 is not.
        if v.fract() == 0.0 && v >= 0.0 && v <= self.max as f64 && v < u64::MAX as f64 {
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            return Ok(Some(v as u64));
        }
        Err(E::invalid_value(de::Unexpected::Float(v), &self))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        match v.parse::<u64>() {
            Ok(u) => self.visit_u64(u),
            Err(_) => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
        }
    }
}

fn opt_uint64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    d.deserialize_option(UintVisitor {
        max: u64::MAX,
        what: "hitsAddend",
    })
}

fn uint32<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let v = d.deserialize_option(UintVisitor {
        max: u64::from(u32::MAX),
        what: "a uint32 field",
    })?;
    Ok(v.and_then(|v| u32::try_from(v).ok()).unwrap_or(0))
}

/// `envoy.type.v3.RateLimitUnit` values by number: `UNKNOWN` is 0.
const UNITS: [(&str, Option<Unit>); 7] = [
    ("UNKNOWN", None),
    ("SECOND", Some(Unit::Second)),
    ("MINUTE", Some(Unit::Minute)),
    ("HOUR", Some(Unit::Hour)),
    ("DAY", Some(Unit::Day)),
    ("MONTH", Some(Unit::Month)),
    ("YEAR", Some(Unit::Year)),
];

/// `RateLimitUnit` by name (any case) or number, or `null` (`UNKNOWN`).
fn unit<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Unit>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Num(i64),
        Name(String),
    }
    let expected = "limit.unit: one of SECOND, MINUTE, HOUR, DAY, MONTH, YEAR (or its number)";
    match Option::<Raw>::deserialize(d)
        .map_err(|_| de::Error::custom(format!("{expected}: not a string or an integer")))?
    {
        None => Ok(None),
        Some(Raw::Num(n)) => usize::try_from(n)
            .ok()
            .and_then(|n| UNITS.get(n))
            .map(|(_, u)| *u)
            .ok_or_else(|| de::Error::custom(format!("{expected}, got {n}"))),
        Some(Raw::Name(s)) => UNITS
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(&s))
            .map(|(_, u)| *u)
            .ok_or_else(|| de::Error::custom(format!("{expected}, got '{s}'"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn camel_and_snake_case_names_are_accepted() {
        let camel = JsonRequest::parse(
            br#"{"domain":"d","hitsAddend":2,"descriptors":[{"entries":[{"key":"k","value":"v"}],
                "hitsAddend":"18446744073709551615","isNegativeHits":true,
                "limit":{"requestsPerUnit":5,"unit":"minute"}}]}"#,
        )
        .unwrap();
        let snake = JsonRequest::parse(
            br#"{"domain":"d","hits_addend":"2","descriptors":[{"entries":[{"key":"k","value":"v"}],
                "hits_addend":18446744073709551615,"is_negative_hits":true,
                "limit":{"requests_per_unit":"5","unit":2}}]}"#,
        )
        .unwrap();
        let (camel, snake) = (camel.to_request(), snake.to_request());
        assert_eq!(camel, snake);
        assert_eq!(camel.hits_addend, 2);
        let d = &camel.descriptors[0];
        assert_eq!(d.hits_addend, Some(u64::MAX));
        assert!(d.is_negative_hits);
        assert_eq!(d.entries, vec![("k", "v")]);
        assert_eq!(
            d.limit,
            Some(Override {
                requests_per_unit: 5,
                unit: Ok(Unit::Minute)
            })
        );
    }

    #[test]
    fn unknown_and_absent_units_reach_the_core_as_unknown() {
        for body in [
            &br#"{"domain":"d","descriptors":[{"limit":{"requestsPerUnit":1,"unit":"unknown"}}]}"#
                [..],
            br#"{"domain":"d","descriptors":[{"limit":{"requestsPerUnit":1,"unit":0}}]}"#,
            br#"{"domain":"d","descriptors":[{"limit":{"requestsPerUnit":1}}]}"#,
        ] {
            let r = JsonRequest::parse(body).unwrap();
            let unit = r.to_request().descriptors[0].limit.clone().unwrap().unit;
            assert_eq!(unit, Err("UNKNOWN".to_owned()));
        }
        let r = JsonRequest::parse(
            br#"{"domain":"d","descriptors":[{"limit":{"requestsPerUnit":1,"unit":6}}]}"#,
        )
        .unwrap();
        assert_eq!(
            r.to_request().descriptors[0].limit.clone().unwrap().unit,
            Ok(Unit::Year)
        );
    }

    #[test]
    fn explicit_zero_and_null_differ_for_descriptor_hits() {
        let r = JsonRequest::parse(
            br#"{"domain":"d","descriptors":[{"entries":[],"hitsAddend":0},{"hitsAddend":null},{}]}"#,
        )
        .unwrap();
        let r = r.to_request();
        assert_eq!(r.descriptors[0].hits_addend, Some(0));
        assert_eq!(r.descriptors[1].hits_addend, None);
        assert_eq!(r.descriptors[2].hits_addend, None);
    }

    #[test]
    fn errors_name_the_problem() {
        for (body, needle) in [
            (&br#"{"domain":"d","hits":1}"#[..], "unknown field `hits`"),
            (br#"{"domain":"d","descriptors":[{"hitsAddend":-1}]}"#, "hitsAddend"),
            (br#"{"domain":"d","descriptors":[{"hitsAddend":"x"}]}"#, "hitsAddend"),
            (br#"{"domain":"d","descriptors":[{"hitsAddend":1.5}]}"#, "hitsAddend"),
            (br#"{"domain":"d","hitsAddend":4294967296}"#, "uint32"),
            (
                br#"{"domain":"d","descriptors":[{"limit":{"requestsPerUnit":1,"unit":"fortnight"}}]}"#,
                "fortnight",
            ),
            (
                br#"{"domain":"d","descriptors":[{"limit":{"requestsPerUnit":1,"unit":7}}]}"#,
                "got 7",
            ),
            (br#"{"domain":"d","descriptors":[{"entries":[{"key":"k","val":"v"}]}]}"#, "`val`"),
            (br#"{"domain":"#, "EOF"),
        ] {
            let e = JsonRequest::parse(body).unwrap_err();
            assert!(e.contains(needle), "{e:?} should mention {needle:?}");
        }
    }

    #[test]
    fn response_uses_enum_names_and_duration_strings() {
        use crate::limiter::Header;
        let decision = Decision {
            overall_code: Code::OverLimit,
            statuses: vec![
                DescriptorStatus {
                    code: Code::OverLimit,
                    current_limit: Some(CurrentLimit {
                        name: "per_ip".into(),
                        requests_per_unit: 5,
                        unit: Unit::Minute,
                    }),
                    limit_remaining: 0,
                    duration_until_reset: Some(Duration::from_secs(12)),
                },
                DescriptorStatus::no_limit(),
            ],
            response_headers_to_add: vec![Header {
                key: "retry-after".into(),
                value: "12".into(),
            }],
            dynamic_metadata: None,
        };
        let json = serde_json::to_value(JsonResponse::from_decision(&decision)).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "overallCode": "OVER_LIMIT",
                "statuses": [
                    {"code": "OVER_LIMIT",
                     "currentLimit": {"name": "per_ip", "requestsPerUnit": 5, "unit": "MINUTE"},
                     "limitRemaining": 0, "durationUntilReset": "12s"},
                    {"code": "OK", "limitRemaining": 0}
                ],
                "responseHeadersToAdd": [{"key": "retry-after", "value": "12"}]
            })
        );
    }

    #[test]
    fn durations_keep_only_needed_fraction_digits() {
        let d = |secs, nanos| duration(&Duration::new(secs, nanos));
        assert_eq!(d(3, 0), "3s");
        assert_eq!(d(1, 500_000_000), "1.500s");
        assert_eq!(d(0, 1_000), "0.000001s");
        assert_eq!(d(0, 1), "0.000000001s");
    }
}
