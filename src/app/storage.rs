//! The storage backend a process serves from, built from [`Backend`].

use crate::settings::{Backend, SetupError};
use crate::storage::Storage;
use crate::storage::clock::MonotonicClock;
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
    crate::metrics::register_backend_series(is_redis);
    Ok(storage)
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
