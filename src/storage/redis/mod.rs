//! The `redis` backends: token buckets shared by every replica of bucket-rls
//! through one Redis node ([`RedisStorage`]), a master watched by Sentinel
//! ([`sentinel::RedisSentinelStorage`]) or a Redis Cluster
//! ([`cluster::RedisClusterStorage`]).
//!
//! Design:
//! - **At most one script call per request** (per hash slot on a Cluster);
//!   the requests that arrive while two calls to a node (a Cluster slot)
//!   are in flight share the next call (`batch`, docs/design.md, "Batched
//!   script calls"), each evaluated by the script exactly as if alone.
//!   [`script`] wraps the request script (`lua/request.lua` with the
//!   algorithms' parts, `lua/algorithms/`), which reads, decides and writes
//!   every key of a request atomically (all-or-nothing, docs/design.md, "All-or-nothing requests") with
//!   exactly the semantics of
//!   [`algorithm::apply_request`](crate::storage::algorithm::apply_request). Time
//!   comes from Redis `TIME`, so replicas never disagree about a bucket and a
//!   skewed service clock cannot mint tokens (docs/design.md, "Time"). The script is called
//!   as `FCALL` of a Redis Functions library (`EVALSHA` where Redis refuses
//!   Functions, and for one call that `OOM` refused); `Function not found`
//!   or `NOSCRIPT` (restart, `FUNCTION FLUSH`, `SCRIPT FLUSH`) loads it and
//!   retries once (docs/design.md, "NOSCRIPT"). Nothing else is ever retried: after a timeout the
//!   script may have run, so the call fails with
//!   [`StorageError::Timeout`] and is not replayed (docs/design.md, "Ambiguous failures are never replayed").
//! - **One call pipeline for every topology.** Each call goes through the
//!   same steps, written once here (`Pipeline`): the local over-limit
//!   cache, the argument encoding, the circuit breaker, the response timeout,
//!   the script call over a connection source (`ConnSource`: a
//!   `ConnectionManager`, the master Sentinel names, or the node of one hash
//!   slot), error classification, reply parsing and the cache record. The
//!   topologies differ only in where the connection comes from and what they
//!   do after a failure (ask Sentinel again, refresh the slot map).
//! - **Options** ([`RedisOptions`]) are shared by the three builders
//!   ([`RedisBuilder`]): the response timeout (`--redis-timeout`), the local
//!   cache size (`--local-cache-size`), the circuit breaker and a private TLS
//!   CA (`--redis-tls-ca-file`). `rediss://` uses rustls with the `ring`
//!   provider; ACL user and password come from the URL and are never logged
//!   ([`redact_url`]).
//! - **Errors** are classified once (`errors::classify`) into typed
//!   [`StorageError`]s; `service.rs` maps them to gRPC `UNAVAILABLE` or the
//!   `--on-storage-error` policy.
//! - **Circuit breaker** (`breaker`): after consecutive failures, requests
//!   fail at once with [`StorageError::CircuitOpen`] until a probe (one request
//!   per interval, or a health-check ping) succeeds (docs/design.md, "Circuit breaker").
//! - **Local over-limit cache** (`local_cache`): buckets Redis reported as
//!   lacking tokens answer certain denials from memory; cleared on every config
//!   swap (docs/design.md, "Reloads").
//! - **Keys** are built by the service ([`key`](crate::storage::key)); each
//!   stores 7 to 14 bytes and expires when its bucket would be full again.

pub(crate) mod batch;
pub(crate) mod breaker;
pub mod cluster;
pub(crate) mod errors;
pub(crate) mod hold;
pub(crate) mod local_cache;
pub mod quota_script;
pub mod script;
pub mod script_clock;
pub mod sentinel;
mod single;
pub(crate) mod url;

pub use batch::{MAX_BATCH_CHARGES, MAX_BATCH_REQUESTS, MAX_IN_FLIGHT};
pub use single::{RedisStorage, RedisStorageBuilder, SingleNode};
pub use url::redact_url;

