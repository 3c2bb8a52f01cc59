//! The quota operation (Envoy's Rate Limit Quota Service, RLQS), the
//! second operation of the core beside [`Limiter::decide`]: no protocol
//! types. The gRPC edge (`grpc/rlqs.rs`) maps a stream onto a
//! [`QuotaStream`] and each usage report onto one [`QuotaStream::report`]
//! call (docs/design.md, "Quota sharing").
//!
//! One report:
//! 1. every bucket id (an unordered set of entries) is checked against the
//!    [`Bounds`] and matched against the stream's domain with
//!    [`matcher::find_unordered`](crate::matcher::find_unordered): no rule gives the blanket rule
//!    ([`Action::AllowAll`], or [`Action::DenyAll`] with
//!    `--rlqs-unmatched deny`); an `unlimited` or shadow rule allows all; a
//!    rate of 0 denies all;
//! 2. the subscriber's demand for the bucket is measured on the service's
//!    own clock (allowed plus denied since its last report, at least 1 s,
//!    smoothed) and a bucket idle for [`ABANDON_AFTER`] is abandoned;
//! 3. the limited buckets go to storage in one
//!    [`Storage::report`](crate::storage::Storage::report) call:
//!    the allowed counts are charged to the rule's bucket (the one
//!    `ShouldRateLimit` charges for the same descriptor) and the live
//!    subscribers come back;
//! 4. each limited bucket's assignment is this subscriber's [`share`] of
//!    the rule; an assignment that changed is recorded in storage (one more
//!    `Storage::report` call, charging nothing) before it is sent. Storage
//!    cuts every assignment it records to what the other subscribers'
//!    records leave of the rule's budget, atomically, and the assignment
//!    sent is the one recorded: another stream's report landing between the
//!    two calls cannot take the sum above the budget.

mod bucket;
#[cfg(test)]
mod recheck_tests;
pub mod share;
#[cfg(test)]
mod tests;
mod types;

pub use types::{
    Action, Answer, BucketAnswer, BucketView, QuotaError, StreamView, SubscriberView, Unmatched,
    Usage,
};

use super::Limiter;
use crate::metrics as m;
use crate::storage::clock::{Clock, MonotonicClock};
use crate::storage::quota::{QuotaReport, subscribers_key};
use crate::storage::{ChargeKind, ChargeSpec, MICRO, StorageError};
use bucket::{
    Resolved, budget_held, canonical, demand_milli, demand_of, held_of, id_label, per_bucket,
    resolve, subscribers, to_action,
};
use parking_lot::Mutex;
use share::{Budget, Share};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How often Envoy 1.40 reports, whatever its config says.
pub const REPORT_INTERVAL: Duration = Duration::from_secs(5);
/// Time to live of every assignment: three reporting intervals, so a
/// service that stops answering lets Envoy fall back to its
/// `expired_assignment_behavior` soon after.
pub const ASSIGNMENT_TTL: Duration = Duration::from_secs(15);
/// A bucket reported with no requests for this long is abandoned; a
/// subscriber not heard of for this long is dropped from storage.
pub const ABANDON_AFTER: Duration = Duration::from_secs(15);
/// The debt an RLQS charge may take a bucket to, in seconds of the rule's
/// rate, beyond one burst.
pub const DEBT_SECS: u64 = 5;
/// How soon a stream checks again a bucket whose part was cut below what it
/// is due (the other subscribers still held more than their targets):
/// [`QuotaStream::recheck`], one storage call a second while such a bucket
/// waits, so that a newcomer gets its part within about a second of the
/// holders moving to theirs, not at its own next report.
pub const RECHECK_INTERVAL: Duration = Duration::from_secs(1);
/// How long a bucket cut below its part is rechecked: two reporting
/// intervals, time for every holder to report once and shrink (one
/// interval) with room to spare. A bucket still cut after that (the holders
/// never reach their targets, e.g. replicas whose configs disagree on the
/// rule) stops waiting until it is cut afresh (uncut, then cut again), so a
/// stream never calls storage every second for good.
pub const RECHECK_FOR: Duration = Duration::from_secs(10);

