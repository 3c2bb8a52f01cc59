//! The gRPC port served on `h2` directly: `ShouldRateLimit` is answered
//! inside the connection's own task (decoded with prost, decided by the same
//! [`Limiter`] as [`crate::grpc`]), every other path (health, reflection) is
//! handed to the tonic [`Routes`] on a task of its own.
//!
//! Why: through tonic and hyper each call costs a task spawn, a cross-task
//! wake-up per frame, tower layers, a router lookup and tonic's streaming
//! codec; most of the server's CPU per decision went there and into the one
//! `writev` per response it caused (BENCHMARKS.md, "Serving ShouldRateLimit
//! on h2"). Here the calls of a connection are polled together, so the
//! responses of all calls that arrived in one read leave in one write. A
//! call decided at once (the memory backend, a local-cache hit) never enters
//! the connection's set of waiting calls.
//!
//! What a client sees is what tonic answers: `content-type:
//! application/grpc`, one length-prefixed message, `grpc-status` in the
//! trailers, or a trailers-only response for an error, with tonic's codes and
//! messages for an unsupported `grpc-encoding` (`UNIMPLEMENTED`), a
//! compressed flag without one (`INTERNAL`), an oversized message
//! (`OUT_OF_RANGE`), a body that does not decode (`INVALID_ARGUMENT`, where
//! tonic says `INTERNAL`: the fault is the client's) and an expired
//! `grpc-timeout` (`CANCELLED`, "Timeout expired"). The per-connection
//! bounds are [`crate::grpc`]'s: 1,024 streams advertised, 64 calls decided
//! at once, 1 MiB windows, 16 KiB header lists, 2 MiB messages; frames are
//! 16 KiB. Keep-alive pings behave like hyper's: a ping every
//! `interval`, the connection closed when its pong takes longer than
//! `timeout`.

use crate::limiter::Limiter;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use h2::RecvStream;
use h2::server::SendResponse;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body::{Body as _, Frame};
use prost::Message as _;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tonic::Status;
use tonic::codegen::Service as _;
use tonic::service::Routes;

/// The path of the one RPC served here.
pub const SHOULD_RATE_LIMIT_PATH: &str =
    "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// Largest request message accepted, bytes ([`crate::grpc::MAX_MESSAGE_BYTES`]).
pub const MAX_MESSAGE_BYTES: usize = crate::grpc::MAX_MESSAGE_BYTES;

/// HTTP/2 flow-control windows, bytes ([`crate::grpc::RECEIVE_WINDOW_BYTES`]).
const WINDOW_BYTES: u32 = crate::grpc::RECEIVE_WINDOW_BYTES;
/// Largest frame accepted, bytes (hyper's default).
const MAX_FRAME_BYTES: u32 = 16 * 1024;
/// Largest header list accepted, bytes ([`crate::grpc::MAX_HEADER_LIST_BYTES`]).
const MAX_HEADER_LIST_BYTES: u32 = crate::grpc::MAX_HEADER_LIST_BYTES;
/// Largest amount of response data buffered per stream, bytes (hyper's default).
const MAX_SEND_BUFFER_BYTES: usize = 400 * 1024;

/// How the connections are served.
#[derive(Debug, Clone)]
pub struct Options {
    /// Keep-alive ping interval and pong timeout; `None`: no pings.
    pub keepalive: Option<(Duration, Duration)>,
}

/// Serves connections from `incoming` until `shutdown` resolves, then stops
/// accepting, asks every connection to finish (HTTP/2 GOAWAY; calls in
/// flight complete) and returns when all are closed.
///
/// # Errors
/// Never: a connection that fails is logged at debug level and dropped, an
/// accept error is skipped (tonic's behaviour).
pub async fn serve<S, IO>(
    incoming: S,
    limiter: Arc<Limiter>,
    fallback: Routes,
    options: Options,
    shutdown: impl Future<Output = ()>,
) -> Result<(), std::convert::Infallible>
where
    S: futures::Stream<Item = std::io::Result<IO>>,
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let fallback = fallback.prepare();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    {
        let mut incoming = std::pin::pin!(incoming);
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                io = incoming.next() => match io {
                    Some(Ok(io)) => {
                        let conn = serve_connection(io, limiter.clone(), fallback.clone(), options.clone(), stop_rx.clone());
                        tokio::spawn(async move {
                            if let Err(e) = conn.await {
                                tracing::debug!(error = %e, "gRPC connection failed");
                            }
                        });
                    }
                    Some(Err(e)) => tracing::debug!(error = %e, "gRPC accept failed"),
                    None => break,
                },
            }
        }
    }
    let _ = stop_tx.send(true);
    drop(stop_rx);
    stop_tx.closed().await;

    Ok(())
}

