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

/// The admin HTTP port ([`crate::http::router_with`]): idle connections
/// time out, and the idle ones are shed when the port is full.
///
/// # Errors
/// The listener failed.
pub(super) async fn admin(
    listener: TcpListener,
    limiter: Arc<Limiter>,
    health: Option<Arc<crate::go::health::Health>>,
    stop: broadcast::Receiver<()>,
) -> std::io::Result<()> {
    axum::serve(
        LimitedListener::new(listener, per_port_limit(), false, "http")
            .idle_timeout(crate::conn_limit::ADMIN_IDLE_TIMEOUT)
            .shed_idle_when_full(),
        crate::http::router_with(limiter, health),
    )
    .with_graceful_shutdown(stopped(stop))
    .await
}

/// An extra plain HTTP port (`port` names it in metrics and logs) serving
/// `router`; nothing when `listener` is `None`.
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
    axum::serve(
        LimitedListener::new(listener, per_port_limit(), false, port),
        router(),
    )
    .with_graceful_shutdown(stopped(stop))
    .await
}
