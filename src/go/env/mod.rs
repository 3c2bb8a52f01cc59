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

mod names;
#[cfg(test)]
mod tests;
mod values;

pub use names::{FAMILIES, IGNORED, MAPPED, XDS};
pub use values::{go_bool, go_duration_ms};

use crate::cli::serve_args::flag;
use crate::cli::{Cli, Command, ServeArgs};
use clap::Parser as _;
use std::collections::BTreeMap;
use std::path::PathBuf;
use values::{listen_addr, log_level, redis_url};

/// An environment: variable name to value.
pub type Env = BTreeMap<String, String>;

/// Whether the process was started as `ratelimit` (the Go service's binary
/// name, `/bin/ratelimit` in the image) with no arguments; `args` are the
/// process arguments, the program name first.
pub fn started_as_ratelimit(mut args: impl Iterator<Item = std::ffi::OsString>) -> bool {
    let name = args.next().map(PathBuf::from);
    let base = name.as_deref().and_then(std::path::Path::file_name);
    base.is_some_and(|b| b == "ratelimit") && args.next().is_none()
}

/// The process environment as an [`Env`]. Names or values that are not
/// UTF-8 cannot be Go service settings and are left out.
#[must_use]
pub fn process_env() -> Env {
    std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect()
}

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
    /// For each flag set (`--flag`), the Go variable(s) it came from (for
    /// errors).
    pub sources: Vec<(String, String)>,
    /// Variables set that were accepted and ignored, in name order.
    pub ignored: Vec<String>,
    /// Variables set in a Go family but unknown here, in name order.
    pub unknown: Vec<String>,
    /// Notes to log at startup (behaviour that differs from the Go service).
    pub notes: Vec<String>,
}

impl Mapped {
    /// The `serve` command the environment became, for a log line: one line
    /// that can be pasted into a shell (`bucket-rls serve --flag value ...`,
    /// each word quoted where the shell would split or expand it, an empty
    /// value as `''`), with passwords and tokens replaced by `***`.
    #[must_use]
    pub fn shown(&self) -> String {
        let mut out = Vec::with_capacity(self.args.len() + 2);
        out.push("bucket-rls".to_owned());
        out.push("serve".to_owned());
        let mut prev = "";
        for a in &self.args {
            let word = match prev.strip_prefix("--").unwrap_or_default() {
                flag::REDIS_MASTER_PASSWORD => "***".to_owned(),
                flag::REDIS_URL | flag::REDIS_SENTINEL | flag::REDIS_CLUSTER => a
                    .split(',')
                    .map(crate::storage::redis::redact_url)
                    .collect::<Vec<_>>()
                    .join(","),
                flag::OTLP_ENDPOINT => crate::storage::redis::redact_url(a),
                // Extra xDS metadata often carries a token: names only.
                flag::CONFIG_XDS_HEADERS => a
                    .split(',')
                    .map(|h| {
                        h.split_once(':')
                            .map_or("***".to_owned(), |(k, _)| format!("{k}:***"))
                    })
                    .collect::<Vec<_>>()
                    .join(","),
                _ => a.clone(),
            };
            out.push(shell_word(&word));
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

    /// Adds `--name value`, set from the variable(s) `from`.
    fn flag(&mut self, name: &str, value: impl Into<String>, from: &str) {
        self.switch(name, from);
        self.args.push(value.into());
    }

    /// Adds the switch `--name`, set from the variable(s) `from`.
    fn switch(&mut self, name: &str, from: &str) {
        let flag = format!("--{name}");
        self.args.push(flag.clone());
        self.sources.push((flag, from.to_owned()));
    }
}

/// `word` as one POSIX shell word: as it is when it holds only characters
/// the shell leaves alone, else in single quotes (a `'` inside as `'\''`).
fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./:,=@+%".contains(&b));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
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
        ConfigSource::File(dir) => m.flag(flag::CONFIG, dir.to_string_lossy(), "RUNTIME_ROOT"),
        ConfigSource::Xds => map_xds(env, &mut m)?,
    }
    map_tracing(env, &mut m)?;
    if flag_bool("MERGE_DOMAIN_CONFIG")? {
        m.switch(flag::MERGE_DOMAIN_CONFIG, "MERGE_DOMAIN_CONFIG");
    }

