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
        /// Merge files that define the same domain (as `serve
        /// --merge-domain-config`).
        #[arg(long)]
        merge_domain_config: bool,
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
    /// Give every limited rule without its own `max_debt` a debt bound of
    /// this many times its burst (0: none). For token budgets charged after
    /// the response in configs that cannot carry `max_debt` (xDS).
    #[arg(long, env = "BUCKET_RLS_MAX_DEBT_BURSTS", default_value_t = 0)]
    pub max_debt_bursts: u32,
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
            config: args.config.clone(),
            grpc_addr: args.grpc_addr,
            http_addr: args.http_addr,
            service,
            load: crate::config::loader::LoadOptions {
                merge_domains: args.merge_domain_config,
            },
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
            header_names: crate::settings::HeaderNames {
                limit: args.limit_header_name.clone(),
                remaining: args.remaining_header_name.clone(),
                reset: args.reset_header_name.clone(),
            },
            global_shadow_mode: args.shadow_mode,
            global_quota_mode: args.quota_mode,
            response_dynamic_metadata: args.response_dynamic_metadata,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// `serve --config c.yaml` plus `flags`, parsed as the binary parses them.
    /// The `BUCKET_RLS_*` variables are not read, so the tests do not depend
    /// on the environment they run in.
    fn serve_args(flags: &[&str]) -> ServeArgs {
        use clap::{CommandFactory as _, FromArgMatches as _};
        let argv = ["bucket-rls", "serve", "--config", "c.yaml"]
            .into_iter()
            .chain(flags.iter().copied());
        let matches = Cli::command()
            .mut_subcommand("serve", |serve| {
                serve.mut_args(|arg| arg.env(None::<&'static str>))
            })
            .try_get_matches_from(argv)
            .expect("flags parse");
        match Cli::from_arg_matches(&matches)
            .expect("flags parse")
            .command
        {
            Command::Serve(args) => *args,
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

    fn redis_defaults() -> RedisSettings {
        RedisSettings {
            timeout_ms: 50,
            local_cache_size: 100_000,
            tls_root_ca_pem: None,
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
        assert_eq!(redis.timeout(), Duration::from_millis(250));
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
        assert_eq!(s.config, PathBuf::from("c.yaml"));
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
}
