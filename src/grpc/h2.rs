//! HTTP/2 serving of a gRPC port on `h2` directly: the connection loop,
//! gRPC framing, `grpc-timeout`, the encoding check and trailers-only
//! errors. One unary method (a [`Unary`] handler) is answered inside each
//! connection's own task; every other path goes to the tonic fallback
//! ([`super::fallback`]) on a task of its own. Nothing here knows the rate
//! limit protos or the limiter.
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
//! bounds are one [`PortLimits`]. Keep-alive pings behave like hyper's: a
//! ping every `interval`, the connection closed when its pong takes longer
//! than `timeout`.

use super::PortLimits;
use super::fallback::forward;
use crate::conn_limit::RequestBytes;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use h2::RecvStream;
use h2::server::SendResponse;
use http::{HeaderMap, HeaderValue, Request, Response};
use std::collections::VecDeque;
use std::future::{Future, poll_fn};
use std::task::Poll;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tonic::Status;
use tonic::service::Routes;

/// A unary gRPC method answered in the connection's task.
pub(crate) trait Unary: Clone + Send + Sync + 'static {
    /// The method's path, `/package.Service/Method`.
    const PATH: &'static str;

    /// Answers one call: `msg` is the request message (the payload of its
    /// one gRPC frame), `headers` the request's headers (gRPC metadata).
    ///
    /// # Errors
    /// The gRPC status to answer with instead of a message.
    fn call(
        &self,
        msg: Bytes,
        headers: HeaderMap,
    ) -> impl Future<Output = Result<Framed, Status>> + Send + 'static;
}

/// A response message with its gRPC frame header (made by [`framed`]).
#[derive(Debug)]
pub(crate) struct Framed(BytesMut);

impl Framed {
    /// The message without its frame header.
    pub(crate) fn message(&self) -> &[u8] {
        &self.0[5..]
    }
}

/// The gRPC frame (uncompressed, length-prefixed) of a message of `len`
/// bytes that `encode` writes.
pub(crate) fn framed(len: usize, encode: impl FnOnce(&mut BytesMut)) -> Framed {
    let mut buf = BytesMut::with_capacity(5 + len);
    buf.put_u8(0);
    buf.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    encode(&mut buf);
    Framed(buf)
}

