//! The flags of `serve` ([`ServeArgs`]) and their conversion into
//! [`Settings`] (`TryFrom<&ServeArgs>`), which refuses flags that contradict
//! each other ([`SetupError`]). Every flag also reads an environment variable
//! `BUCKET_RLS_<FLAG>`.
//!
//! Adding a flag: a field of [`ServeArgs`], its line in the conversion, and
//! its line in the README. A flag that other code names (the Go environment
//! mapping, [`crate::go::env`]) takes its long name from a const of [`flag`],
//! so renaming it breaks that code at compile time.

use crate::settings::{
    Backend, ConfigSource, HealthMode, MasterAuth, OnStorageError, RateLimitHeaders,
    ServiceSettings, Settings, SetupError,
};
use crate::storage::redis::RedisOptions;
use clap::ValueEnum;
use clap::builder::PossibleValue;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Long names (without `--`) of the flags that other code names.
pub mod flag {
    /// `--config`.
    pub const CONFIG: &str = "config";
    /// `--config-xds`.
    pub const CONFIG_XDS: &str = "config-xds";
    /// `--config-xds-node-id`.
    pub const CONFIG_XDS_NODE_ID: &str = "config-xds-node-id";
    /// `--config-xds-node-metadata`.
    pub const CONFIG_XDS_NODE_METADATA: &str = "config-xds-node-metadata";
    /// `--config-xds-headers`.
    pub const CONFIG_XDS_HEADERS: &str = "config-xds-headers";
    /// `--config-xds-tls`.
    pub const CONFIG_XDS_TLS: &str = "config-xds-tls";
    /// `--config-xds-tls-cert`.
    pub const CONFIG_XDS_TLS_CERT: &str = "config-xds-tls-cert";
    /// `--config-xds-tls-key`.
    pub const CONFIG_XDS_TLS_KEY: &str = "config-xds-tls-key";
    /// `--config-xds-tls-ca`.
    pub const CONFIG_XDS_TLS_CA: &str = "config-xds-tls-ca";
    /// `--config-xds-tls-server-name`.
    pub const CONFIG_XDS_TLS_SERVER_NAME: &str = "config-xds-tls-server-name";
    /// `--config-xds-backoff-initial-ms`.
    pub const CONFIG_XDS_BACKOFF_INITIAL_MS: &str = "config-xds-backoff-initial-ms";
    /// `--config-xds-backoff-max-ms`.
    pub const CONFIG_XDS_BACKOFF_MAX_MS: &str = "config-xds-backoff-max-ms";
    /// `--config-xds-backoff-jitter`.
    pub const CONFIG_XDS_BACKOFF_JITTER: &str = "config-xds-backoff-jitter";
    /// `--config-xds-max-message-bytes`.
    pub const CONFIG_XDS_MAX_MESSAGE_BYTES: &str = "config-xds-max-message-bytes";
    /// `--config-xds-wait-for-config`.
    pub const CONFIG_XDS_WAIT_FOR_CONFIG: &str = "config-xds-wait-for-config";
    /// `--grpc-addr`.
    pub const GRPC_ADDR: &str = "grpc-addr";
    /// `--http-addr`.
    pub const HTTP_ADDR: &str = "http-addr";
    /// `--redis-url`.
    pub const REDIS_URL: &str = "redis-url";
    /// `--redis-sentinel`.
    pub const REDIS_SENTINEL: &str = "redis-sentinel";
    /// `--redis-master-name`.
    pub const REDIS_MASTER_NAME: &str = "redis-master-name";
    /// `--redis-master-username`.
    pub const REDIS_MASTER_USERNAME: &str = "redis-master-username";
    /// `--redis-master-password`.
    pub const REDIS_MASTER_PASSWORD: &str = "redis-master-password";
    /// `--redis-cluster`.
    pub const REDIS_CLUSTER: &str = "redis-cluster";
    /// `--redis-tls-ca-file`.
    pub const REDIS_TLS_CA_FILE: &str = "redis-tls-ca-file";
    /// `--redis-tls-client-cert`.
    pub const REDIS_TLS_CLIENT_CERT: &str = "redis-tls-client-cert";
    /// `--redis-tls-client-key`.
    pub const REDIS_TLS_CLIENT_KEY: &str = "redis-tls-client-key";
    /// `--redis-key-prefix`.
    pub const REDIS_KEY_PREFIX: &str = "redis-key-prefix";
    /// `--redis-timeout`.
    pub const REDIS_TIMEOUT: &str = "redis-timeout";
    /// `--local-cache-size`.
    pub const LOCAL_CACHE_SIZE: &str = "local-cache-size";
    /// `--near-limit-ratio`.
    pub const NEAR_LIMIT_RATIO: &str = "near-limit-ratio";
    /// `--rate-limit-headers`.
    pub const RATE_LIMIT_HEADERS: &str = "rate-limit-headers";
    /// `--limit-header-name`.
    pub const LIMIT_HEADER_NAME: &str = "limit-header-name";
    /// `--remaining-header-name`.
    pub const REMAINING_HEADER_NAME: &str = "remaining-header-name";
    /// `--reset-header-name`.
    pub const RESET_HEADER_NAME: &str = "reset-header-name";
    /// `--shadow-mode`.
    pub const SHADOW_MODE: &str = "shadow-mode";
    /// `--quota-mode`.
    pub const QUOTA_MODE: &str = "quota-mode";
    /// `--response-dynamic-metadata`.
    pub const RESPONSE_DYNAMIC_METADATA: &str = "response-dynamic-metadata";
    /// `--merge-domain-config`.
    pub const MERGE_DOMAIN_CONFIG: &str = "merge-domain-config";
    /// `--default-algorithm`.
    pub const DEFAULT_ALGORITHM: &str = "default-algorithm";
    /// `--otlp-endpoint`.
    pub const OTLP_ENDPOINT: &str = "otlp-endpoint";
    /// `--tracing-service-name`.
    pub const TRACING_SERVICE_NAME: &str = "tracing-service-name";
    /// `--tracing-sampling-rate`.
    pub const TRACING_SAMPLING_RATE: &str = "tracing-sampling-rate";
    /// `--grpc-tls-cert`.
    pub const GRPC_TLS_CERT: &str = "grpc-tls-cert";
    /// `--grpc-tls-key`.
    pub const GRPC_TLS_KEY: &str = "grpc-tls-key";
    /// `--grpc-tls-client-ca`.
    pub const GRPC_TLS_CLIENT_CA: &str = "grpc-tls-client-ca";
    /// `--grpc-tls-client-san`.
    pub const GRPC_TLS_CLIENT_SAN: &str = "grpc-tls-client-san";
    /// `--health-mode`.
    pub const HEALTH_MODE: &str = "health-mode";
    /// `--health-require-config`.
    pub const HEALTH_REQUIRE_CONFIG: &str = "health-require-config";
    /// `--go-metrics-addr`.
    pub const GO_METRICS_ADDR: &str = "go-metrics-addr";
    /// `--go-metrics-path`.
    pub const GO_METRICS_PATH: &str = "go-metrics-path";
    /// `--debug-addr`.
    pub const DEBUG_ADDR: &str = "debug-addr";
    /// `--max-buffered-request-bytes`.
    pub const MAX_BUFFERED_REQUEST_BYTES: &str = "max-buffered-request-bytes";
    /// `--log-level`.
    pub const LOG_LEVEL: &str = "log-level";
    /// `--log-format`.
    pub const LOG_FORMAT: &str = "log-format";
}

