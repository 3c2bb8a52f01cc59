//! The one codec of `envoy.service.ratelimit.v3.RateLimitService`: what the
//! gRPC port, the in-process entry point ([`super::ShouldRateLimit`]), the
//! conformance suite and the benchmarks all run.
//!
//! - [`decode`] reads a `RateLimitRequest` into [`wire::RateLimitRequest`],
//!   Envoy's message with its strings kept as slices of the received buffer,
//!   and [`request`] gives the decision core's view of it (UTF-8 checked).
//! - [`encoded_len`] and [`encode`] write the `RateLimitResponse` of a
//!   [`Decision`] straight from it, byte for byte what prost encodes for the
//!   proto message (tests hold the two against each other).
//! - [`status`] maps a [`DecideError`] to the gRPC status.
//!
//! A test builds Envoy's `RateLimitRequest` with every field set (from
//! envoy-types' own types, without `..Default::default()`, so a field that a
//! new envoy-types adds fails to compile there) and fails when this decoder
//! drops one.

use crate::config::Unit;
use crate::limiter::{Code, DecideError, Decision, Descriptor, Override, Request};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code as ProtoCode, rate_limit::Unit as ProtoUnit,
};
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use envoy_types::pb::google::protobuf::{Struct as PbStruct, Value as PbValue};
use tonic::Status;

/// Decodes one `RateLimitRequest` message (the gRPC frame's payload).
///
/// # Errors
/// `INVALID_ARGUMENT` naming Envoy's message and field when the bytes are not
/// a `RateLimitRequest` (truncated, wrong wire type): the client sent them.
pub fn decode(msg: bytes::Bytes) -> Result<wire::RateLimitRequest, Status> {
    <wire::RateLimitRequest as prost::Message>::decode(msg)
        .map_err(|e| Status::invalid_argument(format!("invalid RateLimitRequest: {e}")))
}

/// The decision-core view of a decoded request (strings borrowed from it).
///
/// # Errors
/// `INVALID_ARGUMENT` naming the first string that is not UTF-8 (a protobuf
/// `string` must be), such as `descriptors[1].entries[0].value`.
pub fn request(req: &wire::RateLimitRequest) -> Result<Request<'_>, Status> {
    fn text(b: &[u8], what: impl FnOnce() -> String) -> Result<&str, Status> {
        std::str::from_utf8(b).map_err(|_| {
            Status::invalid_argument(format!("invalid RateLimitRequest: {} is not UTF-8", what()))
        })
    }
    let mut descriptors = Vec::with_capacity(req.descriptors.len());
    for (i, d) in req.descriptors.iter().enumerate() {
        let mut entries = Vec::with_capacity(d.entries.len());
        for (j, e) in d.entries.iter().enumerate() {
            entries.push((
                text(&e.key, || format!("descriptors[{i}].entries[{j}].key"))?,
                text(&e.value, || format!("descriptors[{i}].entries[{j}].value"))?,
            ));
        }
        descriptors.push(Descriptor {
            entries,
            limit: d.limit.as_ref().map(|o| Override {
                requests_per_unit: o.requests_per_unit,
                unit: override_unit(o.unit),
            }),
            hits_addend: d.hits_addend.map(|h| h.value),
            is_negative_hits: d.is_negative_hits,
        });
    }
    Ok(Request {
        domain: text(&req.domain, || "domain".to_owned())?,
        hits_addend: req.hits_addend,
        descriptors,
    })
}

