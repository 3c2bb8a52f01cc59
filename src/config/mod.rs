//! Configuration: YAML files (one domain each) compiled into descriptor trees.
//!
//! - [`schema`]: the raw YAML shape, every scalar kept as literal text with its line.
//! - [`compile`]: validates a raw tree and compiles it into [`Config`].
//! - [`files`]: reads files and directories (bounded, hashed) for [`compile`].
//! - [`handle`]: the [`ConfigHandle`] in force, shared by the request path
//!   (reads), the config sources (writes, through [`ConfigHandle::apply`]
//!   only) and the admin API.
//! - [`source`]: the config sources side by side: the file watcher and xDS.
//! - [`diff`]: `check-config --diff`, rule by rule.

pub mod compile;
pub mod diff;
pub mod files;
pub mod handle;
pub mod problem;
pub mod scalar;
pub mod schema;
pub mod source;

pub use handle::{ConfigHandle, OnSwap, Origin, Outcome, PushStatus, ReloadError, SourceStatus};

use crate::matcher::Level;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

/// A rate limit unit with the fixed lengths of the reference service
/// (envoyproxy/ratelimit: month = 30 days, year = 365 days).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unit {
    /// 1 s
    Second,
    /// 60 s
    Minute,
    /// 3,600 s
    Hour,
    /// 86,400 s
    Day,
    /// 7 days
    Week,
    /// 30 days
    Month,
    /// 365 days
    Year,
}

impl Unit {
    /// Length of the unit in seconds.
    #[must_use]
    pub const fn secs(self) -> u64 {
        match self {
            Self::Second => 1,
            Self::Minute => 60,
            Self::Hour => 3_600,
            Self::Day => 86_400,
            Self::Week => 7 * 86_400,
            Self::Month => 30 * 86_400,
            Self::Year => 365 * 86_400,
        }
    }

    /// Length of the unit in seconds, as the non-zero type bucket limits take.
    #[must_use]
    pub const fn secs_nonzero(self) -> std::num::NonZeroU64 {
        match std::num::NonZeroU64::new(self.secs()) {
            Some(s) => s,
            None => std::num::NonZeroU64::MIN,
        }
    }

    /// Parses a unit name, case-insensitively (`second` ... `year`).
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.to_ascii_lowercase().as_str() {
            "second" => Self::Second,
            "minute" => Self::Minute,
            "hour" => Self::Hour,
            "day" => Self::Day,
            "week" => Self::Week,
            "month" => Self::Month,
            "year" => Self::Year,
            _ => return None,
        })
    }

    /// Upper-case name of the unit in the Envoy protos (`SECOND` ... `YEAR`,
    /// `WEEK`), as protobuf JSON and the Go service's metadata write it.
    #[must_use]
    pub const fn proto_name(self) -> &'static str {
        match self {
            Self::Second => "SECOND",
            Self::Minute => "MINUTE",
            Self::Hour => "HOUR",
            Self::Day => "DAY",
            Self::Week => "WEEK",
            Self::Month => "MONTH",
            Self::Year => "YEAR",
        }
    }

    /// Lower-case name as written in configs.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Second => "second",
            Self::Minute => "minute",
            Self::Hour => "hour",
            Self::Day => "day",
            Self::Week => "week",
            Self::Month => "month",
            Self::Year => "year",
        }
    }
}

/// What a rule does when it matches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Policy {
    /// `requests_per_unit` tokens per `unit`: a token bucket of capacity
    /// `burst`, or a window of `requests_per_unit` per unit.
    Limited {
        /// `R`, tokens per unit; 0 blocks everything the rule matches.
        requests_per_unit: u32,
        /// `U`.
        unit: Unit,
        /// `C` in tokens (default `R`); never 0 when `R > 0`. A window's is
        /// always `R` (a window refuses `burst`).
        burst: u32,
        /// `D` in tokens, when the rule gives `max_debt` (never above 0 when
        /// `R = 0`; never on a window): how far below zero the balance may
        /// go, see
        /// [`BucketLimit::max_debt`](crate::storage::BucketLimit::max_debt). `None` takes
        /// the service-wide bound ([`Policy::max_debt`]); `Some(0)` refuses it.
        max_debt: Option<u32>,
        /// The algorithm: the rule's `algorithm`, or the service-wide
        /// default it was loaded with.
        algorithm: crate::storage::AlgorithmKind,
    },
    /// Always OK, never touches storage.
    Unlimited,
}

