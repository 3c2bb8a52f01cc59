//! The `redis` backend on one node (`--redis-url`).
//!
//! The connection source is a `redis::aio::ConnectionManager`: one
//! multiplexed connection (concurrent requests are pipelined on it) that
//! reconnects by itself. It is created lazily, so startup never waits for or
//! fails on Redis; `/healthcheck` reports 503 through [`Storage::ping`]
//! meanwhile. A background `PING` every second ([`HEALTH_INTERVAL`])
//! replaces a dead connection before a request finds it (e.g. Redis
//! restarted while idle) and closes the circuit breaker once Redis answers
//! again. Every call goes through the shared [`Pipeline`].

use super::batch::{BatchQueue, BatchTarget, Outcome, Queued};
use super::breaker::CircuitBreaker;
use super::errors::redact;
use super::script::{BucketScript, ScriptCall};
use super::url::{is_secret_param, redact_url, url_password};
use super::{
    ConnSource, HEALTH_INTERVAL, MIN_CONNECT_TIMEOUT, Pipeline, RedisBuilder, RedisSetupError,
    hold, install_crypto_provider,
};
use crate::storage::{Charge, RequestResult, Storage, StorageError};
use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::{RedisError, Value};
use async_trait::async_trait;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// The topology of [`RedisStorage`]: one node's URL.
#[derive(Debug, Clone)]
pub struct SingleNode {
    url: String,
}

/// Options of the single-node backend; see [`RedisStorage::builder`].
pub type RedisStorageBuilder = RedisBuilder<SingleNode>;

impl RedisBuilder<SingleNode> {
    /// Builds the backend without waiting for Redis: the connection is made in
    /// the background and remade after failures. Spawns a health task that
    /// pings Redis every second, loads the script and warns about an
    /// eviction policy that may evict buckets in use once Redis answers (docs/design.md, "Key expiry"). Must be called
    /// inside a Tokio runtime.
    ///
    /// # Errors
    /// [`RedisSetupError::InvalidUrl`] when the URL does not parse.
    pub fn build(self) -> Result<RedisStorage, RedisSetupError> {
        install_crypto_provider();
        let url = &self.target.url;
        let secret = url_password(url);
        let invalid = |e: &RedisError| RedisSetupError::InvalidUrl {
            url: redact_url(url),
            message: redact(&e.to_string(), secret.as_deref()),
        };
        if (url.starts_with("redis://") || url.starts_with("rediss://"))
            && url.split_once('?').is_some_and(|(_, q)| {
                q.split('&')
                    .any(|p| p.split_once('=').is_some_and(|(n, _)| is_secret_param(n)))
            })
        {
            // The crate ignores it on TCP URLs: every call would get NOAUTH.
            return Err(RedisSetupError::InvalidUrl {
                url: redact_url(url),
                message: "a password in the query is not used on redis:// URLs; \
                          give it as redis://[user]:PASSWORD@host:port"
                    .into(),
            });
        }
        let client = match self.options.tls_certificates() {
            Some(certs) => ::redis::Client::build_with_tls(url.as_str(), certs),
            None => ::redis::Client::open(url.as_str()),
        }
        .map_err(|e| invalid(&e))?;
        let timeout = self.options.timeout;
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(timeout))
            .set_connection_timeout(Some(timeout.max(MIN_CONNECT_TIMEOUT)))
            // One attempt per reconnect: requests waiting on a reconnect fail
            // at once when Redis refuses, instead of waiting out a backoff;
            // the next request (or the health PING) tries again.
            .set_number_of_retries(0);
        let conn =
            ConnectionManager::new_lazy_with_config(client, config).map_err(|e| invalid(&e))?;
        let storage = RedisStorage {
            inner: Arc::new_cyclic(|me| Inner {
                conn,
                breaker: self.options.breaker(),
                url: redact_url(url),
                pipeline: self.pipeline(secret),
                queue: BatchQueue::spawn(me.clone()),
            }),
        };
        storage.spawn_health_task();
        Ok(storage)
    }
}

