//! The `redis` backend behind **Redis Sentinel** (`--redis-sentinel
//! host:port,... --redis-master-name NAME`): one master found through the
//! Sentinels, followed across failovers without a restart.
//!
//! Everything about a call is as on a single node
//! ([`RedisStorage`](super::RedisStorage)), through the same
//! `Pipeline`: one atomic script call per request,
//! `FCALL` of the library (a promoted replica has it: Redis replicates it)
//! with one reload on `Function not found` or `NOSCRIPT` (docs/design.md,
//! "NOSCRIPT"), no replay after a timeout (docs/design.md, "Ambiguous failures are never replayed"), the response
//! timeout, the circuit breaker and the local over-limit cache. Only the
//! connection source differs:
//!
//! - A background task asks the Sentinels (`SENTINEL MASTERS`, first one that
//!   answers) for the master's address, checks with `ROLE` that the node
//!   really is a master, connects (one multiplexed connection, pipelined
//!   across concurrent requests) and loads the script there. Startup never
//!   waits for it; calls fail with [`StorageError::Unreachable`] until a master
//!   is known.
//! - A connection error, a timeout that leaves the connection unusable, or a
//!   `READONLY` / `MASTERDOWN` reply (the node was demoted to a replica, or
//!   lost its master) drops the connection and wakes the task, which asks the
//!   Sentinels again. `READONLY` is treated as a connection error, never as a
//!   result: the call answers `UNAVAILABLE` and nothing is retried, so during
//!   a failover requests get `UNAVAILABLE` for at most the failover time and
//!   then reach the new master. Sentinel itself disconnects every client of a
//!   demoted master (`CLIENT KILL TYPE normal`), so a stale master is not
//!   kept.
//! - While a master is in use, the task asks the Sentinels again every second
//!   and switches when they name another node: after a failover the old
//!   master keeps accepting writes until Sentinel demotes it (Redis
//!   replication is asynchronous; those writes are lost with it), so its own
//!   answers would not reveal the switch.
//! - While no master is known, the task retries every 250 ms; calls wait for
//!   it within their own timeout.

use super::batch::{BatchQueue, BatchTarget, Outcome, Queued};
use super::breaker::CircuitBreaker;
use super::errors::redact;
use super::script::{BucketScript, ScriptCall};
use super::{
    ConnSource, MIN_CONNECT_TIMEOUT, Pipeline, RedisBuilder, RedisSetupError, hold,
    install_crypto_provider,
};
use crate::storage::{BackendKind, Charge, RequestResult, Storage, StorageError};
use ::redis::aio::MultiplexedConnection;
use ::redis::sentinel::{SentinelClient, SentinelServerType};
use ::redis::{AsyncConnectionConfig, RedisError, Value};
use async_trait::async_trait;
use parking_lot::Mutex;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;
use tokio::sync::{Notify, watch};

/// Delay between discovery attempts while no master is found.
const DISCOVERY_RETRY: Duration = Duration::from_millis(250);
/// How often the Sentinels are asked again while a master is in use: after
/// a failover the old master may keep accepting writes until Sentinel
/// demotes it, so its answer alone does not reveal the switch.
const CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// The topology of [`RedisSentinelStorage`]: the Sentinels, the name of
/// the master they watch, and the master's credentials.
#[derive(Debug, Clone)]
pub struct SentinelMaster {
    sentinels: Vec<String>,
    master_name: String,
    master_username: Option<String>,
    master_password: Option<String>,
}

/// Options of the Sentinel backend; see [`RedisSentinelStorage::builder`].
pub type RedisSentinelStorageBuilder = RedisBuilder<SentinelMaster>;

impl RedisBuilder<SentinelMaster> {
    /// ACL user and password for the **master** (`--redis-master-username`,
    /// `--redis-master-password`): the Sentinels name the master but do not
    /// hand out its credentials, and a master with `requirepass` refuses
    /// scripts without them. The Sentinels' own credentials are those of
    /// their addresses.
    #[must_use]
    pub fn master_auth(mut self, username: Option<String>, password: Option<String>) -> Self {
        self.target.master_username = username.filter(|u| !u.is_empty());
        self.target.master_password = password.filter(|p| !p.is_empty());
        self
    }

