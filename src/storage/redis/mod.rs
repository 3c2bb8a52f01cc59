//! The `redis` backend (single node): token buckets shared by every replica of
//! bucket-rls through one Redis.
//!
//! Design:
//! - **One script call per request.** [`script`] wraps `lua/token_bucket.lua`,
//!   which reads, decides and writes every bucket of a request atomically
//!   (all-or-nothing, DESIGN 3) with exactly the semantics of
//!   [`bucket::apply_request`](crate::storage::bucket::apply_request). Time
//!   comes from Redis `TIME`, so replicas never disagree about a bucket and a
//!   skewed service clock cannot mint tokens (BR-27). The script is called with
//!   `EVALSHA`; `NOSCRIPT` (restart, failover, `SCRIPT FLUSH`) loads it and
//!   retries once (BR-23). Nothing else is ever retried: after a timeout the
//!   script may have run, so the call fails with
//!   [`StorageError::Timeout`] and is not replayed (BR-24).
//! - **Connection.** A `redis::aio::ConnectionManager`: one multiplexed
//!   connection (concurrent requests are pipelined on it) that reconnects by
//!   itself. It is created lazily, so startup never waits for or fails on
//!   Redis; `/healthcheck` reports 503 through [`Storage::ping`] meanwhile.
//!   A background `PING` every second ([`HEALTH_INTERVAL`]) replaces a dead
//!   connection before a request finds it (e.g. Redis restarted while idle)
//!   and closes the circuit breaker once Redis answers again.
//!   `rediss://` uses rustls with the `ring` provider; ACL user and password
//!   come from the URL and are never logged ([`redact_url`]).
//! - **Bounded latency.** Every call is bounded by `--redis-timeout`
//!   ([`RedisStorageBuilder::timeout`]). Errors are classified once in
//!   [`script::classify`]; `service.rs` maps them to gRPC `UNAVAILABLE` or the
//!   `--on-storage-error` policy.
//! - **Circuit breaker** ([`breaker`]): after consecutive failures, requests
//!   fail at once with [`StorageError::CircuitOpen`] until a probe (one request
//!   per interval, or a health-check ping) succeeds (BR-25).
//! - **Local over-limit cache** ([`local_cache`]): buckets Redis reported as
//!   lacking tokens answer certain denials from memory; cleared on every config
//!   swap (BR-21).
//! - **Keys** are built by the service ([`key`](crate::storage::key)); each
//!   stores 7 to 14 bytes and expires when its bucket would be full again.
//!
//! Cluster and Sentinel backends reuse [`script::BucketScript`],
//! [`script::ScriptCall`], [`script::classify`], [`breaker::CircuitBreaker`]
//! and [`local_cache::LocalCache`].

/// The options every Redis topology's builder shares (timeout, local cache,
/// circuit breaker, test clock), written once. The builder must have the
/// fields `timeout`, `local_cache_size`, `breaker_threshold`,
/// `probe_interval` and `test_clock`.
macro_rules! common_builder_options {
    () => {
        /// Response timeout of every call (default 50 ms, `--redis-timeout`).
        /// On a Cluster, a request spanning several slots takes one timeout for
        /// the parallel reservation and, when denied, one more to compensate.
        #[must_use]
        pub fn timeout(mut self, timeout: std::time::Duration) -> Self {
            self.timeout = timeout;
            self
        }

        /// Entries of the local over-limit cache; 0 disables it (default 100,000).
        #[must_use]
        pub fn local_cache_size(mut self, entries: usize) -> Self {
            self.local_cache_size = entries;
            self
        }

        /// Consecutive failures that open the circuit breaker (per slot on a
        /// Cluster), and the time between probes while it is open (defaults 5
        /// and 500 ms).
        #[must_use]
        pub fn breaker(mut self, threshold: u32, probe_interval: std::time::Duration) -> Self {
            self.breaker_threshold = threshold;
            self.probe_interval = probe_interval;
            self
        }

        /// PEM certificate(s) of the CA that signs the server certificates
        /// behind `rediss://` addresses (a private CA), instead of the public
        /// web PKI roots (`--redis-tls-ca-file`).
        #[must_use]
        pub fn tls_root_ca_pem(mut self, pem: Vec<u8>) -> Self {
            self.tls_root_ca_pem = Some(pem);
            self
        }

        /// **Tests only.** Sends `clock`'s time to the script as an explicit
        /// `now_us` instead of letting the script read Redis `TIME`, so tests
        /// can move time with a `ManualClock`. Production never sets this: the
        /// service clock must not decide bucket time (BR-27).
        #[must_use]
        pub fn test_clock(
            mut self,
            clock: std::sync::Arc<dyn crate::storage::clock::Clock>,
        ) -> Self {
            self.test_clock = Some(clock);
            self
        }
    };
}

