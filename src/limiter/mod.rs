//! The decision core: descriptors in, statuses out, with no protocol types.
//! The gRPC service ([`crate::grpc`]) and the `/json` endpoint
//! ([`crate::http::json`]) map their requests into a [`Request`] and a
//! [`Decision`] or [`DecideError`] back, each in one place.
//!
//! One decision (docs/design.md, "Matching descriptors", "Token buckets" and
//! "Responses"):
//! 1. [`Request::validate`] checks the request's shape.
//! 2. [`plan`] matches every descriptor against the domain's rules, drops
//!    replaced rules and builds one bucket charge per limited descriptor.
//! 3. All charges go to storage in one call, applied all-or-nothing.
//! 4. [`verdict`] turns the result into statuses, waits and metrics;
//!    [`headers`] adds the optional RateLimit headers; [`failure`] answers
//!    when storage fails.

mod failure;
pub mod headers;
mod plan;
pub mod request;
pub mod verdict;

pub use request::{Bounds, Descriptor, InvalidRequest, Override, Request};
pub use verdict::{Code, CurrentLimit, Decision, DescriptorStatus, Header, UNLIMITED_REMAINING};

use crate::config::{Config, ConfigHandle, OnSwap};
use crate::metrics as m;
use crate::settings::ServiceSettings;
use crate::storage::{Storage, StorageError};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Distinct unknown domains that get their own metric label; later ones share `other`.
pub const MAX_DOMAIN_LABELS: usize = 100;
const DOMAIN_WARN_INTERVAL: Duration = Duration::from_secs(60);

/// Why a request got no decision.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    /// The request is malformed (gRPC `INVALID_ARGUMENT`, HTTP 400).
    #[error(transparent)]
    Invalid(#[from] InvalidRequest),
    /// Storage failed and the policy is `unavailable` (gRPC `UNAVAILABLE`,
    /// HTTP 503).
    #[error("rate limit storage unavailable: {0}")]
    Storage(#[source] StorageError),
}

impl DecideError {
    /// Stable label for the `service_error_total{kind}` metric.
    #[must_use]
    pub const fn kind(&self) -> &'static str {
        match self {
            Self::Invalid(_) => "invalid_argument",
            Self::Storage(_) => "storage",
        }
    }
}

/// Shared state of the request path: the config handle, the storage backend
/// and the settings.
#[derive(Debug)]
pub struct Limiter {
    config: Arc<ConfigHandle>,
    storage: Arc<dyn Storage>,
    settings: ServiceSettings,
    unknown_domains: Mutex<HashMap<String, Instant>>,
    failure_log: failure::FailureLog,
}

impl Limiter {
    /// A limiter serving `config` from `storage`.
    #[must_use]
    pub fn new(config: Config, storage: Arc<dyn Storage>, settings: ServiceSettings) -> Self {
        Self::with_handle(Arc::new(ConfigHandle::new(config)), storage, settings)
    }

    /// A limiter reading its config from `config`, which a config source
    /// (the file watcher) updates.
    #[must_use]
    pub fn with_handle(
        config: Arc<ConfigHandle>,
        storage: Arc<dyn Storage>,
        settings: ServiceSettings,
    ) -> Self {
        Self {
            config,
            storage,
            settings,
            unknown_domains: Mutex::new(HashMap::new()),
            failure_log: failure::FailureLog::default(),
        }
    }

    /// The config in force now.
    #[must_use]
    pub fn config(&self) -> Arc<Config> {
        self.config.current()
    }

    /// The config handle (config in force and last reload error).
    #[must_use]
    pub fn config_handle(&self) -> &Arc<ConfigHandle> {
        &self.config
    }

    /// Swaps in a new config atomically and runs [`Self::on_swap`]'s hook.
    pub fn swap_config(&self, config: Config) {
        let old = self.config.swap(config);
        after_swap(
            &*self.storage,
            &self.settings.key_prefix,
            &old,
            &self.config(),
        );
    }

