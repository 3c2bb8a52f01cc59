//! `serve`: the settings from the flags, the span exporter, the app built
//! (storage, limiter, config source), the ports bound once the app is
//! ready, then served until SIGTERM or Ctrl-C and drained.

use super::ServeArgs;
use crate::app::{self, App, ExtraListeners, Listeners};
use crate::settings::{Settings, SetupError};
use std::net::SocketAddr;
use tokio::net::TcpListener;

/// Why `serve` stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The Tokio runtime could not be built.
    #[error("cannot start the async runtime")]
    Runtime(#[source] std::io::Error),
    /// The flags, the config or the storage settings refused to start.
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// The span exporter could not be set up.
    #[error(transparent)]
    Tracing(#[from] crate::otel::TracingError),
    /// A port could not be bound.
    #[error("binding {what} on {addr}")]
    Bind {
        /// Which port (`gRPC`, `HTTP`, ...).
        what: &'static str,
        /// The address given.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The address of a bound port could not be read.
    #[error(transparent)]
    LocalAddr(std::io::Error),
    /// A server failed while serving.
    #[error(transparent)]
    App(#[from] app::AppError),
}

/// Runs `serve` with `args` on a multi-threaded runtime until a shutdown
/// signal, and returns once the ports are drained and queued spans sent.
/// Expects logging to be set up by the caller.
///
/// # Errors
/// [`ServeError`] when the service cannot start or a server fails.
pub fn run(args: &ServeArgs) -> Result<(), ServeError> {
    tokio::runtime::Runtime::new()
        .map_err(ServeError::Runtime)?
        .block_on(serve(args))
}

async fn serve(args: &ServeArgs) -> Result<(), ServeError> {
    crate::metrics::install();
    crate::conn_limit::set_buffered_request_budget(args.max_buffered_request_bytes);
    let settings = Settings::try_from(args)?;
    let tracing = crate::otel::init(&settings.tracing)?;
    let (grpc_addr, http_addr) = (settings.grpc_addr, settings.http_addr);
    let go_metrics_addr = settings.go_metrics.as_ref().map(|m| m.addr);
    let debug_addr = settings.debug_addr;
    let app = App::build(settings)?;
    app.ready().await;
    let grpc = bind(grpc_addr, "gRPC").await?;
    let http = bind(http_addr, "HTTP").await?;
    let extra = ExtraListeners {
        go_metrics: bind_optional(go_metrics_addr, "Go-named metrics").await?,
        debug: bind_optional(debug_addr, "debug /rlconfig").await?,
    };
    tracing::info!(
        grpc = %grpc.local_addr().map_err(ServeError::LocalAddr)?,
        http = %http.local_addr().map_err(ServeError::LocalAddr)?,
        go_metrics = ?go_metrics_addr,
        debug = ?debug_addr,
        backend = app.limiter().storage().name(),
        "serving"
    );
    app.serve(Listeners { grpc, http }, extra, app::shutdown_signal())
        .await?;
    // Spans still queued leave before the process does (bounded by the
    // exporter's 10 s timeout).
    if let Some(t) = tracing {
        let _ = tokio::task::spawn_blocking(move || t.shutdown()).await;
    }
    tracing::info!("stopped");
    Ok(())
}

async fn bind(addr: SocketAddr, what: &'static str) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { what, addr, source })
}

async fn bind_optional(
    addr: Option<SocketAddr>,
    what: &'static str,
) -> Result<Option<TcpListener>, ServeError> {
    match addr {
        None => Ok(None),
        Some(a) => bind(a, what).await.map(Some),
    }
}