/// Node addresses (`host:port` or URLs) as URLs, the same list with passwords
/// masked (for logs and errors), and the first password (to redact it from
/// error messages).
pub(crate) fn node_urls(nodes: &[String]) -> (Vec<String>, String, Option<String>) {
    let urls: Vec<String> = nodes
        .iter()
        .map(|n| {
            if n.contains("://") {
                n.clone()
            } else {
                format!("redis://{n}")
            }
        })
        .collect();
    let shown = urls
        .iter()
        .map(|u| redact_url(u))
        .collect::<Vec<_>>()
        .join(",");
    let secret = urls.iter().find_map(|u| url_password(u));
    (urls, shown, secret)
}

pub mod breaker;
pub mod cluster;
pub mod local_cache;
pub mod script;
pub mod sentinel;

use self::breaker::CircuitBreaker;
use self::local_cache::LocalCache;
use self::script::{BucketScript, ScriptCall, classify, is_transient, redact};
use super::clock::Clock;
use super::{Charge, RequestResult, Storage, StorageError};
use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use async_trait::async_trait;
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

/// Default response timeout (`--redis-timeout`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);
/// Default consecutive failures that open the circuit breaker.
pub const DEFAULT_BREAKER_THRESHOLD: u32 = 5;
/// Default time between probes while the breaker is open.
pub const DEFAULT_PROBE_INTERVAL: Duration = Duration::from_millis(500);
/// Default entries of the local over-limit cache (`--local-cache-size`).
pub const DEFAULT_LOCAL_CACHE_SIZE: usize = 100_000;
/// Shortest connect timeout (a TLS handshake may take longer than a reply).
const MIN_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Period of the background health `PING`.
pub const HEALTH_INTERVAL: Duration = Duration::from_secs(1);

/// Why the Redis backend cannot be built (the URL itself is wrong; Redis
/// being down is not an error at this point).
#[derive(Debug, thiserror::Error)]
pub enum RedisSetupError {
    /// The URL does not parse (message with the password redacted).
    #[error("invalid Redis URL {url}: {message}")]
    InvalidUrl {
        /// The URL with its password replaced by `***`.
        url: String,
        /// Why it does not parse.
        message: String,
    },
}

/// Options of the Redis backend; see [`RedisStorage::builder`].
#[derive(Debug, Clone)]
pub struct RedisStorageBuilder {
    url: String,
    timeout: Duration,
    local_cache_size: usize,
    breaker_threshold: u32,
    probe_interval: Duration,
    test_clock: Option<Arc<dyn Clock>>,
    tls_root_ca_pem: Option<Vec<u8>>,
}

impl RedisStorageBuilder {
    common_builder_options!();

