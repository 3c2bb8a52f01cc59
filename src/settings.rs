//! Process settings: those of the request path ([`ServiceSettings`]), the
//! storage backend ([`Backend`]) and all of `serve` ([`Settings`]), and the
//! [`SetupError`] that refuses flags which contradict each other.

use crate::storage::redis::RedisOptions;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// What to answer when storage fails (`--on-storage-error`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
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
/// (`--rate-limit-headers`; off by default: Envoy's own
/// `enable_x_ratelimit_headers` builds `X-RateLimit-*` from the statuses).
/// Computed from the most restrictive
/// non-shadow status: the smallest `limit_remaining`, the first one on ties,
/// as Envoy does; on `OVER_LIMIT` the denial with the longest wait, so the
/// reset agrees with `retry-after`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
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
    /// names given by `--limit-header-name`, `--remaining-header-name` and
    /// `--reset-header-name`.
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
    /// Most entries a descriptor may have to be looked up; a longer one is
    /// deeper than any rule and is answered `OK` without a limit (as the Go
    /// service answers it) without being looked up.
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
    /// Ignore a request's `limit` override on a descriptor that matches no
    /// rule (`--ignore-unmatched-overrides`): answered `OK` without a limit
    /// and no state. Off (the default, as the Go service): such a descriptor
    /// of a known domain gets a bucket of its own, per distinct entry list,
    /// that lives until it is full again (up to one unit of the override, a
    /// year for `YEAR`), so a client that sends arbitrary descriptors with
    /// overrides creates state at its request rate.
    pub ignore_unmatched_overrides: bool,
    /// Debt bound, in multiples of its burst, of every limited rule that has
    /// no `max_debt` of its own (`--max-debt-bursts`, default 0: none), for
    /// configs that cannot carry the key (pushed over xDS, or from the Go
    /// service's environment). With 1, a rule of burst 1000 may go 1000
    /// tokens below zero. See docs/design.md, "Debt".
    pub max_debt_bursts: u32,
    /// Envoy's quota service (RLQS): a bucket id that matches no rule is
    /// sent `DENY_ALL` instead of `ALLOW_ALL` (`--rlqs-unmatched deny`).
    pub rlqs_deny_unmatched: bool,
    /// The algorithm of a request's `limit` override
    /// (`--default-algorithm`, which is also the algorithm of every rule
    /// that names none: [`LoadOptions`](crate::config::compile::LoadOptions)).
    pub default_algorithm: crate::storage::AlgorithmKind,
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
            ignore_unmatched_overrides: false,
            max_debt_bursts: 0,
            rlqs_deny_unmatched: false,
            default_algorithm: crate::storage::AlgorithmKind::TokenBucket,
        }
    }
}

/// How long `serve` waits for in-flight requests after SIGTERM.
pub const DRAIN_GRACE: Duration = Duration::from_secs(10);

/// Everything `serve` needs besides the config itself, checked and complete:
/// built from the command line by `TryFrom<&ServeArgs>` (in [`crate::cli`]).
#[derive(Clone, Debug)]
pub struct Settings {
    /// Where the config comes from (`--config` or `--config-xds`).
    pub config: ConfigSource,
    /// gRPC listen address (`--grpc-addr`).
    pub grpc_addr: SocketAddr,
    /// HTTP admin listen address (`--http-addr`).
    pub http_addr: SocketAddr,
    /// Settings of the request path.
    pub service: ServiceSettings,
    /// How config files become one config (`--merge-domain-config`).
    pub load: crate::config::compile::LoadOptions,
    /// The storage backend and its options.
    pub backend: Backend,
    /// OpenTelemetry span export (off without an endpoint).
    pub tracing: crate::otel::TracingSettings,
    /// Serve gRPC server reflection on the gRPC port (on unless
    /// `--disable-grpc-reflection`).
    pub grpc_reflection: bool,
    /// TLS on the gRPC port (`--grpc-tls-cert`, `--grpc-tls-key`); `None` =
    /// plaintext.
    pub grpc_tls: Option<GrpcTls>,
    /// What `/healthcheck` and the gRPC health service report.
    pub health: HealthMode,
    /// Listener of `/metrics` with the Go service's metric names
    /// (`--go-metrics-addr`, the Go service's `PROMETHEUS_ADDR`).
    pub go_metrics: Option<GoMetrics>,
    /// Listener of the plain-text `/rlconfig` (`--debug-addr`, the Go
    /// service's `DEBUG_HOST`/`DEBUG_PORT`).
    pub debug_addr: Option<SocketAddr>,
    /// After SIGTERM, how long health answers "unhealthy" while every port
    /// keeps serving, before the drain starts (`--shutdown-delay-secs`).
    pub shutdown_delay: Duration,
}

