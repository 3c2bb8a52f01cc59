//! Command line: `serve`, `check-config`, `loadgen`. Every flag of `serve` also
//! reads an environment variable `BUCKET_RLS_<FLAG>`. `serve`'s flags become
//! [`Settings`] through `TryFrom<&ServeArgs>`, which refuses flags that
//! contradict each other ([`SetupError`]).

use crate::settings::{
    Backend, MasterAuth, OnStorageError, RedisSettings, ServiceSettings, Settings, SetupError,
};
use clap::{Parser, Subcommand, ValueEnum};
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

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
    /// (RateLimit-Limit/Remaining/Reset) or `ietf` (RateLimit-Policy and RateLimit).
    #[arg(
        long,
        env = "BUCKET_RLS_RATE_LIMIT_HEADERS",
        value_enum,
        default_value = "off"
    )]
    pub rate_limit_headers: crate::settings::RateLimitHeaders,
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

/// Magic line of a PEM certificate block.
const PEM_CERTIFICATE: &[u8] = b"-----BEGIN CERTIFICATE-----";

impl TryFrom<&ServeArgs> for Settings {
    type Error = SetupError;

    /// Checks the flags of `serve` and reads the CA file (see
    /// [`Backend`]'s `TryFrom`).
    fn try_from(args: &ServeArgs) -> Result<Self, SetupError> {
        Ok(Self {
            config: args.config.clone(),
            grpc_addr: args.grpc_addr,
            http_addr: args.http_addr,
            service: ServiceSettings::from(args),
            backend: Backend::try_from(args)?,
        })
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
        let redis = RedisSettings {
            timeout_ms: args.redis_timeout,
            local_cache_size: usize::try_from(args.local_cache_size).unwrap_or(usize::MAX),
            tls_root_ca_pem,
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

/// `check-config`: loads each of `paths` as one config source with the
/// service's loader, writes one `OK` line per valid source to `out` and every
/// problem of the others to `err`. A failed write is ignored (the reader is
/// gone; the result still tells the outcome).
///
/// Returns whether every source is valid.
pub fn check_config(paths: &[PathBuf], out: &mut impl Write, err: &mut impl Write) -> bool {
    let mut ok = true;
    for p in paths {
        match crate::config::loader::load_source(p) {
            Ok(c) => {
                let _ = writeln!(
                    out,
                    "{}: OK ({} domains, {} rules, sha256 {})",
                    p.display(),
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
