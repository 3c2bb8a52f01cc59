//! Configuration: YAML files (one domain each) compiled into descriptor trees.
//!
//! - [`schema`]: the raw YAML shape, every scalar kept as literal text with its line.
//! - [`loader`]: reads files and directories, validates, compiles into [`Config`].
//! - [`watcher`]: hot reload (file events, SIGHUP, periodic rescan), atomic swap.
//! - [`xds`]: the xDS config source (a control plane pushes the config).
//! - [`ConfigHandle`]: the config in force and the last failed reload, shared by
//!   the request path (reads), the config sources (writes) and the admin API.

pub mod diff;
pub mod loader;
pub mod schema;
pub mod watcher;
pub mod xds;

use crate::matcher::Level;
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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
    /// A token bucket: `requests_per_unit` tokens per `unit`, capacity `burst`.
    Limited {
        /// `R`, tokens per unit; 0 blocks everything the rule matches.
        requests_per_unit: u32,
        /// `U`.
        unit: Unit,
        /// `C` in tokens (default `R`); never 0 when `R > 0`.
        burst: u32,
        /// `D` in tokens, when the rule gives `max_debt` (never above 0 when
        /// `R = 0`): how far below zero the balance may go, see
        /// [`BucketLimit::max_debt`](crate::storage::BucketLimit::max_debt). `None` takes
        /// the service-wide bound ([`Policy::max_debt`]); `Some(0)` refuses it.
        max_debt: Option<u32>,
    },
    /// Always OK, never touches storage.
    Unlimited,
}

