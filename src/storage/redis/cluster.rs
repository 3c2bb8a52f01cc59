//! The `redis` backend on a **Redis Cluster** (`--redis-cluster host:port,...`).
//!
//! # No `CROSSSLOT`, ever
//! A script may only touch keys of one hash slot. Every bucket key's slot is
//! computed here ([`key_slot`], CRC16 of the key as Redis does) from the
//! injective key encoding of [`key`](crate::storage::key), which escapes `{`
//! and `}`, so client text can never form a hash tag and move a bucket to
//! another slot (BR-05, BR-28). The charges of one request are grouped by slot
//! and each script call carries the keys of exactly one slot, all in `KEYS`.
//!
//! # All-or-nothing across slots: reservation and refund
//! A request whose keys all share one slot is one script call, exactly as on a
//! single node. Otherwise:
//!
//! 1. **Reserve.** Every slot that holds a consume charge gets one script call
//!    with that slot's charges, **all slots in parallel** (latency is one round
//!    trip whatever the number of slots, BR-29). Each call is atomic on its node
//!    and charges only if every non-shadow charge of *its* slot fits. Refund
//!    charges (`is_negative_hits`) are not applied in this phase; their buckets
//!    are read with a cost-0 shadow check instead (which writes nothing).
//! 2. **Admitted everywhere:** the request is admitted. Refund charges, if
//!    any, are then applied (one call per slot, in parallel), and every charge
//!    on a refunded bucket reports the tokens after the refund. If that call
//!    fails, the request answers `UNAVAILABLE` although its consumes stand
//!    (the refund is lost: under-admission only).
//! 3. **Denied (or failed) somewhere:** every slot that did charge gets a
//!    compensating call giving back exactly the tokens it took (the script's
//!    refund kind, capped at capacity), in parallel; the answer (`OVER_LIMIT`,
//!    or the error) is sent once the compensation is done, so the next request
//!    of the same client already sees the buckets as they were. Statuses report
//!    the tokens each bucket had before the reservation (tokens after the
//!    reservation plus what it took), as a single node would.
//!
//! **Why it never over-admits:** a request is admitted only if every slot
//! admitted its own charges atomically, with the tokens actually present; a
//! reservation only ever *removes* tokens, so a concurrent request can only
//! see fewer tokens than it would on a single node, never more. The
//! compensating refund gives back no more than was taken and is capped at the
//! capacity, so it can never create tokens either.
//!
//! **Window of inconsistency:** between a reservation and its compensating
//! refund (one round trip, bounded by `--redis-timeout`), the reserved tokens
//! are missing, so a concurrent request on the same bucket may be denied
//! although a single node would have admitted it (under-admission only). If a
//! slot's call times out, its outcome is unknown and it is never replayed nor
//! compensated (BR-24): the request answers `UNAVAILABLE` and at most the one
//! reservation of that slot is lost until its bucket refills. A lost
//! compensating call (node down) likewise only under-admits; it is logged and
//! counted as `bucket_rls_storage_errors_total{kind="cluster_refund_lost"}`.
//!
//! **Difference from a single node:** in a request that spans several slots,
//! a refund and a consume of the *same* bucket are applied consumes first (a
//! single node applies them in request order); the outcome differs only when
//! the refund would have been capped at the capacity. Everything else,
//! statuses included, is identical when no other traffic interleaves.
//!
//! # Redirects, failover and lost slots
//! The `redis` crate's cluster client keeps the slot map and one multiplexed
//! connection per node; it is built with **no automatic retries**, because it
//! would otherwise resend a command after a dropped connection or a timeout,
//! when the script may already have run (BR-24). Instead each slot call here
//! follows `MOVED` (to the named node; the client refreshes its slot map) and
//! `ASK` (`ASKING` then the call, on the named node), waits briefly and retries
//! on `TRYAGAIN` (keys of a slot split by a migration), and answers `NOSCRIPT`
//! with one `EVAL` of the full source (which also loads the script on that
//! node, e.g. a replica promoted by a failover; BR-23): each of these replies
//! proves the script did not run, so the retry is safe. `READONLY` fails the
//! call. All of it is bounded by `--redis-timeout` per slot call.
//!
//! A slot whose node is unreachable (its master died, or master and replicas
//! are lost, or the cluster reports `CLUSTERDOWN`) fails with
//! [`StorageError::Backend`] of kind `CLUSTERDOWN`, for the whole request
//! (`UNAVAILABLE`), and only for requests that touch it: other slots keep
//! working. Such a failure (and `READONLY`) also makes the background task
//! reconnect to the cluster, at most once a second, for a fresh slot map: that
//! is how a replica promoted by a failover is found (the client alone keeps
//! routing the slots to the vanished node); in the tests the slots answer again
//! about 2 s after their master is killed (node timeout 1 s). For that the cluster must run with `cluster-require-full-coverage
//! no`; with the default `yes`, Redis itself refuses every slot while any slot
//! is uncovered. Each slot has its own circuit breaker
//! ([`breaker`](super::breaker)), so a lost slot range never opens the breaker
//! of the others.
//!
//! The local over-limit cache ([`local_cache`](super::local_cache)) only
//! learns from calls during which no compensation of this replica completed
//! (a denial seen then may come from a reservation given back since), and a
//! compensation forgets the buckets it refunded; compensations of *other*
//! replicas are not seen, like their refunds. The
//! timeout and the test-only explicit clock work as in the single-node
//! [`RedisStorage`](super::RedisStorage).

