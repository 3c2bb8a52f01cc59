//! The `redis` backend on a **Redis Cluster** (`--redis-cluster host:port,...`).
//!
//! # No `CROSSSLOT`, ever
//! A script may only touch keys of one hash slot. Every bucket key's slot is
//! computed here ([`key_slot`] in `slot`, CRC16 of the key as Redis does) from the
//! injective key encoding of [`key`](crate::storage::key), which escapes `{`
//! and `}`, so client text can never form a hash tag and move a bucket to
//! another slot (docs/design.md, "Keys"). The charges of one request are grouped by slot
//! and each script call carries the keys of exactly one slot, all in `KEYS`.
//!
//! # All-or-nothing across slots: reservation and refund
//! A request whose keys all share one slot is evaluated in one script call,
//! exactly as on a single node (through the same `Pipeline`, with the
//! slot's node as the connection source; each slot has its own queue, so
//! the requests of one slot that arrive while its call is in flight share
//! the next call, `batch`). Otherwise (`reserve`, written over
//! a "call one slot" trait and unit-tested with one memory backend per slot):
//!
//! 1. **Reserve.** Every slot that holds a consume charge gets one script call
//!    with that slot's charges, **all slots in parallel** (latency is one round
//!    trip whatever the number of slots, docs/design.md, "Redis Cluster"). Each call is atomic on its node
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
//! compensated (docs/design.md, "Ambiguous failures are never replayed"): the request answers `UNAVAILABLE` and at most the one
//! reservation of that slot is lost until its bucket refills. A lost
//! compensating call (node down) likewise only under-admits; it is logged and
//! counted as `bucket_rls_storage_errors_total{kind="cluster_refund_lost"}`.
//!
//! **Difference from a single node:** in a request that spans several slots,
//! a refund and a consume of the *same* bucket are applied consumes first (a
//! single node applies them in request order); the outcome differs only when
//! the refund would have been capped at the capacity. And a compensated
//! bucket has been written twice (reserved, given back), which, like any
//! write, drops the refill remainder below one micro-token that a single
//! node, writing nothing for a denied request, would keep: at most one
//! micro-token less per compensation (under-admission only; none with a unit
//! of one second, where refill is whole micro-tokens). Everything else,
//! statuses included, is identical when no other traffic interleaves.
//!
//! # Quota reports (RLQS)
//! A bucket's quota subscriber records are kept under a key in the bucket's
//! slot ([`subscribers_key`](crate::storage::quota::subscribers_key): a hash
//! tag naming the whole bucket key), so the quota script charges a bucket and
//! records its subscribers in one atomic call, as on a single node.
//! `Storage::report` groups a report's entries by slot and makes one quota
//! script call per slot, all in parallel, each through its slot's breaker,
//! timeout and routing (below), and returns the views in the entries' order.
//! No reservation is needed: a report records what the Envoys already
//! admitted. A slot that fails fails the report (the other slots' calls
//! stand, as after an ambiguous timeout).
//!
//! # Redirects, failover and lost slots
//! The `redis` crate's cluster client keeps the slot map and one multiplexed
//! connection per node; it is built with **no automatic retries**, because it
//! would otherwise resend a command after a dropped connection or a timeout,
//! when the script may already have run (docs/design.md, "Ambiguous failures are never replayed"). Instead each slot call
//! (`route`) follows `MOVED` (to the named node; the client refreshes its slot map) and
//! `ASK` (`ASKING` then the call, on the named node), waits briefly and retries
//! on `TRYAGAIN` (keys of a slot split by a migration), answers `Function
//! not found` with one `FUNCTION LOAD` on that node, and `NOSCRIPT`, a
//! refusal of Functions or `OOM` (which refuses a function before it runs)
//! with one `EVAL` of the full source (which also loads the script on that
//! node; docs/design.md, "NOSCRIPT"): each of these replies
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
//! (`breaker`), so a lost slot range never opens the breaker
//! of the others.
//!
//! The local over-limit cache (`local_cache`) only
//! learns from calls during which no compensation of this replica completed
//! (a denial seen then may come from a reservation given back since), and a
//! compensation forgets the buckets it refunded; compensations of *other*
//! replicas are not seen, like their refunds. The
//! timeout and the test-only explicit clock work as in the single-node
//! [`RedisStorage`](super::RedisStorage).

