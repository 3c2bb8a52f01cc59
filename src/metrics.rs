//! Metric names, described once. Names and labels are a stable contract
//! (documented in the README).
//!
//! Per-rule counters carry the label `rule` = the rule path
//! (`domain.key_value.key2`); with `detailed_metric: true` the path uses the
//! request's own values instead (opt-in cardinality).

/// Hits (descriptor costs) seen per rule. Label `rule`.
pub const TOTAL_HITS: &str = "bucket_rls_hits_total";
/// Hits admitted per rule. Label `rule`.
pub const WITHIN_LIMIT: &str = "bucket_rls_within_limit_total";
/// Hits denied (or that would be denied, in shadow mode) per rule. Label `rule`.
pub const OVER_LIMIT: &str = "bucket_rls_over_limit_total";
/// Admitted hits that left the bucket below `1 - near_limit_ratio` of its capacity. Label `rule`.
pub const NEAR_LIMIT: &str = "bucket_rls_near_limit_total";
/// Hits a shadow-mode rule would have denied. Label `rule`.
pub const SHADOW_MODE: &str = "bucket_rls_shadow_mode_total";
/// Counter: requests `--shadow-mode` answered OK that its rules would have denied.
pub const GLOBAL_SHADOW_MODE: &str = "bucket_rls_global_shadow_mode_total";
/// Hits whose cost exceeds the bucket capacity (never admissible). Label `rule`.
pub const HITS_EXCEED_CAPACITY: &str = "bucket_rls_hits_exceed_capacity_total";
/// Requests for a domain no config defines. Label `domain` (first 100 distinct, then `other`).
pub const DOMAIN_NOT_FOUND: &str = "bucket_rls_domain_not_found_total";
/// Requests rejected as malformed or failed. Label `kind` (`invalid_argument`, `storage`, `no_config`).
pub const SERVICE_ERROR: &str = "bucket_rls_service_error_total";
/// Storage failures. Label `kind` (`timeout`, `unreachable`, `circuit_open`, `CLUSTERDOWN`, ...).
pub const STORAGE_ERRORS: &str = "bucket_rls_storage_errors_total";
/// Config loads. Label `result` (`success`, `error`).
pub const CONFIG_LOAD: &str = "bucket_rls_config_load_total";
/// Gauge: 1 when the last reload reported was applied (or the source came
/// back to the config in force), 0 while the source on disk fails to load.
pub const CONFIG_LAST_RELOAD_SUCCESSFUL: &str = "bucket_rls_config_last_reload_successful";
/// Gauge: Unix time of the last reload outcome reported (applied, failed, or
/// the source back to the config in force).
pub const CONFIG_LAST_RELOAD_TIMESTAMP: &str = "bucket_rls_config_last_reload_timestamp_seconds";
/// Times the Redis request library or script was loaded again after
/// `Function not found` or `NOSCRIPT`.
pub const REDIS_SCRIPT_RELOAD: &str = "bucket_rls_redis_script_reload_total";
/// Requests answered from the local over-limit cache without a Redis call.
pub const LOCAL_CACHE_HITS: &str = "bucket_rls_local_cache_hits_total";
/// 1 while the Redis circuit breaker is open, else 0 (gauge).
pub const REDIS_CIRCUIT_OPEN: &str = "bucket_rls_redis_circuit_open";
/// Counter: xDS responses handled. Label `result` (`ack`, `nack`).
pub const XDS_RESPONSES: &str = "bucket_rls_xds_responses_total";
/// Gauge: 1 while a stream to the management server is open, else 0.
pub const XDS_CONNECTED: &str = "bucket_rls_xds_connected";
/// Info gauge rendered at scrape time: label `version` = the `version_info`
/// whose config is in force (empty before the first), value 1.
pub const XDS_VERSION_INFO: &str = "bucket_rls_xds_version_info";
/// `ShouldRateLimit` latency in seconds (histogram).
pub const REQUEST_DURATION: &str = "bucket_rls_request_duration_seconds";
/// Requests per rule by outcome (labels `rule`, `outcome`: `ok`,
/// `over_limit`, `shadow_over_limit`): one per descriptor that matched a
/// limited rule and asked for tokens, whatever its cost (a refused 0-cost
/// check is one `over_limit`; a debt charge taken while over is
/// `over_limit`). The hit counters count tokens; this counts requests.
pub const RULE_REQUESTS: &str = "bucket_rls_rule_requests_total";
/// Buckets made full by `POST /reset` on the admin port (no labels).
pub const BUCKET_RESETS: &str = "bucket_rls_bucket_resets_total";
/// Reserves that opened a new reservation (docs/design.md, "Reservations").
pub const RESERVATIONS_OPENED: &str = "bucket_rls_reservations_opened_total";
/// Reserves that added their estimate to a reservation still open (the same
/// id reserved again).
pub const RESERVATIONS_ADDED: &str = "bucket_rls_reservations_added_total";
/// Settlements that found their reservation.
pub const RESERVATIONS_SETTLED: &str = "bucket_rls_reservations_settled_total";
/// Reservations found past their TTL and dropped, their estimate left
/// charged (counted when storage next looks at the bucket's reservations).
pub const RESERVATIONS_EXPIRED: &str = "bucket_rls_reservations_expired_total";
/// Reserves refused because the bucket held `max_open` open reservations.
pub const RESERVATIONS_REFUSED: &str = "bucket_rls_reservations_refused_total";
/// Settlements that found no open reservation (expired, or settled already),
/// charged in full.
pub const SETTLEMENTS_UNMATCHED: &str = "bucket_rls_settlements_without_reservation_total";
/// Buckets the memory backend forgot early because its bucket cap was reached (no labels).
pub const MEMORY_EVICTIONS: &str = "bucket_rls_memory_evictions_total";