/// The request types the gRPC port decodes: Envoy's messages under their
/// own names (so decode errors name `RateLimitRequest.domain`, as prost's
/// generated types do), with strings kept as slices of the received buffer.
pub mod wire {
    /// A `RateLimitRequest` as it arrives on the wire, its strings kept as
    /// slices of the received buffer instead of copied into `String`s: what the
    /// gRPC port decodes (one allocation per descriptor list instead of one per
    /// string). Field numbers and types are Envoy's
    /// (`envoy.service.ratelimit.v3.RateLimitRequest` and
    /// `envoy.extensions.common.ratelimit.v3.RateLimitDescriptor`); `bytes` and
    /// `string` share a wire type, and [`super::request`] checks the
    /// UTF-8 that a `string` field must hold. A field sent twice keeps its
    /// last copy, as proto3 says, and only that copy is checked (prost's
    /// `String` checks every copy before it drops the earlier ones).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RateLimitRequest {
        /// `domain`.
        #[prost(bytes = "bytes", tag = "1")]
        pub domain: bytes::Bytes,
        /// `descriptors`.
        #[prost(message, repeated, tag = "2")]
        pub descriptors: Vec<RateLimitDescriptor>,
        /// `hits_addend` (0: unset).
        #[prost(uint32, tag = "3")]
        pub hits_addend: u32,
    }

    /// A `RateLimitDescriptor` of a [`RateLimitRequest`].
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RateLimitDescriptor {
        /// `entries`.
        #[prost(message, repeated, tag = "1")]
        pub entries: Vec<Entry>,
        /// `limit`: the request's override.
        #[prost(message, optional, tag = "2")]
        pub limit: Option<super::RateLimitOverride>,
        /// `hits_addend` (a `google.protobuf.UInt64Value`).
        #[prost(message, optional, tag = "3")]
        pub hits_addend: Option<envoy_types::pb::google::protobuf::UInt64Value>,
        /// `is_negative_hits`: a refund.
        #[prost(bool, tag = "4")]
        pub is_negative_hits: bool,
    }

    /// An `Entry` (key and value) of a [`RateLimitDescriptor`].
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Entry {
        /// `key`.
        #[prost(bytes = "bytes", tag = "1")]
        pub key: bytes::Bytes,
        /// `value`.
        #[prost(bytes = "bytes", tag = "2")]
        pub value: bytes::Bytes,
    }
}

/// The length in bytes of the encoded `RateLimitResponse` of `d` (what
/// [`encode`] writes).
#[must_use]
pub fn encoded_len(d: &Decision) -> usize {
    use prost::encoding::{encoded_len_varint, key_len};
    let field = |tag: u32, len: usize| key_len(tag) + encoded_len_varint(len as u64) + len;
    let mut n = key_len(1) + encoded_len_varint(proto_code(d.overall_code) as u64);
    for st in &d.statuses {
        n += field(2, status_len(st));
    }
    for h in &d.response_headers_to_add {
        n += field(3, header_len(h));
    }
    if let Some(m) = &d.dynamic_metadata {
        n += prost::encoding::message::encoded_len(DYNAMIC_METADATA, &proto_struct(m));
    }
    n
}

/// `RateLimitResponse.dynamic_metadata`, a `google.protobuf.Struct`.
const DYNAMIC_METADATA: u32 = 6;

/// Encodes the `RateLimitResponse` of `d` into `buf`: byte for byte what
/// prost encodes for the proto message, without building it (fields in
/// number order, proto3 defaults left out). Only the dynamic metadata, rare
/// (the Go service's `metadata` rules), goes through prost's `Struct`.
pub fn encode(d: &Decision, buf: &mut impl bytes::BufMut) {
    use prost::encoding::{WireType, encode_key, encode_varint};
    let varint = |tag: u32, v: u64, buf: &mut _| {
        encode_key(tag, WireType::Varint, buf);
        encode_varint(v, buf);
    };
    let delimited = |tag: u32, len: usize, buf: &mut _| {
        encode_key(tag, WireType::LengthDelimited, buf);
        encode_varint(len as u64, buf);
    };
    let string = |tag: u32, v: &str, buf: &mut _| {
        if !v.is_empty() {
            delimited(tag, v.len(), buf);
            bytes::BufMut::put_slice(buf, v.as_bytes());
        }
    };
    varint(1, proto_code(d.overall_code) as u64, buf);
    for st in &d.statuses {
        delimited(2, status_len(st), buf);
        varint(1, proto_code(st.code) as u64, buf);
        if let Some(l) = &st.current_limit {
            // `RateLimit`: requests_per_unit = 1, unit = 2, name = 3.
            delimited(2, limit_len(l), buf);
            if l.requests_per_unit != 0 {
                varint(1, u64::from(l.requests_per_unit), buf);
            }
            varint(2, proto_unit(l.unit) as u64, buf);
            string(3, &l.name, buf);
        }
        if st.limit_remaining != 0 {
            varint(3, u64::from(st.limit_remaining), buf);
        }
        if let Some(w) = st.duration_until_reset {
            let (secs, nanos) = duration_parts(w);
            delimited(4, duration_len(secs, nanos), buf);
            if secs != 0 {
                varint(1, secs as u64, buf);
            }
            if nanos != 0 {
                varint(2, nanos as u64, buf);
            }
        }
    }
    for h in &d.response_headers_to_add {
        delimited(3, header_len(h), buf);
        string(1, &h.key, buf);
        string(2, &h.value, buf);
    }
    if let Some(m) = &d.dynamic_metadata {
        prost::encoding::message::encode(DYNAMIC_METADATA, &proto_struct(m), buf);
    }
}

