//! Metric names, described once. Names and labels are a stable contract
//! (documented in the README).
//!
//! Per-rule counters carry the label `rule` = the rule path
//! (`domain.key_value.key2`); with `detailed_metric: true` the path uses the
//! request's own values instead (opt-in cardinality).

/// Hits (descriptor costs) seen per rule. Label `rule`.
pub const TOTAL_HITS: &str = "bucket_rls_total_hits_total";
/// Hits admitted per rule. Label `rule`.
pub const WITHIN_LIMIT: &str = "bucket_rls_within_limit_total";
/// Hits denied (or that would be denied, in shadow mode) per rule. Label `rule`.
pub const OVER_LIMIT: &str = "bucket_rls_over_limit_total";
/// Admitted hits that left the bucket below `1 - near_limit_ratio` of its capacity. Label `rule`.
pub const NEAR_LIMIT: &str = "bucket_rls_near_limit_total";
/// Hits a shadow-mode rule would have denied. Label `rule`.
pub const SHADOW_MODE: &str = "bucket_rls_shadow_mode_total";
/// Hits whose cost exceeds the bucket capacity (never admissible). Label `rule`.
pub const HITS_EXCEED_CAPACITY: &str = "bucket_rls_hits_exceed_capacity_total";
/// Requests for a domain no config defines. Label `domain` (first 100 distinct, then `other`).
pub const DOMAIN_NOT_FOUND: &str = "bucket_rls_domain_not_found_total";
/// Requests rejected as malformed or failed. Label `kind` (`invalid_argument`, `storage`).
pub const SERVICE_ERROR: &str = "bucket_rls_service_error_total";
/// Storage failures. Label `kind` (`timeout`, `unreachable`, `circuit_open`, `CLUSTERDOWN`, ...).
pub const STORAGE_ERRORS: &str = "bucket_rls_storage_errors_total";
/// Config loads. Label `result` (`success`, `error`).
pub const CONFIG_LOAD: &str = "bucket_rls_config_load_total";
/// `ShouldRateLimit` latency in seconds (histogram).
pub const REQUEST_DURATION: &str = "bucket_rls_request_duration_seconds";

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
        HITS_EXCEED_CAPACITY,
        "Hits whose cost exceeds the bucket capacity"
    );
    describe_counter!(DOMAIN_NOT_FOUND, "Requests for an unknown domain");
    describe_counter!(SERVICE_ERROR, "Requests answered with an error");
    describe_counter!(STORAGE_ERRORS, "Storage failures by kind");
    describe_counter!(CONFIG_LOAD, "Config loads by result");
    describe_histogram!(REQUEST_DURATION, Unit::Seconds, "ShouldRateLimit latency");
}
