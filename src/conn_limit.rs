//! Connection caps for the two listening ports.
//!
//! Each port accepts at most [`per_port_limit`] connections at once; past it
//! the port stops accepting (new connections wait in the kernel's backlog)
//! until one closes. Without a cap, a client holding thousands of idle
//! connections exhausts the process's file descriptors and then nothing works,
//! not even the liveness probe. The caps are per port, so a flood on the gRPC
//! port never starves the admin port. Accept errors (such as `EMFILE`) are
//! logged and retried after a short pause instead of ending the server.
//!
//! A connection must send its first bytes within [`FIRST_BYTE_TIMEOUT`]
//! (Envoy sends the HTTP/2 preface, curl its request line, at once);
//! otherwise it is closed, so connections that never speak cannot hold the
//! cap. After the first bytes there is no idle limit: Envoy keeps its gRPC
//! connection open between requests, and dead peers are found by HTTP/2
//! pings.

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

/// A TCP stream holding one of its port's connection permits until dropped.
/// Reading fails with `TimedOut` if no byte arrived within the first-byte
/// deadline.
#[derive(Debug)]
pub struct Limited {
    inner: TcpStream,
    _permit: OwnedSemaphorePermit,
    /// Until the first bytes arrive: when the connection is given up.
    first_byte: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl AsyncRead for Limited {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Some(deadline) = self.first_byte.as_mut() {
            match &r {
                Poll::Ready(Ok(())) if buf.filled().len() > before => self.first_byte = None,
                Poll::Pending if deadline.as_mut().poll(cx).is_ready() => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no bytes from the client within the first-byte timeout",
                    )));
                }
                _ => {}
            }
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
        }
    }

    /// Replaces the time a new connection has to send its first bytes
    /// (default [`FIRST_BYTE_TIMEOUT`]).
    #[must_use]
    pub fn first_byte_timeout(mut self, timeout: Duration) -> Self {
        self.first_byte_timeout = timeout;
        self
    }

    /// The next connection, once a permit is free. Never fails: accept errors
    /// are logged and retried.
    pub async fn next(&mut self) -> (Limited, SocketAddr) {
        let permit = match self.permits.clone().acquire_owned().await {
            Ok(p) => p,
            // The semaphore is never closed; wait forever rather than panic.
            Err(_) => std::future::pending().await,
        };
        loop {
            match self.inner.accept().await {
                Ok((stream, addr)) => {
                    if self.nodelay {
                        let _ = stream.set_nodelay(true);
                    }
                    return (
                        Limited {
                            inner: stream,
                            _permit: permit,
                            first_byte: Some(Box::pin(tokio::time::sleep(self.first_byte_timeout))),
                        },
                        addr,
                    );
                }
                Err(e) => {
                    tracing::warn!(port = self.port, error = %e, "accept failed; retrying");
                    tokio::time::sleep(ACCEPT_RETRY).await;
                }
            }
        }
    }

    /// The stream of connections, for tonic's `serve_with_incoming`.
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