    /// Builds the backend without waiting for Redis: the connection is made in
    /// the background and remade after failures. Spawns a health task that
    /// pings Redis every second, loads the script and warns about an
    /// `allkeys-*` eviction policy once Redis answers (BR-26). Must be called
    /// inside a Tokio runtime.
    ///
    /// # Errors
    /// [`RedisSetupError::InvalidUrl`] when the URL does not parse.
    pub fn build(self) -> Result<RedisStorage, RedisSetupError> {
        install_crypto_provider();
        let secret = url_password(&self.url);
        let invalid = |e: &::redis::RedisError| RedisSetupError::InvalidUrl {
            url: redact_url(&self.url),
            message: redact(&e.to_string(), secret.as_deref()),
        };
        if (self.url.starts_with("redis://") || self.url.starts_with("rediss://"))
            && self.url.split_once('?').is_some_and(|(_, q)| {
                q.split('&')
                    .any(|p| p.split_once('=').is_some_and(|(n, _)| is_secret_param(n)))
            })
        {
            // The crate ignores it on TCP URLs: every call would get NOAUTH.
            return Err(RedisSetupError::InvalidUrl {
                url: redact_url(&self.url),
                message: "a password in the query is not used on redis:// URLs; \
                          give it as redis://[user]:PASSWORD@host:port"
                    .into(),
            });
        }
        let client = match &self.tls_root_ca_pem {
            Some(pem) => ::redis::Client::build_with_tls(
                self.url.as_str(),
                ::redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem.clone()),
                },
            ),
            None => ::redis::Client::open(self.url.as_str()),
        }
        .map_err(|e| invalid(&e))?;
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(self.timeout))
            .set_connection_timeout(Some(self.timeout.max(MIN_CONNECT_TIMEOUT)))
            // One attempt per reconnect: requests waiting on a reconnect fail
            // at once when Redis refuses, instead of waiting out a backoff;
            // the next request (or the health PING) tries again.
            .set_number_of_retries(0);
        let conn =
            ConnectionManager::new_lazy_with_config(client, config).map_err(|e| invalid(&e))?;
        let storage = RedisStorage {
            inner: Arc::new(Inner {
                conn,
                script: BucketScript::new(),
                timeout: self.timeout,
                breaker: CircuitBreaker::new(self.breaker_threshold, self.probe_interval),
                cache: (self.local_cache_size > 0).then(|| LocalCache::new(self.local_cache_size)),
                test_clock: self.test_clock,
                secret,
                url: redact_url(&self.url),
                epoch: Instant::now(),
            }),
        };
        storage.spawn_health_task();
        Ok(storage)
    }
}

#[derive(Debug)]
struct Inner {
    conn: ConnectionManager,
    script: BucketScript,
    timeout: Duration,
    breaker: CircuitBreaker,
    cache: Option<LocalCache>,
    test_clock: Option<Arc<dyn Clock>>,
    /// The URL's password, removed from every error message.
    secret: Option<String>,
    /// The URL with its password redacted, for logs.
    url: String,
    /// Origin of the local cache's monotonic time line.
    epoch: Instant,
}

/// Token buckets in one Redis node. Cheap to clone (shared state).
#[derive(Debug, Clone)]
pub struct RedisStorage {
    inner: Arc<Inner>,
}

impl RedisStorage {
    /// Options for a backend on `url` (`redis://[user:password@]host:port/db`
    /// or `rediss://...` for TLS).
    #[must_use]
    pub fn builder(url: impl Into<String>) -> RedisStorageBuilder {
        RedisStorageBuilder {
            url: url.into(),
            timeout: DEFAULT_TIMEOUT,
            local_cache_size: DEFAULT_LOCAL_CACHE_SIZE,
            breaker_threshold: DEFAULT_BREAKER_THRESHOLD,
            probe_interval: DEFAULT_PROBE_INTERVAL,
            test_clock: None,
            tls_root_ca_pem: None,
        }
    }

    /// The URL with its password redacted.
    #[must_use]
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    /// Whether the circuit breaker is open now.
    #[must_use]
    pub fn circuit_open(&self) -> bool {
        self.inner.breaker.is_open()
    }

    /// Buckets in the local over-limit cache (0 when disabled).
    #[must_use]
    pub fn local_cache_len(&self) -> usize {
        self.inner.cache.as_ref().map_or(0, LocalCache::len)
    }

    /// Time on the local cache's line: the test clock when set (the same time
    /// the script is given), else microseconds since this backend was built.
    fn local_now_us(&self) -> u64 {
        match &self.inner.test_clock {
            Some(c) => c.now_us(),
            None => u64::try_from(self.inner.epoch.elapsed().as_micros()).unwrap_or(u64::MAX),
        }
    }

