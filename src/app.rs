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
    let options = RunOptions {
        grace,
        ..RunOptions::default()
    };
    run_with(listeners, limiter, shutdown, options).await
}

/// What [`run_with`] serves besides the two ports in plaintext.
#[derive(Debug)]
pub struct RunOptions {
    /// Longest wait for in-flight requests after shutdown (default [`DRAIN_GRACE`]).
    pub grace: Duration,
    /// TLS on the gRPC port; its certificate files are re-read every
    /// [`crate::tls::RELOAD_INTERVAL`] while serving.
    pub tls: Option<crate::tls::ServerTls>,
    /// Health state; `None` = native health, nothing shared.
    pub health: Option<Arc<crate::go::health::Health>>,
    /// After `shutdown` resolves, how long health reports unhealthy while
    /// every port keeps serving, before the drain starts.
    pub shutdown_delay: Duration,
    /// Listener of the Go-named metrics and its path ([`crate::go::metrics`]).
    pub go_metrics: Option<(TcpListener, String)>,
    /// Listener of the plain-text `/rlconfig` (the Go debug port).
    pub debug: Option<TcpListener>,
    /// Serve gRPC server reflection ([`crate::reflection`]) on the gRPC port.
    pub reflection: bool,
}

impl Default for RunOptions {
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

/// How often the `ratelimit` gRPC health status is brought in line with
/// the Go health state ([`crate::go::health::Health::check_go`]).
pub const GO_HEALTH_INTERVAL: Duration = Duration::from_secs(1);

/// gRPC health service names reported with the RateLimitService's own: the
/// Go service's `ratelimit` and the server-wide `""`.
pub const HEALTH_SERVICE_NAMES: [&str; 2] = ["", "ratelimit"];

/// Serves an extra plain HTTP listener (metrics or debug) until `stop`.
async fn serve_extra(
    listener: Option<TcpListener>,
    router: impl FnOnce() -> axum::Router,
    port: &'static str,
    mut stop: tokio::sync::broadcast::Receiver<()>,
) -> std::io::Result<()> {
    let Some(listener) = listener else {
        return Ok(());
    };
    axum::serve(
        LimitedListener::new(listener, per_port_limit(), false, port),
        router(),
    )
    .with_graceful_shutdown(async move {
        let _ = stop.recv().await;
    })
    .await
}

/// [`run_with_grace`] with TLS, the Go health semantics, a shutdown delay
/// and the extra listeners of `options`.
///
/// # Errors
/// A server failed to run.
pub async fn run_with(
    listeners: Listeners,
    limiter: Arc<Limiter>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    options: RunOptions,
) -> Result<(), AppError> {
    type RlsServer = envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer<RateLimitGrpc>;
    let RunOptions {
        grace,
        tls,
        health,
        shutdown_delay,
        go_metrics,
        debug,
        reflection: serve_reflection,
    } = options;
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<RlsServer>().await;
    let go_mode = health
        .as_ref()
        .is_some_and(|h| matches!(h.mode(), crate::settings::HealthMode::Go { .. }));
    for name in HEALTH_SERVICE_NAMES {
        // In Go mode `ratelimit` starts NOT_SERVING and follows the Go
        // health state (the task below).
        let status = if go_mode && name == "ratelimit" {
            tonic_health::ServingStatus::NotServing
        } else {
            tonic_health::ServingStatus::Serving
        };
        health_reporter.set_service_status(name, status).await;
    }

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
    let reloader = tls
        .as_ref()
        .map(|t| t.spawn_reloader(crate::tls::RELOAD_INTERVAL));
    // Go health: the `ratelimit` gRPC name follows `/healthcheck`.
    let go_health = health.clone().filter(|_| go_mode).map(|h| {
        let (reporter, limiter) = (health_reporter.clone(), limiter.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(GO_HEALTH_INTERVAL);
            let mut last = None;
            while !h.is_draining() {
                tick.tick().await;
                let status = match h.check_go(&limiter).await {
                    Ok(()) => tonic_health::ServingStatus::Serving,
                    Err(_) => tonic_health::ServingStatus::NotServing,
                };
                if last != Some(status) && !h.is_draining() {
                    reporter.set_service_status("ratelimit", status).await;
                    last = Some(status);
                }
            }
        })
    });

