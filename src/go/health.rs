//! Health with the Go reference service's semantics (`--health-mode go`),
//! kept apart from the native `/healthcheck` of [`crate::http`].
//!
//! The Go service (`src/server/health.go` of envoyproxy/ratelimit) is
//! healthy when all of its components are: `redis` (healthy once the
//! startup PING succeeded; a later outage does not change it), `sigterm`
//! (unhealthy from SIGTERM on) and, only with
//! `HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED=true`, `config` (healthy once a
//! config was loaded). Envoy Gateway points the Kubernetes liveness probe at
//! `/healthcheck`, so failing it on every Redis hiccup would restart the
//! pods; this mode does not.

use crate::limiter::Limiter;
use crate::settings::HealthMode;
use std::sync::atomic::{AtomicBool, Ordering};

/// How long one storage ping of a health check may take.
pub const PING_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Health state shared by the HTTP and gRPC health endpoints and the
/// shutdown sequence.
#[derive(Debug, Default)]
pub struct Health {
    mode: HealthMode,
    draining: AtomicBool,
    storage_answered: AtomicBool,
    config_loaded: AtomicBool,
}

impl Health {
    /// Health state for `mode`, nothing loaded or answered yet.
    #[must_use]
    pub fn new(mode: HealthMode) -> Self {
        Self {
            mode,
            ..Self::default()
        }
    }

    /// The mode.
    #[must_use]
    pub fn mode(&self) -> HealthMode {
        self.mode
    }

    /// Marks the process as shutting down (SIGTERM): unhealthy from now on.
    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Whether [`Self::set_draining`] was called.
    #[must_use]
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Records that a config is loaded (a config source calls this after
    /// its first successful load, an empty one included).
    pub fn set_config_loaded(&self) {
        self.config_loaded.store(true, Ordering::Release);
    }

    /// The Go service's verdict: `Ok` when healthy, else the reason.
    /// Pings storage only until one ping has succeeded.
    ///
    /// # Errors
    /// The reason it is unhealthy (`shutting down`, `no config loaded yet`,
    /// `storage has not answered yet: ...`).
    pub async fn check_go(&self, limiter: &Limiter) -> Result<(), String> {
        if self.is_draining() {
            return Err("shutting down".into());
        }
        if matches!(
            self.mode,
            HealthMode::Go {
                require_config: true
            }
        ) && !self.config_loaded.load(Ordering::Acquire)
        {
            return Err("no config loaded yet".into());
        }
        if !self.storage_answered.load(Ordering::Acquire) {
            match tokio::time::timeout(PING_TIMEOUT, limiter.storage().ping()).await {
                Ok(Ok(())) => self.storage_answered.store(true, Ordering::Release),
                Ok(Err(e)) => return Err(format!("storage has not answered yet: {e}")),
                Err(_) => {
                    return Err(format!(
                        "storage has not answered yet: no answer to ping within {PING_TIMEOUT:?}"
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::settings::ServiceSettings;
    use crate::storage::clock::SystemClock;
    use crate::storage::memory::MemoryStorage;
    use std::sync::Arc;

    fn limiter() -> Limiter {
        Limiter::new(
            Config::empty(),
            Arc::new(MemoryStorage::new(Arc::new(SystemClock))),
            ServiceSettings::default(),
        )
    }

    #[tokio::test]
    async fn go_health_needs_a_config_only_when_asked_and_fails_after_sigterm() {
        let l = limiter();
        let plain = Health::new(HealthMode::Go {
            require_config: false,
        });
        assert_eq!(plain.check_go(&l).await, Ok(()));
        let strict = Health::new(HealthMode::Go {
            require_config: true,
        });
        assert_eq!(
            strict.check_go(&l).await,
            Err("no config loaded yet".into())
        );
        strict.set_config_loaded();
        assert_eq!(strict.check_go(&l).await, Ok(()));
        strict.set_draining();
        assert_eq!(strict.check_go(&l).await, Err("shutting down".into()));
    }
}
