//! The gRPC edge: `envoy.service.ratelimit.v3.RateLimitService` over tonic.
//! The only module that maps between the Envoy protos and the decision core:
//! [`request`] decodes a `RateLimitRequest`, [`response`] encodes a
//! [`Decision`], and [`status`] maps a [`DecideError`] to a gRPC status
//! (`INVALID_ARGUMENT` or `UNAVAILABLE`).

use crate::config::Unit;
use crate::limiter::{Code, DecideError, Decision, Descriptor, Limiter, Override, Request};
use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code as ProtoCode, DescriptorStatus, RateLimit, rate_limit::Unit as ProtoUnit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use envoy_types::pb::google::protobuf::{
    Duration as PbDuration, Struct as PbStruct, Value as PbValue,
};
use std::future::Future;
use std::sync::Arc;
use tonic::Status;

/// The decision-core view of a proto request (strings borrowed from it).
#[must_use]
pub fn request(req: &RateLimitRequest) -> Request<'_> {
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

/// The proto response for a decision.
#[must_use]
pub fn response(d: Decision) -> RateLimitResponse {
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
                duration_until_reset: s.duration_until_reset.map(|w| PbDuration {
                    seconds: i64::try_from(w.as_secs()).unwrap_or(i64::MAX),
                    nanos: i32::try_from(w.subsec_nanos()).unwrap_or(0),
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
        dynamic_metadata: d.dynamic_metadata.map(proto_struct),
        ..Default::default()
    }
}

/// A JSON mapping as a `google.protobuf.Struct` (numbers become doubles, as
/// in every Struct).
fn proto_struct(m: crate::config::Metadata) -> PbStruct {
    PbStruct {
        fields: m.into_iter().map(|(k, v)| (k, proto_value(v))).collect(),
    }
}

fn proto_value(v: serde_json::Value) -> PbValue {
    use envoy_types::pb::google::protobuf::value::Kind;
    use serde_json::Value;
    let kind = match v {
        Value::Null => Kind::NullValue(0),
        Value::Bool(b) => Kind::BoolValue(b),
        Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        Value::String(s) => Kind::StringValue(s),
        Value::Array(a) => Kind::ListValue(envoy_types::pb::google::protobuf::ListValue {
            values: a.into_iter().map(proto_value).collect(),
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

/// Answers proto requests with a [`Limiter`]: decode, decide, encode.
pub trait ShouldRateLimit {
    /// Answers one `ShouldRateLimit` call.
    ///
    /// # Errors
    /// The [`status`] of the [`DecideError`].
    fn should_rate_limit(
        &self,
        req: &RateLimitRequest,
    ) -> impl Future<Output = Result<RateLimitResponse, Status>> + Send;
}

impl ShouldRateLimit for Limiter {
    async fn should_rate_limit(&self, req: &RateLimitRequest) -> Result<RateLimitResponse, Status> {
        match self.decide(&request(req)).await {
            Ok(d) => Ok(response(d)),
            Err(e) => Err(status(&e)),
        }
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
pub(crate) fn outcome(r: &Result<RateLimitResponse, Status>) -> (String, bool) {
    match r {
        Ok(resp) if resp.overall_code == ProtoCode::OverLimit as i32 => {
            ("OVER_LIMIT".into(), false)
        }
        Ok(_) => ("OK".into(), false),
        Err(s) => (format!("{:?}", s.code()), true),
    }
}

/// The tonic service around a shared [`Limiter`].
#[derive(Debug, Clone)]
pub struct RateLimitGrpc(pub Arc<Limiter>);

#[tonic::async_trait]
impl RateLimitService for RateLimitGrpc {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, Status> {
        let req = request.get_ref();
        crate::otel::should_rate_limit(
            request.metadata(),
            &req.domain,
            req.descriptors.len(),
            ShouldRateLimit::should_rate_limit(&*self.0, req),
            outcome,
        )
        .await
        .map(tonic::Response::new)
    }
}

impl RateLimitGrpc {
    /// The tonic server for this service: requests of at most
    /// [`MAX_MESSAGE_BYTES`]; a request that does not decode is
    /// `INVALID_ARGUMENT` ([`DecodeErrorsAreInvalid`]).
    #[must_use]
    pub fn server(limiter: Arc<Limiter>) -> DecodeErrorsAreInvalid<RateLimitServiceServer<Self>> {
        DecodeErrorsAreInvalid(
            RateLimitServiceServer::new(Self(limiter)).max_decoding_message_size(MAX_MESSAGE_BYTES),
        )
    }
}

/// Wraps a tonic service so that a request body that is not a valid protobuf
/// message (a string field that is not UTF-8, a truncated field) is answered
/// `INVALID_ARGUMENT` instead of tonic's `INTERNAL`: the client sent it, and
/// `INTERNAL` would read as a fault of this service (and count as one in
/// Envoy's and the client's metrics).
#[derive(Debug, Clone)]
pub struct DecodeErrorsAreInvalid<S>(pub S);

/// Start of tonic's message for a request body prost cannot decode, as sent
/// in `grpc-message` (percent-encoded).
const DECODE_ERROR_PREFIX: &[u8] = b"failed%20to%20decode%20Protobuf%20message";

impl<S: tonic::server::NamedService> tonic::server::NamedService for DecodeErrorsAreInvalid<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B, RB> tonic::codegen::Service<tonic::codegen::http::Request<B>>
    for DecodeErrorsAreInvalid<S>
where
    S: tonic::codegen::Service<
            tonic::codegen::http::Request<B>,
            Response = tonic::codegen::http::Response<RB>,
        >,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures::future::MapOk<
        S::Future,
        fn(tonic::codegen::http::Response<RB>) -> tonic::codegen::http::Response<RB>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: tonic::codegen::http::Request<B>) -> Self::Future {
        use futures::TryFutureExt as _;
        self.0.call(req).map_ok(decode_error_as_invalid)
    }
}

/// Rewrites a trailers-only `INTERNAL` answer for an undecodable request to
/// `INVALID_ARGUMENT` (tonic sends errors before any message in the headers).
fn decode_error_as_invalid<RB>(
    mut r: tonic::codegen::http::Response<RB>,
) -> tonic::codegen::http::Response<RB> {
    let h = r.headers_mut();
    let internal = h.get("grpc-status").is_some_and(|v| v.as_bytes() == b"13");
    let decode = h
        .get("grpc-message")
        .is_some_and(|v| v.as_bytes().starts_with(DECODE_ERROR_PREFIX));
    if internal && decode {
        h.insert(
            "grpc-status",
            tonic::codegen::http::HeaderValue::from_static("3"),
        );
    }
    r
}

/// Largest `RateLimitRequest` accepted, in bytes (2 MiB, the `/json` body
/// limit too); a larger one is refused with `OUT_OF_RANGE` before it is
/// decoded.
pub const MAX_MESSAGE_BYTES: usize = 2 << 20;

/// `SETTINGS_MAX_CONCURRENT_STREAMS` advertised on the gRPC port: streams
/// one connection may hold open at once. Envoy honours it (its default
/// per-cluster `max_requests` is 1,024 too) and opens another connection when
/// it needs more.
pub const MAX_CONCURRENT_STREAMS: u32 = 1024;

/// Requests of one connection decoded and decided at once; the others wait,
/// their bytes held by HTTP/2 flow control (the connection window) rather
/// than in memory.
pub const MAX_IN_FLIGHT_PER_CONNECTION: usize = 64;

/// HTTP/2 receive window, per stream and per connection, in bytes: what a
/// peer may send before the service has read it.
pub const RECEIVE_WINDOW_BYTES: u32 = 1 << 20;

/// Largest header block a peer may send, in bytes (`SETTINGS_MAX_HEADER_LIST_SIZE`).
pub const MAX_HEADER_LIST_BYTES: u32 = 16 << 10;

/// The gRPC server builder with the per-connection bounds: at most
/// [`MAX_CONCURRENT_STREAMS`] streams (advertised to the peer), at most
/// [`MAX_IN_FLIGHT_PER_CONNECTION`] of them decided at once, receive windows
/// of [`RECEIVE_WINDOW_BYTES`], headers of at most [`MAX_HEADER_LIST_BYTES`],
/// and HTTP/2 keepalive pings every 30 s (a peer that does not answer within
/// 10 s is dropped). So the memory one connection can hold is bounded: a
/// peer that opens streams and never grants flow-control window keeps at most
/// [`MAX_CONCURRENT_STREAMS`] small responses waiting, and partly sent
/// requests hold at most [`MAX_IN_FLIGHT_PER_CONNECTION`] ×
/// [`MAX_MESSAGE_BYTES`].
#[must_use]
pub fn server_builder() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .concurrency_limit_per_connection(MAX_IN_FLIGHT_PER_CONNECTION)
        .initial_stream_window_size(RECEIVE_WINDOW_BYTES)
        .initial_connection_window_size(RECEIVE_WINDOW_BYTES)
        .http2_max_header_list_size(MAX_HEADER_LIST_BYTES)
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(10)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{CurrentLimit, DescriptorStatus as Status_, Header};
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
        Entry, RateLimitOverride,
    };
    use envoy_types::pb::google::protobuf::UInt64Value;
    use std::time::Duration;

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
        let r = request(&proto);
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
    fn responses_carry_codes_limits_waits_and_headers() {
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
        let p = response(d);
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
}