/// Serves one connection until the client closes it, it fails, or `stop`
/// turns true (then it is shut down gracefully).
///
/// # Errors
/// The HTTP/2 error that ended the connection.
pub async fn serve_connection<IO>(
    io: IO,
    limiter: Arc<Limiter>,
    fallback: Routes,
    options: Options,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(), h2::Error>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut conn = h2::server::Builder::new()
        .max_concurrent_streams(crate::grpc::MAX_CONCURRENT_STREAMS)
        // Streams a client resets before they are taken (Envoy cancelling
        // calls at its timeout while this connection has its 64 calls in
        // flight) close the connection past this count: h2's default of 20
        // would drop every call of a busy connection. Bounded like the
        // streams themselves.
        .max_pending_accept_reset_streams(crate::grpc::MAX_CONCURRENT_STREAMS as usize)
        .initial_window_size(WINDOW_BYTES)
        .initial_connection_window_size(WINDOW_BYTES)
        .max_frame_size(MAX_FRAME_BYTES)
        .max_header_list_size(MAX_HEADER_LIST_BYTES)
        .max_send_buffer_size(MAX_SEND_BUFFER_BYTES)
        .handshake::<_, Bytes>(io)
        .await?;
    let keepalive = keepalive(conn.ping_pong(), options.keepalive);
    let mut keepalive = std::pin::pin!(keepalive);
    // Borrowed, not moved: the receiver lives as long as the connection, so
    // `serve` waits for this connection to close.
    let stopped = stop.wait_for(|s| *s);
    let mut stopped = std::pin::pin!(stopped);
    let mut stopping = false;
    let mut calls: FuturesUnordered<Call> = FuturesUnordered::new();
    // The calls of one read, taken before any is run (kept across reads).
    let mut accepted = Vec::new();
    // One poll of the connection reads every frame the socket has and then
    // writes every frame queued, so: take all the calls that arrived, run
    // them until they wait (the memory backend never does), and only then
    // poll the connection again. The responses of one read leave in one
    // write instead of one write each.
    let open = poll_fn(|cx| {
        if !stopping && stopped.as_mut().poll(cx).is_ready() {
            stopping = true;
            conn.graceful_shutdown();
        }
        if keepalive.as_mut().poll(cx).is_ready() {
            tracing::debug!("gRPC connection closed: keep-alive ping not answered");
            return Poll::Ready(Ok(false));
        }
        loop {
            loop {
                // At most MAX_IN_FLIGHT_PER_CONNECTION calls of one
                // connection are read and decided at once: past it, the
                // connection's I/O goes on (pings, window updates, writes)
                // and new streams wait in h2, bounded by the streams
                // advertised, their bytes held back by flow control.
                if calls.len() + accepted.len() >= crate::grpc::MAX_IN_FLIGHT_PER_CONNECTION {
                    if let Poll::Ready(r) = conn.poll_closed(cx) {
                        return Poll::Ready(r.map(|()| true));
                    }
                    break;
                }
                match conn.poll_accept(cx) {
                    Poll::Ready(Some(Ok((req, respond)))) => {
                        if is_should_rate_limit(&req) {
                            accepted.push((req, respond));
                        } else {
                            tokio::spawn(forward(fallback.clone(), req, respond));
                        }
                    }
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e)),
                    Poll::Ready(None) => return Poll::Ready(Ok(true)),
                    Poll::Pending => break,
                }
            }
            // Each new call is polled once here: one decided at once (the
            // memory backend, a local-cache hit) never enters the set. One
            // that waits is moved in boxed, so the move copies a pointer,
            // and the set polls it again before it waits.
            let mut answered = false;
            for (req, respond) in accepted.drain(..) {
                let mut call: Call = Box::pin(should_rate_limit(limiter.clone(), req, respond));
                if call.as_mut().poll(cx).is_ready() {
                    answered = true;
                } else {
                    calls.push(call);
                }
            }
            while let Poll::Ready(Some(())) = calls.poll_next_unpin(cx) {
                answered = true;
            }
            if !answered {
                return Poll::Pending;
            }
        }
    })
    .await;
    let open = open?;
    if !open {
        return Ok(());
    }
    // The calls still in flight finish (their responses are already queued
    // or will be), then the connection flushes and closes. Calls taken in
    // the read that ended the loop have not run yet.
    for (req, respond) in accepted.drain(..) {
        calls.push(Box::pin(should_rate_limit(limiter.clone(), req, respond)));
    }
    while calls.next().await.is_some() {}
    poll_fn(|cx| conn.poll_closed(cx)).await
}

