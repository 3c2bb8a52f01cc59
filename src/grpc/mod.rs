//! The gRPC port: `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`
//! served on `h2` directly, and tonic for everything else on the same port
//! (`grpc.health.v1.Health`, server reflection).
//!
//! - [`codec`]: the one `RateLimitRequest` decoder and `RateLimitResponse`
//!   encoder, and the gRPC status of a [`DecideError`](crate::limiter::DecideError).
//! - `h2`: the connection loop and gRPC framing, generic over one unary
//!   handler; it knows no limiter.
//! - `fallback`: other paths handed to tonic's routes.
//! - [`reflection`]: the descriptors reflection serves.
//! - [`rlqs`]: Envoy's quota service (`StreamRateLimitQuotas`), a tonic
//!   service among the fallback routes.
//!
//! [`ShouldRateLimit`] runs a proto request through exactly what the port
//! runs (encode, [`codec::decode`], decide, [`codec::encode`]), so the
//! in-process callers (tests, the conformance suite, the benchmarks) check
//! and measure the production codec.
//!
//! Adding a protocol: a streaming service (such as Envoy's quota service)
//! is one more tonic service in [`fallback_routes`]; a unary method hot
//! enough to skip tonic gets a handler of its own beside `Rls`.

pub mod codec;
mod fallback;
mod h2;
pub use h2::STREAM_STATE_BYTES;
pub mod reflection;
pub mod rlqs;

use crate::limiter::Limiter;
use bytes::Bytes;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use http::HeaderMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tonic::Status;
use tonic::service::Routes;

/// The path of `ShouldRateLimit`.
pub const SHOULD_RATE_LIMIT_PATH: &str =
    "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// Largest `RateLimitRequest` accepted, in bytes (2 MiB, the `/json` body
/// limit too); a larger one is refused with `OUT_OF_RANGE` before it is
/// decoded.
pub const MAX_MESSAGE_BYTES: usize = 2 << 20;

/// The bounds of one connection on the gRPC port, so that the memory one
/// connection can hold is bounded: a peer that opens streams and never
/// grants flow-control window keeps at most `max_in_flight_per_connection`
/// answers waiting (each for at most 10 s) and `max_concurrent_streams`
/// streams open, and partly sent requests hold at most
/// `max_in_flight_per_connection` × `max_message_bytes`. Every stream and
/// message also counts in the process-wide budget
/// ([`crate::conn_limit::reserve_request_bytes`]), which bounds them across
/// connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortLimits {
    /// `SETTINGS_MAX_CONCURRENT_STREAMS` advertised: streams one connection
    /// may hold open at once (1,024). Envoy honours it (its default
    /// per-cluster `max_requests` is 1,024 too) and opens another connection
    /// when it needs more. Streams reset before they are taken are bounded
    /// by the same number.
    pub max_concurrent_streams: u32,
    /// Calls of one connection decoded and decided at once (64); the others
    /// wait, their bytes held by HTTP/2 flow control rather than in memory.
    pub max_in_flight_per_connection: usize,
    /// HTTP/2 receive window, per stream and per connection, in bytes (1 MiB):
    /// what a peer may send before the service has read it.
    pub receive_window_bytes: u32,
    /// Largest header block a peer may send, in bytes
    /// (`SETTINGS_MAX_HEADER_LIST_SIZE`, 16 KiB).
    pub max_header_list_bytes: u32,
    /// Largest request message, in bytes ([`MAX_MESSAGE_BYTES`]).
    pub max_message_bytes: usize,
    /// Largest HTTP/2 frame accepted, in bytes (16 KiB, hyper's default).
    pub max_frame_bytes: u32,
    /// Largest amount of response data buffered per stream, in bytes
    /// (400 KiB, hyper's default).
    pub max_send_buffer_bytes: usize,
    /// HTTP/2 keep-alive: a ping every `.0`; a peer whose pong takes longer
    /// than `.1` is dropped (30 s and 10 s). `None`: no pings.
    pub keepalive: Option<(Duration, Duration)>,
}

impl PortLimits {
    /// The bounds the service runs with.
    pub const DEFAULT: Self = Self {
        max_concurrent_streams: 1024,
        max_in_flight_per_connection: 64,
        receive_window_bytes: 1 << 20,
        max_header_list_bytes: 16 << 10,
        max_message_bytes: MAX_MESSAGE_BYTES,
        max_frame_bytes: 16 << 10,
        max_send_buffer_bytes: 400 << 10,
        keepalive: Some((Duration::from_secs(30), Duration::from_secs(10))),
    };
}

