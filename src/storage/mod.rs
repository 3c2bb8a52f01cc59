//! The storage seam: every backend takes all charges of one request at once, so
//! that a backend can evaluate and apply them atomically (all-or-nothing,
//! DESIGN 3) in a single call (one Redis script call on a single node).

pub mod bucket;
pub mod clock;
pub mod key;
pub mod memory;
pub mod redis;

use async_trait::async_trait;
pub use bucket::{BucketState, ChargeKind, ChargeResult, ChargeSpec, Limit, RequestResult};

/// One descriptor's charge: which bucket, and what to do with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Charge {
    /// Bucket identity from [`key::encode`] (prefix included).
    pub key: String,
    /// Limit, cost, kind and shadow flag.
    pub spec: ChargeSpec,
}

/// Why a storage call failed. Classified once here; `service.rs` maps every
/// variant to gRPC `UNAVAILABLE` (or the configured failure policy).
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The backend did not answer within the configured timeout. The call may
    /// or may not have been applied, so it is never replayed (BR-24).
    #[error("storage timed out after {0:?}")]
    Timeout(std::time::Duration),
    /// The backend could not be reached (connection refused, reset, DNS, ...).
    #[error("storage unreachable: {0}")]
    Unreachable(String),
    /// The circuit breaker is open after repeated failures; no call was made.
    #[error("storage circuit open after repeated failures")]
    CircuitOpen,
    /// The backend answered with an error (e.g. `CLUSTERDOWN`, `READONLY`, a
    /// script error) or with a reply of the wrong shape.
    #[error("storage error ({kind}): {message}")]
    Backend {
        /// Short stable label for metrics, e.g. `CLUSTERDOWN`, `READONLY`, `script`.
        kind: String,
        /// Detail for logs.
        message: String,
    },
}

impl StorageError {
    /// Stable label for the `storage_errors_total{kind}` metric.
    #[must_use]
    pub fn kind(&self) -> &str {
        match self {
            Self::Timeout(_) => "timeout",
            Self::Unreachable(_) => "unreachable",
            Self::CircuitOpen => "circuit_open",
            Self::Backend { kind, .. } => kind,
        }
    }
}

/// A place where buckets live.
#[async_trait]
pub trait Storage: Send + Sync + std::fmt::Debug + 'static {
    /// Evaluates and applies all `charges` of one request atomically, with the
    /// semantics of [`bucket::apply_request`]: charges on the same key add up;
    /// the request is admitted only if every non-shadow consume charge has
    /// enough tokens; otherwise nothing is written.
    ///
    /// # Errors
    /// [`StorageError`] when the backend cannot answer; the caller must not
    /// assume anything was or was not applied after a timeout.
    async fn apply(&self, charges: &[Charge]) -> Result<RequestResult, StorageError>;

    /// Whether the backend answers at all (for `/healthcheck`).
    ///
    /// # Errors
    /// [`StorageError`] when it does not.
    async fn ping(&self) -> Result<(), StorageError>;

    /// Short backend name for logs and `/rlconfig` (`memory`, `redis`).
    fn name(&self) -> &'static str;

    /// Forgets any locally cached "over limit until T" knowledge (called when
    /// a new config is applied, BR-21). Default: nothing cached.
    fn invalidate_local_cache(&self) {}

    /// Periodic housekeeping (the memory backend drops full buckets). Default: nothing.
    fn sweep(&self) {}

    /// Called after a reload that can lengthen the time until a bucket is
    /// full again (a rule's rate lowered or its burst raised). A bucket's
    /// state is dropped when it would be full under the limit of its last
    /// write (memory eviction, Redis `PX`); under the new limit it may still
    /// be far from full, and dropping it then would refill it for free
    /// (DESIGN 3: a reload never refills a bucket). So every bucket stored
    /// now (keys starting with `prefix`) is kept at least `hold_us` past its
    /// last write or past now: the longest time to full of any rule of the
    /// new config. Runs in the background where it touches storage. Default:
    /// nothing stored.
    fn hold_existing(&self, prefix: &str, hold_us: u64) {
        let _ = (prefix, hold_us);
    }
}

/// Groups `charges` by key: returns the distinct keys (first-seen order) and,
/// per charge, the index of its key in that list.
#[must_use]
pub fn group_by_key(charges: &[Charge]) -> (Vec<&str>, Vec<(usize, ChargeSpec)>) {
    let mut keys: Vec<&str> = Vec::with_capacity(charges.len());
    let mut indexed = Vec::with_capacity(charges.len());
    for c in charges {
        let idx = keys.iter().position(|k| *k == c.key).unwrap_or_else(|| {
            keys.push(&c.key);
            keys.len() - 1
        });
        indexed.push((idx, c.spec));
    }
    (keys, indexed)
}