/// Gauge: open quota (RLQS) streams.
pub const RLQS_STREAMS: &str = "bucket_rls_rlqs_streams";
/// Gauge: buckets the open quota streams hold.
pub const RLQS_BUCKETS: &str = "bucket_rls_rlqs_buckets";
/// Counter: quota usage report messages received (messages, not the
/// bucket entries inside them).
pub const RLQS_REPORTS: &str = "bucket_rls_rlqs_reports_total";
/// Counter: quota assignments sent (`QuotaAssignmentAction`s, TTL-0 ones
/// on shutdown included).
pub const RLQS_ASSIGNMENTS: &str = "bucket_rls_rlqs_assignments_total";
/// Gauge: live subscribers of a rule's bucket at its last report. Label
/// `rule` (the rule path).
pub const RLQS_SUBSCRIBERS: &str = "bucket_rls_rlqs_subscribers";

/// Counter: streams and calls refused because the process-wide memory
/// budget (`--max-buffered-request-bytes`) was used up.
pub const MEMORY_BUDGET_REFUSALS: &str = "bucket_rls_memory_budget_refusals_total";

/// Registers descriptions for every metric (call once, after installing a recorder).
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_histogram};
    describe_counter!(TOTAL_HITS, "Hits (descriptor costs) evaluated per rule");
    describe_counter!(WITHIN_LIMIT, "Hits admitted per rule");
    describe_counter!(OVER_LIMIT, "Hits denied per rule (shadow rules included)");
    describe_counter!(
        NEAR_LIMIT,
        "Admitted hits that left the bucket nearly empty"
    );
    describe_counter!(SHADOW_MODE, "Hits a shadow-mode rule would have denied");
    describe_counter!(
        RULE_REQUESTS,
        "Requests per rule by outcome (ok, over_limit, shadow_over_limit), whatever their cost"
    );
    describe_counter!(
        GLOBAL_SHADOW_MODE,
        "Requests answered OK by --shadow-mode that the rules would have denied"
    );
    describe_counter!(
        HITS_EXCEED_CAPACITY,
        "Hits whose cost exceeds the bucket capacity"
    );
    describe_counter!(DOMAIN_NOT_FOUND, "Requests for an unknown domain");
    describe_counter!(SERVICE_ERROR, "Requests answered with an error");
    describe_counter!(STORAGE_ERRORS, "Storage failures by kind");
    describe_counter!(CONFIG_LOAD, "Config loads by result");
    describe_counter!(BUCKET_RESETS, "Buckets made full by POST /reset");
    metrics::describe_gauge!(RLQS_STREAMS, "Open quota (RLQS) streams");
    metrics::describe_gauge!(RLQS_BUCKETS, "Buckets held by the open quota streams");
    describe_counter!(RLQS_REPORTS, "Quota usage report messages received");
    describe_counter!(
        MEMORY_BUDGET_REFUSALS,
        "Streams and calls refused because the process-wide memory budget was used up"
    );
    describe_counter!(RLQS_ASSIGNMENTS, "Quota assignments sent");
    metrics::describe_gauge!(
        RLQS_SUBSCRIBERS,
        "Live subscribers of a rule's bucket at its last report"
    );
    metrics::describe_gauge!(BUILD_INFO, "The running build (value always 1)");
    metrics::describe_gauge!(
        CONFIG_LAST_RELOAD_SUCCESSFUL,
        "1 when the config on disk is the config in force, 0 while it fails to load"
    );
    metrics::describe_gauge!(
        CONFIG_LAST_RELOAD_TIMESTAMP,
        Unit::Seconds,
        "Unix time of the last reload outcome"
    );
    describe_counter!(REDIS_SCRIPT_RELOAD, "Redis script reloads after NOSCRIPT");
    describe_counter!(
        LOCAL_CACHE_HITS,
        "Requests answered from the local over-limit cache"
    );
    metrics::describe_gauge!(
        REDIS_CIRCUIT_OPEN,
        "1 while the Redis circuit breaker is open"
    );
    describe_histogram!(REQUEST_DURATION, Unit::Seconds, "ShouldRateLimit latency");
    describe_counter!(XDS_RESPONSES, "xDS responses ACKed or NACKed");
    describe_counter!(RESERVATIONS_OPENED, "Reservations opened");
    describe_counter!(
        RESERVATIONS_ADDED,
        "Reserves added to a reservation still open"
    );
    describe_counter!(RESERVATIONS_SETTLED, "Reservations settled");
    describe_counter!(
        RESERVATIONS_EXPIRED,
        "Reservations dropped after their TTL, estimate left charged"
    );
    describe_counter!(
        RESERVATIONS_REFUSED,
        "Reserves refused at a bucket's max_open"
    );
    describe_counter!(
        SETTLEMENTS_UNMATCHED,
        "Settlements without an open reservation, charged in full"
    );
    describe_counter!(
        MEMORY_EVICTIONS,
        "Buckets forgotten early because the memory backend's bucket cap was reached"
    );
    metrics::describe_gauge!(
        XDS_CONNECTED,
        "1 while the xDS stream to the management server is open"
    );
}

