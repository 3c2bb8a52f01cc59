//! The `envoy.service.ratelimit.v3.RateLimitService` implementation: the only
//! module that sees proto types. It matches descriptors (DESIGN 2), sends all
//! charges of a request to storage in one call (DESIGN 3), and maps the result
//! to statuses (DESIGN 4). Storage errors are mapped to gRPC status here, once.

use crate::config::{Config, DomainConfig, Policy, Unit};
use crate::storage::bucket::{self, MICRO};
use crate::storage::key::{self, KeyValue};
use crate::storage::{Charge, ChargeKind, ChargeSpec, Limit, Storage, StorageError};
use crate::matcher;
use crate::metrics as m;
use crate::settings::{OnStorageError, RateLimitHeaders, ServiceSettings};
use arc_swap::ArcSwap;
use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit, rate_limit::Unit as ProtoUnit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::{Request, Response, Status};

/// `limit_remaining` for `unlimited` rules (upstream compatibility).
pub const UNLIMITED_REMAINING: u32 = u32::MAX;
/// Distinct unknown domains that get their own metric label; later ones share `other`.
pub const MAX_DOMAIN_LABELS: usize = 100;
const DOMAIN_WARN_INTERVAL: Duration = Duration::from_secs(60);
/// At most one "storage call failed" log line per interval (with the count
/// of failures not logged since the previous line).
const STORAGE_LOG_INTERVAL: Duration = Duration::from_secs(1);

/// Shared state of the request path: the current config (swapped atomically
/// on reload), the storage backend and the settings.
#[derive(Debug)]
pub struct Limiter {
    config: ArcSwap<Config>,
    storage: Arc<dyn Storage>,
    settings: ServiceSettings,
    unknown_domains: Mutex<HashMap<String, Instant>>,
    reload_error: Mutex<Option<crate::config::watcher::ReloadError>>,
    /// Last storage-failure log line, and failures not logged since.
    storage_log: Mutex<(Option<Instant>, u64)>,
}

/// How one descriptor is answered, decided before storage is called.
enum Plan {
    /// No rule, replaced, empty descriptor or unknown domain.
    NoLimit,
    /// `unlimited: true`.
    Unlimited,
    /// A bucket to charge: index into the charges sent to storage.
    Limited {
        charge: usize,
        label: String,
        current: RateLimit,
        cost: u64,
    },
}

impl Limiter {
    /// A limiter serving `config` from `storage`.
    #[must_use]
    pub fn new(config: Config, storage: Arc<dyn Storage>, settings: ServiceSettings) -> Self {
        Self {
            config: ArcSwap::from_pointee(config),
            storage,
            settings,
            unknown_domains: Mutex::new(HashMap::new()),
            reload_error: Mutex::new(None),
            storage_log: Mutex::new((None, 0)),
        }
    }

    /// The config in force now.
    #[must_use]
    pub fn config(&self) -> Arc<Config> {
        self.config.load_full()
    }

    /// Swaps in a new config atomically; buckets are untouched (carried over),
    /// and any local over-limit cache is cleared (BR-21).
    pub fn swap_config(&self, config: Config) {
        let hold = config.loosened_hold_us(&self.config());
        self.config.store(Arc::new(config));
        self.storage.invalidate_local_cache();
        if let Some(hold_us) = hold {
            tracing::info!(
                hold_secs = hold_us / 1_000_000,
                "a rule got slower or larger: existing buckets are kept until they are full under the new limits"
            );
            self.storage
                .hold_existing(&self.settings.key_prefix, hold_us);
        }
    }

    /// The last failed reload, if the source has not loaded since (for `/rlconfig`).
    #[must_use]
    pub fn last_reload_error(&self) -> Option<crate::config::watcher::ReloadError> {
        self.reload_error.lock().clone()
    }