/// The bounds of one stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Buckets one stream may hold (1,000).
    pub max_buckets: usize,
    /// Entries of one bucket id (32).
    pub max_entries: usize,
    /// Bytes of one entry's key or value (256).
    pub max_text_bytes: usize,
    /// Bytes of bucket state every stream of the process may hold together
    /// (64 MiB), each bucket counted as 512 bytes plus three times its
    /// id's text: past it a report that adds
    /// buckets ends its stream with `RESOURCE_EXHAUSTED`, so that many
    /// streams, each within its own bounds, cannot take the process's
    /// memory together.
    pub max_process_bytes: usize,
}

impl Bounds {
    /// The bounds the service runs with.
    pub const DEFAULT: Self = Self {
        max_buckets: 1_000,
        max_entries: 32,
        max_text_bytes: 256,
        max_process_bytes: 64 << 20,
    };
}

/// One bucket id: its entries sorted by key (the canonical form of the
/// unordered set Envoy sends).
pub type BucketId = Vec<(String, String)>;

/// The bytes one tracked bucket counts against [`Bounds::max_process_bytes`]:
/// its id three times (the map key, the admin view's label, the storage
/// keys made of it) and a fixed part for the rest of its state.
fn track_cost(id: &BucketId) -> usize {
    512 + 3 * id.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>()
}

/// Process-wide quota state, held by the [`Limiter`]: the replica's id, the
/// open streams (for the admin view and the drain) and the shutdown signal.
#[derive(Debug)]
pub struct Quotas {
    replica: u64,
    next_stream: AtomicU64,
    streams: Mutex<BTreeMap<u64, Arc<Mutex<StreamView>>>>,
    closing: tokio::sync::watch::Sender<bool>,
    clock: Arc<dyn Clock>,
    unmatched: Unmatched,
    bounds: Bounds,
    /// Bytes of bucket state all streams hold (`track_cost`).
    held_bytes: AtomicU64,
}

impl Default for Quotas {
    fn default() -> Self {
        Self::new(Unmatched::Allow, Arc::new(MonotonicClock::default()))
    }
}

impl Quotas {
    /// Quota state answering unmatched buckets by `unmatched`, timing
    /// reports on `clock` (the service's own clock).
    #[must_use]
    pub fn new(unmatched: Unmatched, clock: Arc<dyn Clock>) -> Self {
        Self {
            replica: {
                use std::hash::{BuildHasher as _, Hasher as _};
                std::hash::RandomState::new().build_hasher().finish()
            },
            next_stream: AtomicU64::new(1),
            streams: Mutex::new(BTreeMap::new()),
            closing: tokio::sync::watch::channel(false).0,
            clock,
            unmatched,
            bounds: Bounds::DEFAULT,
            held_bytes: AtomicU64::new(0),
        }
    }

    /// Tells every open stream to send TTL-0 assignments and close (the
    /// drain on shutdown).
    pub fn close_all(&self) {
        self.closing.send_replace(true);
    }

    /// Resolves once [`Quotas::close_all`] was called.
    #[must_use]
    pub fn closing(&self) -> tokio::sync::watch::Receiver<bool> {
        self.closing.subscribe()
    }

    /// Every open stream's buckets, for the admin view (`GET /rlqs`).
    #[must_use]
    pub fn view(&self) -> Vec<StreamView> {
        self.streams
            .lock()
            .values()
            .map(|s| s.lock().clone())
            .collect()
    }
}

/// Per stream and bucket: the demand tracking and the assignment held.
#[derive(Clone, Debug)]
struct Track {
    bound_us: u64,
    last_report_us: Option<u64>,
    last_active_us: u64,
    /// Smoothed demand, requests a second; `None` until the second report
    /// (the first measures nothing, [`share::with_unmeasured`]).
    demand: Option<f64>,
    held: Option<Action>,
    rule_label: Option<String>,
    /// The storage entry of its last report, while it has a limited rule:
    /// what [`leaving`] turns into the entry that removes its record.
    stored: Option<QuotaReport>,
    /// The rule's budget, while it has a limited rule.
    budget: Option<Budget>,
    /// The part sent last was cut below the part it is due: checked again
    /// every [`RECHECK_INTERVAL`].
    cut: bool,
    /// When `cut` last became true, service clock microseconds.
    cut_since_us: u64,
}

impl Track {
    /// Records whether the part sent is cut below what the bucket is due,
    /// at `now_us` (a bucket cut afresh starts its [`RECHECK_FOR`] window).
    fn set_cut(&mut self, cut: bool, now_us: u64) {
        if cut && !self.cut {
            self.cut_since_us = now_us;
        }
        self.cut = cut;
    }