    /// The hook a config source calls after each swap: buckets are carried
    /// over, the local over-limit cache is cleared, and when a rule got
    /// slower or larger the existing buckets are held until they are full
    /// under the new limits (docs/design.md, "Reloads").
    #[must_use]
    pub fn on_swap(&self) -> OnSwap {
        let storage = self.storage.clone();
        let prefix = self.settings.key_prefix.clone();
        Arc::new(move |old: &Config, new: &Config| after_swap(&*storage, &prefix, old, new))
    }

    /// The storage backend.
    #[must_use]
    pub fn storage(&self) -> &Arc<dyn Storage> {
        &self.storage
    }

    /// The settings.
    #[must_use]
    pub fn settings(&self) -> &ServiceSettings {
        &self.settings
    }

    /// Decides one request, recording the request duration and errors.
    ///
    /// # Errors
    /// [`DecideError::Invalid`] for a malformed request (empty domain, no
    /// descriptors, too many descriptors or entries, an override unit that
    /// is not `SECOND`..`YEAR`); [`DecideError::Storage`] when storage fails
    /// and the policy is `unavailable`.
    pub async fn decide(&self, req: &Request<'_>) -> Result<Decision, DecideError> {
        let started = Instant::now();
        let out = self.decide_inner(req).await;
        metrics::histogram!(m::REQUEST_DURATION).record(started.elapsed().as_secs_f64());
        if let Err(e) = &out {
            metrics::counter!(m::SERVICE_ERROR, "kind" => e.kind()).increment(1);
        }
        out
    }

    async fn decide_inner(&self, req: &Request<'_>) -> Result<Decision, DecideError> {
        req.validate(Bounds {
            max_descriptors: self.settings.max_descriptors,
            max_entries: self.settings.max_entries,
        })?;
        let config = self.config.load();
        let Some(domain) = config.domains.get(req.domain) else {
            self.note_unknown_domain(req.domain);
            return Ok(Decision::ok(
                req.descriptors
                    .iter()
                    .map(|_| DescriptorStatus::no_limit())
                    .collect(),
            ));
        };
        let (plans, charges) = plan::plan(domain, req, &self.settings.key_prefix);
        drop(config);
        if charges.is_empty() {
            return Ok(Decision::ok(
                plans
                    .iter()
                    .map(|p| {
                        if matches!(p, plan::Plan::Unlimited) {
                            DescriptorStatus::unlimited()
                        } else {
                            DescriptorStatus::no_limit()
                        }
                    })
                    .collect(),
            ));
        }
        match self.storage.apply(&charges).await {
            Ok(result) => {
                let (mut decision, limited) =
                    verdict::respond(&self.settings, &plans, &charges, &result);
                headers::add(self.settings.rate_limit_headers, &mut decision, &limited);
                Ok(decision)
            }
            Err(e) => failure::answer(self.settings.on_storage_error, &self.failure_log, &plans, e),
        }
    }

    fn note_unknown_domain(&self, domain: &str) {
        let mut seen = self.unknown_domains.lock();
        let label = if seen.contains_key(domain) || seen.len() < MAX_DOMAIN_LABELS {
            domain.to_owned()
        } else {
            "other".to_owned()
        };
        let now = Instant::now();
        let warn = match seen.get_mut(&label) {
            Some(last) if now.duration_since(*last) < DOMAIN_WARN_INTERVAL => false,
            Some(last) => {
                *last = now;
                true
            }
            None => {
                seen.insert(label.clone(), now);
                true
            }
        };
        drop(seen);
        if warn {
            tracing::warn!(domain = ?domain, "request for unknown domain; no config defines it, answering OK without limits");
        }
        metrics::counter!(m::DOMAIN_NOT_FOUND, "domain" => label).increment(1);
    }
}

fn after_swap(storage: &dyn Storage, key_prefix: &str, old: &Config, new: &Config) {
    storage.invalidate_local_cache();
    if let Some(hold_us) = new.loosened_hold_us(old) {
        tracing::info!(
            hold_secs = hold_us / 1_000_000,
            "a rule got slower or larger: existing buckets are kept until they are full under the new limits"
        );
        storage.hold_existing(key_prefix, hold_us);
    }
}
