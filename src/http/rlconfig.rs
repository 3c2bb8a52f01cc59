//! The `/rlconfig` body: one type, serialized by the admin endpoint and
//! deserialized by `check-config --diff` ([`crate::config::diff`]), so the
//! two cannot drift apart. Reading is lenient where older answers may lack
//! a field (everything but the domains, and each rule's path and
//! `unlimited`, may be missing).

use super::rfc3339;
use crate::config::{Config, ConfigHandle, Policy};
use crate::limiter::Limiter;
use serde::{Deserialize, Serialize};
use std::time::UNIX_EPOCH;

/// `/rlconfig` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RlConfig {
    /// The config's hash ([`Config::hash`]).
    #[serde(default)]
    pub hash: String,
    /// When it was loaded, RFC 3339 UTC with milliseconds.
    #[serde(default)]
    pub loaded_at: String,
    /// The same instant in milliseconds since the Unix epoch.
    #[serde(default)]
    pub loaded_at_unix_ms: u128,
    /// The storage backend's name (`memory`, `redis`, ...).
    #[serde(default)]
    pub backend: String,
    /// Where the config comes from (`file` or `xds`) and, for xDS, the
    /// version in force and the last push's outcome.
    #[serde(default)]
    pub source: SourceView,
    /// Service-wide modes (`--shadow-mode`, `--quota-mode`,
    /// `--response-dynamic-metadata`), which apply on top of each rule's own,
    /// `--max-debt-bursts` and `--default-algorithm`.
    #[serde(default)]
    pub modes: ModesView,
    /// The last reload that failed, while the source has not loaded since.
    pub last_reload_error: Option<ReloadErrorView>,
    /// Domains, sorted by name.
    pub domains: Vec<DomainView>,
}

/// Service-wide modes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModesView {
    /// `--shadow-mode`.
    #[serde(default)]
    pub shadow_mode: bool,
    /// `--quota-mode`.
    #[serde(default)]
    pub quota_mode: bool,
    /// `--response-dynamic-metadata`.
    #[serde(default)]
    pub response_dynamic_metadata: bool,
    /// `--max-debt-bursts`: the debt bound, in multiples of its burst, of a
    /// token bucket rule without a `max_debt` of its own (and not in quota
    /// mode), which each rule's `max_debt` includes. 0 (none) in the
    /// answers of replicas older than it.
    #[serde(default)]
    pub max_debt_bursts: u32,
    /// `--default-algorithm`: the algorithm of every rule that names none
    /// (each rule's `algorithm` shows it already). Absent from the answers
    /// of replicas older than it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_algorithm: Option<String>,
}

/// The config source ([`crate::config::SourceStatus`]); the optional parts
/// appear only for a source that has them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceView {
    /// `file` or `xds` (empty when no source was named).
    #[serde(default)]
    pub kind: String,
    /// The path, or the server's address.
    #[serde(default)]
    pub location: String,
    /// No config has arrived yet (xDS before its first push).
    #[serde(default)]
    pub awaiting_first_config: bool,
    /// Whether the stream to the server is open.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connected: Option<bool>,
    /// The version label of the config in force.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// The last config received and what was done with it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_push: Option<PushView>,
}

/// One config a source received.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushView {
    /// When it was received, RFC 3339.
    #[serde(default)]
    pub at: String,
    /// Its version label.
    #[serde(default)]
    pub version: String,
    /// Its nonce.
    #[serde(default)]
    pub nonce: String,
    /// `ack` or `nack`.
    #[serde(default)]
    pub outcome: String,
    /// Why it was refused.
    pub error: Option<String>,
}

/// The last failed reload.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReloadErrorView {
    /// When the failing state was first seen, RFC 3339.
    #[serde(default)]
    pub at: String,
    /// Every problem, one per line.
    #[serde(default)]
    pub message: String,
}

/// One domain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DomainView {
    /// The domain name.
    #[serde(default)]
    pub domain: String,
    /// The file (or xDS resource) it came from.
    #[serde(default)]
    pub file: String,
    /// Its rules, in config order.
    pub rules: Vec<RuleView>,
}

/// A rule's `reservation` setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationView {
    /// How long an unsettled reservation is kept, seconds.
    pub ttl_seconds: u32,
    /// Most open reservations per bucket.
    pub max_open: u32,
}