impl Policy {
    /// The debt bound in tokens a limited policy is evaluated with: its own
    /// `max_debt` when it gives one (0 included), else `max_debt_bursts`
    /// times its burst (the service-wide setting, saturating at
    /// `u32::MAX`); 0 for a rate of 0, for a window and for `Unlimited`.
    #[must_use]
    pub fn max_debt(&self, max_debt_bursts: u32) -> u32 {
        match *self {
            Self::Limited {
                requests_per_unit,
                burst,
                max_debt,
                algorithm: crate::storage::AlgorithmKind::TokenBucket,
                ..
            } if requests_per_unit > 0 => {
                max_debt.unwrap_or_else(|| burst.saturating_mul(max_debt_bursts))
            }
            _ => 0,
        }
    }
}

/// A rule's `reservation` setting (docs/design.md, "Reservations").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReservationRule {
    /// `ttl_seconds`: how long an unsettled reservation is kept, seconds.
    pub ttl_secs: u32,
    /// `max_open`: most open reservations per bucket.
    pub max_open: u32,
}

/// A compiled rule: a node of the descriptor tree that carries a `rate_limit`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// Metric label and `/rlconfig` name: `domain.key_value.key2` (a key-only
    /// level is just its key; a wildcard level is `key_<pattern>`).
    pub path: String,
    /// `rate_limit.name`: target of `replaces`, echoed in `current_limit.name`.
    pub name: Option<String>,
    /// The limit itself.
    pub policy: Policy,
    /// Names of rules this rule removes from a request's evaluation.
    pub replaces: Vec<String>,
    /// Count and report, never deny.
    pub shadow_mode: bool,
    /// Metric labels use the request's values (opt-in cardinality).
    pub detailed_metric: bool,
    /// `quota_mode`: over its limit, this rule alone does not deny a request;
    /// a request is denied when every quota rule it hits is over (or a
    /// normal rule is).
    pub quota_mode: bool,
    /// `metadata`: returned in the response's dynamic metadata while the
    /// rule is not over its limit (with `--response-dynamic-metadata`).
    pub metadata: Option<Arc<Metadata>>,
    /// The levels from the top of the tree down to this rule, kept only when
    /// one of them sets `value_to_metric` (the metric label then carries the
    /// request's values at those levels).
    pub metric_levels: Option<Vec<MetricLevel>>,
    /// The levels from the top of the tree down to this rule, always: what
    /// a reload needs to name the storage keys of this rule's buckets
    /// ([`crate::storage::key::rule_prefixes`]).
    pub levels: Arc<[MetricLevel]>,
    /// `reservation`: the rule's last entry is each request's reservation
    /// id, not part of the bucket's identity (docs/design.md,
    /// "Reservations").
    pub reservation: Option<ReservationRule>,
    /// File the rule came from and its line, for `/rlconfig`.
    pub source: String,
    /// The counters of label [`Rule::path`], looked up once per config.
    pub counters: Arc<crate::metrics::RuleCounters>,
}

impl Rule {
    /// The limit this rule is evaluated with, `None` for `unlimited`: its
    /// algorithm, rate and unit, and for a token bucket its burst and its
    /// debt bound in tokens. The bound is the rule's own `max_debt` when it
    /// gives one, else `max_debt_bursts` times its burst; 0 for a quota
    /// rule (its own `quota_mode` or the service-wide `--quota-mode`),
    /// which keeps its quota semantics instead (a debt rule is never a
    /// quota), and 0 for a rate of 0. The one place these facts are put
    /// together: the request path, `/rlconfig` and the reload hold all read
    /// them here.
    #[must_use]
    pub fn limit(
        &self,
        settings: &crate::settings::ServiceSettings,
    ) -> Option<crate::storage::Limit> {
        let Policy::Limited {
            requests_per_unit,
            unit,
            burst,
            algorithm,
            ..
        } = self.policy
        else {
            return None;
        };
        match algorithm {
            crate::storage::AlgorithmKind::TokenBucket => {}
            crate::storage::AlgorithmKind::FixedWindow => {
                return Some(crate::storage::Limit::FixedWindow(
                    crate::storage::WindowLimit::counting(requests_per_unit, unit.secs_nonzero()),
                ));
            }
            crate::storage::AlgorithmKind::SlidingWindow => {
                return Some(crate::storage::Limit::SlidingWindow(
                    crate::storage::WindowLimit {
                        requests_per_unit,
                        unit_secs: unit.secs_nonzero(),
                        counts_denied: false,
                    },
                ));
            }
        }
        let bursts = if self.quota_mode || settings.global_quota_mode {
            0
        } else {
            settings.max_debt_bursts
        };
        Some(crate::storage::Limit::TokenBucket(
            crate::storage::BucketLimit {
                requests_per_unit,
                unit_secs: unit.secs_nonzero(),
                burst,
                max_debt: self.policy.max_debt(bursts),
            },
        ))
    }
}