    // The descriptors are built in code and checked by tests: a failure is a
    // bug, logged, and the port serves without reflection.
    let reflection = |on: bool| {
        on.then(|| {
            let v1 = crate::reflection::service_v1();
            let v1alpha = crate::reflection::service_v1alpha();
            match (v1, v1alpha) {
                (Ok(a), Ok(b)) => Some((a, b)),
                (Err(e), _) | (_, Err(e)) => {
                    tracing::error!(error = %e, "gRPC reflection is off: its descriptors do not resolve");
                    None
                }
            }
        })
        .flatten()
    };
    // Dead peers are found by HTTP/2 pings; each connection is bounded in
    // streams, calls at once, windows and message size (crate::grpc), and
    // each port holds a bounded number of connections (crate::conn_limit).
    // ShouldRateLimit is served on h2 directly (crate::grpc_h2); health,
    // reflection and any other path by tonic.
    let mut routes = tonic::service::Routes::new(health_service)
        .add_service(RateLimitGrpc::server(limiter.clone()));
    if let Some((v1, v1alpha)) = reflection(serve_reflection) {
        routes = routes.add_service(v1).add_service(v1alpha);
    }
    // TCP_NODELAY: without it, Nagle's algorithm holds small HTTP/2 writes
    // until the peer's delayed ACK (about 40 ms) and shows up as p99.9 latency.
    // A connection must send its opening bytes (the HTTP/2 preface, or a TLS
    // ClientHello, which is longer) within the first-byte timeout.
    let tcp = LimitedListener::new(listeners.grpc, per_port_limit(), true, "grpc")
        .opening_bytes(crate::conn_limit::HTTP2_PREFACE_BYTES)
        .into_stream();
    let grpc_signal = async move {
        let _ = grpc_stop.recv().await;
    };
    let h2_options = crate::grpc_h2::Options {
        keepalive: Some((Duration::from_secs(30), Duration::from_secs(10))),
    };
    let grpc: std::pin::Pin<Box<dyn Future<Output = Result<(), std::convert::Infallible>> + Send>> =
        match &tls {
            Some(t) => Box::pin(crate::grpc_h2::serve(
                crate::tls::incoming(tcp, t),
                limiter.clone(),
                routes,
                h2_options,
                grpc_signal,
            )),
            None => Box::pin(crate::grpc_h2::serve(
                tcp,
                limiter.clone(),
                routes,
                h2_options,
                grpc_signal,
            )),
        };
    let http = axum::serve(
        LimitedListener::new(listeners.http, per_port_limit(), false, "http")
            .idle_timeout(crate::conn_limit::ADMIN_IDLE_TIMEOUT)
            .shed_idle_when_full(),
        crate::http::router_with(limiter.clone(), health.clone()),
    )
    .with_graceful_shutdown(async move {
        let _ = http_stop.recv().await;
    })
    .into_future();
    let (metrics_listener, metrics_path) = match go_metrics {
        Some((l, path)) => (Some(l), path),
        None => (None, String::new()),
    };
    let metrics = serve_extra(
        metrics_listener,
        move || crate::http::go_metrics_router(&metrics_path),
        "metrics",
        stop_tx.subscribe(),
    );
    let debug = serve_extra(
        debug,
        {
            let l = limiter.clone();
            move || crate::http::debug_router(l)
        },
        "debug",
        stop_tx.subscribe(),
    );

    let reporter = health_reporter.clone();
    let (draining_tx, draining_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        shutdown.await;
        if let Some(h) = &health {
            h.set_draining();
        }
        for name in HEALTH_SERVICE_NAMES {
            reporter
                .set_service_status(name, tonic_health::ServingStatus::NotServing)
                .await;
        }
        reporter.set_not_serving::<RlsServer>().await;
        if !shutdown_delay.is_zero() {
            tracing::info!(
                ?shutdown_delay,
                "shutting down: reporting unhealthy before draining"
            );
            tokio::time::sleep(shutdown_delay).await;
        }
        tracing::info!("shutting down: draining in-flight requests");
        let _ = stop_tx.send(());
        let _ = draining_tx.send(());
    });
    let servers = async { tokio::join!(grpc, http, metrics, debug) };
    let deadline = async {
        if draining_rx.await.is_ok() {
            tokio::time::sleep(grace).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    let stop_tasks = || {
        sweeper.abort();
        if let Some(g) = &go_health {
            g.abort();
        }
        if let Some(r) = &reloader {
            r.abort();
        }
    };
    let (g, h, m, d) = tokio::select! {
        r = servers => r,
        () = deadline => {
            tracing::warn!(?grace, "drain grace period elapsed; closing the remaining connections");
            stop_tasks();
            return Ok(());
        }
    };
    stop_tasks();
    let Ok(()) = g;
    h?;
    m?;
    d?;
    Ok(())
}

mod setup;
pub use setup::{App, ExtraListeners, build_storage, reload_on_sighup, shutdown_signal};
