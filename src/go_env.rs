//! The `ratelimit` entry point: the Go reference service's environment
//! variables (envoyproxy/ratelimit `src/settings/settings.go`) mapped onto
//! the flags of `serve`, so a deployment that runs `/bin/ratelimit` with no
//! arguments (Envoy Gateway, the Istio sample, the Go docker-compose files)
//! runs bucket-rls unchanged.
//!
//! [`map_env`] turns an environment (a map, injected so it is testable) into
//! `serve` flags; [`serve_args`] parses them with the same clap definition
//! and the same `Settings` conversion as the command line, so there is one
//! settings code path. Each variable is one of:
//! - mapped onto a flag (the table in the README, "Replacing the Go service");
//! - accepted and ignored ([`IGNORED`]: Go-internal tuning);
//! - handled by the xDS config source ([`XDS`]);
//! - refused with the reason (memcache, `USE_STATSD=true`, the per-second
//!   Redis, Unix sockets, ...): [`GoEnvError`];
//! - unknown: in a family of the Go service's names ([`FAMILIES`]) but not
//!   known here; ignored and named once in the log.
//!
//! `BUCKET_RLS_<FLAG>` variables still set flags that no Go variable gives
//! (clap reads them after the command line).

use crate::cli::{Cli, Command, ServeArgs};
use clap::Parser as _;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// An environment: variable name to value.
pub type Env = BTreeMap<String, String>;

/// Go variables accepted and ignored: they tune Go internals (pools,
/// pipelines, jitter, statsd details, the stats mapper) or ask for what
/// bucket-rls always does.
pub const IGNORED: &[&str] = &[
    "RUNTIME_IGNOREDOTFILES",
    "RUNTIME_WATCH_ROOT",
    "GRPC_SERVER_TLS_CA_CERT",
    "GRPC_MAX_CONNECTION_AGE",
    "GRPC_MAX_CONNECTION_AGE_GRACE",
    "BACKEND_TYPE",
    "REDIS_SOCKET_TYPE",
    "REDIS_POOL_SIZE",
    "REDIS_PIPELINE_WINDOW",
    "REDIS_PIPELINE_LIMIT",
    "REDIS_CLUSTER_PIPELINE_PARALLELISM",
    "REDIS_POOL_ON_EMPTY_BEHAVIOR",
    "REDIS_POOL_ON_EMPTY_WAIT_DURATION",
    "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION",
    "REDIS_STARTUP_INITIAL_INTERVAL",
    "REDIS_STARTUP_MAX_INTERVAL",
    "REDIS_STARTUP_MAX_ELAPSED_TIME",
    "REDIS_PERSECOND",
    "EXPIRATION_JITTER_MAX_SECONDS",
    "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT",
    "USE_STATSD",
    "STATSD_HOST",
    "STATSD_PORT",
    "USE_DOG_STATSD",
    "USE_DOG_STATSD_MOGRIFIERS",
    "EXTRA_TAGS",
    "STATS_FLUSH_INTERVAL",
    "DISABLE_STATS",
    "PROMETHEUS_MAPPER_YAML",
    "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS",
    "TRACING_SERVICE_NAMESPACE",
    "TRACING_SERVICE_INSTANCE_ID",
    "MEMCACHE_HOST_PORT",
    "MEMCACHE_SRV",
    "MEMCACHE_SRV_REFRESH",
    "MEMCACHE_MAX_IDLE_CONNS",
];

/// Variables of the xDS config source (`CONFIG_TYPE=GRPC_XDS_SOTW`); in
/// file mode they are not read, as in the Go service.
pub const XDS: &[&str] = &[
    "CONFIG_GRPC_XDS_SERVER_URL",
    "CONFIG_GRPC_XDS_NODE_ID",
    "CONFIG_GRPC_XDS_NODE_METADATA",
    "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
    "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",
    "CONFIG_GRPC_XDS_SERVER_USE_TLS",
    "CONFIG_GRPC_XDS_CLIENT_TLS_CERT",
    "CONFIG_GRPC_XDS_CLIENT_TLS_KEY",
    "CONFIG_GRPC_XDS_SERVER_TLS_CACERT",
    "CONFIG_GRPC_XDS_SERVER_TLS_SAN",
    "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL",
    "XDS_CLIENT_BACKOFF_MAX_INTERVAL",
    "XDS_CLIENT_BACKOFF_RANDOM_FACTOR",
    "XDS_CLIENT_BACKOFF_JITTER",
    "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES",
    "FORCE_START_WITHOUT_INITIAL_CONFIG",
];

/// Variables mapped onto `serve` flags (read by [`map_env`]).
pub const MAPPED: &[&str] = &[
    "CONFIG_TYPE",
    "RUNTIME_ROOT",
    "RUNTIME_SUBDIRECTORY",
    "RUNTIME_APPDIRECTORY",
    "MERGE_DOMAIN_CONFIG",
    "HOST",
    "PORT",
    "GRPC_HOST",
    "GRPC_PORT",
    "DEBUG_HOST",
    "DEBUG_PORT",
    "GRPC_SERVER_USE_TLS",
    "GRPC_SERVER_TLS_CERT",
    "GRPC_SERVER_TLS_KEY",
    "GRPC_CLIENT_TLS_CACERT",
    "GRPC_CLIENT_TLS_SAN",
    "LOG_LEVEL",
    "LOG_FORMAT",
    "REDIS_TYPE",
    "REDIS_URL",
    "REDIS_AUTH",
    "REDIS_SENTINEL_AUTH",
    "REDIS_TLS",
    "REDIS_TLS_CACERT",
    "REDIS_TLS_CLIENT_CERT",
    "REDIS_TLS_CLIENT_KEY",
    "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
    "REDIS_TIMEOUT",
    "CACHE_KEY_PREFIX",
    "LOCAL_CACHE_SIZE_IN_BYTES",
    "NEAR_LIMIT_RATIO",
    "LIMIT_RESPONSE_HEADERS_ENABLED",
    "LIMIT_LIMIT_HEADER",
    "LIMIT_REMAINING_HEADER",
    "LIMIT_RESET_HEADER",
    "SHADOW_MODE",
    "QUOTA_MODE",
    "RESPONSE_DYNAMIC_METADATA",
    "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
    "USE_PROMETHEUS",
    "PROMETHEUS_ADDR",
    "PROMETHEUS_PATH",
    "TRACING_ENABLED",
    "TRACING_SERVICE_NAME",
    "TRACING_SAMPLING_RATE",
    "TRACING_EXPORTER_PROTOCOL",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
];

