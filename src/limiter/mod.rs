//! The decision core: descriptors in, statuses out, with no protocol types.
//! The gRPC service ([`crate::grpc`]) and the `/json` endpoint
//! ([`crate::http::json`]) map their requests into a [`Request`] and a
//! [`Decision`] or [`DecideError`] back, each in one place.
//!
//! One decision (docs/design.md, "Matching descriptors", "Token buckets" and
//! "Responses"):
//! 1. [`Request::validate`] checks the request's shape.
//! 2. `plan` matches every descriptor against the domain's rules, drops
//!    replaced rules and builds one bucket charge per limited descriptor.
//! 3. All charges go to storage in one call, applied all-or-nothing.
//! 4. [`verdict`] turns the result into statuses, waits and metrics;
//!    [`headers`] adds the optional RateLimit headers; `failure` answers
//!    when storage fails.

mod failure;
pub mod headers;
pub mod labels;
pub mod metadata;
mod plan;
pub mod quota;
pub mod request;
pub mod reset;
pub mod verdict;

pub use request::{Bounds, Descriptor, InvalidRequest, Override, Request};
pub use verdict::{Code, CurrentLimit, Decision, DescriptorStatus, Header, UNLIMITED_REMAINING};

use crate::config::{Config, ConfigHandle, OnSwap};
use crate::metrics as m;
use crate::settings::ServiceSettings;
use crate::storage::{Charge, ChargeKind, RequestResult, Storage, StorageError};
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
    /// The config source has not delivered a config yet (an xDS source
    /// started without one): gRPC `UNKNOWN`, HTTP 503, as the Go service
    /// answers before its first config, so Envoy's failure mode decides.
    #[error("no rate limit configuration loaded")]
    NoConfig,
}

impl DecideError {
    /// Stable label for the `service_error_total{kind}` metric.
    #[must_use]
    pub const fn kind(&self) -> &'static str {
        match self {
            Self::Invalid(_) => "invalid_argument",
            Self::Storage(_) => "storage",
            Self::NoConfig => "no_config",
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
    value_labels: labels::ValueLabels,
    /// The [`m::REQUEST_DURATION`] histogram, looked up on the first request.
    request_duration: std::sync::OnceLock<metrics::Histogram>,
    /// Envoy's quota service streams ([`quota`]).
    quotas: quota::Quotas,
    /// When a refused reservation was last logged (at most one line per
    /// [`RESERVATION_WARN_INTERVAL`]), and how many were not logged since.
    reservation_log: Mutex<(Option<Instant>, u64)>,
}

/// Shortest time between two log lines about reservations refused at a
/// bucket's `max_open`.
const RESERVATION_WARN_INTERVAL: Duration = Duration::from_secs(10);

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
        warn_value_labels(&config.current());
        if settings.global_shadow_mode {
            // The series exists from startup, so an alert has one to match.
            metrics::counter!(m::GLOBAL_SHADOW_MODE).increment(0);
        }
        Self {
            config,
            storage,
            unknown_domains: Mutex::new(HashMap::new()),
            failure_log: failure::FailureLog::default(),
            value_labels: labels::ValueLabels::default(),
            request_duration: std::sync::OnceLock::new(),
            reservation_log: Mutex::new((None, 0)),
            quotas: quota::Quotas::new(
                if settings.rlqs_deny_unmatched {
                    quota::Unmatched::Deny
                } else {
                    quota::Unmatched::Allow
                },
                Arc::new(crate::storage::clock::MonotonicClock::default()),
            ),
            settings,
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
            &self.settings,
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
        let settings = self.settings.clone();
        Arc::new(move |old: &Config, new: &Config| {
            after_swap(&*storage, &prefix, &settings, old, new);
        })
    }

    /// The storage backend.
    #[must_use]
    pub fn storage(&self) -> &Arc<dyn Storage> {
        &self.storage
    }

