//! The storage seam: every backend takes all charges of one request at once, so
//! that a backend can evaluate and apply them atomically (all-or-nothing,
//! docs/design.md, "All-or-nothing requests") in a single call (one Redis script call on a single node).

pub mod algorithm;
pub mod clock;
pub mod key;
pub mod memory;
pub mod quota;
pub mod redis;

pub use algorithm::{
    AlgorithmKind, BucketLimit, BucketState, ChargeKind, ChargeResult, ChargeSpec, Limit, MICRO,
    RequestResult, ReservationOutcome, State, WindowLimit, WindowState, fixed_window, token_bucket,
};
use async_trait::async_trait;
use smallvec::SmallVec;

/// One descriptor's charge: which key, and what to do with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Charge {
    /// Key identity from [`key::encode`] (prefix included).
    pub key: String,
    /// Limit (and algorithm), cost, kind and shadow flag.
    pub spec: ChargeSpec,
}

/// The error a storage failure was caused by, when there is one (a Redis
/// client error). Its message has the URL's password redacted, as the
/// [`StorageError`] message has.
pub type ErrorSource = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a storage call failed. Classified once here; `service.rs` maps every
/// variant to gRPC `UNAVAILABLE` (or the configured failure policy).
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The backend did not answer within the configured timeout. The call may
    /// or may not have been applied, so it is never replayed (docs/design.md, "Ambiguous failures are never replayed").
    #[error("storage timed out after {0:?}")]
    Timeout(std::time::Duration),
    /// The backend could not be reached (connection refused, reset, DNS, no
    /// connection yet, ...).
    #[error("storage unreachable: {message}")]
    Unreachable {
        /// Detail for logs (passwords redacted).
        message: String,
        /// The client error, if one caused it.
        #[source]
        source: Option<ErrorSource>,
    },
    /// The circuit breaker is open after repeated failures; no call was made.
    #[error("storage circuit open after repeated failures")]
    CircuitOpen,
    /// The backend answered with an error (e.g. `CLUSTERDOWN`, `READONLY`, a
    /// script error) or with a reply of the wrong shape.
    #[error("storage error ({kind}): {message}")]
    Backend {
        /// What kind of error; [`BackendKind::as_str`] is its metric label.
        kind: BackendKind,
        /// Detail for logs (passwords redacted).
        message: String,
        /// The client error, if one caused it.
        #[source]
        source: Option<ErrorSource>,
    },
}

impl StorageError {
    /// [`StorageError::Unreachable`] without a source error.
    #[must_use]
    pub fn unreachable(message: impl Into<String>) -> Self {
        Self::Unreachable {
            message: message.into(),
            source: None,
        }
    }

    /// [`StorageError::Backend`] of `kind` without a source error.
    #[must_use]
    pub fn backend(kind: BackendKind, message: impl Into<String>) -> Self {
        Self::Backend {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// Stable label for the `storage_errors_total{kind}` metric: `timeout`,
    /// `unreachable`, `circuit_open`, or the [`BackendKind`] label.
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Timeout(_) => "timeout",
            Self::Unreachable { .. } => "unreachable",
            Self::CircuitOpen => "circuit_open",
            Self::Backend { kind, .. } => kind.as_str(),
        }
    }

    /// The [`BackendKind`] of a [`StorageError::Backend`].
    #[must_use]
    pub fn backend_kind(&self) -> Option<BackendKind> {
        match self {
            Self::Backend { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// Whether the error says the backend cannot serve now (connection
    /// trouble, a timeout, failover, loading, cluster down, an open breaker),
    /// as opposed to an answer that would be the same on a retry (a script,
    /// argument or reply error). Transient failures count towards opening
    /// the circuit breaker.
    #[must_use]
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Timeout(_) | Self::Unreachable { .. } | Self::CircuitOpen => true,
            Self::Backend { kind, .. } => kind.is_transient(),
        }
    }
}

/// The kind of a [`StorageError::Backend`]: a Redis error code, or what went
/// wrong on our side of the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// `READONLY`: the node is a replica (a stale master after a failover).
    ReadOnly,
    /// `CLUSTERDOWN`, or a Cluster hash slot whose node cannot be reached.
    ClusterDown,
    /// `LOADING`: the node is loading its data set.
    Loading,
    /// `MASTERDOWN`: a replica that lost its master.
    MasterDown,
    /// `TRYAGAIN`: the keys of a slot are being migrated.
    TryAgain,
    /// `MOVED`: the slot lives on another node.
    Moved,
    /// `ASK`: the slot is being migrated to another node.
    Ask,
    /// `CROSSSLOT`: keys of several hash slots in one call.
    CrossSlot,
    /// `NOSCRIPT`: the node does not have the script (or, `Function not
    /// found`, the library).
    NoScript,
    /// `NOPERM`: the ACL user may not run the command.
    NoPerm,
    /// `BUSY`: a script is running too long.
    Busy,
    /// `OOM`: memory full with `noeviction`.
    Oom,
    /// `WRONGTYPE`: a foreign value under a bucket's name.
    WrongType,
    /// Authentication failed.
    Auth,
    /// A reply of the wrong shape.
    Reply,
    /// Any other error raised by the script.
    Script,
    /// A call the script could not compute exactly (an explicit `now_us`
    /// above 2^53); never sent.
    Argument,
    /// The engine's clock inside scripts cannot be used (`TIME` answered
    /// 0, refused, or far from this host's clock): calls are refused
    /// without running the request script.
    Clock,
    /// A failure inside this service (a request task that died).
    Internal,
    /// Any other Redis error.
    Redis,
}