impl Policy {
    /// The debt bound in tokens a limited policy is evaluated with: its own
    /// `max_debt` when it gives one (0 included), else `max_debt_bursts`
    /// times its burst (the service-wide setting, saturating at
    /// `u32::MAX`); 0 for a rate of 0 and for `Unlimited`.
    #[must_use]
    pub fn max_debt(&self, max_debt_bursts: u32) -> u32 {
        match *self {
            Self::Limited {
                requests_per_unit,
                burst,
                max_debt,
                ..
            } if requests_per_unit > 0 => {
                max_debt.unwrap_or_else(|| burst.saturating_mul(max_debt_bursts))
            }
            _ => 0,
        }
    }
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
    /// File the rule came from and its line, for `/rlconfig`.
    pub source: String,
    /// The counters of label [`Rule::path`], looked up once per config.
    pub counters: Arc<crate::metrics::RuleCounters>,
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
            hash: loader::hash_files(&[]),
            loaded_at: SystemTime::now(),
        }
    }

    /// Number of rules across all domains.
    #[must_use]
    pub fn rule_count(&self) -> usize {
        self.domains.values().map(|d| d.rules.len()).sum()
    }

    /// Whether going from `old` to this config lengthens the time until some
    /// bucket is full again: a rule (same domain and path) with a lower rate
    /// (tokens per second) or a larger burst. If so, the longest time to
    /// full from empty of any rule here, in microseconds, capped at
    /// [`MAX_HOLD_US`]; see `Storage::hold_existing`.
    #[must_use]
    pub fn loosened_hold_us(&self, old: &Config, max_debt_bursts: u32) -> Option<u64> {
        self.loosened(old, max_debt_bursts).map(|(hold, _)| hold)
    }

    /// [`Self::loosened_hold_us`], with what changed: one line per rule that
    /// got slower or larger (`edge.user: 10/minute burst 10 -> 20/minute
    /// burst 40`), sorted, at most 10.
    #[must_use]
    pub fn loosened(&self, old: &Config, max_debt_bursts: u32) -> Option<(u64, Vec<String>)> {
        let limited = |p: &Policy| match *p {
            Policy::Limited {
                requests_per_unit,
                unit,
                burst,
                ..
            } if requests_per_unit > 0 => Some((requests_per_unit, unit.secs_nonzero(), burst)),
            _ => None,
        };
        let mut changed: Vec<String> = Vec::new();
        let mut hold: u128 = 0;
        for (name, d) in &self.domains {
            let before = old.domains.get(name);
            for r in &d.rules {
                let Some((rpu, secs, burst)) = limited(&r.policy) else {
                    continue;
                };
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
                let debt = r.policy.max_debt(max_debt_bursts).max(
                    same_path()
                        .map(|o| o.policy.max_debt(max_debt_bursts))
                        .max()
                        .unwrap_or(0),
                );
                let empty = crate::storage::BucketLimit {
                    requests_per_unit: rpu,
                    unit_secs: secs,
                    burst,
                    max_debt: debt,
                };
                let floor = -i64::from(debt) * i64::try_from(crate::storage::MICRO).unwrap_or(0);
                hold = hold.max(crate::storage::token_bucket::time_to_full_us(&empty, floor));
                for o in same_path() {
                    let Some((o_rpu, o_secs, o_burst)) = limited(&o.policy) else {
                        continue;
                    };
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
                        changed.push(format!(
                            "{}: {} -> {}",
                            r.path,
                            rate(&o.policy),
                            rate(&r.policy)
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
        Some((hold, changed))
    }
}

/// The last reload that failed, kept for `/rlconfig` until a reload succeeds
/// or the source returns to the config in force.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReloadError {
    /// When the failing state was first seen.
    pub at: SystemTime,
    /// Every problem, one per line (`file:line: path: message`).
    pub message: String,
}

/// The config in force, swapped atomically on reload, and the last failed
/// reload. Owned by config: a source (the file watcher) writes it, the
/// request path reads it without locking, the admin API shows both.
#[derive(Debug)]
pub struct ConfigHandle {
    current: ArcSwap<Config>,
    last_error: Mutex<Option<ReloadError>>,
    /// No config has been swapped in yet (a source that starts empty).
    awaiting_first: AtomicBool,
    source: Mutex<SourceStatus>,
}

/// Where the config in force comes from and how its source is doing, for
/// `/rlconfig` and `/metrics`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceStatus {
    /// `file` or `xds` (empty when no source was named).
    pub kind: &'static str,
    /// The path, or the management server's address.
    pub location: String,
    /// xDS: whether a stream to the server is open.
    pub connected: Option<bool>,
    /// xDS: `version_info` of the response whose config is in force.
    pub version: Option<String>,
    /// xDS: the last response and what was done with it.
    pub last_push: Option<PushStatus>,
}

/// One pushed config and its outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushStatus {
    /// When it was received.
    pub at: SystemTime,
    /// Its `version_info` (cut to a bounded length).
    pub version: String,
    /// Its nonce (cut to a bounded length).
    pub nonce: String,
    /// ACKed (applied, or equal to the config in force) or NACKed.
    pub accepted: bool,
    /// Why it was refused.
    pub error: Option<String>,
}

impl ConfigHandle {
    /// A handle whose config in force is `config`, with no reload error.
    #[must_use]
    pub fn new(config: Config) -> Self {
        Self {
            current: ArcSwap::from_pointee(config),
            last_error: Mutex::new(None),
            awaiting_first: AtomicBool::new(false),
            source: Mutex::new(SourceStatus::default()),
        }
    }

    /// A handle with no config yet (a source that delivers it later, such
    /// as xDS): [`Self::is_awaiting_first_config`] is true until the first
    /// [`Self::swap`]; the config in force meanwhile is [`Config::empty`].
    #[must_use]
    pub fn awaiting_first_config() -> Self {
        let h = Self::new(Config::empty());
        h.awaiting_first.store(true, Ordering::Release);
        h
    }

    /// Whether no config has been swapped in yet into a handle made by
    /// [`Self::awaiting_first_config`] (the request path then answers an
    /// error).
    #[must_use]
    pub fn is_awaiting_first_config(&self) -> bool {
        self.awaiting_first.load(Ordering::Acquire)
    }

    /// The source's status.
    #[must_use]
    pub fn source_status(&self) -> SourceStatus {
        self.source.lock().clone()
    }

    /// Updates the source's status.
    pub fn update_source_status(&self, f: impl FnOnce(&mut SourceStatus)) {
        f(&mut self.source.lock());
    }

    /// The config in force, for one request: a cheap guard, no reference
    /// count taken (hold it only for the request).
    #[must_use]
    pub fn load(&self) -> arc_swap::Guard<Arc<Config>> {
        self.current.load()
    }

    /// The config in force, as an owned reference.
    #[must_use]
    pub fn current(&self) -> Arc<Config> {
        self.current.load_full()
    }

    /// Swaps `config` in atomically and returns the config it replaced.
    /// Requests already running finish on the old one.
    pub fn swap(&self, config: Config) -> Arc<Config> {
        let old = self.current.swap(Arc::new(config));
        self.awaiting_first.store(false, Ordering::Release);
        old
    }

    /// The last failed reload, if the source has not loaded since.
    #[must_use]
    pub fn last_error(&self) -> Option<ReloadError> {
        self.last_error.lock().clone()
    }

    /// Records (or clears, with `None`) the last failed reload.
    pub fn set_last_error(&self, error: Option<ReloadError>) {
        *self.last_error.lock() = error;
    }
}

/// Called after a new config is swapped in, with the old and the new config
/// (the request path uses it to clear its local cache and to hold buckets a
/// slower rule would otherwise drop).
pub type OnSwap = Arc<dyn Fn(&Config, &Config) + Send + Sync>;

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
    /// Descriptor path, e.g. `descriptors[0].rate_limit`; empty for file-level errors.
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
    use super::loader::compile_texts;

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
            crate::config::loader::compile_texts(&[("c.yaml".to_owned(), yaml.into_bytes())])
                .expect("loads")
        };
        let old = load("{unit: minute, requests_per_unit: 10, burst: 10}");
        let new = load("{unit: hour, requests_per_unit: 1, burst: 10}");
        let (_, changed) = new.loosened(&old, 0).expect("the slower k: a is seen");
        assert!(
            changed
                .iter()
                .any(|c| c == "h.k_a: 10/minute burst 10 -> 1/hour burst 10"),
            "{changed:?}"
        );
    }

    #[test]
    fn loosened_names_the_rules_that_take_longer_to_fill() {
        let old = config("{unit: minute, requests_per_unit: 10}");
        // Faster, same burst: buckets fill sooner, nothing to hold.
        assert_eq!(
            config("{unit: minute, requests_per_unit: 20, burst: 10}").loosened(&old, 0),
            None
        );
        // Faster but a larger burst: a drained bucket is further from full.
        let (hold_us, rules) = config("{unit: minute, requests_per_unit: 20, burst: 40}")
            .loosened(&old, 0)
            .unwrap();
        assert_eq!(rules, ["e.user: 10/minute burst 10 -> 20/minute burst 40"]);
        assert_eq!(hold_us, 120_000_000, "40 tokens at 20 per minute");
        // Slower.
        let (_, rules) = config("{unit: hour, requests_per_unit: 10}")
            .loosened(&old, 0)
            .unwrap();
        assert_eq!(rules, ["e.user: 10/minute burst 10 -> 10/hour burst 10"]);
    }
}
