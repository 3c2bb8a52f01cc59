//! The listening ports of a serving process, one function each: the gRPC
//! port, the admin HTTP port, and the optional extra HTTP ports (the Go
//! service's metrics and debug ports). Each stops accepting when its `stop`
//! receiver fires and resolves once its connections have finished.

use crate::conn_limit::{LimitedListener, per_port_limit};
use crate::limiter::Limiter;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::broadcast;

/// Resolves when `stop` fires (or its sender is gone).
async fn stopped(mut stop: broadcast::Receiver<()>) {
    let _ = stop.recv().await;
}

/// The gRPC port ([`crate::grpc::serve`]) on `listener`, in TLS when `tls`
/// is given. TCP_NODELAY is set: without it, Nagle's algorithm holds small
/// HTTP/2 writes until the peer's delayed ACK (about 40 ms) and shows up as
/// p99.9 latency. A connection must send its opening bytes (the HTTP/2
/// preface, or a TLS ClientHello, which is longer) within the first-byte
/// timeout.
pub(super) async fn grpc(
    listener: TcpListener,
    limiter: Arc<Limiter>,
    routes: tonic::service::Routes,
    tls: Option<crate::tls::ServerTls>,
    stop: broadcast::Receiver<()>,
) {
    let tcp = LimitedListener::new(listener, per_port_limit(), true, "grpc")
        .opening_bytes(crate::conn_limit::HTTP2_PREFACE_BYTES)
        .into_stream();
    let limits = crate::grpc::PortLimits::DEFAULT;
    let Ok(()) = match &tls {
        Some(t) => {
            crate::grpc::serve(
                crate::tls::incoming(tcp, t),
                limiter,
                routes,
                limits,
                stopped(stop),
            )
            .await
        }
        None => crate::grpc::serve(tcp, limiter, routes, limits, stopped(stop)).await,
    };
}

/// The connection rules of every plain HTTP port (admin, Go metrics,
/// debug), in one place: the per-port cap, the first-byte timeout, the idle
/// timeout (an unfinished request head or body included), and shedding the
/// longest-silent connection when the port is full, so probes and scrapes
/// are answered under a connection flood.
fn http_listener(listener: TcpListener, port: &'static str) -> LimitedListener {
    LimitedListener::new(listener, per_port_limit(), false, port)
        .idle_timeout(crate::conn_limit::ADMIN_IDLE_TIMEOUT)
        .shed_idle_when_full()
}

/// Serves `router` on `listener` over HTTP/1.1 until `stop` fires, then
/// lets the open requests finish. HTTP/1.1 only: probes, Prometheus and
/// curl speak it, and an HTTP/2 admin port would let one connection hold
/// many unfinished bodies at once. A request head must arrive whole within
/// [`crate::conn_limit::HEAD_TIMEOUT`] (hyper's `header_read_timeout`), so a
/// head dribbled a byte at a time cannot hold a connection that the idle
/// timeout would keep.
///
/// # Errors
/// None so far: accept errors are retried by the listener.
async fn serve_http(
    mut listener: LimitedListener,
    router: axum::Router,
    stop: broadcast::Receiver<()>,
) -> std::io::Result<()> {
    use axum::serve::Listener as _;
    use hyper_util::rt::{TokioIo, TokioTimer};
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut stop = std::pin::pin!(stopped(stop));
    loop {
        let (io, _) = tokio::select! {
            conn = listener.accept() => conn,
            () = &mut stop => break,
        };
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(crate::conn_limit::HEAD_TIMEOUT)
            .serve_connection(
                TokioIo::new(io),
                hyper_util::service::TowerToHyperService::new(router.clone()),
            );
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// The admin HTTP port ([`crate::http::router_with`]), under
/// [`http_listener`]'s rules.
///
/// # Errors
/// The listener failed.
pub(super) async fn admin(
    listener: TcpListener,
    limiter: Arc<Limiter>,
    health: Option<Arc<crate::go::health::Health>>,
    stop: broadcast::Receiver<()>,
) -> std::io::Result<()> {
    serve_http(
        http_listener(listener, "http"),
        crate::http::router_with(limiter, health),
        stop,
    )
    .await
}

/// An extra plain HTTP port (`port` names it in metrics and logs) serving
/// `router` under [`http_listener`]'s rules; nothing when `listener` is
/// `None`.
///
/// # Errors
/// The listener failed.
pub(super) async fn extra(
    listener: Option<TcpListener>,
    router: impl FnOnce() -> axum::Router,
    port: &'static str,
    stop: broadcast::Receiver<()>,
) -> std::io::Result<()> {
    let Some(listener) = listener else {
        return Ok(());
    };
    serve_http(http_listener(listener, port), router(), stop).await
}