use self::breaker::CircuitBreaker;
use self::local_cache::LocalCache;
use self::script::{BucketScript, ScriptCall};
use super::clock::Clock;
use super::{BackendKind, Charge, RequestResult, StorageError};
use ::redis::{RedisError, Value};
use std::future::Future;
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
/// Shortest connect timeout, to a node or a Sentinel (a TLS handshake may
/// take longer than a reply).
pub(crate) const MIN_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Period of the background health `PING` of the single-node backend.
pub const HEALTH_INTERVAL: Duration = Duration::from_secs(1);

/// Why a Redis backend cannot be built (the addresses themselves are wrong;
/// Redis being down is not an error at this point).
#[derive(Debug, thiserror::Error)]
pub enum RedisSetupError {
    /// The URL does not parse, or the addresses contradict each other
    /// (message with the password redacted).
    #[error("invalid Redis URL {url}: {message}")]
    InvalidUrl {
        /// The URL(s) with the password replaced by `***`.
        url: String,
        /// Why it does not parse.
        message: String,
    },
}

/// The options every Redis topology shares. `Debug` shows the sizes of the
/// PEM files, not their bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisOptions {
    /// Response timeout of every call (default 50 ms, `--redis-timeout`).
    /// On a Cluster, a request spanning several slots takes one timeout for
    /// the parallel reservation and, when denied, one more to compensate.
    pub timeout: Duration,
    /// Entries of the local over-limit cache; 0 disables it (default
    /// 100,000, `--local-cache-size`).
    pub local_cache_size: usize,
    /// Consecutive failures that open the circuit breaker (per slot on a
    /// Cluster; default 5).
    pub breaker_threshold: u32,
    /// Time between probes while the breaker is open (default 500 ms).
    pub probe_interval: Duration,
    /// PEM certificate(s) of the CA that signs the server certificates
    /// behind `rediss://` addresses (a private CA), instead of the public
    /// web PKI roots (`--redis-tls-ca-file`).
    pub tls_root_ca_pem: Option<Vec<u8>>,
    /// Client certificate presented over TLS (`--redis-tls-client-cert`).
    pub tls_client: Option<ClientCertPem>,
}

/// A PEM client certificate chain and its private key, for Redis over TLS.
/// `Debug` shows neither.
#[derive(Clone, PartialEq, Eq)]
pub struct ClientCertPem {
    /// PEM certificate chain.
    pub cert: Vec<u8>,
    /// PEM private key.
    pub key: Vec<u8>,
}

impl std::fmt::Debug for ClientCertPem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientCertPem(..)")
    }
}

impl std::fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisOptions")
            .field("timeout", &self.timeout)
            .field("local_cache_size", &self.local_cache_size)
            .field("breaker_threshold", &self.breaker_threshold)
            .field("probe_interval", &self.probe_interval)
            .field(
                "tls_root_ca_pem",
                &self
                    .tls_root_ca_pem
                    .as_ref()
                    .map(|p| format!("{} bytes", p.len())),
            )
            .field("tls_client", &self.tls_client.is_some())
            .finish()
    }
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            local_cache_size: DEFAULT_LOCAL_CACHE_SIZE,
            breaker_threshold: DEFAULT_BREAKER_THRESHOLD,
            probe_interval: DEFAULT_PROBE_INTERVAL,
            tls_root_ca_pem: None,
            tls_client: None,
        }
    }
}

impl RedisOptions {
    /// The certificates the `redis` crate takes for TLS connections: the
    /// private CA and the client certificate; `None` when neither is given
    /// (the crate's defaults: web PKI roots, no client certificate).
    #[must_use]
    pub fn tls_certificates(&self) -> Option<::redis::TlsCertificates> {
        if self.tls_root_ca_pem.is_none() && self.tls_client.is_none() {
            return None;
        }
        Some(::redis::TlsCertificates {
            client_tls: self.tls_client.as_ref().map(|c| ::redis::ClientTlsConfig {
                client_cert: c.cert.clone(),
                client_key: c.key.clone(),
            }),
            root_cert: self.tls_root_ca_pem.clone(),
        })
    }