impl BackendKind {
    /// The `kind` label of `storage_errors_total`: the Redis error code in
    /// capitals (`READONLY`, `CLUSTERDOWN`, ...), else lower case (`auth`,
    /// `reply`, `script`, `argument`, `clock`, `internal`, `redis`).
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::ReadOnly => "READONLY",
            Self::ClusterDown => "CLUSTERDOWN",
            Self::Loading => "LOADING",
            Self::MasterDown => "MASTERDOWN",
            Self::TryAgain => "TRYAGAIN",
            Self::Moved => "MOVED",
            Self::Ask => "ASK",
            Self::CrossSlot => "CROSSSLOT",
            Self::NoScript => "NOSCRIPT",
            Self::NoPerm => "NOPERM",
            Self::Busy => "BUSY",
            Self::Oom => "OOM",
            Self::WrongType => "WRONGTYPE",
            Self::Auth => "auth",
            Self::Reply => "reply",
            Self::Script => "script",
            Self::Argument => "argument",
            Self::Clock => "clock",
            Self::Internal => "internal",
            Self::Redis => "redis",
        }
    }

    /// Whether an error of this kind says the node cannot serve now; script,
    /// argument, reply, `NOSCRIPT`, `CROSSSLOT` and `WRONGTYPE` errors would
    /// come back on a healthy node and do not count towards the breaker.
    #[must_use]
    pub const fn is_transient(self) -> bool {
        !matches!(
            self,
            Self::Script
                | Self::Argument
                | Self::Clock
                | Self::Reply
                | Self::NoScript
                | Self::CrossSlot
                | Self::WrongType
        )
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A place where buckets live.
#[async_trait]
pub trait Storage: Send + Sync + std::fmt::Debug + 'static {
    /// Evaluates and applies all `charges` of one request atomically, with the
    /// semantics of [`algorithm::apply_request`]: charges on the same key add
    /// up; the request is admitted only if every non-shadow consume charge
    /// has enough; otherwise nothing is written but the charges taken when
    /// denied (consumes on buckets with a `max_debt`, clamped at
    /// `-max_debt`).
    ///
    /// # Errors
    /// [`StorageError`] when the backend cannot answer; the caller must not
    /// assume anything was or was not applied after a timeout.
    async fn apply(&self, charges: &[Charge]) -> Result<RequestResult, StorageError>;

    /// Makes the buckets under `keys` full (`POST /reset`): forgets their
    /// state, as a bucket never seen is full, and drops what the local
    /// over-limit cache knows. Returns, per key in order, whether it held
    /// state (was not full already). Not atomic across keys on a Cluster
    /// (one `DEL` per key); nothing else is affected.
    ///
    /// # Errors
    /// [`StorageError`] when the backend cannot answer; after a timeout the
    /// keys may or may not have been reset (a retry is harmless: a reset is
    /// idempotent). By default (a backend without stored buckets of its
    /// own, such as a test wrapper) a [`BackendKind::Argument`] error; every
    /// backend of the service implements it.
    async fn reset(&self, keys: &[&str]) -> Result<Vec<bool>, StorageError> {
        let _ = keys;
        Err(StorageError::backend(
            BackendKind::Argument,
            "this storage backend cannot reset buckets",
        ))
    }

    /// Whether the backend answers at all (for `/healthcheck`).
    ///
    /// # Errors
    /// [`StorageError`] when it does not.
    async fn ping(&self) -> Result<(), StorageError>;

    /// Whether charges work now (for `/healthcheck`): by default
    /// [`Storage::ping`]. The single-node and Sentinel backends instead
    /// apply `probe`, a real charge (a consume on a bucket of its own), so a
    /// node that answers `PING` but refuses writes (`READONLY`, `OOM` under
    /// `noeviction`) is reported unhealthy; the outcome counts in the
    /// circuit breaker like any request's. Cluster keeps the ping of any
    /// node: one lost slot range must not take the whole service out of
    /// rotation.
    ///
    /// # Errors
    /// [`StorageError`] when charges do not work.
    async fn check_charges(&self, probe: &Charge) -> Result<(), StorageError> {
        let _ = probe;
        self.ping().await
    }

    /// Records the bucket entries of one quota usage report (Envoy's RLQS,
    /// [`quota`]), each atomically: charges the allowed count to the
    /// bucket with debt, upserts the subscriber's record, drops records not
    /// refreshed for `live_ms` (an entry with `live_ms` 0 removes only its
    /// own record: the subscriber leaves), and returns the balance and the
    /// live subscribers per entry, in order. Each entry names its own
    /// subscriber. One call per report message: one script call on a single
    /// node or Sentinel, one per hash slot of its buckets on a Cluster (an
    /// entry's subscriber records share its bucket's slot).
    ///
    /// # Errors
    /// [`StorageError`] when the backend cannot answer (on a Cluster, when
    /// any slot of the report fails; the other slots' entries may have been
    /// recorded). By default (a backend without quota records of its own,
    /// such as a test wrapper) a [`BackendKind::Argument`] error; every
    /// backend of the service implements it.
    async fn report(
        &self,
        reports: &[quota::QuotaReport],
    ) -> Result<Vec<quota::QuotaView>, StorageError> {
        let _ = reports;
        Err(StorageError::backend(
            BackendKind::Argument,
            "this storage backend keeps no quota subscriber records",
        ))
    }

    /// Short backend name for logs and `/rlconfig` (`memory`, `redis`).
    fn name(&self) -> &'static str;

    /// Forgets any locally cached "over limit until T" knowledge (called when
    /// a new config is applied, docs/design.md, "Reloads"). Default: nothing cached.
    fn invalidate_local_cache(&self) {}

    /// Periodic housekeeping (the memory backend drops full buckets). Default: nothing.
    fn sweep(&self) {}

    /// Called after a reload that can lengthen the time until a bucket is
    /// full again (a rule's rate lowered or its burst raised). A bucket's
    /// state is dropped when it would be full under the limit of its last
    /// write (memory eviction, Redis `PX`); under the new limit it may still
    /// be far from full, and dropping it then would refill it for free
    /// (docs/design.md, "Reloads": a reload never refills a bucket). So every bucket stored
    /// now with a key starting with `prefix` (the keys of one slowed rule,
    /// [`key::rule_prefixes`]) is kept at least `hold_us` past its last
    /// write or past now: that rule's time to full under its new limit.
    /// Runs in the background where it touches storage (on Redis one hold
    /// at a time, paced; a later one for the same prefix replaces a waiting
    /// one). Default: nothing stored.
    fn hold_existing(&self, prefix: &str, hold_us: u64) {
        let _ = (prefix, hold_us);
    }
}