// Header names built once, not parsed per lookup.
const GRPC_ENCODING: http::HeaderName = http::HeaderName::from_static("grpc-encoding");
const GRPC_TIMEOUT: http::HeaderName = http::HeaderName::from_static("grpc-timeout");
const GRPC_STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");

/// One `ShouldRateLimit` call in flight on a connection.
type Call = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// Resolves when a keep-alive ping is not answered in time; never without
/// pings configured.
async fn keepalive(ping_pong: Option<h2::PingPong>, every: Option<(Duration, Duration)>) {
    let (Some(mut pp), Some((interval, timeout))) = (ping_pong, every) else {
        return std::future::pending().await;
    };
    loop {
        tokio::time::sleep(interval).await;
        match tokio::time::timeout(timeout, pp.ping(h2::Ping::opaque())).await {
            Ok(Ok(_)) => {}
            // A failed ping means the connection is gone; accept() reports it.
            Ok(Err(_)) => return std::future::pending().await,
            Err(_) => return,
        }
    }
}

fn is_should_rate_limit<B>(req: &Request<B>) -> bool {
    req.method() == http::Method::POST && req.uri().path() == SHOULD_RATE_LIMIT_PATH
}

/// Answers one `ShouldRateLimit` call on its stream; failures to send mean
/// the client reset the stream or the connection went away, and are dropped.
async fn should_rate_limit(
    limiter: Arc<Limiter>,
    req: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
) {
    let (parts, body) = req.into_parts();
    if let Some(status) = unsupported_encoding(&parts.headers) {
        let _ = send_status(&mut respond, &status);
        return;
    }
    let timeout = grpc_timeout(&parts.headers);
    let metadata = tonic::metadata::MetadataMap::from_headers(parts.headers);
    let answer = async {
        let msg = read_message(body).await?;
        // A body that is not a RateLimitRequest (bad wire format, strings
        // that are not UTF-8) is the client's error.
        let wire = crate::grpc::wire::RateLimitRequest::decode(msg)
            .map_err(|e| Status::invalid_argument(format!("invalid RateLimitRequest: {e}")))?;
        let req = crate::grpc::wire_request(&wire)?;
        crate::otel::should_rate_limit(
            &metadata,
            req.domain,
            req.descriptors.len(),
            crate::grpc::decide(&limiter, &req),
            crate::grpc::decision_outcome,
        )
        .await
    };
    // One poll function drives the answer, the `grpc-timeout` and the
    // stream's reset, without moving the answer's future again: a call the
    // client reset (Envoy's own timeout) is dropped where it waits, as hyper
    // drops a tonic call; the timer and the reset are only looked at when
    // the answer is not ready at once.
    // In a block: the answer's future (and a storage call it still waits
    // for) is dropped before anything is sent.
    let answer = {
        let mut answer = std::pin::pin!(answer);
        let mut expiry = std::pin::pin!(timeout.map(tokio::time::sleep));
        poll_fn(|cx| {
            if let Poll::Ready(a) = answer.as_mut().poll(cx) {
                return Poll::Ready(Some(a));
            }
            if let Some(sleep) = expiry.as_mut().as_pin_mut()
                && sleep.poll(cx).is_ready()
            {
                return Poll::Ready(Some(Err(Status::cancelled("Timeout expired"))));
            }
            respond.poll_reset(cx).map(|_| None)
        })
        .await
    };
    let Some(answer) = answer else { return };
    let _ = match answer {
        Ok(decision) => send_decision(&mut respond, decision),
        Err(status) => send_status(&mut respond, &status),
    };
}