/// One rule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RuleView {
    /// `domain.key_value.key2`.
    pub path: String,
    /// `rate_limit.name`.
    #[serde(default)]
    pub name: Option<String>,
    /// `unlimited: true`.
    pub unlimited: bool,
    /// Tokens per unit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_unit: Option<u32>,
    /// The unit, lower case (`second` ... `year`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit: Option<String>,
    /// Capacity in tokens (a window's is its rate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    /// The algorithm (`token_bucket`, `fixed_window`, ...): the rule's own
    /// or the service-wide default it was loaded with. Absent from the
    /// answers of replicas older than it (they have token buckets only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<String>,
    /// The debt bound in force (the rule's `max_debt` or the service-wide
    /// multiple of its burst), when above 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_debt: Option<u32>,
    /// `shadow_mode`.
    #[serde(default)]
    pub shadow_mode: bool,
    /// `detailed_metric`.
    #[serde(default)]
    pub detailed_metric: bool,
    /// `quota_mode`.
    #[serde(default)]
    pub quota_mode: bool,
    /// `value_to_metric` on some level of its path.
    #[serde(default)]
    pub value_to_metric: bool,
    /// `metadata`.
    #[serde(default)]
    pub metadata: Option<crate::config::Metadata>,
    /// Names of the rules it replaces.
    #[serde(default)]
    pub replaces: Vec<String>,
    /// `reservation` (docs/design.md, "Reservations"), when the rule has
    /// one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation: Option<ReservationView>,
    /// `file:line` it came from.
    #[serde(default)]
    pub source: String,
}

impl RlConfig {
    /// The view of `config` as `limiter` serves it.
    #[must_use]
    pub fn of(config: &Config, limiter: &Limiter) -> Self {
        let settings = limiter.settings();
        let mut domains: Vec<DomainView> = config
            .domains
            .values()
            .map(|d| DomainView {
                domain: d.name.clone(),
                file: d.file.clone(),
                rules: d
                    .rules
                    .iter()
                    .map(|r| {
                        let (unlimited, rpu, unit, burst, algorithm) = match &r.policy {
                            Policy::Unlimited => (true, None, None, None, None),
                            Policy::Limited {
                                requests_per_unit,
                                unit,
                                burst,
                                algorithm,
                                ..
                            } => (
                                false,
                                Some(*requests_per_unit),
                                Some(unit.as_str().to_owned()),
                                Some(*burst),
                                Some(algorithm.as_str().to_owned()),
                            ),
                        };
                        RuleView {
                            path: r.path.clone(),
                            name: r.name.clone(),
                            unlimited,
                            requests_per_unit: rpu,
                            unit,
                            burst,
                            algorithm,
                            max_debt: r.limit(settings).map(|l| l.max_debt()).filter(|d| *d > 0),
                            shadow_mode: r.shadow_mode,
                            detailed_metric: r.detailed_metric,
                            quota_mode: r.quota_mode,
                            value_to_metric: r.metric_levels.is_some(),
                            metadata: r.metadata.as_deref().cloned(),
                            replaces: r.replaces.clone(),
                            reservation: r.reservation.map(|res| ReservationView {
                                ttl_seconds: res.ttl_secs,
                                max_open: res.max_open,
                            }),
                            source: r.source.clone(),
                        }
                    })
                    .collect(),
            })
            .collect();
        domains.sort_by(|a, b| a.domain.cmp(&b.domain));
        Self {
            hash: config.hash.clone(),
            loaded_at: rfc3339(config.loaded_at),
            loaded_at_unix_ms: config
                .loaded_at
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis()),
            backend: limiter.storage().name().to_owned(),
            source: SourceView::of(limiter.config_handle()),
            modes: ModesView {
                shadow_mode: settings.global_shadow_mode,
                quota_mode: settings.global_quota_mode,
                response_dynamic_metadata: settings.response_dynamic_metadata,
                max_debt_bursts: settings.max_debt_bursts,
                default_algorithm: Some(settings.default_algorithm.as_str().to_owned()),
            },
            last_reload_error: limiter
                .config_handle()
                .last_error()
                .map(|e| ReloadErrorView {
                    at: rfc3339(e.at),
                    message: e.message,
                }),
            domains,
        }
    }
}

impl SourceView {
    /// The view of `handle`'s source status.
    #[must_use]
    pub fn of(handle: &ConfigHandle) -> Self {
        let s = handle.source_status();
        Self {
            kind: s.kind.to_owned(),
            location: s.location,
            awaiting_first_config: handle.is_awaiting_first_config(),
            connected: s.connected,
            version: s.version,
            last_push: s.last_push.map(|p| PushView {
                at: rfc3339(p.at),
                version: p.version,
                nonce: p.nonce,
                outcome: if p.accepted { "ack" } else { "nack" }.to_owned(),
                error: p.error,
            }),
        }
    }
}