    /// Builds the backend and starts the discovery task (see the module
    /// docs). Must be called inside a Tokio runtime.
    ///
    /// # Errors
    /// [`RedisSetupError::InvalidUrl`] when no Sentinel is given, the master
    /// name is empty, or a Sentinel address does not parse.
    pub fn build(self) -> Result<RedisSentinelStorage, RedisSetupError> {
        install_crypto_provider();
        let (urls, shown, secret) = super::url::node_urls(&self.target.sentinels);
        let invalid = |message: String| RedisSetupError::InvalidUrl {
            url: shown.clone(),
            message,
        };
        if urls.is_empty() {
            return Err(invalid("no Redis Sentinel address given".into()));
        }
        if self.target.master_name.is_empty() {
            return Err(invalid("no master name given (--redis-master-name)".into()));
        }
        let client = self
            .client(&urls)
            .map_err(|e| invalid(redact(&e, secret.as_deref())))?;
        let (ready, _) = watch::channel(0u64);
        let storage = RedisSentinelStorage {
            inner: Arc::new_cyclic(|me| Inner {
                master: Mutex::new(None),
                wake: Notify::new(),
                ready,
                breaker: self.options.breaker(),
                pipeline: self.pipeline(self.target.master_password.clone()),
                queue: BatchQueue::spawn(me.clone()),
                sentinel_secret: secret,
                sentinels: shown,
                master_name: self.target.master_name,
            }),
        };
        storage.spawn_discovery(client);
        Ok(storage)
    }

    /// The crate's Sentinel client: every Sentinel with the user and password
    /// of its address (the same for all), TLS to the Sentinels and to the
    /// master when the addresses are `rediss://`, the private CA if given.
    fn client(&self, urls: &[String]) -> Result<SentinelClient, String> {
        use ::redis::{ConnectionAddr, IntoConnectionInfo, TlsMode};
        let fail = |message: String| message;
        let mut addrs = Vec::with_capacity(urls.len());
        let mut auth: Option<(Option<String>, Option<String>)> = None;
        for url in urls {
            let info = url
                .as_str()
                .into_connection_info()
                .map_err(|e| e.to_string())?;
            let r = info.redis_settings();
            let this = (
                r.username().map(str::to_owned),
                r.password().map(str::to_owned),
            );
            match &auth {
                Some(first) if *first != this => {
                    return Err(fail(
                        "every Sentinel address must carry the same user and password".into(),
                    ));
                }
                _ => auth = Some(this),
            }
            addrs.push(info.addr().clone());
        }
        let tls = addrs
            .iter()
            .filter(|a| matches!(a, ConnectionAddr::TcpTls { .. }))
            .count();
        if tls != 0 && tls != addrs.len() {
            return Err(fail(
                "mix of redis:// and rediss:// Sentinel addresses; use one scheme".into(),
            ));
        }
        if tls == 0 && self.options.tls_certificates().is_some() {
            return Err(fail(
                "a TLS CA file or client certificate is given but the Sentinel addresses are not rediss://".into(),
            ));
        }
        let mut b = ::redis::sentinel::SentinelClientBuilder::new(
            addrs,
            &self.target.master_name,
            SentinelServerType::Master,
        )
        .map_err(|e| e.to_string())?;
        if let Some((user, password)) = auth {
            if let Some(u) = user {
                b = b.set_client_to_sentinel_username(u);
            }
            if let Some(p) = password {
                b = b.set_client_to_sentinel_password(p);
            }
        }
        if let Some(u) = &self.target.master_username {
            b = b.set_client_to_redis_username(u);
        }
        if let Some(p) = &self.target.master_password {
            b = b.set_client_to_redis_password(p);
        }
        if tls > 0 {
            b = b.set_client_to_redis_tls_mode(TlsMode::Secure);
            if let Some(certs) = self.options.tls_certificates() {
                b = b
                    .set_client_to_sentinel_certificates(certs.clone())
                    .set_client_to_redis_certificates(certs);
            }
        }
        b.build().map_err(|e| e.to_string())
    }
}