    /// Records (or clears, with `None`) the last failed reload.
    pub fn set_reload_error(&self, error: Option<crate::config::watcher::ReloadError>) {
        *self.reload_error.lock() = error;
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

    /// Answers one `ShouldRateLimit` call.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` for an empty domain, an empty descriptor list, too
    /// many descriptors or entries, or an override with unit `UNKNOWN`;
    /// `UNAVAILABLE` when storage fails and the policy is `unavailable`.
    pub async fn should_rate_limit(
        &self,
        req: &RateLimitRequest,
    ) -> Result<RateLimitResponse, Status> {
        let started = Instant::now();
        let out = self.decide(req).await;
        metrics::histogram!(m::REQUEST_DURATION).record(started.elapsed().as_secs_f64());
        if let Err(s) = &out {
            let kind = if s.code() == tonic::Code::InvalidArgument {
                "invalid_argument"
            } else {
                "storage"
            };
            metrics::counter!(m::SERVICE_ERROR, "kind" => kind).increment(1);
        }
        out
    }

    fn validate(&self, req: &RateLimitRequest) -> Result<(), Status> {
        if req.domain.is_empty() {
            return Err(Status::invalid_argument("domain must not be empty"));
        }
        if req.descriptors.is_empty() {
            return Err(Status::invalid_argument(
                "descriptor list must not be empty",
            ));
        }
        if req.descriptors.len() > self.settings.max_descriptors {
            return Err(Status::invalid_argument(format!(
                "too many descriptors: {} (at most {} per request)",
                req.descriptors.len(),
                self.settings.max_descriptors
            )));
        }
        for (i, d) in req.descriptors.iter().enumerate() {
            if d.entries.len() > self.settings.max_entries {
                return Err(Status::invalid_argument(format!(
                    "descriptors[{i}]: too many entries: {} (at most {})",
                    d.entries.len(),
                    self.settings.max_entries
                )));
            }
            if let Some(o) = &d.limit
                && unit_from_override(o.unit).is_none()
            {
                return Err(Status::invalid_argument(format!(
                    "descriptors[{i}].limit.unit must be SECOND..YEAR, got {}",
                    RateLimitUnit::try_from(o.unit)
                        .map_or_else(|_| o.unit.to_string(), |u| u.as_str_name().to_owned())
                )));
            }
        }
        Ok(())
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

    async fn decide(&self, req: &RateLimitRequest) -> Result<RateLimitResponse, Status> {
        self.validate(req)?;
        let config = self.config.load();
        let Some(domain) = config.domains.get(&req.domain) else {
            self.note_unknown_domain(&req.domain);
            let statuses = req.descriptors.iter().map(|_| no_limit()).collect();
            return Ok(RateLimitResponse {
                overall_code: Code::Ok as i32,
                statuses,
                ..Default::default()
            });
        };
        let (plans, charges) = self.plan(domain, req);
        if charges.is_empty() {
            let statuses = plans
                .iter()
                .map(|p| {
                    if matches!(p, Plan::Unlimited) {
                        unlimited()
                    } else {
                        no_limit()
                    }
                })
                .collect();
            return Ok(RateLimitResponse {
                overall_code: Code::Ok as i32,
                statuses,
                ..Default::default()
            });
        }
        match self.storage.apply(&charges).await {
            Ok(result) => Ok(self.respond(&plans, &charges, &result)),
            Err(e) => self.storage_failed(&plans, &e),
        }
    }

    fn plan<'a>(
        &self,
        domain: &'a DomainConfig,
        req: &RateLimitRequest,
    ) -> (Vec<Plan>, Vec<Charge>) {
        // Pass 1: match every descriptor and collect `replaces`.
        let matched: Vec<Option<matcher::Matched<'a>>> = req
            .descriptors
            .iter()
            .map(|d| {
                let entries: Vec<(&str, &str)> = d
                    .entries
                    .iter()
                    .map(|e| (e.key.as_str(), e.value.as_str()))
                    .collect();
                matcher::find(&domain.root, &entries)
            })
            .collect();
        let replaced: HashSet<&str> = matched
            .iter()
            .flatten()
            .flat_map(|m| domain.rules[m.rule].replaces.iter().map(String::as_str))
            .collect();
        // Pass 2: build charges.
        let mut plans = Vec::with_capacity(req.descriptors.len());
        let mut charges = Vec::new();
        for (d, mt) in req.descriptors.iter().zip(&matched) {
            let cost = d
                .hits_addend
                .map_or(u64::from(req.hits_addend.max(1)), |h| h.value);
            let kind = if d.is_negative_hits {
                ChargeKind::Refund
            } else {
                ChargeKind::Consume
            };
            let rule = mt.as_ref().map(|m| &domain.rules[m.rule]);
            if let Some(r) = rule
                && r.name.as_deref().is_some_and(|n| replaced.contains(n))
            {
                plans.push(Plan::NoLimit);
                continue;
            }
            let (limit, current, shadow) = match (rule, &d.limit) {
                (_, Some(o)) if !d.entries.is_empty() => {
                    let Some(unit) = unit_from_override(o.unit) else {
                        plans.push(Plan::NoLimit);
                        continue;
                    };
                    let limit = Limit {
                        requests_per_unit: o.requests_per_unit,
                        unit_secs: NonZeroU64::new(unit.secs()).expect("a unit is at least 1 s"),
                        burst: o.requests_per_unit,
                    };
                    let current = RateLimit {
                        name: rule.and_then(|r| r.name.clone()).unwrap_or_default(),
                        requests_per_unit: o.requests_per_unit,
                        unit: proto_unit(unit) as i32,
                    };
                    (limit, current, rule.is_some_and(|r| r.shadow_mode))
                }
                (Some(r), None) => match &r.policy {
                    Policy::Unlimited => {
                        plans.push(Plan::Unlimited);
                        continue;
                    }
                    Policy::Limited {
                        requests_per_unit,
                        unit,
                        burst,
                    } => (
                        Limit {
                            requests_per_unit: *requests_per_unit,
                            unit_secs: NonZeroU64::new(unit.secs())
                                .expect("a unit is at least 1 s"),
                            burst: *burst,
                        },
                        RateLimit {
                            name: r.name.clone().unwrap_or_default(),
                            requests_per_unit: *requests_per_unit,
                            unit: proto_unit(*unit) as i32,
                        },
                        r.shadow_mode,
                    ),
                },
                _ => {
                    plans.push(Plan::NoLimit);
                    continue;
                }
            };
            let shared = mt.as_ref().map(|m| m.shared.as_slice()).unwrap_or(&[]);
            let entries: Vec<(&str, KeyValue<'_>)> = d
                .entries
                .iter()
                .enumerate()
                .map(|(i, e)| {
                    (
                        e.key.as_str(),
                        shared
                            .get(i)
                            .copied()
                            .flatten()
                            .map_or(KeyValue::Value(&e.value), KeyValue::Shared),
                    )
                })
                .collect();
            let label = match rule {
                Some(r) if r.detailed_metric => detailed_label(&domain.name, d),
                Some(r) => r.path.clone(),
                None => format!("{}._override", domain.name),
            };
            plans.push(Plan::Limited {
                charge: charges.len(),
                label,
                current,
                cost,
            });
            charges.push(Charge {
                key: key::encode(&self.settings.key_prefix, &domain.name, &entries),
                spec: ChargeSpec {
                    limit,
                    cost,
                    kind,
                    shadow,
                },
            });
        }
        (plans, charges)
    }

    fn duration(&self, us: u128) -> PbDuration {
        if self.settings.exact_durations {
            let ms = us.div_ceil(1000);
            let secs = i64::try_from(ms / 1000).unwrap_or(i64::MAX);
            let nanos = i32::try_from((ms % 1000) * 1_000_000).unwrap_or(0);
            PbDuration {
                seconds: secs,
                nanos,
            }
        } else {
            PbDuration {
                seconds: i64::try_from(bucket::ceil_secs(us)).unwrap_or(i64::MAX),
                nanos: 0,
            }
        }
    }

    /// Micro-tokens each consume needs in its bucket for the whole request to
    /// pass: its own cost (at least 1 token: a check needs one) plus the costs of the earlier consumes (shadow ones
    /// too: they take tokens) of the same request on the same bucket. A refund
    /// earlier in the request is not subtracted, so a reported wait is never too
    /// short. Refunds get 0.
    fn request_needs_micro(charges: &[Charge]) -> Vec<u128> {
        let mut taken: std::collections::HashMap<&str, u128> = std::collections::HashMap::new();
        charges
            .iter()
            .map(|c| {
                if c.spec.kind != ChargeKind::Consume {
                    return 0;
                }
                let taken_before = taken.entry(c.key.as_str()).or_insert(0);
                let need = *taken_before + u128::from(c.spec.cost.max(1)) * u128::from(MICRO);
                *taken_before += u128::from(c.spec.cost) * u128::from(MICRO);
                need
            })
            .collect()
    }

    fn respond(
        &self,
        plans: &[Plan],
        charges: &[Charge],
        result: &bucket::RequestResult,
    ) -> RateLimitResponse {
        let mut statuses = Vec::with_capacity(plans.len());
        let mut over = false;
        let mut retry_after_us: u128 = 0;
        // (status index, unit seconds) of every status that carries a limit.
        let mut limited: Vec<(usize, u64)> = Vec::new();
        let need_micro = Self::request_needs_micro(charges);
        for plan in plans {
            let (charge_idx, label, current, cost) = match plan {
                Plan::NoLimit => {
                    statuses.push(no_limit());
                    continue;
                }
                Plan::Unlimited => {
                    statuses.push(unlimited());
                    continue;
                }
                Plan::Limited {
                    charge,
                    label,
                    current,
                    cost,
                    ..
                } => (*charge, label, current, *cost),
            };
            let spec = &charges[charge_idx].spec;
            // Shadow rules never deny and are not announced in headers.
            if !spec.shadow {
                limited.push((statuses.len(), spec.limit.unit_secs.get()));
            }
            let r = result.charges[charge_idx];
            let limit = &spec.limit;
            let remaining = u32::try_from(r.tokens_micro / MICRO).unwrap_or(u32::MAX);
            // A u64 `hits_addend` near its maximum would wrap a counter in one
            // or two requests, and Prometheus reads a counter going down as a
            // reset; one request counts at most u32::MAX hits (the reference
            // service's hits are u32 throughout).
            let counted = cost.min(u64::from(u32::MAX));
            if spec.kind == ChargeKind::Consume {
                metrics::counter!(m::TOTAL_HITS, "rule" => label.clone()).increment(counted);
            }
            let status = if spec.kind == ChargeKind::Refund || r.enough {
                if spec.kind == ChargeKind::Consume && result.admitted {
                    metrics::counter!(m::WITHIN_LIMIT, "rule" => label.clone()).increment(counted);
                    let cap = limit.capacity_micro();
                    let low = (cap as f64) * (1.0 - self.settings.near_limit_ratio);
                    if cost > 0 && (r.tokens_micro as f64) < low {
                        metrics::counter!(m::NEAR_LIMIT, "rule" => label.clone())
                            .increment(counted);
                    }
                }
                DescriptorStatus {
                    code: Code::Ok as i32,
                    current_limit: Some(current.clone()),
                    limit_remaining: remaining,
                    duration_until_reset: Some(
                        self.duration(bucket::time_to_full_us(limit, r.tokens_micro)),
                    ),
                    quota: None,
                }
            } else {
                metrics::counter!(m::OVER_LIMIT, "rule" => label.clone()).increment(counted);
                let cap = limit.capacity_micro();
                let own = u128::from(spec.cost.max(1)) * u128::from(MICRO);
                // Earlier consumes of this request on the same bucket must fit
                // too: wait until all of them do, not only this one's cost.
                let need = need_micro[charge_idx].max(own);
                let wait_us = if limit.requests_per_unit == 0 {
                    u128::from(limit.unit_secs.get()) * 1_000_000
                } else if need > cap {
                    if own > cap {
                        metrics::counter!(m::HITS_EXCEED_CAPACITY, "rule" => label.clone())
                            .increment(counted);
                    }
                    bucket::time_to_full_us(limit, r.tokens_micro)
                } else {
                    limit
                        .wait_us(need - u128::from(r.tokens_micro).min(need))
                        .unwrap_or(0)
                };
                // Never 0 on OVER_LIMIT: at least one microsecond, i.e. "1" second.
                let wait_us = wait_us.max(1);
                let code = if spec.shadow {
                    metrics::counter!(m::SHADOW_MODE, "rule" => label.clone()).increment(counted);
                    Code::Ok
                } else {
                    over = true;
                    retry_after_us = retry_after_us.max(wait_us);
                    Code::OverLimit
                };
                DescriptorStatus {
                    code: code as i32,
                    current_limit: Some(current.clone()),
                    limit_remaining: 0,
                    duration_until_reset: Some(self.duration(wait_us)),
                    quota: None,
                }
            };
            statuses.push(status);
        }
        let mut resp = RateLimitResponse {
            overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
            statuses,
            ..Default::default()
        };
        if over {
            resp.response_headers_to_add.push(header(
                "retry-after",
                bucket::ceil_secs(retry_after_us).to_string(),
            ));
        }
        self.add_rate_limit_headers(&mut resp, &limited);
        resp
    }

    /// Adds the optional `RateLimit` headers (see [`RateLimitHeaders`]).
    fn add_rate_limit_headers(&self, resp: &mut RateLimitResponse, limited: &[(usize, u64)]) {
        let mode = self.settings.rate_limit_headers;
        if mode == RateLimitHeaders::Off {
            return;
        }
        // On OVER_LIMIT, the denial with the longest wait (the one
        // `retry-after` reports), first on ties; otherwise the most
        // restrictive: strictly smallest remaining, first on ties (Envoy's
        // rule). Shadow statuses are not in `limited`.
        let over = resp.overall_code == Code::OverLimit as i32;
        let wait = |i: usize| {
            resp.statuses[i]
                .duration_until_reset
                .map_or((0, 0), |d| (d.seconds, d.nanos))
        };
        let chosen = if over {
            limited
                .iter()
                .filter(|(i, _)| resp.statuses[*i].code == Code::OverLimit as i32)
                .max_by_key(|(i, _)| (wait(*i), std::cmp::Reverse(*i)))
        } else {
            limited
                .iter()
                .min_by_key(|(i, _)| (resp.statuses[*i].limit_remaining, *i))
        };
        let Some(&(tightest, _)) = chosen else {
            return;
        };
        let st = &resp.statuses[tightest];
        let reset = st
            .duration_until_reset
            .map_or(0, |d| d.seconds.max(0) + i64::from(d.nanos > 0));
        let rpu = |i: usize| {
            resp.statuses[i]
                .current_limit
                .as_ref()
                .map_or(0, |l| l.requests_per_unit)
        };
        let name = |i: usize| {
            let n = resp.statuses[i]
                .current_limit
                .as_ref()
                .map_or("", |l| l.name.as_str());
            if n.is_empty() {
                format!("limit{i}")
            } else {
                n.chars()
                    .map(|c| {
                        if c.is_ascii_alphanumeric() || "_-.:/".contains(c) {
                            c
                        } else {
                            '_'
                        }
                    })
                    .collect()
            }
        };
        let headers = match mode {
            RateLimitHeaders::Off => return,
            RateLimitHeaders::Draft03 => {
                let mut limit = rpu(tightest).to_string();
                for (i, secs) in limited {
                    limit.push_str(&format!(", {};w={secs}", rpu(*i)));
                }
                vec![
                    header("ratelimit-limit", limit),
                    header("ratelimit-remaining", st.limit_remaining.to_string()),
                    header("ratelimit-reset", reset.to_string()),
                ]
            }
            RateLimitHeaders::Ietf => {
                let policy = limited
                    .iter()
                    .map(|(i, secs)| format!("\"{}\";q={};w={secs}", name(*i), rpu(*i)))
                    .collect::<Vec<_>>()
                    .join(", ");
                vec![
                    header("ratelimit-policy", policy),
                    header(
                        "ratelimit",
                        format!("\"{}\";r={};t={reset}", name(tightest), st.limit_remaining),
                    ),
                ]
            }
        };
        resp.response_headers_to_add.extend(headers);
    }

    fn storage_failed(
        &self,
        plans: &[Plan],
        e: &StorageError,
    ) -> Result<RateLimitResponse, Status> {
        metrics::counter!(m::STORAGE_ERRORS, "kind" => e.kind().to_owned()).increment(1);
        // One line per failure, but at most one per STORAGE_LOG_INTERVAL: an
        // outage at thousands of requests per second must not flood the log
        // (the metric counts every failure).
        let suppressed = {
            let mut log = self.storage_log.lock();
            let now = Instant::now();
            match log.0 {
                Some(last) if now.duration_since(last) < STORAGE_LOG_INTERVAL => {
                    log.1 += 1;
                    None
                }
                _ => {
                    log.0 = Some(now);
                    Some(std::mem::take(&mut log.1))
                }
            }
        };
        if let Some(suppressed) = suppressed {
            tracing::error!(error = %e, policy = ?self.settings.on_storage_error, suppressed, "storage call failed");
        }
        let answer = |limited: fn() -> DescriptorStatus, overall: Code| {
            let statuses = plans
                .iter()
                .map(|p| match p {
                    Plan::NoLimit => no_limit(),
                    Plan::Unlimited => unlimited(),
                    Plan::Limited { .. } => limited(),
                })
                .collect();
            RateLimitResponse {
                overall_code: overall as i32,
                statuses,
                ..Default::default()
            }
        };
        match self.settings.on_storage_error {
            OnStorageError::Unavailable => Err(Status::unavailable(format!(
                "rate limit storage unavailable: {e}"
            ))),
            // Fail open: never with a current_limit that was not checked.
            OnStorageError::Allow => Ok(answer(no_limit, Code::Ok)),
            OnStorageError::Deny => Ok(answer(
                || DescriptorStatus {
                    code: Code::OverLimit as i32,
                    ..Default::default()
                },
                Code::OverLimit,
            )),
        }
    }
}

fn detailed_label(domain: &str, d: &RateLimitDescriptor) -> String {
    let mut s = domain.to_owned();
    for e in &d.entries {
        s.push('.');
        s.push_str(&e.key);
        s.push('_');
        s.push_str(&e.value);
    }
    s
}

fn header(key: &str, value: String) -> HeaderValue {
    HeaderValue {
        key: key.into(),
        value,
        ..Default::default()
    }
}

fn no_limit() -> DescriptorStatus {
    DescriptorStatus {
        code: Code::Ok as i32,
        ..Default::default()
    }
}

fn unlimited() -> DescriptorStatus {
    DescriptorStatus {
        code: Code::Ok as i32,
        limit_remaining: UNLIMITED_REMAINING,
        ..Default::default()
    }
}

fn unit_from_override(u: i32) -> Option<Unit> {
    Some(match RateLimitUnit::try_from(u).ok()? {
        RateLimitUnit::Second => Unit::Second,
        RateLimitUnit::Minute => Unit::Minute,
        RateLimitUnit::Hour => Unit::Hour,
        RateLimitUnit::Day => Unit::Day,
        RateLimitUnit::Month => Unit::Month,
        RateLimitUnit::Year => Unit::Year,
        RateLimitUnit::Unknown => return None,
    })
}

/// The proto enum value of a config unit.
#[must_use]
pub fn proto_unit(u: Unit) -> ProtoUnit {
    match u {
        Unit::Second => ProtoUnit::Second,
        Unit::Minute => ProtoUnit::Minute,
        Unit::Hour => ProtoUnit::Hour,
        Unit::Day => ProtoUnit::Day,
        Unit::Week => ProtoUnit::Week,
        Unit::Month => ProtoUnit::Month,
        Unit::Year => ProtoUnit::Year,
    }
}

/// The tonic service around a shared [`Limiter`].
#[derive(Debug, Clone)]
pub struct RateLimitGrpc(pub Arc<Limiter>);

#[tonic::async_trait]
impl RateLimitService for RateLimitGrpc {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        self.0
            .should_rate_limit(request.get_ref())
            .await
            .map(Response::new)
    }
}

impl RateLimitGrpc {
    /// The tonic server for this service (max message size 4 MiB, as tonic's default).
    #[must_use]
    pub fn server(limiter: Arc<Limiter>) -> RateLimitServiceServer<Self> {
        RateLimitServiceServer::new(Self(limiter))
    }
}