    /// Whether charges work now (`/healthcheck`): the storage's
    /// [`Storage::check_charges`] with a probe charge of 1 token on a bucket
    /// of its own (`<prefix>health`, 1,000 tokens a second, so it is full
    /// again within a millisecond; no bucket key can have that name, since
    /// every bucket key continues the prefix with `d<length>:`).
    ///
    /// # Errors
    /// The [`StorageError`] when the probe charge fails.
    pub async fn check_charges(&self) -> Result<(), StorageError> {
        let probe = Charge {
            key: format!("{}health", self.settings.key_prefix),
            spec: crate::storage::ChargeSpec {
                limit: crate::storage::Limit::TokenBucket(crate::storage::BucketLimit {
                    requests_per_unit: 1_000,
                    unit_secs: std::num::NonZeroU64::MIN,
                    burst: 1_000,
                    max_debt: 0,
                }),
                cost: 1,
                kind: ChargeKind::Consume,
                shadow: false,
            },
        };
        self.storage.check_charges(&probe).await
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
    /// descriptors, too many descriptors, an override unit that
    /// is not `SECOND`..`YEAR`); [`DecideError::Storage`] when storage fails
    /// and the policy is `unavailable`.
    pub async fn decide(&self, req: &Request<'_>) -> Result<Decision, DecideError> {
        use tracing::Instrument as _;
        let started = Instant::now();
        // The span only when debug logging is on: even a disabled span costs
        // a few hundred instructions per request.
        let out = if tracing::enabled!(tracing::Level::DEBUG) {
            let span = tracing::debug_span!("should_rate_limit", domain = %labels::ValueLabels::clip(req.domain));
            self.decide_inner(req).instrument(span).await
        } else {
            self.decide_inner(req).await
        };
        self.request_duration
            .get_or_init(|| metrics::histogram!(m::REQUEST_DURATION))
            .record(started.elapsed().as_secs_f64());
        if let Err(e) = &out {
            metrics::counter!(m::SERVICE_ERROR, "kind" => e.kind()).increment(1);
        }
        out
    }

    async fn decide_inner(&self, req: &Request<'_>) -> Result<Decision, DecideError> {
        req.validate(Bounds {
            max_descriptors: self.settings.max_descriptors,
        })?;
        if self.config.is_awaiting_first_config() {
            return Err(DecideError::NoConfig);
        }
        let config = self.config.load();
        let Some(domain) = config.domains.get(req.domain) else {
            self.note_unknown_domain(req.domain);
            let statuses = req.descriptors.iter().map(|_| DescriptorStatus::no_limit());
            return Ok(self.with_metadata(Decision::ok(statuses.collect()), req, &[], None));
        };
        let (plans, charges) = plan::plan(domain, req, &self.settings, &self.value_labels);
        drop(config);
        if charges.is_empty() {
            let statuses = plans.iter().map(|p| {
                if matches!(p, plan::Plan::Unlimited) {
                    DescriptorStatus::unlimited()
                } else {
                    DescriptorStatus::no_limit()
                }
            });
            return Ok(self.with_metadata(Decision::ok(statuses.collect()), req, &plans, None));
        }
        let result = match self.storage.apply(&charges).await {
            Ok(result) => self.pass_on_quota(&plans, &charges, result).await,
            Err(e) => Err(e),
        };
        match result {
            Ok(result) => {
                self.note_reservations(req, &plans, &charges, &result);
                let v = verdict::respond(&self.settings, &plans, &charges, &result);
                let mut decision = v.decision;
                headers::add(
                    self.settings.rate_limit_headers,
                    &self.settings.header_names,
                    &mut decision,
                    &v.limited,
                    &v.denials,
                );
                if tracing::enabled!(tracing::Level::DEBUG) {
                    self.explain(req, &plans, &charges, &decision);
                }
                Ok(self.with_metadata(decision, req, &plans, Some(&v.over)))
            }
            Err(e) => failure::answer(
                self.settings.on_storage_error,
                self.settings.global_shadow_mode,
                &self.failure_log,
                &plans,
                e,
            )
            .map(|d| self.with_metadata(d, req, &plans, None)),
        }
    }

    /// Quota mode in storage terms. Storage admits a request only when every
    /// charge that can deny has the tokens, and writes nothing otherwise. A
    /// quota charge there is such a charge, so a request whose quota
    /// descriptors are only partly over is refused by the first call; it is
    /// then asked again without the quota charges that lacked tokens (they
    /// would take nothing anyway), and again while a concurrent request
    /// spends another quota in between. The dropped charges keep the answer
    /// that dropped them. So a denied request is never charged, and a request
    /// costs more than one storage call only when some but not all of its
    /// quota descriptors are over.
    async fn pass_on_quota(
        &self,
        plans: &[plan::Plan],
        charges: &[Charge],
        first: RequestResult,
    ) -> Result<RequestResult, StorageError> {
        let has_quota = plans.iter().any(|p| {
            matches!(
                p,
                plan::Plan::Limited {
                    quota: true,
                    shadow: false,
                    ..
                }
            )
        });
        if first.admitted || !has_quota {
            return Ok(first);
        }
        let mut quota = vec![false; charges.len()];
        for p in plans {
            if let plan::Plan::Limited {
                charge,
                quota: true,
                shadow: false,
                ..
            } = p
            {
                quota[*charge] = true;
            }
        }
        // (A reserve takes like a consume.)
        let lacks = |i: usize| charges[i].spec.kind.takes() && !first.charges[i].enough;
        let is_quota_consume = |i: usize| quota[i] && charges[i].spec.kind.takes();
        let normal_lacks =
            (0..charges.len()).any(|i| lacks(i) && !quota[i] && !charges[i].spec.shadow);
        let quota_left = (0..charges.len()).any(|i| is_quota_consume(i) && !lacks(i));
        if normal_lacks || !quota_left {
            return Ok(first);
        }
        // Each round drops the quota charges that lacked tokens in the
        // previous one, so there are at most as many rounds as quota charges
        // (a concurrent request can spend a quota between two rounds).
        // A debt charge was taken by the first call, denied or not, and so
        // were the hits a fixed window counted without room for them: they
        // are not sent again (docs/design.md, "Debt", "Windows").
        let stood = |i: usize| charges[i].spec.stood(first.charges[i].enough);
        let mut dropped: Vec<bool> = (0..charges.len())
            .map(|i| (is_quota_consume(i) && lacks(i)) || stood(i))
            .collect();
        let mut merged = first;
        loop {
            let kept: Vec<usize> = (0..charges.len()).filter(|&i| !dropped[i]).collect();
            let subset: Vec<Charge> = kept.iter().map(|&i| charges[i].clone()).collect();
            let next = self.storage.apply(&subset).await?;
            for (j, &i) in kept.iter().enumerate() {
                merged.charges[i] = next.charges[j];
            }
            merged.admitted = next.admitted;
            if next.admitted {
                return Ok(merged);
            }
            let now_lacks = |i: usize| charges[i].spec.kind.takes() && !merged.charges[i].enough;
            let normal_lacks = kept
                .iter()
                .any(|&i| now_lacks(i) && !quota[i] && !charges[i].spec.shadow);
            let spent: Vec<usize> = kept
                .iter()
                .copied()
                .filter(|&i| is_quota_consume(i) && now_lacks(i))
                .collect();
            let quota_left = kept.iter().any(|&i| is_quota_consume(i) && !now_lacks(i));
            if normal_lacks || spent.is_empty() || !quota_left {
                return Ok(merged);
            }
            for i in spent {
                dropped[i] = true;
            }
            // What this denied round counted stays counted.
            for &i in &kept {
                if charges[i].spec.stood(merged.charges[i].enough) {
                    dropped[i] = true;
                }
            }
        }
    }

    /// `decision` with the dynamic metadata when the settings ask for it.
    /// `over` says per status whether its rule lacked the tokens (a shadow
    /// rule's status is `OK` even then); without it the status codes tell.
    fn with_metadata(
        &self,
        mut decision: Decision,
        req: &Request<'_>,
        plans: &[plan::Plan],
        over: Option<&[bool]>,
    ) -> Decision {
        if self.settings.response_dynamic_metadata {
            let statuses = &decision.statuses;
            let is_over = |i: usize| over.map_or(statuses[i].code == Code::OverLimit, |o| o[i]);
            let passed = plans.iter().enumerate().filter_map(|(i, p)| match p {
                plan::Plan::Limited {
                    metadata: Some(m), ..
                } if !is_over(i) => Some(&**m),
                _ => None,
            });
            decision.dynamic_metadata = Some(metadata::response_metadata(req, passed));
        }
        decision
    }

    /// One debug line per limited descriptor ("why was I denied"): the
    /// request's entries (clipped), the rule with its `file:line`, the cost,
    /// the answer, the tokens left and the wait. Only called when debug
    /// logging is on.
    fn explain(&self, req: &Request<'_>, plans: &[plan::Plan], charges: &[Charge], d: &Decision) {
        let config = self.config.load();
        let domain = config.domains.get(req.domain);
        for (i, (p, status)) in plans.iter().zip(&d.statuses).enumerate() {
            let plan::Plan::Limited {
                charge,
                counters,
                rule,
                shadow,
                quota,
                ..
            } = p
            else {
                continue;
            };
            let entries = req.descriptors[i]
                .entries
                .iter()
                .take(8)
                .map(|(k, v)| {
                    format!(
                        "{}={}",
                        labels::ValueLabels::clip(k),
                        labels::ValueLabels::clip(v)
                    )
                })
                .collect::<Vec<_>>()
                .join(",");
            let source = rule
                .and_then(|r| domain.and_then(|d| d.rules.get(r)))
                .map_or("(request override)", |r| r.source.as_str());
            let spec = &charges[*charge].spec;
            tracing::debug!(
                descriptor = i,
                entries = %entries,
                rule = %counters.label(),
                source,
                algorithm = spec.limit.kind().as_str(),
                cost = spec.cost,
                refund = spec.kind == ChargeKind::Refund,
                shadow,
                quota,
                code = ?status.code,
                remaining = status.limit_remaining,
                wait_ms = status.duration_until_reset.map(|w| u64::try_from(w.as_millis()).unwrap_or(u64::MAX)),
                overall = ?d.overall_code,
                "descriptor decided"
            );
        }
    }

    /// Counts (and at most once a minute per domain, logs) a request for a
    /// domain no config defines. The domain is client text: the label, the
    /// map key and the log line carry it clipped to
    /// [`labels::MAX_LABEL_VALUE_BYTES`] (with its full length logged), so
    /// long domains cost neither memory nor log volume.
    /// Counts what reserves and settlements did (docs/design.md,
    /// "Reservations": the `reservations_*` metrics) and logs, at most once
    /// per [`RESERVATION_WARN_INTERVAL`], a reserve refused because its
    /// bucket holds `max_open` open reservations.
    fn note_reservations(
        &self,
        req: &Request<'_>,
        plans: &[plan::Plan],
        charges: &[Charge],
        result: &RequestResult,
    ) {
        use crate::storage::ReservationOutcome as O;
        for (i, (c, r)) in charges.iter().zip(&result.charges).enumerate() {
            if r.expired > 0 {
                metrics::counter!(m::RESERVATIONS_EXPIRED).increment(u64::from(r.expired));
            }
            match r.reservation {
                O::None => {}
                O::Opened => metrics::counter!(m::RESERVATIONS_OPENED).increment(1),
                O::Added => metrics::counter!(m::RESERVATIONS_ADDED).increment(1),
                O::Settled => metrics::counter!(m::RESERVATIONS_SETTLED).increment(1),
                O::Unmatched => metrics::counter!(m::SETTLEMENTS_UNMATCHED).increment(1),
                O::Full => {
                    metrics::counter!(m::RESERVATIONS_REFUSED).increment(1);
                    let max_open = match c.spec.kind {
                        crate::storage::ChargeKind::Reserve(r) => r.max_open,
                        _ => 0,
                    };
                    let mut log = self.reservation_log.lock();
                    let now = Instant::now();
                    if log
                        .0
                        .is_some_and(|t| now.duration_since(t) < RESERVATION_WARN_INTERVAL)
                    {
                        log.1 += 1;
                        continue;
                    }
                    let suppressed = std::mem::take(&mut log.1);
                    log.0 = Some(now);
                    drop(log);
                    let rule = plans.iter().find_map(|p| match p {
                        plan::Plan::Limited {
                            charge, counters, ..
                        } if *charge == i => Some(counters.label().to_owned()),
                        _ => None,
                    });
                    tracing::warn!(
                        domain = %labels::ValueLabels::clip(req.domain),
                        rule = rule.as_deref().unwrap_or(""),
                        max_open,
                        suppressed,
                        "reservation refused: the bucket already holds max_open open reservations (answered OVER_LIMIT; raise reservation.max_open or lower ttl_seconds if callers are not at fault)"
                    );
                }
            }
        }
    }

    fn note_unknown_domain(&self, domain: &str) {
        let clipped = labels::ValueLabels::clip(domain);
        let mut seen = self.unknown_domains.lock();
        let label = if seen.contains_key(clipped.as_ref()) || seen.len() < MAX_DOMAIN_LABELS {
            clipped.clone().into_owned()
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
            tracing::warn!(domain = %clipped, domain_bytes = domain.len(), "request for unknown domain; no config defines it, answering OK without limits");
        }
        metrics::counter!(m::DOMAIN_NOT_FOUND, "domain" => label).increment(1);
    }
}

fn after_swap(
    storage: &dyn Storage,
    key_prefix: &str,
    settings: &ServiceSettings,
    old: &Config,
    new: &Config,
) {
    storage.invalidate_local_cache();
    warn_value_labels(new);
    if let Some(loosened) = new.loosened(old, settings) {
        tracing::info!(
            hold_secs = loosened.hold_us / 1_000_000,
            rules = ?loosened.lines,
            "rules that now take longer to fill (a lower rate or a larger burst): their existing buckets are kept until they are full under the new limits"
        );
        // Each slowed rule's keys, for its own time to full: the buckets of
        // unchanged rules keep their own expiry.
        for (domain, levels, hold_us) in &loosened.rules {
            for start in crate::storage::key::rule_prefixes(key_prefix, domain, levels) {
                storage.hold_existing(&start, *hold_us);
            }
        }
    }
}

/// Logs, once per loaded config, the rules whose metric labels carry request
/// values (`detailed_metric`, `value_to_metric`): an opt-in to cardinality,
/// bounded by [`labels::MAX_VALUE_LABELS`].
fn warn_value_labels(config: &Config) {
    let mut rules: Vec<&str> = config
        .domains
        .values()
        .flat_map(|d| d.rules.iter())
        .filter(|r| r.detailed_metric || r.metric_levels.is_some())
        .map(|r| r.path.as_str())
        .collect();
    if rules.is_empty() {
        return;
    }
    rules.sort_unstable();
    rules.truncate(20);
    tracing::warn!(
        rules = ?rules,
        max_labels = labels::MAX_VALUE_LABELS,
        "metric labels of these rules carry request values (detailed_metric or value_to_metric): one series per distinct value, up to max_labels in the process, later values count as <rule>._other"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::clock::ManualClock;
    use crate::storage::memory::MemoryStorage;

    /// A storage that lets a concurrent request spend bucket `steal` just
    /// before its second call.
    #[derive(Debug)]
    struct Racing {
        inner: MemoryStorage,
        calls: std::sync::atomic::AtomicUsize,
        steal: Charge,
    }

    #[async_trait::async_trait]
    impl Storage for Racing {
        async fn apply(&self, charges: &[Charge]) -> Result<RequestResult, StorageError> {
            let n = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if n == 1 {
                self.inner.apply(std::slice::from_ref(&self.steal)).await?;
            }
            self.inner.apply(charges).await
        }
        async fn ping(&self) -> Result<(), StorageError> {
            Ok(())
        }
        fn name(&self) -> &'static str {
            "racing"
        }
    }

    /// A quota spent by a concurrent request between two storage calls is
    /// dropped too: the request passes on the quota still left.
    #[test]
    fn a_quota_spent_between_calls_does_not_deny_while_another_is_left() {
        let yaml = "domain: q\ndescriptors:\n  - key: svc\n    quota_mode: true\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";
        let config =
            crate::config::compile::compile_texts(&[("q.yaml".into(), yaml.as_bytes().to_vec())])
                .unwrap();
        let settings = ServiceSettings::default();
        let plain = Descriptor::new(vec![("svc", "z1")]);
        let (_, charges) = plan::plan(
            &config.domains["q"],
            &Request {
                domain: "q",
                descriptors: vec![plain],
                hits_addend: 1,
            },
            &settings,
            &labels::ValueLabels::default(),
        );
        let storage = Arc::new(Racing {
            inner: MemoryStorage::new(Arc::new(ManualClock::new(1_000_000))),
            calls: std::sync::atomic::AtomicUsize::new(0),
            steal: charges[0].clone(),
        });
        let l = Limiter::new(config, storage.clone(), settings);
        let one = |v: &'static str| Descriptor::new(vec![("svc", v)]);
        // Spend "spent" first (call 0).
        let r = Request {
            domain: "q",
            descriptors: vec![one("spent")],
            hits_addend: 1,
        };
        assert_eq!(
            futures::executor::block_on(l.decide(&r))
                .unwrap()
                .overall_code,
            Code::Ok
        );
        // Round 1 (call 1) drops "spent"; before round 2 (call 2) the other
        // request takes z1's token; round 3 passes on z2.
        storage.calls.store(0, std::sync::atomic::Ordering::SeqCst);
        let r = Request {
            domain: "q",
            descriptors: vec![one("spent"), one("z1"), one("z2")],
            hits_addend: 1,
        };
        let d = futures::executor::block_on(l.decide(&r)).unwrap();
        assert_eq!(d.overall_code, Code::Ok, "{d:?}");
        let codes: Vec<Code> = d.statuses.iter().map(|s| s.code).collect();
        assert_eq!(codes, [Code::OverLimit, Code::OverLimit, Code::Ok]);
        assert_eq!(d.statuses[2].limit_remaining, 0, "z2 charged");
        assert_eq!(storage.calls.load(std::sync::atomic::Ordering::SeqCst), 3);
    }

    /// A client sending long unknown domains (the attack: 100 domains of
    /// 3.9 MiB each) gets each one counted under a clipped label and logged
    /// clipped: the labels, the map of seen domains and the log lines stay
    /// small whatever the domain's length.
    #[test]
    fn long_unknown_domains_are_clipped_in_labels_maps_and_logs() {
        let config = crate::config::compile::compile_texts(&[(
            "a.yaml".into(),
            b"domain: a\ndescriptors: []\n".to_vec(),
        )])
        .unwrap();
        let storage = Arc::new(MemoryStorage::new(Arc::new(ManualClock::new(1_000_000))));
        let l = Limiter::new(config, storage, ServiceSettings::default());
        let domains: Vec<String> = (0..150)
            .map(|i| format!("{i:03}-{}\n", "x".repeat(1 << 20)))
            .collect();
        let text = crate::test_log::logged(tracing::Level::WARN, || {
            for d in &domains {
                let req = Request {
                    domain: d,
                    descriptors: vec![Descriptor::new(vec![("k", "v")])],
                    hits_addend: 1,
                };
                futures::executor::block_on(l.decide(&req)).unwrap();
            }
        });
        let lines: Vec<&str> = text.lines().collect();
        // One per labelled domain, then one for the first under `other`.
        assert_eq!(lines.len(), MAX_DOMAIN_LABELS + 1, "{}", &text[..2000]);
        let longest = lines.iter().map(|l| l.len()).max().unwrap();
        assert!(longest < 400, "a log line of {longest} bytes");
        assert!(lines[0].contains("domain_bytes=1048581"), "{}", lines[0]);
        let seen = l.unknown_domains.lock();
        assert_eq!(seen.len(), MAX_DOMAIN_LABELS + 1, "100 labels and other");
        let held: usize = seen.keys().map(String::len).sum();
        assert!(held <= (MAX_DOMAIN_LABELS + 1) * labels::MAX_LABEL_VALUE_BYTES);
        assert!(seen.keys().all(|k| !k.contains('\n')));
    }

    /// At debug level every limited descriptor gets one line saying why: the
    /// entries, the rule and where it is defined, the cost, the answer, the
    /// tokens left and the wait, inside a span naming the domain.
    #[test]
    fn debug_logging_explains_each_decision() {
        let yaml = "domain: why\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1}\n";
        let config =
            crate::config::compile::compile_texts(&[("why.yaml".into(), yaml.as_bytes().to_vec())])
                .unwrap();
        let storage = Arc::new(MemoryStorage::new(Arc::new(ManualClock::new(1_000_000))));
        let l = Limiter::new(config, storage, ServiceSettings::default());
        let req = Request {
            domain: "why",
            descriptors: vec![Descriptor::new(vec![("user", "ann\n")])],
            hits_addend: 1,
        };
        let text = crate::test_log::logged(tracing::Level::DEBUG, || {
            for _ in 0..2 {
                futures::executor::block_on(l.decide(&req)).unwrap();
            }
        });
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("descriptor decided"))
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        for needle in [
            "should_rate_limit{domain=why}",
            "entries=user=ann_",
            "rule=why.user",
            "source=\"why.yaml:3\"",
            "cost=1",
            "code=OverLimit",
            "remaining=0",
            "wait_ms=60000",
        ] {
            assert!(lines[1].contains(needle), "{needle} in {}", lines[1]);
        }
    }
}
