//! The `memory` backend: one process, no Redis.
//!
//! A fixed number of shards, each a mutex around a hash map from bucket key to
//! [`BucketState`]. A request locks every shard it touches, in ascending shard
//! order (no deadlock), so all-or-nothing holds under concurrency. A bucket is
//! dropped once it would be full again (its state then equals "never seen"), by
//! an amortised sweep on insert and by [`MemoryStorage::sweep`], which the
//! service runs periodically; memory therefore stays bounded under unique values
//! (BR-31) and shrinks back after a burst of them.

use super::bucket::{self, BucketState};
use super::clock::{Clock, SystemClock};
use super::{Charge, RequestResult, Storage, StorageError, group_by_key};
use async_trait::async_trait;
use parking_lot::{Mutex, MutexGuard};
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;

const SHARDS: usize = 64;
const MIN_SWEEP_LEN: usize = 1024;

#[derive(Debug, Default)]
struct Shard {
    /// key -> (state, microsecond time at which the bucket is full again)
    map: HashMap<String, (BucketState, u64)>,
    next_sweep_len: usize,
}

impl Shard {
    fn sweep(&mut self, now_us: u64) {
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
}

impl Default for MemoryStorage {
    fn default() -> Self {
        Self::new(Arc::new(SystemClock))
    }
}

impl MemoryStorage {
    /// A memory backend reading time from `clock`.
    #[must_use]
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        let shards = (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect();
        Self {
            shards: Arc::new(shards),
            hasher: RandomState::new(),
            clock,
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

    /// Drops every bucket that is full again by now and returns how many remain.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now_us();
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
        let shard_ids: Vec<usize> = keys.iter().map(|k| self.shard_of(k)).collect();
        let mut order: Vec<usize> = shard_ids.clone();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> =
            order.iter().map(|&i| (i, self.shards[i].lock())).collect();
        let guard_pos = |shard: usize| order.binary_search(&shard).unwrap_or(0);
        let now = self.clock.now_us();
        let states: Vec<Option<BucketState>> = keys
            .iter()
            .zip(&shard_ids)
            .map(|(k, &s)| {
                guards[guard_pos(s)]
                    .1
                    .map
                    .get(*k)
                    .filter(|(_, full_at)| *full_at > now)
                    .map(|(st, _)| *st)
            })
            .collect();
        // The limit of a bucket's last charge decides when it is full again.
        let mut limit_of = vec![None; keys.len()];
        for (i, spec) in &indexed {
            limit_of[*i] = Some(spec.limit);
        }
        bucket::apply_request(&indexed, &states, now, |i, st| {
            let shard = &mut guards[guard_pos(shard_ids[i])].1;
            let ttf = limit_of[i].map_or(0, |l| bucket::time_to_full_us(&l, st.tokens_micro));
            if ttf == 0 {
                shard.map.remove(keys[i]);
                return;
            }
            let full_at = st
                .updated_us
                .saturating_add(u64::try_from(ttf).unwrap_or(u64::MAX));
            shard.map.insert(keys[i].to_owned(), (st, full_at));
            if shard.map.len() >= shard.next_sweep_len {
                shard.sweep(now);
            }
        })
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

    fn name(&self) -> &'static str {
        "memory"
    }

    fn sweep(&self) {
        MemoryStorage::sweep(self);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::bucket::{ChargeKind, ChargeSpec, Limit, MICRO};
    use crate::limiter::clock::ManualClock;
    use std::time::Duration;

    fn charge(key: &str, r: u32, u: u64, cost: u64) -> Charge {
        Charge {
            key: key.into(),
            spec: ChargeSpec {
                limit: Limit {
                    requests_per_unit: r,
                    unit_secs: u,
                    burst: u64::from(r),
                },
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

    #[test]
    fn refund_never_creates_a_bucket() {
        let m = MemoryStorage::new(Arc::new(ManualClock::new(0)));
        let mut c = charge("k", 10, 60, 5);
        c.spec.kind = ChargeKind::Refund;
        let r = m.apply_sync(&[c]);
        assert!(r.admitted);
        assert!(m.is_empty());
        let r = m.apply_sync(&[charge("k", 10, 60, 4)]);
        assert_eq!(r.charges[0].tokens_micro, 6 * MICRO);
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