use super::breaker::CircuitBreaker;
use super::local_cache::LocalCache;
use super::script::{BucketScript, SOURCE, ScriptCall, classify, is_transient, redact};
use super::{
    DEFAULT_BREAKER_THRESHOLD, DEFAULT_LOCAL_CACHE_SIZE, DEFAULT_PROBE_INTERVAL, DEFAULT_TIMEOUT,
    RedisSetupError, install_crypto_provider,
};
use crate::metrics as m;
use crate::storage::bucket::{ChargeKind, ChargeResult, ChargeSpec, MICRO, RequestResult};
use crate::storage::clock::Clock;
use crate::storage::{Charge, Storage, StorageError};
use ::redis::cluster::ClusterClientBuilder;
use ::redis::cluster_async::ClusterConnection;
use ::redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use ::redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};
use async_trait::async_trait;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// Number of hash slots of a Redis Cluster.
pub const SLOTS: u16 = 16_384;
/// Redirects (`MOVED`, `ASK`), `TRYAGAIN` waits and `NOSCRIPT` reloads one
/// slot call may go through before it gives up (within its timeout anyway).
const MAX_ATTEMPTS: usize = 6;
/// Wait before retrying after `TRYAGAIN` (a slot being migrated).
const TRYAGAIN_DELAY: Duration = Duration::from_millis(5);
/// Shortest connect timeout.
const MIN_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Delay between attempts of the first connection while the cluster is down.
const CONNECT_RETRY: Duration = Duration::from_millis(500);
/// Shortest time between two reconnections for a fresh slot map.
const REFRESH_INTERVAL: Duration = Duration::from_secs(1);

/// The hash slot of `key` (CRC16/XMODEM of the key, or of its hash tag, modulo
/// 16,384), as Redis Cluster computes it. Keys made by
/// [`key::encode`](crate::storage::key::encode) never contain a hash tag from
/// client text; a `{tag}` in the configured key prefix applies to every key.
#[must_use]
pub fn key_slot(key: &str) -> u16 {
    key_slot_bytes(key.as_bytes())
}

/// [`key_slot`] of a key that may not be UTF-8 (a key found by `SCAN`).
fn key_slot_bytes(b: &[u8]) -> u16 {
    let hashed = b
        .iter()
        .position(|c| *c == b'{')
        .and_then(|open| {
            let close = b[open + 1..].iter().position(|c| *c == b'}')?;
            (close > 0).then(|| &b[open + 1..open + 1 + close])
        })
        .unwrap_or(b);
    crc16_xmodem(hashed) % SLOTS
}