/// Name prefixes of the Go service's variables: a variable with one of
/// them that is not known here is reported as unknown. Other variables
/// (`PATH`, `HOSTNAME`, `KUBERNETES_*`) are not the service's and are not
/// mentioned.
pub const FAMILIES: &[&str] = &[
    "BACKEND_",
    "CACHE_",
    "CONFIG_",
    "DEBUG_",
    "DISABLE_",
    "EXPIRATION_",
    "EXTRA_",
    "FORCE_",
    "GRPC_",
    "HEALTHY_",
    "LIMIT_",
    "LOCAL_CACHE_",
    "LOG_",
    "MEMCACHE_",
    "MERGE_",
    "NEAR_LIMIT_",
    "OTEL_",
    "PROMETHEUS_",
    "QUOTA_",
    "REDIS_",
    "RESPONSE_",
    "RUNTIME_",
    "SHADOW_",
    "STATSD_",
    "STATS_",
    "STOP_",
    "TRACING_",
    "USE_",
    "XDS_",
];

/// Bytes the Go service's local cache spends per entry, to turn
/// `LOCAL_CACHE_SIZE_IN_BYTES` into the entries of `--local-cache-size`
/// (an estimate: a key of about 100 bytes plus bookkeeping).
pub const LOCAL_CACHE_BYTES_PER_ENTRY: u64 = 128;

/// Why the environment cannot start the service: the variable and the
/// reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}: {reason}")]
pub struct GoEnvError {
    /// The variable (or variables) at fault.
    pub var: String,
    /// Why.
    pub reason: String,
}

fn refuse(var: &str, reason: impl Into<String>) -> GoEnvError {
    GoEnvError {
        var: var.to_owned(),
        reason: reason.into(),
    }
}

/// Where the config comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigSource {
    /// Files under `$RUNTIME_ROOT/$RUNTIME_SUBDIRECTORY/$RUNTIME_APPDIRECTORY`.
    File(PathBuf),
    /// An xDS server (`CONFIG_TYPE=GRPC_XDS_SOTW`), from the [`XDS`]
    /// variables.
    Xds,
}

/// The config source `CONFIG_TYPE` selects (default `FILE`). The one place
/// a new source (xDS) is added.
///
/// # Errors
/// [`GoEnvError`] for an unknown value.
pub fn config_source(env: &Env) -> Result<ConfigSource, GoEnvError> {
    let get = |k: &str| env.get(k).map(String::as_str);
    match get("CONFIG_TYPE")
        .unwrap_or("FILE")
        .to_ascii_uppercase()
        .as_str()
    {
        "FILE" => {
            // The Go defaults; an empty value is the default too (envconfig).
            let root = get("RUNTIME_ROOT")
                .filter(|v| !v.is_empty())
                .unwrap_or("/srv/runtime_data/current");
            let sub = get("RUNTIME_SUBDIRECTORY").unwrap_or("");
            let app = get("RUNTIME_APPDIRECTORY")
                .filter(|v| !v.is_empty())
                .unwrap_or("config");
            Ok(ConfigSource::File(PathBuf::from(root).join(sub).join(app)))
        }
        "GRPC_XDS_SOTW" => Ok(ConfigSource::Xds),
        other => Err(refuse(
            "CONFIG_TYPE",
            format!("'{other}' is not a config type: FILE or GRPC_XDS_SOTW"),
        )),
    }
}

/// The outcome of [`map_env`]: `serve` flags and what was left aside.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Mapped {
    /// `serve` flags (`--flag`, `value`, ...), without `serve` itself.
    pub args: Vec<String>,
    /// For each flag set, the Go variable(s) it came from (for errors).
    pub sources: Vec<(String, String)>,
    /// Variables set that were accepted and ignored, in name order.
    pub ignored: Vec<String>,
    /// Variables set in a Go family but unknown here, in name order.
    pub unknown: Vec<String>,
    /// Notes to log at startup (behaviour that differs from the Go service).
    pub notes: Vec<String>,
}

impl Mapped {
    /// The flags for a log line: passwords replaced by `***`.
    #[must_use]
    pub fn shown(&self) -> String {
        let mut out = Vec::with_capacity(self.args.len());
        let mut prev = "";
        for a in &self.args {
            out.push(match prev {
                "--redis-master-password" => "***".to_owned(),
                "--redis-url" | "--redis-sentinel" | "--redis-cluster" => a
                    .split(',')
                    .map(crate::storage::redis::redact_url)
                    .collect::<Vec<_>>()
                    .join(","),
                "--otlp-endpoint" => crate::storage::redis::redact_url(a),
                // Extra xDS metadata often carries a token: names only.
                "--config-xds-headers" => a
                    .split(',')
                    .map(|h| {
                        h.split_once(':')
                            .map_or("***".to_owned(), |(k, _)| format!("{k}:***"))
                    })
                    .collect::<Vec<_>>()
                    .join(","),
                _ if a.is_empty() => "\"\"".to_owned(),
                _ => a.clone(),
            });
            prev = a;
        }
        out.join(" ")
    }

    /// Logs, once at startup, the flags the environment became, the
    /// variables accepted and ignored, the unknown ones and the notes.
    pub fn log_startup(&self) {
        tracing::info!(flags = %self.shown(), "started as ratelimit: settings from the Go service's environment variables");
        if !self.ignored.is_empty() {
            tracing::info!(variables = %self.ignored.join(", "), "accepted and ignored (Go service tuning, or read by a config source not in use)");
        }
        if !self.unknown.is_empty() {
            tracing::warn!(variables = %self.unknown.join(", "), "unknown variables, ignored");
        }
        for note in &self.notes {
            tracing::warn!("{note}");
        }
    }

    fn flag(&mut self, flag: &str, value: impl Into<String>, from: &str) {
        self.args.push(flag.to_owned());
        self.args.push(value.into());
        self.sources.push((flag.to_owned(), from.to_owned()));
    }
    fn switch(&mut self, flag: &str, from: &str) {
        self.args.push(flag.to_owned());
        self.sources.push((flag.to_owned(), from.to_owned()));
    }
}

/// Parses a Go `strconv.ParseBool` value (`1 t T TRUE true True`, `0 f F
/// FALSE false False`).
///
/// # Errors
/// [`GoEnvError`] naming `var` for anything else.
pub fn go_bool(var: &str, v: &str) -> Result<bool, GoEnvError> {
    match v {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(refuse(
            var,
            format!("'{v}' is not a boolean (true or false)"),
        )),
    }
}