#[derive(Debug)]
struct Inner {
    conn: ConnectionManager,
    pipeline: Pipeline,
    breaker: CircuitBreaker,
    /// The URL with its password redacted, for logs.
    url: String,
    /// The queue of the script calls (many requests per call).
    queue: BatchQueue,
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
        RedisBuilder::new(SingleNode { url: url.into() })
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
        self.inner.pipeline.cache().map_or(0, |c| c.len())
    }

    /// Spawns the background health task: every [`HEALTH_INTERVAL`] a `PING`
    /// (bounded by the timeout). It makes the connection manager notice a dead
    /// connection and reconnect before a request would (Redis restarted while
    /// idle), and on the first answer (and the first after a failed ping)
    /// loads the library and checks the eviction policy. It never closes
    /// the circuit breaker (a node that answers `PING` may still refuse
    /// every charge); a failed ping clears the local over-limit cache and
    /// the script clock's verdict. Ends when the storage is dropped.
    fn spawn_health_task(&self) {
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let mut ready = false;
            let mut warned = false;
            loop {
                let Some(inner) = weak.upgrade() else { return };
                let p = &inner.pipeline;
                let mut conn = inner.conn.clone();
                let pong = tokio::time::timeout(
                    p.timeout.max(MIN_CONNECT_TIMEOUT),
                    ::redis::cmd("PING").query_async::<String>(&mut conn),
                )
                .await;
                match pong {
                    Ok(Ok(_)) => {
                        warned = false;
                        if !ready {
                            match p.script.load(&mut conn).await {
                                Ok(()) => {
                                    tracing::info!(url = %inner.url, sha = p.script.sha(), functions = p.script.uses_functions(), "Redis answers; token bucket script loaded");
                                    check_eviction_policy(&mut conn, p.timeout).await;
                                    ready = true;
                                }
                                Err(e) => {
                                    let e = p.classify(&e);
                                    tracing::warn!(url = %inner.url, error = %e, "cannot load the token bucket script");
                                }
                            }
                        }
                    }
                    failed => {
                        // Redis may be restarting: what it said about
                        // buckets may not hold when it is back, its
                        // script clock is checked again (a library kept in
                        // its persistence says nothing of a restart, where
                        // a lost script said `NOSCRIPT`), and the library
                        // is loaded again when it answers (so a Redis that
                        // refused Functions and now has them is called
                        // with `FCALL` again).
                        p.clear_cache();
                        p.clock.forget();
                        ready = false;
                        if !warned {
                            let e = match failed {
                                Ok(Err(e)) => p.classify(&e),
                                _ => StorageError::Timeout(p.timeout.max(MIN_CONNECT_TIMEOUT)),
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

/// Warns when a `maxmemory-policy` may evict buckets that are in use
/// (docs/design.md, "Key expiry"): an evicted bucket is a free full bucket,
/// a silent fail-open.
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
                match eviction_risk(policy) {
                    Some(risk) => tracing::warn!(
                        maxmemory_policy = %policy,
                        "Redis may evict rate limit buckets that are in use: {risk}; use noeviction (writes fail when memory is full, and bucket-rls answers as on any storage failure) or volatile-ttl (evicts the buckets closest to full first)"
                    ),
                    None => tracing::debug!(maxmemory_policy = %policy, "Redis eviction policy"),
                }
            }
        }
        _ => tracing::debug!("cannot read Redis maxmemory-policy (CONFIG GET not allowed?)"),
    }
}

/// What a Redis `maxmemory-policy` does to the limits, when it breaks them;
/// `None` for the two that keep them: `noeviction` (nothing is evicted; a
/// charge fails with `OOM` when memory is full) and `volatile-ttl` (evicts
/// the keys with the shortest TTL first: every bucket key's TTL is its time
/// to full, so the buckets evicted are those about to be full anyway).
/// Every bucket key has a TTL, so `volatile-lru`, `volatile-lfu` and
/// `volatile-random` may evict any bucket, drained ones in use included, and
/// `allkeys-*` too; an unknown policy is reported as such.
#[must_use]
pub(crate) fn eviction_risk(policy: &str) -> Option<&'static str> {
    match policy {
        "noeviction" | "volatile-ttl" => None,
        "volatile-lru" | "volatile-lfu" | "allkeys-lru" | "allkeys-lfu" => Some(
            "it evicts the least recently (or frequently) used keys, and a drained bucket a client waits on is one of them: its next request finds a full bucket",
        ),
        "volatile-random" | "allkeys-random" => Some(
            "it evicts random keys, drained buckets in use included: their next request finds a full bucket",
        ),
        _ => Some("an eviction policy bucket-rls does not know"),
    }
}

/// The connection manager: always at hand (it reconnects by itself).
impl ConnSource for Inner {
    type Conn = ConnectionManager;
    type Tag = ();

    fn connection(
        &self,
    ) -> impl Future<Output = Result<((), ConnectionManager), StorageError>> + Send {
        std::future::ready(Ok(((), self.conn.clone())))
    }

    fn eval<'a>(
        &'a self,
        conn: &'a mut ConnectionManager,
        script: &'a BucketScript,
        call: &'a ScriptCall,
    ) -> impl Future<Output = Result<Value, RedisError>> + Send + 'a {
        script.eval(conn, call)
    }
}