/// The one length-prefixed message of a unary request body.
async fn read_message(mut body: RecvStream) -> Result<Bytes, Status> {
    let mut buf = BytesMut::new();
    let mut first: Option<Bytes> = None;
    while let Some(chunk) = body.data().await {
        let chunk = chunk.map_err(|e| Status::internal(format!("h2 protocol error: {e}")))?;
        let _ = body.flow_control().release_capacity(chunk.len());
        // Most requests arrive in one DATA frame: keep it without copying.
        if first.is_none() && buf.is_empty() {
            first = Some(chunk);
        } else {
            if let Some(f) = first.take() {
                buf.extend_from_slice(&f);
            }
            buf.extend_from_slice(&chunk);
        }
        let have = first.as_ref().map_or(buf.len(), Bytes::len);
        if have >= 5 {
            let head = first.as_deref().unwrap_or(&buf[..]);
            let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
            if len > MAX_MESSAGE_BYTES {
                return Err(Status::out_of_range(format!(
                    "Error, decoded message length too large: found {len} bytes, the limit is: {MAX_MESSAGE_BYTES} bytes"
                )));
            }
            // The whole message is here: what else the body carries is not
            // read (as tonic reads one message of a unary call), so a client
            // cannot make the server hold more than one message per call.
            if have >= 5 + len {
                break;
            }
        }
        // The frame that carried END_STREAM: no need to poll for the end.
        if body.is_end_stream() {
            break;
        }
    }
    let mut all = first.unwrap_or_else(|| buf.freeze());
    if all.len() < 5 {
        return Err(Status::internal("Missing request message."));
    }
    let flag = all[0];
    let len = u32::from_be_bytes([all[1], all[2], all[3], all[4]]) as usize;
    match flag {
        0 => {}
        // gRPC's compression spec: a compressed flag without a
        // `grpc-encoding` is INTERNAL (tonic's message).
        1 => {
            return Err(Status::internal(
                "protocol error: received message with compressed-flag but no grpc-encoding was specified",
            ));
        }
        f => {
            return Err(Status::internal(format!(
                "protocol error: received message with invalid compression flag: {f} (valid flags are 0 and 1), while sending request"
            )));
        }
    }
    all.advance(5);
    if all.len() < len {
        return Err(Status::internal("Missing request message."));
    }
    Ok(all.split_to(len))
}

/// `UNIMPLEMENTED` for a request body in a `grpc-encoding` other than
/// `identity` (no compression is enabled), with tonic's message and
/// `grpc-accept-encoding: identity`.
fn unsupported_encoding(headers: &HeaderMap) -> Option<Status> {
    let enc = headers.get(&GRPC_ENCODING)?;
    if enc.as_bytes() == b"identity" {
        return None;
    }
    let name = enc
        .to_str()
        .map_or_else(|_| format!("{:?}", enc.as_bytes()), str::to_owned);
    let mut status = Status::unimplemented(format!(
        "Content is compressed with `{name}` which isn't supported"
    ));
    status.metadata_mut().insert(
        "grpc-accept-encoding",
        tonic::metadata::MetadataValue::from_static("identity"),
    );
    Some(status)
}