/// Parses a Go `time.ParseDuration` value (`10s`, `1.5s`, `250ms`,
/// `1m30s`, `0`; units `ns`, `us`, `µs`, `ms`, `s`, `m`, `h`) into
/// milliseconds, rounded up to whole milliseconds.
///
/// # Errors
/// A message for a malformed value.
pub fn go_duration_ms(v: &str) -> Result<u64, String> {
    if v == "0" {
        return Ok(0);
    }
    let bad = || format!("'{v}' is not a duration (such as 250ms, 10s, 1m30s)");
    let mut rest = v;
    let mut total_ns: f64 = 0.0;
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let n = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        let number: f64 = rest[..n].parse().map_err(|_| bad())?;
        rest = &rest[n..];
        let u = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..u] {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3_600e9,
            _ => return Err(bad()),
        };
        total_ns += number * scale;
        rest = &rest[u..];
    }
    Ok((total_ns / 1e6).ceil() as u64)
}

/// Maps a logrus level name (case-insensitive) onto `--log-level`.
fn log_level(v: &str) -> Result<&'static str, GoEnvError> {
    Ok(match v.to_ascii_lowercase().as_str() {
        "trace" => "trace",
        "debug" => "debug",
        "info" => "info",
        "warn" | "warning" => "warn",
        "error" | "fatal" | "panic" => "error",
        _ => {
            return Err(refuse(
                "LOG_LEVEL",
                format!("'{v}' is not a level: trace, debug, info, warn, error, fatal or panic"),
            ));
        }
    })
}