/// What Envoy's quota service (RLQS) sends for a bucket id that matches no
/// rule (`--rlqs-unmatched`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RlqsUnmatched {
    /// `BlanketRule` `ALLOW_ALL`.
    Allow,
    /// `BlanketRule` `DENY_ALL`.
    Deny,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Flags of `serve`.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Config file, or directory of `*.yaml`/`*.yml` files (one domain each).
    /// Exactly one of `--config` and `--config-xds` is required.
    #[arg(
        long = flag::CONFIG,
        env = "BUCKET_RLS_CONFIG",
        required_unless_present = "config_xds",
        conflicts_with = "config_xds"
    )]
    pub config: Option<PathBuf>,
    /// Take the config from an xDS management server (`host:port`, e.g.
    /// `envoy-gateway:18001`) instead of files: an ADS stream of
    /// `RateLimitConfig` resources (docs/xds.md).
    #[arg(long = flag::CONFIG_XDS, env = "BUCKET_RLS_CONFIG_XDS")]
    pub config_xds: Option<String>,
    /// xDS `Node.id` (the control plane picks the config by it; Envoy
    /// Gateway serves `envoy-ratelimit`).
    /// Default `default`.
    #[arg(long = flag::CONFIG_XDS_NODE_ID, env = "BUCKET_RLS_CONFIG_XDS_NODE_ID")]
    pub config_xds_node_id: Option<String>,
    /// xDS `Node.metadata`, `k1=v1,k2=v2` (string values).
    #[arg(long = flag::CONFIG_XDS_NODE_METADATA, env = "BUCKET_RLS_CONFIG_XDS_NODE_METADATA")]
    pub config_xds_node_metadata: Option<String>,
    /// Extra gRPC metadata on the xDS stream, `name1:value1,name2:value2`.
    #[arg(long = flag::CONFIG_XDS_HEADERS, env = "BUCKET_RLS_CONFIG_XDS_HEADERS", hide_env_values = true)]
    pub config_xds_headers: Option<String>,
    /// Connect to the xDS server over TLS (implied by any other
    /// `--config-xds-tls-*` flag or an `https://` address).
    #[arg(long = flag::CONFIG_XDS_TLS, env = "BUCKET_RLS_CONFIG_XDS_TLS", default_value_t = false)]
    pub config_xds_tls: bool,
    /// Client certificate chain (PEM) for mTLS to the xDS server; re-read on
    /// every reconnect.
    #[arg(long = flag::CONFIG_XDS_TLS_CERT, env = "BUCKET_RLS_CONFIG_XDS_TLS_CERT")]
    pub config_xds_tls_cert: Option<PathBuf>,
    /// Private key (PEM) of `--config-xds-tls-cert`.
    #[arg(long = flag::CONFIG_XDS_TLS_KEY, env = "BUCKET_RLS_CONFIG_XDS_TLS_KEY")]
    pub config_xds_tls_key: Option<PathBuf>,
    /// CA certificates (PEM) that sign the xDS server's certificate (trusted
    /// besides the public web PKI roots).
    #[arg(long = flag::CONFIG_XDS_TLS_CA, env = "BUCKET_RLS_CONFIG_XDS_TLS_CA")]
    pub config_xds_tls_ca: Option<PathBuf>,
    /// Name the xDS server's certificate must hold (default: the host of
    /// `--config-xds`).
    #[arg(long = flag::CONFIG_XDS_TLS_SERVER_NAME, env = "BUCKET_RLS_CONFIG_XDS_TLS_SERVER_NAME")]
    pub config_xds_tls_server_name: Option<String>,
    /// First wait before reconnecting to the xDS server, in milliseconds
    /// (doubles per failed attempt, jittered).
    #[arg(long = flag::CONFIG_XDS_BACKOFF_INITIAL_MS, env = "BUCKET_RLS_CONFIG_XDS_BACKOFF_INITIAL_MS", default_value_t = 1_000,
          value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub config_xds_backoff_initial_ms: u64,
    /// Longest wait before reconnecting, in milliseconds.
    #[arg(long = flag::CONFIG_XDS_BACKOFF_MAX_MS, env = "BUCKET_RLS_CONFIG_XDS_BACKOFF_MAX_MS", default_value_t = 30_000,
          value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub config_xds_backoff_max_ms: u64,
    /// Jitter of each reconnect wait, a fraction from 0 to 1.
    #[arg(long = flag::CONFIG_XDS_BACKOFF_JITTER, env = "BUCKET_RLS_CONFIG_XDS_BACKOFF_JITTER", default_value_t = 0.5, value_parser = ratio)]
    pub config_xds_backoff_jitter: f64,
    /// Largest xDS response accepted, in bytes.
    #[arg(long = flag::CONFIG_XDS_MAX_MESSAGE_BYTES, env = "BUCKET_RLS_CONFIG_XDS_MAX_MESSAGE_BYTES", default_value_t = crate::config::source::xds::DEFAULT_MAX_MESSAGE_BYTES, value_parser = at_least_one)]
    pub config_xds_max_message_bytes: usize,
    /// Bind the ports only once the first xDS config is in force. Without
    /// it the service serves at once and ShouldRateLimit answers an error
    /// until then (the Go service's FORCE_START_WITHOUT_INITIAL_CONFIG=true).
    #[arg(
        long = flag::CONFIG_XDS_WAIT_FOR_CONFIG,
        env = "BUCKET_RLS_CONFIG_XDS_WAIT_FOR_CONFIG",
        default_value_t = false
    )]
    pub config_xds_wait_for_config: bool,
    /// gRPC listen address (RateLimitService and grpc.health.v1.Health).
    #[arg(long = flag::GRPC_ADDR, env = "BUCKET_RLS_GRPC_ADDR", default_value = "0.0.0.0:8081")]
    pub grpc_addr: SocketAddr,
    /// HTTP admin listen address (/healthcheck and the admin API).
    #[arg(long = flag::HTTP_ADDR, env = "BUCKET_RLS_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    pub http_addr: SocketAddr,
    /// Redis URL (`redis://[user:password@]host:port/db` or `rediss://...`).
    /// Without it (and without Sentinel or Cluster) the backend is `memory`.
    #[arg(long = flag::REDIS_URL, env = "BUCKET_RLS_REDIS_URL")]
    pub redis_url: Option<String>,
    /// Redis Sentinel addresses, `host:port,host:port,...` (with `--redis-master-name`).
    #[arg(long = flag::REDIS_SENTINEL, env = "BUCKET_RLS_REDIS_SENTINEL", value_delimiter = ',')]
    pub redis_sentinel: Vec<String>,
    /// Master name watched by the Sentinels.
    #[arg(long = flag::REDIS_MASTER_NAME, env = "BUCKET_RLS_REDIS_MASTER_NAME")]
    pub redis_master_name: Option<String>,
    /// ACL user for the master found through Sentinel (the Sentinels' own
    /// credentials go in their addresses).
    #[arg(long = flag::REDIS_MASTER_USERNAME, env = "BUCKET_RLS_REDIS_MASTER_USERNAME")]
    pub redis_master_username: Option<String>,
    /// Password of the master found through Sentinel (its `requirepass` or
    /// the ACL user's password). Never logged.
    #[arg(long = flag::REDIS_MASTER_PASSWORD, env = "BUCKET_RLS_REDIS_MASTER_PASSWORD", hide_env_values = true)]
    pub redis_master_password: Option<String>,
    /// Redis Cluster seed nodes, `host:port,host:port,...`.
    #[arg(long = flag::REDIS_CLUSTER, env = "BUCKET_RLS_REDIS_CLUSTER", value_delimiter = ',')]
    pub redis_cluster: Vec<String>,
    /// PEM file with the CA certificate(s) that sign the Redis server
    /// certificates behind `rediss://` addresses (single node, Sentinel and
    /// master, or Cluster nodes; default: the public web PKI roots).
    #[arg(long = flag::REDIS_TLS_CA_FILE, env = "BUCKET_RLS_REDIS_TLS_CA_FILE")]
    pub redis_tls_ca_file: Option<PathBuf>,
    /// PEM client certificate chain presented to Redis over TLS (with
    /// `--redis-tls-client-key`; `rediss://` addresses).
    #[arg(
        long = flag::REDIS_TLS_CLIENT_CERT,
        env = "BUCKET_RLS_REDIS_TLS_CLIENT_CERT",
        requires = "redis_tls_client_key"
    )]
    pub redis_tls_client_cert: Option<PathBuf>,
    /// PEM private key of `--redis-tls-client-cert`.
    #[arg(
        long = flag::REDIS_TLS_CLIENT_KEY,
        env = "BUCKET_RLS_REDIS_TLS_CLIENT_KEY",
        requires = "redis_tls_client_cert"
    )]
    pub redis_tls_client_key: Option<PathBuf>,
    /// Prefix of every bucket key in Redis.
    #[arg(long = flag::REDIS_KEY_PREFIX, env = "BUCKET_RLS_REDIS_KEY_PREFIX", default_value = "rls:")]
    pub redis_key_prefix: String,
    /// Redis response timeout in milliseconds.
    #[arg(long = flag::REDIS_TIMEOUT, env = "BUCKET_RLS_REDIS_TIMEOUT", default_value_t = 50,
          value_parser = clap::value_parser!(u64).range(1..=60_000))]
    pub redis_timeout: u64,
    /// What to answer when storage fails: `unavailable` (gRPC UNAVAILABLE, so
    /// Envoy's failure_mode_deny decides), `allow` (OK) or `deny` (OVER_LIMIT).
    #[arg(
        long,
        env = "BUCKET_RLS_ON_STORAGE_ERROR",
        value_enum,
        default_value = "unavailable"
    )]
    pub on_storage_error: OnStorageError,
    /// Most buckets the memory backend holds (about 150 bytes each); past it,
    /// the buckets closest to full are forgotten first.
    #[arg(long, env = "BUCKET_RLS_MEMORY_MAX_BUCKETS", default_value_t = crate::storage::memory::DEFAULT_MAX_BUCKETS)]
    pub memory_max_buckets: usize,
    /// Entries of the local over-limit cache (0 disables it).
    #[arg(long = flag::LOCAL_CACHE_SIZE, env = "BUCKET_RLS_LOCAL_CACHE_SIZE", default_value_t = 100_000)]
    pub local_cache_size: u64,
    /// An admitted hit leaving fewer than (1 - ratio) x capacity tokens counts
    /// as near_limit; from 0 to 1.
    #[arg(long = flag::NEAR_LIMIT_RATIO, env = "BUCKET_RLS_NEAR_LIMIT_RATIO", default_value_t = 0.8, value_parser = ratio)]
    pub near_limit_ratio: f64,
    /// Most descriptors accepted per request.
    #[arg(long, env = "BUCKET_RLS_MAX_DESCRIPTORS", default_value_t = 1024, value_parser = at_least_one)]
    pub max_descriptors: usize,
    /// Send duration_until_reset in exact milliseconds instead of whole seconds
    /// rounded up (Envoy reads only whole seconds; leave off for Envoy).
    #[arg(long, env = "BUCKET_RLS_EXACT_DURATIONS", default_value_t = false)]
    pub exact_durations: bool,
    /// Extra rate limit headers in every limited response: `off`, `draft03`
    /// (RateLimit-Limit/Remaining/Reset), `ietf` (RateLimit-Policy and
    /// RateLimit) or `go` (the Go service's: RateLimit-Limit is the bare
    /// number; names from --limit-header-name and friends).
    #[arg(
        long = flag::RATE_LIMIT_HEADERS,
        env = "BUCKET_RLS_RATE_LIMIT_HEADERS",
        value_enum,
        default_value = "off"
    )]
    pub rate_limit_headers: RateLimitHeaders,
    /// Name of the limit header with `--rate-limit-headers go`.
    #[arg(long = flag::LIMIT_HEADER_NAME, env = "BUCKET_RLS_LIMIT_HEADER_NAME", default_value = "RateLimit-Limit", value_parser = header_name)]
    pub limit_header_name: String,
    /// Name of the remaining header with `--rate-limit-headers go`.
    #[arg(long = flag::REMAINING_HEADER_NAME, env = "BUCKET_RLS_REMAINING_HEADER_NAME", default_value = "RateLimit-Remaining", value_parser = header_name)]
    pub remaining_header_name: String,
    /// Name of the reset header with `--rate-limit-headers go`.
    #[arg(long = flag::RESET_HEADER_NAME, env = "BUCKET_RLS_RESET_HEADER_NAME", default_value = "RateLimit-Reset", value_parser = header_name)]
    pub reset_header_name: String,
    /// Every rule in shadow mode: evaluated, charged and counted, never
    /// denying (a dry run of a whole policy).
    #[arg(long = flag::SHADOW_MODE, env = "BUCKET_RLS_SHADOW_MODE", default_value_t = false)]
    pub shadow_mode: bool,
    /// Every rule in quota mode: a request is denied only when every rule it
    /// hits is over its limit.
    #[arg(long = flag::QUOTA_MODE, env = "BUCKET_RLS_QUOTA_MODE", default_value_t = false)]
    pub quota_mode: bool,
    /// Send dynamic metadata in every response: the domain, the request's
    /// descriptors and the merged `metadata` of the rules not over their limit.
    #[arg(
        long = flag::RESPONSE_DYNAMIC_METADATA,
        env = "BUCKET_RLS_RESPONSE_DYNAMIC_METADATA",
        default_value_t = false
    )]
    pub response_dynamic_metadata: bool,
    /// Ignore a request's `limit` override on a descriptor that matches no
    /// rule (answer OK without a limit, keep no state). Default: such an
    /// override gets its own bucket in a known domain, as in the Go service,
    /// which lets a client create keys that live up to one unit of its
    /// override (a year for YEAR).
    #[arg(
        long,
        env = "BUCKET_RLS_IGNORE_UNMATCHED_OVERRIDES",
        default_value_t = false
    )]
    pub ignore_unmatched_overrides: bool,
    /// Give every limited rule without its own `max_debt` a debt bound of
    /// this many times its burst (0: none). For token budgets charged after
    /// the response in configs that cannot carry `max_debt` (xDS).
    #[arg(long, env = "BUCKET_RLS_MAX_DEBT_BURSTS", default_value_t = 0)]
    pub max_debt_bursts: u32,
    /// The algorithm of every rule that names no `algorithm` (files and
    /// xDS pushes alike) and of every request's `limit` override:
    /// `fixed_window` gives the Go service's windows everywhere.
    #[arg(
        long = flag::DEFAULT_ALGORITHM,
        env = "BUCKET_RLS_DEFAULT_ALGORITHM",
        default_value = "token_bucket",
        value_parser = algorithm_parser()
    )]
    pub default_algorithm: crate::storage::AlgorithmKind,
    /// Envoy's quota service (RLQS): the blanket rule sent for a bucket id
    /// that matches no rule of the stream's domain.
    #[arg(
        long,
        env = "BUCKET_RLS_RLQS_UNMATCHED",
        value_enum,
        default_value_t = RlqsUnmatched::Allow
    )]
    pub rlqs_unmatched: RlqsUnmatched,
    /// Merge files that define the same domain into one domain (a descriptor
    /// defined twice is still an error) instead of refusing the second file.
    #[arg(long = flag::MERGE_DOMAIN_CONFIG, env = "BUCKET_RLS_MERGE_DOMAIN_CONFIG", default_value_t = false)]
    pub merge_domain_config: bool,
    /// Do not serve gRPC server reflection (`grpc.reflection.v1` and
    /// `v1alpha`, which `grpcurl` uses) on the gRPC port.
    #[arg(
        long,
        env = "BUCKET_RLS_DISABLE_GRPC_REFLECTION",
        default_value_t = false
    )]
    pub disable_grpc_reflection: bool,
    /// Export a span per ShouldRateLimit call and per Redis call over
    /// OTLP/HTTP (protobuf) to this collector base URL
    /// (`http://collector:4318`; spans go to `/v1/traces`). Off when unset.
    #[arg(long = flag::OTLP_ENDPOINT, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the exported spans.
    #[arg(long = flag::TRACING_SERVICE_NAME, env = "OTEL_SERVICE_NAME", default_value = "bucket-rls")]
    pub tracing_service_name: String,
    /// Share of calls without a sampled parent span that are traced (0 to
    /// 1); a call whose `traceparent` is sampled is always traced.
    #[arg(long = flag::TRACING_SAMPLING_RATE, env = "BUCKET_RLS_TRACING_SAMPLING_RATE", default_value_t = 1.0)]
    pub tracing_sampling_rate: f64,
    /// Serve gRPC over TLS with this PEM certificate chain (with
    /// `--grpc-tls-key`). The files are read again every few seconds: a
    /// replaced certificate is used for new connections.
    #[arg(long = flag::GRPC_TLS_CERT, env = "BUCKET_RLS_GRPC_TLS_CERT", requires = "grpc_tls_key")]
    pub grpc_tls_cert: Option<PathBuf>,
    /// PEM private key of `--grpc-tls-cert` (PKCS#1, PKCS#8 or SEC1).
    #[arg(long = flag::GRPC_TLS_KEY, env = "BUCKET_RLS_GRPC_TLS_KEY", requires = "grpc_tls_cert")]
    pub grpc_tls_key: Option<PathBuf>,
    /// Require gRPC clients to present a certificate signed by a CA of this
    /// PEM file (needs `--grpc-tls-cert`).
    #[arg(
        long = flag::GRPC_TLS_CLIENT_CA,
        env = "BUCKET_RLS_GRPC_TLS_CLIENT_CA",
        requires = "grpc_tls_cert"
    )]
    pub grpc_tls_client_ca: Option<PathBuf>,
    /// A DNS name or IP address that client certificates must carry as a
    /// subject alternative name (needs `--grpc-tls-client-ca`).
    #[arg(
        long = flag::GRPC_TLS_CLIENT_SAN,
        env = "BUCKET_RLS_GRPC_TLS_CLIENT_SAN",
        requires = "grpc_tls_client_ca"
    )]
    pub grpc_tls_client_san: Option<String>,
    /// What `/healthcheck` and gRPC health report: `native` (whether
    /// storage answers now) or `go` (the Go service's: healthy once storage
    /// answered once; unhealthy after SIGTERM).
    #[arg(
        long = flag::HEALTH_MODE,
        env = "BUCKET_RLS_HEALTH_MODE",
        value_enum,
        default_value = "native"
    )]
    pub health_mode: HealthModeArg,
    /// With `--health-mode go`: unhealthy until a config is loaded.
    #[arg(
        long = flag::HEALTH_REQUIRE_CONFIG,
        env = "BUCKET_RLS_HEALTH_REQUIRE_CONFIG",
        default_value_t = false
    )]
    pub health_require_config: bool,
    /// Also serve metrics under the Go service's names
    /// (`ratelimit_service_*`, process metrics) on this address.
    #[arg(long = flag::GO_METRICS_ADDR, env = "BUCKET_RLS_GO_METRICS_ADDR")]
    pub go_metrics_addr: Option<SocketAddr>,
    /// Path of the Go-named metrics on `--go-metrics-addr`.
    #[arg(long = flag::GO_METRICS_PATH, env = "BUCKET_RLS_GO_METRICS_PATH", default_value = "/metrics", value_parser = url_path)]
    pub go_metrics_path: String,
    /// Also serve the plain-text `/rlconfig` (the Go service's debug port,
    /// read by `egctl config envoy-ratelimit`) on this address.
    #[arg(long = flag::DEBUG_ADDR, env = "BUCKET_RLS_DEBUG_ADDR")]
    pub debug_addr: Option<SocketAddr>,
    /// Process-wide budget of request bytes held while calls are read and
    /// decided, on every port; past it new calls are refused (gRPC
    /// `RESOURCE_EXHAUSTED`, HTTP 503) and admitted ones finish.
    #[arg(long = flag::MAX_BUFFERED_REQUEST_BYTES, env = "BUCKET_RLS_MAX_BUFFERED_REQUEST_BYTES", default_value_t = crate::conn_limit::DEFAULT_BUFFERED_REQUEST_BYTES, value_parser = at_least_one)]
    pub max_buffered_request_bytes: usize,
    /// After SIGTERM, report unhealthy for this many seconds while still
    /// serving, then drain (lets load balancers stop sending first).
    #[arg(long, env = "BUCKET_RLS_SHUTDOWN_DELAY_SECS", default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=3_600))]
    pub shutdown_delay_secs: u64,
    /// Log level or filter (`info`, `debug`, `bucket_rls=debug,info`).
    #[arg(long = flag::LOG_LEVEL, env = "BUCKET_RLS_LOG_LEVEL", default_value = "info", value_parser = parse_log_level)]
    pub log_level: String,
    /// Log format.
    #[arg(
        long = flag::LOG_FORMAT,
        env = "BUCKET_RLS_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    pub log_format: LogFormat,
}

