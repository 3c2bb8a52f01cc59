//! Serving: takes already-bound listeners and a shutdown future (so tests bind
//! port 0 and never sleep), serves gRPC and HTTP, and drains on shutdown:
//! gRPC health turns NOT_SERVING, listeners stop accepting, in-flight
//! requests finish.

use crate::conn_limit::{LimitedListener, per_port_limit};
use crate::grpc::RateLimitGrpc;
use crate::limiter::Limiter;
use crate::settings::DRAIN_GRACE;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// Bound listeners for the two ports.
#[derive(Debug)]
pub struct Listeners {
    /// gRPC: RateLimitService and grpc.health.v1.Health.
    pub grpc: TcpListener,
    /// HTTP admin API.
    pub http: TcpListener,
}

/// Errors that stop the server.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Grpc(#[from] tonic::transport::Error),
    /// The HTTP server failed.
    #[error("HTTP server: {0}")]
    Http(#[from] std::io::Error),
}

/// How often the storage's housekeeping (e.g. memory bucket eviction) and
/// the metrics upkeep (draining histogram samples) run.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(5);

/// Serves until `shutdown` resolves, then drains for at most
/// [`DRAIN_GRACE`] and returns ([`run_with_grace`] with the default grace).
///
/// # Errors
/// A server failed to run.
pub async fn run(
    listeners: Listeners,
    limiter: Arc<Limiter>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AppError> {
    run_with_grace(listeners, limiter, shutdown, DRAIN_GRACE).await
}

/// Serves until `shutdown` resolves, then drains: gRPC health turns
/// NOT_SERVING, the listeners stop accepting, and in-flight requests get up
/// to `grace` to finish. Connections still open after `grace` (e.g. a client
/// holding a `grpc.health.v1.Health/Watch` stream, which never ends by
/// itself) are dropped, so shutdown is bounded.
///
/// # Errors
/// A server failed to run.
pub async fn run_with_grace(
    listeners: Listeners,
    limiter: Arc<Limiter>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> Result<(), AppError> {
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer<RateLimitGrpc>>().await;
    health_reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;

    let (stop_tx, _) = tokio::sync::broadcast::channel::<()>(1);
    let mut grpc_stop = stop_tx.subscribe();
    let mut http_stop = stop_tx.subscribe();

    let sweeper = {
        let limiter = limiter.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SWEEP_INTERVAL);
            loop {
                tick.tick().await;
                // Off the async workers: sweeping a million buckets takes tens
                // of milliseconds, which requests queued on this worker would wait.
                let l = limiter.clone();
                let _ = tokio::task::spawn_blocking(move || {
                    l.storage().sweep();
                    crate::metrics::upkeep();
                })
                .await;
            }
        })
    };

    // Dead peers are found by HTTP/2 pings; each port holds a bounded number
    // of connections (crate::conn_limit). ShouldRateLimit is served on h2
    // directly (crate::grpc_h2), health and any other path by tonic.
    // TCP_NODELAY: without it, Nagle's algorithm holds small HTTP/2 writes
    // until the peer's delayed ACK (about 40 ms) and shows up as p99.9 latency.
    let routes = tonic::service::Routes::new(health_service)
        .add_service(RateLimitGrpc::server(limiter.clone()));
    let grpc = crate::grpc_h2::serve(
        LimitedListener::new(listeners.grpc, per_port_limit(), true, "grpc").into_stream(),
        limiter.clone(),
        routes,
        crate::grpc_h2::Options {
            keepalive: Some((Duration::from_secs(30), Duration::from_secs(10))),
        },
        async move {
            let _ = grpc_stop.recv().await;
        },
    );
    let http = axum::serve(
        LimitedListener::new(listeners.http, per_port_limit(), false, "http"),
        crate::http::router(limiter.clone()),
    )
    .with_graceful_shutdown(async move {
        let _ = http_stop.recv().await;
    })
    .into_future();

    let reporter = health_reporter.clone();
    let (draining_tx, draining_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        shutdown.await;
        tracing::info!("shutting down: draining in-flight requests");
        reporter
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        reporter
            .set_not_serving::<envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer<RateLimitGrpc>>()
            .await;
        let _ = stop_tx.send(());
        let _ = draining_tx.send(());
    });
    let servers = async { tokio::join!(grpc, http) };
    let deadline = async {
        if draining_rx.await.is_ok() {
            tokio::time::sleep(grace).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    let (g, h) = tokio::select! {
        r = servers => r,
        () = deadline => {
            tracing::warn!(?grace, "drain grace period elapsed; closing the remaining connections");
            sweeper.abort();
            return Ok(());
        }
    };
    sweeper.abort();
    let Ok(()) = g;
    h?;
    Ok(())
}

mod setup;
pub use setup::{App, build_storage, reload_on_sighup, shutdown_signal};