    /// Spawns the background health task: every [`HEALTH_INTERVAL`] a `PING`
    /// (bounded by the timeout). It makes the connection manager notice a dead
    /// connection and reconnect before a request would (Redis restarted while
    /// idle), closes the circuit breaker as soon as Redis answers again, and on
    /// the first answer loads the script and checks the eviction policy. Ends
    /// when the storage is dropped.
    fn spawn_health_task(&self) {
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let mut ready = false;
            let mut warned = false;
            loop {
                let Some(inner) = weak.upgrade() else { return };
                let mut conn = inner.conn.clone();
                let pong = tokio::time::timeout(
                    inner.timeout.max(MIN_CONNECT_TIMEOUT),
                    ::redis::cmd("PING").query_async::<String>(&mut conn),
                )
                .await;
                match pong {
                    Ok(Ok(_)) => {
                        inner.breaker.success();
                        warned = false;
                        if !ready {
                            match inner.script.load(&mut conn).await {
                                Ok(()) => {
                                    tracing::info!(url = %inner.url, sha = inner.script.sha(), "Redis answers; token bucket script loaded");
                                    check_eviction_policy(&mut conn, inner.timeout).await;
                                    ready = true;
                                }
                                Err(e) => {
                                    let e = classify(&e, inner.timeout, inner.secret.as_deref());
                                    tracing::warn!(url = %inner.url, error = %e, "cannot load the token bucket script");
                                }
                            }
                        }
                    }
                    failed => {
                        if !warned {
                            let e = match failed {
                                Ok(Err(e)) => classify(&e, inner.timeout, inner.secret.as_deref()),
                                _ => StorageError::Timeout(inner.timeout.max(MIN_CONNECT_TIMEOUT)),
                            };
                            tracing::warn!(url = %inner.url, error = %e, "Redis does not answer; requests that need it fail until it does");
                            warned = true;
                        }
                    }
                }
                drop(inner);
                tokio::time::sleep(HEALTH_INTERVAL).await;
            }
        });
    }
}

/// Warns when keys may be evicted before they expire (BR-26): an evicted
/// bucket is a free full bucket, a silent fail-open.
async fn check_eviction_policy(conn: &mut ConnectionManager, timeout: Duration) {
    let got = tokio::time::timeout(
        timeout.max(MIN_CONNECT_TIMEOUT),
        ::redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory-policy")
            .query_async::<Vec<String>>(conn),
    )
    .await;
    match got {
        Ok(Ok(v)) => {
            if let Some(policy) = v.get(1) {
                if policy.starts_with("allkeys-") {
                    tracing::warn!(
                        maxmemory_policy = %policy,
                        "Redis may evict live rate limit buckets (maxmemory-policy allkeys-*): an evicted bucket is a free full bucket; use volatile-ttl, volatile-lru or noeviction"
                    );
                } else {
                    tracing::debug!(maxmemory_policy = %policy, "Redis eviction policy");
                }
            }
        }
        _ => tracing::debug!("cannot read Redis maxmemory-policy (CONFIG GET not allowed?)"),
    }
}

#[async_trait]
impl Storage for RedisStorage {
    async fn apply(&self, charges: &[Charge]) -> Result<RequestResult, StorageError> {
        let inner = &self.inner;
        if let Some(r) =
            local_cache::answer_or_note(inner.cache.as_ref(), charges, self.local_now_us())
        {
            return Ok(r);
        }
        let now_us = inner.test_clock.as_ref().map(|c| c.now_us());
        let call = ScriptCall::new(charges, now_us)?;
        if !inner.breaker.allow() {
            return Err(StorageError::CircuitOpen);
        }
        let sent_us = self.local_now_us();
        let started = Instant::now();
        let mut conn = inner.conn.clone();
        let result =
            match tokio::time::timeout(inner.timeout, inner.script.eval(&mut conn, &call)).await {
                Err(_) => Err(StorageError::Timeout(inner.timeout)),
                Ok(Err(e)) => Err(classify(&e, inner.timeout, inner.secret.as_deref())),
                Ok(Ok(v)) => call.parse_reply(&v),
            };
        match &result {
            Ok(r) => {
                inner.breaker.success();
                if let Some(cache) = &inner.cache {
                    cache.record_between(charges, r, sent_us, self.local_now_us());
                }
            }
            Err(e) if is_transient(e) => inner.breaker.failure_of_call_started(started),
            Err(_) => {}
        }
        result
    }