/// Serves connections from `incoming` until `shutdown` resolves, then stops
/// accepting, asks every connection to finish (HTTP/2 GOAWAY; calls in
/// flight complete) and returns when all are closed.
///
/// # Errors
/// Never: a connection that fails is logged at debug level and dropped, an
/// accept error is skipped (tonic's behaviour).
pub(crate) async fn serve<S, IO, H: Unary>(
    incoming: S,
    handler: H,
    fallback: Routes,
    limits: PortLimits,
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
                        let conn = serve_connection(io, handler.clone(), fallback.clone(), limits, stop_rx.clone());
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
/// turns true (then it is shut down gracefully). The client's HTTP/2
/// preface must arrive within [`crate::conn_limit::FIRST_BYTE_TIMEOUT`] of
/// the connection reaching here: the TCP listener checks that for plaintext
/// connections, and this also closes a TLS connection that completes its
/// handshake and then sends nothing.
///
/// # Errors
/// The HTTP/2 error that ended the connection.
async fn serve_connection<IO, H: Unary>(
    io: IO,
    handler: H,
    fallback: Routes,
    limits: PortLimits,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(), h2::Error>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let handshake = h2::server::Builder::new()
        .max_concurrent_streams(limits.max_concurrent_streams)
        // Streams a client resets before they are taken (Envoy cancelling
        // calls at its timeout while this connection has its 64 calls in
        // flight) close the connection past this count: h2's default of 20
        // would drop every call of a busy connection. Bounded like the
        // streams themselves.
        .max_pending_accept_reset_streams(limits.max_concurrent_streams as usize)
        .initial_window_size(limits.receive_window_bytes)
        .initial_connection_window_size(limits.receive_window_bytes)
        .max_frame_size(limits.max_frame_bytes)
        .max_header_list_size(limits.max_header_list_bytes)
        .max_send_buffer_size(limits.max_send_buffer_bytes)
        .handshake::<_, Bytes>(io);
    let Ok(conn) = tokio::time::timeout(crate::conn_limit::FIRST_BYTE_TIMEOUT, handshake).await
    else {
        tracing::debug!("gRPC connection closed: no HTTP/2 preface in time");
        return Ok(());
    };
    let mut conn = conn?;
    let keepalive = keepalive(conn.ping_pong(), limits.keepalive);
    let mut keepalive = std::pin::pin!(keepalive);
    // Borrowed, not moved: the receiver lives as long as the connection, so
    // `serve` waits for this connection to close.
    let stopped = stop.wait_for(|s| *s);
    let mut stopped = std::pin::pin!(stopped);
    let mut stopping = false;
    let mut calls: FuturesUnordered<Call> = FuturesUnordered::new();
    // Calls taken and not started yet, each holding its stream's share of
    // the process-wide budget: the calls of one read are all taken before
    // any is run, and past `max_in_flight_per_connection` they wait here.
    let mut pending: VecDeque<Pending> = VecDeque::new();
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
            // Every stream is taken as soon as it arrives, so that each is
            // counted in the process-wide budget from the start (its state,
            // its headers, later its answer): past the budget it is refused
            // at once with `RESOURCE_EXHAUSTED`, which frees its state.
            // Streams one connection holds are bounded by the streams
            // advertised.
            loop {
                match conn.poll_accept(cx) {
                    Poll::Ready(Some(Ok((req, mut respond)))) => {
                        let Some(held) = reserve_stream(&req) else {
                            let _ = send_status(&mut respond, &budget_used_up());
                            continue;
                        };
                        if req.method() == http::Method::POST && req.uri().path() == H::PATH {
                            pending.push_back((req, respond, held));
                        } else {
                            tokio::spawn(forward(fallback.clone(), req, respond, held));
                        }
                    }
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e)),
                    Poll::Ready(None) => return Poll::Ready(Ok(true)),
                    Poll::Pending => break,
                }
            }
            // At most `max_in_flight_per_connection` calls of one
            // connection are read and decided at once; the bytes of the
            // others stay in h2, bounded by flow control.
            // Each new call is polled once here: one decided at once (the
            // memory backend, a local-cache hit) never enters the set. One
            // that waits is moved in boxed, so the move copies a pointer,
            // and the set polls it again before it waits.
            let mut answered = false;
            while calls.len() < limits.max_in_flight_per_connection {
                let Some((req, respond, held)) = pending.pop_front() else {
                    break;
                };
                let mut call: Call = Box::pin(unary(handler.clone(), req, respond, limits, held));
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
    // The calls still in flight and those taken but not started finish
    // (their responses are already queued or will be), then the connection
    // flushes and closes.
    for (req, respond, held) in pending.drain(..) {
        calls.push(Box::pin(unary(handler.clone(), req, respond, limits, held)));
    }
    while calls.next().await.is_some() {}
    poll_fn(|cx| conn.poll_closed(cx)).await
}

// Header names built once, not parsed per lookup.
const GRPC_ENCODING: http::HeaderName = http::HeaderName::from_static("grpc-encoding");
const GRPC_TIMEOUT: http::HeaderName = http::HeaderName::from_static("grpc-timeout");
const GRPC_STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");

/// One unary call in flight on a connection.
type Call = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// A call taken from the connection and not started yet, with its stream's
/// share of the process-wide budget.
type Pending = (Request<RecvStream>, SendResponse<Bytes>, RequestBytes);

/// Bytes of the process-wide budget ([`crate::conn_limit`]) one open stream
/// holds from the moment it is taken until its answer is handed to HTTP/2
/// with the window to send it, besides its request headers and its message:
/// h2's state of the stream and its answer. Measured about 1.3 KiB for a
/// `ShouldRateLimit` call and 3.2 KiB for a reflection stream whose answers
/// are not read; 4 KiB covers both.
pub const STREAM_STATE_BYTES: usize = 4 << 10;

/// Longest an answer waits for the peer to grant the flow-control window
/// to send it (10 s); then the stream is reset (`CANCEL`) and its share of
/// the budget given back.
pub(crate) const ANSWER_WINDOW_TIMEOUT: Duration = Duration::from_secs(10);

/// The status of a call refused because the process-wide budget is used up.
fn budget_used_up() -> Status {
    Status::resource_exhausted(
        "the service's memory budget for requests being read is used up; retry later",
    )
}

