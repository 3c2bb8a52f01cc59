//! The quota operation's types seen from outside the core: a usage report's
//! buckets, the answers, the errors, the unmatched-bucket setting and the
//! admin view (`GET /rlqs`).

use super::BucketId;
use crate::storage::StorageError;
use std::collections::BTreeMap;
use std::time::Duration;

/// One bucket of a usage report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage<'a> {
    /// The bucket id's entries, in any order (keys distinct).
    pub bucket: &'a [(&'a str, &'a str)],
    /// Requests Envoy allowed since its last report of the bucket.
    pub allowed: u64,
    /// Requests Envoy denied since then.
    pub denied: u64,
}

/// What Envoy is told to do with a bucket's requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// A token bucket enforced by Envoy.
    TokenBucket {
        /// Tokens held at most (a new assignment starts full).
        max_tokens: u32,
        /// Tokens added every `fill_interval_secs`.
        tokens_per_fill: u32,
        /// Whole seconds between fills.
        fill_interval_secs: u64,
    },
    /// Admit everything.
    AllowAll,
    /// Deny everything.
    DenyAll,
}

/// The answer for one bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Apply `action` for `ttl`.
    Assign {
        /// What to do.
        action: Action,
        /// How long it holds (0: expire now).
        ttl: Duration,
    },
    /// Forget the bucket (idle for [`ABANDON_AFTER`](super::ABANDON_AFTER)).
    Abandon,
}

/// One bucket's answer, for the bucket id as reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketAnswer {
    /// The bucket id (sorted by key).
    pub bucket: BucketId,
    /// What to send.
    pub answer: Answer,
}

/// Why a stream or a report got no answer.
#[derive(Debug, thiserror::Error)]
pub enum QuotaError {
    /// The stream sent something malformed (gRPC `INVALID_ARGUMENT`): the
    /// message names it.
    #[error("{0}")]
    Invalid(String),
    /// The process holds as much quota state as [`Bounds::max_process_bytes`](super::Bounds::max_process_bytes)
    /// allows (gRPC `RESOURCE_EXHAUSTED`): the stream ends.
    #[error("{0}")]
    Exhausted(String),
    /// The config source has not delivered a config yet (gRPC `UNAVAILABLE`).
    #[error("no rate limit configuration loaded")]
    NoConfig,
    /// Storage failed (gRPC `UNAVAILABLE`).
    #[error("rate limit storage unavailable: {0}")]
    Storage(#[source] StorageError),
}

/// What `--rlqs-unmatched` says about a bucket id that matches no rule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Unmatched {
    /// `BlanketRule` `ALLOW_ALL` (the default).
    #[default]
    Allow,
    /// `BlanketRule` `DENY_ALL`.
    Deny,
}

/// One stream as the admin view shows it.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct StreamView {
    /// The subscriber id (replica and stream).
    pub subscriber: String,
    /// The domain bound by the first message.
    pub domain: String,
    /// The buckets reported, by bucket id (`key=value,...`).
    pub buckets: BTreeMap<String, BucketView>,
}

/// One bucket of a stream as the admin view shows it.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct BucketView {
    /// The rule's path (`None`: no rule, the blanket rule applies).
    pub rule: Option<String>,
    /// This subscriber's smoothed demand, requests a second (`None`: not
    /// measured yet, until its second report).
    pub demand: Option<f64>,
    /// The assignment sent last.
    pub assignment: Option<Action>,
    /// Every live subscriber of the rule's bucket (this one included), with
    /// its demand (requests a second) and the assignment it holds.
    pub subscribers: Vec<SubscriberView>,
    /// The rule bucket's balance at the last report, tokens.
    pub balance: Option<f64>,
}

/// One subscriber of a bucket as the admin view shows it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SubscriberView {
    /// Its id.
    pub id: String,
    /// Its smoothed demand, requests a second (`None`: not measured yet).
    pub demand: Option<f64>,
    /// Tokens per fill of the assignment it holds.
    pub tokens_per_fill: Option<u32>,
    /// Max tokens of the assignment it holds.
    pub max_tokens: Option<u32>,
}