use self::reserve::{SlotCall, SlotOutcome};
use super::batch::{BatchQueue, BatchTarget, Outcome, Queued, lost};
use super::breaker::CircuitBreaker;
use super::errors::redact;
use super::quota_script::{QuotaArgs, QuotaScript};
use super::script::{BucketScript, ScriptCall};
use super::{
    ConnSource, MIN_CONNECT_TIMEOUT, Pipeline, RedisBuilder, RedisSetupError, hold,
    install_crypto_provider,
};
use crate::storage::algorithm::{ChargeKind, ChargeSpec, RequestResult};
use crate::storage::quota::{QuotaReport, QuotaView};
use crate::storage::{BackendKind, Charge, Storage, StorageError};
use ::redis::cluster::ClusterClientBuilder;
use ::redis::cluster_async::ClusterConnection;
use ::redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use ::redis::{ErrorKind, RedisError, Value};
use async_trait::async_trait;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::Notify;

mod reserve;
mod route;
pub(crate) mod slot;

pub use slot::{SLOTS, hash_tag, key_slot};

/// Delay between attempts of the first connection while the cluster is down.
const CONNECT_RETRY: Duration = Duration::from_millis(500);
/// Shortest time between two reconnections for a fresh slot map.
const REFRESH_INTERVAL: Duration = Duration::from_secs(1);

/// The topology of [`RedisClusterStorage`]: its seed nodes.
#[derive(Debug, Clone)]
pub struct ClusterNodes {
    nodes: Vec<String>,
}

/// Options of the Cluster backend; see [`RedisClusterStorage::builder`].
pub type RedisClusterStorageBuilder = RedisBuilder<ClusterNodes>;