fn status_len(st: &crate::limiter::DescriptorStatus) -> usize {
    use prost::encoding::{encoded_len_varint, key_len};
    let mut n = key_len(1) + encoded_len_varint(proto_code(st.code) as u64);
    if let Some(l) = &st.current_limit {
        let len = limit_len(l);
        n += key_len(2) + encoded_len_varint(len as u64) + len;
    }
    if st.limit_remaining != 0 {
        n += key_len(3) + encoded_len_varint(u64::from(st.limit_remaining));
    }
    if let Some(w) = st.duration_until_reset {
        let (secs, nanos) = duration_parts(w);
        let len = duration_len(secs, nanos);
        n += key_len(4) + encoded_len_varint(len as u64) + len;
    }
    n
}

fn limit_len(l: &crate::limiter::CurrentLimit) -> usize {
    use prost::encoding::{encoded_len_varint, key_len};
    let mut n = key_len(2) + encoded_len_varint(proto_unit(l.unit) as u64);
    if l.requests_per_unit != 0 {
        n += key_len(1) + encoded_len_varint(u64::from(l.requests_per_unit));
    }
    if !l.name.is_empty() {
        n += key_len(3) + encoded_len_varint(l.name.len() as u64) + l.name.len();
    }
    n
}

fn header_len(h: &crate::limiter::Header) -> usize {
    use prost::encoding::{encoded_len_varint, key_len};
    [h.key.as_ref(), h.value.as_str()]
        .iter()
        .enumerate()
        .filter(|(_, v)| !v.is_empty())
        .map(|(i, v)| key_len(i as u32 + 1) + encoded_len_varint(v.len() as u64) + v.len())
        .sum()
}

/// A wait as `google.protobuf.Duration` seconds and nanos (both never
/// negative: waits are).
fn duration_parts(w: std::time::Duration) -> (i64, i32) {
    (
        i64::try_from(w.as_secs()).unwrap_or(i64::MAX),
        i32::try_from(w.subsec_nanos()).unwrap_or(0),
    )
}

fn duration_len(secs: i64, nanos: i32) -> usize {
    use prost::encoding::{encoded_len_varint, key_len};
    let mut n = 0;
    if secs != 0 {
        n += key_len(1) + encoded_len_varint(secs as u64);
    }
    if nanos != 0 {
        n += key_len(2) + encoded_len_varint(nanos as u64);
    }
    n
}

/// A JSON mapping as a `google.protobuf.Struct` (numbers become doubles, as
/// in every Struct).
fn proto_struct(m: &crate::config::Metadata) -> PbStruct {
    PbStruct {
        fields: m.iter().map(|(k, v)| (k.clone(), proto_value(v))).collect(),
    }
}

fn proto_value(v: &serde_json::Value) -> PbValue {
    use envoy_types::pb::google::protobuf::value::Kind;
    use serde_json::Value;
    let kind = match v {
        Value::Null => Kind::NullValue(0),
        Value::Bool(b) => Kind::BoolValue(*b),
        Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        Value::String(s) => Kind::StringValue(s.clone()),
        Value::Array(a) => Kind::ListValue(envoy_types::pb::google::protobuf::ListValue {
            values: a.iter().map(proto_value).collect(),
        }),
        Value::Object(m) => Kind::StructValue(proto_struct(m)),
    };
    PbValue { kind: Some(kind) }
}

/// The gRPC status for a request that got no decision: `INVALID_ARGUMENT`
/// for a malformed request, `UNAVAILABLE` when storage failed, `UNKNOWN`
/// before the first config of an xDS source (Envoy's `failure_mode_deny`
/// then decides).
#[must_use]
pub fn status(e: &DecideError) -> Status {
    match e {
        DecideError::Invalid(_) => Status::invalid_argument(e.to_string()),
        DecideError::Storage(_) => Status::unavailable(e.to_string()),
        DecideError::NoConfig => Status::unknown(e.to_string()),
    }
}