/// The master in use.
#[derive(Clone)]
struct Master {
    /// Increments with every discovery, so a stale failure cannot drop a
    /// newer connection.
    generation: u64,
    /// `host:port` as the Sentinels reported it.
    addr: String,
    conn: MultiplexedConnection,
}

impl std::fmt::Debug for Master {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Master")
            .field("generation", &self.generation)
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct Inner {
    master: Mutex<Option<Master>>,
    /// Wakes the discovery task.
    wake: Notify,
    /// The generation of the latest master found.
    ready: watch::Sender<u64>,
    /// The calls (redacting the master's password from their errors).
    pipeline: Pipeline,
    breaker: CircuitBreaker,
    /// The queue of the master's script calls (many requests per call).
    queue: BatchQueue,
    /// The Sentinels' password (redacted from discovery errors).
    sentinel_secret: Option<String>,
    /// Sentinel addresses with passwords redacted, for logs.
    sentinels: String,
    master_name: String,
}

/// Token buckets in the Redis master watched by Sentinel. Cheap to clone.
#[derive(Debug, Clone)]
pub struct RedisSentinelStorage {
    inner: Arc<Inner>,
}

impl RedisSentinelStorage {
    /// Options for a backend on master `master_name` watched by `sentinels`
    /// (`host:port` or `redis[s]://[user:password@]host:port` of each
    /// Sentinel; `rediss://` makes the Sentinel and master connections TLS).
    #[must_use]
    pub fn builder<S: Into<String>>(
        sentinels: impl IntoIterator<Item = S>,
        master_name: impl Into<String>,
    ) -> RedisSentinelStorageBuilder {
        RedisBuilder::new(SentinelMaster {
            sentinels: sentinels.into_iter().map(Into::into).collect(),
            master_name: master_name.into(),
            master_username: None,
            master_password: None,
        })
    }

    /// The Sentinel addresses (passwords redacted), comma-separated.
    #[must_use]
    pub fn sentinels(&self) -> &str {
        &self.inner.sentinels
    }

    /// `host:port` of the master in use, if one is known now.
    #[must_use]
    pub fn master_addr(&self) -> Option<String> {
        self.inner.master.lock().as_ref().map(|m| m.addr.clone())
    }

    /// How many times a master has been found (1 after startup, +1 per
    /// rediscovery).
    #[must_use]
    pub fn discoveries(&self) -> u64 {
        *self.inner.ready.borrow()
    }

    /// Whether the circuit breaker is open now.
    #[must_use]
    pub fn circuit_open(&self) -> bool {
        self.inner.breaker.is_open()
    }