    /// A closed circuit breaker with these options.
    pub(crate) fn breaker(&self) -> CircuitBreaker {
        CircuitBreaker::new(self.breaker_threshold, self.probe_interval)
    }
}

/// The builder of a Redis backend: the topology `T` (what to connect to:
/// [`SingleNode`], [`sentinel::SentinelMaster`] or [`cluster::ClusterNodes`])
/// and the shared [`RedisOptions`]. Made by [`RedisStorage::builder`],
/// [`sentinel::RedisSentinelStorage::builder`] or
/// [`cluster::RedisClusterStorage::builder`]; each topology adds its own
/// `build`.
#[derive(Debug, Clone)]
pub struct RedisBuilder<T> {
    target: T,
    options: RedisOptions,
    test_clock: Option<Arc<dyn Clock>>,
}

impl<T> RedisBuilder<T> {
    fn new(target: T) -> Self {
        Self {
            target,
            options: RedisOptions::default(),
            test_clock: None,
        }
    }

    /// Sets every shared option at once.
    #[must_use]
    pub fn options(mut self, options: RedisOptions) -> Self {
        self.options = options;
        self
    }

    /// Response timeout of every call ([`RedisOptions::timeout`]).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.options.timeout = timeout;
        self
    }

    /// Entries of the local over-limit cache; 0 disables it
    /// ([`RedisOptions::local_cache_size`]).
    #[must_use]
    pub fn local_cache_size(mut self, entries: usize) -> Self {
        self.options.local_cache_size = entries;
        self
    }

    /// Consecutive failures that open the circuit breaker (per slot on a
    /// Cluster), and the time between probes while it is open (defaults 5
    /// and 500 ms).
    #[must_use]
    pub fn breaker(mut self, threshold: u32, probe_interval: Duration) -> Self {
        self.options.breaker_threshold = threshold;
        self.options.probe_interval = probe_interval;
        self
    }

    /// PEM certificate(s) of a private CA for `rediss://` addresses
    /// ([`RedisOptions::tls_root_ca_pem`]).
    #[must_use]
    pub fn tls_root_ca_pem(mut self, pem: Vec<u8>) -> Self {
        self.options.tls_root_ca_pem = Some(pem);
        self
    }

    /// **Tests only** (cargo feature `test-util`). Sends `clock`'s time to
    /// the script as an explicit `now_us` instead of letting the script read
    /// Redis `TIME`, so tests can move time with a `ManualClock`. Production
    /// never sets this: the service clock must not decide bucket time (docs/design.md, "Time").
    #[cfg(any(test, feature = "test-util"))]
    #[must_use]
    pub fn test_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.test_clock = Some(clock);
        self
    }

    /// The pipeline of a backend built with these options, removing `secret`
    /// from error messages.
    fn pipeline(&self, secret: Option<String>) -> Pipeline {
        Pipeline {
            script: BucketScript::new(),
            quota_script: quota_script::QuotaScript::default(),
            timeout: self.options.timeout,
            cache: (self.options.local_cache_size > 0)
                .then(|| LocalCache::new(self.options.local_cache_size)),
            test_clock: self.test_clock.clone(),
            secret,
            epoch: Instant::now(),
            seen_reloads: std::sync::atomic::AtomicU64::new(0),
            holds: Arc::default(),
            clock: script_clock::ScriptClock::default(),
        }
    }
}

/// Where the connection of one script call comes from, and what the
/// topology does after the call: the only part of a call that differs
/// between a single node, Sentinel and a Cluster slot.
pub(crate) trait ConnSource: Sync {
    /// The connection one call runs on.
    type Conn: Send + ::redis::aio::ConnectionLike;
    /// What [`ConnSource::after`] needs to know about the connection used
    /// (Sentinel: which master it was).
    type Tag: Copy + Send;

    /// The connection for the next call, waiting for one if needed (within
    /// the call's timeout; see [`ConnSource::no_connection`]).
    ///
    /// # Errors
    /// A [`StorageError`] that fails the call at once, before anything is
    /// sent; the circuit breaker does not count it.
    fn connection(
        &self,
    ) -> impl Future<Output = Result<(Self::Tag, Self::Conn), StorageError>> + Send;

