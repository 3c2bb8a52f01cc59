//! Local over-limit cache (docs/design.md, "Local over-limit cache"): after Redis said a bucket lacks tokens,
//! later requests that are certain to be denied are answered from memory,
//! without a Redis call, until enough tokens could have refilled.
//!
//! An entry remembers, per key, the limit it was evaluated under, what
//! Redis reported the key had left, and the times just before the call was sent
//! and just after the reply came: Redis evaluated somewhere in between, so
//! what the key regained since `sent` ([`Limit::remaining_later`], a
//! bucket's refill) is an upper bound of the truth (used to be certain of a
//! denial) and what it regained since `received` a lower bound (used for
//! the tokens reported, so the wait reported is never too short and a
//! client retrying after it is admitted, docs/design.md, "Durations").
//! A request is answered from the cache only when **every** charge is a
//! non-shadow consume whose bucket has an entry for the same limit and whose
//! estimated tokens, plus one micro-token for the rounding of two partial
//! refills, are below what it needs: Redis would then deny the request and
//! write nothing, so the answer is the same (`enough = false` and the
//! estimated tokens for every charge). Anything else goes to Redis.
//!
//! Limits of the guarantee: tokens given back by refunds or a config change
//! on *another* replica, or a key deleted or lost in Redis, are not seen
//! until the entry is replaced or [`MAX_ENTRY_AGE_US`] old (1 s, whatever the
//! refill rate); a config change on this replica, a SIGHUP, a `Function not
//! found` or `NOSCRIPT` (Redis restarted, failed over or flushed its
//! functions or scripts), a failed
//! background ping and a Sentinel master switch clear the cache ([`LocalCache::clear`], docs/design.md,
//! "Reloads"), and entries are keyed by limit as well.
//!
//! Exactness: the reported tokens can be below what Redis would compute by
//! the refill of one round trip and one micro-token of rounding; the reported
//! `duration_until_reset` is in whole seconds, so it is the same except when
//! the true wait is within that margin of a second boundary (then one second
//! longer, never shorter). With the test clock both times are equal. Bounded by `--local-cache-size` entries (eviction by
//! `quick_cache`).

use crate::storage::Charge;
use crate::storage::algorithm::{ChargeKind, ChargeResult, Limit, Report, RequestResult};

/// What is known about one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    limit: Limit,
    /// What Redis reported (what is left, and a window's time).
    report: Report,
    /// Microseconds (on the cache's time line) just before the call was sent.
    sent_us: u64,
    /// Microseconds just after the reply was received.
    received_us: u64,
}

/// Longest an entry answers for Redis, in microseconds (1 s), whatever the
/// refill rate: after that the next request goes to Redis again. So a denial
/// Redis no longer holds (an operator deleted the key, a `FLUSHALL`, a Redis
/// restart or failover that lost the key, tokens given back on another
/// replica) is answered from memory for at most this long.
pub const MAX_ENTRY_AGE_US: u64 = 1_000_000;

/// A bounded map from bucket key to "had `tokens` at time `at`".
#[derive(Debug)]
pub struct LocalCache {
    map: quick_cache::sync::Cache<String, Entry>,
    /// [`MAX_ENTRY_AGE_US`] (tests of the refill bounds lift it).
    max_age_us: u64,
}

/// The first step of every Redis backend's `apply`: answers from `cache` when
/// the answer is certain (counting the hit in `bucket_rls_local_cache_hits_total`),
/// otherwise notes that a call for `charges` is about to be sent and returns
/// `None`. Does nothing without a cache.
pub fn answer_or_note(
    cache: Option<&LocalCache>,
    charges: &[Charge],
    now_us: u64,
) -> Option<RequestResult> {
    let cache = cache?;
    if let Some(r) = cache.lookup(charges, now_us) {
        metrics::counter!(crate::metrics::LOCAL_CACHE_HITS).increment(1);
        return Some(r);
    }
    cache.before_call(charges);
    None
}

impl LocalCache {
    /// A cache of at most `capacity` buckets (`capacity` at least 1).
    #[must_use]
    pub fn new(capacity: usize) -> Self {
        Self {
            map: quick_cache::sync::Cache::new(capacity.max(1)),
            max_age_us: MAX_ENTRY_AGE_US,
        }
    }

    /// A cache whose entries never age out (for tests of the refill bounds
    /// over several seconds).
    #[cfg(test)]
    #[must_use]
    fn without_age_limit(capacity: usize) -> Self {
        Self {
            max_age_us: u64::MAX,
            ..Self::new(capacity)
        }
    }