/// Reserves an open stream's share of the process-wide budget:
/// [`STREAM_STATE_BYTES`] and its request head (each header's name and
/// value plus 32 bytes, as HPACK counts a header list), or `None` when the
/// budget cannot hold it (a health check then draws on the health
/// reserve).
fn reserve_stream<B>(req: &Request<B>) -> Option<RequestBytes> {
    let head: usize = req
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 32)
        .sum::<usize>()
        + req.uri().path().len();
    let bytes = STREAM_STATE_BYTES + head;
    crate::conn_limit::reserve_request_bytes(bytes).or_else(|| {
        (req.uri().path() == HEALTH_CHECK_PATH)
            .then(|| crate::conn_limit::reserve_health_bytes(bytes))
            .flatten()
    })
}

/// gRPC health's unary check: past the budget it draws on
/// [`crate::conn_limit::HEALTH_RESERVE_BYTES`], so probes keep answering.
const HEALTH_CHECK_PATH: &str = "/grpc.health.v1.Health/Check";

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

/// Answers one unary call on its stream; failures to send mean the client
/// reset the stream or the connection went away, and are dropped.
async fn unary<H: Unary>(
    handler: H,
    req: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
    limits: PortLimits,
    // The stream's share of the budget, held until its answer is sent.
    _stream: RequestBytes,
) {
    let (parts, body) = req.into_parts();
    if let Some(status) = unsupported_encoding(&parts.headers) {
        let _ = send_status(&mut respond, &status);
        return;
    }
    let timeout = grpc_timeout(&parts.headers);
    let headers = parts.headers;
    let answer = async {
        // The reservation is held until the call is decided.
        let (msg, _held) = read_message(body, limits.max_message_bytes).await?;
        handler.call(msg, headers).await
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
    match answer {
        Ok(framed) => send_framed(&mut respond, framed.0).await,
        Err(status) => {
            let _ = send_status(&mut respond, &status);
        }
    }
}

/// The bytes of one length-prefixed gRPC message as its DATA frames arrive.
/// A message in one frame is kept as that frame, without a copy; a message
/// in several frames is copied into one buffer that, once the 5-byte prefix
/// has declared the length, holds at most the whole message (its
/// capacity is what the request budget counts: grown frame by frame, a
/// buffer doubles and could hold twice the message).
#[derive(Default)]
struct MessageBuf {
    /// The first frame while it is the only one.
    first: Option<Bytes>,
    /// The frames so far, once there are several.
    buf: BytesMut,
}

impl MessageBuf {
    /// Appends one frame's bytes.
    fn push(&mut self, chunk: Bytes) {
        if self.first.is_none() && self.buf.is_empty() {
            self.first = Some(chunk);
            return;
        }
        if let Some(f) = self.first.take() {
            self.buf.extend_from_slice(&f);
        }
        self.buf.extend_from_slice(&chunk);
    }

    /// Bytes received so far (prefix included).
    fn len(&self) -> usize {
        self.first.as_ref().map_or(self.buf.len(), Bytes::len)
    }

    /// The message length the 5-byte prefix declares (bytes, prefix not
    /// included), once the prefix is here.
    fn declared_len(&self) -> Option<usize> {
        let head = self.first.as_deref().unwrap_or(&self.buf[..]);
        (head.len() >= 5).then(|| u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize)
    }

    /// Makes room for `total` bytes (prefix included) at once when they
    /// have not all arrived.
    fn reserve_message(&mut self, total: usize) {
        let have = self.len();
        if have >= total {
            return;
        }
        if let Some(f) = self.first.take() {
            self.buf.reserve(total);
            self.buf.extend_from_slice(&f);
        } else {
            self.buf.reserve(total - have);
        }
    }

    /// Bytes of memory the buffer holds for the message.
    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.first.as_ref().map_or(self.buf.capacity(), Bytes::len)
    }

    /// Everything received, as one buffer.
    fn into_bytes(self) -> Bytes {
        self.first.unwrap_or_else(|| self.buf.freeze())
    }
}