    fn spawn_discovery(&self, mut client: SentinelClient) {
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let mut generation = 0u64;
            let mut failing = false;
            // Every Sentinel failed the last check while a master is known.
            let mut sentinels_down = false;
            loop {
                let Some(inner) = weak.upgrade() else { return };
                let known = inner.master.lock().as_ref().map(|m| m.addr.clone());
                if known.is_some()
                    && tokio::time::timeout(CHECK_INTERVAL, inner.wake.notified())
                        .await
                        .is_ok()
                {
                    // A failure report: the loop sees the dropped master.
                    continue;
                }
                let budget = inner.pipeline.timeout.max(MIN_CONNECT_TIMEOUT) * 2;
                let found =
                    tokio::time::timeout(budget, discover(&mut client, &inner, known.as_deref()))
                        .await;
                let answered = matches!(found, Ok(Ok(_)));
                if answered && sentinels_down {
                    tracing::info!(name = %inner.master_name, sentinels = %inner.sentinels, "a Sentinel answers again; failovers are followed again");
                    sentinels_down = false;
                }
                match found {
                    Ok(Ok(None)) => {}
                    Ok(Ok(Some((addr, conn)))) => {
                        generation += 1;
                        match &known {
                            Some(old) => {
                                tracing::warn!(old = %old, master = %addr, name = %inner.master_name, generation, "Sentinel names a new Redis master; switching");
                                // What the old master said about buckets may
                                // not hold on the new one (replication lag),
                                // and its script clock is its own: checked
                                // before it serves.
                                inner.pipeline.clear_cache();
                                inner.pipeline.clock.forget();
                            }
                            None => {
                                if generation > 1 {
                                    // Found again after the one in use
                                    // failed (a `READONLY` of a demoted
                                    // master, say): as for a switch.
                                    inner.pipeline.clear_cache();
                                    inner.pipeline.clock.forget();
                                }
                                tracing::info!(master = %addr, name = %inner.master_name, sentinels = %inner.sentinels, generation, "Redis master found through Sentinel");
                            }
                        }
                        *inner.master.lock() = Some(Master {
                            generation,
                            addr,
                            conn,
                        });
                        inner.ready.send_replace(generation);
                        failing = false;
                    }
                    // Sentinels unreachable while a master is known: keep
                    // it, and say so once: a failover now goes unseen.
                    _ if known.is_some() => {
                        if !sentinels_down {
                            let why = match &found {
                                Ok(Err(e)) => redact(
                                    &inner.pipeline.classify(e).to_string(),
                                    inner.sentinel_secret.as_deref(),
                                ),
                                _ => format!("no answer within {budget:?}"),
                            };
                            tracing::warn!(name = %inner.master_name, sentinels = %inner.sentinels, master = %known.as_deref().unwrap_or(""), error = %why, "no Sentinel answers; keeping the known Redis master, but a failover is not seen until a Sentinel answers again");
                            sentinels_down = true;
                        }
                    }
                    Ok(Err(e)) => {
                        if !failing {
                            let e = inner.pipeline.classify(&e);
                            let e = redact(&e.to_string(), inner.sentinel_secret.as_deref());
                            tracing::warn!(name = %inner.master_name, sentinels = %inner.sentinels, error = %e, "no Redis master through Sentinel yet; retrying");
                        }
                        failing = true;
                        drop(inner);
                        tokio::time::sleep(DISCOVERY_RETRY).await;
                    }
                    Err(_) => {
                        if !failing {
                            tracing::warn!(name = %inner.master_name, sentinels = %inner.sentinels, "Sentinel discovery timed out; retrying");
                        }
                        failing = true;
                        drop(inner);
                        tokio::time::sleep(DISCOVERY_RETRY).await;
                    }
                }
            }
        });
    }
}

/// Asks the Sentinels for the master; unless it is `known`, connects and
/// loads the script (`None`: still `known`).
async fn discover(
    client: &mut SentinelClient,
    inner: &Inner,
    known: Option<&str>,
) -> Result<Option<(String, MultiplexedConnection)>, ::redis::RedisError> {
    let master = client.async_get_client().await?;
    let addr = master.get_connection_info().addr().to_string();
    if known == Some(addr.as_str()) {
        return Ok(None);
    }
    let timeout = inner.pipeline.timeout;
    let config = AsyncConnectionConfig::new()
        .set_response_timeout(Some(timeout))
        .set_connection_timeout(Some(timeout.max(MIN_CONNECT_TIMEOUT)));
    let mut conn = master
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    // Best effort: a promoted replica normally has the library (Redis
    // replicates it) but not the script; `Function not found` or
    // `NOSCRIPT` would load them on first use anyway.
    if let Err(e) = inner.pipeline.script.load(&mut conn).await {
        tracing::debug!(error = %redact(&e.to_string(), inner.pipeline.secret.as_deref()), "loading the token bucket library on the new master failed; the first call loads it");
    }
    Ok(Some((addr, conn)))
}