fn crc16_xmodem(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for byte in data {
        crc ^= u16::from(*byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// Options of the Cluster backend; see [`RedisClusterStorage::builder`].
#[derive(Debug, Clone)]
pub struct RedisClusterStorageBuilder {
    nodes: Vec<String>,
    timeout: Duration,
    local_cache_size: usize,
    breaker_threshold: u32,
    probe_interval: Duration,
    test_clock: Option<Arc<dyn Clock>>,
    tls_root_ca_pem: Option<Vec<u8>>,
}

impl RedisClusterStorageBuilder {
    common_builder_options!();

    /// Builds the backend without waiting for the cluster: a background task
    /// connects (retrying every 500 ms while no seed node answers) and loads
    /// the script on every master; calls fail with
    /// [`StorageError::Unreachable`] until then. Must be called inside a Tokio
    /// runtime.
    ///
    /// # Errors
    /// [`RedisSetupError::InvalidUrl`] when no seed node is given or one does
    /// not parse.
    pub fn build(self) -> Result<RedisClusterStorage, RedisSetupError> {
        install_crypto_provider();
        let (urls, shown, secret) = super::node_urls(&self.nodes);
        if urls.is_empty() {
            return Err(RedisSetupError::InvalidUrl {
                url: String::new(),
                message: "no Redis Cluster seed node given".into(),
            });
        }
        let mut builder = ClusterClientBuilder::new(urls.iter().map(String::as_str))
            // No automatic retry: the crate would resend after a dropped
            // connection or a timeout (BR-24); redirects are followed here.
            .retries(0)
            .connection_timeout(self.timeout.max(MIN_CONNECT_TIMEOUT))
            .response_timeout(self.timeout);
        if let Some(pem) = &self.tls_root_ca_pem {
            // The crate would switch plain `redis://` seeds to TLS silently.
            if let Some(plain) = urls.iter().find(|u| !u.starts_with("rediss://")) {
                return Err(RedisSetupError::InvalidUrl {
                    url: shown.clone(),
                    message: format!(
                        "a TLS CA file is given but seed node {} is not rediss://",
                        super::redact_url(plain)
                    ),
                });
            }
            builder = builder.certs(::redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(pem.clone()),
            });
        }
        let client = builder.build().map_err(|e| RedisSetupError::InvalidUrl {
            url: shown.clone(),
            message: redact(&e.to_string(), secret.as_deref()),
        })?;
        let storage = RedisClusterStorage {
            inner: Arc::new(Inner {
                conn: RwLock::new(None),
                refresh: Notify::new(),
                script: BucketScript::new(),
                timeout: self.timeout,
                breakers: Mutex::new(HashMap::new()),
                breaker_threshold: self.breaker_threshold,
                probe_interval: self.probe_interval,
                cache: (self.local_cache_size > 0).then(|| LocalCache::new(self.local_cache_size)),
                compensations: AtomicU64::new(0),
                test_clock: self.test_clock,
                secret,
                nodes: shown,
                epoch: Instant::now(),
            }),
        };
        storage.spawn_connect(client);
        Ok(storage)
    }
}

/// The cluster client's connection (which has no `Debug`).
#[derive(Clone)]
struct Conn(ClusterConnection);

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterConnection")
    }
}

#[derive(Debug)]
struct Inner {
    conn: RwLock<Option<Conn>>,
    /// Wakes the connection task to reconnect (fresh slot map).
    refresh: Notify,
    script: BucketScript,
    timeout: Duration,
    /// One breaker per hash slot, made on first use (at most [`SLOTS`]).
    breakers: Mutex<HashMap<u16, Arc<CircuitBreaker>>>,
    breaker_threshold: u32,
    probe_interval: Duration,
    cache: Option<LocalCache>,
    /// Compensations completed so far (see [`Inner::record`]).
    compensations: AtomicU64,
    test_clock: Option<Arc<dyn Clock>>,
    secret: Option<String>,
    /// Seed nodes with passwords redacted, for logs.
    nodes: String,
    epoch: Instant,
}

/// Token buckets in a Redis Cluster. Cheap to clone (shared state).
#[derive(Debug, Clone)]
pub struct RedisClusterStorage {
    inner: Arc<Inner>,
}

/// The outcome of one slot's call.
type SlotOutcome = Result<RequestResult, StorageError>;

impl RedisClusterStorage {
    /// Options for a backend on the cluster reached through `nodes` (seed
    /// nodes as `host:port` or `redis[s]://[user:password@]host:port`; any
    /// one answering is enough, the others are found through it; `rediss://`
    /// seeds make every node connection TLS).
    #[must_use]
    pub fn builder<S: Into<String>>(
        nodes: impl IntoIterator<Item = S>,
    ) -> RedisClusterStorageBuilder {
        RedisClusterStorageBuilder {
            nodes: nodes.into_iter().map(Into::into).collect(),
            timeout: DEFAULT_TIMEOUT,
            local_cache_size: DEFAULT_LOCAL_CACHE_SIZE,
            breaker_threshold: DEFAULT_BREAKER_THRESHOLD,
            probe_interval: DEFAULT_PROBE_INTERVAL,
            test_clock: None,
            tls_root_ca_pem: None,
        }
    }

    /// The seed nodes (passwords redacted), comma-separated.
    #[must_use]
    pub fn nodes(&self) -> &str {
        &self.inner.nodes
    }

    /// Whether the first connection to the cluster has been made.
    #[must_use]
    pub fn connected(&self) -> bool {
        self.inner.conn.read().is_some()
    }

    /// Whether the circuit breaker of hash slot `slot` is open now.
    #[must_use]
    pub fn circuit_open(&self, slot: u16) -> bool {
        self.inner
            .breakers
            .lock()
            .get(&slot)
            .is_some_and(|b| b.is_open())
    }