/// Files of the gRPC server's TLS (`--grpc-tls-*`; the Go service's
/// `GRPC_SERVER_TLS_CERT`, `GRPC_SERVER_TLS_KEY`, `GRPC_CLIENT_TLS_CACERT`,
/// `GRPC_CLIENT_TLS_SAN`). Read at startup and again when they change
/// (the `tls` module).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrpcTls {
    /// PEM certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// PEM private key (PKCS#1, PKCS#8 or SEC1).
    pub key_file: PathBuf,
    /// PEM CA certificate(s): when given, clients must present a
    /// certificate signed by one of them.
    pub client_ca_file: Option<PathBuf>,
    /// A DNS name or IP address the client certificate must carry as a
    /// subject alternative name (only with `client_ca_file`).
    pub client_san: Option<String>,
}

/// The Go-compatible metrics listener (`--go-metrics-addr`, `--go-metrics-path`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GoMetrics {
    /// Listen address.
    pub addr: SocketAddr,
    /// Path of the exposition (default `/metrics`).
    pub path: String,
}

/// What health reports (`--health-mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HealthMode {
    /// bucket-rls's own: `/healthcheck` reflects whether storage answers.
    #[default]
    Native,
    /// The Go service's: healthy once storage answered one ping, whatever
    /// happens to it later; unhealthy after SIGTERM; with `require_config`
    /// (`HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED`) also until a config is
    /// loaded.
    Go {
        /// Unhealthy until a config is loaded.
        require_config: bool,
    },
}

/// The one source of the config: files or a control plane.
#[derive(Clone, Debug, PartialEq)]
pub enum ConfigSource {
    /// A config file or directory (`--config`), watched for changes.
    File(PathBuf),
    /// An xDS management server (`--config-xds`) pushing `RateLimitConfig`
    /// resources.
    Xds(Box<crate::config::source::xds::XdsSettings>),
}

/// Which storage holds the buckets, with the options of that backend. At
/// most one Redis topology exists by construction; options that only one
/// topology reads (the master's credentials) live in its variant. `Debug`
/// shows addresses with their passwords replaced by `***`.
#[derive(Clone, PartialEq, Eq)]
pub enum Backend {
    /// Buckets in this process (no Redis flag given).
    Memory {
        /// Most buckets held (`--memory-max-buckets`).
        max_buckets: usize,
    },
    /// One Redis node (`--redis-url`).
    Redis {
        /// `redis://[user:password@]host:port/db` or `rediss://...`.
        url: String,
        /// Options shared by the Redis topologies (`--redis-timeout`,
        /// `--local-cache-size`, `--redis-tls-*`; the breaker at its defaults).
        redis: RedisOptions,
    },
    /// A master found through Redis Sentinel (`--redis-sentinel`).
    Sentinel {
        /// Sentinel addresses (`host:port` or URLs), at least one.
        sentinels: Vec<String>,
        /// Master name watched by the Sentinels (`--redis-master-name`).
        master_name: String,
        /// Credentials of the master (not of the Sentinels).
        master_auth: MasterAuth,
        /// Options shared by the Redis topologies (`--redis-timeout`,
        /// `--local-cache-size`, `--redis-tls-*`; the breaker at its defaults).
        redis: RedisOptions,
    },
    /// Redis Cluster (`--redis-cluster`).
    Cluster {
        /// Seed nodes (`host:port` or URLs), at least one.
        nodes: Vec<String>,
        /// Options shared by the Redis topologies (`--redis-timeout`,
        /// `--local-cache-size`, `--redis-tls-*`; the breaker at its defaults).
        redis: RedisOptions,
    },
}

impl Backend {
    /// The options shared by the Redis topologies; `None` for memory.
    #[must_use]
    pub fn redis(&self) -> Option<&RedisOptions> {
        match self {
            Self::Memory { .. } => None,
            Self::Redis { redis, .. }
            | Self::Sentinel { redis, .. }
            | Self::Cluster { redis, .. } => Some(redis),
        }
    }
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::storage::redis::redact_url;
        let redact_all = |urls: &[String]| urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>();
        match self {
            Self::Memory { max_buckets } => f
                .debug_struct("Memory")
                .field("max_buckets", max_buckets)
                .finish(),
            Self::Redis { url, redis } => f
                .debug_struct("Redis")
                .field("url", &redact_url(url))
                .field("redis", redis)
                .finish(),
            Self::Sentinel {
                sentinels,
                master_name,
                master_auth,
                redis,
            } => f
                .debug_struct("Sentinel")
                .field("sentinels", &redact_all(sentinels))
                .field("master_name", master_name)
                .field("master_auth", master_auth)
                .field("redis", redis)
                .finish(),
            Self::Cluster { nodes, redis } => f
                .debug_struct("Cluster")
                .field("nodes", &redact_all(nodes))
                .field("redis", redis)
                .finish(),
        }
    }
}