impl Inner {
    /// The current master, waiting (within the caller's timeout) for the
    /// discovery task when none is known.
    async fn master(&self) -> Master {
        let mut rx = self.ready.subscribe();
        loop {
            if let Some(m) = self.master.lock().clone() {
                return m;
            }
            self.wake.notify_one();
            if rx.changed().await.is_err() {
                // The sender lives in `self`; cannot happen while borrowed.
                std::future::pending::<()>().await;
            }
        }
    }

    /// Drops the connection of `generation` (if still in use) and wakes the
    /// discovery task.
    fn rediscover(&self, generation: u64, why: &StorageError) {
        let mut m = self.master.lock();
        if m.as_ref().is_some_and(|m| m.generation == generation) {
            tracing::warn!(master = %m.as_ref().map_or("", |m| m.addr.as_str()), error = %why, "Redis master connection failed; asking Sentinel for the master again");
            *m = None;
            drop(m);
            self.wake.notify_one();
        }
    }
}

/// Whether an error means the node we talk to may no longer be the master.
fn needs_rediscovery(e: &StorageError) -> bool {
    match e {
        StorageError::Unreachable { .. } => true,
        StorageError::Backend { kind, .. } => matches!(
            kind,
            BackendKind::ReadOnly | BackendKind::MasterDown | BackendKind::Loading
        ),
        StorageError::Timeout(_) | StorageError::CircuitOpen => false,
    }
}

/// The master Sentinel names: waited for while none is known; a failure
/// that says it may no longer be the master (or repeated timeouts) makes the
/// discovery task ask the Sentinels again.
impl ConnSource for Inner {
    type Conn = MultiplexedConnection;
    /// The master's generation.
    type Tag = u64;

    async fn connection(&self) -> Result<(u64, MultiplexedConnection), StorageError> {
        let master = self.master().await;
        Ok((master.generation, master.conn))
    }

