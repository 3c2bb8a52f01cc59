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
        }
    }
}

/// How long `serve` waits for in-flight requests after SIGTERM.
pub const DRAIN_GRACE: Duration = Duration::from_secs(10);