/// The one length-prefixed message of a unary request body, and its
/// reservation of the process-wide request budget (made when the length
/// prefix arrives: `RESOURCE_EXHAUSTED` when the budget cannot hold it).
async fn read_message(
    mut body: RecvStream,
    max_message_bytes: usize,
) -> Result<(Bytes, RequestBytes), Status> {
    let mut msg = MessageBuf::default();
    let mut held: Option<RequestBytes> = None;
    while let Some(chunk) = body.data().await {
        let chunk = chunk.map_err(|e| Status::internal(format!("h2 protocol error: {e}")))?;
        let _ = body.flow_control().release_capacity(chunk.len());
        msg.push(chunk);
        if let Some(len) = msg.declared_len() {
            if len > max_message_bytes {
                return Err(Status::out_of_range(format!(
                    "Error, decoded message length too large: found {len} bytes, the limit is: {max_message_bytes} bytes"
                )));
            }
            if held.is_none() {
                held = Some(
                    crate::conn_limit::reserve_request_bytes(5 + len).ok_or_else(budget_used_up)?,
                );
                msg.reserve_message(5 + len);
            }
            // The whole message is here: what else the body carries is not
            // read (as tonic reads one message of a unary call), so a client
            // cannot make the server hold more than one message per call.
            if msg.len() >= 5 + len {
                break;
            }
        }
        // The frame that carried END_STREAM: no need to poll for the end.
        if body.is_end_stream() {
            break;
        }
    }
    let mut all = msg.into_bytes();
    let Some(held) = held else {
        return Err(Status::internal("Missing request message."));
    };
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
    Ok((all.split_to(len), held))
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

/// Sends `buf`, one length-prefixed message, with `grpc-status: 0`.
async fn send_framed(respond: &mut SendResponse<Bytes>, buf: BytesMut) {
    let Ok(mut stream) = respond.send_response(grpc_headers(), false) else {
        return;
    };
    let len = buf.len();
    // The answer goes to h2 only with the window to send it, so h2 never
    // holds answers a peer does not take; until then it waits here, with the
    // stream's share of the budget, for at most ANSWER_WINDOW_TIMEOUT. With
    // window to spare (the usual case) h2 assigns it at once.
    stream.reserve_capacity(len);
    if stream.capacity() < len {
        let granted = poll_fn(|cx| {
            loop {
                if stream.capacity() >= len {
                    return Poll::Ready(true);
                }
                match stream.poll_capacity(cx) {
                    Poll::Ready(Some(Ok(_))) => {}
                    Poll::Ready(_) => return Poll::Ready(false),
                    Poll::Pending => return Poll::Pending,
                }
            }
        });
        match tokio::time::timeout(ANSWER_WINDOW_TIMEOUT, granted).await {
            Ok(true) => {}
            Ok(false) => return,
            Err(_) => {
                tracing::debug!("gRPC answer not sent: the peer granted no window in time");
                stream.send_reset(h2::Reason::CANCEL);
                return;
            }
        }
    }
    if stream.send_data(buf.freeze(), false).is_err() {
        return;
    }
    let mut trailers = HeaderMap::with_capacity(1);
    trailers.insert(GRPC_STATUS, HeaderValue::from_static("0"));
    let _ = stream.send_trailers(trailers);
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

    /// Frames of `frame` bytes carrying one message of `len` bytes after its
    /// 5-byte prefix, as a client sends them.
    fn frames(len: usize, frame: usize) -> Vec<Bytes> {
        let mut all = vec![0u8];
        all.extend_from_slice(&u32::try_from(len).unwrap().to_be_bytes());
        all.resize(5 + len, 7);
        all.chunks(frame).map(Bytes::copy_from_slice).collect()
    }

    #[test]
    fn a_message_in_many_frames_holds_no_more_than_its_declared_size() {
        for (len, frame) in [
            (2 << 20, 16 << 10),
            (100_000, 16 << 10),
            (70_000, 3),
            (40, 16 << 10),
        ] {
            let mut msg = MessageBuf::default();
            for chunk in frames(len, frame) {
                msg.push(chunk);
                if let Some(declared) = msg.declared_len() {
                    assert_eq!(declared, len);
                    msg.reserve_message(5 + declared);
                }
                assert!(
                    msg.capacity() <= 5 + len,
                    "{len} bytes in frames of {frame}: buffer holds {} after {} received",
                    msg.capacity(),
                    msg.len()
                );
            }
            let all = msg.into_bytes();
            assert_eq!(all.len(), 5 + len);
            assert!(all[5..].iter().all(|&b| b == 7), "bytes kept in order");
        }
    }

    #[test]
    fn a_message_in_one_frame_is_kept_without_a_copy() {
        let frame = frames(300, 16 << 10).remove(0);
        let at = frame.as_ptr();
        let mut msg = MessageBuf::default();
        msg.push(frame);
        msg.reserve_message(305);
        assert_eq!(msg.into_bytes().as_ptr(), at);
    }
}
