//! Process settings that shape decisions (the service's, not the listeners').

use std::time::Duration;

/// What to answer when storage fails (DESIGN 4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OnStorageError {
    /// gRPC `UNAVAILABLE`: Envoy's `failure_mode_deny` decides.
    #[default]
    Unavailable,
    /// Fail open: `OK` for every descriptor, with no `current_limit`.
    Allow,
    /// Fail closed: `OVER_LIMIT` for descriptors that needed storage.
    Deny,
}

/// Optional rate limit headers added to every response that carries a limit
/// (DESIGN 4; off by default: Envoy's own `enable_x_ratelimit_headers` builds
/// `X-RateLimit-*` from the statuses). Computed from the most restrictive
/// non-shadow status: the smallest `limit_remaining`, the first one on ties,
/// as Envoy does; on `OVER_LIMIT` the denial with the longest wait, so the
/// reset agrees with `retry-after`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum RateLimitHeaders {
    /// No extra headers (`retry-after` is still sent on OVER_LIMIT).
    #[default]
    Off,
    /// `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset`
    /// (draft-ietf-httpapi-ratelimit-headers-03, the format Envoy emits).
    Draft03,
    /// `RateLimit-Policy` and `RateLimit` structured fields
    /// (draft-ietf-httpapi-ratelimit-headers-08 and later).
    Ietf,
    /// The Go reference service's headers (`LIMIT_RESPONSE_HEADERS_ENABLED`):
    /// `RateLimit-Limit` with the bare tokens per unit (no `;w=` policy),
    /// `RateLimit-Remaining` and `RateLimit-Reset` in seconds, under the
    /// names of [`HeaderNames`].
    Go,
}

/// Header names of [`RateLimitHeaders::Go`] (the Go service's
/// `LIMIT_LIMIT_HEADER`, `LIMIT_REMAINING_HEADER`, `LIMIT_RESET_HEADER`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderNames {
    /// Default `RateLimit-Limit`.
    pub limit: String,
    /// Default `RateLimit-Remaining`.
    pub remaining: String,
    /// Default `RateLimit-Reset`.
    pub reset: String,
}

impl Default for HeaderNames {
    fn default() -> Self {
        Self {
            limit: "RateLimit-Limit".into(),
            remaining: "RateLimit-Remaining".into(),
            reset: "RateLimit-Reset".into(),
        }
    }
}

/// Settings used by the request path.
#[derive(Clone, Debug)]
pub struct ServiceSettings {
    /// Prefix of every bucket key (`--redis-key-prefix`, default `rls:`).
    pub key_prefix: String,
    /// Failure policy.
    pub on_storage_error: OnStorageError,
    /// An admitted hit that leaves fewer than `(1 - ratio) * capacity` tokens
    /// counts as `near_limit` (default 0.8).
    pub near_limit_ratio: f64,
    /// Most descriptors accepted in one request; more is `INVALID_ARGUMENT`.
    pub max_descriptors: usize,
    /// Most entries accepted in one descriptor; more is `INVALID_ARGUMENT`.
    pub max_entries: usize,
    /// Send `duration_until_reset` with millisecond precision instead of whole
    /// seconds rounded up (for clients other than Envoy, which reads only seconds).
    pub exact_durations: bool,
    /// Extra `RateLimit` headers in `response_headers_to_add`.
    pub rate_limit_headers: RateLimitHeaders,
    /// Names of the [`RateLimitHeaders::Go`] headers.
    pub header_names: HeaderNames,
    /// Every rule in shadow mode (`--shadow-mode`, the Go service's
    /// `SHADOW_MODE`): evaluated, charged and counted, never denying.
    pub global_shadow_mode: bool,
    /// Every rule in quota mode (`--quota-mode`, the Go service's `QUOTA_MODE`).
    pub global_quota_mode: bool,
    /// Send `dynamic_metadata` in every response (`--response-dynamic-metadata`,
    /// the Go service's `RESPONSE_DYNAMIC_METADATA`).
    pub response_dynamic_metadata: bool,
}

impl Default for ServiceSettings {
    fn default() -> Self {
        Self {
            key_prefix: "rls:".into(),
            on_storage_error: OnStorageError::Unavailable,
            near_limit_ratio: 0.8,
            max_descriptors: 1024,
            max_entries: 64,
            exact_durations: false,
            rate_limit_headers: RateLimitHeaders::Off,
            header_names: HeaderNames::default(),
            global_shadow_mode: false,
            global_quota_mode: false,
            response_dynamic_metadata: false,
        }
    }
}

/// How long `serve` waits for in-flight requests after SIGTERM.
pub const DRAIN_GRACE: Duration = Duration::from_secs(10);