/// A descriptor's `metadata`: a mapping of any YAML values, sent back as a
/// protobuf `Struct` in the response's dynamic metadata.
pub type Metadata = serde_json::Map<String, serde_json::Value>;

/// One level on the path to a rule, as `value_to_metric` labels need it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetricLevel {
    /// The level's key.
    pub key: String,
    /// How the level matches.
    pub kind: MetricLevelKind,
    /// `value_to_metric` on this level: the label carries the request's value.
    pub value_to_metric: bool,
}

/// How a [`MetricLevel`] matches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetricLevelKind {
    /// An exact `value`: the label always carries it.
    Exact(String),
    /// No `value`: the label carries only the key unless `value_to_metric`.
    KeyOnly,
    /// A wildcard `value`: the label carries the pattern unless
    /// `value_to_metric` (and not `share_threshold`, which always keeps it).
    Wildcard {
        /// The pattern as written (`api/*`).
        pattern: String,
        /// `share_threshold` on this level.
        share_threshold: bool,
    },
}

/// One domain: its rules and the compiled tree that finds them.
#[derive(Debug, Clone)]
pub struct DomainConfig {
    /// The domain name.
    pub name: String,
    /// File it was loaded from.
    pub file: String,
    /// All rules of the domain, in config order; indexed by the tree.
    pub rules: Vec<Rule>,
    /// Top level of the descriptor tree.
    pub root: Level,
    /// The counters of request overrides that match no rule (label
    /// `<domain>._override`).
    pub override_counters: Arc<crate::metrics::RuleCounters>,
}

/// A complete, validated configuration: what one reload swaps in atomically.
#[derive(Debug, Clone)]
pub struct Config {
    /// Domains by name.
    pub domains: HashMap<String, Arc<DomainConfig>>,
    /// SHA-256 (hex) over every loaded file's name and bytes, in name order:
    /// equal on every replica that runs the same policy.
    pub hash: String,
    /// When this config was loaded.
    pub loaded_at: SystemTime,
}

impl Config {
    /// An empty configuration (no domains).
    #[must_use]
    pub fn empty() -> Self {
        Self {
            domains: HashMap::new(),
            hash: files::hash_files(&[]),
            loaded_at: SystemTime::now(),
        }
    }

    /// Number of rules across all domains.
    #[must_use]
    pub fn rule_count(&self) -> usize {
        self.domains.values().map(|d| d.rules.len()).sum()
    }

    /// Number of limited rules per algorithm, every algorithm listed (in
    /// [`AlgorithmKind::ALL`](crate::storage::AlgorithmKind::ALL) order).
    #[must_use]
    pub fn rules_by_algorithm(&self) -> Vec<(crate::storage::AlgorithmKind, usize)> {
        let mut counts: Vec<(crate::storage::AlgorithmKind, usize)> =
            crate::storage::AlgorithmKind::ALL
                .iter()
                .map(|k| (*k, 0))
                .collect();
        for r in self.domains.values().flat_map(|d| d.rules.iter()) {
            if let Policy::Limited { algorithm, .. } = r.policy
                && let Some(c) = counts.iter_mut().find(|(k, _)| *k == algorithm)
            {
                c.1 += 1;
            }
        }
        counts
    }

    /// Whether going from `old` to this config lengthens the time until some
    /// bucket is full again: a rule (same domain and path) with a lower rate
    /// (tokens per second) or a larger burst. If so, the longest time to
    /// full from empty (at the debt bound) of those rules under their new
    /// limits, in microseconds, capped at [`MAX_HOLD_US`]; see
    /// `Storage::hold_existing`. Debt bounds are the ones the rules are
    /// evaluated with under `settings` ([`Rule::limit`]).
    #[must_use]
    pub fn loosened_hold_us(
        &self,
        old: &Config,
        settings: &crate::settings::ServiceSettings,
    ) -> Option<u64> {
        self.loosened(old, settings).map(|l| l.hold_us)
    }

