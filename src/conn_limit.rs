//! Connection caps for the listening ports, and the process-wide budget of
//! buffered request bytes ([`reserve_request_bytes`]).
//!
//! Each port accepts at most [`per_port_limit`] connections at once; past it
//! the port stops accepting (new connections wait in the kernel's backlog)
//! until one closes. Without a cap, a client holding thousands of idle
//! connections exhausts the process's file descriptors and then nothing works,
//! not even the liveness probe. The caps are per port, so a flood on the gRPC
//! port never starves the admin port. Accept errors (such as `EMFILE`) are
//! logged and retried after a short pause instead of ending the server.
//!
//! A connection must send its opening bytes within [`FIRST_BYTE_TIMEOUT`]
//! (Envoy sends the whole HTTP/2 preface, [`HTTP2_PREFACE_BYTES`], curl its
//! request line, at once); otherwise it is closed, so connections that never
//! speak, or send one byte and stop, cannot hold the cap. On the gRPC port
//! there is no idle limit after that: Envoy keeps its connection open
//! between requests, and dead peers are found by HTTP/2 pings. Every HTTP
//! port (admin, Go metrics, debug; `app::ports`) closes a connection that
//! sends nothing for [`ADMIN_IDLE_TIMEOUT`] (an unfinished request head or
//! body included) or whose request head takes longer than
//! [`HEAD_TIMEOUT`] in all, and, when at its cap, makes room for a new
//! connection by closing the one silent for the longest, so probes and
//! scrapes are answered under a connection flood.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Upper bound of the per-port cap.
pub const MAX_PER_PORT: usize = 10_000;
const ACCEPT_RETRY: Duration = Duration::from_millis(100);
/// Time a new connection has to send its first bytes.
pub const FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections one port may hold: half of the file descriptors the process may
/// open (`RLIMIT_NOFILE`, minus a reserve for Redis, config files and logs),
/// at most [`MAX_PER_PORT`], at least 16.
#[must_use]
pub fn per_port_limit() -> usize {
    let soft = open_files_soft_limit().unwrap_or(1024);
    (soft.saturating_sub(128) / 2).clamp(16, MAX_PER_PORT)
}

/// The soft `RLIMIT_NOFILE`, read from `/proc/self/limits` (the crate forbids
/// `unsafe`, so no `getrlimit`); `None` where procfs is not there or says
/// "unlimited".
fn open_files_soft_limit() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace()
        .find_map(|w| w.parse::<usize>().ok())
}

/// Bytes the HTTP/2 client preface takes (`PRI * HTTP/2.0...`): on the gRPC
/// port, all of them must arrive within the first-byte timeout, so a
/// connection that sends one byte and stops is closed too.
pub const HTTP2_PREFACE_BYTES: usize = 24;

/// On the admin port: the longest a connection may go without sending a
/// byte once it has spoken (an unfinished request head or body, or an idle
/// keep-alive connection). Prometheus and probes send a whole request at
/// once; a closed keep-alive connection just reconnects.
pub const ADMIN_IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// On the HTTP ports: the longest a request head (request line and
/// headers) may take to arrive whole, however it trickles in.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

/// A TCP stream holding one of its port's connection permits until dropped.
/// Reading fails with `TimedOut` if the opening bytes did not arrive within
/// the first-byte deadline or (with an idle timeout) no byte arrived for that
/// long, and with `ConnectionAborted` once the listener shed it to make room.
#[derive(Debug)]
pub struct Limited {
    inner: TcpStream,
    _permit: OwnedSemaphorePermit,
    /// When the connection is given up if no (more) bytes arrive.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Opening bytes still expected before the first-byte deadline lifts.
    opening_left: usize,
    /// Re-armed after every read once the opening bytes arrived.
    idle: Option<Duration>,
    /// This connection's entry in its port's registry, where the listener
    /// may shed it.
    slot: Option<(Arc<Slot>, Arc<Slots>)>,
}

impl Drop for Limited {
    fn drop(&mut self) {
        if let Some((slot, slots)) = &self.slot {
            slots.map.lock().remove(&slot.id);
        }
    }
}