    /// Whether the bucket is to be rechecked at `now_us`: cut, limited, and
    /// within [`RECHECK_FOR`] of being cut.
    fn rechecking(&self, now_us: u64) -> bool {
        let window = u64::try_from(RECHECK_FOR.as_micros()).unwrap_or(u64::MAX);
        self.cut
            && self.stored.is_some()
            && self.budget.is_some()
            && now_us.saturating_sub(self.cut_since_us) < window
    }
}

/// The entry that removes `last`'s subscriber record from storage (the
/// subscriber leaves: the stream ended or the bucket was abandoned), so that
/// the others' next shares may take what it held at once instead of after
/// its record expires. Charges nothing.
fn leaving(last: &QuotaReport) -> QuotaReport {
    QuotaReport {
        charge: ChargeSpec {
            cost: 0,
            ..last.charge
        },
        demand_milli: 0,
        held: None,
        live_ms: 0,
        ..last.clone()
    }
}

/// One Envoy's stream: its domain, its buckets and their demand. Made by
/// [`Limiter::quota_stream`]; dropped when the stream ends.
#[derive(Debug)]
pub struct QuotaStream {
    limiter: Arc<Limiter>,
    id: u64,
    subscriber: String,
    domain: String,
    tracks: HashMap<BucketId, Track>,
    view: Arc<Mutex<StreamView>>,
    /// This stream's part of [`Quotas::held_bytes`].
    held_bytes: u64,
}

impl Limiter {
    /// Times quota reports on `clock` instead of the monotonic clock (tests
    /// move time with a `ManualClock`).
    #[must_use]
    pub fn with_quota_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.quotas.clock = clock;
        self
    }

    /// Runs the quota service within `bounds` instead of
    /// [`Bounds::DEFAULT`].
    #[must_use]
    pub fn with_quota_bounds(mut self, bounds: Bounds) -> Self {
        self.quotas.bounds = bounds;
        self
    }

    /// The quota state of the process.
    #[must_use]
    pub fn quotas(&self) -> &Quotas {
        &self.quotas
    }

    /// Binds a quota stream to `domain` (the first message's).
    ///
    /// # Errors
    /// [`QuotaError::Invalid`] for an empty or too long domain.
    pub fn quota_stream(self: &Arc<Self>, domain: &str) -> Result<QuotaStream, QuotaError> {
        let q = &self.quotas;
        if domain.is_empty() {
            return Err(QuotaError::Invalid(
                "the first usage report names no domain".into(),
            ));
        }
        if domain.len() > q.bounds.max_text_bytes {
            return Err(QuotaError::Invalid(format!(
                "domain longer than {} bytes",
                q.bounds.max_text_bytes
            )));
        }
        let id = q.next_stream.fetch_add(1, Ordering::Relaxed);
        let subscriber = format!("{:016x}-{id}", q.replica);
        let view = Arc::new(Mutex::new(StreamView {
            subscriber: subscriber.clone(),
            domain: domain.to_owned(),
            buckets: BTreeMap::new(),
        }));
        q.streams.lock().insert(id, view.clone());
        metrics::gauge!(m::RLQS_STREAMS).increment(1.0);
        Ok(QuotaStream {
            limiter: self.clone(),
            id,
            subscriber,
            domain: domain.to_owned(),
            tracks: HashMap::new(),
            view,
            held_bytes: 0,
        })
    }
}

impl Drop for QuotaStream {
    fn drop(&mut self) {
        self.limiter.quotas.streams.lock().remove(&self.id);
        metrics::gauge!(m::RLQS_STREAMS).decrement(1.0);
        #[allow(clippy::cast_precision_loss)]
        metrics::gauge!(m::RLQS_BUCKETS).decrement(self.tracks.len() as f64);
        self.limiter
            .quotas
            .held_bytes
            .fetch_sub(self.held_bytes, Ordering::Relaxed);
    }
}

impl QuotaStream {
    /// The domain the stream is bound to.
    #[must_use]
    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// This stream's subscriber id (replica id and stream number).
    #[must_use]
    pub fn subscriber(&self) -> &str {
        &self.subscriber
    }

    /// Buckets the stream holds.
    #[must_use]
    pub fn buckets(&self) -> usize {
        self.tracks.len()
    }