/// `host:port` of a listen address, with an IPv6 host (`::`) in brackets
/// and an empty host meaning every IPv4 address, as Go's `net.Listen` does.
fn listen_addr(host: &str, port: &str) -> String {
    // `localhost` is the one host name the Go service's listeners commonly
    // get; the flags take addresses.
    let host = match host {
        "" => "0.0.0.0",
        "localhost" => "127.0.0.1",
        h => h,
    };
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Percent-encodes a user name or password for a URL's user info.
fn userinfo(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// `redis://` (or `rediss://` with `tls`) URL for a `REDIS_URL` element,
/// with `auth` (`password` or `user:password`) as its user info. An element
/// that already has a scheme is kept as given.
fn redis_url(addr: &str, tls: bool, auth: Option<&str>) -> String {
    if addr.contains("://") {
        return addr.to_owned();
    }
    let scheme = if tls { "rediss" } else { "redis" };
    match auth.filter(|a| !a.is_empty()) {
        None => format!("{scheme}://{addr}"),
        Some(a) => match a.split_once(':') {
            Some((user, pw)) => format!("{scheme}://{}:{}@{addr}", userinfo(user), userinfo(pw)),
            None => format!("{scheme}://:{}@{addr}", userinfo(a)),
        },
    }
}

/// Maps `env` onto `serve` flags (see the module doc).
///
/// # Errors
/// [`GoEnvError`] for the first variable refused.
pub fn map_env(env: &Env) -> Result<Mapped, GoEnvError> {
    let get = |k: &str| env.get(k).map(String::as_str);
    let flag_bool = |k: &str| get(k).map_or(Ok(false), |v| go_bool(k, v));
    let mut m = Mapped::default();

    // Refused features first: they decide whether anything else matters.
    if let Some(b) = get("BACKEND_TYPE")
        && !b.eq_ignore_ascii_case("redis")
    {
        return Err(refuse(
            "BACKEND_TYPE",
            format!(
                "'{b}' is not supported: bucket-rls keeps its buckets in Redis (BACKEND_TYPE=redis)"
            ),
        ));
    }
    if flag_bool("USE_STATSD")? {
        return Err(refuse(
            "USE_STATSD",
            "statsd is not supported: set USE_STATSD=false and scrape Prometheus (USE_PROMETHEUS=true)",
        ));
    }
    if flag_bool("REDIS_PERSECOND")? {
        return Err(refuse(
            "REDIS_PERSECOND",
            "a second Redis for per-second limits is not supported: one Redis holds every bucket",
        ));
    }
    if get("GRPC_UDS").is_some_and(|v| !v.is_empty()) {
        return Err(refuse(
            "GRPC_UDS",
            "a gRPC Unix socket is not supported: use GRPC_HOST and GRPC_PORT",
        ));
    }
    if get("REDIS_SOCKET_TYPE").is_some_and(|v| !v.eq_ignore_ascii_case("tcp")) {
        return Err(refuse(
            "REDIS_SOCKET_TYPE",
            "only tcp is supported (a Unix socket Redis is not): set REDIS_SOCKET_TYPE=tcp and REDIS_URL=host:port",
        ));
    }
    if flag_bool("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION")? {
        return Err(refuse(
            "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
            "skipping certificate verification is not supported: give the CA with REDIS_TLS_CACERT and address Redis by a name its certificate carries",
        ));
    }

    match config_source(env)? {
        ConfigSource::File(dir) => m.flag("--config", dir.to_string_lossy(), "RUNTIME_ROOT"),
        ConfigSource::Xds => map_xds(env, &mut m)?,
    }
    map_tracing(env, &mut m)?;
    if flag_bool("MERGE_DOMAIN_CONFIG")? {
        m.switch("--merge-domain-config", "MERGE_DOMAIN_CONFIG");
    }

    let port = |k: &str, default: &'static str| get(k).filter(|v| !v.is_empty()).unwrap_or(default);
    m.flag(
        "--http-addr",
        listen_addr(get("HOST").unwrap_or(""), port("PORT", "8080")),
        "HOST/PORT",
    );
    m.flag(
        "--grpc-addr",
        listen_addr(get("GRPC_HOST").unwrap_or(""), port("GRPC_PORT", "8081")),
        "GRPC_HOST/GRPC_PORT",
    );
    m.flag(
        "--debug-addr",
        listen_addr(get("DEBUG_HOST").unwrap_or(""), port("DEBUG_PORT", "6070")),
        "DEBUG_HOST/DEBUG_PORT",
    );

    if flag_bool("GRPC_SERVER_USE_TLS")? {
        let need = |k: &str| {
            get(k).filter(|v| !v.is_empty()).ok_or_else(|| {
                refuse(
                    k,
                    "GRPC_SERVER_USE_TLS=true needs GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY",
                )
            })
        };
        m.flag(
            "--grpc-tls-cert",
            need("GRPC_SERVER_TLS_CERT")?,
            "GRPC_SERVER_TLS_CERT",
        );
        m.flag(
            "--grpc-tls-key",
            need("GRPC_SERVER_TLS_KEY")?,
            "GRPC_SERVER_TLS_KEY",
        );
        if let Some(ca) = get("GRPC_CLIENT_TLS_CACERT").filter(|v| !v.is_empty()) {
            m.flag("--grpc-tls-client-ca", ca, "GRPC_CLIENT_TLS_CACERT");
            if let Some(san) = get("GRPC_CLIENT_TLS_SAN").filter(|v| !v.is_empty()) {
                m.flag("--grpc-tls-client-san", san, "GRPC_CLIENT_TLS_SAN");
            }
        }
    }

    // The Go default is WARN.
    m.flag(
        "--log-level",
        log_level(get("LOG_LEVEL").unwrap_or("warn"))?,
        "LOG_LEVEL",
    );
    if let Some(f) = get("LOG_FORMAT") {
        match f.to_ascii_lowercase().as_str() {
            "text" | "" => {}
            "json" => m.flag("--log-format", "json", "LOG_FORMAT"),
            _ => {
                return Err(refuse(
                    "LOG_FORMAT",
                    format!("'{f}' is not a format: text or json"),
                ));
            }
        }
    }

    map_redis(env, &mut m)?;

    if let Some(v) = get("NEAR_LIMIT_RATIO") {
        m.flag("--near-limit-ratio", v, "NEAR_LIMIT_RATIO");
    }
    if flag_bool("LIMIT_RESPONSE_HEADERS_ENABLED")? {
        m.flag(
            "--rate-limit-headers",
            "go",
            "LIMIT_RESPONSE_HEADERS_ENABLED",
        );
        for (var, flag) in [
            ("LIMIT_LIMIT_HEADER", "--limit-header-name"),
            ("LIMIT_REMAINING_HEADER", "--remaining-header-name"),
            ("LIMIT_RESET_HEADER", "--reset-header-name"),
        ] {
            if let Some(v) = get(var).filter(|v| !v.is_empty()) {
                m.flag(flag, v, var);
            }
        }
    }
    for (var, flag) in [
        ("SHADOW_MODE", "--shadow-mode"),
        ("QUOTA_MODE", "--quota-mode"),
        ("RESPONSE_DYNAMIC_METADATA", "--response-dynamic-metadata"),
    ] {
        if flag_bool(var)? {
            m.switch(flag, var);
        }
    }

    m.flag(
        "--health-mode",
        "go",
        "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
    );
    if flag_bool("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED")? {
        m.switch(
            "--health-require-config",
            "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
        );
    }

    if flag_bool("USE_PROMETHEUS")? {
        let addr = get("PROMETHEUS_ADDR")
            .filter(|v| !v.is_empty())
            .unwrap_or(":9090");
        let (host, port) = addr.rsplit_once(':').ok_or_else(|| {
            refuse(
                "PROMETHEUS_ADDR",
                format!("'{addr}' is not host:port (such as :19001)"),
            )
        })?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        m.flag(
            "--go-metrics-addr",
            listen_addr(host, port),
            "PROMETHEUS_ADDR",
        );
        if let Some(p) = get("PROMETHEUS_PATH").filter(|v| !v.is_empty()) {
            m.flag("--go-metrics-path", p, "PROMETHEUS_PATH");
        }
    } else if get("USE_STATSD").is_none() {
        m.notes.push(
            "USE_STATSD is not set (the Go default is true): no statsd sink; metrics are on the admin port's /metrics".into(),
        );
    }

    for name in env.keys() {
        let n = name.as_str();
        if MAPPED.contains(&n) || n == "GRPC_UDS" {
            continue;
        }
        if IGNORED.contains(&n)
            || XDS.contains(&n)
            || n.starts_with("REDIS_PERSECOND_")
            || n.starts_with("OTEL_")
        {
            m.ignored.push(name.clone());
        } else if FAMILIES.iter().any(|f| n.starts_with(f)) {
            m.unknown.push(name.clone());
        }
    }
    Ok(m)
}

/// The xDS variables ([`XDS`]) onto the `--config-xds*` flags, with the Go
/// service's defaults: server `localhost:18000`, reconnect backoff 10 s
/// doubling to 60 s with a random factor of 0.5, and waiting for the first
/// config unless `FORCE_START_WITHOUT_INITIAL_CONFIG=true`.
fn map_xds(env: &Env, m: &mut Mapped) -> Result<(), GoEnvError> {
    let get = |k: &str| env.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
    let flag_bool = |k: &str| get(k).map_or(Ok(false), |v| go_bool(k, v));
    let ms = |k: &str, default_ms: u64| -> Result<String, GoEnvError> {
        get(k).map_or(Ok(default_ms.to_string()), |v| {
            go_duration_ms(v)
                .map(|n| n.max(1).to_string())
                .map_err(|e| refuse(k, e))
        })
    };
    m.flag(
        "--config-xds",
        get("CONFIG_GRPC_XDS_SERVER_URL").unwrap_or("localhost:18000"),
        "CONFIG_GRPC_XDS_SERVER_URL",
    );
    for (var, flag) in [
        ("CONFIG_GRPC_XDS_NODE_ID", "--config-xds-node-id"),
        (
            "CONFIG_GRPC_XDS_NODE_METADATA",
            "--config-xds-node-metadata",
        ),
        (
            "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
            "--config-xds-headers",
        ),
    ] {
        if let Some(v) = get(var) {
            m.flag(flag, v, var);
        }
    }
    if flag_bool("CONFIG_GRPC_XDS_SERVER_USE_TLS")? {
        m.switch("--config-xds-tls", "CONFIG_GRPC_XDS_SERVER_USE_TLS");
        for (var, flag) in [
            ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "--config-xds-tls-cert"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "--config-xds-tls-key"),
            ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "--config-xds-tls-ca"),
            (
                "CONFIG_GRPC_XDS_SERVER_TLS_SAN",
                "--config-xds-tls-server-name",
            ),
        ] {
            if let Some(v) = get(var) {
                m.flag(flag, v, var);
            }
        }
    }
    // The Go service's first connection retries every
    // CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL; later reconnects back
    // off from XDS_CLIENT_BACKOFF_INITIAL_INTERVAL. One backoff here starts
    // from the latter, or the former when only it is set.
    let initial = if get("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL").is_none()
        && get("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL").is_some()
    {
        ms("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", 3_000)?
    } else {
        ms("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", 10_000)?
    };
    m.flag(
        "--config-xds-backoff-initial-ms",
        initial,
        "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL",
    );
    m.flag(
        "--config-xds-backoff-max-ms",
        ms("XDS_CLIENT_BACKOFF_MAX_INTERVAL", 60_000)?,
        "XDS_CLIENT_BACKOFF_MAX_INTERVAL",
    );
    if get("XDS_CLIENT_BACKOFF_JITTER").is_some() && !flag_bool("XDS_CLIENT_BACKOFF_JITTER")? {
        m.flag(
            "--config-xds-backoff-jitter",
            "0",
            "XDS_CLIENT_BACKOFF_JITTER",
        );
    } else {
        m.flag(
            "--config-xds-backoff-jitter",
            get("XDS_CLIENT_BACKOFF_RANDOM_FACTOR").unwrap_or("0.5"),
            "XDS_CLIENT_BACKOFF_RANDOM_FACTOR",
        );
    }
    if let Some(v) = get("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES") {
        m.flag(
            "--config-xds-max-message-bytes",
            v,
            "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES",
        );
    }
    if !flag_bool("FORCE_START_WITHOUT_INITIAL_CONFIG")? {
        m.switch(
            "--config-xds-wait-for-config",
            "FORCE_START_WITHOUT_INITIAL_CONFIG",
        );
    }
    Ok(())
}