/// One connection as the shedding listener sees it.
#[derive(Debug)]
struct Slot {
    id: u64,
    /// Milliseconds since the registry's origin of the last read with bytes.
    last_read_ms: std::sync::atomic::AtomicU64,
    shed: std::sync::atomic::AtomicBool,
    waker: parking_lot::Mutex<Option<std::task::Waker>>,
}

/// The open connections of a port that sheds.
#[derive(Debug)]
struct Slots {
    origin: tokio::time::Instant,
    next_id: std::sync::atomic::AtomicU64,
    map: parking_lot::Mutex<std::collections::HashMap<u64, Arc<Slot>>>,
}

impl Slots {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn add(&self) -> Arc<Slot> {
        use std::sync::atomic::Ordering::Relaxed;
        let slot = Arc::new(Slot {
            id: self.next_id.fetch_add(1, Relaxed),
            last_read_ms: self.now_ms().into(),
            shed: false.into(),
            waker: parking_lot::Mutex::new(None),
        });
        self.map.lock().insert(slot.id, slot.clone());
        slot
    }

    /// Closes the connection that read nothing for the longest (the oldest
    /// on ties; not one shed already): its next read fails, its server task ends and its
    /// permit frees. False when there is none.
    fn shed_oldest(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let victim = self
            .map
            .lock()
            .values()
            .filter(|s| !s.shed.load(Relaxed))
            .min_by_key(|s| (s.last_read_ms.load(Relaxed), s.id))
            .cloned();
        let Some(v) = victim else { return false };
        v.shed.store(true, Relaxed);
        if let Some(w) = v.waker.lock().take() {
            w.wake();
        }
        true
    }
}

impl AsyncRead for Limited {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        use std::sync::atomic::Ordering::Relaxed;
        if let Some((slot, _)) = &self.slot {
            if slot.shed.load(Relaxed) {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "closed to make room for a new connection (the port is at its cap)",
                )));
            }
            *slot.waker.lock() = Some(cx.waker().clone());
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        match &r {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                let n = buf.filled().len() - before;
                if let Some((slot, slots)) = &self.slot {
                    slot.last_read_ms.store(slots.now_ms(), Relaxed);
                }
                self.opening_left = self.opening_left.saturating_sub(n);
                if self.opening_left == 0 {
                    match self.idle {
                        Some(idle) => {
                            let at = tokio::time::Instant::now() + idle;
                            if let Some(d) = self.deadline.as_mut() {
                                d.as_mut().reset(at);
                            } else {
                                self.deadline = Some(Box::pin(tokio::time::sleep_until(at)));
                            }
                        }
                        None => self.deadline = None,
                    }
                }
            }
            Poll::Pending => {
                let opening = self.opening_left > 0;
                if let Some(deadline) = self.deadline.as_mut()
                    && deadline.as_mut().poll(cx).is_ready()
                {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        if opening {
                            "the client's opening bytes did not arrive within the first-byte timeout"
                        } else {
                            "no bytes from the client within the idle timeout"
                        },
                    )));
                }
            }
            _ => {}
        }
        r
    }
}

impl AsyncWrite for Limited {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl tonic::transport::server::Connected for Limited {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// A listener that holds at most `limit` connections open at once.
#[derive(Debug)]
pub struct LimitedListener {
    inner: TcpListener,
    permits: Arc<Semaphore>,
    nodelay: bool,
    port: &'static str,
    first_byte_timeout: Duration,
    opening_bytes: usize,
    idle: Option<Duration>,
    /// With [`LimitedListener::shed_idle_when_full`]: the open connections.
    shed: Option<Arc<Slots>>,
}

impl LimitedListener {
    /// Wraps `inner`; `nodelay` sets `TCP_NODELAY` on accepted streams;
    /// `port` names the port in logs.
    #[must_use]
    pub fn new(inner: TcpListener, limit: usize, nodelay: bool, port: &'static str) -> Self {
        Self {
            inner,
            permits: Arc::new(Semaphore::new(limit.max(1))),
            nodelay,
            port,
            first_byte_timeout: FIRST_BYTE_TIMEOUT,
            opening_bytes: 1,
            idle: None,
            shed: None,
        }
    }