impl Default for PortLimits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Serves the gRPC port on the connections from `incoming` until `shutdown`
/// resolves, then stops accepting, asks every connection to finish (HTTP/2
/// GOAWAY; calls in flight complete) and returns when all are closed.
/// `ShouldRateLimit` is answered by `limiter` in each connection's task;
/// every other path by `fallback` ([`fallback_routes`]).
///
/// # Errors
/// Never: a connection that fails is logged at debug level and dropped, an
/// accept error is skipped (tonic's behaviour).
pub async fn serve<S, IO>(
    incoming: S,
    limiter: Arc<Limiter>,
    fallback: Routes,
    limits: PortLimits,
    shutdown: impl Future<Output = ()>,
) -> Result<(), std::convert::Infallible>
where
    S: futures::Stream<Item = std::io::Result<IO>>,
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    h2::serve(incoming, Rls(limiter), fallback, limits, shutdown).await
}

/// The tonic services of the port besides `ShouldRateLimit`: `health`,
/// Envoy's quota service ([`rlqs`], answered by `limiter`), and server
/// reflection (v1 and v1alpha) when `reflection` is on.
#[must_use]
pub fn fallback_routes<H>(health: H, limiter: Arc<Limiter>, reflection: bool) -> Routes
where
    H: tonic::codegen::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    H::Future: Send + 'static,
{
    let mut routes = Routes::new(health).add_service(rlqs::Rlqs::server(limiter));
    if reflection {
        // The descriptors are built in code and checked by tests: a failure
        // is a bug, logged, and the port serves without reflection.
        match (reflection::service_v1(), reflection::service_v1alpha()) {
            (Ok(v1), Ok(v1alpha)) => routes = routes.add_service(v1).add_service(v1alpha),
            (Err(e), _) | (_, Err(e)) => {
                tracing::error!(error = %e, "gRPC reflection is off: its descriptors do not resolve");
            }
        }
    }
    routes
}

/// The `ShouldRateLimit` handler of the port.
#[derive(Debug, Clone)]
struct Rls(Arc<Limiter>);

impl h2::Unary for Rls {
    const PATH: &'static str = SHOULD_RATE_LIMIT_PATH;

    fn call(
        &self,
        msg: Bytes,
        headers: HeaderMap,
    ) -> impl Future<Output = Result<h2::Framed, Status>> + Send + 'static {
        let limiter = self.0.clone();
        async move { should_rate_limit(&limiter, msg, &headers).await }
    }
}

/// Answers one `ShouldRateLimit` message: decode, decide (inside a trace
/// span, child of the trace context in `headers`), encode.
async fn should_rate_limit(
    limiter: &Limiter,
    msg: Bytes,
    headers: &HeaderMap,
) -> Result<h2::Framed, Status> {
    let wire = codec::decode(msg)?;
    let req = codec::request(&wire)?;
    let decision = crate::otel::should_rate_limit(
        headers,
        req.domain,
        req.descriptors.len(),
        async { limiter.decide(&req).await.map_err(|e| codec::status(&e)) },
        codec::outcome,
    )
    .await?;
    Ok(h2::framed(codec::encoded_len(&decision), |buf| {
        codec::encode(&decision, buf);
    }))
}

/// Answers proto requests in process with exactly what the gRPC port runs:
/// the request encoded, decoded by [`codec::decode`], decided, encoded by
/// [`codec::encode`] and decoded back into the proto response.
pub trait ShouldRateLimit {
    /// Answers one `ShouldRateLimit` call.
    ///
    /// # Errors
    /// The gRPC status the port would answer with ([`codec::status`], or
    /// `INVALID_ARGUMENT` for a request that does not decode).
    fn should_rate_limit(
        &self,
        req: &RateLimitRequest,
    ) -> impl Future<Output = Result<RateLimitResponse, Status>> + Send;
}

impl ShouldRateLimit for Limiter {
    async fn should_rate_limit(&self, req: &RateLimitRequest) -> Result<RateLimitResponse, Status> {
        let msg = Bytes::from(prost::Message::encode_to_vec(req));
        let framed = should_rate_limit(self, msg, &HeaderMap::new()).await?;
        <RateLimitResponse as prost::Message>::decode(framed.message())
            .map_err(|e| Status::internal(format!("response does not decode: {e}")))
    }
}