/// Info gauge of the config in force: always exactly one series, value 1,
/// label `hash` = the config's hash (`Config::hash`). Rendered at scrape time
/// from the config in force (see [`render`]), so a reload never leaves a
/// stale series behind.
pub const CONFIG_INFO: &str = "bucket_rls_config_info";
/// Unix time in seconds at which the config in force was loaded (gauge,
/// rendered at scrape time like [`CONFIG_INFO`]).
pub const CONFIG_LOAD_TIMESTAMP: &str = "bucket_rls_config_load_timestamp_seconds";

/// Limited rules of the config in force per algorithm (gauge, label
/// `algorithm`: `token_bucket`, `fixed_window`, ...; a series for every
/// algorithm, 0 included; `unlimited` rules have none). Rendered at scrape
/// time from the config in force, like [`CONFIG_INFO`].
pub const CONFIG_RULES: &str = "bucket_rls_config_rules";

/// The [`CONFIG_RULES`] series: `counts` is the number of limited rules
/// per algorithm name.
#[must_use]
pub fn render_rules(counts: &[(&str, usize)]) -> String {
    use std::fmt::Write as _;
    let mut out = format!(
        "# HELP {CONFIG_RULES} Limited rules of the config in force per algorithm\n\
         # TYPE {CONFIG_RULES} gauge\n"
    );
    for (algorithm, n) in counts {
        let _ = writeln!(out, "{CONFIG_RULES}{{algorithm=\"{algorithm}\"}} {n}");
    }
    out
}

