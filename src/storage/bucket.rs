//! Token bucket arithmetic: the single definition of what a bucket does.
//!
//! Units: tokens are counted in **micro-tokens** (1 token = 1,000,000) and time in
//! **microseconds**, both as integers, so fractional refill accumulates without
//! loss and nothing depends on floating point. The memory backend runs this code
//! directly; `lua/token_bucket.lua` implements the same rules and is tested
//! against [`apply_request`] as its reference model.
//!
//! A bucket with rate `R` tokens per `U` seconds and capacity `C` tokens gains
//! `R / U` micro-tokens per microsecond, up to `C`. A bucket that has never been
//! seen (or whose state expired) is full.

use std::num::NonZeroU64;

/// Micro-tokens per token.
pub const MICRO: u64 = 1_000_000;

/// The limit a bucket is evaluated under; taken from the rule (or a per-request
/// override) on every call, never stored with the bucket, so a config change
/// applies at once and never refills a bucket (docs/design.md, "Reloads").
///
/// The types exclude the limits no backend could evaluate: a unit of 0 s
/// (`NonZeroU64`) and a capacity above `u32::MAX` tokens (which the Lua
/// script could not compute exactly in micro-tokens).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Limit {
    /// `R`: tokens added per unit. 0 blocks everything (capacity is then 0).
    pub requests_per_unit: u32,
    /// `U`: length of the unit in seconds (second = 1 ... year = 31,536,000).
    pub unit_secs: NonZeroU64,
    /// `C`: capacity in tokens (`burst`, default `R`).
    pub burst: u32,
}

impl Limit {
    /// Capacity in micro-tokens; 0 when `R = 0`.
    #[must_use]
    pub fn capacity_micro(&self) -> u128 {
        if self.requests_per_unit == 0 {
            0
        } else {
            u128::from(self.burst) * u128::from(MICRO)
        }
    }

    /// Micro-tokens gained in `elapsed_us` microseconds (floor), capped by nothing.
    #[must_use]
    pub fn refill_micro(&self, elapsed_us: u64) -> u128 {
        u128::from(elapsed_us) * u128::from(self.requests_per_unit)
            / u128::from(self.unit_secs.get())
    }

    /// Microseconds until `deficit_micro` micro-tokens have been refilled (ceil).
    /// `None` when the rate is 0 (never).
    #[must_use]
    pub fn wait_us(&self, deficit_micro: u128) -> Option<u128> {
        if self.requests_per_unit == 0 {
            return None;
        }
        let r = u128::from(self.requests_per_unit);
        Some((deficit_micro * u128::from(self.unit_secs.get())).div_ceil(r))
    }
}

/// Stored state of one bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BucketState {
    /// Tokens present at `updated_us`, in micro-tokens.
    pub tokens_micro: u64,
    /// Time of the last write, microseconds since the Unix epoch.
    pub updated_us: u64,
}

impl BucketState {
    /// Tokens at `now_us` under `limit`: refilled since `updated_us` and capped at
    /// the capacity. A clock behind `updated_us` refills nothing (a stored
    /// timestamp never moves backwards).
    #[must_use]
    pub fn tokens_at(&self, limit: &Limit, now_us: u64) -> u128 {
        let cap = limit.capacity_micro();
        let have = u128::from(self.tokens_micro).min(cap);
        if have >= cap {
            return cap;
        }
        let elapsed = now_us.saturating_sub(self.updated_us);
        (have + limit.refill_micro(elapsed)).min(cap)
    }
}

/// What to do with one bucket in a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChargeKind {
    /// Take `cost` tokens if the whole request is admitted. Cost 0 only checks.
    Consume,
    /// Give `cost` tokens back (`is_negative_hits`), capped at the capacity.
    Refund,
}

/// One descriptor's charge against one bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChargeSpec {
    /// Limit to evaluate under.
    pub limit: Limit,
    /// Cost in tokens (0 = check only).
    pub cost: u64,
    /// Consume or refund.
    pub kind: ChargeKind,
    /// Shadow mode: evaluated, never denies the request.
    pub shadow: bool,
}

