//! Command line: `serve`, `check-config`, `loadgen`. Every flag of `serve` also
//! reads an environment variable `BUCKET_RLS_<FLAG>`. `serve`'s flags become
//! [`Settings`] through `TryFrom<&ServeArgs>`, which refuses flags that
//! contradict each other ([`SetupError`]).

use crate::settings::{
    Backend, ConfigSource, HealthMode, MasterAuth, OnStorageError, RateLimitHeaders,
    ServiceSettings, Settings, SetupError,
};
use crate::storage::redis::RedisOptions;
use clap::builder::PossibleValue;
use clap::{Parser, Subcommand, ValueEnum};
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// bucket-rls: Envoy rate limit service with exact token buckets.
#[derive(Debug, Parser)]
#[command(name = "bucket-rls", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve ShouldRateLimit over gRPC and the admin API over HTTP.
    Serve(Box<ServeArgs>),
    /// Load config files or directories with the service's loader and print
    /// every problem; exit 0 only when all are valid.
    CheckConfig {
        /// Files or directories to check (each checked as one config source).
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// Merge files that define the same domain (as `serve
        /// --merge-domain-config`).
        #[arg(long)]
        merge_domain_config: bool,
        /// Compare against OLD (a config file or directory, or a running
        /// replica's `http://HOST:PORT/rlconfig`) instead of only checking:
        /// one line per rule added, removed, tightened or loosened, with what
        /// happens to existing buckets. Exit 0: no rule changed; 2: changes
        /// that only add or loosen; 3: changes that tighten, remove or change
        /// a mode (review them); 1: either side does not load.
        #[arg(long, value_name = "OLD")]
        diff: Option<String>,
        /// Each path is a YAML dump of xDS `RateLimitConfig` resources
        /// (documents separated by `---`, as a control plane's tests write
        /// them), checked as one pushed set.
        #[arg(long)]
        xds_resources: bool,
    },
    /// Load a rate limit service over gRPC and report throughput and latency
    /// (loopback targets only unless `--allow-remote`).
    #[cfg(feature = "loadgen")]
    Loadgen(Box<crate::loadgen::LoadgenArgs>),
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
        long,
        env = "BUCKET_RLS_CONFIG",
        required_unless_present = "config_xds",
        conflicts_with = "config_xds"
    )]
    pub config: Option<PathBuf>,
    /// Take the config from an xDS management server (`host:port`, e.g.
    /// `envoy-gateway:18001`) instead of files: an ADS stream of
    /// `RateLimitConfig` resources (docs/xds.md).
    #[arg(long, env = "BUCKET_RLS_CONFIG_XDS")]
    pub config_xds: Option<String>,
    /// xDS `Node.id` (the control plane picks the config by it; Envoy
    /// Gateway serves `envoy-ratelimit`).
    /// Default `default`.
    #[arg(long, env = "BUCKET_RLS_CONFIG_XDS_NODE_ID")]
    pub config_xds_node_id: Option<String>,
    /// xDS `Node.metadata`, `k1=v1,k2=v2` (string values).
    #[arg(long, env = "BUCKET_RLS_CONFIG_XDS_NODE_METADATA")]
    pub config_xds_node_metadata: Option<String>,
    /// Extra gRPC metadata on the xDS stream, `name1:value1,name2:value2`.
    #[arg(long, env = "BUCKET_RLS_CONFIG_XDS_HEADERS", hide_env_values = true)]
    pub config_xds_headers: Option<String>,
    /// Connect to the xDS server over TLS (implied by any other
    /// `--config-xds-tls-*` flag or an `https://` address).
    #[arg(long, env = "BUCKET_RLS_CONFIG_XDS_TLS", default_value_t = false)]
    pub config_xds_tls: bool,
    /// Client certificate chain (PEM) for mTLS to the xDS server; re-read on
    /// every reconnect.
    #[arg(long, env = "BUCKET_RLS_CONFIG_XDS_TLS_CERT")]
    pub config_xds_tls_cert: Option<PathBuf>,
    /// Private key (PEM) of `--config-xds-tls-cert`.
    #[arg(long, env = "BUCKET_RLS_CONFIG_XDS_TLS_KEY")]
    pub config_xds_tls_key: Option<PathBuf>,
    /// CA certificates (PEM) that sign the xDS server's certificate (trusted
    /// besides the public web PKI roots).
    #[arg(long, env = "BUCKET_RLS_CONFIG_XDS_TLS_CA")]
    pub config_xds_tls_ca: Option<PathBuf>,
    /// Name the xDS server's certificate must hold (default: the host of
    /// `--config-xds`).
    #[arg(long, env = "BUCKET_RLS_CONFIG_XDS_TLS_SERVER_NAME")]
    pub config_xds_tls_server_name: Option<String>,
    /// First wait before reconnecting to the xDS server, in milliseconds
    /// (doubles per failed attempt, jittered).
    #[arg(long, env = "BUCKET_RLS_CONFIG_XDS_BACKOFF_INITIAL_MS", default_value_t = 1_000,
          value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub config_xds_backoff_initial_ms: u64,
    /// Longest wait before reconnecting, in milliseconds.
    #[arg(long, env = "BUCKET_RLS_CONFIG_XDS_BACKOFF_MAX_MS", default_value_t = 30_000,
          value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub config_xds_backoff_max_ms: u64,
    /// Jitter of each reconnect wait, a fraction from 0 to 1.
    #[arg(long, env = "BUCKET_RLS_CONFIG_XDS_BACKOFF_JITTER", default_value_t = 0.5, value_parser = ratio)]
    pub config_xds_backoff_jitter: f64,
    /// Largest xDS response accepted, in bytes.
    #[arg(long, env = "BUCKET_RLS_CONFIG_XDS_MAX_MESSAGE_BYTES", default_value_t = crate::config::xds::DEFAULT_MAX_MESSAGE_BYTES, value_parser = at_least_one)]
    pub config_xds_max_message_bytes: usize,
    /// Bind the ports only once the first xDS config is in force. Without
    /// it the service serves at once and ShouldRateLimit answers an error
    /// until then (the Go service's FORCE_START_WITHOUT_INITIAL_CONFIG=true).
    #[arg(
        long,
        env = "BUCKET_RLS_CONFIG_XDS_WAIT_FOR_CONFIG",
        default_value_t = false
    )]
    pub config_xds_wait_for_config: bool,
    /// gRPC listen address (RateLimitService and grpc.health.v1.Health).
    #[arg(long, env = "BUCKET_RLS_GRPC_ADDR", default_value = "0.0.0.0:8081")]
    pub grpc_addr: SocketAddr,
    /// HTTP admin listen address (/healthcheck and the admin API).
    #[arg(long, env = "BUCKET_RLS_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    pub http_addr: SocketAddr,
    /// Redis URL (`redis://[user:password@]host:port/db` or `rediss://...`).
    /// Without it (and without Sentinel or Cluster) the backend is `memory`.
    #[arg(long, env = "BUCKET_RLS_REDIS_URL")]
    pub redis_url: Option<String>,
    /// Redis Sentinel addresses, `host:port,host:port,...` (with `--redis-master-name`).
    #[arg(long, env = "BUCKET_RLS_REDIS_SENTINEL", value_delimiter = ',')]
    pub redis_sentinel: Vec<String>,
    /// Master name watched by the Sentinels.
    #[arg(long, env = "BUCKET_RLS_REDIS_MASTER_NAME")]
    pub redis_master_name: Option<String>,
    /// ACL user for the master found through Sentinel (the Sentinels' own
    /// credentials go in their addresses).
    #[arg(long, env = "BUCKET_RLS_REDIS_MASTER_USERNAME")]
    pub redis_master_username: Option<String>,
    /// Password of the master found through Sentinel (its `requirepass` or
    /// the ACL user's password). Never logged.
    #[arg(long, env = "BUCKET_RLS_REDIS_MASTER_PASSWORD", hide_env_values = true)]
    pub redis_master_password: Option<String>,
    /// Redis Cluster seed nodes, `host:port,host:port,...`.
    #[arg(long, env = "BUCKET_RLS_REDIS_CLUSTER", value_delimiter = ',')]
    pub redis_cluster: Vec<String>,
    /// PEM file with the CA certificate(s) that sign the Redis server
    /// certificates behind `rediss://` addresses (single node, Sentinel and
    /// master, or Cluster nodes; default: the public web PKI roots).
    #[arg(long, env = "BUCKET_RLS_REDIS_TLS_CA_FILE")]
    pub redis_tls_ca_file: Option<PathBuf>,
    /// PEM client certificate chain presented to Redis over TLS (with
    /// `--redis-tls-client-key`; `rediss://` addresses).
    #[arg(
        long,
        env = "BUCKET_RLS_REDIS_TLS_CLIENT_CERT",
        requires = "redis_tls_client_key"
    )]
    pub redis_tls_client_cert: Option<PathBuf>,
    /// PEM private key of `--redis-tls-client-cert`.
    #[arg(
        long,
        env = "BUCKET_RLS_REDIS_TLS_CLIENT_KEY",
        requires = "redis_tls_client_cert"
    )]
    pub redis_tls_client_key: Option<PathBuf>,
    /// Prefix of every bucket key in Redis.
    #[arg(long, env = "BUCKET_RLS_REDIS_KEY_PREFIX", default_value = "rls:")]
    pub redis_key_prefix: String,
    /// Redis response timeout in milliseconds.
    #[arg(long, env = "BUCKET_RLS_REDIS_TIMEOUT", default_value_t = 50,
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
    #[arg(long, env = "BUCKET_RLS_LOCAL_CACHE_SIZE", default_value_t = 100_000)]
    pub local_cache_size: u64,
    /// An admitted hit leaving fewer than (1 - ratio) x capacity tokens counts
    /// as near_limit; from 0 to 1.
    #[arg(long, env = "BUCKET_RLS_NEAR_LIMIT_RATIO", default_value_t = 0.8, value_parser = ratio)]
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
        long,
        env = "BUCKET_RLS_RATE_LIMIT_HEADERS",
        value_enum,
        default_value = "off"
    )]
    pub rate_limit_headers: RateLimitHeaders,
    /// Name of the limit header with `--rate-limit-headers go`.
    #[arg(long, env = "BUCKET_RLS_LIMIT_HEADER_NAME", default_value = "RateLimit-Limit", value_parser = header_name)]
    pub limit_header_name: String,
    /// Name of the remaining header with `--rate-limit-headers go`.
    #[arg(long, env = "BUCKET_RLS_REMAINING_HEADER_NAME", default_value = "RateLimit-Remaining", value_parser = header_name)]
    pub remaining_header_name: String,
    /// Name of the reset header with `--rate-limit-headers go`.
    #[arg(long, env = "BUCKET_RLS_RESET_HEADER_NAME", default_value = "RateLimit-Reset", value_parser = header_name)]
    pub reset_header_name: String,
    /// Every rule in shadow mode: evaluated, charged and counted, never
    /// denying (a dry run of a whole policy).
    #[arg(long, env = "BUCKET_RLS_SHADOW_MODE", default_value_t = false)]
    pub shadow_mode: bool,
    /// Every rule in quota mode: a request is denied only when every rule it
    /// hits is over its limit.
    #[arg(long, env = "BUCKET_RLS_QUOTA_MODE", default_value_t = false)]
    pub quota_mode: bool,
    /// Send dynamic metadata in every response: the domain, the request's
    /// descriptors and the merged `metadata` of the rules not over their limit.
    #[arg(
        long,
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
    /// Merge files that define the same domain into one domain (a descriptor
    /// defined twice is still an error) instead of refusing the second file.
    #[arg(long, env = "BUCKET_RLS_MERGE_DOMAIN_CONFIG", default_value_t = false)]
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
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the exported spans.
    #[arg(long, env = "OTEL_SERVICE_NAME", default_value = "bucket-rls")]
    pub tracing_service_name: String,
    /// Share of calls without a sampled parent span that are traced (0 to
    /// 1); a call whose `traceparent` is sampled is always traced.
    #[arg(long, env = "BUCKET_RLS_TRACING_SAMPLING_RATE", default_value_t = 1.0)]
    pub tracing_sampling_rate: f64,
    /// Serve gRPC over TLS with this PEM certificate chain (with
    /// `--grpc-tls-key`). The files are read again every few seconds: a
    /// replaced certificate is used for new connections.
    #[arg(long, env = "BUCKET_RLS_GRPC_TLS_CERT", requires = "grpc_tls_key")]
    pub grpc_tls_cert: Option<PathBuf>,
    /// PEM private key of `--grpc-tls-cert` (PKCS#1, PKCS#8 or SEC1).
    #[arg(long, env = "BUCKET_RLS_GRPC_TLS_KEY", requires = "grpc_tls_cert")]
    pub grpc_tls_key: Option<PathBuf>,
    /// Require gRPC clients to present a certificate signed by a CA of this
    /// PEM file (needs `--grpc-tls-cert`).
    #[arg(
        long,
        env = "BUCKET_RLS_GRPC_TLS_CLIENT_CA",
        requires = "grpc_tls_cert"
    )]
    pub grpc_tls_client_ca: Option<PathBuf>,
    /// A DNS name or IP address that client certificates must carry as a
    /// subject alternative name (needs `--grpc-tls-client-ca`).
    #[arg(
        long,
        env = "BUCKET_RLS_GRPC_TLS_CLIENT_SAN",
        requires = "grpc_tls_client_ca"
    )]
    pub grpc_tls_client_san: Option<String>,
    /// What `/healthcheck` and gRPC health report: `native` (whether
    /// storage answers now) or `go` (the Go service's: healthy once storage
    /// answered once; unhealthy after SIGTERM).
    #[arg(
        long,
        env = "BUCKET_RLS_HEALTH_MODE",
        value_enum,
        default_value = "native"
    )]
    pub health_mode: HealthModeArg,
    /// With `--health-mode go`: unhealthy until a config is loaded.
    #[arg(
        long,
        env = "BUCKET_RLS_HEALTH_REQUIRE_CONFIG",
        default_value_t = false
    )]
    pub health_require_config: bool,
    /// Also serve metrics under the Go service's names
    /// (`ratelimit_service_*`, process metrics) on this address.
    #[arg(long, env = "BUCKET_RLS_GO_METRICS_ADDR")]
    pub go_metrics_addr: Option<SocketAddr>,
    /// Path of the Go-named metrics on `--go-metrics-addr`.
    #[arg(long, env = "BUCKET_RLS_GO_METRICS_PATH", default_value = "/metrics", value_parser = url_path)]
    pub go_metrics_path: String,
    /// Also serve the plain-text `/rlconfig` (the Go service's debug port,
    /// read by `egctl config envoy-ratelimit`) on this address.
    #[arg(long, env = "BUCKET_RLS_DEBUG_ADDR")]
    pub debug_addr: Option<SocketAddr>,
    /// After SIGTERM, report unhealthy for this many seconds while still
    /// serving, then drain (lets load balancers stop sending first).
    #[arg(long, env = "BUCKET_RLS_SHUTDOWN_DELAY_SECS", default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=3_600))]
    pub shutdown_delay_secs: u64,
    /// Log level or filter (`info`, `debug`, `bucket_rls=debug,info`).
    #[arg(long, env = "BUCKET_RLS_LOG_LEVEL", default_value = "info", value_parser = parse_log_level)]
    pub log_level: String,
    /// Log format.
    #[arg(
        long,
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
            load: crate::config::loader::LoadOptions {
                merge_domains: args.merge_domain_config,
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
        use crate::config::xds::{Backoff, XdsSettings, XdsTls, pairs};
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

/// `check-config --xds-resources`: reads each of `paths` as a YAML dump of
/// `RateLimitConfig` resources and compiles it as one pushed set would be
/// (the xDS source's mapping and validation), writing one `OK` line per valid
/// dump to `out` and every problem of the others to `err`.
///
/// Returns whether every dump is valid.
pub fn check_xds_dumps(
    paths: &[PathBuf],
    load: crate::config::loader::LoadOptions,
    out: &mut impl Write,
    err: &mut impl Write,
) -> bool {
    use crate::config::xds::resources::{compile_configs, parse_dump};
    let mut ok = true;
    for p in paths {
        let name = p.display().to_string();
        let result = crate::config::loader::read_file(p)
            .map_err(|message| {
                crate::config::ConfigErrors(vec![crate::config::ConfigError {
                    file: name.clone(),
                    line: None,
                    path: String::new(),
                    message,
                }])
            })
            .and_then(|bytes| {
                String::from_utf8(bytes).map_err(|_| {
                    crate::config::ConfigErrors(vec![crate::config::ConfigError {
                        file: name.clone(),
                        line: None,
                        path: String::new(),
                        message: "not valid UTF-8".into(),
                    }])
                })
            })
            .and_then(|text| parse_dump(&name, &text))
            .and_then(|configs| compile_configs(&configs, load).map(|c| (configs.len(), c)));
        match result {
            Ok((n, c)) => {
                let _ = writeln!(
                    out,
                    "{name}: OK ({n} resources, {} domains, {} rules, sha256 {})",
                    c.domains.len(),
                    c.rule_count(),
                    c.hash
                );
            }
            Err(errs) => {
                ok = false;
                for e in errs.0 {
                    let _ = writeln!(err, "{e}");
                }
            }
        }
    }
    ok
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

/// `check-config`: loads each of `paths` as one config source with the
/// service's loader, writes one `OK` line per valid source to `out` and every
/// problem of the others to `err`. A failed write is ignored (the reader is
/// gone; the result still tells the outcome).
///
/// Returns whether every source is valid.
pub fn check_config(
    paths: &[PathBuf],
    load: crate::config::loader::LoadOptions,
    out: &mut impl Write,
    err: &mut impl Write,
) -> bool {
    let mut ok = true;
    // Domains of the sources checked so far, to catch one domain given by
    // two sources (one service loads one source: the second would be lost).
    let mut seen: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let plural = |n: usize, one: &'static str, many: &'static str| {
        format!("{n} {}", if n == 1 { one } else { many })
    };
    for p in paths {
        match crate::config::loader::load_source_with(p, load) {
            Ok(c) => {
                let mut names: Vec<&String> = c.domains.keys().collect();
                names.sort();
                let mut clash = false;
                for d in names {
                    if let Some(first) = seen.get(d) {
                        clash = true;
                        let _ = writeln!(
                            err,
                            "{}: domain: duplicate domain '{d}' (also defined in {first}, given as another source; a service loads one --config source, so put both in one directory)",
                            p.display()
                        );
                    } else {
                        seen.insert(d.clone(), p.display().to_string());
                    }
                }
                if clash {
                    ok = false;
                    continue;
                }
                let _ = writeln!(
                    out,
                    "{}: OK ({}, {}, sha256 {})",
                    p.display(),
                    plural(c.domains.len(), "domain", "domains"),
                    plural(c.rule_count(), "rule", "rules"),
                    c.hash
                );
            }
            Err(errs) => {
                ok = false;
                for e in errs.0 {
                    let _ = writeln!(err, "{e}");
                }
            }
        }
    }
    ok
}

/// `check-config --diff OLD NEW`: loads both sides, writes one line per
/// changed rule and a summary to `out`, problems to `err`.
///
/// `old` is a path, or an `http://` URL of a replica's `/rlconfig` (plain
/// HTTP, as the admin port serves it; 10 s timeout). Returns the exit code:
/// 0 no rule changed, 2 only additions and loosenings, 3 a change to review
/// (tightened, removed, mixed, or a mode changed), 1 when a side does not
/// load.
pub async fn diff_configs(
    old: &str,
    new: &std::path::Path,
    load: crate::config::loader::LoadOptions,
    out: &mut impl Write,
    err: &mut impl Write,
) -> i32 {
    use crate::config::diff;
    let load_path = |p: &std::path::Path, err: &mut dyn Write| {
        crate::config::loader::load_source_with(p, load)
            .map(|c| diff::rules_of(&c))
            .map_err(|errs| {
                for e in errs.0 {
                    let _ = writeln!(err, "{e}");
                }
            })
    };
    let old_rules = if old.starts_with("http://") || old.starts_with("https://") {
        match fetch_rlconfig(old)
            .await
            .and_then(|b| diff::rules_from_rlconfig(&b))
        {
            Ok(r) => Ok(r),
            Err(e) => {
                let _ = writeln!(err, "{old}: {e}");
                Err(())
            }
        }
    } else {
        load_path(std::path::Path::new(old), err)
    };
    let new_rules = load_path(new, err);
    let (Ok(old_rules), Ok(new_rules)) = (old_rules, new_rules) else {
        return 1;
    };
    let changes = diff::diff(&old_rules, &new_rules);
    for c in &changes {
        let _ = writeln!(out, "{}", c.line);
    }
    let _ = writeln!(out, "{}", diff::summary(&changes));
    if changes.is_empty() {
        0
    } else if changes.iter().any(|c| c.kind.needs_review()) {
        3
    } else {
        2
    }
}

/// `GET url` over plain HTTP/1.1; the body of a 200 answer (at most 64 MiB).
async fn fetch_rlconfig(url: &str) -> Result<Vec<u8>, String> {
    use http_body_util::{BodyExt, Empty, Limited};
    let uri: hyper::Uri = url.parse().map_err(|e| format!("not a URL: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err("only http:// is supported (the admin port serves plain HTTP)".to_owned());
    }
    let host = uri.host().ok_or("the URL has no host")?.to_owned();
    let port = uri.port_u16().unwrap_or(80);
    let fetch = async {
        let stream = tokio::net::TcpStream::connect((host.trim_matches(['[', ']']), port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| format!("HTTP: {e}"))?;
        tokio::spawn(conn);
        let req = hyper::Request::get(uri.path_and_query().map_or("/", |p| p.as_str()))
            .header(
                hyper::header::HOST,
                uri.authority().map_or(host.as_str(), |a| a.as_str()),
            )
            .body(Empty::<bytes::Bytes>::new())
            .map_err(|e| format!("request: {e}"))?;
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| format!("HTTP: {e}"))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), 64 << 20)
            .collect()
            .await
            .map_err(|e| format!("reading the body: {e}"))?
            .to_bytes();
        if status != hyper::StatusCode::OK {
            return Err(format!("answered {status}"));
        }
        Ok(body.to_vec())
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), fetch)
        .await
        .map_err(|_| "no answer within 10 s".to_owned())?
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `serve --config c.yaml` plus `flags`, parsed as the binary parses them.
    /// The `BUCKET_RLS_*` variables are not read, so the tests do not depend
    /// on the environment they run in.
    fn serve_args(flags: &[&str]) -> ServeArgs {
        let argv: Vec<&str> = ["--config", "c.yaml"]
            .into_iter()
            .chain(flags.iter().copied())
            .collect();
        try_serve_args(&argv).expect("flags parse")
    }

    /// `serve` plus `flags` (no `--config` added), or clap's error.
    fn try_serve_args(flags: &[&str]) -> Result<ServeArgs, clap::Error> {
        use clap::{CommandFactory as _, FromArgMatches as _};
        let argv = ["bucket-rls", "serve"]
            .into_iter()
            .chain(flags.iter().copied());
        let matches = Cli::command()
            .mut_subcommand("serve", |serve| {
                serve.mut_args(|arg| arg.env(None::<&'static str>))
            })
            .try_get_matches_from(argv)?;
        match Cli::from_arg_matches(&matches)?.command {
            Command::Serve(args) => Ok(*args),
            other => panic!("not serve: {other:?}"),
        }
    }

    fn backend(flags: &[&str]) -> Result<Backend, SetupError> {
        Backend::try_from(&serve_args(flags))
    }

    /// The error's message, with its sources as `main` prints them.
    fn refused(flags: &[&str]) -> (SetupError, String) {
        let e = backend(flags).expect_err("must be refused");
        let mut msg = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            msg = format!("{msg}: {s}");
            source = s.source();
        }
        (e, msg)
    }

    /// A file holding a PEM certificate block (only its presence is checked
    /// here; parsing is the backend builder's job).
    fn ca_file() -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().expect("temp file");
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])
            .expect("self-signed certificate");
        f.write_all(cert.cert.pem().as_bytes()).expect("write");
        f
    }

    fn redis_defaults() -> RedisOptions {
        RedisOptions {
            timeout: Duration::from_millis(50),
            local_cache_size: 100_000,
            tls_root_ca_pem: None,
            tls_client: None,
            ..RedisOptions::default()
        }
    }

    #[test]
    fn no_redis_flag_selects_memory_with_its_bucket_cap() {
        assert_eq!(
            backend(&[]).expect("memory"),
            Backend::Memory {
                max_buckets: crate::storage::memory::DEFAULT_MAX_BUCKETS
            }
        );
        assert_eq!(
            backend(&["--memory-max-buckets", "7"]).expect("memory"),
            Backend::Memory { max_buckets: 7 }
        );
    }

    #[test]
    fn redis_url_selects_one_node_with_the_shared_options() {
        assert_eq!(
            backend(&["--redis-url", "redis://127.0.0.1:1"]).expect("redis"),
            Backend::Redis {
                url: "redis://127.0.0.1:1".into(),
                redis: redis_defaults(),
            }
        );
        let b = backend(&[
            "--redis-url",
            "redis://127.0.0.1:1",
            "--redis-timeout",
            "250",
            "--local-cache-size",
            "0",
        ])
        .expect("redis");
        let redis = b.redis().expect("a Redis backend");
        assert_eq!(redis.timeout, Duration::from_millis(250));
        assert_eq!(redis.local_cache_size, 0);
    }

    #[test]
    fn sentinel_needs_a_master_name_and_carries_the_master_credentials() {
        let b = backend(&[
            "--redis-sentinel",
            "127.0.0.1:1,127.0.0.1:2",
            "--redis-master-name",
            "mymaster",
            "--redis-master-username",
            "app",
            "--redis-master-password",
            "pw",
        ])
        .expect("sentinel");
        assert_eq!(
            b,
            Backend::Sentinel {
                sentinels: vec!["127.0.0.1:1".into(), "127.0.0.1:2".into()],
                master_name: "mymaster".into(),
                master_auth: MasterAuth {
                    username: Some("app".into()),
                    password: Some("pw".into()),
                },
                redis: redis_defaults(),
            }
        );
        let shown = format!("{b:?}");
        assert!(
            shown.contains("***") && !shown.contains("\"pw\""),
            "password in Debug: {shown}"
        );

        let (e, msg) = refused(&["--redis-sentinel", "127.0.0.1:1"]);
        assert!(matches!(e, SetupError::MissingMasterName), "{e:?}");
        assert_eq!(msg, "--redis-sentinel needs --redis-master-name");
    }

    #[test]
    fn debug_output_shows_no_password() {
        for flags in [
            &["--redis-url", "redis://app:s3cret@127.0.0.1:1"][..],
            &["--redis-cluster", "redis://:s3cret@127.0.0.1:1,127.0.0.1:2"][..],
            &[
                "--redis-sentinel",
                "redis://:s3cret@127.0.0.1:1",
                "--redis-master-name",
                "m",
                "--redis-master-password",
                "s3cret",
            ][..],
        ] {
            let shown = format!("{:?}", backend(flags).expect("backend"));
            assert!(
                shown.contains("***") && !shown.contains("s3cret"),
                "{flags:?}: {shown}"
            );
        }
    }

    #[test]
    fn cluster_seed_nodes_are_split_at_commas() {
        assert_eq!(
            backend(&["--redis-cluster", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"]).expect("cluster"),
            Backend::Cluster {
                nodes: vec![
                    "127.0.0.1:1".into(),
                    "127.0.0.1:2".into(),
                    "127.0.0.1:3".into()
                ],
                redis: redis_defaults(),
            }
        );
    }

    #[test]
    fn two_topologies_are_refused_whichever_pair() {
        for flags in [
            &[
                "--redis-url",
                "redis://127.0.0.1:1",
                "--redis-cluster",
                "127.0.0.1:2",
            ][..],
            &[
                "--redis-cluster",
                "127.0.0.1:2",
                "--redis-sentinel",
                "127.0.0.1:3",
            ][..],
            &[
                "--redis-url",
                "redis://127.0.0.1:1",
                "--redis-sentinel",
                "127.0.0.1:3",
            ][..],
        ] {
            let (e, msg) = refused(flags);
            assert!(matches!(e, SetupError::ManyTopologies), "{flags:?}: {e:?}");
            assert_eq!(
                msg,
                "give only one of --redis-url, --redis-sentinel and --redis-cluster"
            );
        }
    }

    #[test]
    fn master_credentials_without_sentinel_are_refused() {
        for flags in [
            &["--redis-master-password", "pw"][..],
            &[
                "--redis-url",
                "redis://127.0.0.1:1",
                "--redis-master-username",
                "u",
            ][..],
            &[
                "--redis-cluster",
                "127.0.0.1:1",
                "--redis-master-password",
                "pw",
            ][..],
        ] {
            let (e, msg) = refused(flags);
            assert!(
                matches!(e, SetupError::MasterAuthWithoutSentinel),
                "{flags:?}: {e:?}"
            );
            assert_eq!(
                msg,
                "--redis-master-username and --redis-master-password apply only with --redis-sentinel"
            );
        }
    }

    #[test]
    fn a_ca_file_without_redis_is_refused_before_it_is_read() {
        let (e, msg) = refused(&["--redis-tls-ca-file", "/nonexistent/ca.pem"]);
        assert!(matches!(e, SetupError::TlsCaWithoutRedis), "{e:?}");
        assert_eq!(
            msg,
            "--redis-tls-ca-file needs a Redis backend (--redis-url, --redis-sentinel or --redis-cluster)"
        );
    }

    #[test]
    fn an_unreadable_ca_file_is_named_with_the_reason() {
        let dir = tempfile::tempdir().expect("temp dir");
        let missing = dir.path().join("missing.pem");
        let path = missing.to_str().expect("utf-8 path");
        let (e, msg) = refused(&[
            "--redis-url",
            "rediss://127.0.0.1:1",
            "--redis-tls-ca-file",
            path,
        ]);
        assert!(
            matches!(&e, SetupError::TlsCaRead { path: p, source } if *p == missing && source.kind() == std::io::ErrorKind::NotFound),
            "{e:?}"
        );
        assert!(
            msg.starts_with(&format!("reading --redis-tls-ca-file {path}: ")),
            "{msg}"
        );
    }

    #[test]
    fn a_ca_file_without_a_certificate_is_refused() {
        let mut f = tempfile::NamedTempFile::new().expect("temp file");
        f.write_all(b"not a certificate\n").expect("write");
        let path = f.path().to_str().expect("utf-8 path");
        let (e, msg) = refused(&[
            "--redis-url",
            "rediss://127.0.0.1:1",
            "--redis-tls-ca-file",
            path,
        ]);
        assert!(matches!(e, SetupError::TlsCaNoCertificate { .. }), "{e:?}");
        assert_eq!(
            msg,
            format!(
                "--redis-tls-ca-file {path}: no PEM certificate (-----BEGIN CERTIFICATE-----) in it"
            )
        );
    }

    #[test]
    fn a_ca_file_is_read_for_every_redis_topology() {
        let ca = ca_file();
        let pem = std::fs::read(ca.path()).expect("read");
        let path = ca.path().to_str().expect("utf-8 path");
        for flags in [
            &["--redis-url", "rediss://127.0.0.1:1"][..],
            &["--redis-cluster", "rediss://127.0.0.1:1"][..],
            &[
                "--redis-sentinel",
                "rediss://127.0.0.1:1",
                "--redis-master-name",
                "m",
            ][..],
        ] {
            let flags: Vec<&str> = flags
                .iter()
                .copied()
                .chain(["--redis-tls-ca-file", path])
                .collect();
            let b = backend(&flags).expect("backend");
            assert_eq!(
                b.redis().and_then(|r| r.tls_root_ca_pem.as_deref()),
                Some(pem.as_slice()),
                "{flags:?}"
            );
        }
    }

    #[test]
    fn the_checks_run_in_a_fixed_order() {
        // Two topologies win over credentials without Sentinel and a CA file.
        let (e, _) = refused(&[
            "--redis-url",
            "redis://127.0.0.1:1",
            "--redis-cluster",
            "127.0.0.1:2",
            "--redis-master-password",
            "pw",
        ]);
        assert!(matches!(e, SetupError::ManyTopologies), "{e:?}");
        // The CA file is checked before the missing master name.
        let (e, _) = refused(&[
            "--redis-sentinel",
            "127.0.0.1:1",
            "--redis-tls-ca-file",
            "/nonexistent/ca.pem",
        ]);
        assert!(matches!(e, SetupError::TlsCaRead { .. }), "{e:?}");
    }

    #[test]
    fn service_settings_take_the_request_path_flags() {
        let s = Settings::try_from(&serve_args(&[
            "--grpc-addr",
            "127.0.0.1:9001",
            "--http-addr",
            "127.0.0.1:9002",
            "--redis-key-prefix",
            "t:",
            "--on-storage-error",
            "deny",
            "--near-limit-ratio",
            "0.5",
            "--max-descriptors",
            "3",
            "--exact-durations",
            "--rate-limit-headers",
            "ietf",
            "--max-debt-bursts",
            "2",
        ]))
        .expect("settings");
        assert_eq!(s.config, ConfigSource::File(PathBuf::from("c.yaml")));
        assert_eq!(s.grpc_addr, "127.0.0.1:9001".parse().expect("addr"));
        assert_eq!(s.http_addr, "127.0.0.1:9002".parse().expect("addr"));
        assert_eq!(s.service.key_prefix, "t:");
        assert_eq!(s.service.on_storage_error, OnStorageError::Deny);
        assert!((s.service.near_limit_ratio - 0.5).abs() < f64::EPSILON);
        assert_eq!(s.service.max_descriptors, 3);
        assert!(s.service.exact_durations);
        assert_eq!(s.service.max_debt_bursts, 2);
        assert_eq!(
            s.service.rate_limit_headers,
            crate::settings::RateLimitHeaders::Ietf
        );
        // Not a flag: the library default.
        assert_eq!(
            s.service.max_entries,
            ServiceSettings::default().max_entries
        );
    }

    #[test]
    fn default_flags_give_the_default_service_settings() {
        let s = ServiceSettings::from(&serve_args(&[]));
        let d = ServiceSettings::default();
        assert_eq!(s.key_prefix, d.key_prefix);
        assert_eq!(s.on_storage_error, d.on_storage_error);
        assert!((s.near_limit_ratio - d.near_limit_ratio).abs() < f64::EPSILON);
        assert_eq!(s.max_descriptors, d.max_descriptors);
        assert_eq!(s.exact_durations, d.exact_durations);
        assert_eq!(s.rate_limit_headers, d.rate_limit_headers);
        assert_eq!(s.header_names, d.header_names);
        assert!(!s.global_shadow_mode && !s.global_quota_mode && !s.response_dynamic_metadata);
        assert_eq!((s.max_debt_bursts, d.max_debt_bursts), (0, 0));
    }

    #[test]
    fn go_mode_flags_reach_the_service_settings() {
        let args = serve_args(&[
            "--shadow-mode",
            "--quota-mode",
            "--response-dynamic-metadata",
            "--merge-domain-config",
            "--rate-limit-headers",
            "go",
            "--limit-header-name",
            "X-Limit",
        ]);
        let s = ServiceSettings::from(&args);
        assert!(s.global_shadow_mode && s.global_quota_mode && s.response_dynamic_metadata);
        assert_eq!(s.rate_limit_headers, crate::settings::RateLimitHeaders::Go);
        assert_eq!(s.header_names.limit, "X-Limit");
        assert_eq!(s.header_names.reset, "RateLimit-Reset");
        assert!(Settings::try_from(&args).unwrap().load.merge_domains);
        let bad = Cli::try_parse_from([
            "bucket-rls",
            "serve",
            "--config",
            "c.yaml",
            "--limit-header-name",
            "bad name",
        ]);
        assert!(
            bad.unwrap_err()
                .to_string()
                .contains("is not a header name")
        );
    }

    #[test]
    fn check_config_refuses_one_domain_given_by_two_sources() {
        let dir = tempfile::tempdir().expect("temp dir");
        let yaml = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n";
        let (a, b) = (dir.path().join("a.yaml"), dir.path().join("b.yaml"));
        std::fs::write(&a, yaml).expect("write");
        std::fs::write(&b, yaml.replace("key: k", "key: j")).expect("write");
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert!(!check_config(
            &[a.clone(), b],
            Default::default(),
            &mut out,
            &mut err
        ));
        let (out, err) = (
            String::from_utf8(out).unwrap(),
            String::from_utf8(err).unwrap(),
        );
        assert!(
            out.contains("a.yaml: OK (1 domain, 1 rule, sha256 "),
            "{out}"
        );
        assert!(
            err.contains("b.yaml: domain: duplicate domain 'd' (also defined in ")
                && err.contains("a.yaml, given as another source"),
            "{err}"
        );
    }

    #[test]
    fn check_config_reports_ok_lines_and_every_problem() {
        let dir = tempfile::tempdir().expect("temp dir");
        let good = dir.path().join("good.yaml");
        std::fs::write(
            &good,
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        )
        .expect("write");
        let bad = dir.path().join("bad.yaml");
        std::fs::write(&bad, "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minnute, requests_per_unit: 1}\n")
            .expect("write");
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert!(check_config(
            std::slice::from_ref(&good),
            Default::default(),
            &mut out,
            &mut err
        ));
        let out_text = String::from_utf8(out).expect("utf-8");
        assert!(
            out_text.starts_with(&format!(
                "{}: OK (1 domain, 1 rule, sha256 ",
                good.display()
            )),
            "{out_text}"
        );
        assert!(err.is_empty());
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert!(!check_config(
            &[good, bad],
            Default::default(),
            &mut out,
            &mut err
        ));
        let err_text = String::from_utf8(err).expect("utf-8");
        assert!(
            err_text.contains("bad.yaml") && err_text.contains("minnute"),
            "{err_text}"
        );
        assert_eq!(String::from_utf8(out).expect("utf-8").lines().count(), 1);
    }

    #[test]
    fn config_xds_flags_become_xds_settings() {
        use crate::config::xds::XdsTls;
        let args = try_serve_args(&[
            "--config-xds",
            "envoy-gateway:18001",
            "--config-xds-node-id",
            "envoy-ratelimit",
            "--config-xds-node-metadata",
            "zone=a",
            "--config-xds-headers",
            "X-Token:t",
            "--config-xds-tls-cert",
            "/certs/tls.crt",
            "--config-xds-tls-key",
            "/certs/tls.key",
            "--config-xds-tls-ca",
            "/certs/ca.crt",
            "--config-xds-backoff-initial-ms",
            "100",
            "--config-xds-max-message-bytes",
            "8388608",
            "--config-xds-wait-for-config",
        ])
        .expect("flags parse");
        let Ok(Settings {
            config: ConfigSource::Xds(x),
            ..
        }) = Settings::try_from(&args)
        else {
            panic!("not xDS settings");
        };
        assert_eq!(x.node_id, "envoy-ratelimit");
        assert_eq!(x.node_metadata, vec![("zone".into(), "a".into())]);
        assert_eq!(x.headers, vec![("x-token".into(), "t".into())]);
        assert_eq!(
            x.tls,
            Some(XdsTls {
                client_cert: Some("/certs/tls.crt".into()),
                client_key: Some("/certs/tls.key".into()),
                ca_cert: Some("/certs/ca.crt".into()),
                server_name: None,
            })
        );
        assert_eq!(x.backoff.initial, Duration::from_millis(100));
        assert_eq!(x.max_message_bytes, 8 << 20);
        assert!(!x.start_without_config);
        // Plaintext unless a TLS flag or https:// asks for TLS.
        let args = try_serve_args(&["--config-xds", "127.0.0.1:18000"]).expect("flags parse");
        let Ok(Settings {
            config: ConfigSource::Xds(x),
            ..
        }) = Settings::try_from(&args)
        else {
            panic!("not xDS settings");
        };
        assert_eq!(x.tls, None);
        assert!(x.start_without_config);
    }

    #[test]
    fn config_and_config_xds_are_exclusive_and_one_is_required() {
        assert!(try_serve_args(&["--config", "c.yaml", "--config-xds", "h:1"]).is_err());
        assert!(try_serve_args(&[]).is_err());
        let args = try_serve_args(&["--config", "c.yaml", "--config-xds-node-id", "x"])
            .expect("flags parse");
        let e = Settings::try_from(&args).unwrap_err().to_string();
        assert!(e.contains("--config-xds-node-id needs --config-xds"), "{e}");
        let args = try_serve_args(&["--config-xds", "no-port"]).expect("flags parse");
        let e = Settings::try_from(&args).unwrap_err().to_string();
        assert!(e.contains("host:port"), "{e}");
    }

    #[test]
    fn check_config_reads_xds_resource_dumps() {
        let dir = tempfile::tempdir().expect("tempdir");
        let good = dir.path().join("good.yaml");
        std::fs::write(
            &good,
            "name: a\ndomain: a\ndescriptors:\n  - key: k\n    value: \"\"\n    rate_limit:\n      requests_per_unit: 5\n      unit: SECOND\n---\nname: b\ndomain: b\ndescriptors: []\n",
        )
        .expect("write");
        let bad = dir.path().join("bad.yaml");
        std::fs::write(&bad, "name: c\ndomain: c\ndescriptors:\n  - key: k\n    rate_limit:\n      requests_per_unit: 5\n").expect("write");
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert!(check_xds_dumps(
            std::slice::from_ref(&good),
            crate::config::loader::LoadOptions::default(),
            &mut out,
            &mut err
        ));
        let out = String::from_utf8(out).expect("UTF-8");
        assert!(
            out.contains("OK (2 resources, 2 domains, 1 rules, sha256 "),
            "{out}"
        );
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert!(!check_xds_dumps(
            &[good, bad],
            crate::config::loader::LoadOptions::default(),
            &mut out,
            &mut err
        ));
        let err = String::from_utf8(err).expect("UTF-8");
        assert!(
            err.contains("c: descriptors[0].rate_limit: bad unit 'UNKNOWN'"),
            "{err}"
        );
    }
}