    async fn ping(&self) -> Result<(), StorageError> {
        let inner = &self.inner;
        let mut conn = inner.conn.clone();
        let pong = tokio::time::timeout(
            inner.timeout,
            ::redis::cmd("PING").query_async::<String>(&mut conn),
        )
        .await;
        match pong {
            Ok(Ok(_)) => {
                inner.breaker.success();
                Ok(())
            }
            Ok(Err(e)) => Err(classify(&e, inner.timeout, inner.secret.as_deref())),
            Err(_) => Err(StorageError::Timeout(inner.timeout)),
        }
    }

    fn name(&self) -> &'static str {
        "redis"
    }

    fn invalidate_local_cache(&self) {
        if let Some(cache) = &self.inner.cache {
            cache.clear();
        }
    }

    fn hold_existing(&self, prefix: &str, hold_us: u64) {
        spawn_hold(
            self.inner.conn.clone(),
            prefix,
            hold_us,
            self.inner.secret.clone(),
        );
    }
}

/// Keeps each key of `KEYS` at least `ARGV[1]` ms: `PEXPIRE` only where the
/// key's TTL is shorter (a key already gone, or without a TTL, is left
/// alone). Returns how many keys it extended.
const HOLD_SCRIPT: &str = "local n = 0 \
    for _, k in ipairs(KEYS) do \
      local t = redis.call('PTTL', k) \
      if t >= 0 and t < tonumber(ARGV[1]) then redis.call('PEXPIRE', k, ARGV[1]); n = n + 1 end \
    end return n";

/// `prefix` as a `SCAN MATCH` pattern for every key under it (`*?[]\`
/// escaped).
fn prefix_pattern(prefix: &str) -> String {
    let mut p = String::with_capacity(prefix.len() + 2);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            p.push('\\');
        }
        p.push(c);
    }
    p.push('*');
    p
}

/// `SCAN`s the keys under `prefix` on the node behind `conn` and keeps each
/// at least `hold_ms` (`Storage::hold_existing`): 500 keys per step, one
/// script call per step. Returns how many keys were extended.
///
/// # Errors
/// The first failing `SCAN` or script call.
pub(crate) async fn hold_keys<C: ::redis::aio::ConnectionLike>(
    conn: &mut C,
    prefix: &str,
    hold_ms: u64,
) -> ::redis::RedisResult<u64> {
    let pattern = prefix_pattern(prefix);
    let mut cursor: u64 = 0;
    let mut extended = 0u64;
    loop {
        let (next, keys): (u64, Vec<Vec<u8>>) = ::redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(500)
            .query_async(conn)
            .await?;
        if !keys.is_empty() {
            // Plain EVAL: rare and small, no script cache to keep loaded.
            let n: u64 = ::redis::cmd("EVAL")
                .arg(HOLD_SCRIPT)
                .arg(keys.len())
                .arg(keys)
                .arg(hold_ms)
                .query_async(conn)
                .await?;
            extended += n;
        }
        if next == 0 {
            return Ok(extended);
        }
        cursor = next;
    }
}

/// Runs [`hold_keys`] in the background and logs the outcome.
pub(crate) fn spawn_hold<C>(mut conn: C, prefix: &str, hold_us: u64, secret: Option<String>)
where
    C: ::redis::aio::ConnectionLike + Send + 'static,
{
    let prefix = prefix.to_owned();
    let hold_ms = hold_us.div_ceil(1000);
    tokio::spawn(async move {
        let result = hold_keys(&mut conn, &prefix, hold_ms).await;
        log_hold(&result, hold_ms, secret.as_deref());
    });
}

/// Logs the outcome of a background key hold (single node, Sentinel or
/// Cluster): the keys extended, or the error with the password redacted.
pub(crate) fn log_hold(result: &::redis::RedisResult<u64>, hold_ms: u64, secret: Option<&str>) {
    match result {
        Ok(n) => tracing::info!(
            extended = n,
            hold_secs = hold_ms / 1000,
            "kept existing Redis buckets until they are full under the new limits"
        ),
        Err(e) => tracing::warn!(
            error = %redact(&e.to_string(), secret),
            "could not extend existing Redis buckets after a reload; some may expire before they are full under the new limits"
        ),
    }
}

static CRYPTO: Once = Once::new();