/// The `grpc-timeout` of a request (gRPC over HTTP/2: at most 8 digits and
/// a unit `H`, `M`, `S`, `m`, `u`, `n`); `None` when absent or malformed, as
/// tonic treats it.
fn grpc_timeout(headers: &HeaderMap) -> Option<Duration> {
    let v = headers.get(&GRPC_TIMEOUT)?.to_str().ok()?;
    if v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (n, unit) = v.split_at(v.len() - 1);
    let n: u64 = n.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

fn grpc_headers() -> Response<()> {
    let mut r = Response::new(());
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    r
}

/// Sends the `RateLimitResponse` of `d` as the one response message with
/// `grpc-status: 0`: encoded straight from the decision, or through the
/// proto type when it carries dynamic metadata.
fn send_decision(
    respond: &mut SendResponse<Bytes>,
    d: crate::limiter::Decision,
) -> Result<(), h2::Error> {
    let Some(len) = crate::grpc::encoded_response_len(&d) else {
        return send_message(respond, &crate::grpc::response(d));
    };
    let mut buf = BytesMut::with_capacity(5 + len);
    buf.put_u8(0);
    buf.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    crate::grpc::encode_response(&d, &mut buf);
    send_framed(respond, buf)
}

/// Sends `msg` as the one response message with `grpc-status: 0`.
fn send_message(
    respond: &mut SendResponse<Bytes>,
    msg: &impl prost::Message,
) -> Result<(), h2::Error> {
    let len = msg.encoded_len();
    let mut buf = BytesMut::with_capacity(5 + len);
    buf.put_u8(0);
    buf.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    // Encoding into a buffer of the encoded length cannot fail.
    let _ = msg.encode(&mut buf);
    send_framed(respond, buf)
}

/// Sends `buf`, one length-prefixed message, with `grpc-status: 0`.
fn send_framed(respond: &mut SendResponse<Bytes>, buf: BytesMut) -> Result<(), h2::Error> {
    let mut stream = respond.send_response(grpc_headers(), false)?;
    stream.send_data(buf.freeze(), false)?;
    let mut trailers = HeaderMap::with_capacity(1);
    trailers.insert(GRPC_STATUS, HeaderValue::from_static("0"));
    stream.send_trailers(trailers)
}

/// Sends a trailers-only response carrying `status`.
fn send_status(respond: &mut SendResponse<Bytes>, status: &Status) -> Result<(), h2::Error> {
    let mut r = grpc_headers();
    if status.add_header(r.headers_mut()).is_err() {
        r.headers_mut()
            .insert("grpc-status", HeaderValue::from_static("13"));
    }
    respond.send_response(r, true).map(|_| ())
}

/// Hands a request for another path to tonic and streams its answer back
/// (health `Watch` streams included), until the body ends or the client
/// resets the stream.
async fn forward(mut routes: Routes, req: Request<RecvStream>, mut respond: SendResponse<Bytes>) {
    type Req = Request<tonic::body::Body>;
    let req: Req = req.map(|b| {
        tonic::body::Body::new(H2Body {
            inner: b,
            data_done: false,
        })
    });
    // The router is always ready, and never fails (unknown paths get
    // UNIMPLEMENTED).
    let Ok(()) = poll_fn(|cx| tonic::codegen::Service::<Req>::poll_ready(&mut routes, cx)).await;
    let Ok(resp) = routes.call(req).await;
    let (parts, mut body) = resp.into_parts();
    let end = body.is_end_stream();
    let Ok(mut send) = respond.send_response(Response::from_parts(parts, ()), end) else {
        return;
    };
    if end {
        return;
    }
    loop {
        let frame = tokio::select! {
            f = poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)) => f,
            _ = poll_fn(|cx| send.poll_reset(cx)) => return,
        };
        let frame: Frame<Bytes> = match frame {
            None => {
                let _ = send.send_data(Bytes::new(), true);
                return;
            }
            Some(Err(_)) => {
                send.send_reset(h2::Reason::INTERNAL_ERROR);
                return;
            }
            Some(Ok(f)) => f,
        };
        match frame.into_data() {
            Ok(mut data) => {
                while !data.is_empty() {
                    send.reserve_capacity(data.len());
                    // Capacity, or None once the client reset the stream.
                    let n = poll_fn(|cx| {
                        if send.poll_reset(cx).is_ready() {
                            return Poll::Ready(None);
                        }
                        send.poll_capacity(cx)
                    })
                    .await;
                    let Some(Ok(n)) = n else { return };
                    let chunk = data.split_to(n.min(data.len()));
                    if send.send_data(chunk, false).is_err() {
                        return;
                    }
                }
            }
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    let _ = send.send_trailers(trailers);
                    return;
                }
            }
        }
    }
}

/// An h2 request body as an [`http_body::Body`] for tonic, returning the
/// flow-control capacity of each chunk as it is read.
struct H2Body {
    inner: RecvStream,
    data_done: bool,
}

impl http_body::Body for H2Body {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        if !self.data_done {
            match self.inner.poll_data(cx) {
                Poll::Ready(Some(Ok(b))) => {
                    let _ = self.inner.flow_control().release_capacity(b.len());
                    return Poll::Ready(Some(Ok(Frame::data(b))));
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => self.data_done = true,
                Poll::Pending => return Poll::Pending,
            }
        }
        match self.inner.poll_trailers(cx) {
            Poll::Ready(Ok(Some(t))) => Poll::Ready(Some(Ok(Frame::trailers(t)))),
            Poll::Ready(Ok(None)) => Poll::Ready(None),
            Poll::Ready(Err(e)) => Poll::Ready(Some(Err(e))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse_like_the_spec_and_tonic() {
        let t = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert("grpc-timeout", HeaderValue::from_str(v).unwrap());
            grpc_timeout(&h)
        };
        assert_eq!(t("20m"), Some(Duration::from_millis(20)));
        assert_eq!(t("1S"), Some(Duration::from_secs(1)));
        assert_eq!(t("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(t("99999999n"), Some(Duration::from_nanos(99_999_999)));
        assert_eq!(t("123456789m"), None, "more than 8 digits");
        assert_eq!(t("5x"), None);
        assert_eq!(t("m"), None);
        assert_eq!(grpc_timeout(&HeaderMap::new()), None);
    }
}