/// One per-rule counter (label `rule`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuleCounter {
    /// [`TOTAL_HITS`].
    Hits = 0,
    /// [`WITHIN_LIMIT`].
    WithinLimit = 1,
    /// [`NEAR_LIMIT`].
    NearLimit = 2,
    /// [`OVER_LIMIT`].
    OverLimit = 3,
    /// [`HITS_EXCEED_CAPACITY`].
    HitsExceedCapacity = 4,
    /// [`SHADOW_MODE`].
    ShadowMode = 5,
    /// [`RULE_REQUESTS`] with `outcome="ok"`.
    RequestOk = 6,
    /// [`RULE_REQUESTS`] with `outcome="over_limit"`.
    RequestOverLimit = 7,
    /// [`RULE_REQUESTS`] with `outcome="shadow_over_limit"`.
    RequestShadowOverLimit = 8,
}

impl RuleCounter {
    /// The metric name.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Hits => TOTAL_HITS,
            Self::WithinLimit => WITHIN_LIMIT,
            Self::NearLimit => NEAR_LIMIT,
            Self::OverLimit => OVER_LIMIT,
            Self::HitsExceedCapacity => HITS_EXCEED_CAPACITY,
            Self::ShadowMode => SHADOW_MODE,
            Self::RequestOk | Self::RequestOverLimit | Self::RequestShadowOverLimit => {
                RULE_REQUESTS
            }
        }
    }

    /// The `outcome` label of a [`RULE_REQUESTS`] counter; `None` for the
    /// hit counters.
    #[must_use]
    pub const fn outcome(self) -> Option<&'static str> {
        match self {
            Self::RequestOk => Some("ok"),
            Self::RequestOverLimit => Some("over_limit"),
            Self::RequestShadowOverLimit => Some("shadow_over_limit"),
            _ => None,
        }
    }
}

/// The per-rule counters of one `rule` label, each looked up in the recorder
/// on its first increment and kept, instead of a label clone and a registry
/// lookup per counter per request. A series still appears only once it is
/// first incremented. Handles bind to the recorder installed at their first
/// use: install it ([`install`]) before the first request.
pub struct RuleCounters {
    label: String,
    counters: [std::sync::OnceLock<metrics::Counter>; 9],
}

impl RuleCounters {
    /// The counters of label `label`.
    #[must_use]
    pub fn new(label: String) -> Self {
        Self {
            label,
            counters: Default::default(),
        }
    }

    /// The `rule` label.
    #[must_use]
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Adds `by` hits to counter `which` of this label.
    pub fn increment(&self, which: RuleCounter, by: u64) {
        self.counters[which as usize]
            .get_or_init(|| match which.outcome() {
                Some(outcome) => {
                    metrics::counter!(which.name(), "rule" => self.label.clone(), "outcome" => outcome)
                }
                None => metrics::counter!(which.name(), "rule" => self.label.clone()),
            })
            .increment(by);
    }
}

impl std::fmt::Debug for RuleCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("RuleCounters").field(&self.label).finish()
    }
}

/// Counters are equal when their labels are (what they count is the
/// recorder's state, not theirs).
impl PartialEq for RuleCounters {
    fn eq(&self, other: &Self) -> bool {
        self.label == other.label
    }
}

impl Eq for RuleCounters {}

/// Gauge, always 1: the running build. Label `version` (the crate version).
pub const BUILD_INFO: &str = "bucket_rls_build_info";

/// Upper bounds in seconds of the [`REQUEST_DURATION`] histogram buckets:
/// 100 µs to 100 ms, the range that matters against Envoy's 20 ms default
/// timeout.
pub const REQUEST_DURATION_BUCKETS_SECS: &[f64] = &[
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.02, 0.05, 0.1,
];