    /// Runs `call` on `conn` (with the library or script reloaded on
    /// `Function not found` or `NOSCRIPT`).
    fn eval<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        script: &'a BucketScript,
        call: &'a ScriptCall,
    ) -> impl Future<Output = Result<Value, RedisError>> + Send + 'a;

    /// Runs one quota report `args` on `conn` (with the script reloaded on
    /// `NOSCRIPT`). Default: [`QuotaScript::eval`](quota_script::QuotaScript::eval)
    /// on the connection as it is (a single node, a Sentinel master).
    fn eval_quota<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        script: &'a quota_script::QuotaScript,
        args: &'a quota_script::QuotaArgs,
    ) -> impl Future<Output = Result<Value, RedisError>> + Send + 'a {
        script.eval(conn, args)
    }

    /// The error when the timeout ran out while waiting for a connection.
    fn no_connection(&self, timeout: Duration) -> StorageError {
        StorageError::Timeout(timeout)
    }

    /// Classifies an error of [`ConnSource::eval`].
    fn classify(&self, pipeline: &Pipeline, e: &RedisError) -> StorageError {
        pipeline.classify(e)
    }

    /// Reacts to the outcome of a call that got a connection (`tag`) or
    /// timed out waiting for one (`None`). Default: nothing.
    fn after(
        &self,
        tag: Option<Self::Tag>,
        result: &Result<RequestResult, StorageError>,
        breaker: &CircuitBreaker,
    ) {
        let _ = (tag, result, breaker);
    }
}

/// What every call of one backend shares: the script, the response timeout,
/// the local over-limit cache, the clock of the cache (and the test-only
/// explicit script clock), and the password removed from error messages.
#[derive(Debug)]
pub(crate) struct Pipeline {
    pub(crate) script: BucketScript,
    /// The quota (RLQS) script.
    pub(crate) quota_script: quota_script::QuotaScript,
    pub(crate) timeout: Duration,
    cache: Option<LocalCache>,
    test_clock: Option<Arc<dyn Clock>>,
    /// The password removed from every error message.
    pub(crate) secret: Option<String>,
    /// Origin of the local cache's monotonic time line.
    epoch: Instant,
    /// The script's reload count the local cache last saw: a `Function not
    /// found` or `NOSCRIPT` since then clears the cache.
    seen_reloads: std::sync::atomic::AtomicU64,
    /// The reload holds of this backend, one at a time
    /// (`Storage::hold_existing`).
    pub(crate) holds: Arc<hold::HoldQueue>,
    /// Whether the script's `TIME` can be trusted ([`script_clock`]).
    clock: script_clock::ScriptClock,
}