/// `--on-storage-error` values (the help texts are those of
/// [`OnStorageError`]'s variants).
impl ValueEnum for OnStorageError {
    fn value_variants<'a>() -> &'a [Self] {
        &[Self::Unavailable, Self::Allow, Self::Deny]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(match self {
            Self::Unavailable => PossibleValue::new("unavailable")
                .help("gRPC `UNAVAILABLE`: Envoy's `failure_mode_deny` decides"),
            Self::Allow => PossibleValue::new("allow")
                .help("Fail open: `OK` for every descriptor, with no `current_limit`"),
            Self::Deny => PossibleValue::new("deny")
                .help("Fail closed: `OVER_LIMIT` for descriptors that needed storage"),
        })
    }
}

/// `--rate-limit-headers` values (the help texts are those of
/// [`RateLimitHeaders`]' variants).
impl ValueEnum for RateLimitHeaders {
    fn value_variants<'a>() -> &'a [Self] {
        &[Self::Off, Self::Draft03, Self::Ietf, Self::Go]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(match self {
            Self::Off => PossibleValue::new("off")
                .help("No extra headers (`retry-after` is still sent on OVER_LIMIT)"),
            Self::Draft03 => PossibleValue::new("draft03").help(
                "`RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset` (draft-ietf-httpapi-ratelimit-headers-03, the format Envoy emits)",
            ),
            Self::Ietf => PossibleValue::new("ietf").help(
                "`RateLimit-Policy` and `RateLimit` structured fields (draft-ietf-httpapi-ratelimit-headers-08 and later)",
            ),
            Self::Go => PossibleValue::new("go").help(
                "The Go reference service's headers (`LIMIT_RESPONSE_HEADERS_ENABLED`): `RateLimit-Limit` with the bare tokens per unit (no `;w=` policy), `RateLimit-Remaining` and `RateLimit-Reset` in seconds, under the names given by `--limit-header-name`, `--remaining-header-name` and `--reset-header-name`",
            ),
        })
    }
}