/// The config unit of an override's proto unit, or its name (or number)
/// when it is `UNKNOWN` or not a unit at all.
fn override_unit(u: i32) -> Result<Unit, String> {
    Ok(match RateLimitUnit::try_from(u) {
        Ok(RateLimitUnit::Second) => Unit::Second,
        Ok(RateLimitUnit::Minute) => Unit::Minute,
        Ok(RateLimitUnit::Hour) => Unit::Hour,
        Ok(RateLimitUnit::Day) => Unit::Day,
        Ok(RateLimitUnit::Month) => Unit::Month,
        Ok(RateLimitUnit::Year) => Unit::Year,
        Ok(RateLimitUnit::Unknown) => return Err(RateLimitUnit::Unknown.as_str_name().to_owned()),
        Err(_) => return Err(u.to_string()),
    })
}

const fn proto_code(c: Code) -> ProtoCode {
    match c {
        Code::Ok => ProtoCode::Ok,
        Code::OverLimit => ProtoCode::OverLimit,
    }
}

/// The proto enum value of a config unit.
#[must_use]
pub const fn proto_unit(u: Unit) -> ProtoUnit {
    match u {
        Unit::Second => ProtoUnit::Second,
        Unit::Minute => ProtoUnit::Minute,
        Unit::Hour => ProtoUnit::Hour,
        Unit::Day => ProtoUnit::Day,
        Unit::Week => ProtoUnit::Week,
        Unit::Month => ProtoUnit::Month,
        Unit::Year => ProtoUnit::Year,
    }
}

