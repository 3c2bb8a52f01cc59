//! Serving: takes already-bound listeners and a shutdown future (so tests bind
//! port 0 and never sleep), serves gRPC and HTTP, and drains on shutdown:
//! gRPC health turns NOT_SERVING, listeners stop accepting, in-flight
//! requests finish.

use crate::service::{Limiter, RateLimitGrpc};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

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

/// Serves until `shutdown` resolves, then drains and returns.
///
/// # Errors
/// A server failed to run.
pub async fn run(
    listeners: Listeners,
    limiter: Arc<Limiter>,
    shutdown: impl Future<Output = ()> + Send + 'static,
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
                limiter.storage().sweep();
                crate::metrics::upkeep();
            }
        })
    };

    let grpc = tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(RateLimitGrpc::server(limiter.clone()))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listeners.grpc), async move {
            let _ = grpc_stop.recv().await;
        });
    let http = axum::serve(listeners.http, crate::http::router(limiter.clone()))
        .with_graceful_shutdown(async move {
            let _ = http_stop.recv().await;
        })
        .into_future();

    let reporter = health_reporter.clone();
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
    });
    let (g, h) = tokio::join!(grpc, http);
    sweeper.abort();
    g?;
    h?;
    Ok(())
}