/// `--health-mode` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum HealthModeArg {
    /// Whether storage answers now.
    Native,
    /// The Go service's semantics.
    Go,
}

/// An HTTP path: starts with `/`, at most 256 characters, no spaces.
fn url_path(s: &str) -> Result<String, String> {
    if !s.starts_with('/')
        || s.len() > 256
        || s.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(format!("'{s}' is not a path (starts with /, no spaces)"));
    }
    Ok(s.to_owned())
}

/// Parses a ratio from 0 to 1 (`--near-limit-ratio`).
fn ratio(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        Ok(r) => Err(format!("{r} is not between 0 and 1")),
        Err(e) => Err(e.to_string()),
    }
}

/// Checks a `--log-level` value: a level (`trace`, `debug`, `info`, `warn`,
/// `error`, `off`) or a `tracing` filter whose bare words are levels
/// (`bucket_rls=debug,info`). A bare word such as `warning` would otherwise be
/// read as a target name and silently turn every log line off.
///
/// # Errors
/// A message naming the bad part.
pub fn parse_log_level(s: &str) -> Result<String, String> {
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if !part.contains('=') && !LEVELS.contains(&part.to_ascii_lowercase().as_str()) {
            return Err(format!(
                "unknown log level '{part}': use trace, debug, info, warn, error or off, or a filter such as bucket_rls=debug,info"
            ));
        }
    }
    tracing_subscriber::EnvFilter::try_new(s)
        .map(|_| s.to_owned())
        .map_err(|e| format!("invalid log filter '{s}': {e}"))
}