impl ChargeSpec {
    /// Micro-tokens this charge needs to be admitted: `max(cost, 1)` (a check-only
    /// call is answered as a 1-token request would be, docs/design.md, "Costs"), and anything above
    /// the capacity is clamped to capacity + 1 token (it can never be admitted).
    #[must_use]
    pub fn need_micro(&self) -> u128 {
        let cap = self.limit.capacity_micro();
        let need = u128::from(self.cost.max(1)) * u128::from(MICRO);
        need.min(cap + u128::from(MICRO))
    }
}

/// Result for one charge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChargeResult {
    /// The bucket had enough tokens for this charge (always true for refunds).
    pub enough: bool,
    /// Micro-tokens in the bucket after the request (after charging when the
    /// request was admitted, unchanged otherwise).
    pub tokens_micro: u64,
}

/// Result for a whole request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestResult {
    /// Every non-shadow consume charge had enough tokens, so all were charged.
    pub admitted: bool,
    /// One result per charge, in request order.
    pub charges: Vec<ChargeResult>,
}

/// Evaluates and applies all charges of one request atomically (docs/design.md, "All-or-nothing requests"):
///
/// 1. Charges are simulated in order on working copies, so two charges on the
///    same bucket add up. A shadow charge that lacks tokens is skipped (not
///    charged) and does not deny.
/// 2. If every non-shadow consume charge had enough tokens, the simulated states
///    are written (`put`); otherwise nothing is written at all, refunds included.
///
/// `slots[i]` is the stored state of charge `i`'s bucket (`None` = full / never
/// seen); charges on the same bucket must carry the same `bucket` index. `put`
/// receives `(bucket index, new state)` for every bucket whose state changed.
/// Cost-0 checks and refunds on a full bucket write nothing.
pub fn apply_request(
    charges: &[(usize, ChargeSpec)],
    states: &[Option<BucketState>],
    now_us: u64,
    mut put: impl FnMut(usize, BucketState),
) -> RequestResult {
    // Working state per bucket: micro-tokens now (u128, capped), dirty flag.
    let mut work: Vec<Option<(u128, bool)>> = vec![None; states.len()];
    let mut results = Vec::with_capacity(charges.len());
    let mut admitted = true;
    for (bucket, spec) in charges {
        let cap = spec.limit.capacity_micro();
        let slot = work[*bucket].get_or_insert_with(|| {
            let t = states[*bucket].map_or(cap, |s| s.tokens_at(&spec.limit, now_us));
            (t, false)
        });
        // A later charge on the same bucket may carry another limit; cap again.
        if slot.0 > cap {
            slot.0 = cap;
        }
        match spec.kind {
            ChargeKind::Refund => {
                let add = u128::from(spec.cost) * u128::from(MICRO);
                let new = (slot.0 + add).min(cap);
                if new != slot.0 {
                    slot.0 = new;
                    slot.1 = true;
                }
                results.push(ChargeResult {
                    enough: true,
                    tokens_micro: 0,
                });
            }
            ChargeKind::Consume => {
                let enough = slot.0 >= spec.need_micro();
                if enough && spec.cost > 0 {
                    slot.0 -= u128::from(spec.cost) * u128::from(MICRO);
                    slot.1 = true;
                }
                if !enough && !spec.shadow {
                    admitted = false;
                }
                results.push(ChargeResult {
                    enough,
                    tokens_micro: 0,
                });
            }
        }
    }
    if admitted {
        for (i, w) in work.iter().enumerate() {
            if let Some((t, true)) = w {
                put(
                    i,
                    BucketState {
                        tokens_micro: to_u64(*t),
                        updated_us: now_us.max(states[i].map_or(0, |s| s.updated_us)),
                    },
                );
            }
        }
        // Report tokens after the whole request.
        for ((bucket, _), r) in charges.iter().zip(results.iter_mut()) {
            r.tokens_micro = to_u64(work[*bucket].map_or(0, |w| w.0));
        }
    } else {
        // Nothing charged: report tokens as they are now.
        for ((bucket, spec), r) in charges.iter().zip(results.iter_mut()) {
            let cap = spec.limit.capacity_micro();
            let t = states[*bucket].map_or(cap, |s| s.tokens_at(&spec.limit, now_us));
            r.tokens_micro = to_u64(t.min(cap));
        }
    }
    RequestResult {
        admitted,
        charges: results,
    }
}

