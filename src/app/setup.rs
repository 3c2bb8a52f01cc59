//! Assembly for `serve`: the storage backend built from [`Backend`], the
//! metric series that exist from startup, and the process signals.

use super::storage::build_storage;
use super::{AppError, Listeners};
use crate::config::source::{self, Reload, SourceHandle};
use crate::config::{Config, ConfigHandle};
use crate::limiter::Limiter;
use crate::settings::{ConfigSource, Settings, SetupError};
use std::future::Future;
use std::sync::Arc;

/// A service ready to serve: the storage, the limiter on the config, and
/// the config source that updates it (with a SIGHUP task). Dropping it stops
/// the source.
#[derive(Debug)]
pub struct App {
    limiter: Arc<Limiter>,
    source: SourceHandle,
    tls: Option<crate::tls::ServerTls>,
    health: Arc<crate::go::health::Health>,
    shutdown_delay: std::time::Duration,
    go_metrics_path: Option<String>,
    grpc_reflection: bool,
}

/// Listeners of the optional ports (`--go-metrics-addr`, `--debug-addr`),
/// bound by the caller like [`Listeners`].
#[derive(Debug, Default)]
pub struct ExtraListeners {
    /// Go-named metrics.
    pub go_metrics: Option<tokio::net::TcpListener>,
    /// Plain-text `/rlconfig`.
    pub debug: Option<tokio::net::TcpListener>,
}

impl App {
    /// Builds the storage named by `settings`, a limiter, and the config
    /// source ([`source::spawn`]): for a file source the config is loaded
    /// from that path first (before anything else is built), applied as the
    /// startup load, and a watcher reloads it; for xDS the limiter has no
    /// config until the first push (ShouldRateLimit answers an error
    /// meanwhile) and the xDS client starts. Binds nothing. Must be called
    /// inside a Tokio runtime.
    ///
    /// [`source::spawn`]: crate::config::source::spawn
    ///
    /// # Errors
    /// [`SetupError::Config`] when the config files do not load, other
    /// [`SetupError`]s when the storage cannot be built or a gRPC TLS file
    /// cannot be used.
    pub fn build(settings: Settings) -> Result<Self, SetupError> {
        let config = match &settings.config {
            ConfigSource::File(path) => Some(load_startup_config(path, settings.load)?),
            ConfigSource::Xds(_) => None,
        };
        let tls = settings
            .grpc_tls
            .as_ref()
            .map(crate::tls::ServerTls::load)
            .transpose()
            .map_err(|e| SetupError::Tls(e.to_string()))?;
        let health = Arc::new(crate::go::health::Health::new(settings.health));
        let storage = build_storage(settings.backend)?;
        let s = &settings.service;
        if s.global_shadow_mode || s.global_quota_mode || s.response_dynamic_metadata {
            tracing::info!(
                shadow_mode = s.global_shadow_mode,
                quota_mode = s.global_quota_mode,
                response_dynamic_metadata = s.response_dynamic_metadata,
                "service-wide modes on"
            );
        }
        let handle = Arc::new(ConfigHandle::awaiting_first_config());
        let limiter = Arc::new(Limiter::with_handle(handle, storage, settings.service));
        let source = source::spawn(
            settings.config,
            config,
            limiter.config_handle().clone(),
            limiter.on_swap(),
            settings.load,
        );
        tokio::spawn(reload_on_sighup(source.reload(), limiter.clone()));
        // Health counts a config loaded once the first is in force.
        if source.has_first_config() {
            health.set_config_loaded();
        } else {
            let first = source.first_config_signal();
            let h = health.clone();
            tokio::spawn(async move {
                first.await;
                h.set_config_loaded();
            });
        }
        Ok(Self {
            limiter,
            source,
            tls,
            health,
            shutdown_delay: settings.shutdown_delay,
            go_metrics_path: settings.go_metrics.map(|m| m.path),
            grpc_reflection: settings.grpc_reflection,
        })
    }

    /// The health state shared by the health endpoints.
    #[must_use]
    pub fn health(&self) -> &Arc<crate::go::health::Health> {
        &self.health
    }

    /// Resolves when the service may bind its ports: at once, except for an
    /// xDS source told to wait for its first config (the Go service without
    /// `FORCE_START_WITHOUT_INITIAL_CONFIG`).
    pub async fn ready(&self) {
        if self.source.waits_for_first_config() {
            tracing::info!("waiting for the first xDS config before serving");
            self.source.first_config().await;
        }
    }

    /// The limiter (config, storage, settings).
    #[must_use]
    pub fn limiter(&self) -> &Arc<Limiter> {
        &self.limiter
    }

    /// Serves `listeners` and the optional `extra` ones until `shutdown`
    /// resolves, with the gRPC TLS, the health mode, reflection and the
    /// shutdown delay of the settings, then drains ([`super::run_with_grace`]
    /// says how) and stops the config source.
    ///
    /// # Errors
    /// A server failed to run.
    pub async fn serve(
        self,
        listeners: Listeners,
        extra: ExtraListeners,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), AppError> {
        let options = super::Serving {
            tls: self.tls.clone(),
            health: Some(self.health.clone()),
            shutdown_delay: self.shutdown_delay,
            go_metrics: extra.go_metrics.map(|l| {
                (
                    l,
                    self.go_metrics_path
                        .clone()
                        .unwrap_or_else(|| "/metrics".into()),
                )
            }),
            debug: extra.debug,
            reflection: self.grpc_reflection,
            ..super::Serving::default()
        };
        let out = super::serve(listeners, self.limiter.clone(), shutdown, options).await;
        drop(self.source);
        out
    }
}

/// Loads the config of a file source at startup; the source applies it
/// ([`crate::config::ConfigHandle::apply`], which counts and logs it).
fn load_startup_config(
    path: &std::path::Path,
    load: crate::config::compile::LoadOptions,
) -> Result<Config, SetupError> {
    crate::config::files::load_source_with(path, load).map_err(SetupError::Config)
}

/// On every SIGHUP: with a source that reloads on demand (`reload`), asks
/// it for a reload and clears `limiter`'s local over-limit cache (an
/// operator who reset buckets in Redis gets them seen at once, even when the
/// config is unchanged); with one that does not (xDS: nothing on disk to
/// reload), logs and otherwise ignores the signal (its default action would
/// end the process). Logs and returns when SIGHUP cannot be listened for.
pub async fn reload_on_sighup(reload: Option<Reload>, limiter: Arc<Limiter>) {
    let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            if reload.is_some() {
                tracing::error!(error = %e, "cannot listen for SIGHUP; reloads come from file events and the rescan only");
            }
            return;
        }
    };
    while hup.recv().await.is_some() {
        match &reload {
            Some(reload) => {
                tracing::info!(
                    "SIGHUP: reloading the config and clearing the local over-limit cache"
                );
                limiter.storage().invalidate_local_cache();
                reload();
            }
            None => tracing::info!("SIGHUP ignored: the config comes from xDS"),
        }
    }
}

/// Resolves on SIGTERM or Ctrl-C (SIGINT): the shutdown future `serve`
/// passes to [`super::run`].
pub async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops the server");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
