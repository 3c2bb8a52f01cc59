//! Connection caps for the two listening ports.
//!
//! Each port accepts at most [`per_port_limit`] connections at once; past it
//! the port stops accepting (new connections wait in the kernel's backlog)
//! until one closes. Without a cap, a client holding thousands of idle
//! connections exhausts the process's file descriptors and then nothing works,
//! not even the liveness probe. The caps are per port, so a flood on the gRPC
//! port never starves the admin port. Accept errors (such as `EMFILE`) are
//! logged and retried after a short pause instead of ending the server.

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
#[derive(Debug)]
pub struct Limited {
    inner: TcpStream,
    _permit: OwnedSemaphorePermit,
}

impl AsyncRead for Limited {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
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
        }
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