fn to_u64(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

/// Microseconds until a bucket holding `tokens_micro` is full under `limit`
/// (0 when already full, and always 0 when `R = 0`: capacity 0 is always full).
#[must_use]
pub fn time_to_full_us(limit: &Limit, tokens_micro: u64) -> u128 {
    let cap = limit.capacity_micro();
    let deficit = cap.saturating_sub(u128::from(tokens_micro));
    if deficit == 0 {
        return 0;
    }
    limit.wait_us(deficit).unwrap_or(0)
}

/// Whole seconds, rounded up, for a wait in microseconds (docs/design.md, "Durations": Envoy reads
/// only `seconds`, so 2.5 s must be sent as 3).
#[must_use]
pub fn ceil_secs(us: u128) -> u64 {
    u64::try_from(us.div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

/// Micro-tokens each charge needs in its bucket for the whole request to
/// pass, in charge order: a consume needs its own cost (at least 1 token: a
/// check needs one) plus the costs of the earlier consumes of the same
/// request on the same key (shadow ones too: they take tokens). An earlier
/// refund is not subtracted, so a wait computed from it is never too short.
/// Refunds need 0.
#[must_use]
pub fn request_needs(charges: &[super::Charge]) -> Vec<u128> {
    let mut taken: std::collections::HashMap<&str, u128> = std::collections::HashMap::new();
    charges
        .iter()
        .map(|c| {
            if c.spec.kind != ChargeKind::Consume {
                return 0;
            }
            let taken_before = taken.entry(c.key.as_str()).or_insert(0);
            let need = *taken_before + u128::from(c.spec.cost.max(1)) * u128::from(MICRO);
            *taken_before += u128::from(c.spec.cost) * u128::from(MICRO);
            need
        })
        .collect()
}

/// Microseconds until a bucket holding `tokens_micro` has `need_micro`
/// under `limit`, at least 1 (a denial never says "now"): the unit's length
/// when `R = 0` (nothing ever refills), the time to full when `need_micro`
/// is more than the capacity (the most that can ever be there).
#[must_use]
pub fn wait_until_fits_us(limit: &Limit, tokens_micro: u64, need_micro: u128) -> u128 {
    let wait = if limit.requests_per_unit == 0 {
        u128::from(limit.unit_secs.get()) * 1_000_000
    } else if need_micro > limit.capacity_micro() {
        time_to_full_us(limit, tokens_micro)
    } else {
        limit
            .wait_us(need_micro - u128::from(tokens_micro).min(need_micro))
            .unwrap_or(0)
    };
    wait.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_needs_add_up_earlier_consumes_of_the_same_key() {
        let c = |key: &str, cost: u64, kind: ChargeKind| super::super::Charge {
            key: key.into(),
            spec: ChargeSpec {
                limit: lim(10, 1, 10),
                cost,
                kind,
                shadow: false,
            },
        };
        let charges = [
            c("a", 3, ChargeKind::Consume),
            c("b", 0, ChargeKind::Consume),
            c("a", 0, ChargeKind::Consume),
            c("a", 2, ChargeKind::Refund),
            c("a", 4, ChargeKind::Consume),
        ];
        let m = u128::from(MICRO);
        assert_eq!(request_needs(&charges), vec![3 * m, m, 4 * m, 0, 7 * m]);
    }

    #[test]
    fn waits_until_fits_are_never_zero_and_capped_at_full() {
        let l = lim(10, 1, 10); // 10 tokens/s, capacity 10
        let m = MICRO;
        assert_eq!(wait_until_fits_us(&l, 0, u128::from(m)), 100_000);
        assert_eq!(wait_until_fits_us(&l, 5 * m, u128::from(m)), 1);
        // More than the capacity: until full (1 s from empty).
        assert_eq!(wait_until_fits_us(&l, 0, 50 * u128::from(m)), 1_000_000);
        assert_eq!(wait_until_fits_us(&lim(0, 60, 0), 0, 1), 60_000_000);
    }

    fn lim(r: u32, u: u64, c: u32) -> Limit {
        Limit {
            requests_per_unit: r,
            unit_secs: NonZeroU64::new(u).expect("a unit of at least 1 s"),
            burst: c,
        }
    }

    fn spec(l: Limit, cost: u64) -> ChargeSpec {
        ChargeSpec {
            limit: l,
            cost,
            kind: ChargeKind::Consume,
            shadow: false,
        }
    }

    #[test]
    fn fractional_refill_accumulates() {
        // 3 per 2 s = 1.5 tokens/s; one call per second for 10 s after draining.
        let l = lim(3, 2, 3);
        let mut st = BucketState {
            tokens_micro: 0,
            updated_us: 0,
        };
        for s in 1..=10u64 {
            let t = st.tokens_at(&l, s * 1_000_000);
            st = BucketState {
                tokens_micro: to_u64(t),
                updated_us: s * 1_000_000,
            };
        }
        assert_eq!(st.tokens_micro, 3 * MICRO); // capped
        let mut st = BucketState {
            tokens_micro: 0,
            updated_us: 0,
        };
        let l = lim(3, 2, 100);
        let mut admitted = 0;
        for s in 1..=10u64 {
            let mut t = st.tokens_at(&l, s * 1_000_000);
            while t >= u128::from(MICRO) {
                t -= u128::from(MICRO);
                admitted += 1;
            }
            st = BucketState {
                tokens_micro: to_u64(t),
                updated_us: s * 1_000_000,
            };
        }
        assert_eq!(admitted, 15);
    }

    #[test]
    fn extremes_do_not_overflow() {
        let l = lim(u32::MAX, 1, u32::MAX);
        let st = BucketState {
            tokens_micro: 0,
            updated_us: 0,
        };
        assert_eq!(st.tokens_at(&l, u64::MAX), l.capacity_micro());
        let s = ChargeSpec {
            limit: l,
            cost: u64::MAX,
            kind: ChargeKind::Consume,
            shadow: false,
        };
        let r = apply_request(&[(0, s)], &[None], 5, |_, _| panic!("no write"));
        assert!(!r.admitted);
        assert_eq!(
            time_to_full_us(&lim(u32::MAX, 31_536_000, u32::MAX), 0),
            31_536_000_000_000
        );
    }

    #[test]
    fn denied_request_writes_nothing() {
        let a = spec(lim(10, 60, 10), 3);
        let b = spec(lim(1, 60, 1), 2);
        let r = apply_request(&[(0, a), (1, b)], &[None, None], 0, |_, _| {
            panic!("no write")
        });
        assert!(!r.admitted);
        assert_eq!(
            r.charges[0],
            ChargeResult {
                enough: true,
                tokens_micro: 10 * MICRO
            }
        );
        assert_eq!(
            r.charges[1],
            ChargeResult {
                enough: false,
                tokens_micro: MICRO
            }
        );
    }

    #[test]
    fn same_bucket_twice_adds_up() {
        let a = spec(lim(5, 60, 5), 3);
        let r = apply_request(&[(0, a), (0, a)], &[None], 0, |_, _| panic!("no write"));
        assert!(!r.admitted);
        let mut wrote = None;
        let b = spec(lim(5, 60, 5), 2);
        let r = apply_request(&[(0, a), (0, b)], &[None], 7, |i, s| wrote = Some((i, s)));
        assert!(r.admitted);
        assert_eq!(
            wrote,
            Some((
                0,
                BucketState {
                    tokens_micro: 0,
                    updated_us: 7
                }
            ))
        );
    }

    #[test]
    fn zero_rate_is_always_denied_and_never_written() {
        let a = spec(lim(0, 60, 0), 0);
        let r = apply_request(&[(0, a)], &[None], 0, |_, _| panic!("no write"));
        assert!(!r.admitted);
        assert_eq!(r.charges[0].tokens_micro, 0);
    }

    #[test]
    fn timestamp_never_moves_back() {
        let l = lim(10, 1, 10);
        let st = BucketState {
            tokens_micro: 0,
            updated_us: 5_000_000,
        };
        assert_eq!(st.tokens_at(&l, 1_000_000), 0);
        let mut wrote = None;
        let refund = ChargeSpec {
            limit: l,
            cost: 1,
            kind: ChargeKind::Refund,
            shadow: false,
        };
        apply_request(&[(0, refund)], &[Some(st)], 1_000_000, |_, s| {
            wrote = Some(s)
        });
        assert_eq!(wrote.map(|s| s.updated_us), Some(5_000_000));
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        struct Step {
            gap_us: u64,
            cost: u64,
            refund: bool,
        }

        fn steps() -> impl Strategy<Value = Vec<Step>> {
            proptest::collection::vec(
                (0u64..3_000_000, 0u64..12, proptest::bool::weighted(0.1)).prop_map(
                    |(gap_us, cost, refund)| Step {
                        gap_us,
                        cost,
                        refund,
                    },
                ),
                1..200,
            )
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(200))]
            /// Invariants of a single bucket under random traffic on a paused clock:
            /// remaining <= C; admissions in any window <= C + r*T + 1 (+ refunds);
            /// a denied request writes nothing; a retry after the reported wait is admitted.
            #[test]
            fn single_bucket_invariants(r in 0u32..20, unit in prop_oneof![Just(1u64), Just(60)], extra in 0u32..5, steps in steps()) {
                let limit = lim(r, unit, r + extra);
                let cap = limit.capacity_micro();
                let mut state: Option<BucketState> = None;
                let mut now = 1_000_000u64;
                let mut log: Vec<(u64, u64, bool)> = Vec::new(); // (t, cost, refund) of admitted
                for s in steps {
                    now += s.gap_us;
                    let kind = if s.refund { ChargeKind::Refund } else { ChargeKind::Consume };
                    let spec = ChargeSpec { limit, cost: s.cost, kind, shadow: false };
                    let mut wrote = None;
                    let res = apply_request(&[(0, spec)], &[state], now, |_, st| wrote = Some(st));
                    prop_assert!(u128::from(res.charges[0].tokens_micro) <= cap);
                    if !res.admitted {
                        prop_assert!(wrote.is_none());
                        // Honest wait: retrying after it (absent other traffic) is admitted.
                        let tokens = u128::from(res.charges[0].tokens_micro);
                        let need = spec.need_micro();
                        if need <= cap && r > 0 {
                            let wait = limit.wait_us(need - tokens).unwrap_or(0);
                            let later = now + ceil_secs(wait) * 1_000_000;
                            let retry = apply_request(&[(0, spec)], &[state], later, |_, _| {});
                            prop_assert!(retry.admitted, "retry after {} s not admitted", ceil_secs(wait));
                        }
                    } else {
                        log.push((now, s.cost, s.refund));
                    }
                    if let Some(w) = wrote {
                        prop_assert!(w.updated_us >= state.map_or(0, |p| p.updated_us));
                        state = Some(w);
                    }
                }
                for i in 0..log.len() {
                    let mut consumed: i128 = 0;
                    let mut refunded: i128 = 0;
                    for e in &log[i..] {
                        if e.2 { refunded += i128::from(e.1) } else { consumed += i128::from(e.1) }
                        let span = i128::from(e.0 - log[i].0);
                        let bound = i128::try_from(cap / u128::from(MICRO)).unwrap_or(0)
                            + i128::from(r) * span / (i128::from(unit) * 1_000_000) + 1 + refunded;
                        prop_assert!(consumed <= bound, "{} consumed within {} us, bound {}", consumed, span, bound);
                    }
                }
            }
        }
    }
}