/// The trace span's name for an answer: `OK`, `OVER_LIMIT` or the gRPC
/// code, and whether it is an error.
pub(crate) fn outcome(r: &Result<Decision, Status>) -> (String, bool) {
    match r {
        Ok(d) if d.overall_code == Code::OverLimit => ("OVER_LIMIT".into(), false),
        Ok(_) => ("OK".into(), false),
        Err(s) => (format!("{:?}", s.code()), true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{CurrentLimit, DescriptorStatus as Status_, Header};
    use envoy_types::pb::envoy::config::core::v3::HeaderValue;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
        DescriptorStatus, RateLimit,
    };
    use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
    use envoy_types::pb::google::protobuf::{Duration as PbDuration, UInt64Value};
    use prost::Message as _;
    use std::time::Duration;

    /// The oracle for [`request`]: the core view of prost's decoding of the
    /// request, field by field.
    fn proto_request(req: &RateLimitRequest) -> Request<'_> {
        Request {
            domain: &req.domain,
            hits_addend: req.hits_addend,
            descriptors: req
                .descriptors
                .iter()
                .map(|d| Descriptor {
                    entries: d
                        .entries
                        .iter()
                        .map(|e| (e.key.as_str(), e.value.as_str()))
                        .collect(),
                    limit: d.limit.as_ref().map(|o| Override {
                        requests_per_unit: o.requests_per_unit,
                        unit: override_unit(o.unit),
                    }),
                    hits_addend: d.hits_addend.map(|h| h.value),
                    is_negative_hits: d.is_negative_hits,
                })
                .collect(),
        }
    }

    /// The oracle for [`encode`]: the proto response of a decision, built
    /// field by field for prost to encode.
    fn proto_response(d: Decision) -> RateLimitResponse {
        RateLimitResponse {
            overall_code: proto_code(d.overall_code) as i32,
            statuses: d
                .statuses
                .into_iter()
                .map(|s| DescriptorStatus {
                    code: proto_code(s.code) as i32,
                    current_limit: s.current_limit.map(|l| RateLimit {
                        name: l.name,
                        requests_per_unit: l.requests_per_unit,
                        unit: proto_unit(l.unit) as i32,
                    }),
                    limit_remaining: s.limit_remaining,
                    duration_until_reset: s.duration_until_reset.map(|w| {
                        let (seconds, nanos) = duration_parts(w);
                        PbDuration { seconds, nanos }
                    }),
                    quota: None,
                })
                .collect(),
            response_headers_to_add: d
                .response_headers_to_add
                .into_iter()
                .map(|h| HeaderValue {
                    key: h.key.into_owned(),
                    value: h.value,
                    ..Default::default()
                })
                .collect(),
            dynamic_metadata: d.dynamic_metadata.as_ref().map(proto_struct),
            ..Default::default()
        }
    }

    /// Decodes what the port would receive for `req`.
    fn wire_of(req: &RateLimitRequest) -> wire::RateLimitRequest {
        decode(req.encode_to_vec().into()).expect("decodes")
    }

    /// What the port sends for `d`, decoded by prost.
    fn sent(d: &Decision) -> RateLimitResponse {
        let mut buf = Vec::with_capacity(encoded_len(d));
        encode(d, &mut buf);
        assert_eq!(buf.len(), encoded_len(d));
        RateLimitResponse::decode(&buf[..]).expect("prost decodes it")
    }

    /// Envoy's `RateLimitRequest` with every field set to a value other than
    /// its default. Written without `..Default::default()`: a field a new
    /// envoy-types adds makes this fail to compile, so it is added here and
    /// the test below checks the codec keeps it.
    fn every_field_set() -> RateLimitRequest {
        RateLimitRequest {
            domain: "edge".into(),
            descriptors: vec![
                RateLimitDescriptor {
                    entries: vec![
                        Entry {
                            key: "tenant".into(),
                            value: "acme".into(),
                        },
                        Entry {
                            key: "path".into(),
                            value: "/v1".into(),
                        },
                    ],
                    limit: Some(RateLimitOverride {
                        requests_per_unit: 42,
                        unit: RateLimitUnit::Hour as i32,
                    }),
                    hits_addend: Some(UInt64Value { value: 5 }),
                    is_negative_hits: true,
                },
                RateLimitDescriptor {
                    entries: vec![Entry {
                        key: "k".into(),
                        value: "v".into(),
                    }],
                    limit: None,
                    hits_addend: None,
                    is_negative_hits: false,
                },
            ],
            hits_addend: 3,
        }
    }

    #[test]
    fn every_field_of_envoys_request_survives_the_codec() {
        let original = every_field_set();
        let wire = wire_of(&original);
        // The wire type re-encoded must give back Envoy's message whole: a
        // field the wire type does not know is skipped by its decoder and
        // missing here.
        let again = RateLimitRequest::decode(&wire.encode_to_vec()[..]).expect("decodes");
        assert_eq!(again, original);
        // And the core view carries every value.
        let r = request(&wire).expect("UTF-8");
        assert_eq!((r.domain, r.hits_addend), ("edge", 3));
        let d = &r.descriptors[0];
        assert_eq!(d.entries, vec![("tenant", "acme"), ("path", "/v1")]);
        let o = d.limit.as_ref().expect("override kept");
        assert_eq!((o.requests_per_unit, o.unit.clone()), (42, Ok(Unit::Hour)));
        assert_eq!(d.hits_addend, Some(5));
        assert!(d.is_negative_hits);
        assert_eq!(r, proto_request(&original));
    }

    #[test]
    fn a_field_unknown_to_the_wire_type_is_caught_by_the_round_trip() {
        // The round trip above fails when a field is dropped: a message with
        // a field this codec does not read (number 15) loses it.
        let mut bytes = every_field_set().encode_to_vec();
        prost::encoding::uint32::encode(15, &9, &mut bytes);
        let wire = decode(bytes.clone().into()).expect("decodes");
        assert_ne!(wire.encode_to_vec(), bytes);
    }

    #[test]
    fn requests_keep_entries_costs_and_override_units() {
        let proto = RateLimitRequest {
            domain: "d".into(),
            hits_addend: 4,
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "k".into(),
                    value: "v".into(),
                }],
                limit: Some(RateLimitOverride {
                    requests_per_unit: 9,
                    unit: RateLimitUnit::Hour as i32,
                }),
                hits_addend: Some(UInt64Value { value: 0 }),
                is_negative_hits: true,
            }],
        };
        let wire = wire_of(&proto);
        let r = request(&wire).expect("UTF-8");
        assert_eq!((r.domain, r.hits_addend), ("d", 4));
        let d = &r.descriptors[0];
        assert_eq!(d.entries, vec![("k", "v")]);
        assert_eq!(d.hits_addend, Some(0));
        assert!(d.is_negative_hits);
        assert_eq!(d.limit.as_ref().unwrap().unit, Ok(Unit::Hour));
        assert_eq!(override_unit(0), Err("UNKNOWN".into()));
        assert_eq!(override_unit(99), Err("99".into()));
    }

    #[test]
    fn responses_carry_codes_limits_waits_headers_and_metadata() {
        let d = Decision {
            overall_code: Code::OverLimit,
            statuses: vec![Status_ {
                code: Code::OverLimit,
                current_limit: Some(CurrentLimit {
                    name: "n".into(),
                    requests_per_unit: 3,
                    unit: Unit::Week,
                }),
                limit_remaining: 0,
                duration_until_reset: Some(Duration::from_millis(1500)),
            }],
            response_headers_to_add: vec![Header {
                key: "retry-after".into(),
                value: "2".into(),
            }],
            dynamic_metadata: Some(
                serde_json::json!({"domain": "d", "n": 2, "l": [true, null], "m": {"s": "x"}})
                    .as_object()
                    .unwrap()
                    .clone(),
            ),
        };
        let p = sent(&d);
        assert_eq!(p, proto_response(d));
        assert_eq!(p.overall_code, ProtoCode::OverLimit as i32);
        let s = &p.statuses[0];
        assert_eq!(
            s.current_limit.as_ref().unwrap().unit,
            ProtoUnit::Week as i32
        );
        assert_eq!(
            s.duration_until_reset,
            Some(PbDuration {
                seconds: 1,
                nanos: 500_000_000
            })
        );
        assert_eq!(p.response_headers_to_add[0].key, "retry-after");
        use envoy_types::pb::google::protobuf::value::Kind;
        let md = p.dynamic_metadata.unwrap().fields;
        assert_eq!(md["domain"].kind, Some(Kind::StringValue("d".into())));
        assert_eq!(md["n"].kind, Some(Kind::NumberValue(2.0)));
        let Some(Kind::ListValue(l)) = &md["l"].kind else {
            panic!("list expected")
        };
        assert_eq!(l.values[1].kind, Some(Kind::NullValue(0)));
        let Some(Kind::StructValue(m)) = &md["m"].kind else {
            panic!("struct expected")
        };
        assert_eq!(m.fields["s"].kind, Some(Kind::StringValue("x".into())));
    }

    #[test]
    fn errors_map_to_invalid_argument_and_unavailable() {
        let invalid = DecideError::Invalid(crate::limiter::InvalidRequest::EmptyDomain);
        assert_eq!(status(&invalid).code(), tonic::Code::InvalidArgument);
        assert_eq!(status(&invalid).message(), "domain must not be empty");
        let down = DecideError::Storage(crate::storage::StorageError::CircuitOpen);
        assert_eq!(status(&down).code(), tonic::Code::Unavailable);
        assert!(
            status(&down)
                .message()
                .starts_with("rate limit storage unavailable: ")
        );
    }

    use proptest::prelude::*;

    fn any_unit() -> impl Strategy<Value = Unit> {
        prop_oneof![
            Just(Unit::Second),
            Just(Unit::Minute),
            Just(Unit::Hour),
            Just(Unit::Day),
            Just(Unit::Week),
            Just(Unit::Month),
            Just(Unit::Year),
        ]
    }

    fn any_code() -> impl Strategy<Value = Code> {
        prop_oneof![Just(Code::Ok), Just(Code::OverLimit)]
    }

    fn any_status() -> impl Strategy<Value = Status_> {
        let limit = proptest::option::of(("[a-z_]{0,12}", any::<u32>(), any_unit()).prop_map(
            |(name, requests_per_unit, unit)| CurrentLimit {
                name,
                requests_per_unit,
                unit,
            },
        ));
        // Waits from 0 to past protobuf's Duration range, in ms or whole s.
        let wait = proptest::option::of(prop_oneof![
            (0u64..10_000_000).prop_map(Duration::from_millis),
            any::<u64>().prop_map(Duration::from_secs),
            (0u64..u64::MAX, 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
        ]);
        (any_code(), limit, any::<u32>(), wait).prop_map(|(code, current_limit, rem, wait)| {
            Status_ {
                code,
                current_limit,
                limit_remaining: rem,
                duration_until_reset: wait,
            }
        })
    }

    fn any_metadata() -> impl Strategy<Value = Option<crate::config::Metadata>> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::Bool),
            (-1e9f64..1e9).prop_map(|f| serde_json::json!(f)),
            "[ -~]{0,10}".prop_map(serde_json::Value::String),
        ];
        let value = leaf.prop_recursive(2, 8, 3, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..3).prop_map(serde_json::Value::Array),
                proptest::collection::btree_map("[a-z]{1,4}", inner, 0..3)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        });
        proptest::option::of(
            proptest::collection::btree_map("[a-z_]{1,8}", value, 0..4)
                .prop_map(|m| m.into_iter().collect()),
        )
    }

    fn any_decision() -> impl Strategy<Value = Decision> {
        let header = ("[a-z-]{0,20}", "[ -~]{0,30}").prop_map(|(k, v)| Header {
            key: k.into(),
            value: v,
        });
        (
            any_code(),
            proptest::collection::vec(any_status(), 0..8),
            proptest::collection::vec(header, 0..4),
            any_metadata(),
        )
            .prop_map(
                |(overall_code, statuses, headers, dynamic_metadata)| Decision {
                    overall_code,
                    statuses,
                    response_headers_to_add: headers,
                    dynamic_metadata,
                },
            )
    }

    fn any_proto_request() -> impl Strategy<Value = RateLimitRequest> {
        let entry = (".{0,12}", ".{0,12}").prop_map(|(key, value)| Entry { key, value });
        let descriptor = (
            proptest::collection::vec(entry, 0..4),
            proptest::option::of((any::<u32>(), -1i32..9)),
            proptest::option::of(any::<u64>()),
            any::<bool>(),
        )
            .prop_map(|(entries, limit, hits, neg)| RateLimitDescriptor {
                entries,
                limit: limit.map(|(requests_per_unit, unit)| RateLimitOverride {
                    requests_per_unit,
                    unit,
                }),
                hits_addend: hits.map(|value| UInt64Value { value }),
                is_negative_hits: neg,
            });
        (
            ".{0,16}",
            proptest::collection::vec(descriptor, 0..6),
            any::<u32>(),
        )
            .prop_map(|(domain, descriptors, hits_addend)| RateLimitRequest {
                domain,
                descriptors,
                hits_addend,
            })
    }

    proptest! {
        /// The direct encoding is byte for byte prost's encoding of the
        /// proto response.
        #[test]
        fn direct_response_encoding_is_prosts(d in any_decision()) {
            let expected = proto_response(d.clone());
            let mut got = Vec::with_capacity(encoded_len(&d));
            encode(&d, &mut got);
            prop_assert_eq!(got.len(), encoded_len(&d));
            prop_assert_eq!(&RateLimitResponse::decode(&got[..]).expect("decodes"), &expected);
            // A Struct's fields are a hash map, encoded in its own order:
            // bytes compare only without one.
            if d.dynamic_metadata.is_none() {
                prop_assert_eq!(got, expected.encode_to_vec());
            }
        }

        /// A request decodes to the same decision-core request as prost's
        /// decoding of it.
        #[test]
        fn requests_map_like_prosts_decoding(p in any_proto_request()) {
            let wire = wire_of(&p);
            prop_assert_eq!(request(&wire).expect("UTF-8"), proto_request(&p));
        }
    }

    #[test]
    fn decode_errors_name_envoys_messages() {
        // Field 1 (domain) says 5 bytes, one follows.
        let e = decode(bytes::Bytes::from_static(&[0x0a, 0x05, b'd'])).expect_err("truncated");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("RateLimitRequest.domain"), "{e}");
    }

    #[test]
    fn strings_that_are_not_utf8_are_named_where_they_are() {
        let entry = |key: &[u8], value: &[u8]| wire::Entry {
            key: bytes::Bytes::copy_from_slice(key),
            value: bytes::Bytes::copy_from_slice(value),
        };
        let req = |domain: &[u8], entries: Vec<wire::Entry>| wire::RateLimitRequest {
            domain: bytes::Bytes::copy_from_slice(domain),
            descriptors: vec![
                wire::RateLimitDescriptor {
                    entries: vec![entry(b"k", b"v")],
                    ..Default::default()
                },
                wire::RateLimitDescriptor {
                    entries,
                    ..Default::default()
                },
            ],
            hits_addend: 0,
        };
        for (r, what) in [
            (req(b"\xff", vec![]), "domain"),
            (
                req(b"d", vec![entry(b"k", b"v"), entry(b"\xc3", b"v")]),
                "descriptors[1].entries[1].key",
            ),
            (
                req(b"d", vec![entry(b"k", b"\xfe\xff")]),
                "descriptors[1].entries[0].value",
            ),
        ] {
            let e = request(&r).expect_err("not UTF-8");
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert_eq!(
                e.message(),
                format!("invalid RateLimitRequest: {what} is not UTF-8")
            );
        }
    }
}