/// A count of at least 1 (0 would refuse every request).
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1 (0 would refuse every request)".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("not a count: {e}")),
    }
}

/// Checks a response header name: 1 to 64 characters of an HTTP token
/// (letters, digits and `!#$%&'*+-.^_|~`). Envoy refuses anything else.
fn header_name(s: &str) -> Result<String, String> {
    let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    if s.is_empty() || s.len() > 64 || !s.chars().all(token) {
        return Err(format!(
            "'{s}' is not a header name (1 to 64 letters, digits or !#$%&'*+-.^_`|~)"
        ));
    }
    Ok(s.to_owned())
}

/// Magic line of a PEM certificate block.
const PEM_CERTIFICATE: &[u8] = b"-----BEGIN CERTIFICATE-----";

impl TryFrom<&ServeArgs> for Settings {
    type Error = SetupError;

    /// Checks the flags of `serve` and reads the CA file (see
    /// [`Backend`]'s `TryFrom`).
    fn try_from(args: &ServeArgs) -> Result<Self, SetupError> {
        let service = ServiceSettings::from(args);
        service.header_names.check(service.rate_limit_headers)?;
        Ok(Self {
            config: ConfigSource::try_from(args)?,
            grpc_addr: args.grpc_addr,
            http_addr: args.http_addr,
            service,
            load: crate::config::compile::LoadOptions {
                merge_domains: args.merge_domain_config,
                default_algorithm: args.default_algorithm,
            },
            backend: Backend::try_from(args)?,
            grpc_reflection: !args.disable_grpc_reflection,
            tracing: crate::otel::TracingSettings {
                otlp_endpoint: args.otlp_endpoint.clone().filter(|e| !e.is_empty()),
                service_name: args.tracing_service_name.clone(),
                sampling_rate: args.tracing_sampling_rate,
            },
            grpc_tls: match (&args.grpc_tls_cert, &args.grpc_tls_key) {
                (Some(cert), Some(key)) => Some(crate::settings::GrpcTls {
                    cert_file: cert.clone(),
                    key_file: key.clone(),
                    client_ca_file: args.grpc_tls_client_ca.clone(),
                    client_san: args.grpc_tls_client_san.clone(),
                }),
                _ => None,
            },
            health: match args.health_mode {
                HealthModeArg::Native if args.health_require_config => {
                    return Err(SetupError::HealthRequireConfig);
                }
                HealthModeArg::Native => HealthMode::Native,
                HealthModeArg::Go => HealthMode::Go {
                    require_config: args.health_require_config,
                },
            },
            go_metrics: args.go_metrics_addr.map(|addr| crate::settings::GoMetrics {
                addr,
                path: args.go_metrics_path.clone(),
            }),
            debug_addr: args.debug_addr,
            shutdown_delay: std::time::Duration::from_secs(args.shutdown_delay_secs),
        })
    }
}