/// The Go service's tracing variables onto `--otlp-endpoint` and friends:
/// `TRACING_ENABLED=true` exports to `OTEL_EXPORTER_OTLP_ENDPOINT` (Go's
/// default `http://localhost:4318`) as `TRACING_SERVICE_NAME` (default
/// `RateLimit`) at `TRACING_SAMPLING_RATE` (default 1). Only OTLP over HTTP
/// is exported: `TRACING_EXPORTER_PROTOCOL=grpc` is refused. Tracing off
/// overrides an `OTEL_EXPORTER_OTLP_ENDPOINT` in the environment, as in the
/// Go service.
fn map_tracing(env: &Env, m: &mut Mapped) -> Result<(), GoEnvError> {
    let get = |k: &str| env.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
    if !get("TRACING_ENABLED").map_or(Ok(false), |v| go_bool("TRACING_ENABLED", v))? {
        m.flag("--otlp-endpoint", "", "TRACING_ENABLED");
        return Ok(());
    }
    if let Some(p) = get("TRACING_EXPORTER_PROTOCOL")
        && !p.eq_ignore_ascii_case("http")
    {
        return Err(refuse(
            "TRACING_EXPORTER_PROTOCOL",
            format!("'{p}' is not supported: spans are exported over OTLP/HTTP (set http)"),
        ));
    }
    let endpoint = get("OTEL_EXPORTER_OTLP_ENDPOINT").unwrap_or("http://localhost:4318");
    let endpoint = if endpoint.contains("://") {
        endpoint.to_owned()
    } else {
        format!("http://{endpoint}")
    };
    m.flag("--otlp-endpoint", endpoint, "OTEL_EXPORTER_OTLP_ENDPOINT");
    m.flag(
        "--tracing-service-name",
        get("TRACING_SERVICE_NAME").unwrap_or("RateLimit"),
        "TRACING_SERVICE_NAME",
    );
    if let Some(r) = get("TRACING_SAMPLING_RATE") {
        m.flag("--tracing-sampling-rate", r, "TRACING_SAMPLING_RATE");
    }
    Ok(())
}

/// The Redis variables: `REDIS_TYPE`, `REDIS_URL`, credentials, TLS,
/// timeout, key prefix, local cache.
fn map_redis(env: &Env, m: &mut Mapped) -> Result<(), GoEnvError> {
    let get = |k: &str| env.get(k).map(String::as_str);
    let tls = get("REDIS_TLS").map_or(Ok(false), |v| go_bool("REDIS_TLS", v))?;
    let auth = get("REDIS_AUTH");
    let Some(url) = get("REDIS_URL").filter(|v| !v.is_empty()) else {
        m.notes.push(
            "REDIS_URL is not set: buckets are kept in this process (the memory backend), not shared between replicas".into(),
        );
        return Ok(());
    };
    let items: Vec<&str> = url
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    match get("REDIS_TYPE")
        .unwrap_or("SINGLE")
        .to_ascii_uppercase()
        .as_str()
    {
        "SINGLE" | "" => {
            if items.len() != 1 {
                return Err(refuse(
                    "REDIS_URL",
                    "REDIS_TYPE=SINGLE takes one host:port; a comma list needs REDIS_TYPE=SENTINEL or CLUSTER",
                ));
            }
            m.flag("--redis-url", redis_url(items[0], tls, auth), "REDIS_URL");
        }
        "CLUSTER" => {
            let nodes: Vec<String> = items.iter().map(|a| redis_url(a, tls, auth)).collect();
            m.flag("--redis-cluster", nodes.join(","), "REDIS_URL");
        }
        "SENTINEL" => {
            let [master, sentinels @ ..] = items.as_slice() else {
                return Err(refuse("REDIS_URL", "empty"));
            };
            if sentinels.is_empty() {
                return Err(refuse(
                    "REDIS_URL",
                    "REDIS_TYPE=SENTINEL takes the master name first, then the Sentinels: mymaster,host:port,...",
                ));
            }
            let sentinel_auth = get("REDIS_SENTINEL_AUTH");
            let urls: Vec<String> = sentinels
                .iter()
                .map(|a| redis_url(a, tls, sentinel_auth))
                .collect();
            m.flag("--redis-sentinel", urls.join(","), "REDIS_URL");
            m.flag("--redis-master-name", *master, "REDIS_URL");
            if let Some(a) = auth.filter(|a| !a.is_empty()) {
                match a.split_once(':') {
                    Some((user, pw)) => {
                        m.flag("--redis-master-username", user, "REDIS_AUTH");
                        m.flag("--redis-master-password", pw, "REDIS_AUTH");
                    }
                    None => m.flag("--redis-master-password", a, "REDIS_AUTH"),
                }
            }
        }
        other => {
            return Err(refuse(
                "REDIS_TYPE",
                format!("'{other}' is not a Redis type: SINGLE, SENTINEL or CLUSTER"),
            ));
        }
    }
    if let Some(ca) = get("REDIS_TLS_CACERT").filter(|v| !v.is_empty()) {
        m.flag("--redis-tls-ca-file", ca, "REDIS_TLS_CACERT");
    }
    match (get("REDIS_TLS_CLIENT_CERT"), get("REDIS_TLS_CLIENT_KEY")) {
        (Some(c), Some(k)) if !c.is_empty() && !k.is_empty() => {
            m.flag("--redis-tls-client-cert", c, "REDIS_TLS_CLIENT_CERT");
            m.flag("--redis-tls-client-key", k, "REDIS_TLS_CLIENT_KEY");
        }
        (None, None) => {}
        _ => {
            return Err(refuse(
                "REDIS_TLS_CLIENT_CERT/REDIS_TLS_CLIENT_KEY",
                "give both or neither",
            ));
        }
    }
    if let Some(t) = get("REDIS_TIMEOUT").filter(|v| !v.is_empty()) {
        let ms = go_duration_ms(t).map_err(|e| refuse("REDIS_TIMEOUT", e))?;
        m.flag("--redis-timeout", ms.to_string(), "REDIS_TIMEOUT");
    }
    if let Some(p) = get("CACHE_KEY_PREFIX") {
        m.args.push(format!("--redis-key-prefix={p}"));
        m.sources
            .push(("--redis-key-prefix".into(), "CACHE_KEY_PREFIX".into()));
    }
    if let Some(b) = get("LOCAL_CACHE_SIZE_IN_BYTES").filter(|v| !v.is_empty()) {
        let bytes: u64 = b.parse().map_err(|_| {
            refuse(
                "LOCAL_CACHE_SIZE_IN_BYTES",
                format!("'{b}' is not a byte count"),
            )
        })?;
        let entries = if bytes == 0 {
            0
        } else {
            (bytes / LOCAL_CACHE_BYTES_PER_ENTRY).max(1)
        };
        m.flag(
            "--local-cache-size",
            entries.to_string(),
            "LOCAL_CACHE_SIZE_IN_BYTES",
        );
    }
    Ok(())
}