/// The distinct keys of a request's charges, in first-seen order (on the
/// stack for up to 4).
pub type Keys<'a> = SmallVec<[&'a str; 4]>;

/// Per charge: the index of its key in [`Keys`] and its spec.
pub type Indexed = SmallVec<[(usize, ChargeSpec); 4]>;

/// Groups `charges` by key: returns the distinct keys (first-seen order) and,
/// per charge, the index of its key in that list.
#[must_use]
pub fn group_by_key(charges: &[Charge]) -> (Keys<'_>, Indexed) {
    let mut keys = Keys::with_capacity(charges.len());
    let mut indexed = SmallVec::with_capacity(charges.len());
    for c in charges {
        let idx = keys.iter().position(|k| *k == c.key).unwrap_or_else(|| {
            keys.push(&c.key);
            keys.len() - 1
        });
        indexed.push((idx, c.spec));
    }
    (keys, indexed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `kind` labels of `storage_errors_total` stay what dashboards and
    /// alerts match on, and transience follows the kind.
    #[test]
    fn error_kinds_keep_their_metric_labels() {
        let labels: Vec<(&str, bool)> = [
            BackendKind::ReadOnly,
            BackendKind::ClusterDown,
            BackendKind::Loading,
            BackendKind::MasterDown,
            BackendKind::TryAgain,
            BackendKind::Moved,
            BackendKind::Ask,
            BackendKind::CrossSlot,
            BackendKind::NoScript,
            BackendKind::NoPerm,
            BackendKind::Busy,
            BackendKind::Oom,
            BackendKind::WrongType,
            BackendKind::Auth,
            BackendKind::Reply,
            BackendKind::Script,
            BackendKind::Argument,
            BackendKind::Clock,
            BackendKind::Internal,
            BackendKind::Redis,
        ]
        .into_iter()
        .map(|k| {
            let e = StorageError::backend(k, "detail");
            assert_eq!(
                e.to_string(),
                format!("storage error ({}): detail", e.kind())
            );
            (e.kind(), e.is_transient())
        })
        .collect();
        assert_eq!(
            labels,
            [
                ("READONLY", true),
                ("CLUSTERDOWN", true),
                ("LOADING", true),
                ("MASTERDOWN", true),
                ("TRYAGAIN", true),
                ("MOVED", true),
                ("ASK", true),
                ("CROSSSLOT", false),
                ("NOSCRIPT", false),
                ("NOPERM", true),
                ("BUSY", true),
                ("OOM", true),
                ("WRONGTYPE", false),
                ("auth", true),
                ("reply", false),
                ("script", false),
                ("argument", false),
                ("clock", false),
                ("internal", true),
                ("redis", true),
            ]
        );
        for (e, label) in [
            (
                StorageError::Timeout(std::time::Duration::from_millis(50)),
                "timeout",
            ),
            (StorageError::unreachable("refused"), "unreachable"),
            (StorageError::CircuitOpen, "circuit_open"),
        ] {
            assert_eq!(e.kind(), label);
            assert!(e.is_transient(), "{label}");
        }
    }
}