impl TryFrom<&ServeArgs> for ConfigSource {
    type Error = SetupError;

    /// `--config PATH`, or `--config-xds URL` with its `--config-xds-*`
    /// flags (clap makes the two exclusive and one of them required).
    fn try_from(args: &ServeArgs) -> Result<Self, SetupError> {
        use crate::config::source::xds::{Backoff, XdsSettings, XdsTls, pairs};
        let Some(server) = &args.config_xds else {
            let given = [
                ("--config-xds-node-id", args.config_xds_node_id.is_some()),
                (
                    "--config-xds-node-metadata",
                    args.config_xds_node_metadata.is_some(),
                ),
                ("--config-xds-headers", args.config_xds_headers.is_some()),
                ("--config-xds-tls", args.config_xds_tls),
                ("--config-xds-tls-cert", args.config_xds_tls_cert.is_some()),
                ("--config-xds-tls-key", args.config_xds_tls_key.is_some()),
                ("--config-xds-tls-ca", args.config_xds_tls_ca.is_some()),
                (
                    "--config-xds-tls-server-name",
                    args.config_xds_tls_server_name.is_some(),
                ),
                (
                    "--config-xds-wait-for-config",
                    args.config_xds_wait_for_config,
                ),
            ];
            if let Some((flag, _)) = given.iter().find(|(_, set)| *set) {
                return Err(SetupError::Xds(format!("{flag} needs --config-xds")));
            }
            return Ok(Self::File(args.config.clone().unwrap_or_default()));
        };
        let mut s = XdsSettings::new(server.clone());
        if let Some(id) = &args.config_xds_node_id {
            s.node_id.clone_from(id);
        }
        s.node_metadata = args
            .config_xds_node_metadata
            .as_deref()
            .map(|m| pairs(m, '='))
            .unwrap_or_default();
        s.headers = args
            .config_xds_headers
            .as_deref()
            .map(|h| {
                pairs(h, ':')
                    .into_iter()
                    .map(|(k, v)| (k.to_ascii_lowercase(), v))
                    .collect()
            })
            .unwrap_or_default();
        let tls = XdsTls {
            client_cert: args.config_xds_tls_cert.clone(),
            client_key: args.config_xds_tls_key.clone(),
            ca_cert: args.config_xds_tls_ca.clone(),
            server_name: args.config_xds_tls_server_name.clone(),
        };
        if args.config_xds_tls || server.starts_with("https://") || tls != XdsTls::default() {
            s.tls = Some(tls);
        }
        s.backoff = Backoff {
            initial: std::time::Duration::from_millis(args.config_xds_backoff_initial_ms),
            max: std::time::Duration::from_millis(args.config_xds_backoff_max_ms),
            jitter: args.config_xds_backoff_jitter,
        };
        s.max_message_bytes = args.config_xds_max_message_bytes;
        s.start_without_config = !args.config_xds_wait_for_config;
        s.check().map_err(SetupError::Xds)?;
        Ok(Self::Xds(Box::new(s)))
    }
}