    /// Connects in the background, and again whenever a slot call reports
    /// its slot unreachable (at most once per [`REFRESH_INTERVAL`]): a fresh
    /// connection reads the slot map anew from the seed nodes, which is how
    /// a replica promoted by a failover is found (the client keeps a
    /// vanished node's slots otherwise).
    fn spawn_connect(&self, client: ::redis::cluster::ClusterClient) {
        let inner = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let mut warned = false;
            loop {
                let Some(strong) = inner.upgrade() else {
                    return;
                };
                let first = strong.conn.read().is_none();
                if !first {
                    // Wait for a report of an unreachable slot.
                    let woken =
                        tokio::time::timeout(Duration::from_secs(1), strong.refresh.notified())
                            .await
                            .is_ok();
                    if !woken {
                        continue;
                    }
                }
                let wait = strong.timeout.max(MIN_CONNECT_TIMEOUT) * 4;
                match tokio::time::timeout(wait, client.get_async_connection()).await {
                    Ok(Ok(mut conn)) => {
                        let loaded = tokio::time::timeout(
                            wait,
                            ::redis::cmd("SCRIPT")
                                .arg("LOAD")
                                .arg(SOURCE)
                                .query_async::<Value>(&mut conn),
                        )
                        .await;
                        if !matches!(loaded, Ok(Ok(_))) {
                            tracing::debug!(nodes = %strong.nodes, "could not load the token bucket script on every master; NOSCRIPT loads it on first use");
                        }
                        *strong.conn.write() = Some(Conn(conn));
                        if first {
                            tracing::info!(nodes = %strong.nodes, sha = strong.script.sha(), "Redis Cluster answers");
                        } else {
                            tracing::info!(nodes = %strong.nodes, "reconnected to the Redis Cluster (fresh slot map)");
                        }
                        warned = false;
                    }
                    Ok(Err(e)) if !warned => {
                        let e = classify(&e, strong.timeout, strong.secret.as_deref());
                        tracing::warn!(nodes = %strong.nodes, error = %e, "Redis Cluster not reachable; serving anyway (storage errors until it answers)");
                        warned = true;
                    }
                    Err(_) if !warned => {
                        tracing::warn!(nodes = %strong.nodes, "Redis Cluster does not answer; serving anyway (storage errors until it answers)");
                        warned = true;
                    }
                    _ => {}
                }
                if !first {
                    // Rate limit: reconnect at most once per interval.
                    drop(strong);
                    tokio::time::sleep(REFRESH_INTERVAL).await;
                    continue;
                }
                let connected = strong.conn.read().is_some();
                drop(strong);
                if !connected {
                    tokio::time::sleep(CONNECT_RETRY).await;
                }
            }
        });
    }

    fn local_now_us(&self) -> u64 {
        match &self.inner.test_clock {
            Some(c) => c.now_us(),
            None => u64::try_from(self.inner.epoch.elapsed().as_micros()).unwrap_or(u64::MAX),
        }
    }
}

impl Inner {
    fn breaker(&self, slot: u16) -> Arc<CircuitBreaker> {
        self.breakers
            .lock()
            .entry(slot)
            .or_insert_with(|| {
                Arc::new(CircuitBreaker::new(
                    self.breaker_threshold,
                    self.probe_interval,
                ))
            })
            .clone()
    }

    /// Teaches the local cache Redis's answer, unless a compensation of this
    /// replica completed since the call was sent (`epoch`): a denial may then
    /// have been caused by a reservation that has since been given back, so
    /// the request's buckets are forgotten instead of cached as short. A
    /// compensation also forgets the buckets it refunded.
    fn record(&self, charges: &[Charge], result: &RequestResult, sent_us: u64, epoch: u64) {
        let Some(cache) = &self.cache else { return };
        if self.compensations.load(Ordering::SeqCst) == epoch {
            cache.record(charges, result, sent_us);
            // A compensation that completed while recording may have
            // forgotten its buckets just before this insert: check again.
            if self.compensations.load(Ordering::SeqCst) == epoch {
                return;
            }
        }
        {
            let forget: Vec<Charge> = charges
                .iter()
                .map(|c| Charge {
                    key: c.key.clone(),
                    spec: ChargeSpec {
                        kind: ChargeKind::Refund,
                        ..c.spec
                    },
                })
                .collect();
            cache.before_call(&forget);
        }
    }

    fn connection(&self) -> Result<ClusterConnection, StorageError> {
        self.conn
            .read()
            .as_ref()
            .map(|c| c.0.clone())
            .ok_or_else(|| {
                StorageError::Unreachable("not connected to the Redis Cluster yet".into())
            })
    }

    /// One atomic script call for `charges`, all in hash slot `slot`, bounded
    /// by the timeout; records the outcome in the slot's breaker.
    async fn call_slot(&self, slot: u16, charges: &[Charge], now_us: Option<u64>) -> SlotOutcome {
        let call = ScriptCall::new(charges, now_us)?;
        let mut conn = self.connection()?;
        let breaker = self.breaker(slot);
        let started = Instant::now();
        let result = match tokio::time::timeout(
            self.timeout,
            eval_in_slot(&mut conn, &self.script, slot, &call),
        )
        .await
        {
            Err(_) => Err(StorageError::Timeout(self.timeout)),
            Ok(Err(e)) => Err(self.classify(slot, &e)),
            Ok(Ok(v)) => call.parse_reply(&v),
        };
        match &result {
            Ok(_) => breaker.success(),
            Err(e) => {
                if is_transient(e) {
                    breaker.failure_of_call_started(started);
                }
                if matches!(e.kind(), "CLUSTERDOWN" | "READONLY" | "MASTERDOWN") {
                    self.refresh.notify_one();
                }
            }
        }
        result
    }