    /// The answer Redis would give at `now_us` when it is certain to be a
    /// denial that writes nothing; `None` means "ask Redis".
    #[must_use]
    pub fn lookup(&self, charges: &[Charge], now_us: u64) -> Option<RequestResult> {
        if charges.is_empty() {
            return None;
        }
        let mut out = Vec::with_capacity(charges.len());
        for c in charges {
            // A debt charge is taken even when denied: it must reach Redis.
            if c.spec.kind != ChargeKind::Consume || c.spec.shadow || c.spec.taken_when_denied() {
                return None;
            }
            let e = self.map.get(c.key.as_str())?;
            if now_us.saturating_sub(e.received_us) >= self.max_age_us {
                self.map.remove(c.key.as_str());
                return None;
            }
            // A clock stepped back past the entry: Redis decides (it takes
            // a future timestamp as now; the cache would freeze).
            if e.limit != c.spec.limit || e.sent_us > now_us {
                return None;
            }
            let at = |t_us: u64| e.limit.report_later(&e.report, t_us, now_us);
            let most = i128::from(at(e.sent_us).remaining_micro);
            let need = i128::try_from(c.spec.need_micro()).unwrap_or(i128::MAX);
            if most + 1 >= need {
                if most >= i128::try_from(e.limit.capacity_micro()).unwrap_or(i128::MAX) {
                    self.map.remove(c.key.as_str());
                }
                return None;
            }
            // As of the reply (a window's time moved on by the time since
            // then): the wait it gives is never shorter than Redis's.
            let later = at(e.received_us);
            out.push(ChargeResult {
                enough: false,
                remaining_micro: later.remaining_micro,
                window: later.window,
                ..ChargeResult::default()
            });
        }
        Some(RequestResult {
            admitted: false,
            charges: out,
        })
    }

    /// Forgets the buckets a request is about to refund (their tokens grow).
    pub fn before_call(&self, charges: &[Charge]) {
        for c in charges {
            if c.spec.kind.gives_back() {
                self.map.remove(c.key.as_str());
            }
        }
    }

    /// [`LocalCache::record_between`] with the reply taken as received at
    /// `sent_us` (exact with a test clock, where time does not move).
    #[cfg(test)]
    pub fn record(&self, charges: &[Charge], result: &RequestResult, sent_us: u64) {
        self.record_between(charges, result, sent_us, sent_us);
    }

    /// Learns from Redis's answer to `charges`, sent at `sent_us` and
    /// received at `received_us`: a consume that lacked tokens records the
    /// bucket; any other charge forgets it.
    pub fn record_between(
        &self,
        charges: &[Charge],
        result: &RequestResult,
        sent_us: u64,
        received_us: u64,
    ) {
        for (c, r) in charges.iter().zip(&result.charges) {
            // A denied debt charge was taken after the balance reported.
            if c.spec.kind == ChargeKind::Consume && !r.enough && !c.spec.taken_when_denied() {
                self.map.insert(
                    c.key.clone(),
                    Entry {
                        limit: c.spec.limit,
                        report: r.report(),
                        sent_us,
                        received_us: received_us.max(sent_us),
                    },
                );
            } else {
                self.map.remove(c.key.as_str());
            }
        }
    }

    /// Forgets everything (on every config swap, docs/design.md, "Reloads").
    pub fn clear(&self) {
        self.map.clear();
    }

    /// Number of buckets remembered.
    #[must_use]
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when nothing is remembered.
    #[cfg(test)]
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::algorithm::{BucketLimit, ChargeSpec, MICRO_I64};

    fn charge(key: &str, cost: u64, shadow: bool) -> Charge {
        Charge {
            key: key.into(),
            spec: ChargeSpec {
                limit: BucketLimit {
                    requests_per_unit: 10,
                    unit_secs: std::num::NonZeroU64::new(60).expect("a minute"),
                    burst: 10,
                    max_debt: 0,
                }
                .into(),
                cost,
                kind: ChargeKind::Consume,
                shadow,
            },
        }
    }

    /// One charge denied with an empty bucket.
    fn denied_empty() -> RequestResult {
        RequestResult {
            admitted: false,
            charges: vec![ChargeResult {
                enough: false,
                remaining_micro: 0,
                window: None,
                ..ChargeResult::default()
            }],
        }
    }

