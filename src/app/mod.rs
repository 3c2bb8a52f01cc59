//! Serving: takes already-bound listeners and a shutdown future (so tests bind
//! port 0 and never sleep), serves gRPC and HTTP, and drains on shutdown:
//! gRPC health turns NOT_SERVING, listeners stop accepting, in-flight
//! requests finish.

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

/// Errors that stop the server (the gRPC port never fails as a whole: a
/// connection that fails is dropped on its own).
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// An HTTP server failed.
    #[error("HTTP server: {0}")]
    Http(#[from] std::io::Error),
}

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
    let options = Serving {
        grace,
        ..Serving::default()
    };
    serve(listeners, limiter, shutdown, options).await
}

/// What [`serve`] serves besides the two ports in plaintext (filled from
/// an [`App`], or with defaults by [`run`]).
#[derive(Debug)]
struct Serving {
    /// Longest wait for in-flight requests after shutdown (default [`DRAIN_GRACE`]).
    grace: Duration,
    /// TLS on the gRPC port; its certificate files are re-read every
    /// [`crate::tls::RELOAD_INTERVAL`] while serving.
    tls: Option<crate::tls::ServerTls>,
    /// Health state; `None` = native health, nothing shared.
    health: Option<Arc<crate::go::health::Health>>,
    /// After `shutdown` resolves, how long health reports unhealthy while
    /// every port keeps serving, before the drain starts.
    shutdown_delay: Duration,
    /// Listener of the Go-named metrics and its path ([`crate::go::metrics`]).
    go_metrics: Option<(TcpListener, String)>,
    /// Listener of the plain-text `/rlconfig` (the Go debug port).
    debug: Option<TcpListener>,
    /// Serve gRPC server reflection ([`crate::grpc::reflection`]) on the gRPC port.
    reflection: bool,
}

impl Default for Serving {
    fn default() -> Self {
        Self {
            grace: DRAIN_GRACE,
            tls: None,
            health: None,
            shutdown_delay: Duration::ZERO,
            go_metrics: None,
            debug: None,
            reflection: true,
        }
    }
}

/// gRPC health service names reported with the RateLimitService's own: the
/// Go service's `ratelimit` and the server-wide `""`.
pub const HEALTH_SERVICE_NAMES: [&str; 2] = ["", "ratelimit"];

/// [`run_with_grace`] with TLS, the Go health semantics, a shutdown delay
/// and the extra listeners of `options`.
///
/// # Errors
/// A server failed to run.
async fn serve(
    listeners: Listeners,
    limiter: Arc<Limiter>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    options: Serving,
) -> Result<(), AppError> {
    let Serving {
        grace,
        tls,
        health,
        shutdown_delay,
        go_metrics,
        debug,
        reflection,
    } = options;
    let go_mode = health
        .as_ref()
        .is_some_and(|h| matches!(h.mode(), crate::settings::HealthMode::Go { .. }));
    let (reporter, health_service) = grpc_health(go_mode).await;

    let mut tasks = tasks::Tasks::default();
    tasks.push(tasks::sweeper(limiter.clone()));
    if let Some(t) = &tls {
        tasks.push(t.spawn_reloader(crate::tls::RELOAD_INTERVAL));
    }
    if let Some(h) = health.clone().filter(|_| go_mode) {
        tasks.push(tasks::go_health(h, reporter.clone(), limiter.clone()));
    }

    let (stop_tx, _) = tokio::sync::broadcast::channel::<()>(1);
    let grpc = ports::grpc(
        listeners.grpc,
        limiter.clone(),
        crate::grpc::fallback_routes(health_service, limiter.clone(), reflection),
        tls,
        stop_tx.subscribe(),
    );
    let http = ports::admin(
        listeners.http,
        limiter.clone(),
        health.clone(),
        stop_tx.subscribe(),
    );
    let (metrics_listener, metrics_path) = match go_metrics {
        Some((l, path)) => (Some(l), path),
        None => (None, String::new()),
    };
    let metrics = ports::extra(
        metrics_listener,
        move || crate::go::metrics::router(&metrics_path),
        "metrics",
        stop_tx.subscribe(),
    );
    let debug = ports::extra(
        debug,
        {
            let l = limiter.clone();
            move || crate::go::rlconfig::router(l)
        },
        "debug",
        stop_tx.subscribe(),
    );

    let (draining_tx, draining_rx) = tokio::sync::oneshot::channel::<()>();
    drain::spawn(
        shutdown,
        limiter.clone(),
        health,
        reporter,
        shutdown_delay,
        stop_tx,
        draining_tx,
    );
    let servers = async { tokio::join!(grpc, http, metrics, debug) };
    let ((), h, m, d) = tokio::select! {
        r = servers => r,
        () = drain::deadline(draining_rx, grace) => {
            tracing::warn!(?grace, "drain grace period elapsed; closing the remaining connections");
            return Ok(());
        }
    };
    drop(tasks);
    h?;
    m?;
    d?;
    Ok(())
}

/// The gRPC health service and its reporter, with the RateLimitService's
/// name and [`HEALTH_SERVICE_NAMES`] SERVING; in Go mode `ratelimit` starts
/// NOT_SERVING and follows the Go health state (a task of [`tasks`]).
async fn grpc_health(
    go_mode: bool,
) -> (
    tonic_health::server::HealthReporter,
    tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>,
) {
    let (reporter, service) = tonic_health::server::health_reporter();
    for name in HEALTH_SERVICE_NAMES
        .into_iter()
        .chain([crate::grpc::reflection::RATE_LIMIT_SERVICE])
    {
        let status = if go_mode && name == "ratelimit" {
            tonic_health::ServingStatus::NotServing
        } else {
            tonic_health::ServingStatus::Serving
        };
        reporter.set_service_status(name, status).await;
    }
    (reporter, service)
}

mod drain;
mod ports;
mod setup;
mod storage;
mod tasks;
pub use setup::{App, ExtraListeners, reload_on_sighup, shutdown_signal};
pub use storage::build_storage;
pub use tasks::{GO_HEALTH_INTERVAL, SWEEP_INTERVAL};