/// The parser of an algorithm name (`--default-algorithm`): one of the
/// names [`AlgorithmKind::as_str`](crate::storage::AlgorithmKind::as_str)
/// writes, listed by `--help` and in the error for another.
pub fn algorithm_parser()
-> impl clap::builder::TypedValueParser<Value = crate::storage::AlgorithmKind> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(
        crate::storage::AlgorithmKind::ALL.map(crate::storage::AlgorithmKind::as_str),
    )
    .map(|s| crate::storage::AlgorithmKind::parse(&s).unwrap_or_default())
}

impl From<&ServeArgs> for ServiceSettings {
    fn from(args: &ServeArgs) -> Self {
        Self {
            key_prefix: args.redis_key_prefix.clone(),
            on_storage_error: args.on_storage_error,
            near_limit_ratio: args.near_limit_ratio,
            max_descriptors: args.max_descriptors,
            exact_durations: args.exact_durations,
            rate_limit_headers: args.rate_limit_headers,
            header_names: crate::settings::HeaderNames {
                limit: args.limit_header_name.clone(),
                remaining: args.remaining_header_name.clone(),
                reset: args.reset_header_name.clone(),
            },
            global_shadow_mode: args.shadow_mode,
            global_quota_mode: args.quota_mode,
            response_dynamic_metadata: args.response_dynamic_metadata,
            ignore_unmatched_overrides: args.ignore_unmatched_overrides,
            max_debt_bursts: args.max_debt_bursts,
            rlqs_deny_unmatched: args.rlqs_unmatched == RlqsUnmatched::Deny,
            default_algorithm: args.default_algorithm,
            ..Self::default()
        }
    }
}