impl Pipeline {
    /// One request on one node: answered from the local cache when certain,
    /// else queued for the node's next script call (`queue`, its batching
    /// task: docs/design.md, "Batched script calls") behind the circuit
    /// breaker, whose answer the cache then learns (with the times the
    /// request was queued and its answer received). The timeout counts
    /// from the request's arrival; a request still queued when it runs out
    /// is never sent.
    ///
    /// # Errors
    /// [`StorageError::CircuitOpen`] without a call while `breaker` is open;
    /// [`StorageError::Timeout`] (or the source's
    /// [`ConnSource::no_connection`] while no connection is at hand) when no
    /// answer came in time; the call's error otherwise, as the request's
    /// own call would have had it.
    pub(crate) async fn apply<S: ConnSource>(
        &self,
        source: &S,
        queue: &batch::BatchQueue,
        breaker: &CircuitBreaker,
        charges: &[Charge],
    ) -> Result<RequestResult, StorageError> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        if let Some(r) = self.cached_answer(charges) {
            return Ok(r);
        }
        let call = ScriptCall::new(charges, self.explicit_now_us())?;
        if !breaker.allow() {
            return Err(StorageError::CircuitOpen);
        }
        let sent_us = self.local_now_us();
        let result = self.queued(source, queue, breaker, call, deadline).await;
        if let Ok(r) = &result {
            self.record(charges, r, sent_us);
        }
        result
    }

    /// Queues `call` on `queue` and waits for its outcome until `deadline`,
    /// then tells `breaker` (a success closes it; a transient failure of a
    /// call that was sent counts). Does not ask `breaker` whether the call
    /// may go (the caller did).
    ///
    /// # Errors
    /// [`StorageError::Timeout`] (or the source's
    /// [`ConnSource::no_connection`] while no connection is at hand) when no
    /// answer came by `deadline`; the call's error otherwise.
    pub(crate) async fn queued<S: ConnSource>(
        &self,
        source: &S,
        queue: &batch::BatchQueue,
        breaker: &CircuitBreaker,
        call: ScriptCall,
        deadline: tokio::time::Instant,
    ) -> Result<RequestResult, StorageError> {
        let started = Instant::now();
        // The client span is the request's (a child of its server span),
        // from its queueing to its answer.
        let command = if self.script.uses_functions() {
            "FCALL"
        } else {
            "EVALSHA"
        };
        let span = crate::otel::RedisSpan::start(call.keys.len(), command);
        let answer = queue.push(call);
        let (result, sent) = match tokio::time::timeout_at(deadline, answer).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(_)) => (Err(batch::lost()), true),
            Err(_) if queue.connecting() => (Err(source.no_connection(self.timeout)), true),
            Err(_) => (Err(StorageError::Timeout(self.timeout)), true),
        };
        match &result {
            Ok(_) => breaker.success(),
            Err(e) if sent && e.is_transient() => breaker.failure_of_call_started(started),
            Err(_) => {}
        }
        if let Some(span) = span {
            span.end(result.as_ref().err().map(|e| e as &dyn std::fmt::Display));
        }
        result
    }

    /// Sends `call` over `source`, bounded by the timeout: the connection
    /// it ran on (`None`: none came in time) and the reply, or the
    /// classified error. `connecting` is set while waiting for the
    /// connection.
    ///
    /// # Errors
    /// The source's error when it has no connection to give
    /// ([`ConnSource::connection`]): nothing was sent.
    async fn exchange<S: ConnSource>(
        &self,
        source: &S,
        call: &ScriptCall,
        connecting: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<(Option<S::Tag>, Result<Value, StorageError>), StorageError> {
        use std::sync::atomic::Ordering;
        let mut tag = None;
        let attempt = async {
            if let Some(c) = connecting {
                c.store(true, Ordering::Relaxed);
            }
            let got = source.connection().await;
            if let Some(c) = connecting {
                c.store(false, Ordering::Relaxed);
            }
            let (t, mut conn) = got?;
            tag = Some(t);
            self.clock_gate_on(source, &mut conn).await?;
            Ok(source.eval(&mut conn, &self.script, call).await)
        };
        let result = match tokio::time::timeout(self.timeout, attempt).await {
            Err(_) if tag.is_none() => Err(source.no_connection(self.timeout)),
            Err(_) => Err(StorageError::Timeout(self.timeout)),
            Ok(Err(not_connected)) if tag.is_none() => {
                if let Some(c) = connecting {
                    c.store(false, Ordering::Relaxed);
                }
                return Err(not_connected);
            }
            // The clock check refused the node, or could not run on it.
            Ok(Err(gate)) => Err(gate),
            Ok(Ok(Err(e))) => Err(source.classify(self, &e)),
            Ok(Ok(Ok(v))) => Ok(v),
        };
        if matches!(result, Err(StorageError::Unreachable { .. })) {
            // The connection comes back to a node that may be another: its
            // clock is checked again.
            self.clock.forget();
        }
        if let Some(c) = connecting {
            c.store(false, Ordering::Relaxed);
        }
        Ok((tag, result))
    }

    /// One script call for the queued requests `batch` (one request: its
    /// own call, unchanged): one outcome per request, in order, each what
    /// the request's own call would have given (a failed call fails every
    /// request with its error). Lets the source react once
    /// ([`ConnSource::after`]); the breaker is told by each request.
    pub(crate) async fn call_batch<S: ConnSource>(
        &self,
        source: &S,
        breaker: &CircuitBreaker,
        batch: &[batch::Queued],
        connecting: &std::sync::atomic::AtomicBool,
    ) -> Vec<batch::Outcome> {
        let calls: Vec<&ScriptCall> = batch.iter().map(|q| &q.call).collect();
        let call = ScriptCall::batch(&calls);
        let (tag, reply) = match self.exchange(source, &call, Some(connecting)).await {
            Ok(sent) => sent,
            // Nothing was sent.
            Err(e) => {
                return batch
                    .iter()
                    .map(|_| (Err(batch::share(&e)), false))
                    .collect();
            }
        };
        let outcomes: Vec<Result<RequestResult, StorageError>> = match reply {
            Err(e) => batch.iter().map(|_| Err(batch::share(&e))).collect(),
            Ok(v) if call.requests.is_empty() => vec![call.parse_reply(&v)],
            Ok(v) => match call.parse_batch_reply(&v) {
                Ok(each) => each
                    .into_iter()
                    .map(|r| r.map_err(|e| source.classify(self, &e)))
                    .collect(),
                Err(e) => batch.iter().map(|_| Err(batch::share(&e))).collect(),
            },
        };
        // The source reacts to the call's outcome: its first failure.
        let first_error = outcomes.iter().find_map(|o| o.as_ref().err());
        let overall = match first_error {
            Some(e) => Err(batch::share(e)),
            None => Ok(RequestResult {
                admitted: true,
                charges: Vec::new(),
            }),
        };
        source.after(tag, &overall, breaker);
        outcomes.into_iter().map(|o| (o, true)).collect()
    }

    /// Lets a call go when the script clock of the node behind `source`
    /// is known to be good; checks it first when it is not known (after
    /// a (re)connection, a failover or a script reload) or was bad more
    /// than [`script_clock::RECHECK_AFTER`] ago ([`script_clock`]). With
    /// the test-only explicit clock the script never reads `TIME`, and
    /// nothing is checked. The backends' pings run it (the background
    /// health ping, `/healthcheck`), so the check normally runs when a
    /// connection is made, before the first request; a request's own call
    /// runs it on its connection when the verdict is unknown.
    ///
    /// # Errors
    /// A [`BackendKind::Clock`] error naming the engine problem, or the
    /// check's own connection error or timeout (the verdict then stays
    /// unknown).
    pub(crate) async fn clock_gate<S: ConnSource>(&self, source: &S) -> Result<(), StorageError> {
        if self.test_clock.is_some() || matches!(self.clock.gate(), script_clock::Gate::Pass) {
            return Ok(());
        }
        let attempt = async {
            let (_, mut conn) = source.connection().await?;
            self.clock_gate_on(source, &mut conn).await
        };
        tokio::time::timeout(self.timeout, attempt)
            .await
            .unwrap_or(Err(StorageError::Timeout(self.timeout)))
    }

    /// [`Pipeline::clock_gate`] on a connection already taken (within the
    /// caller's timeout).
    async fn clock_gate_on<S: ConnSource>(
        &self,
        source: &S,
        conn: &mut S::Conn,
    ) -> Result<(), StorageError> {
        if self.test_clock.is_some() {
            return Ok(());
        }
        match self.clock.gate() {
            script_clock::Gate::Pass => return Ok(()),
            script_clock::Gate::Refuse(e) => return Err(e),
            script_clock::Gate::Check => {}
        }
        let reply = ::redis::cmd("EVAL")
            .arg(script_clock::CHECK_SCRIPT)
            .arg(0)
            .query_async::<Value>(conn)
            .await;
        let script_us = match reply {
            Err(e) => {
                // An error reply about the script itself is the engine's
                // refusal; anything else (connection, failover, loading)
                // leaves the verdict unknown.
                let e = source.classify(self, &e);
                match e.backend_kind() {
                    Some(BackendKind::NoPerm | BackendKind::Script | BackendKind::Redis) => {
                        Err(e.to_string())
                    }
                    _ => return Err(e),
                }
            }
            Ok(v) => script_clock::parse_reply(&v).ok_or_else(|| {
                format!("TIME in a script answered {v:?}, not [seconds, microseconds]")
            }),
        };
        self.clock
            .record(script_clock::judge(script_us, script_clock::host_now_us()))
    }

    /// One quota report ([`crate::storage::Storage::report`]) over
    /// `source`: one quota script call behind the circuit breaker, bounded
    /// by the timeout, classified and recorded as a request's call is.
    ///
    /// # Errors
    /// [`StorageError::CircuitOpen`] without a call while `breaker` is open;
    /// [`StorageError::Timeout`] (never replayed) or the classified error.
    pub(crate) async fn report<S: ConnSource>(
        &self,
        source: &S,
        breaker: &CircuitBreaker,
        reports: &[crate::storage::quota::QuotaReport],
    ) -> Result<Vec<crate::storage::quota::QuotaView>, StorageError> {
        let test_now = self
            .explicit_now_us()
            .map(|now| (now, script::TEST_MIN_TTL_MS));
        let args = quota_script::QuotaArgs::new(reports, test_now);
        if !breaker.allow() {
            return Err(StorageError::CircuitOpen);
        }
        let started = Instant::now();
        let mut tag = None;
        let attempt = async {
            let (t, mut conn) = source.connection().await?;
            tag = Some(t);
            Ok(source
                .eval_quota(&mut conn, &self.quota_script, &args)
                .await)
        };
        let result = match tokio::time::timeout(self.timeout, attempt).await {
            Err(_) if tag.is_none() => Err(source.no_connection(self.timeout)),
            Err(_) => Err(StorageError::Timeout(self.timeout)),
            Ok(Err(not_connected)) => return Err(not_connected),
            Ok(Ok(Err(e))) => Err(source.classify(self, &e)),
            Ok(Ok(Ok(v))) => args.parse_reply(&v),
        };
        match &result {
            Ok(_) => breaker.success(),
            Err(e) if e.is_transient() => breaker.failure_of_call_started(started),
            Err(_) => {}
        }
        // The topology reacts to the outcome as to a request's.
        let (outcome, views) = match result {
            Ok(v) => (
                Ok(RequestResult {
                    admitted: true,
                    charges: Vec::new(),
                }),
                Some(v),
            ),
            Err(e) => (Err(e), None),
        };
        source.after(tag, &outcome, breaker);
        match (outcome, views) {
            (_, Some(v)) => Ok(v),
            (Err(e), None) => Err(e),
            (Ok(_), None) => Err(StorageError::backend(
                BackendKind::Internal,
                "no quota views",
            )),
        }
    }

    /// [`crate::storage::Storage::reset`] over `source`: one `DEL` per key
    /// in one pipelined call (the keys of a single node or a Sentinel
    /// master), bounded by the timeout, then the local over-limit cache is
    /// cleared. Not behind the circuit breaker: an operator's reset is
    /// tried even while requests fail fast, and its outcome does not count.
    ///
    /// # Errors
    /// [`StorageError::Timeout`] (the keys may have been deleted) or the
    /// classified error.
    pub(crate) async fn reset<S: ConnSource>(
        &self,
        source: &S,
        keys: &[&str],
    ) -> Result<Vec<bool>, StorageError> {
        let mut pipe = ::redis::pipe();
        for k in keys {
            pipe.del(*k);
        }
        let attempt = async {
            let (_, mut conn) = source.connection().await?;
            Ok(pipe.query_async::<Vec<u64>>(&mut conn).await)
        };
        let result = match tokio::time::timeout(self.timeout, attempt).await {
            Err(_) => Err(StorageError::Timeout(self.timeout)),
            Ok(Err(not_connected)) => Err(not_connected),
            Ok(Ok(Err(e))) => Err(source.classify(self, &e)),
            Ok(Ok(Ok(deleted))) => Ok(deleted.into_iter().map(|n| n > 0).collect()),
        };
        self.clear_cache();
        result
    }

    /// [`errors::classify`] with this backend's timeout and password.
    pub(crate) fn classify(&self, e: &RedisError) -> StorageError {
        errors::classify(e, self.timeout, self.secret.as_deref())
    }

    /// The first step of a request: the answer from the local cache when it
    /// is certain (see [`local_cache::answer_or_note`]).
    pub(crate) fn cached_answer(&self, charges: &[Charge]) -> Option<RequestResult> {
        local_cache::answer_or_note(self.cache.as_ref(), charges, self.local_now_us())
    }

    /// Teaches the local cache Redis's answer to `charges`, sent at
    /// `sent_us` and received now, after [`Self::note_reloads`].
    pub(crate) fn record(&self, charges: &[Charge], result: &RequestResult, sent_us: u64) {
        self.note_reloads();
        if let Some(cache) = &self.cache {
            cache.record_between(charges, result, sent_us, self.local_now_us());
        }
    }

    /// A lost library or script since the last call (`Function not found`,
    /// `NOSCRIPT`: Redis restarted, failed over or flushed its functions or
    /// scripts; not the first load) clears the
    /// local cache and makes the next call check the script's clock again:
    /// the node may be another. With or without a cache.
    pub(crate) fn note_reloads(&self) {
        let reloads = self.script.reloads();
        if self
            .seen_reloads
            .swap(reloads, std::sync::atomic::Ordering::Relaxed)
            != reloads
        {
            if let Some(cache) = &self.cache {
                cache.clear();
            }
            self.clock.forget();
        }
    }

    /// The local over-limit cache, if enabled.
    pub(crate) fn cache(&self) -> Option<&LocalCache> {
        self.cache.as_ref()
    }

    /// Forgets everything the local cache knows.
    pub(crate) fn clear_cache(&self) {
        if let Some(cache) = &self.cache {
            cache.clear();
        }
    }

    /// The explicit `now_us` sent to the script: the test clock's, or `None`
    /// (the script reads Redis `TIME`).
    pub(crate) fn explicit_now_us(&self) -> Option<u64> {
        self.test_clock.as_ref().map(|c| c.now_us())
    }

    /// Time on the local cache's line: the test clock when set (the same time
    /// the script is given), else microseconds since this backend was built.
    pub(crate) fn local_now_us(&self) -> u64 {
        match &self.test_clock {
            Some(c) => c.now_us(),
            None => u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX),
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::algorithm::{BucketLimit, ChargeKind, ChargeResult, ChargeSpec, MICRO_I64};
    use crate::storage::clock::ManualClock;
    use std::num::NonZeroU64;

    /// The cache learns a reply with the time it was received, not only the
    /// time the call was sent: the tokens it reports later are the lower
    /// bound (refilled since the reply), so a reported wait is never short.
    #[test]
    fn the_cache_records_the_time_a_reply_was_received() {
        let clock = ManualClock::new(1_000_000);
        let pipeline = RedisBuilder::new(())
            .test_clock(Arc::new(clock.clone()))
            .pipeline(None);
        let charge = Charge {
            key: "k".into(),
            spec: ChargeSpec {
                limit: BucketLimit {
                    requests_per_unit: 10,
                    unit_secs: NonZeroU64::new(60).expect("a minute"),
                    burst: 10,
                    max_debt: 0,
                }
                .into(),
                cost: 1,
                kind: ChargeKind::Consume,
                shadow: false,
            },
        };
        let denied = RequestResult {
            admitted: false,
            charges: vec![ChargeResult {
                enough: false,
                remaining_micro: 0,
                window: None,
                ..ChargeResult::default()
            }],
        };
        let sent_us = pipeline.local_now_us();
        // The reply comes 300 ms after the call was sent (within an entry's
        // one-second life).
        clock.advance(Duration::from_millis(300));
        pipeline.record(std::slice::from_ref(&charge), &denied, sent_us);
        // 900 ms after sending: at most 0.15 token (since sending, so the
        // denial is certain), at least 0.1 (since the reply): the answer
        // reports the lower bound. Recorded with the send time alone it
        // would say 150,000.
        let r = pipeline
            .cache()
            .expect("enabled")
            .lookup(std::slice::from_ref(&charge), sent_us + 900_000)
            .expect("certain");
        assert_eq!(r.charges[0].remaining_micro, MICRO_I64 / 10);
    }
}