    /// Answers one usage report: one answer per distinct bucket reported, in
    /// report order (a bucket reported twice in one message counts once,
    /// with the counts added).
    ///
    /// # Errors
    /// [`QuotaError::Invalid`] naming the problem (an empty bucket id, an
    /// empty key, too many entries, a key or value too long, more buckets
    /// than the stream may hold): the stream should end;
    /// [`QuotaError::NoConfig`] before the first config;
    /// [`QuotaError::Storage`] when storage fails.
    pub async fn report(&mut self, usages: &[Usage<'_>]) -> Result<Vec<BucketAnswer>, QuotaError> {
        let bounds = self.limiter.quotas.bounds;
        // A message cannot name more buckets than a stream may hold: refused
        // before any work that grows with it.
        if usages.len() > bounds.max_buckets {
            return Err(QuotaError::Invalid(format!(
                "more than {} buckets on one stream ({} bucket usages in one report)",
                bounds.max_buckets,
                usages.len()
            )));
        }
        let mut merged: Vec<(BucketId, u64, u64)> = Vec::with_capacity(usages.len());
        let mut at: HashMap<BucketId, usize> = HashMap::with_capacity(usages.len());
        for u in usages {
            let id = canonical(u.bucket, &bounds)?;
            if let Some(&i) = at.get(&id) {
                let e = &mut merged[i];
                e.1 = e.1.saturating_add(u.allowed);
                e.2 = e.2.saturating_add(u.denied);
            } else {
                at.insert(id.clone(), merged.len());
                merged.push((id, u.allowed, u.denied));
            }
        }
        let new = merged
            .iter()
            .filter(|(id, ..)| !self.tracks.contains_key(id))
            .count();
        if self.tracks.len() + new > bounds.max_buckets {
            return Err(QuotaError::Invalid(format!(
                "more than {} buckets on one stream",
                bounds.max_buckets
            )));
        }
        let new_bytes: u64 = merged
            .iter()
            .filter(|(id, ..)| !self.tracks.contains_key(id))
            .map(|(id, ..)| track_cost(id) as u64)
            .sum();
        if new_bytes > 0 {
            let max = bounds.max_process_bytes as u64;
            self.limiter
                .quotas
                .held_bytes
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                    held.checked_add(new_bytes).filter(|&after| after <= max)
                })
                .map_err(|_| {
                    QuotaError::Exhausted(format!(
                        "the service holds as much quota bucket state as it may ({} MiB over all streams); a report adding {new} buckets is refused",
                        max >> 20
                    ))
                })?;
            self.held_bytes += new_bytes;
        }
        if self.limiter.config.is_awaiting_first_config() {
            return Err(QuotaError::NoConfig);
        }
        let now = self.limiter.quotas.clock.now_us();
        let config = self.limiter.config();
        let mut answers = Vec::with_capacity(merged.len());
        // Per answer index: the storage entry's index and the bucket's budget.
        let mut pending: Vec<(usize, usize, Budget)> = Vec::new();
        let mut reports = Vec::new();
        for (id, allowed, denied) in merged {
            if !self.tracks.contains_key(&id) {
                metrics::gauge!(m::RLQS_BUCKETS).increment(1.0);
            }
            let track = self.tracks.entry(id.clone()).or_insert(Track {
                bound_us: now,
                last_report_us: None,
                last_active_us: now,
                demand: None,
                held: None,
                rule_label: None,
                stored: None,
                budget: None,
                cut: false,
                cut_since_us: now,
            });
            let since = track.last_report_us.unwrap_or(track.bound_us);
            #[allow(clippy::cast_precision_loss)]
            let secs = (now.saturating_sub(since) as f64 / 1e6).max(1.0);
            #[allow(clippy::cast_precision_loss)]
            let sample = allowed.saturating_add(denied) as f64 / secs;
            // The first report measures nothing (Envoy sends it right after
            // the bucket's first request): demand stays unmeasured until the
            // second.
            track.demand = track
                .last_report_us
                .map(|_| share::smoothed(track.demand, sample));
            track.last_report_us = Some(now);
            if allowed.saturating_add(denied) > 0 {
                track.last_active_us = now;
            }
            let abandon_us = u64::try_from(ABANDON_AFTER.as_micros()).unwrap_or(u64::MAX);
            if now.saturating_sub(track.last_active_us) >= abandon_us {
                if let Some(last) = &track.stored {
                    reports.push(leaving(last));
                }
                self.tracks.remove(&id);
                let cost = track_cost(&id) as u64;
                self.held_bytes -= cost;
                self.limiter
                    .quotas
                    .held_bytes
                    .fetch_sub(cost, Ordering::Relaxed);
                metrics::gauge!(m::RLQS_BUCKETS).decrement(1.0);
                self.view.lock().buckets.remove(&id_label(&id));
                answers.push(BucketAnswer {
                    bucket: id,
                    answer: Answer::Abandon,
                });
                continue;
            }
            match resolve(&self.limiter, &config, &self.domain, &id) {
                Resolved::Blanket(action, rule_label) => {
                    if let Some(last) = track.stored.take() {
                        reports.push(leaving(&last));
                    }
                    track.held = Some(action);
                    track.rule_label.clone_from(&rule_label);
                    track.budget = None;
                    track.cut = false;
                    let demand = track.demand;
                    self.view.lock().buckets.insert(
                        id_label(&id),
                        BucketView {
                            rule: rule_label,
                            demand,
                            assignment: Some(action),
                            subscribers: Vec::new(),
                            balance: None,
                        },
                    );
                    answers.push(BucketAnswer {
                        bucket: id,
                        answer: Answer::Assign {
                            action,
                            ttl: ASSIGNMENT_TTL,
                        },
                    });
                }
                Resolved::Limited {
                    rule_label,
                    key,
                    limit,
                    budget,
                } => {
                    track.rule_label = Some(rule_label);
                    track.budget = Some(budget);
                    let held = track.held.and_then(held_of);
                    let report = QuotaReport {
                        subscribers: subscribers_key(&self.limiter.settings.key_prefix, &key),
                        bucket: key,
                        charge: ChargeSpec {
                            limit,
                            cost: allowed,
                            kind: ChargeKind::Consume,
                            shadow: false,
                        },
                        // One record per bucket id of this stream: ids that
                        // share one storage key (a `share_threshold` rule)
                        // divide its budget instead of each taking it.
                        subscriber: per_bucket(&self.subscriber, &id),
                        demand_milli: demand_milli(track.demand),
                        held,
                        budget: budget_held(&budget),
                        live_ms: u64::try_from(ABANDON_AFTER.as_millis()).unwrap_or(u64::MAX),
                    };
                    // A reload that moved the bucket id to another storage
                    // key leaves the old one.
                    if let Some(last) = &track.stored
                        && (last.bucket != report.bucket || last.subscriber != report.subscriber)
                    {
                        reports.push(leaving(last));
                    }
                    track.stored = Some(report.clone());
                    pending.push((answers.len(), reports.len(), budget));
                    reports.push(report);
                    answers.push(BucketAnswer {
                        bucket: id,
                        answer: Answer::Abandon,
                    });
                }
            }
        }
        drop(config);
        self.share_out(&reports, pending, &mut answers).await?;
        Ok(answers)
    }

    /// Whether a bucket's part was cut below what it is due at the last
    /// report or recheck, less than [`RECHECK_FOR`] ago: then
    /// [`QuotaStream::recheck`] is due within [`RECHECK_INTERVAL`].
    #[must_use]
    pub fn waiting(&self) -> bool {
        let now = self.limiter.quotas.clock.now_us();
        self.tracks.values().any(|t| t.rechecking(now))
    }

    /// Checks again the buckets whose part was cut below what they are due
    /// (the other subscribers held more than their targets when it was
    /// computed): one [`Storage::report`](crate::storage::Storage::report)
    /// call charging nothing and measuring nothing (the record keeps its
    /// demand), then the sharing as after a report. Answers only the buckets
    /// whose assignment changed: a newcomer gets its part about a second
    /// after the holders moved to theirs, not at its own next report (up to
    /// a reporting interval later). The grant is cut by storage as every
    /// recorded assignment is, so the sum bound holds. A bucket whose rule
    /// a reload changed since its last report stops waiting: its next
    /// report answers it under the new rule.
    ///
    /// # Errors
    /// [`QuotaError::Storage`] when storage fails (the buckets stay waiting).
    pub async fn recheck(&mut self) -> Result<Vec<BucketAnswer>, QuotaError> {
        // A reload since the last report may have changed a waiting
        // bucket's rule (its budget, its storage key, or made it a blanket
        // rule): such a bucket is not rechecked under the rule it had, which
        // could grant a part of a budget no longer in force; its next report
        // answers it under the new rule.
        let config = self.limiter.config();
        for (id, t) in &mut self.tracks {
            if !t.cut {
                continue;
            }
            let same = match (resolve(&self.limiter, &config, &self.domain, id), &t.stored) {
                (
                    Resolved::Limited {
                        key, limit, budget, ..
                    },
                    Some(stored),
                ) => {
                    key == stored.bucket && limit == stored.charge.limit && Some(budget) == t.budget
                }
                _ => false,
            };
            if !same {
                t.cut = false;
            }
        }
        drop(config);
        let now = self.limiter.quotas.clock.now_us();
        let mut waiting: Vec<(&BucketId, &Track)> = self
            .tracks
            .iter()
            .filter(|(_, t)| t.rechecking(now))
            .collect();
        waiting.sort_by(|a, b| a.0.cmp(b.0));
        let mut answers = Vec::with_capacity(waiting.len());
        let mut before = Vec::with_capacity(waiting.len());
        let mut pending = Vec::with_capacity(waiting.len());
        let mut reports = Vec::with_capacity(waiting.len());
        for (id, t) in waiting {
            let (Some(stored), Some(budget)) = (&t.stored, t.budget) else {
                continue;
            };
            pending.push((answers.len(), reports.len(), budget));
            reports.push(QuotaReport {
                charge: ChargeSpec {
                    cost: 0,
                    ..stored.charge
                },
                held: t.held.and_then(held_of),
                ..stored.clone()
            });
            before.push(t.held);
            answers.push(BucketAnswer {
                bucket: id.clone(),
                answer: Answer::Abandon,
            });
        }
        if reports.is_empty() {
            return Ok(Vec::new());
        }
        self.share_out(&reports, pending, &mut answers).await?;
        Ok(answers
            .into_iter()
            .zip(before)
            .filter(|(a, was)| match a.answer {
                Answer::Assign { action, .. } => Some(action) != *was,
                Answer::Abandon => false,
            })
            .map(|(a, _)| a)
            .collect())
    }

    /// Sends `reports` to storage and sets each limited bucket's answer
    /// (`pending`: per bucket its answer's index, its entry's index in
    /// `reports` and its rule's budget) to this subscriber's share of the
    /// rule; an assignment that changed is recorded (one more call) before
    /// it is answered, as storage cut it.
    async fn share_out(
        &mut self,
        reports: &[QuotaReport],
        pending: Vec<(usize, usize, Budget)>,
        answers: &mut [BucketAnswer],
    ) -> Result<(), QuotaError> {
        let now = self.limiter.quotas.clock.now_us();
        let mut changed_held = Vec::new();
        // Per recorded change: the answer's index and the bucket's budget.
        let mut changed_at: Vec<(usize, Budget)> = Vec::new();
        if !reports.is_empty() {
            let views = self
                .limiter
                .storage
                .report(reports)
                .await
                .map_err(QuotaError::Storage)?;
            for (answer_at, report_at, budget) in pending {
                let (Some(view), Some(report)) = (views.get(report_at), reports.get(report_at))
                else {
                    return Err(QuotaError::Storage(StorageError::backend(
                        crate::storage::BackendKind::Reply,
                        "fewer quota views than reports",
                    )));
                };
                let recorded = view
                    .subscribers
                    .iter()
                    .find(|s| s.id == report.subscriber)
                    .and_then(|s| s.held);
                let (subs, me) = subscribers(view, report);
                let (got, want) = share::assign_and_want(&budget, &subs, me);
                let action = to_action(got, &budget);
                let id = &answers[answer_at].bucket;
                let track = self.tracks.get_mut(id);
                let (rule, demand) = match track {
                    Some(t) => {
                        t.held = Some(action);
                        t.set_cut(share::is_cut(got, want), now);
                        (t.rule_label.clone(), t.demand)
                    }
                    None => (None, None),
                };
                if let Some(r) = &rule {
                    #[allow(clippy::cast_precision_loss)]
                    metrics::gauge!(m::RLQS_SUBSCRIBERS, "rule" => r.clone())
                        .set(subs.len() as f64);
                }
                self.view.lock().buckets.insert(
                    id_label(id),
                    BucketView {
                        rule,
                        demand,
                        assignment: Some(action),
                        subscribers: view
                            .subscribers
                            .iter()
                            .map(|s| SubscriberView {
                                id: s.id.clone(),
                                demand: demand_of(s.demand_milli),
                                tokens_per_fill: s.held.map(|h| h.tokens_per_fill),
                                max_tokens: s.held.map(|h| h.max_tokens),
                            })
                            .collect(),
                        #[allow(clippy::cast_precision_loss)]
                        balance: Some(view.balance_micro as f64 / MICRO as f64),
                    },
                );
                answers[answer_at].answer = Answer::Assign {
                    action,
                    ttl: ASSIGNMENT_TTL,
                };
                let now_held = held_of(action);
                let changed = now_held.is_some() && now_held != recorded;
                if changed {
                    changed_at.push((answer_at, budget));
                    changed_held.push(QuotaReport {
                        held: now_held,
                        charge: ChargeSpec {
                            cost: 0,
                            ..report.charge
                        },
                        ..report.clone()
                    });
                }
            }
        }
        if !changed_held.is_empty() {
            // A changed assignment is recorded before it is sent, so the
            // others' next shares are cut from what is left (one more call,
            // only when an assignment changes).
            // Storage records each one cut to what the others' records
            // leave of the budget at that moment (a report of another
            // stream or replica may have landed since the views above):
            // what is sent is what was recorded.
            let views = self
                .limiter
                .storage
                .report(&changed_held)
                .await
                .map_err(QuotaError::Storage)?;
            for ((answer_at, budget), (report, view)) in
                changed_at.into_iter().zip(changed_held.iter().zip(&views))
            {
                let recorded = view
                    .subscribers
                    .iter()
                    .find(|s| s.id == report.subscriber)
                    .and_then(|s| s.held)
                    .unwrap_or_default();
                if Some(recorded) == report.held {
                    continue;
                }
                let action = to_action(
                    Share {
                        tokens_per_fill: u64::from(recorded.tokens_per_fill),
                        max_tokens: u64::from(recorded.max_tokens),
                    },
                    &budget,
                );
                tracing::debug!(
                    subscriber = %self.subscriber,
                    computed = ?report.held,
                    recorded = ?recorded,
                    "quota assignment cut to what the other subscribers left"
                );
                let id = &answers[answer_at].bucket;
                if let Some(t) = self.tracks.get_mut(id) {
                    t.held = Some(action);
                    t.set_cut(true, now);
                }
                if let Some(b) = self.view.lock().buckets.get_mut(&id_label(id)) {
                    b.assignment = Some(action);
                }
                answers[answer_at].answer = Answer::Assign {
                    action,
                    ttl: ASSIGNMENT_TTL,
                };
            }
        }
        Ok(())
    }

    /// Removes this stream's subscriber records from storage (one
    /// [`Storage::report`](crate::storage::Storage::report) call, charging
    /// nothing), so that the other subscribers' next reports share what it
    /// held at once, not after its records expire ([`ABANDON_AFTER`]). Called
    /// when the stream ends, whoever ends it.
    /// A stream with no limited bucket makes no call.
    ///
    /// # Errors
    /// [`QuotaError::Storage`] when storage fails: the records then expire
    /// on their own.
    pub async fn leave(&mut self) -> Result<(), QuotaError> {
        let mut entries: Vec<QuotaReport> = self
            .tracks
            .values_mut()
            .filter_map(|t| t.stored.take())
            .map(|last| leaving(&last))
            .collect();
        if entries.is_empty() {
            return Ok(());
        }
        // The same order on every call, whatever the map's.
        entries
            .sort_by(|a, b| (&a.subscribers, &a.subscriber).cmp(&(&b.subscribers, &b.subscriber)));
        self.limiter
            .storage
            .report(&entries)
            .await
            .map(|_| ())
            .map_err(QuotaError::Storage)
    }

    /// The answers that end the stream on shutdown: every bucket's
    /// assignment again with a time to live of 0, so Envoy applies its
    /// `expired_assignment_behavior` at once.
    #[must_use]
    pub fn expire_all(&self) -> Vec<BucketAnswer> {
        let mut out: Vec<BucketAnswer> = self
            .tracks
            .iter()
            .filter_map(|(id, t)| {
                t.held.map(|action| BucketAnswer {
                    bucket: id.clone(),
                    answer: Answer::Assign {
                        action,
                        ttl: Duration::ZERO,
                    },
                })
            })
            .collect();
        out.sort_by(|a, b| a.bucket.cmp(&b.bucket));
        out
    }
}