    /// [`classify`], with an unreachable slot owner reported as `CLUSTERDOWN`
    /// (the slot cannot be served) and the slot named in the message.
    fn classify(&self, slot: u16, e: &RedisError) -> StorageError {
        let lost = e.kind() == ErrorKind::ClusterConnectionNotFound;
        match classify(e, self.timeout, self.secret.as_deref()) {
            StorageError::Unreachable(message) => StorageError::Backend {
                kind: "CLUSTERDOWN".into(),
                message: format!("hash slot {slot} unreachable: {message}"),
            },
            StorageError::Backend { message, .. } if lost => StorageError::Backend {
                kind: "CLUSTERDOWN".into(),
                message: format!("hash slot {slot} not served: {message}"),
            },
            StorageError::Backend { kind, message } => StorageError::Backend {
                kind,
                message: format!("hash slot {slot}: {message}"),
            },
            other => other,
        }
    }

    /// The request spread over several slots: reservation, then commit of
    /// refunds or compensation (see the module docs).
    async fn apply_slots(
        self: Arc<Self>,
        charges: Vec<Charge>,
        slots: Vec<(u16, Vec<usize>)>,
        now_us: Option<u64>,
    ) -> Result<RequestResult, StorageError> {
        let is_refund = |i: usize| charges[i].spec.kind == ChargeKind::Refund;
        let has_consume = charges.iter().any(|c| c.spec.kind == ChargeKind::Consume);
        let mut results: Vec<Option<ChargeResult>> = vec![None; charges.len()];

        if has_consume {
            // Phase 1: reserve, every slot in parallel.
            let calls = slots.iter().map(|(slot, idx)| {
                let part: Vec<Charge> = idx
                    .iter()
                    .map(|&i| {
                        if is_refund(i) {
                            probe(&charges[i])
                        } else {
                            charges[i].clone()
                        }
                    })
                    .collect();
                let inner = &self;
                async move { inner.call_slot(*slot, &part, now_us).await }
            });
            let outcomes: Vec<SlotOutcome> = futures::future::join_all(calls).await;
            let all_admitted = outcomes.iter().all(|o| matches!(o, Ok(r) if r.admitted));
            if !all_admitted {
                return self.compensate(&charges, &slots, outcomes, now_us).await;
            }
            for ((_, idx), outcome) in slots.iter().zip(outcomes) {
                let Ok(r) = outcome else {
                    unreachable!("all admitted")
                };
                for (&i, mut cr) in idx.iter().zip(r.charges) {
                    if is_refund(i) {
                        cr.enough = true;
                    }
                    results[i] = Some(cr);
                }
            }
        }

        // Phase 2 (or the only phase of a refund-only request): refunds.
        let refund_slots: Vec<(u16, Vec<usize>)> = slots
            .iter()
            .map(|(slot, idx)| {
                (
                    *slot,
                    idx.iter()
                        .copied()
                        .filter(|&i| is_refund(i))
                        .collect::<Vec<_>>(),
                )
            })
            .filter(|(_, idx)| !idx.is_empty())
            .collect();
        if !refund_slots.is_empty() {
            let calls = refund_slots.iter().map(|(slot, idx)| {
                let part: Vec<Charge> = idx.iter().map(|&i| charges[i].clone()).collect();
                let inner = &self;
                async move { inner.call_slot(*slot, &part, now_us).await }
            });
            let outcomes = futures::future::join_all(calls).await;
            let mut after: HashMap<&str, u64> = HashMap::new();
            for ((_, idx), outcome) in refund_slots.iter().zip(outcomes) {
                let r = outcome?;
                for (&i, cr) in idx.iter().zip(r.charges) {
                    after.insert(charges[i].key.as_str(), cr.tokens_micro);
                    results[i] = Some(cr);
                }
            }
            // Every charge on a refunded bucket reports the tokens after the
            // whole request, as on a single node.
            for (c, r) in charges.iter().zip(results.iter_mut()) {
                if let (Some(t), Some(r)) = (after.get(c.key.as_str()), r.as_mut()) {
                    r.tokens_micro = *t;
                }
            }
        }
        Ok(RequestResult {
            admitted: true,
            charges: results
                .into_iter()
                .map(|r| r.expect("every charge belongs to one slot"))
                .collect(),
        })
    }