    /// [`Self::loosened_hold_us`], with what changed ([`Loosened`]).
    #[must_use]
    pub fn loosened(
        &self,
        old: &Config,
        settings: &crate::settings::ServiceSettings,
    ) -> Option<Loosened> {
        // Rules with a rate above 0 (a rate of 0 never fills).
        let limited = |r: &Rule| {
            r.limit(settings)
                .and_then(|l| l.token_bucket().copied())
                .filter(|l| l.requests_per_unit > 0)
        };
        let mut changed: Vec<String> = Vec::new();
        let mut slowed: Vec<(String, Arc<[MetricLevel]>, u64)> = Vec::new();
        let mut hold: u128 = 0;
        for (name, d) in &self.domains {
            let before = old.domains.get(name);
            for r in &d.rules {
                let Some(limit) = limited(r) else {
                    continue;
                };
                let (rpu, secs, burst) = (limit.requests_per_unit, limit.unit_secs, limit.burst);
                // The emptiest a bucket can be: at its debt bound (the
                // larger of the old and the new one).
                // Two rules can share a path (key-only `k_a` and `k: a`):
                // every old rule of the path is compared, so a change is
                // never missed (a false match only holds buckets longer).
                let same_path = || {
                    before
                        .into_iter()
                        .flat_map(|b| b.rules.iter())
                        .filter(|o| o.path == r.path)
                };
                let debt = limit.max_debt.max(
                    same_path()
                        .filter_map(|o| o.limit(settings).map(|l| l.max_debt()))
                        .max()
                        .unwrap_or(0),
                );
                let empty = crate::storage::BucketLimit {
                    max_debt: debt,
                    ..limit
                };
                let floor = -i64::from(debt) * i64::try_from(crate::storage::MICRO).unwrap_or(0);
                let rule_hold = crate::storage::token_bucket::time_to_full_us(&empty, floor)
                    .min(u128::from(MAX_HOLD_US));
                for o in same_path() {
                    let Some(o_limit) = limited(o) else {
                        continue;
                    };
                    let (o_rpu, o_secs, o_burst) =
                        (o_limit.requests_per_unit, o_limit.unit_secs, o_limit.burst);
                    // rpu/secs < o_rpu/o_secs, in integers.
                    let slower = u128::from(rpu) * u128::from(o_secs.get())
                        < u128::from(o_rpu) * u128::from(secs.get());
                    if slower || burst > o_burst {
                        let rate = |p: &Policy| match p {
                            Policy::Limited {
                                requests_per_unit,
                                unit,
                                burst,
                                ..
                            } => format!("{requests_per_unit}/{} burst {burst}", unit.as_str()),
                            Policy::Unlimited => "unlimited".into(),
                        };
                        hold = hold.max(rule_hold);
                        if !slowed.iter().any(|(_, l, _)| Arc::ptr_eq(l, &r.levels)) {
                            slowed.push((
                                name.clone(),
                                r.levels.clone(),
                                u64::try_from(rule_hold).unwrap_or(MAX_HOLD_US),
                            ));
                        }
                        changed.push(format!(
                            "{}: {} -> {}, full again within {} s",
                            r.path,
                            rate(&o.policy),
                            rate(&r.policy),
                            rule_hold.div_ceil(1_000_000)
                        ));
                    }
                }
            }
        }
        if changed.is_empty() {
            return None;
        }
        changed.sort_unstable();
        changed.truncate(10);
        let hold = u64::try_from(hold.min(u128::from(MAX_HOLD_US))).unwrap_or(MAX_HOLD_US);
        Some(Loosened {
            hold_us: hold,
            lines: changed,
            rules: slowed,
        })
    }
}

/// What a reload lengthened ([`Config::loosened`]): the rules that now take
/// longer to fill (a lower rate or a larger burst).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loosened {
    /// The longest time to full among them, microseconds.
    pub hold_us: u64,
    /// One line per such rule, with its own time to full (`edge.user:
    /// 10/minute burst 10 -> 20/minute burst 40, full again within 120 s`),
    /// sorted, at most 10.
    pub lines: Vec<String>,
    /// Each such rule: its domain, its levels and its own time to full in
    /// microseconds (at most [`MAX_HOLD_US`]).
    pub rules: Vec<(String, Arc<[MetricLevel]>, u64)>,
}

/// Longest time a reload keeps existing buckets (366 days, in microseconds).
pub const MAX_HOLD_US: u64 = 366 * 86_400 * 1_000_000;

