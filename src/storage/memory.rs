//! The `memory` backend: one process, no Redis.
//!
//! A fixed number of shards, each a mutex around a hash map from key to its
//! [`State`] (a bucket's balance and stamp), evaluated through the request
//! driver of the algorithm seam ([`algorithm::apply_request`]). A request locks every shard it touches, in ascending shard
//! order (no deadlock), so all-or-nothing holds under concurrency. A bucket is
//! dropped once it would be full again (its state then equals "never seen"), by
//! an amortised sweep on insert and by [`MemoryStorage::sweep`], which the
//! service runs periodically; memory therefore shrinks back after a burst of
//! unique values (docs/design.md, "Unbounded client values").
//!
//! A hard cap bounds memory even when buckets take long to refill (a per-value
//! rule per day or year under a flood of unique values): at most
//! [`DEFAULT_MAX_BUCKETS`] buckets by default (about 150 bytes each). Past the
//! cap a shard first drops full buckets, then forgets a random eighth of its
//! buckets (a new draw with a per-process secret each time, so no client can
//! choose which): those clients get a full bucket early, and
//! `bucket_rls_memory_evictions_total` counts them. Redis is the backend for
//! exact limits at that scale.

use super::algorithm::{self, Book, ChargeKind, Limit, State};
use super::clock::{Clock, MonotonicClock};
use super::quota::{QuotaReport, QuotaView, SubscriberRecord};
use super::{Charge, RequestResult, Storage, StorageError, group_by_key};
use async_trait::async_trait;
use parking_lot::{Mutex, MutexGuard};
use smallvec::{SmallVec, smallvec};
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;

const SHARDS: usize = 64;
const MIN_SWEEP_LEN: usize = 1024;

/// Default most buckets held by one process.
pub const DEFAULT_MAX_BUCKETS: usize = 2_000_000;

#[derive(Debug, Default)]
struct Shard {
    /// key -> (state, microsecond time at which it is the same as never seen)
    map: HashMap<String, (State, u64)>,
    /// bucket key -> its open reservations (docs/design.md,
    /// "Reservations"), under the bucket's shard lock. Kept apart from the
    /// bucket: a bucket full again is forgotten, its reservations are not.
    books: HashMap<String, Book>,
    next_sweep_len: usize,
    /// Cap evictions so far: each draws a new random order.
    evict_round: u64,
}

impl Shard {
    /// Keeps the shard at most `max_len` long: full buckets go first, then a
    /// random eighth of the rest. Random, with a per-process secret and a
    /// new draw each round, because any order a client can predict lets it
    /// choose the victim: under "closest to full first", a client drained
    /// its own bucket and then flooded unique values drained to zero, so its
    /// own bucket became the closest to full and was forgotten first.
    fn enforce_cap(&mut self, now_us: u64, max_len: usize, hasher: &RandomState) {
        if self.map.len() <= max_len {
            return;
        }
        self.sweep(now_us);
        if self.map.len() <= max_len {
            return;
        }
        self.evict_round = self.evict_round.wrapping_add(1);
        let round = self.evict_round;
        let score = |k: &String| hasher.hash_one((k.as_str(), round));
        let mut scores: Vec<u64> = self.map.keys().map(score).collect();
        let drop = (self.map.len() / 8).max(self.map.len() - max_len);
        let (_, threshold, _) = scores.select_nth_unstable(drop - 1);
        let threshold = *threshold;
        let before = self.map.len();
        let mut budget = drop;
        self.map.retain(|k, _| {
            if budget > 0 && score(k) <= threshold {
                budget -= 1;
                false
            } else {
                true
            }
        });
        metrics::counter!(crate::metrics::MEMORY_EVICTIONS)
            .increment((before - self.map.len()) as u64);
        self.next_sweep_len = (self.map.len() * 2).max(MIN_SWEEP_LEN);
    }