    /// Gives back what the admitted slots reserved, then answers: the first
    /// error if a slot failed, else `OVER_LIMIT` with the tokens each bucket
    /// had before the reservation.
    async fn compensate(
        &self,
        charges: &[Charge],
        slots: &[(u16, Vec<usize>)],
        outcomes: Vec<SlotOutcome>,
        now_us: Option<u64>,
    ) -> Result<RequestResult, StorageError> {
        let mut results: Vec<Option<ChargeResult>> = vec![None; charges.len()];
        let mut first_error = None;
        let mut refunds: Vec<(u16, Vec<Charge>)> = Vec::new();
        for ((slot, idx), outcome) in slots.iter().zip(outcomes) {
            let r = match outcome {
                Ok(r) => r,
                Err(e) => {
                    first_error.get_or_insert(e);
                    continue;
                }
            };
            // Micro-tokens this slot's call took from each bucket.
            let mut taken: HashMap<&str, u128> = HashMap::new();
            if r.admitted {
                let mut give_back = Vec::new();
                for (&i, cr) in idx.iter().zip(&r.charges) {
                    let c = &charges[i];
                    if c.spec.kind == ChargeKind::Consume && cr.enough && c.spec.cost > 0 {
                        *taken.entry(c.key.as_str()).or_default() +=
                            u128::from(c.spec.cost) * u128::from(MICRO);
                        give_back.push(Charge {
                            key: c.key.clone(),
                            spec: ChargeSpec {
                                kind: ChargeKind::Refund,
                                shadow: false,
                                ..c.spec
                            },
                        });
                    }
                }
                if !give_back.is_empty() {
                    refunds.push((*slot, give_back));
                }
            }
            for (&i, cr) in idx.iter().zip(r.charges) {
                let c = &charges[i];
                let before =
                    u128::from(cr.tokens_micro) + taken.get(c.key.as_str()).copied().unwrap_or(0);
                results[i] = Some(ChargeResult {
                    enough: cr.enough || c.spec.kind == ChargeKind::Refund,
                    tokens_micro: u64::try_from(before.min(c.spec.limit.capacity_micro()))
                        .unwrap_or(u64::MAX),
                });
            }
        }
        let calls = refunds
            .iter()
            .map(|(slot, part)| async move { (*slot, self.call_slot(*slot, part, now_us).await) });
        for (slot, outcome) in futures::future::join_all(calls).await {
            if let Err(e) = outcome {
                metrics::counter!(m::STORAGE_ERRORS, "kind" => "cluster_refund_lost").increment(1);
                tracing::warn!(slot, error = %e, "could not give back a reservation in a Redis Cluster slot; its buckets stay charged until they refill (under-admission only)");
            }
        }
        if !refunds.is_empty() {
            self.compensations.fetch_add(1, Ordering::SeqCst);
            if let Some(cache) = &self.cache {
                for (_, part) in &refunds {
                    cache.before_call(part);
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        // A slot call that did not answer left `None`: impossible here, since
        // every outcome was either an error (returned above) or a result.
        Ok(RequestResult {
            admitted: false,
            charges: results
                .into_iter()
                .map(|r| r.expect("every slot answered"))
                .collect(),
        })
    }
}

/// A cost-0 shadow check on a refund's bucket: reads its tokens, writes
/// nothing, never denies.
fn probe(c: &Charge) -> Charge {
    Charge {
        key: c.key.clone(),
        spec: ChargeSpec {
            kind: ChargeKind::Consume,
            cost: 0,
            shadow: true,
            ..c.spec
        },
    }
}

/// Where the next attempt of a slot call goes.
enum Target {
    /// The slot's master in the client's slot map.
    Slot,
    /// A node named by `MOVED`.
    Moved(String, u16),
    /// A node named by `ASK` (needs `ASKING` first).
    Ask(String, u16),
}

fn script_cmd(script: &BucketScript, call: &ScriptCall, with_source: bool) -> Cmd {
    let mut cmd = if with_source {
        let mut c = ::redis::cmd("EVAL");
        c.arg(SOURCE);
        c
    } else {
        let mut c = ::redis::cmd("EVALSHA");
        c.arg(script.sha());
        c
    };
    cmd.arg(call.keys.len());
    for k in &call.keys {
        cmd.arg(k.as_bytes());
    }
    for a in &call.args {
        cmd.arg(a.as_bytes());
    }
    cmd
}

fn redirect(e: &RedisError) -> Option<(String, u16)> {
    let (addr, _slot) = e.redirect_node()?;
    let (host, port) = addr.rsplit_once(':')?;
    Some((host.to_owned(), port.parse().ok()?))
}

/// Runs one script call on the master of `slot`, following `MOVED` and
/// `ASK`, waiting on `TRYAGAIN` and answering `NOSCRIPT` with one `EVAL`; each
/// of these replies proves the script did not run. Any other error (a
/// timeout, a dropped connection) is returned and never replayed.
async fn eval_in_slot(
    conn: &mut ClusterConnection,
    script: &BucketScript,
    slot: u16,
    call: &ScriptCall,
) -> Result<Value, RedisError> {
    let mut target = Target::Slot;
    let mut with_source = false;
    let mut last = None;
    for _ in 0..MAX_ATTEMPTS {
        let cmd = script_cmd(script, call, with_source);
        let reply = match &target {
            Target::Slot => {
                let route = SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master));
                conn.route_command(cmd, RoutingInfo::SingleNode(route))
                    .await
            }
            Target::Moved(host, port) => {
                let route = SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                };
                conn.route_command(cmd, RoutingInfo::SingleNode(route))
                    .await
            }
            Target::Ask(host, port) => {
                let route = SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                };
                let mut pipe = ::redis::pipe();
                pipe.cmd("ASKING").add_command(cmd);
                conn.route_pipeline(pipe, 1, 1, route)
                    .await
                    .and_then(|mut v| v.pop().unwrap_or(Value::Nil).extract_error())
            }
        };
        // The cluster client returns most server errors as a value.
        let e = match reply.and_then(Value::extract_error) {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        match e.kind() {
            ErrorKind::Server(ServerErrorKind::NoScript) if !with_source => {
                metrics::counter!(m::REDIS_SCRIPT_RELOAD).increment(1);
                tracing::info!(
                    slot,
                    "a Redis Cluster node lost the token bucket script (NOSCRIPT); sending it with EVAL"
                );
                with_source = true;
            }
            ErrorKind::Server(ServerErrorKind::Moved) => match redirect(&e) {
                Some((h, p)) => target = Target::Moved(h, p),
                None => return Err(e),
            },
            ErrorKind::Server(ServerErrorKind::Ask) => match redirect(&e) {
                Some((h, p)) => target = Target::Ask(h, p),
                None => return Err(e),
            },
            ErrorKind::Server(ServerErrorKind::TryAgain) => {
                tokio::time::sleep(TRYAGAIN_DELAY).await;
                target = Target::Slot;
            }
            _ => return Err(e),
        }
        last = Some(e);
    }
    Err(last.unwrap_or_else(|| RedisError::from((ErrorKind::Client, "no attempt made"))))
}