    fn eval<'a>(
        &'a self,
        conn: &'a mut MultiplexedConnection,
        script: &'a BucketScript,
        call: &'a ScriptCall,
    ) -> impl Future<Output = Result<Value, RedisError>> + Send + 'a {
        script.eval(conn, call)
    }

    fn no_connection(&self, _timeout: Duration) -> StorageError {
        StorageError::unreachable(format!(
            "no Redis master known for {} (Sentinel discovery in progress)",
            self.master_name
        ))
    }

    fn after(
        &self,
        generation: Option<u64>,
        result: &Result<RequestResult, StorageError>,
        breaker: &CircuitBreaker,
    ) {
        let (Some(g), Err(e)) = (generation, result) else {
            return;
        };
        // Repeated timeouts may be a master cut off by a partition
        // (Sentinel cannot disconnect us from it): ask again.
        let stuck = matches!(e, StorageError::Timeout(_)) && breaker.is_open();
        if needs_rediscovery(e) || stuck {
            self.rediscover(g, e);
        }
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
impl Storage for RedisSentinelStorage {
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
        let mut generation = None;
        let attempt = async {
            let master = inner.master().await;
            generation = Some(master.generation);
            let mut conn = master.conn;
            ::redis::cmd("ROLE")
                .query_async::<::redis::Value>(&mut conn)
                .await
        };
        let timeout = inner.pipeline.timeout;
        let out = tokio::time::timeout(timeout, attempt).await;
        let result = match out {
            Err(_) if generation.is_none() => Err(StorageError::unreachable(format!(
                "no Redis master known for {}",
                inner.master_name
            ))),
            Err(_) => Err(StorageError::Timeout(timeout)),
            Ok(Err(e)) => Err(inner.pipeline.classify(&e)),
            Ok(Ok(v)) => {
                // ROLE: ["master", offset, replicas] on a master.
                let is_master = matches!(&v, ::redis::Value::Array(items)
                    if matches!(items.first(), Some(::redis::Value::BulkString(b)) if b == b"master"));
                if is_master {
                    // The master's script clock, checked once per master.
                    inner.pipeline.clock_gate(&**inner).await
                } else {
                    Err(StorageError::backend(
                        BackendKind::ReadOnly,
                        "the node Sentinel named is no longer a master",
                    ))
                }
            }
        };
        // A `ROLE` answer says nothing about whether charges work: it never
        // closes the circuit breaker, only a charge that worked does.
        match &result {
            Ok(()) => {}
            Err(e) => {
                if let Some(g) = generation
                    && needs_rediscovery(e)
                {
                    inner.rediscover(g, e);
                }
            }
        }
        result
    }

    fn name(&self) -> &'static str {
        "redis-sentinel"
    }

    fn invalidate_local_cache(&self) {
        self.inner.pipeline.clear_cache();
    }

    fn hold_existing(&self, prefix: &str, hold_us: u64) {
        // Without a master now, there is nothing reachable to extend; the
        // next master's keys are as replication left them.
        let conn = self.inner.master.lock().as_ref().map(|m| m.conn.clone());
        match conn {
            Some(conn) => {
                hold::spawn_hold(
                    &self.inner.pipeline.holds,
                    conn,
                    prefix,
                    hold_us,
                    self.inner.pipeline.secret.clone(),
                );
            }
            None => tracing::warn!(
                "no Redis master known during a reload; existing buckets were not extended"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demoted_or_lost_masters_are_rediscovered() {
        let backend = |kind| StorageError::backend(kind, "");
        assert!(needs_rediscovery(&StorageError::unreachable("reset")));
        assert!(needs_rediscovery(&backend(BackendKind::ReadOnly)));
        assert!(needs_rediscovery(&backend(BackendKind::MasterDown)));
        assert!(needs_rediscovery(&backend(BackendKind::Loading)));
        assert!(!needs_rediscovery(&backend(BackendKind::Script)));
        assert!(!needs_rediscovery(&backend(BackendKind::NoScript)));
        assert!(!needs_rediscovery(&StorageError::Timeout(
            Duration::from_millis(50)
        )));
        assert!(!needs_rediscovery(&StorageError::CircuitOpen));
    }

    #[tokio::test]
    async fn refuses_an_empty_setup() {
        assert!(
            RedisSentinelStorage::builder(Vec::<String>::new(), "m")
                .build()
                .is_err()
        );
        assert!(
            RedisSentinelStorage::builder(["127.0.0.1:1"], "")
                .build()
                .is_err()
        );
        let s = RedisSentinelStorage::builder(["redis://:pw@127.0.0.1:1"], "m")
            .build()
            .expect("valid");
        assert_eq!(s.sentinels(), "redis://:***@127.0.0.1:1");
        assert_eq!(s.master_addr(), None);
    }

    /// Setups the crate would accept but run differently from what was
    /// asked: each is refused with an error naming the problem, and a
    /// password never appears in it.
    #[tokio::test]
    async fn refuses_inconsistent_tls_and_credentials() {
        let err = |b: RedisSentinelStorageBuilder| match b.build() {
            Ok(_) => panic!("accepted"),
            Err(e) => e.to_string(),
        };
        let e = err(RedisSentinelStorage::builder(
            ["redis://:pw1@127.0.0.1:1", "redis://:pw2@127.0.0.1:2"],
            "m",
        ));
        assert!(e.contains("same user and password"), "{e}");
        assert!(!e.contains("pw1") && !e.contains("pw2"), "{e}");
        let e = err(RedisSentinelStorage::builder(
            ["rediss://127.0.0.1:1", "redis://127.0.0.1:2"],
            "m",
        ));
        assert!(e.contains("use one scheme"), "{e}");
        let e =
            err(RedisSentinelStorage::builder(["127.0.0.1:1"], "m")
                .tls_root_ca_pem(b"pem".to_vec()));
        assert!(e.contains("not rediss://"), "{e}");
        RedisSentinelStorage::builder(["rediss://:pw@127.0.0.1:1"], "m")
            .master_auth(Some("app".into()), Some("secret".into()))
            .build()
            .expect("TLS Sentinels with master credentials");
    }
}