    /// Replaces the time a new connection has to send its opening bytes
    /// (default [`FIRST_BYTE_TIMEOUT`]).
    #[must_use]
    pub fn first_byte_timeout(mut self, timeout: Duration) -> Self {
        self.first_byte_timeout = timeout;
        self
    }

    /// Bytes a new connection must send within the first-byte timeout
    /// (default 1; [`HTTP2_PREFACE_BYTES`] on the gRPC port).
    #[must_use]
    pub fn opening_bytes(mut self, bytes: usize) -> Self {
        self.opening_bytes = bytes.max(1);
        self
    }

    /// After the opening bytes, closes a connection that sends nothing for
    /// `idle` (a read waiting longer fails with `TimedOut`).
    #[must_use]
    pub fn idle_timeout(mut self, idle: Duration) -> Self {
        self.idle = Some(idle);
        self
    }

    /// When the port is at its cap and a new connection arrives, closes the
    /// open connection that has sent nothing for the longest instead of
    /// leaving the new one waiting: a flood of silent or trickling
    /// connections cannot keep a probe (which sends its request at once)
    /// from being answered.
    #[must_use]
    pub fn shed_idle_when_full(mut self) -> Self {
        self.shed = Some(Arc::new(Slots {
            origin: tokio::time::Instant::now(),
            next_id: 0.into(),
            map: parking_lot::Mutex::new(std::collections::HashMap::new()),
        }));
        self
    }

    fn wrap(&self, stream: TcpStream, permit: OwnedSemaphorePermit) -> Limited {
        if self.nodelay {
            let _ = stream.set_nodelay(true);
        }
        Limited {
            inner: stream,
            _permit: permit,
            deadline: Some(Box::pin(tokio::time::sleep(self.first_byte_timeout))),
            opening_left: self.opening_bytes,
            idle: self.idle,
            slot: self.shed.as_ref().map(|s| (s.add(), s.clone())),
        }
    }

    async fn accept_retrying(&self) -> (TcpStream, SocketAddr) {
        loop {
            match self.inner.accept().await {
                Ok(c) => return c,
                Err(e) => {
                    tracing::warn!(port = self.port, error = %e, "accept failed; retrying");
                    tokio::time::sleep(ACCEPT_RETRY).await;
                }
            }
        }
    }

    /// The next connection, once a permit is free (or, when shedding, once
    /// the longest-silent connection made room). Never fails: accept errors
    /// are logged and retried.
    pub async fn next(&mut self) -> (Limited, SocketAddr) {
        let Some(slots) = self.shed.clone() else {
            let permit = match self.permits.clone().acquire_owned().await {
                Ok(p) => p,
                // The semaphore is never closed; wait forever rather than panic.
                Err(_) => std::future::pending().await,
            };
            let (stream, addr) = self.accept_retrying().await;
            return (self.wrap(stream, permit), addr);
        };
        let (stream, addr) = self.accept_retrying().await;
        let permit = loop {
            if let Ok(p) = self.permits.clone().try_acquire_owned() {
                break p;
            }
            let shed = slots.shed_oldest();
            let wait = if shed { ACCEPT_RETRY } else { Duration::MAX };
            match tokio::time::timeout(wait, self.permits.clone().acquire_owned()).await {
                Ok(Ok(p)) => break p,
                Ok(Err(_)) => std::future::pending().await,
                Err(_) => {}
            }
        };
        (self.wrap(stream, permit), addr)
    }