/// One problem found while loading a config. Displayed as
/// `file:line: path: message` (line omitted when unknown).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// File name as given (or as found in the directory).
    pub file: String,
    /// 1-based line, when the parser could give one.
    pub line: Option<u32>,
    /// Descriptor path, each level named by its index, key and value
    /// ([`compile::descriptor_path`]), e.g.
    /// `descriptors[0](key=user, value=gold).rate_limit`; empty for
    /// file-level errors.
    pub path: String,
    /// What was wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file)?;
        if let Some(l) = self.line {
            write!(f, ":{l}")?;
        }
        if !self.path.is_empty() {
            write!(f, ": {}", self.path)?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for ConfigError {}

/// All problems of one load attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

#[cfg(test)]
mod tests {
    use super::compile::compile_texts;

    fn config(rule: &str) -> super::Config {
        let yaml = format!("domain: e\ndescriptors:\n  - key: user\n    rate_limit: {rule}\n");
        compile_texts(&[("e.yaml".into(), yaml.into_bytes())]).unwrap()
    }

    #[test]
    fn loosened_sees_a_slower_rule_that_shares_its_path_with_another() {
        // Key-only `k_a` and `k: a` both have the path `h.k_a`.
        let load = |second: &str| {
            let yaml = format!(
                "domain: h\ndescriptors:\n  - key: k_a\n    rate_limit: {{unit: hour, requests_per_unit: 1, burst: 10}}\n  - key: k\n    value: a\n    rate_limit: {second}\n"
            );
            crate::config::compile::compile_texts(&[("c.yaml".to_owned(), yaml.into_bytes())])
                .expect("loads")
        };
        let old = load("{unit: minute, requests_per_unit: 10, burst: 10}");
        let new = load("{unit: hour, requests_per_unit: 1, burst: 10}");
        let changed = new
            .loosened(&old, &crate::settings::ServiceSettings::default())
            .expect("the slower k: a is seen")
            .lines;
        assert!(
            changed
                .iter()
                .any(|c| c
                    == "h.k_a: 10/minute burst 10 -> 1/hour burst 10, full again within 36000 s"),
            "{changed:?}"
        );
    }

    #[test]
    fn loosened_names_the_rules_that_take_longer_to_fill() {
        let old = config("{unit: minute, requests_per_unit: 10}");
        // Faster, same burst: buckets fill sooner, nothing to hold.
        assert_eq!(
            config("{unit: minute, requests_per_unit: 20, burst: 10}")
                .loosened(&old, &crate::settings::ServiceSettings::default()),
            None
        );
        // Faster but a larger burst: a drained bucket is further from full.
        let super::Loosened {
            hold_us,
            lines: rules,
            ..
        } = config("{unit: minute, requests_per_unit: 20, burst: 40}")
            .loosened(&old, &crate::settings::ServiceSettings::default())
            .unwrap();
        assert_eq!(
            rules,
            ["e.user: 10/minute burst 10 -> 20/minute burst 40, full again within 120 s"]
        );
        assert_eq!(hold_us, 120_000_000, "40 tokens at 20 per minute");
        // Slower.
        let rules = config("{unit: hour, requests_per_unit: 10}")
            .loosened(&old, &crate::settings::ServiceSettings::default())
            .unwrap()
            .lines;
        assert_eq!(
            rules,
            ["e.user: 10/minute burst 10 -> 10/hour burst 10, full again within 3600 s"]
        );
    }

    #[test]
    fn the_hold_is_that_of_the_slowed_rules_not_the_slowest_rule() {
        let load = |user: &str| {
            let yaml = format!(
                "domain: e\ndescriptors:\n  - key: daily\n    rate_limit: {{unit: day, requests_per_unit: 1}}\n  - key: user\n    rate_limit: {user}\n"
            );
            compile_texts(&[("e.yaml".into(), yaml.into_bytes())]).unwrap()
        };
        let old = load("{unit: minute, requests_per_unit: 10}");
        let super::Loosened {
            hold_us,
            lines: rules,
            rules: slowed,
        } = load("{unit: hour, requests_per_unit: 10}")
            .loosened(&old, &crate::settings::ServiceSettings::default())
            .unwrap();
        // Only e.user's keys are held, for its own hour.
        assert_eq!(slowed.len(), 1);
        assert_eq!(slowed[0].2, 3_600_000_000);
        assert_eq!(
            crate::storage::key::rule_prefixes("p:", &slowed[0].0, &slowed[0].1),
            ["p:d1:e|k4:user=".to_owned(), "p:d1:e#".to_owned()]
        );
        // The unchanged 1/day rule takes a day to fill; only e.user slowed.
        assert_eq!(hold_us, 3_600_000_000);
        assert_eq!(
            rules,
            ["e.user: 10/minute burst 10 -> 10/hour burst 10, full again within 3600 s"]
        );
    }
}