/// The `serve` flags of `env` parsed by the command line's own definition
/// (so the values are checked by the same parsers), with what
/// [`map_env`] left aside. `BUCKET_RLS_*` variables of the process fill
/// flags the Go environment does not give.
///
/// # Errors
/// [`GoEnvError`] for a refused variable, or a value the flag refuses
/// (naming the variable it came from).
pub fn serve_args(env: &Env) -> Result<(ServeArgs, Mapped), GoEnvError> {
    let mapped = map_env(env)?;
    let argv = ["ratelimit", "serve"]
        .into_iter()
        .map(str::to_owned)
        .chain(mapped.args.iter().cloned());
    match Cli::try_parse_from(argv) {
        Ok(Cli {
            command: Command::Serve(args),
        }) => Ok((*args, mapped)),
        Ok(_) => Err(refuse("(arguments)", "not a serve command")),
        Err(e) => {
            let text = e.to_string();
            let first = text.lines().next().unwrap_or_default().to_owned();
            let var = mapped
                .sources
                .iter()
                .filter(|(flag, _)| first.contains(flag.as_str()))
                .max_by_key(|(flag, _)| flag.len())
                .map_or_else(|| "(environment)".to_owned(), |(_, v)| v.clone());
            Err(refuse(&var, first.trim_start_matches("error: ").to_owned()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::{Backend, HealthMode, MasterAuth, Settings};

    fn env(pairs: &[(&str, &str)]) -> Env {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn settings(pairs: &[(&str, &str)]) -> Settings {
        let (args, _) = serve_args(&env(pairs)).expect("maps");
        Settings::try_from(&args).expect("settings")
    }

    /// The variables Envoy Gateway sets in file mode (its xDS variables
    /// left aside), with Redis and Prometheus.
    const EG: &[(&str, &str)] = &[
        ("RUNTIME_ROOT", "/data"),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("RUNTIME_IGNOREDOTFILES", "true"),
        ("RUNTIME_WATCH_ROOT", "false"),
        ("LOG_LEVEL", "info"),
        ("USE_STATSD", "false"),
        ("GRPC_SERVER_USE_TLS", "true"),
        ("GRPC_SERVER_TLS_CERT", "/certs/tls.crt"),
        ("GRPC_SERVER_TLS_KEY", "/certs/tls.key"),
        ("GRPC_SERVER_TLS_CA_CERT", "/certs/ca.crt"),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", "redis.redis-system.svc.cluster.local:6379"),
        ("USE_PROMETHEUS", "true"),
        ("PROMETHEUS_ADDR", ":19001"),
        ("PROMETHEUS_MAPPER_YAML", "/etc/statsd-exporter/conf.yaml"),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
    ];

    #[test]
    fn envoy_gateways_xds_environment_gives_mtls_xds_settings_with_go_defaults() {
        use crate::config::xds::{Backoff, XdsTls};
        use std::time::Duration;
        let mut vars = EG.to_vec();
        vars.extend([
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
            ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/certs/tls.crt"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "/certs/tls.key"),
            ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/certs/ca.crt"),
        ]);
        let s = settings(&vars);
        let crate::settings::ConfigSource::Xds(x) = &s.config else {
            panic!("not xDS: {:?}", s.config);
        };
        assert_eq!(x.host_port().unwrap(), ("envoy-gateway".into(), 18001));
        assert_eq!(x.node_id, "envoy-ratelimit");
        assert!(
            x.start_without_config,
            "FORCE_START_WITHOUT_INITIAL_CONFIG=true"
        );
        assert_eq!(
            x.tls,
            Some(XdsTls {
                client_cert: Some("/certs/tls.crt".into()),
                client_key: Some("/certs/tls.key".into()),
                ca_cert: Some("/certs/ca.crt".into()),
                server_name: None,
            })
        );
        // The Go service's defaults.
        assert_eq!(
            x.backoff,
            Backoff {
                initial: Duration::from_secs(10),
                max: Duration::from_secs(60),
                jitter: 0.5
            }
        );
        assert_eq!(x.max_message_bytes, 4 << 20);
    }

    #[test]
    fn go_xds_variables_for_metadata_headers_backoff_and_size_are_read() {
        use crate::config::xds::Backoff;
        use std::time::Duration;
        let s = settings(&[
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            ("CONFIG_GRPC_XDS_NODE_METADATA", "zone=a,broken,team=rl"),
            (
                "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
                "X-Token:abc,x-env:prod",
            ),
            ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "250ms"),
            ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "1m30s"),
            ("XDS_CLIENT_BACKOFF_JITTER", "false"),
            ("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", "16777216"),
            ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "false"),
        ]);
        let crate::settings::ConfigSource::Xds(x) = &s.config else {
            panic!("not xDS: {:?}", s.config);
        };
        assert_eq!(x.server, "localhost:18000");
        assert_eq!(x.node_id, "default");
        assert_eq!(
            x.node_metadata,
            vec![("zone".into(), "a".into()), ("team".into(), "rl".into())]
        );
        assert_eq!(
            x.headers,
            vec![
                ("x-token".into(), "abc".into()),
                ("x-env".into(), "prod".into())
            ]
        );
        assert_eq!(
            x.backoff,
            Backoff {
                initial: Duration::from_millis(250),
                max: Duration::from_secs(90),
                jitter: 0.0
            }
        );
        assert_eq!(x.max_message_bytes, 16 << 20);
        assert!(
            !x.start_without_config,
            "the Go default waits for the first config"
        );
        assert_eq!(x.tls, None);
        for (k, v) in [
            ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "ten"),
            ("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", "0"),
            ("FORCE_START_WITHOUT_INITIAL_CONFIG", "yes please"),
            ("XDS_CLIENT_BACKOFF_RANDOM_FACTOR", "2"),
        ] {
            let e = serve_args(&env(&[("CONFIG_TYPE", "GRPC_XDS_SOTW"), (k, v)])).unwrap_err();
            assert_eq!(e.var, k, "{e}");
        }
    }

    #[test]
    fn the_startup_log_hides_xds_header_values_and_endpoint_passwords() {
        let (_, m) = serve_args(&env(&[
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            (
                "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
                "authorization:Bearer SECRET1,x-api-key:SECRET2",
            ),
            ("TRACING_ENABLED", "true"),
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                "http://user:SECRET3@127.0.0.1:4318",
            ),
        ]))
        .expect("maps");
        let shown = m.shown();
        for secret in ["SECRET1", "SECRET2", "SECRET3"] {
            assert!(!shown.contains(secret), "{shown}");
        }
        assert!(
            shown.contains("--config-xds-headers authorization:***,x-api-key:***"),
            "{shown}"
        );
        assert!(
            shown.contains("--otlp-endpoint http://user:***@127.0.0.1:4318"),
            "{shown}"
        );
    }

    #[test]
    fn go_tracing_variables_turn_otlp_export_on_or_off() {
        let on = settings(&[
            ("TRACING_ENABLED", "true"),
            ("TRACING_SERVICE_NAME", "rl"),
            ("TRACING_SAMPLING_RATE", "0.25"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318"),
        ]);
        assert_eq!(
            on.tracing,
            crate::otel::TracingSettings {
                otlp_endpoint: Some("http://collector:4318".into()),
                service_name: "rl".into(),
                sampling_rate: 0.25,
            }
        );
        let off = settings(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")]);
        assert_eq!(
            off.tracing.otlp_endpoint, None,
            "TRACING_ENABLED unset: off"
        );
    }

    #[test]
    fn envoy_gateways_environment_gives_the_same_settings_as_the_flags() {
        let from_env = settings(EG);
        let cli = Cli::try_parse_from([
            "bucket-rls",
            "serve",
            "--config",
            "/data/ratelimit/config",
            "--grpc-addr",
            "0.0.0.0:8081",
            "--http-addr",
            "0.0.0.0:8080",
            "--debug-addr",
            "0.0.0.0:6070",
            "--grpc-tls-cert",
            "/certs/tls.crt",
            "--grpc-tls-key",
            "/certs/tls.key",
            "--redis-url",
            "redis://redis.redis-system.svc.cluster.local:6379",
            "--health-mode",
            "go",
            "--go-metrics-addr",
            "0.0.0.0:19001",
        ])
        .expect("flags");
        let Command::Serve(args) = cli.command else {
            panic!("serve")
        };
        let from_flags = Settings::try_from(&*args).expect("settings");
        assert_eq!(format!("{from_env:?}"), format!("{from_flags:?}"));
        assert_eq!(
            from_env.health,
            HealthMode::Go {
                require_config: false
            }
        );
    }

    #[test]
    fn ipv6_any_hosts_are_bracketed_as_istio_sets_them() {
        let s = settings(&[("HOST", "::"), ("GRPC_HOST", "::"), ("DEBUG_PORT", "7000")]);
        assert_eq!(s.http_addr, "[::]:8080".parse().expect("addr"));
        assert_eq!(s.grpc_addr, "[::]:8081".parse().expect("addr"));
        assert_eq!(s.debug_addr, Some("0.0.0.0:7000".parse().expect("addr")));
        assert_eq!(
            s.config,
            crate::settings::ConfigSource::File(PathBuf::from("/srv/runtime_data/current/config"))
        );
    }

    #[test]
    fn go_durations_become_milliseconds() {
        assert_eq!(go_duration_ms("10s"), Ok(10_000));
        assert_eq!(go_duration_ms("250ms"), Ok(250));
        assert_eq!(go_duration_ms("1.5s"), Ok(1_500));
        assert_eq!(go_duration_ms("1m30s"), Ok(90_000));
        assert_eq!(go_duration_ms("500us"), Ok(1));
        assert!(go_duration_ms("10").is_err());
        assert!(go_duration_ms("ten seconds").is_err());
        let s = settings(&[("REDIS_URL", "h:1"), ("REDIS_TIMEOUT", "2s")]);
        assert_eq!(
            s.backend.redis().expect("redis").timeout,
            std::time::Duration::from_millis(2_000)
        );
        let e = serve_args(&env(&[("REDIS_URL", "h:1"), ("REDIS_TIMEOUT", "2h")])).unwrap_err();
        assert_eq!(e.var, "REDIS_TIMEOUT", "{e}");
    }

    #[test]
    fn logrus_level_names_map_onto_log_levels() {
        for (go, ours) in [
            ("WARNING", "warn"),
            ("Info", "info"),
            ("fatal", "error"),
            ("panic", "error"),
            ("trace", "trace"),
        ] {
            let (args, _) = serve_args(&env(&[("LOG_LEVEL", go)])).expect("maps");
            assert_eq!(args.log_level, ours, "{go}");
        }
        let (args, _) = serve_args(&env(&[])).expect("maps");
        assert_eq!(args.log_level, "warn", "the Go default");
        assert_eq!(
            serve_args(&env(&[("LOG_LEVEL", "verbose")]))
                .unwrap_err()
                .var,
            "LOG_LEVEL"
        );
    }

    #[test]
    fn redis_types_map_onto_the_three_topologies_with_credentials() {
        let s = settings(&[
            ("REDIS_URL", "h:1"),
            ("REDIS_AUTH", "u:p@ss"),
            ("REDIS_TLS", "true"),
        ]);
        assert!(
            matches!(&s.backend, Backend::Redis { url, .. } if url == "rediss://u:p%40ss@h:1"),
            "{:?}",
            s.backend
        );
        let s = settings(&[
            ("REDIS_TYPE", "sentinel"),
            ("REDIS_URL", "mymaster,s1:26379,s2:26379"),
            ("REDIS_AUTH", "pw"),
            ("REDIS_SENTINEL_AUTH", "spw"),
        ]);
        match &s.backend {
            Backend::Sentinel {
                sentinels,
                master_name,
                master_auth,
                ..
            } => {
                assert_eq!(
                    sentinels,
                    &["redis://:spw@s1:26379", "redis://:spw@s2:26379"]
                );
                assert_eq!(master_name, "mymaster");
                assert_eq!(
                    master_auth,
                    &MasterAuth {
                        username: None,
                        password: Some("pw".into())
                    }
                );
            }
            b => panic!("{b:?}"),
        }
        let s = settings(&[("REDIS_TYPE", "CLUSTER"), ("REDIS_URL", "a:1, b:2")]);
        assert!(
            matches!(&s.backend, Backend::Cluster { nodes, .. } if nodes == &["redis://a:1", "redis://b:2"]),
            "{:?}",
            s.backend
        );
        assert_eq!(
            serve_args(&env(&[("REDIS_URL", "a:1,b:2")]))
                .unwrap_err()
                .var,
            "REDIS_URL"
        );
        assert_eq!(
            serve_args(&env(&[("REDIS_TYPE", "sentinel"), ("REDIS_URL", "m")]))
                .unwrap_err()
                .var,
            "REDIS_URL"
        );
    }

    #[test]
    fn feature_variables_reach_the_same_settings_as_their_flags() {
        let s = settings(&[
            ("SHADOW_MODE", "true"),
            ("QUOTA_MODE", "1"),
            ("RESPONSE_DYNAMIC_METADATA", "True"),
            ("MERGE_DOMAIN_CONFIG", "t"),
            ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
            ("LIMIT_REMAINING_HEADER", "X-Left"),
            ("NEAR_LIMIT_RATIO", "0.5"),
            ("CACHE_KEY_PREFIX", ""),
            ("REDIS_URL", "h:1"),
            ("LOCAL_CACHE_SIZE_IN_BYTES", "1280"),
            ("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", "true"),
            ("PROMETHEUS_PATH", "/m"),
            ("USE_PROMETHEUS", "true"),
        ]);
        let v = &s.service;
        assert!(v.global_shadow_mode && v.global_quota_mode && v.response_dynamic_metadata);
        assert!(s.load.merge_domains);
        assert_eq!(v.rate_limit_headers, crate::settings::RateLimitHeaders::Go);
        assert_eq!(v.header_names.remaining, "X-Left");
        assert_eq!(v.header_names.limit, "RateLimit-Limit");
        assert!((v.near_limit_ratio - 0.5).abs() < f64::EPSILON);
        assert_eq!(v.key_prefix, "");
        assert_eq!(s.backend.redis().expect("redis").local_cache_size, 10);
        assert_eq!(
            s.health,
            HealthMode::Go {
                require_config: true
            }
        );
        let g = s.go_metrics.expect("prometheus");
        assert_eq!(
            (g.addr, g.path.as_str()),
            ("0.0.0.0:9090".parse().expect("addr"), "/m")
        );
    }

    #[test]
    fn every_refused_variable_gives_its_reason() {
        for (pairs, var, why) in [
            (
                &[("BACKEND_TYPE", "memcache")][..],
                "BACKEND_TYPE",
                "keeps its buckets in Redis",
            ),
            (
                &[("USE_STATSD", "true")][..],
                "USE_STATSD",
                "statsd is not supported",
            ),
            (
                &[("REDIS_PERSECOND", "true")][..],
                "REDIS_PERSECOND",
                "per-second",
            ),
            (&[("GRPC_UDS", "/tmp/s")][..], "GRPC_UDS", "Unix socket"),
            (
                &[("REDIS_SOCKET_TYPE", "unix")][..],
                "REDIS_SOCKET_TYPE",
                "only tcp",
            ),
            (
                &[("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", "true")][..],
                "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
                "REDIS_TLS_CACERT",
            ),
            (
                &[
                    ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
                    ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "soon"),
                ][..],
                "XDS_CLIENT_BACKOFF_MAX_INTERVAL",
                "not a duration",
            ),
            (
                &[
                    ("TRACING_ENABLED", "true"),
                    ("TRACING_EXPORTER_PROTOCOL", "grpc"),
                ][..],
                "TRACING_EXPORTER_PROTOCOL",
                "OTLP/HTTP",
            ),
            (
                &[("REDIS_TYPE", "ring")][..],
                "REDIS_TYPE",
                "SINGLE, SENTINEL or CLUSTER",
            ),
            (
                &[("GRPC_SERVER_USE_TLS", "true")][..],
                "GRPC_SERVER_TLS_CERT",
                "needs",
            ),
            (
                &[("SHADOW_MODE", "yes")][..],
                "SHADOW_MODE",
                "not a boolean",
            ),
            (
                &[("NEAR_LIMIT_RATIO", "2")][..],
                "NEAR_LIMIT_RATIO",
                "not between 0 and 1",
            ),
        ] {
            let mut e = env(pairs);
            // The variables that a refusal depends on.
            if var == "REDIS_TYPE" {
                e.insert("REDIS_URL".into(), "h:1".into());
            }
            let err = serve_args(&e).unwrap_err();
            assert_eq!(err.var, var, "{pairs:?}: {err}");
            assert!(err.reason.contains(why), "{pairs:?}: {err}");
        }
    }

    #[test]
    fn the_logged_flags_show_no_password() {
        for pairs in [
            &[("REDIS_URL", "h:1"), ("REDIS_AUTH", "s3cret")][..],
            &[
                ("REDIS_TYPE", "SENTINEL"),
                ("REDIS_URL", "m,h:1"),
                ("REDIS_AUTH", "u:s3cret"),
                ("REDIS_SENTINEL_AUTH", "s3cret"),
            ][..],
        ] {
            let m = map_env(&env(pairs)).expect("maps");
            let shown = m.shown();
            assert!(
                !shown.contains("s3cret") && shown.contains("***"),
                "{shown}"
            );
        }
    }

    #[test]
    fn tuning_and_xds_variables_are_ignored_and_unknown_ones_named() {
        let (_, m) = serve_args(&env(&[
            ("REDIS_POOL_SIZE", "20"),
            ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
            ("MEMCACHE_HOST_PORT", "memcached:11211"),
            ("REDIS_NO_SUCH_THING", "1"),
            ("PATH", "/bin"),
        ]))
        .expect("maps");
        assert_eq!(
            m.ignored,
            [
                "CONFIG_GRPC_XDS_SERVER_URL",
                "MEMCACHE_HOST_PORT",
                "REDIS_POOL_SIZE"
            ]
        );
        assert_eq!(m.unknown, ["REDIS_NO_SUCH_THING"]);
    }
}