    /// A window's denial is answered from the cache until its window ends
    /// as Redis placed it (measured from when the call was sent: Redis's
    /// clock need not be this host's), with the wait measured from the
    /// reply; a sliding window's until the previous count's weight could
    /// have fallen enough.
    #[test]
    fn window_denials_last_until_their_window_ends_on_redis_clock() {
        use crate::storage::algorithm::{Limit, WindowLimit, WindowReport};
        let cache = LocalCache::without_age_limit(10);
        let unit = std::num::NonZeroU64::new(60).expect("a minute");
        let window = |limit: Limit| Charge {
            key: "w".into(),
            spec: ChargeSpec {
                limit,
                cost: 1,
                kind: ChargeKind::Consume,
                shadow: false,
            },
        };
        let denied = |remaining_micro: i64, previous_micro: u64| RequestResult {
            admitted: false,
            charges: vec![ChargeResult {
                enough: false,
                remaining_micro,
                // Redis's clock: 50 s into its minute (this host's clock
                // reads 1 s then).
                window: Some(WindowReport {
                    at_us: 1_699_999_980_000_000 + 50_000_000,
                    previous_micro,
                }),
                ..ChargeResult::default()
            }],
        };
        let fixed = window(Limit::FixedWindow(WindowLimit::counting(3, unit)));
        cache.record_between(
            std::slice::from_ref(&fixed),
            &denied(0, 0),
            1_000_000,
            1_500_000,
        );
        // 9 s after sending: still the same window on Redis, for sure.
        let r = cache
            .lookup(std::slice::from_ref(&fixed), 10_000_000)
            .expect("certain");
        let limit = fixed.spec.limit;
        // Measured from the reply: 10 s - 8.5 s = 1.5 s left at most.
        assert_eq!(limit.wait_us(&r.charges[0].report(), 1), 1_500_000);
        // 10 s after sending Redis may be in its next minute: ask it.
        assert!(
            cache
                .lookup(std::slice::from_ref(&fixed), 11_000_000)
                .is_none()
        );
        let mut sliding = window(Limit::SlidingWindow(WindowLimit {
            requests_per_unit: 10,
            unit_secs: unit,
            counts_denied: false,
        }));
        sliding.spec.cost = 2;
        // 50 s into the minute, 10 in the previous one weigh
        // ceil(10 × 10/60) = 1.666667 of 10, and 7 in this one: 1.333333
        // left. A cost of 2 fits once 10 × r/60 <= 1, at r <= 6 s: 4 s after
        // the evaluation (less the margin of the cache's rounding).
        cache.record_between(
            std::slice::from_ref(&sliding),
            &denied(1_333_333, 10 * 1_000_000),
            1_000_000,
            1_000_000,
        );
        assert!(
            cache
                .lookup(std::slice::from_ref(&sliding), 4_999_990)
                .is_some()
        );
        assert!(
            cache
                .lookup(std::slice::from_ref(&sliding), 5_000_000)
                .is_none()
        );
    }

    #[test]
    fn reports_a_lower_bound_and_denies_on_an_upper_bound() {
        let cache = LocalCache::without_age_limit(10);
        let c = charge("a", 1, false);
        let denied = denied_empty();
        // Sent at 1 s, received at 2 s (a slow round trip).
        cache.record_between(std::slice::from_ref(&c), &denied, 1_000_000, 2_000_000);
        // At 6 s: at most 833,333 micro-tokens (since 1 s), at least 666,666 (since 2 s).
        let r = cache
            .lookup(std::slice::from_ref(&c), 6_000_000)
            .expect("certain");
        assert_eq!(r.charges[0].remaining_micro, 666_666);
        // At 6.999999 s the upper bound may suffice: ask Redis.
        assert!(cache.lookup(std::slice::from_ref(&c), 6_999_999).is_none());
    }

    #[test]
    fn answers_only_certain_denials() {
        let cache = LocalCache::without_age_limit(10);
        let c = charge("a", 1, false);
        let denied = denied_empty();
        cache.record(std::slice::from_ref(&c), &denied, 1_000_000);
        // 5.999999 s later: 999,999 micro-tokens, one short of a token (+1 margin: ask Redis).
        assert!(cache.lookup(std::slice::from_ref(&c), 6_999_999).is_none());
        let r = cache
            .lookup(std::slice::from_ref(&c), 6_000_000)
            .expect("certain");
        assert_eq!(r.charges[0].remaining_micro, 833_333);
        assert!(
            cache.lookup(&[charge("a", 1, true)], 2_000_000).is_none(),
            "shadow"
        );
        assert!(
            cache
                .lookup(&[c.clone(), charge("b", 1, false)], 2_000_000)
                .is_none(),
            "unknown bucket"
        );
        assert!(cache.lookup(std::slice::from_ref(&c), 7_000_000).is_none());
        let ok = RequestResult {
            admitted: true,
            charges: vec![ChargeResult {
                enough: true,
                remaining_micro: MICRO_I64,
                window: None,
                ..ChargeResult::default()
            }],
        };
        cache.record(std::slice::from_ref(&c), &ok, 1_000_000);
        assert!(cache.is_empty());
        cache.record(std::slice::from_ref(&c), &denied, 1_000_000);
        cache.clear();
        assert!(cache.lookup(&[c], 1_000_000).is_none());
    }

    /// An entry answers for at most a second, even for a rule that refills
    /// one token a day: a bucket reset in Redis is seen within that second.
    #[test]
    fn entries_answer_for_at_most_a_second_whatever_the_refill() {
        let cache = LocalCache::new(10);
        let mut slow = charge("slow", 1, false);
        slow.spec.limit = BucketLimit {
            requests_per_unit: 1,
            unit_secs: std::num::NonZeroU64::new(86_400).expect("a day"),
            burst: 1,
            max_debt: 0,
        }
        .into();
        let denied = RequestResult {
            admitted: false,
            charges: vec![ChargeResult {
                enough: false,
                remaining_micro: 0,
                window: None,
                ..ChargeResult::default()
            }],
        };
        cache.record(std::slice::from_ref(&slow), &denied, 5_000_000);
        assert!(
            cache
                .lookup(
                    std::slice::from_ref(&slow),
                    5_000_000 + MAX_ENTRY_AGE_US - 1
                )
                .is_some()
        );
        assert!(
            cache
                .lookup(std::slice::from_ref(&slow), 5_000_000 + MAX_ENTRY_AGE_US)
                .is_none(),
            "a second later Redis is asked again"
        );
        assert!(cache.is_empty(), "the stale entry is dropped");
    }
}