impl RedisBuilder<ClusterNodes> {
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
        let (urls, shown, secret) = super::url::node_urls(&self.target.nodes);
        if urls.is_empty() {
            return Err(RedisSetupError::InvalidUrl {
                url: String::new(),
                message: "no Redis Cluster seed node given".into(),
            });
        }
        let timeout = self.options.timeout;
        let mut builder = ClusterClientBuilder::new(urls.iter().map(String::as_str))
            // No automatic retry: the crate would resend after a dropped
            // connection or a timeout (docs/design.md, "Ambiguous failures are never replayed"); redirects are followed here.
            .retries(0)
            .connection_timeout(timeout.max(MIN_CONNECT_TIMEOUT))
            .response_timeout(timeout);
        if let Some(certs) = self.options.tls_certificates() {
            // The crate would switch plain `redis://` seeds to TLS silently.
            if let Some(plain) = urls.iter().find(|u| !u.starts_with("rediss://")) {
                return Err(RedisSetupError::InvalidUrl {
                    url: shown.clone(),
                    message: format!(
                        "a TLS CA file or client certificate is given but seed node {} is not rediss://",
                        super::redact_url(plain)
                    ),
                });
            }
            builder = builder.certs(certs);
        }
        let client = builder.build().map_err(|e| RedisSetupError::InvalidUrl {
            url: shown.clone(),
            message: redact(&e.to_string(), secret.as_deref()),
        })?;
        let storage = RedisClusterStorage {
            inner: Arc::new_cyclic(|me| Inner {
                me: me.clone(),
                conn: RwLock::new(None),
                refresh: Notify::new(),
                breakers: Mutex::new(HashMap::new()),
                queues: Mutex::new(HashMap::new()),
                options: self.options.clone(),
                pipeline: self.pipeline(secret),
                compensations: AtomicU64::new(0),
                nodes: shown,
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
    /// This backend, for the batching tasks of its slots.
    me: Weak<Inner>,
    conn: RwLock<Option<Conn>>,
    /// Wakes the connection task to reconnect (fresh slot map).
    refresh: Notify,
    /// One breaker per hash slot, made on first use (at most [`SLOTS`]).
    breakers: Mutex<HashMap<u16, Arc<CircuitBreaker>>>,
    /// One queue of script calls per hash slot (many requests per call),
    /// made on first use, with what its task serves.
    queues: Mutex<HashMap<u16, (Arc<SlotBatch>, BatchQueue)>>,
    /// The options the breakers are made with.
    options: super::RedisOptions,
    pipeline: Pipeline,
    /// Compensations completed so far (see [`Inner::record`]).
    compensations: AtomicU64,
    /// Seed nodes with passwords redacted, for logs.
    nodes: String,
}

/// Token buckets in a Redis Cluster. Cheap to clone (shared state).
#[derive(Debug, Clone)]
pub struct RedisClusterStorage {
    inner: Arc<Inner>,
}

impl RedisClusterStorage {
    /// Options for a backend on the cluster reached through `nodes` (seed
    /// nodes as `host:port` or `redis[s]://[user:password@]host:port`; any
    /// one answering is enough, the others are found through it; `rediss://`
    /// seeds make every node connection TLS).
    #[must_use]
    pub fn builder<S: Into<String>>(
        nodes: impl IntoIterator<Item = S>,
    ) -> RedisClusterStorageBuilder {
        RedisBuilder::new(ClusterNodes {
            nodes: nodes.into_iter().map(Into::into).collect(),
        })
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
                let wait = strong.pipeline.timeout.max(MIN_CONNECT_TIMEOUT) * 4;
                match tokio::time::timeout(wait, client.get_async_connection()).await {
                    Ok(Ok(mut conn)) => {
                        let loaded =
                            tokio::time::timeout(wait, strong.pipeline.script.load(&mut conn))
                                .await;
                        if !matches!(loaded, Ok(Ok(()))) {
                            tracing::debug!(nodes = %strong.nodes, "could not load the token bucket library on every master; a node that lacks it gets it on first use");
                        }
                        *strong.conn.write() = Some(Conn(conn));
                        if first {
                            tracing::info!(nodes = %strong.nodes, sha = strong.pipeline.script.sha(), "Redis Cluster answers");
                        } else {
                            tracing::info!(nodes = %strong.nodes, "reconnected to the Redis Cluster (fresh slot map)");
                        }
                        warned = false;
                    }
                    Ok(Err(e)) if !warned => {
                        let e = strong.pipeline.classify(&e);
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
}

impl Inner {
    fn breaker(&self, slot: u16) -> Arc<CircuitBreaker> {
        self.breakers
            .lock()
            .entry(slot)
            .or_insert_with(|| Arc::new(self.options.breaker()))
            .clone()
    }

    /// Teaches the local cache Redis's answer (with the times the request
    /// was sent and answered, as on a single node), unless a compensation
    /// of this replica completed since the request was sent (`epoch`): a
    /// denial may then have been caused by a reservation that has since
    /// been given back, so the request's buckets are forgotten instead of
    /// cached as short. A compensation also forgets the buckets it refunded.
    fn record(&self, charges: &[Charge], result: &RequestResult, sent_us: u64, epoch: u64) {
        self.pipeline.note_reloads();
        let Some(cache) = self.pipeline.cache() else {
            return;
        };
        if self.compensations.load(Ordering::SeqCst) == epoch {
            self.pipeline.record(charges, result, sent_us);
            // A compensation that completed while recording may have
            // forgotten its buckets just before this insert: check again.
            if self.compensations.load(Ordering::SeqCst) == epoch {
                return;
            }
        }
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

    fn connection(&self) -> Result<ClusterConnection, StorageError> {
        self.conn
            .read()
            .as_ref()
            .map(|c| c.0.clone())
            .ok_or_else(|| StorageError::unreachable("not connected to the Redis Cluster yet"))
    }

    /// The queue of script calls of `slot`, made on first use.
    fn queue(&self, slot: u16) -> BatchQueue {
        self.queues
            .lock()
            .entry(slot)
            .or_insert_with(|| {
                let target = Arc::new(SlotBatch {
                    inner: self.me.clone(),
                    slot,
                });
                let queue = BatchQueue::spawn(Arc::downgrade(&target));
                (target, queue)
            })
            .1
            .clone()
    }

    /// `charges`, all in hash slot `slot`, evaluated atomically in the
    /// slot's next script call (with the other requests queued for that
    /// slot meanwhile), through the shared pipeline with the slot's own
    /// breaker (asked beforehand, by the request). The timeout counts from
    /// now.
    async fn call_slot(&self, slot: u16, charges: &[Charge], now_us: Option<u64>) -> SlotOutcome {
        let deadline = tokio::time::Instant::now() + self.pipeline.timeout;
        let call = ScriptCall::new(charges, now_us)?;
        let breaker = self.breaker(slot);
        let queue = self.queue(slot);
        self.pipeline
            .queued(
                &SlotSource { inner: self, slot },
                &queue,
                &breaker,
                call,
                deadline,
            )
            .await
    }

    /// [`Pipeline::classify`], with an unreachable slot owner reported as
    /// `CLUSTERDOWN` (the slot cannot be served) and the slot named in the
    /// message.
    fn classify(&self, slot: u16, e: &RedisError) -> StorageError {
        let lost = e.kind() == ErrorKind::ClusterConnectionNotFound;
        match self.pipeline.classify(e) {
            StorageError::Unreachable { message, source } => StorageError::Backend {
                kind: BackendKind::ClusterDown,
                message: format!("hash slot {slot} unreachable: {message}"),
                source,
            },
            StorageError::Backend {
                message, source, ..
            } if lost => StorageError::Backend {
                kind: BackendKind::ClusterDown,
                message: format!("hash slot {slot} not served: {message}"),
                source,
            },
            StorageError::Backend {
                kind,
                message,
                source,
            } => StorageError::Backend {
                kind,
                message: format!("hash slot {slot}: {message}"),
                source,
            },
            other => other,
        }
    }
}

/// The master of one hash slot, as the client's slot map names it (and as
/// `MOVED`/`ASK` redirect). A slot that cannot be served makes the
/// connection task reconnect for a fresh slot map.
struct SlotSource<'a> {
    inner: &'a Inner,
    slot: u16,
}

impl ConnSource for SlotSource<'_> {
    type Conn = ClusterConnection;
    type Tag = ();

    fn connection(
        &self,
    ) -> impl Future<Output = Result<((), ClusterConnection), StorageError>> + Send {
        std::future::ready(self.inner.connection().map(|c| ((), c)))
    }

    fn eval<'a>(
        &'a self,
        conn: &'a mut ClusterConnection,
        script: &'a BucketScript,
        call: &'a ScriptCall,
    ) -> impl Future<Output = Result<Value, RedisError>> + Send + 'a {
        route::eval_in_slot(conn, self.slot, (script, call))
    }

    fn eval_quota<'a>(
        &'a self,
        conn: &'a mut ClusterConnection,
        script: &'a QuotaScript,
        args: &'a QuotaArgs,
    ) -> impl Future<Output = Result<Value, RedisError>> + Send + 'a {
        route::eval_in_slot(conn, self.slot, (script, args))
    }

    fn classify(&self, _pipeline: &Pipeline, e: &RedisError) -> StorageError {
        self.inner.classify(self.slot, e)
    }

    fn after(
        &self,
        _tag: Option<()>,
        result: &Result<RequestResult, StorageError>,
        _breaker: &CircuitBreaker,
    ) {
        if let Err(e) = result
            && matches!(
                e.backend_kind(),
                Some(BackendKind::ClusterDown | BackendKind::ReadOnly | BackendKind::MasterDown)
            )
        {
            self.inner.refresh.notify_one();
        }
    }
}

/// What the batching task of one hash slot serves: the slot's script calls,
/// on the backend while it lives.
#[derive(Debug)]
struct SlotBatch {
    inner: Weak<Inner>,
    slot: u16,
}

impl BatchTarget for SlotBatch {
    async fn call_batch(&self, batch: &[Queued], connecting: &AtomicBool) -> Vec<Outcome> {
        let Some(inner) = self.inner.upgrade() else {
            return batch.iter().map(|_| (Err(lost()), false)).collect();
        };
        let breaker = inner.breaker(self.slot);
        let source = SlotSource {
            inner: &inner,
            slot: self.slot,
        };
        inner
            .pipeline
            .call_batch(&source, &breaker, batch, connecting)
            .await
    }
}

/// The slots of one request on the cluster: one script call per slot, with
/// the request's explicit time (tests only).
struct Slots<'a> {
    inner: &'a Inner,
    now_us: Option<u64>,
}