    let port = |k: &str, default: &'static str| get(k).filter(|v| !v.is_empty()).unwrap_or(default);
    m.flag(
        flag::HTTP_ADDR,
        listen_addr(get("HOST").unwrap_or(""), port("PORT", "8080")),
        "HOST/PORT",
    );
    m.flag(
        flag::GRPC_ADDR,
        listen_addr(get("GRPC_HOST").unwrap_or(""), port("GRPC_PORT", "8081")),
        "GRPC_HOST/GRPC_PORT",
    );
    m.flag(
        flag::DEBUG_ADDR,
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
            flag::GRPC_TLS_CERT,
            need("GRPC_SERVER_TLS_CERT")?,
            "GRPC_SERVER_TLS_CERT",
        );
        m.flag(
            flag::GRPC_TLS_KEY,
            need("GRPC_SERVER_TLS_KEY")?,
            "GRPC_SERVER_TLS_KEY",
        );
        if let Some(ca) = get("GRPC_CLIENT_TLS_CACERT").filter(|v| !v.is_empty()) {
            m.flag(flag::GRPC_TLS_CLIENT_CA, ca, "GRPC_CLIENT_TLS_CACERT");
            if let Some(san) = get("GRPC_CLIENT_TLS_SAN").filter(|v| !v.is_empty()) {
                m.flag(flag::GRPC_TLS_CLIENT_SAN, san, "GRPC_CLIENT_TLS_SAN");
            }
        }
    }

    // The Go default is WARN.
    m.flag(
        flag::LOG_LEVEL,
        log_level(get("LOG_LEVEL").unwrap_or("warn"))?,
        "LOG_LEVEL",
    );
    if let Some(f) = get("LOG_FORMAT") {
        match f.to_ascii_lowercase().as_str() {
            "text" | "" => {}
            "json" => m.flag(flag::LOG_FORMAT, "json", "LOG_FORMAT"),
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
        m.flag(flag::NEAR_LIMIT_RATIO, v, "NEAR_LIMIT_RATIO");
    }
    if flag_bool("LIMIT_RESPONSE_HEADERS_ENABLED")? {
        m.flag(
            flag::RATE_LIMIT_HEADERS,
            "go",
            "LIMIT_RESPONSE_HEADERS_ENABLED",
        );
        for (var, name) in [
            ("LIMIT_LIMIT_HEADER", flag::LIMIT_HEADER_NAME),
            ("LIMIT_REMAINING_HEADER", flag::REMAINING_HEADER_NAME),
            ("LIMIT_RESET_HEADER", flag::RESET_HEADER_NAME),
        ] {
            if let Some(v) = get(var).filter(|v| !v.is_empty()) {
                m.flag(name, v, var);
            }
        }
    }
    for (var, name) in [
        ("SHADOW_MODE", flag::SHADOW_MODE),
        ("QUOTA_MODE", flag::QUOTA_MODE),
        ("RESPONSE_DYNAMIC_METADATA", flag::RESPONSE_DYNAMIC_METADATA),
    ] {
        if flag_bool(var)? {
            m.switch(name, var);
        }
    }

    m.flag(
        flag::HEALTH_MODE,
        "go",
        "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
    );
    if flag_bool("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED")? {
        m.switch(
            flag::HEALTH_REQUIRE_CONFIG,
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
            flag::GO_METRICS_ADDR,
            listen_addr(host, port),
            "PROMETHEUS_ADDR",
        );
        if let Some(p) = get("PROMETHEUS_PATH").filter(|v| !v.is_empty()) {
            m.flag(flag::GO_METRICS_PATH, p, "PROMETHEUS_PATH");
        }
    } else if get("USE_STATSD").is_none() {
        m.notes.push(
            "USE_STATSD is not set (the Go default is true): no statsd sink; metrics are on the admin port's /metrics".into(),
        );
    }

    for name in env.keys() {
        let n = name.as_str();
        if MAPPED.contains(&n) || n == "GRPC_UDS" || names::is_grpc_library(n) {
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
        flag::CONFIG_XDS,
        get("CONFIG_GRPC_XDS_SERVER_URL").unwrap_or("localhost:18000"),
        "CONFIG_GRPC_XDS_SERVER_URL",
    );
    for (var, name) in [
        ("CONFIG_GRPC_XDS_NODE_ID", flag::CONFIG_XDS_NODE_ID),
        (
            "CONFIG_GRPC_XDS_NODE_METADATA",
            flag::CONFIG_XDS_NODE_METADATA,
        ),
        (
            "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
            flag::CONFIG_XDS_HEADERS,
        ),
    ] {
        if let Some(v) = get(var) {
            m.flag(name, v, var);
        }
    }
    if flag_bool("CONFIG_GRPC_XDS_SERVER_USE_TLS")? {
        m.switch(flag::CONFIG_XDS_TLS, "CONFIG_GRPC_XDS_SERVER_USE_TLS");
        for (var, name) in [
            ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", flag::CONFIG_XDS_TLS_CERT),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", flag::CONFIG_XDS_TLS_KEY),
            ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", flag::CONFIG_XDS_TLS_CA),
            (
                "CONFIG_GRPC_XDS_SERVER_TLS_SAN",
                flag::CONFIG_XDS_TLS_SERVER_NAME,
            ),
        ] {
            if let Some(v) = get(var) {
                m.flag(name, v, var);
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
        flag::CONFIG_XDS_BACKOFF_INITIAL_MS,
        initial,
        "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL",
    );
    m.flag(
        flag::CONFIG_XDS_BACKOFF_MAX_MS,
        ms("XDS_CLIENT_BACKOFF_MAX_INTERVAL", 60_000)?,
        "XDS_CLIENT_BACKOFF_MAX_INTERVAL",
    );
    if get("XDS_CLIENT_BACKOFF_JITTER").is_some() && !flag_bool("XDS_CLIENT_BACKOFF_JITTER")? {
        m.flag(
            flag::CONFIG_XDS_BACKOFF_JITTER,
            "0",
            "XDS_CLIENT_BACKOFF_JITTER",
        );
    } else {
        m.flag(
            flag::CONFIG_XDS_BACKOFF_JITTER,
            get("XDS_CLIENT_BACKOFF_RANDOM_FACTOR").unwrap_or("0.5"),
            "XDS_CLIENT_BACKOFF_RANDOM_FACTOR",
        );
    }
    if let Some(v) = get("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES") {
        m.flag(
            flag::CONFIG_XDS_MAX_MESSAGE_BYTES,
            v,
            "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES",
        );
    }
    if !flag_bool("FORCE_START_WITHOUT_INITIAL_CONFIG")? {
        m.switch(
            flag::CONFIG_XDS_WAIT_FOR_CONFIG,
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
        m.flag(flag::OTLP_ENDPOINT, "", "TRACING_ENABLED");
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
    m.flag(flag::OTLP_ENDPOINT, endpoint, "OTEL_EXPORTER_OTLP_ENDPOINT");
    m.flag(
        flag::TRACING_SERVICE_NAME,
        get("TRACING_SERVICE_NAME").unwrap_or("RateLimit"),
        "TRACING_SERVICE_NAME",
    );
    if let Some(r) = get("TRACING_SAMPLING_RATE") {
        m.flag(flag::TRACING_SAMPLING_RATE, r, "TRACING_SAMPLING_RATE");
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
            m.flag(flag::REDIS_URL, redis_url(items[0], tls, auth), "REDIS_URL");
        }
        "CLUSTER" => {
            let nodes: Vec<String> = items.iter().map(|a| redis_url(a, tls, auth)).collect();
            m.flag(flag::REDIS_CLUSTER, nodes.join(","), "REDIS_URL");
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
            m.flag(flag::REDIS_SENTINEL, urls.join(","), "REDIS_URL");
            m.flag(flag::REDIS_MASTER_NAME, *master, "REDIS_URL");
            if let Some(a) = auth.filter(|a| !a.is_empty()) {
                match a.split_once(':') {
                    Some((user, pw)) => {
                        m.flag(flag::REDIS_MASTER_USERNAME, user, "REDIS_AUTH");
                        m.flag(flag::REDIS_MASTER_PASSWORD, pw, "REDIS_AUTH");
                    }
                    None => m.flag(flag::REDIS_MASTER_PASSWORD, a, "REDIS_AUTH"),
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
        m.flag(flag::REDIS_TLS_CA_FILE, ca, "REDIS_TLS_CACERT");
    }
    match (get("REDIS_TLS_CLIENT_CERT"), get("REDIS_TLS_CLIENT_KEY")) {
        (Some(c), Some(k)) if !c.is_empty() && !k.is_empty() => {
            m.flag(flag::REDIS_TLS_CLIENT_CERT, c, "REDIS_TLS_CLIENT_CERT");
            m.flag(flag::REDIS_TLS_CLIENT_KEY, k, "REDIS_TLS_CLIENT_KEY");
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
        m.flag(flag::REDIS_TIMEOUT, ms.to_string(), "REDIS_TIMEOUT");
    }
    if let Some(p) = get("CACHE_KEY_PREFIX") {
        // One argument: a prefix may start with `-`.
        m.args.push(format!("--{}={p}", flag::REDIS_KEY_PREFIX));
        m.sources.push((
            format!("--{}", flag::REDIS_KEY_PREFIX),
            "CACHE_KEY_PREFIX".into(),
        ));
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
            flag::LOCAL_CACHE_SIZE,
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