impl TryFrom<&ServeArgs> for Backend {
    type Error = SetupError;

    /// The backend the Redis flags select (memory without any), with its
    /// options. Reads `--redis-tls-ca-file`. Checks in this order: one
    /// topology at most, master credentials only with Sentinel, a CA file
    /// only with Redis and holding a certificate, a master name with
    /// Sentinel. Addresses are checked when the backend is built.
    fn try_from(args: &ServeArgs) -> Result<Self, SetupError> {
        let topologies = usize::from(args.redis_url.is_some())
            + usize::from(!args.redis_sentinel.is_empty())
            + usize::from(!args.redis_cluster.is_empty());
        if topologies > 1 {
            return Err(SetupError::ManyTopologies);
        }
        if args.redis_sentinel.is_empty()
            && (args.redis_master_username.is_some() || args.redis_master_password.is_some())
        {
            return Err(SetupError::MasterAuthWithoutSentinel);
        }
        let tls_root_ca_pem = match &args.redis_tls_ca_file {
            Some(_) if topologies == 0 => return Err(SetupError::TlsCaWithoutRedis),
            Some(path) => Some(read_ca_file(path)?),
            None => None,
        };
        let tls_client = match (&args.redis_tls_client_cert, &args.redis_tls_client_key) {
            (Some(_), _) | (_, Some(_)) if topologies == 0 => {
                return Err(SetupError::Tls(
                    "--redis-tls-client-cert needs a Redis backend (--redis-url, --redis-sentinel or --redis-cluster)".into(),
                ));
            }
            (Some(cert), Some(key)) => Some(read_client_cert(cert, key)?),
            _ => None,
        };
        let redis = RedisOptions {
            timeout: Duration::from_millis(args.redis_timeout),
            local_cache_size: usize::try_from(args.local_cache_size).unwrap_or(usize::MAX),
            tls_root_ca_pem,
            tls_client,
            ..RedisOptions::default()
        };
        let prefix = args.redis_key_prefix.as_bytes();
        if !args.redis_cluster.is_empty()
            && prefix.iter().any(|c| matches!(c, b'{' | b'}'))
            && crate::storage::redis::cluster::slot::hash_tag(prefix).is_none()
        {
            return Err(SetupError::ClusterKeyPrefix(args.redis_key_prefix.clone()));
        }
        Ok(if !args.redis_cluster.is_empty() {
            Self::Cluster {
                nodes: args.redis_cluster.clone(),
                redis,
            }
        } else if !args.redis_sentinel.is_empty() {
            Self::Sentinel {
                sentinels: args.redis_sentinel.clone(),
                master_name: args
                    .redis_master_name
                    .clone()
                    .ok_or(SetupError::MissingMasterName)?,
                master_auth: MasterAuth {
                    username: args.redis_master_username.clone(),
                    password: args.redis_master_password.clone(),
                },
                redis,
            }
        } else if let Some(url) = &args.redis_url {
            Self::Redis {
                url: url.clone(),
                redis,
            }
        } else {
            Self::Memory {
                max_buckets: args.memory_max_buckets,
            }
        })
    }
}

/// Reads `--redis-tls-ca-file` and checks that it holds a PEM certificate.
fn read_ca_file(path: &Path) -> Result<Vec<u8>, SetupError> {
    let pem = std::fs::read(path).map_err(|source| SetupError::TlsCaRead {
        path: path.to_owned(),
        source,
    })?;
    if !pem
        .windows(PEM_CERTIFICATE.len())
        .any(|w| w == PEM_CERTIFICATE)
    {
        return Err(SetupError::TlsCaNoCertificate {
            path: path.to_owned(),
        });
    }
    Ok(pem)
}

/// Reads `--redis-tls-client-cert` and `--redis-tls-client-key` and checks
/// that they parse as a certificate chain and a private key.
fn read_client_cert(
    cert: &Path,
    key: &Path,
) -> Result<crate::storage::redis::ClientCertPem, SetupError> {
    let tls = |e: crate::tls::TlsError| SetupError::Tls(e.to_string());
    crate::tls::load_certs("--redis-tls-client-cert", cert).map_err(tls)?;
    crate::tls::load_key("--redis-tls-client-key", key).map_err(tls)?;
    let read =
        |p: &Path| std::fs::read(p).map_err(|e| SetupError::Tls(format!("{}: {e}", p.display())));
    Ok(crate::storage::redis::ClientCertPem {
        cert: read(cert)?,
        key: read(key)?,
    })
}

#[cfg(test)]
mod tests;