static HANDLE: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
    std::sync::OnceLock::new();

/// Installs the process-wide Prometheus recorder once and returns its handle;
/// later calls (from `serve`, the HTTP router or tests) return the same handle.
///
/// Metrics are process-global by design of the `metrics` crate: every
/// [`crate::limiter::Limiter`] in a process records into this one recorder.
/// Install it before the first metric is recorded: the `metrics` macros drop
/// what is recorded while no recorder is installed. If another recorder was
/// installed first (by an embedding program), ours is not installed, a
/// warning is logged, and the handle renders nothing of bucket-rls.
pub fn install() -> &'static metrics_exporter_prometheus::PrometheusHandle {
    HANDLE.get_or_init(|| {
        let builder = metrics_exporter_prometheus::PrometheusBuilder::new()
            .set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Full(REQUEST_DURATION.to_owned()),
                REQUEST_DURATION_BUCKETS_SECS,
            )
            // Only fails for an empty bucket list, which the constant is not.
            .unwrap_or_else(|_| metrics_exporter_prometheus::PrometheusBuilder::new());
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        if let Err(e) = metrics::set_global_recorder(recorder) {
            tracing::warn!(error = %e, "another metrics recorder is installed; /metrics will not show bucket-rls metrics");
        } else {
            describe();
            metrics::gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
        }
        handle
    })
}

/// Renders the Prometheus text exposition of every metric, followed by the
/// config identity gauges ([`CONFIG_INFO`], [`CONFIG_LOAD_TIMESTAMP`]) of
/// the config in force: its `hash` and the time it was loaded.
#[must_use]
pub fn render(hash: &str, loaded_at: std::time::SystemTime) -> String {
    use std::fmt::Write as _;
    let mut out = install().render();
    let loaded_secs = loaded_at
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let _ = write!(
        out,
        "# HELP {CONFIG_INFO} Hash of the config in force (value always 1)\n\
         # TYPE {CONFIG_INFO} gauge\n\
         {CONFIG_INFO}{{hash=\"{hash}\"}} 1\n\
         # HELP {CONFIG_LOAD_TIMESTAMP} Unix time at which the config in force was loaded\n\
         # TYPE {CONFIG_LOAD_TIMESTAMP} gauge\n\
         {CONFIG_LOAD_TIMESTAMP} {loaded_secs:.3}\n",
    );
    out
}

/// The help text of each process series.
const PROCESS_HELP: [(&str, &str); 6] = [
    (
        "process_cpu_seconds_total",
        "Total user and system CPU time spent in seconds",
    ),
    (
        "process_virtual_memory_bytes",
        "Virtual memory size in bytes",
    ),
    (
        "process_start_time_seconds",
        "Start time of the process since unix epoch in seconds",
    ),
    (
        "process_resident_memory_bytes",
        "Resident memory size in bytes",
    ),
    ("process_open_fds", "Number of open file descriptors"),
    ("process_max_fds", "Maximum number of open file descriptors"),
];

/// Linux clock ticks per second of `/proc/self/stat` (`USER_HZ`, 100 on
/// every Linux architecture's user ABI).
const CLOCK_TICKS: f64 = 100.0;