/// Installs rustls's `ring` provider as the process default, once (needed by
/// `rediss://`; a provider installed earlier by the process is kept).
pub fn install_crypto_provider() {
    CRYPTO.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// Splits `url` into (prefix up to and including `://`, user info, the rest
/// from the last `@` on). The user info runs to the **last** `@`, so a password
/// holding `/`, `#`, `?` or `@` (common in generated passwords), or a URL
/// without a scheme, still never leaks.
fn split_userinfo(url: &str) -> Option<(&str, &str, &str)> {
    let start = url.find("://").map_or(0, |i| i + 3);
    let at = url.rfind('@').filter(|&at| at >= start)?;
    Some((&url[..start], &url[start..at], &url[at..]))
}

/// Whether a query parameter name carries a password: `pass` is how the
/// `redis` crate reads one from `redis+unix://` and `unix://` URLs;
/// `password` is a common guess (the crate ignores it on TCP URLs, but it
/// must not be logged either).
fn is_secret_param(name: &str) -> bool {
    name.eq_ignore_ascii_case("pass") || name.eq_ignore_ascii_case("password")
}

fn url_password(url: &str) -> Option<String> {
    if let Some((_, userinfo, _)) = split_userinfo(url)
        && let Some((_, password)) = userinfo.split_once(':')
        && !password.is_empty()
    {
        return Some(password.to_owned());
    }
    let (_, query) = url.split_once('?')?;
    query
        .split('&')
        .filter_map(|p| p.split_once('='))
        .find(|(name, value)| is_secret_param(name) && !value.is_empty())
        .map(|(_, value)| value.to_owned())
}

/// `url` with the password of its user info and the value of any `pass=` or
/// `password=` query parameter replaced by `***`, for logs and errors
/// (`redis://user:***@host:6379/0`, `redis+unix:///run/redis.sock?pass=***`).
/// Works on URLs that do not parse.
#[must_use]
pub fn redact_url(url: &str) -> String {
    let url = match split_userinfo(url) {
        Some((scheme, userinfo, host)) => {
            let masked = match userinfo.split_once(':') {
                Some((user, _)) => format!("{user}:***"),
                // `redis://password@host` is read as a password by some clients.
                None => "***".to_owned(),
            };
            format!("{scheme}{masked}{host}")
        }
        None => url.to_owned(),
    };
    match url.split_once('?') {
        Some((base, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|p| match p.split_once('=') {
                    Some((name, _)) if is_secret_param(name) => format!("{name}=***"),
                    _ => p.to_owned(),
                })
                .collect();
            format!("{base}?{}", query.join("&"))
        }
        None => url,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_redacted() {
        assert_eq!(
            redact_url("redis://app:s3cret@db:6379/2"),
            "redis://app:***@db:6379/2"
        );
        assert_eq!(redact_url("rediss://:s3cret@db"), "rediss://:***@db");
        assert_eq!(redact_url("redis://db:6379"), "redis://db:6379");
        assert_eq!(
            url_password("redis://app:s3cret@db:6379/2").as_deref(),
            Some("s3cret")
        );
        assert_eq!(url_password("redis://db:6379"), None);
        // Passwords with URL delimiters, and URLs without a scheme.
        for (url, want) in [
            (
                "redis://:S3CRET/PW@127.0.0.1:6379/0",
                "redis://:***@127.0.0.1:6379/0",
            ),
            ("redis://u:a#b?c@d@h:1", "redis://u:***@h:1"),
            ("app:S3CRETPW@127.0.0.1:6379/0", "app:***@127.0.0.1:6379/0"),
            (
                "redis+unix:///tmp/x.sock?db=1&pass=S3CRETPW",
                "redis+unix:///tmp/x.sock?db=1&pass=***",
            ),
            (
                "unix:///tmp/x.sock?user=app&PASS=S3CRETPW",
                "unix:///tmp/x.sock?user=app&PASS=***",
            ),
            (
                "redis://host/0?password=S3CRETPW",
                "redis://host/0?password=***",
            ),
        ] {
            assert_eq!(redact_url(url), want);
            let pw = url_password(url).expect("password");
            assert!(!redact(&format!("parse error near {pw}"), Some(&pw)).contains(&pw));
        }
    }
}