impl SlotCall for Slots<'_> {
    async fn call(&self, slot: u16, charges: &[Charge]) -> SlotOutcome {
        self.inner.call_slot(slot, charges, self.now_us).await
    }

    fn compensated(&self, refunds: &[(u16, Vec<Charge>)]) {
        self.inner.compensations.fetch_add(1, Ordering::SeqCst);
        if let Some(cache) = self.inner.pipeline.cache() {
            for (_, part) in refunds {
                cache.before_call(part);
            }
        }
    }
}

#[async_trait]
impl Storage for RedisClusterStorage {
    async fn apply(&self, charges: &[Charge]) -> Result<RequestResult, StorageError> {
        let inner = &self.inner;
        let pipeline = &inner.pipeline;
        if let Some(r) = pipeline.cached_answer(charges) {
            return Ok(r);
        }
        let now_us = pipeline.explicit_now_us();
        let slots = reserve::group_by_slot(charges.iter().map(|c| c.key.as_str()), key_slot);
        // Check the arguments once, before anything is reserved.
        ScriptCall::new(charges, now_us)?;
        for (slot, _) in &slots {
            if !inner.breaker(*slot).allow() {
                return Err(StorageError::CircuitOpen);
            }
        }
        let sent_us = pipeline.local_now_us();
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
                let task = tokio::spawn({
                    let inner = inner.clone();
                    let charges = charges.to_vec();
                    async move {
                        let slot_call = Slots {
                            inner: &inner,
                            now_us,
                        };
                        reserve::apply_slots(&slot_call, &charges, &slots).await
                    }
                });
                task.await.unwrap_or_else(|e| {
                    Err(StorageError::backend(
                        BackendKind::Internal,
                        format!("cluster request task failed: {e}"),
                    ))
                })
            }
        };
        if let Ok(r) = &result {
            inner.record(charges, r, sent_us, epoch);
        }
        result
    }

    /// One quota script call per hash slot of the report's buckets (each
    /// entry's subscriber records share its bucket's slot), all slots in
    /// parallel, each behind its slot's breaker and timeout and routed as a
    /// request's call is. One slot failing fails the report (the other
    /// slots' entries were recorded, as after an ambiguous timeout).
    async fn report(&self, reports: &[QuotaReport]) -> Result<Vec<QuotaView>, StorageError> {
        let inner = &self.inner;
        let slots = group_reports_by_slot(reports)?;
        let calls = slots.iter().map(|(slot, at)| async move {
            let source = SlotSource { inner, slot: *slot };
            let breaker = inner.breaker(*slot);
            if at.len() == reports.len() {
                inner.pipeline.report(&source, &breaker, reports).await
            } else {
                let part: Vec<QuotaReport> = at.iter().map(|&i| reports[i].clone()).collect();
                inner.pipeline.report(&source, &breaker, &part).await
            }
        });
        let mut views: Vec<Option<QuotaView>> = vec![None; reports.len()];
        for ((_, at), result) in slots.iter().zip(futures::future::join_all(calls).await) {
            let part = result?;
            if part.len() != at.len() {
                return Err(StorageError::backend(
                    BackendKind::Reply,
                    "quota script reply: wrong length",
                ));
            }
            for (&i, view) in at.iter().zip(part) {
                views[i] = Some(view);
            }
        }
        views
            .into_iter()
            .map(|v| {
                v.ok_or_else(|| {
                    StorageError::backend(BackendKind::Internal, "a quota entry got no view")
                })
            })
            .collect()
    }

    async fn ping(&self) -> Result<(), StorageError> {
        let inner = &self.inner;
        let mut conn = inner.connection()?;
        // Healthy when any node answers: a lost slot range must not take the
        // whole service out of rotation.
        let timeout = inner.pipeline.timeout;
        let mut last = StorageError::Timeout(timeout);
        for _ in 0..10 {
            let pong = tokio::time::timeout(
                timeout,
                conn.route_command(
                    ::redis::cmd("PING"),
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
                ),
            )
            .await;
            match pong {
                // The script clock of the nodes, checked once per
                // connection (`/healthcheck` says why it is refused).
                Ok(Ok(_)) => {
                    let any = SlotSource { inner, slot: 0 };
                    return inner.pipeline.clock_gate(&any).await;
                }
                Ok(Err(e)) => last = inner.pipeline.classify(&e),
                Err(_) => last = StorageError::Timeout(timeout),
            }
        }
        Err(last)
    }

    async fn reset(&self, keys: &[&str]) -> Result<Vec<bool>, StorageError> {
        let inner = &self.inner;
        let pipeline = &inner.pipeline;
        let mut conn = inner.connection()?;
        // One `DEL` per key, routed by its slot (keys of one request may
        // live on several masters).
        let deletes = async {
            let mut out = Vec::with_capacity(keys.len());
            for k in keys {
                let n: u64 = ::redis::cmd("DEL").arg(*k).query_async(&mut conn).await?;
                out.push(n > 0);
            }
            Ok::<_, RedisError>(out)
        };
        let result = match tokio::time::timeout(pipeline.timeout, deletes).await {
            Err(_) => Err(StorageError::Timeout(pipeline.timeout)),
            Ok(Err(e)) => Err(pipeline.classify(&e)),
            Ok(Ok(out)) => Ok(out),
        };
        pipeline.clear_cache();
        result
    }

    fn name(&self) -> &'static str {
        "redis-cluster"
    }

    fn invalidate_local_cache(&self) {
        self.inner.pipeline.clear_cache();
    }

    fn hold_existing(&self, prefix: &str, hold_us: u64) {
        let Ok(conn) = self.inner.connection() else {
            tracing::warn!(
                "not connected to the Redis Cluster during a reload; existing buckets were not extended"
            );
            return;
        };
        let prefix = prefix.to_owned();
        let secret = self.inner.pipeline.secret.clone();
        self.inner.pipeline.holds.submit(
            &prefix.clone(),
            hold_us.div_ceil(1000),
            Box::new(move |hold_ms| {
                Box::pin(async move {
                    let result = hold::hold_cluster(conn, &prefix, hold_ms).await;
                    hold::log_hold(&result, hold_ms, secret.as_deref());
                })
            }),
        );
    }
}

