//! Assembly for `serve`: the storage backend built from [`Backend`], the
//! metric series that exist from startup, and the process signals.

use crate::config::watcher::ReloadHandle;
use crate::settings::{Backend, SetupError};
use crate::storage::Storage;
use crate::storage::clock::SystemClock;
use crate::storage::memory::MemoryStorage;
use crate::storage::redis::RedisStorage;
use crate::storage::redis::cluster::RedisClusterStorage;
use crate::storage::redis::sentinel::RedisSentinelStorage;
use std::sync::Arc;

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
            Arc::new(SystemClock),
            max_buckets,
        )),
        Backend::Redis { url, redis } => {
            let mut builder = RedisStorage::builder(url)
                .timeout(redis.timeout())
                .local_cache_size(redis.local_cache_size);
            if let Some(pem) = redis.tls_root_ca_pem {
                builder = builder.tls_root_ca_pem(pem);
            }
            let storage = builder.build()?;
            tracing::info!(
                url = storage.url(),
                timeout_ms = redis.timeout_ms,
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
            let mut builder = RedisSentinelStorage::builder(sentinels, master_name)
                .timeout(redis.timeout())
                .local_cache_size(redis.local_cache_size)
                .master_auth(master_auth.username, master_auth.password);
            if let Some(pem) = redis.tls_root_ca_pem {
                builder = builder.tls_root_ca_pem(pem);
            }
            let storage = builder.build()?;
            tracing::info!(
                sentinels = storage.sentinels(),
                timeout_ms = redis.timeout_ms,
                "Redis Sentinel backend (discovering the master in the background)"
            );
            Arc::new(storage)
        }
        Backend::Cluster { nodes, redis } => {
            let mut builder = RedisClusterStorage::builder(nodes)
                .timeout(redis.timeout())
                .local_cache_size(redis.local_cache_size);
            if let Some(pem) = redis.tls_root_ca_pem {
                builder = builder.tls_root_ca_pem(pem);
            }
            let storage = builder.build()?;
            tracing::info!(
                nodes = storage.nodes(),
                timeout_ms = redis.timeout_ms,
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

/// Asks `handle` for a reload on every SIGHUP, until the handle's watcher
/// is gone. Logs and returns when SIGHUP cannot be listened for.
pub async fn reload_on_sighup(handle: ReloadHandle) {
    let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGHUP; reloads come from file events and the rescan only");
            return;
        }
    };
    while hup.recv().await.is_some() {
        tracing::info!("SIGHUP: reloading the config");
        handle.reload_now();
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