    /// The stream of connections, for [`crate::grpc::serve`].
    pub fn into_stream(self) -> impl futures::Stream<Item = io::Result<Limited>> + Send + 'static {
        futures::stream::unfold(self, |mut l| async move {
            let (c, _) = l.next().await;
            Some((Ok(c), l))
        })
    }
}

impl axum::serve::Listener for LimitedListener {
    type Io = Limited;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        self.next().await
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// The default of [`set_buffered_request_budget`]: 256 MiB, so that a
/// process under the Kubernetes example's 512 Mi memory limit keeps room
/// for its buckets and its own working set.
pub const DEFAULT_BUFFERED_REQUEST_BYTES: usize = 256 << 20;

/// The process-wide budget of request bytes held while calls are read and
/// decided, on every port: every stream on the gRPC port reserves its state
/// and request head (`grpc::STREAM_STATE_BYTES` plus the headers) from the
/// moment it is taken until its answer is handed to HTTP/2 with the window
/// to send it, a gRPC call also its message's declared length (5 + the
/// length in its prefix) when that prefix arrives, an HTTP request to the
/// admin port its `Content-Length` (or the 2 MiB body limit when it has
/// none) before its body is read. Past the budget new streams and calls are
/// refused (gRPC `RESOURCE_EXHAUSTED`, HTTP 503) and those already admitted
/// finish; a reservation is given back when its stream or call ends. So
/// however many connections hold unfinished bodies or answers they do not
/// read, what they make the process hold stays under the budget (plus each
/// connection's HTTP/2 receive window that is not read yet).
static BUFFERED_REQUEST_LIMIT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
/// Bytes reserved now against [`BUFFERED_REQUEST_LIMIT`] (one atomic: no
/// lock on the request path).
static BUFFERED_REQUEST_USED: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

/// Sets the process-wide budget of buffered request bytes. The first call
/// wins; before any, the budget is [`DEFAULT_BUFFERED_REQUEST_BYTES`].
/// Returns whether this call set it.
pub fn set_buffered_request_budget(bytes: usize) -> bool {
    BUFFERED_REQUEST_LIMIT.set(bytes).is_ok()
}

/// Bytes of the process-wide request budget (or of the health reserve)
/// held by one call; given back when dropped.
#[derive(Debug)]
pub struct RequestBytes {
    bytes: usize,
    pool: &'static std::sync::atomic::AtomicUsize,
}

impl Drop for RequestBytes {
    fn drop(&mut self) {
        self.pool
            .fetch_sub(self.bytes, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Takes `bytes` from `pool` when it stays at most `limit`.
fn take(
    pool: &'static std::sync::atomic::AtomicUsize,
    limit: usize,
    bytes: usize,
) -> Option<RequestBytes> {
    use std::sync::atomic::Ordering::Relaxed;
    pool.fetch_update(Relaxed, Relaxed, |used| {
        used.checked_add(bytes).filter(|&after| after <= limit)
    })
    .ok()
    .map(|_| RequestBytes { bytes, pool })
}

/// Reserves `bytes` of the process-wide request budget, or `None` when
/// that many are not free now (the call is to be refused, never queued;
/// counted in `bucket_rls_memory_budget_refusals_total`).
#[must_use]
pub fn reserve_request_bytes(bytes: usize) -> Option<RequestBytes> {
    let limit = *BUFFERED_REQUEST_LIMIT.get_or_init(|| DEFAULT_BUFFERED_REQUEST_BYTES);
    let held = take(&BUFFERED_REQUEST_USED, limit, bytes);
    if held.is_none() {
        metrics::counter!(crate::metrics::MEMORY_BUDGET_REFUSALS).increment(1);
    }
    held
}

/// Bytes set aside for gRPC health checks (`grpc.health.v1.Health/Check`)
/// when the request budget is used up (1 MiB, about 200 checks at once): a
/// flood that fills the budget does not also fail the liveness probes of a
/// service that is still serving.
pub const HEALTH_RESERVE_BYTES: usize = 1 << 20;

/// Bytes of [`HEALTH_RESERVE_BYTES`] held now.
static HEALTH_RESERVE_USED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Reserves `bytes` for one health check from the health reserve, for when
/// [`reserve_request_bytes`] refused them; `None` when the reserve is used
/// up too.
#[must_use]
pub fn reserve_health_bytes(bytes: usize) -> Option<RequestBytes> {
    take(&HEALTH_RESERVE_USED, HEALTH_RESERVE_BYTES, bytes)
}
