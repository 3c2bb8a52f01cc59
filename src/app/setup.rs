//! Assembly for `serve`: the storage backend built from [`Backend`], the
//! metric series that exist from startup, and the process signals.

use super::{AppError, Listeners};
use crate::config::source::{self, Reload, SourceHandle};
use crate::config::{Config, ConfigHandle};
use crate::limiter::Limiter;
use crate::settings::{Backend, ConfigSource, Settings, SetupError};
use crate::storage::Storage;
use crate::storage::clock::MonotonicClock;
use crate::storage::memory::MemoryStorage;
use crate::storage::redis::RedisStorage;
use crate::storage::redis::cluster::RedisClusterStorage;
use crate::storage::redis::sentinel::RedisSentinelStorage;
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

    /// Serves `listeners` until `shutdown` resolves, then drains
    /// ([`super::run`]) and stops the watcher.
    ///
    /// # Errors
    /// A server failed to run.
    pub async fn run(
        self,
        listeners: Listeners,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), AppError> {
        self.run_with(listeners, ExtraListeners::default(), shutdown)
            .await
    }

    /// [`Self::run`] with the optional listeners, gRPC TLS, the health mode
    /// and the shutdown delay of the settings ([`super::run_with`]).
    ///
    /// # Errors
    /// A server failed to run.
    pub async fn run_with(
        self,
        listeners: Listeners,
        extra: ExtraListeners,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), AppError> {
        let options = super::RunOptions {
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
            ..super::RunOptions::default()
        };
        let out = super::run_with(listeners, self.limiter.clone(), shutdown, options).await;
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

/// Builds the storage `backend` names, logs which one it is, and registers
/// the backend's unlabelled metric series at zero (so an alert on `== 0`
/// has a series to match from startup; labelled series appear with their
/// first event). A Redis backend connects in the background: Redis being
/// down is not an error here. Must be called inside a Tokio runtime.
///
/// # Errors
/// [`SetupError::Redis`] when the Redis addresses do not parse (or a CA file
/// is given for a plain `redis://` Cluster seed).
pub fn build_storage(backend: Backend) -> Result<Arc<dyn Storage>, SetupError> {
    let is_redis = backend.redis().is_some();
    let storage: Arc<dyn Storage> = match backend {
        Backend::Memory { max_buckets } => Arc::new(MemoryStorage::with_max_buckets(
            // Monotonic: a wall-clock step neither mints tokens nor freezes a
            // bucket (docs/design.md, "Time").
            Arc::new(MonotonicClock::default()),
            max_buckets,
        )),
        Backend::Redis { url, redis } => {
            let storage = RedisStorage::builder(url).options(redis.clone()).build()?;
            tracing::info!(
                url = storage.url(),
                timeout_ms = redis.timeout.as_millis(),
                "Redis backend (connecting in the background)"
            );
            Arc::new(storage)
        }
        Backend::Sentinel {
            sentinels,
            master_name,
            master_auth,
            redis,
        } => {
            let storage = RedisSentinelStorage::builder(sentinels, master_name)
                .options(redis.clone())
                .master_auth(master_auth.username, master_auth.password)
                .build()?;
            tracing::info!(
                sentinels = storage.sentinels(),
                timeout_ms = redis.timeout.as_millis(),
                "Redis Sentinel backend (discovering the master in the background)"
            );
            Arc::new(storage)
        }
        Backend::Cluster { nodes, redis } => {
            let storage = RedisClusterStorage::builder(nodes)
                .options(redis.clone())
                .build()?;
            tracing::info!(
                nodes = storage.nodes(),
                timeout_ms = redis.timeout.as_millis(),
                "Redis Cluster backend (connecting in the background)"
            );
            Arc::new(storage)
        }
    };
    if is_redis {
        metrics::gauge!(crate::metrics::REDIS_CIRCUIT_OPEN).increment(0.0);
        metrics::counter!(crate::metrics::REDIS_SCRIPT_RELOAD).increment(0);
        metrics::counter!(crate::metrics::LOCAL_CACHE_HITS).increment(0);
    } else {
        metrics::counter!(crate::storage::memory::EVICTIONS_METRIC).increment(0);
    }
    Ok(storage)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::MasterAuth;
    use crate::storage::redis::RedisOptions;
    use std::time::Duration;

    // Nothing listens on port 1: building never connects, and the background
    // tasks only log their failed attempts until the test's runtime stops.
    const NOBODY: &str = "127.0.0.1:1";

    fn redis(tls_root_ca_pem: Option<Vec<u8>>) -> RedisOptions {
        RedisOptions {
            timeout: Duration::from_millis(50),
            local_cache_size: 10,
            tls_root_ca_pem,
            tls_client: None,
            ..RedisOptions::default()
        }
    }

    fn ca_pem() -> Vec<u8> {
        rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])
            .expect("self-signed certificate")
            .cert
            .pem()
            .into_bytes()
    }

    /// Builds `backend` with a Prometheus recorder of its own and returns
    /// the storage's name and the rendered metrics.
    fn build_and_render(backend: Backend) -> Result<(&'static str, String), SetupError> {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let storage = metrics::with_local_recorder(&recorder, || build_storage(backend))?;
        Ok((storage.name(), handle.render()))
    }

    fn has_line(rendered: &str, line: &str) -> bool {
        rendered.lines().any(|l| l == line)
    }

    #[tokio::test]
    async fn memory_backend_registers_the_eviction_series_at_zero() {
        let (name, rendered) =
            build_and_render(Backend::Memory { max_buckets: 10 }).expect("memory");
        assert_eq!(name, "memory");
        assert!(
            has_line(&rendered, "bucket_rls_memory_evictions_total 0"),
            "{rendered}"
        );
        assert!(
            !rendered.contains("bucket_rls_redis_circuit_open"),
            "{rendered}"
        );
    }

    #[tokio::test]
    async fn every_redis_topology_builds_without_connecting_and_registers_its_series() {
        for (backend, want) in [
            (
                Backend::Redis {
                    url: format!("redis://{NOBODY}"),
                    redis: redis(None),
                },
                "redis",
            ),
            (
                Backend::Sentinel {
                    sentinels: vec![NOBODY.into()],
                    master_name: "mymaster".into(),
                    master_auth: MasterAuth {
                        username: Some("app".into()),
                        password: Some("pw".into()),
                    },
                    redis: redis(None),
                },
                "redis-sentinel",
            ),
            (
                Backend::Cluster {
                    nodes: vec![NOBODY.into(), "127.0.0.1:2".into()],
                    redis: redis(None),
                },
                "redis-cluster",
            ),
        ] {
            let (name, rendered) = build_and_render(backend).expect(want);
            assert_eq!(name, want);
            for series in [
                "bucket_rls_redis_circuit_open 0",
                "bucket_rls_redis_script_reload_total 0",
                "bucket_rls_local_cache_hits_total 0",
            ] {
                assert!(has_line(&rendered, series), "{want}: {series}:\n{rendered}");
            }
            assert!(
                !rendered.contains("bucket_rls_memory_evictions_total"),
                "{want}: {rendered}"
            );
        }
    }

    #[tokio::test]
    async fn a_private_ca_is_accepted_for_tls_addresses() {
        for backend in [
            Backend::Redis {
                url: format!("rediss://{NOBODY}"),
                redis: redis(Some(ca_pem())),
            },
            Backend::Sentinel {
                sentinels: vec![format!("rediss://{NOBODY}")],
                master_name: "mymaster".into(),
                master_auth: MasterAuth::default(),
                redis: redis(Some(ca_pem())),
            },
            Backend::Cluster {
                nodes: vec![format!("rediss://{NOBODY}")],
                redis: redis(Some(ca_pem())),
            },
        ] {
            let shown = format!("{backend:?}");
            build_storage(backend).unwrap_or_else(|e| panic!("{shown}: {e}"));
        }
    }

    #[tokio::test]
    async fn addresses_the_redis_backend_refuses_are_setup_errors_naming_them() {
        for (backend, want) in [
            (
                Backend::Redis {
                    url: "redis://:s3cret@127.0.0.1:1/?password=s3cret".into(),
                    redis: redis(None),
                },
                "a password in the query is not used",
            ),
            (
                Backend::Redis {
                    url: "http://127.0.0.1:1".into(),
                    redis: redis(None),
                },
                "invalid Redis URL http://127.0.0.1:1",
            ),
            (
                Backend::Sentinel {
                    sentinels: vec![NOBODY.into()],
                    master_name: String::new(),
                    master_auth: MasterAuth::default(),
                    redis: redis(None),
                },
                "no master name given (--redis-master-name)",
            ),
            (
                Backend::Cluster {
                    nodes: vec![format!("redis://{NOBODY}")],
                    redis: redis(Some(ca_pem())),
                },
                "is not rediss://",
            ),
        ] {
            let shown = format!("{backend:?}");
            let e = build_storage(backend).map(|_| ()).expect_err(&shown);
            assert!(matches!(e, SetupError::Redis(_)), "{shown}: {e:?}");
            let msg = e.to_string();
            assert!(msg.contains(want), "{shown}: {msg}");
            assert!(!msg.contains("s3cret"), "password in the message: {msg}");
        }
    }
}