    /// Keeps at most `max_len` books: expired reservations go first, then
    /// a random eighth of the books (as for buckets: no client can choose
    /// which); their estimates stay charged.
    fn enforce_book_cap(&mut self, now_us: u64, max_len: usize, hasher: &RandomState) {
        if self.books.len() <= max_len {
            return;
        }
        self.sweep_books(now_us);
        if self.books.len() <= max_len {
            return;
        }
        self.evict_round = self.evict_round.wrapping_add(1);
        let round = self.evict_round;
        let score = |k: &String| hasher.hash_one((k.as_str(), round, "book"));
        let mut scores: Vec<u64> = self.books.keys().map(score).collect();
        let drop = (self.books.len() / 8).max(self.books.len() - max_len);
        let (_, threshold, _) = scores.select_nth_unstable(drop - 1);
        let threshold = *threshold;
        let mut budget = drop;
        self.books.retain(|k, _| {
            if budget > 0 && score(k) <= threshold {
                budget -= 1;
                false
            } else {
                true
            }
        });
    }

    /// Drops expired reservations, and books left empty.
    fn sweep_books(&mut self, now_us: u64) {
        self.books.retain(|_, book| {
            book.retain(|_, h| h.expires_us > now_us);
            !book.is_empty()
        });
    }

    fn sweep(&mut self, now_us: u64) {
        self.sweep_books(now_us);
        self.map.retain(|_, (_, full_at)| *full_at > now_us);
        if self.map.capacity() > 4 * self.map.len().max(MIN_SWEEP_LEN) {
            self.map.shrink_to(self.map.len() * 2);
        }
        self.next_sweep_len = (self.map.len() * 2).max(MIN_SWEEP_LEN);
    }
}

/// In-process token buckets. Cheap to clone (shared state).
#[derive(Debug, Clone)]
pub struct MemoryStorage {
    shards: Arc<Vec<Mutex<Shard>>>,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
    max_per_shard: usize,
    /// RLQS subscriber records ([`super::quota`]): records key -> (expiry
    /// in microseconds, subscriber id -> (demand, held, last seen)).
    quotas: Arc<Mutex<QuotaMap>>,
}

type QuotaMap = HashMap<String, (u64, std::collections::BTreeMap<String, QuotaRecord>)>;
type QuotaRecord = (u64, Option<super::quota::Held>, u64);

impl Default for MemoryStorage {
    fn default() -> Self {
        Self::new(Arc::new(MonotonicClock::default()))
    }
}