/// ACL user and password of the master found through Sentinel
/// (`--redis-master-username`, `--redis-master-password`). `Debug` never
/// shows the password.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct MasterAuth {
    /// ACL user; `None` = the default user.
    pub username: Option<String>,
    /// Password (`requirepass` or the ACL user's); `None` = no `AUTH`.
    pub password: Option<String>,
}

impl std::fmt::Debug for MasterAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MasterAuth")
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .finish()
    }
}

/// Why `serve` cannot start with the flags given: flags that contradict each
/// other or that another flag needs, an unreadable CA file, a Redis address
/// that does not parse (each message names the flag), or a config that does
/// not load.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// The config files given to `serve` do not load (every problem, one
    /// per line).
    #[error("invalid config, not starting:\n{0}")]
    Config(crate::config::ConfigErrors),
    /// More than one Redis topology was given.
    #[error("give only one of --redis-url, --redis-sentinel and --redis-cluster")]
    ManyTopologies,
    /// Master credentials without Sentinel, where nothing would read them.
    #[error("--redis-master-username and --redis-master-password apply only with --redis-sentinel")]
    MasterAuthWithoutSentinel,
    /// `--redis-sentinel` without `--redis-master-name`.
    #[error("--redis-sentinel needs --redis-master-name")]
    MissingMasterName,
    /// A CA file for the memory backend, where nothing would read it.
    #[error(
        "--redis-tls-ca-file needs a Redis backend (--redis-url, --redis-sentinel or --redis-cluster)"
    )]
    TlsCaWithoutRedis,
    /// The CA file cannot be read.
    #[error("reading --redis-tls-ca-file {}", path.display())]
    TlsCaRead {
        /// The file given.
        path: PathBuf,
        /// Why it cannot be read.
        #[source]
        source: std::io::Error,
    },
    /// The CA file holds no `-----BEGIN CERTIFICATE-----` block.
    #[error(
        "--redis-tls-ca-file {}: no PEM certificate (-----BEGIN CERTIFICATE-----) in it",
        path.display()
    )]
    TlsCaNoCertificate {
        /// The file given.
        path: PathBuf,
    },
    /// The Redis backend refused its addresses (the message names them,
    /// passwords redacted).
    #[error(transparent)]
    Redis(#[from] crate::storage::redis::RedisSetupError),
    /// Header names of `--rate-limit-headers go` that clash, or given
    /// without it.
    #[error("{0}")]
    HeaderNames(String),
    /// An `--config-xds-*` flag is invalid (the message names it).
    #[error("{0}")]
    Xds(String),
    /// A TLS file (gRPC server or Redis client) that cannot be used, or TLS
    /// flags missing their partner.
    #[error("{0}")]
    Tls(String),
    /// `--redis-key-prefix` with a `{` or `}` that forms no whole hash tag,
    /// with `--redis-cluster`: a bucket's quota records and reservations
    /// would not share its hash slot.
    #[error(
        "--redis-key-prefix {0:?}: with --redis-cluster a prefix with '{{' or '}}' must hold a whole hash tag such as \"rls:{{limits}}:\" (a bucket's quota records and reservations must share its hash slot)"
    )]
    ClusterKeyPrefix(String),
    /// `--health-require-config` without `--health-mode go`.
    #[error("--health-require-config applies only with --health-mode go")]
    HealthRequireConfig,
}

impl HeaderNames {
    /// Checks the names for `mode`: given only with [`RateLimitHeaders::Go`]
    /// (elsewhere nothing would send them), distinct from each other and
    /// from `retry-after` (case-insensitive, as HTTP header names are).
    ///
    /// # Errors
    /// [`SetupError::HeaderNames`] saying which names and why.
    pub fn check(&self, mode: RateLimitHeaders) -> Result<(), SetupError> {
        if mode != RateLimitHeaders::Go {
            if *self != Self::default() {
                return Err(SetupError::HeaderNames(
                    "--limit-header-name, --remaining-header-name and --reset-header-name apply only with --rate-limit-headers go".into(),
                ));
            }
            return Ok(());
        }
        let names = [&self.limit, &self.remaining, &self.reset];
        for (i, a) in names.iter().enumerate() {
            if a.eq_ignore_ascii_case("retry-after") {
                return Err(SetupError::HeaderNames(format!(
                    "header name '{a}' is taken: retry-after is sent on every denial"
                )));
            }
            if names[i + 1..].iter().any(|b| a.eq_ignore_ascii_case(b)) {
                return Err(SetupError::HeaderNames(format!(
                    "header name '{a}' is given twice: the limit, remaining and reset headers need three names"
                )));
            }
        }
        Ok(())
    }
}
