//! Command line: `serve`, `check-config`, `loadgen`. Every flag of `serve` also
//! reads an environment variable `BUCKET_RLS_<FLAG>`.

use crate::settings::OnStorageError;
use clap::{Parser, Subcommand, ValueEnum};
use std::net::SocketAddr;
use std::path::PathBuf;

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
    },
    /// Load a rate limit service over gRPC and report throughput and latency
    /// (loopback targets only unless `--allow-remote`).
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
    #[arg(long, env = "BUCKET_RLS_CONFIG")]
    pub config: PathBuf,
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
    pub rate_limit_headers: crate::settings::RateLimitHeaders,
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
    /// Merge files that define the same domain into one domain (a descriptor
    /// defined twice is still an error) instead of refusing the second file.
    #[arg(long, env = "BUCKET_RLS_MERGE_DOMAIN_CONFIG", default_value_t = false)]
    pub merge_domain_config: bool,
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