#[async_trait]
impl Storage for RedisClusterStorage {
    async fn apply(&self, charges: &[Charge]) -> Result<RequestResult, StorageError> {
        let inner = &self.inner;
        if let Some(r) =
            super::local_cache::answer_or_note(inner.cache.as_ref(), charges, self.local_now_us())
        {
            return Ok(r);
        }
        let now_us = inner.test_clock.as_ref().map(|c| c.now_us());
        // Group by slot, in first-seen order.
        let mut slots: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, c) in charges.iter().enumerate() {
            let s = key_slot(&c.key);
            match slots.iter_mut().find(|(slot, _)| *slot == s) {
                Some((_, idx)) => idx.push(i),
                None => slots.push((s, vec![i])),
            }
        }
        // Check the arguments once, before anything is reserved.
        ScriptCall::new(charges, now_us)?;
        for (slot, _) in &slots {
            if !inner.breaker(*slot).allow() {
                return Err(StorageError::CircuitOpen);
            }
        }
        let sent_us = self.local_now_us();
        let epoch = inner.compensations.load(Ordering::SeqCst);
        let result = match slots.as_slice() {
            [] => Ok(RequestResult {
                admitted: true,
                charges: Vec::new(),
            }),
            [(slot, _)] => inner.call_slot(*slot, charges, now_us).await,
            _ => {
                // Own task: a caller that goes away (client cancelled) must
                // not cut a reservation off from its compensation.
                let task = tokio::spawn(inner.clone().apply_slots(charges.to_vec(), slots, now_us));
                task.await.unwrap_or_else(|e| {
                    Err(StorageError::Backend {
                        kind: "internal".into(),
                        message: format!("cluster request task failed: {e}"),
                    })
                })
            }
        };
        if let Ok(r) = &result {
            inner.record(charges, r, sent_us, epoch);
        }
        result
    }

    async fn ping(&self) -> Result<(), StorageError> {
        let inner = &self.inner;
        let mut conn = inner.connection()?;
        // Healthy when any node answers: a lost slot range must not take the
        // whole service out of rotation.
        let mut last = StorageError::Timeout(inner.timeout);
        for _ in 0..10 {
            let pong = tokio::time::timeout(
                inner.timeout,
                conn.route_command(
                    ::redis::cmd("PING"),
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
                ),
            )
            .await;
            match pong {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => last = classify(&e, inner.timeout, inner.secret.as_deref()),
                Err(_) => last = StorageError::Timeout(inner.timeout),
            }
        }
        Err(last)
    }

    fn name(&self) -> &'static str {
        "redis-cluster"
    }

    fn invalidate_local_cache(&self) {
        if let Some(cache) = &self.inner.cache {
            cache.clear();
        }
    }

    fn hold_existing(&self, prefix: &str, hold_us: u64) {
        let Ok(conn) = self.inner.connection() else {
            tracing::warn!(
                "not connected to the Redis Cluster during a reload; existing buckets were not extended"
            );
            return;
        };
        let prefix = prefix.to_owned();
        let secret = self.inner.secret.clone();
        let hold_ms = hold_us.div_ceil(1000);
        tokio::spawn(async move {
            let result = hold_cluster(conn, &prefix, hold_ms).await;
            super::log_hold(&result, hold_ms, secret.as_deref());
        });
    }
}