/// The entries of one quota report grouped by the hash slot of their
/// bucket ([`reserve::group_by_slot`]).
///
/// # Errors
/// [`BackendKind::CrossSlot`] naming both keys when an entry's subscriber
/// records are not in its bucket's slot (a key prefix with a `{` or `}`
/// that forms no hash tag, see
/// [`subscribers_key`](crate::storage::quota::subscribers_key)), before
/// anything is sent.
fn group_reports_by_slot(reports: &[QuotaReport]) -> Result<Vec<(u16, Vec<usize>)>, StorageError> {
    if let Some(r) = reports
        .iter()
        .find(|r| key_slot(&r.subscribers) != key_slot(&r.bucket))
    {
        return Err(StorageError::backend(
            BackendKind::CrossSlot,
            format!(
                "quota subscriber records {:?} are not in the hash slot of their bucket {:?}: the key prefix has a '{{' or '}}' that forms no hash tag; on Redis Cluster RLQS needs a prefix without braces or with a whole {{tag}}",
                r.subscribers, r.bucket
            ),
        ));
    }
    Ok(reserve::group_by_slot(
        reports.iter().map(|r| r.bucket.as_str()),
        key_slot,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::algorithm::{BucketLimit, Limit};
    use crate::storage::key::{KeyValue, encode};
    use crate::storage::quota::{Held, subscribers_key};

    fn entry(prefix: &str, value: &str) -> QuotaReport {
        let bucket = encode(prefix, "edge", &[("tenant", KeyValue::Value(value))]);
        QuotaReport {
            subscribers: subscribers_key(prefix, &bucket),
            bucket,
            charge: ChargeSpec {
                limit: Limit::TokenBucket(BucketLimit {
                    requests_per_unit: 10,
                    unit_secs: std::num::NonZeroU64::MIN,
                    burst: 10,
                    max_debt: 10,
                }),
                cost: 1,
                kind: ChargeKind::Consume,
                shadow: false,
            },
            subscriber: "s".into(),
            demand_milli: 1,
            held: None,
            budget: Held::default(),
            live_ms: 15_000,
        }
    }

    /// A report's entries go to one call per slot of their buckets, each
    /// slot's entries in report order; a prefix whose brace forms no hash
    /// tag, which leaves the subscriber records outside the bucket's slot,
    /// is refused before anything is sent, naming both keys.
    #[test]
    fn quota_entries_are_grouped_by_the_slot_of_their_bucket() {
        let reports: Vec<QuotaReport> = (0..200).map(|i| entry("rls:", &format!("t{i}"))).collect();
        let slots = group_reports_by_slot(&reports).expect("grouped");
        assert!(slots.len() > 100, "{}", slots.len());
        let mut seen: Vec<usize> = Vec::new();
        for (slot, at) in &slots {
            assert!(at.windows(2).all(|w| w[0] < w[1]), "{at:?}");
            for &i in at {
                assert_eq!(key_slot(&reports[i].bucket), *slot);
                assert_eq!(key_slot(&reports[i].subscribers), *slot);
            }
            seen.extend(at.iter().copied());
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..200).collect::<Vec<usize>>());
        // A tag in the prefix: every entry in one slot, one call.
        let tagged: Vec<QuotaReport> = (0..20)
            .map(|i| entry("rls:{x}:", &format!("t{i}")))
            .collect();
        assert_eq!(group_reports_by_slot(&tagged).expect("grouped").len(), 1);
        let e = group_reports_by_slot(&[entry("rls{:", "t")])
            .expect_err("refused")
            .to_string();
        assert!(
            e.contains("not in the hash slot") && e.contains("rls{:d4:edge"),
            "{e}"
        );
    }

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
}