impl MemoryStorage {
    /// A memory backend reading time from `clock`.
    #[must_use]
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self::with_max_buckets(clock, DEFAULT_MAX_BUCKETS)
    }

    /// A memory backend holding at most about `max_buckets` buckets (rounded
    /// up to a multiple of the shard count; see the module docs for what
    /// happens past it).
    #[must_use]
    pub fn with_max_buckets(clock: Arc<dyn Clock>, max_buckets: usize) -> Self {
        let shards = (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect();
        Self {
            shards: Arc::new(shards),
            hasher: RandomState::new(),
            clock,
            max_per_shard: max_buckets.div_ceil(SHARDS).max(1),
            quotas: Arc::default(),
        }
    }

    fn shard_of(&self, key: &str) -> usize {
        usize::try_from(self.hasher.hash_one(key) % SHARDS as u64).unwrap_or(0)
    }

    /// Number of buckets held (not yet full again).
    #[must_use]
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().map.len()).sum()
    }

    /// True when no bucket is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every bucket that is full again by now (and the quota
    /// subscriber records that expired) and returns how many buckets remain.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now_us();
        self.quotas.lock().retain(|_, (expires, _)| *expires > now);
        self.shards
            .iter()
            .map(|s| {
                let mut g = s.lock();
                g.sweep(now);
                g.map.len()
            })
            .sum()
    }

    /// Applies one request synchronously (the async trait method wraps this).
    #[must_use]
    pub fn apply_sync(&self, charges: &[Charge]) -> RequestResult {
        let (keys, indexed) = group_by_key(charges);
        let shard_ids: SmallVec<[usize; 4]> = keys.iter().map(|k| self.shard_of(k)).collect();
        let mut order = shard_ids.clone();
        order.sort_unstable();
        order.dedup();
        let mut guards: SmallVec<[(usize, MutexGuard<'_, Shard>); 4]> =
            order.iter().map(|&i| (i, self.shards[i].lock())).collect();
        let guard_pos = |shard: usize| order.binary_search(&shard).unwrap_or(0);
        let now = self.clock.now_us();
        let states: SmallVec<[Option<State>; 4]> = keys
            .iter()
            .zip(&shard_ids)
            .map(|(k, &s)| {
                guards[guard_pos(s)]
                    .1
                    .map
                    .get(*k)
                    // Not filtered by `full_at`: that was computed under the
                    // limit of the last write; the state itself is exact under
                    // any limit (a reload to a slower rate must not refill).
                    .map(|(st, _)| *st)
            })
            .collect();
        // The limit of a key's last charge decides when it expires.
        let mut limit_of: SmallVec<[Option<Limit>; 4]> = smallvec![None; keys.len()];
        for (i, spec) in &indexed {
            limit_of[*i] = Some(spec.limit);
        }
        let max_per_shard = self.max_per_shard;
        let hasher = &self.hasher;
        // The books of the keys reservation charges touch (a copy: the
        // driver writes whole books back).
        let reserving = indexed.iter().any(|(_, s)| {
            matches!(
                s.kind,
                ChargeKind::Reserve(_) | ChargeKind::Settle { .. } | ChargeKind::Unreserve { .. }
            )
        });
        let books: SmallVec<[Option<Book>; 4]> = if reserving {
            keys.iter()
                .zip(&shard_ids)
                .map(|(k, &s)| guards[guard_pos(s)].1.books.get(*k).cloned())
                .collect()
        } else {
            SmallVec::new()
        };
        let book_refs: SmallVec<[Option<&Book>; 4]> = books.iter().map(Option::as_ref).collect();
        let mut book_writes: SmallVec<[(usize, Book); 2]> = SmallVec::new();
        let result = algorithm::apply_request_with_books(
            &indexed,
            &states,
            &book_refs,
            now,
            |i, st| {
                let shard = &mut guards[guard_pos(shard_ids[i])].1;
                let ttf = limit_of[i].map_or(0, |l| l.expiry_us(&st));
                if ttf == 0 {
                    shard.map.remove(keys[i]);
                    return;
                }
                let full_at = st
                    .updated_us()
                    .saturating_add(u64::try_from(ttf).unwrap_or(u64::MAX));
                // An existing bucket is updated in place: no key allocated.
                if let Some(slot) = shard.map.get_mut(keys[i]) {
                    *slot = (st, full_at);
                } else {
                    shard.map.insert(keys[i].to_owned(), (st, full_at));
                }
                if shard.map.len() >= shard.next_sweep_len {
                    shard.sweep(now);
                }
                shard.enforce_cap(now, max_per_shard, hasher);
            },
            |i, book| book_writes.push((i, book)),
        );
        for (i, book) in book_writes {
            let shard = &mut guards[guard_pos(shard_ids[i])].1;
            if book.is_empty() {
                shard.books.remove(keys[i]);
            } else {
                shard.books.insert(keys[i].to_owned(), book);
                shard.enforce_book_cap(now, max_per_shard, hasher);
            }
        }
        result
    }

    /// The open reservations of the bucket under `key` at now, as
    /// `(tokens, expires_us)` per reservation (tests and diagnostics).
    #[must_use]
    pub fn open_reservations(&self, key: &str) -> Vec<(u64, u64)> {
        let now = self.clock.now_us();
        self.shards[self.shard_of(key)]
            .lock()
            .books
            .get(key)
            .map(|b| {
                b.values()
                    .filter(|h| h.expires_us > now)
                    .map(|h| (h.tokens, h.expires_us))
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[async_trait]
impl Storage for MemoryStorage {
    async fn apply(&self, charges: &[Charge]) -> Result<RequestResult, StorageError> {
        Ok(self.apply_sync(charges))
    }

    async fn ping(&self) -> Result<(), StorageError> {
        Ok(())
    }

    async fn reset(&self, keys: &[&str]) -> Result<Vec<bool>, StorageError> {
        let now = self.clock.now_us();
        Ok(keys
            .iter()
            .map(|k| {
                self.shards[self.shard_of(k)]
                    .lock()
                    .map
                    .remove(*k)
                    .is_some_and(|(_, full_at)| full_at > now)
            })
            .collect())
    }

    fn name(&self) -> &'static str {
        "memory"
    }

    async fn report(&self, reports: &[QuotaReport]) -> Result<Vec<QuotaView>, StorageError> {
        let mut out = Vec::with_capacity(reports.len());
        for r in reports {
            let mut charge = Charge {
                key: r.bucket.clone(),
                spec: r.charge,
            };
            let charged = self.apply_sync(std::slice::from_ref(&charge));
            // A charge that did not fit (taken as debt) reports the balance
            // before it; the view is the balance after it.
            let charged = if charged.admitted {
                charged
            } else {
                charge.spec.cost = 0;
                self.apply_sync(std::slice::from_ref(&charge))
            };
            let balance_micro = charged.charges.first().map_or(0, |c| c.remaining_micro);
            let now = self.clock.now_us();
            let live_us = r.live_ms.saturating_mul(1000);
            let mut quotas = self.quotas.lock();
            if live_us == 0 {
                // The subscriber leaves: its record alone goes.
                if let Some((_, subs)) = quotas.get_mut(&r.subscribers) {
                    subs.remove(&r.subscriber);
                }
                out.push(QuotaView {
                    balance_micro,
                    subscribers: Vec::new(),
                });
                continue;
            }
            let (expires, subs) = quotas.entry(r.subscribers.clone()).or_default();
            *expires = now.saturating_add(live_us);
            subs.retain(|_, (_, _, seen)| now.saturating_sub(*seen) < live_us);
            // Under the lock: the others' records cannot change between
            // this sum and the write.
            let others = subs
                .iter()
                .filter(|(id, _)| **id != r.subscriber)
                .filter_map(|(_, (_, held, _))| *held)
                .fold((0u64, 0u64), |(t, m), h| {
                    (
                        t.saturating_add(u64::from(h.tokens_per_fill)),
                        m.saturating_add(super::quota::max_against_burst(
                            u64::from(h.tokens_per_fill),
                            u64::from(h.max_tokens),
                        )),
                    )
                });
            let held = super::quota::fit(r.held, r.budget, others);
            subs.insert(r.subscriber.clone(), (r.demand_milli, held, now));
            subs.retain(|_, (_, _, seen)| now.saturating_sub(*seen) < live_us);
            out.push(QuotaView {
                balance_micro,
                subscribers: subs
                    .iter()
                    .map(|(id, &(demand_milli, held, _))| SubscriberRecord {
                        id: id.clone(),
                        demand_milli,
                        held,
                    })
                    .collect(),
            });
        }
        Ok(out)
    }

    fn sweep(&self) {
        MemoryStorage::sweep(self);
    }

    fn hold_existing(&self, prefix: &str, hold_us: u64) {
        for shard in self.shards.iter() {
            for (key, (st, full_at)) in &mut shard.lock().map {
                if key.starts_with(prefix) {
                    *full_at = (*full_at).max(st.updated_us().saturating_add(hold_us));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::algorithm::{BucketLimit, ChargeKind, ChargeSpec, MICRO_I64};
    use crate::storage::clock::ManualClock;
    use std::time::Duration;

    fn charge(key: &str, r: u32, u: u64, cost: u64) -> Charge {
        Charge {
            key: key.into(),
            spec: ChargeSpec {
                limit: BucketLimit {
                    requests_per_unit: r,
                    unit_secs: std::num::NonZeroU64::new(u).expect("a unit of at least 1 s"),
                    burst: r,
                    max_debt: 0,
                }
                .into(),
                cost,
                kind: ChargeKind::Consume,
                shadow: false,
            },
        }
    }

    #[test]
    fn full_buckets_are_evicted() {
        let clock = ManualClock::new(1_000_000);
        let m = MemoryStorage::new(Arc::new(clock.clone()));
        for i in 0..5000 {
            assert!(m.apply_sync(&[charge(&format!("k{i}"), 10, 1, 1)]).admitted);
        }
        assert_eq!(m.len(), 5000);
        clock.advance(Duration::from_millis(100));
        assert_eq!(m.sweep(), 0);
    }

    /// A yearly rule of burst 10: nothing refills during the test.
    fn yearly(key: &str, cost: u64) -> Charge {
        Charge {
            key: key.into(),
            spec: ChargeSpec {
                limit: BucketLimit {
                    requests_per_unit: 10,
                    unit_secs: std::num::NonZeroU64::new(31_536_000).expect("a year"),
                    burst: 10,
                    max_debt: 0,
                }
                .into(),
                cost,
                kind: ChargeKind::Consume,
                shadow: false,
            },
        }
    }

    #[test]
    fn the_cap_bounds_buckets() {
        let clock = ManualClock::new(1_000_000);
        let m = MemoryStorage::with_max_buckets(Arc::new(clock.clone()), 64 * 100);
        for i in 0..50_000 {
            assert!(m.apply_sync(&[yearly(&format!("k{i}"), 1)]).admitted);
        }
        assert!(m.len() <= 64 * 100, "{} buckets", m.len());
    }

    /// The attack: a client drains its own buckets, then floods unique
    /// values each drained by `hits = burst`, so its own buckets are the
    /// closest to full; under "closest to full first" they were forgotten
    /// first (every one of them), and the client got full buckets back. Now
    /// the victims are random: about one in eight is forgotten per round,
    /// like any other bucket (at most half here; a chance draw past that is
    /// below one in a billion).
    #[test]
    fn a_client_cannot_steer_cap_eviction_onto_its_own_drained_buckets() {
        let clock = ManualClock::new(1_000_000);
        let cap = 64 * 64;
        let m = MemoryStorage::with_max_buckets(Arc::new(clock.clone()), cap);
        let own: Vec<String> = (0..256).map(|i| format!("own{i}")).collect();
        for k in &own {
            assert!(m.apply_sync(&[yearly(k, 10)]).admitted);
        }
        // A second later the own buckets hold a little more than the flood's.
        clock.advance(std::time::Duration::from_secs(1));
        for i in 0..cap + cap / 8 {
            // Time moves during the flood: each flood bucket is further from
            // full than the one before.
            clock.advance(std::time::Duration::from_micros(1));
            assert!(m.apply_sync(&[yearly(&format!("flood{i}"), 10)]).admitted);
        }
        let forgotten = own
            .iter()
            .filter(|k| m.apply_sync(&[yearly(k, 0)]).charges[0].enough)
            .count();
        eprintln!("{forgotten} of {} own drained buckets forgotten", own.len());
        assert!(
            forgotten <= own.len() / 2,
            "{forgotten} of {} own drained buckets forgotten",
            own.len()
        );
    }

    #[test]
    fn a_slower_rate_after_reload_does_not_refill() {
        let clock = ManualClock::new(1_000_000);
        let m = MemoryStorage::new(Arc::new(clock.clone()));
        assert!(m.apply_sync(&[charge("k", 10, 1, 10)]).admitted);
        // Reloaded to 10 per hour; 1.5 s later (past the old time to full).
        clock.advance(Duration::from_millis(1500));
        let r = m.apply_sync(&[charge("k", 10, 3600, 1)]);
        assert!(!r.admitted, "{r:?}");
    }

    #[test]
    fn refund_never_creates_a_bucket() {
        let m = MemoryStorage::new(Arc::new(ManualClock::new(0)));
        let mut c = charge("k", 10, 60, 5);
        c.spec.kind = ChargeKind::Refund;
        let r = m.apply_sync(&[c]);
        assert!(r.admitted);
        assert!(m.is_empty());
        let r = m.apply_sync(&[charge("k", 10, 60, 4)]);
        assert_eq!(r.charges[0].remaining_micro, 6 * MICRO_I64);
    }

    #[test]
    fn concurrent_all_or_nothing() {
        let m = MemoryStorage::new(Arc::new(ManualClock::new(0)));
        let admitted = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for t in 0..8 {
                let m = &m;
                let admitted = &admitted;
                s.spawn(move || {
                    for i in 0..100 {
                        let r = m.apply_sync(&[
                            charge(&format!("big{}", (t + i) % 3), 1000, 60, 1),
                            charge("small", 3, 60, 1),
                        ]);
                        if r.admitted {
                            admitted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                    }
                });
            }
        });
        assert_eq!(admitted.into_inner(), 3);
    }
}