/// [`super::hold_keys`] on every master: `SCAN` each one (addressed as
/// `CLUSTER SLOTS` names it), then one script call per hash slot of each
/// batch (a call never spans two slots).
async fn hold_cluster(
    mut conn: ClusterConnection,
    prefix: &str,
    hold_ms: u64,
) -> ::redis::RedisResult<u64> {
    use ::redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
    let slots = conn
        .route_command(
            ::redis::cmd("CLUSTER").arg("SLOTS").clone(),
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
        )
        .await?;
    let ranges: Vec<Vec<::redis::Value>> = ::redis::from_redis_value(slots)?;
    let mut masters = std::collections::BTreeSet::new();
    for range in ranges {
        // [start, end, [host, port, id, ...], replicas...]
        if let Some(node) = range.into_iter().nth(2) {
            let mut node: Vec<::redis::Value> = ::redis::from_redis_value(node)?;
            node.truncate(2);
            let (host, port): (String, u16) =
                ::redis::from_redis_value(::redis::Value::Array(node))?;
            masters.insert((host, port));
        }
    }
    let pattern = super::prefix_pattern(prefix);
    let mut extended = 0u64;
    for (host, port) in masters {
        let mut cursor: u64 = 0;
        loop {
            let reply = conn
                .route_command(
                    ::redis::cmd("SCAN")
                        .arg(cursor)
                        .arg("MATCH")
                        .arg(&pattern)
                        .arg("COUNT")
                        .arg(500)
                        .clone(),
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                        host: host.clone(),
                        port,
                    }),
                )
                .await?;
            let (next, keys): (u64, Vec<Vec<u8>>) = ::redis::from_redis_value(reply)?;
            let mut by_slot: HashMap<u16, Vec<Vec<u8>>> = HashMap::new();
            for k in keys {
                by_slot.entry(key_slot_bytes(&k)).or_default().push(k);
            }
            for keys in by_slot.into_values() {
                let n: u64 = ::redis::cmd("EVAL")
                    .arg(super::HOLD_SCRIPT)
                    .arg(keys.len())
                    .arg(keys)
                    .arg(hold_ms)
                    .query_async(&mut conn)
                    .await?;
                extended += n;
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    Ok(extended)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ::redis::cluster_routing::Slot;

    #[tokio::test]
    async fn a_ca_file_needs_tls_seeds() {
        let pem = b"-----BEGIN CERTIFICATE-----".to_vec();
        let e = RedisClusterStorage::builder(["rediss://127.0.0.1:1", "127.0.0.1:2"])
            .tls_root_ca_pem(pem)
            .build()
            .expect_err("refused")
            .to_string();
        assert!(
            e.contains("seed node redis://127.0.0.1:2 is not rediss://"),
            "{e}"
        );
    }

    #[test]
    fn slots_match_the_redis_crate() {
        for k in [
            "",
            "a",
            "rls:d3:api|k5:group=v7:reports",
            "x{tag}y",
            "{}x",
            "a{b",
            "pre{fix}:d1:x",
            "{user1000}.following",
        ] {
            assert_eq!(
                Route::new(key_slot(k), SlotAddr::Master),
                Route::with_slot(Slot::for_key(k), SlotAddr::Master),
                "{k}"
            );
        }
        // Known values from the Redis Cluster specification.
        assert_eq!(key_slot("123456789"), 0x31C3 % SLOTS);
        assert_eq!(key_slot("foo"), 12182);
    }

    #[test]
    fn escaped_client_braces_do_not_form_a_tag() {
        use crate::storage::key::{KeyValue, encode};
        let k = encode("rls:", "d", &[("k", KeyValue::Value("{x}"))]);
        assert_eq!(key_slot(&k), crc16_xmodem(k.as_bytes()) % SLOTS, "{k}");
    }
}