/// The standard process collector series from `/proc/self` (empty where
/// `/proc` is not mounted): `process_cpu_seconds_total`,
/// `process_resident_memory_bytes`, `process_virtual_memory_bytes`,
/// `process_open_fds`, `process_max_fds`, `process_start_time_seconds`.
#[must_use]
pub fn process_metrics() -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let mut gauge = |name: &str, kind: &str, v: f64| {
        let help = PROCESS_HELP
            .iter()
            .find(|(n, _)| *n == name)
            .map_or("", |(_, h)| h);
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
        );
    };
    if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
        // Fields after the command name in parentheses (which may hold spaces).
        let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let f: Vec<&str> = after.split_whitespace().collect();
        let field = |n: usize| f.get(n - 3).and_then(|s| s.parse::<f64>().ok());
        if let (Some(u), Some(s)) = (field(14), field(15)) {
            gauge(
                "process_cpu_seconds_total",
                "counter",
                (u + s) / CLOCK_TICKS,
            );
        }
        if let Some(v) = field(23) {
            gauge("process_virtual_memory_bytes", "gauge", v);
        }
        let btime = std::fs::read_to_string("/proc/stat").ok().and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("btime "))
                .and_then(|v| v.trim().parse::<f64>().ok())
        });
        if let (Some(start), Some(btime)) = (field(22), btime) {
            gauge(
                "process_start_time_seconds",
                "gauge",
                btime + start / CLOCK_TICKS,
            );
        }
    }
    if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
        let rss_kb = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok());
        if let Some(kb) = rss_kb {
            gauge("process_resident_memory_bytes", "gauge", kb * 1024.0);
        }
    }
    if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
        gauge("process_open_fds", "gauge", dir.count() as f64);
    }
    if let Ok(limits) = std::fs::read_to_string("/proc/self/limits") {
        let max = limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .and_then(|l| l.split_whitespace().nth(3)?.parse::<f64>().ok());
        if let Some(m) = max {
            gauge("process_max_fds", "gauge", m);
        }
    }
    out
}

/// The native exposition of `/metrics` on the admin port: every metric
/// ([`render`]), the xDS version in force when the config comes from xDS
/// (`xds_version`), and the process series ([`process_metrics`]).
#[must_use]
pub fn render_native(
    hash: &str,
    loaded_at: std::time::SystemTime,
    xds_version: Option<&str>,
) -> String {
    let mut out = render(hash, loaded_at);
    if let Some(v) = xds_version {
        out.push_str(&render_xds_version(v));
    }
    out.push_str(&process_metrics());
    out
}

/// Registers the unlabelled series of a storage backend at zero, so an
/// alert on `== 0` has a series to match from startup (labelled series
/// appear with their first event): the Redis series for a Redis backend
/// (`redis`), the memory eviction counter otherwise.
pub fn register_backend_series(redis: bool) {
    metrics::counter!(BUCKET_RESETS).increment(0);
    if redis {
        metrics::gauge!(REDIS_CIRCUIT_OPEN).increment(0.0);
        metrics::counter!(REDIS_SCRIPT_RELOAD).increment(0);
        metrics::counter!(LOCAL_CACHE_HITS).increment(0);
    } else {
        metrics::counter!(MEMORY_EVICTIONS).increment(0);
    }
}

/// Registers the xDS series at zero when an xDS source starts.
pub fn register_xds_series() {
    metrics::gauge!(XDS_CONNECTED).set(0.0);
    metrics::counter!(XDS_RESPONSES, "result" => "ack").increment(0);
    metrics::counter!(XDS_RESPONSES, "result" => "nack").increment(0);
}

/// Drains histogram samples into their buckets; the server calls this
/// periodically so memory stays bounded between scrapes.
pub fn upkeep() {
    if let Some(h) = HANDLE.get() {
        h.run_upkeep();
    }
}

/// The [`XDS_VERSION_INFO`] gauge for `version` (the version in force, already
/// cut to a bounded length by the source), as Prometheus text; the label
/// value is escaped.
#[must_use]
pub fn render_xds_version(version: &str) -> String {
    let mut v = String::with_capacity(version.len());
    for c in version.chars() {
        match c {
            '\\' => v.push_str("\\\\"),
            '"' => v.push_str("\\\""),
            '\n' => v.push_str("\\n"),
            c => v.push(c),
        }
    }
    format!(
        "# HELP {XDS_VERSION_INFO} xDS version_info of the config in force (value always 1)\n\
         # TYPE {XDS_VERSION_INFO} gauge\n\
         {XDS_VERSION_INFO}{{version=\"{v}\"}} 1\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_metrics_name_the_standard_series() {
        let p = process_metrics();
        for name in [
            "process_resident_memory_bytes",
            "process_cpu_seconds_total",
            "process_open_fds",
            "process_start_time_seconds",
        ] {
            assert!(p.contains(&format!("\n{name} ")), "{name}:\n{p}");
        }
    }
}