impl BatchTarget for Inner {
    fn call_batch<'a>(
        &'a self,
        batch: &'a [Queued],
        connecting: &'a AtomicBool,
    ) -> impl Future<Output = Vec<Outcome>> + Send + 'a {
        self.pipeline
            .call_batch(self, &self.breaker, batch, connecting)
    }
}

#[async_trait]
impl Storage for RedisStorage {
    async fn apply(&self, charges: &[Charge]) -> Result<RequestResult, StorageError> {
        let inner = &*self.inner;
        inner
            .pipeline
            .apply(inner, &inner.queue, &inner.breaker, charges)
            .await
    }

    async fn report(
        &self,
        reports: &[crate::storage::quota::QuotaReport],
    ) -> Result<Vec<crate::storage::quota::QuotaView>, StorageError> {
        let inner = &*self.inner;
        inner.pipeline.report(inner, &inner.breaker, reports).await
    }

    async fn reset(&self, keys: &[&str]) -> Result<Vec<bool>, StorageError> {
        let inner = &*self.inner;
        inner.pipeline.reset(inner, keys).await
    }

    async fn check_charges(&self, probe: &Charge) -> Result<(), StorageError> {
        self.apply(std::slice::from_ref(probe)).await.map(|_| ())
    }

    async fn ping(&self) -> Result<(), StorageError> {
        let inner = &self.inner;
        let p = &inner.pipeline;
        let mut conn = inner.conn.clone();
        let pong = tokio::time::timeout(
            p.timeout,
            ::redis::cmd("PING").query_async::<String>(&mut conn),
        )
        .await;
        match pong {
            // A PONG says nothing about whether charges work (a replica or
            // a full `noeviction` node answers it): it never closes the
            // circuit breaker, only a charge that worked does.
            // The node's script clock, checked once per connection.
            Ok(Ok(_)) => p.clock_gate(&**inner).await,
            Ok(Err(e)) => Err(p.classify(&e)),
            Err(_) => Err(StorageError::Timeout(p.timeout)),
        }
    }

    fn name(&self) -> &'static str {
        "redis"
    }

    fn invalidate_local_cache(&self) {
        self.inner.pipeline.clear_cache();
    }

    fn hold_existing(&self, prefix: &str, hold_us: u64) {
        hold::spawn_hold(
            &self.inner.pipeline.holds,
            self.inner.conn.clone(),
            prefix,
            hold_us,
            self.inner.pipeline.secret.clone(),
        );
    }
}

#[cfg(test)]
mod eviction_tests {
    use super::eviction_risk;

    #[test]
    fn only_noeviction_and_volatile_ttl_keep_the_limits() {
        assert_eq!(eviction_risk("noeviction"), None);
        assert_eq!(eviction_risk("volatile-ttl"), None);
        for p in [
            "volatile-lru",
            "volatile-lfu",
            "volatile-random",
            "allkeys-lru",
            "allkeys-lfu",
            "allkeys-random",
            "something-new",
        ] {
            assert!(eviction_risk(p).is_some(), "{p}");
        }
    }
}
