//! The token bucket: the single definition of what a bucket does, and the
//! reference model of its script part (`lua/algorithms/token_bucket.lua`),
//! tested against it through the request driver
//! ([`apply_request`](super::apply_request), `lua/request.lua`).
//!
//! Units: tokens are counted in **micro-tokens** (1 token = [`MICRO`]) and
//! time in **microseconds**, both as integers, so fractional refill
//! accumulates without loss and nothing depends on floating point.
//!
//! A bucket with rate `R` tokens per `U` seconds and capacity `C` tokens gains
//! `R / U` micro-tokens per microsecond, up to `C`. A bucket that has never been
//! seen (or whose state expired) is full. Its level during a request is its
//! balance in micro-tokens (an `i128`), and what a charge reports is that
//! balance.

use super::{Algorithm, ChargeKind, Consumed, MICRO, Report, ScriptCharge};
use std::num::NonZeroU64;

/// The limit a bucket is evaluated under ([`Limit::TokenBucket`](super::Limit::TokenBucket)).
///
/// The types exclude the limits no backend could evaluate: a unit of 0 s
/// (`NonZeroU64`) and a capacity above `u32::MAX` tokens (which the Lua
/// script could not compute exactly in micro-tokens).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BucketLimit {
    /// `R`: tokens added per unit. 0 blocks everything (capacity is then 0).
    pub requests_per_unit: u32,
    /// `U`: length of the unit in seconds (second = 1 ... year = 31,536,000).
    pub unit_secs: NonZeroU64,
    /// `C`: capacity in tokens (`burst`, default `R`).
    pub burst: u32,
    /// `D`: how far below zero a consume may take the balance, in tokens
    /// (`max_debt`, default 0). On a bucket with `D > 0` a consume is always
    /// charged, also when the request is denied, and the balance is clamped
    /// at `-D`; 0 when `R = 0` (such a bucket never refills, so never
    /// repays).
    pub max_debt: u32,
}

impl BucketLimit {
    /// Capacity in micro-tokens; 0 when `R = 0`.
    #[must_use]
    pub fn capacity_micro(&self) -> u128 {
        if self.requests_per_unit == 0 {
            0
        } else {
            u128::from(self.burst) * u128::from(MICRO)
        }
    }

    /// The debt bound in micro-tokens (`D`, 0 when `R = 0`).
    #[must_use]
    pub fn debt_micro(&self) -> u128 {
        if self.requests_per_unit == 0 {
            0
        } else {
            u128::from(self.max_debt) * u128::from(MICRO)
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
    /// Balance at `updated_us`, in micro-tokens; below zero only on a bucket
    /// in debt (`max_debt`), never below `-max_debt`.
    pub tokens_micro: i64,
    /// Time of the last write, microseconds since the Unix epoch.
    pub updated_us: u64,
}

impl BucketState {
    /// Balance at `now_us` under `limit`: refilled since `updated_us` and
    /// capped at the capacity (negative while in debt). A timestamp after
    /// `now_us` (a clock stepped back, or another clock) is taken as now: it
    /// refills nothing, and the next write stores `now_us`, so a clock step
    /// never freezes a bucket (docs/design.md, "Time").
    #[must_use]
    pub fn tokens_at(&self, limit: &BucketLimit, now_us: u64) -> i128 {
        let cap = capacity(limit);
        let have = i128::from(self.tokens_micro).min(cap);
        if have >= cap {
            return cap;
        }
        let elapsed = now_us.saturating_sub(self.updated_us);
        let refill = i128::try_from(limit.refill_micro(elapsed)).unwrap_or(i128::MAX);
        have.saturating_add(refill).min(cap)
    }
}

/// The token bucket algorithm (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenBucket;

impl Algorithm for TokenBucket {
    type Limit = BucketLimit;
    type State = BucketState;
    /// The balance in micro-tokens.
    type Level = i128;
    const SCRIPT_ID: u8 = 0;

    fn read(limit: &BucketLimit, stored: Option<&BucketState>, now_us: u64) -> (i128, bool) {
        match stored {
            Some(s) => (s.tokens_at(limit, now_us), s.updated_us > now_us),
            None => (capacity(limit), false),
        }
    }

    fn rebase(limit: &BucketLimit, _from: &BucketLimit, level: i128) -> i128 {
        level.min(capacity(limit))
    }

    fn consume(limit: &BucketLimit, level: i128, cost: u64) -> Consumed<i128> {
        let need = i128::try_from(need_micro(limit, cost)).unwrap_or(i128::MAX);
        let enough = level >= need;
        let debt = i128::try_from(limit.debt_micro()).unwrap_or(0);
        let taken = if debt > 0 {
            (cost > 0).then(|| charge_debt(level, cost, debt))
        } else if enough && cost > 0 {
            Some(level - i128::from(cost) * i128::from(MICRO))
        } else {
            None
        };
        Consumed {
            level: taken.unwrap_or(level),
            enough,
            changed: taken.is_some(),
            stands: debt > 0 && cost > 0,
        }
    }

    fn refund(
        limit: &BucketLimit,
        level: i128,
        cost: u64,
        _taken_at_us: Option<u64>,
        _now_us: u64,
    ) -> i128 {
        let add = i128::from(cost) * i128::from(MICRO);
        level.saturating_add(add).min(capacity(limit))
    }

    fn charges_when_denied(limit: &BucketLimit) -> bool {
        limit.debt_micro() > 0
    }

    fn counts_when_short(_: &BucketLimit) -> bool {
        false
    }

    fn store(_: &BucketLimit, level: i128, now_us: u64) -> BucketState {
        BucketState {
            tokens_micro: to_i64(level),
            updated_us: now_us,
        }
    }

    fn report(_: &BucketLimit, level: i128, _now_us: u64) -> Report {
        Report {
            remaining_micro: to_i64(level),
            window: None,
        }
    }

    fn level_of_report(_: &BucketLimit, report: &Report) -> i128 {
        i128::from(report.remaining_micro)
    }

    fn expiry_us(limit: &BucketLimit, state: &BucketState) -> u128 {
        time_to_full_us(limit, state.tokens_micro)
    }

    fn updated_us(state: &BucketState) -> u64 {
        state.updated_us
    }

    fn capacity_micro(limit: &BucketLimit) -> u128 {
        limit.capacity_micro()
    }

    fn unit_secs(limit: &BucketLimit) -> u64 {
        limit.unit_secs.get()
    }

    fn admits_nothing(limit: &BucketLimit) -> bool {
        limit.requests_per_unit == 0
    }

    /// `max(cost, 1)` tokens: a check is answered as a 1-token request
    /// (docs/design.md, "Costs").
    fn need_micro(_: &BucketLimit, cost: u64) -> u128 {
        u128::from(cost.max(1)) * u128::from(MICRO)
    }

    fn reset_us(limit: &BucketLimit, report: &Report) -> u128 {
        time_to_full_us(limit, report.remaining_micro)
    }

    fn wait_us(limit: &BucketLimit, report: &Report, need_micro: u128) -> u128 {
        wait_until_fits_us(limit, report.remaining_micro, need_micro)
    }

    fn report_later(limit: &BucketLimit, report: &Report, since_us: u64, now_us: u64) -> Report {
        let later = BucketState {
            tokens_micro: report.remaining_micro,
            updated_us: since_us,
        }
        .tokens_at(limit, now_us);
        Report {
            remaining_micro: to_i64(later),
            window: None,
        }
    }

    /// Parameters `[R, U, C]`, the extra parameter `D` (0 when `R = 0`), and
    /// the cost clamped to capacity + `max_debt` + 1 token for consumes and
    /// to capacity + `u32::MAX` (the deepest debt) for refunds, which changes
    /// no outcome (see [`ChargeSpec::need_micro`](super::ChargeSpec::need_micro);
    /// a debt charge that large is clamped at `-max_debt` anyway) and keeps
    /// every micro-token amount below 2^53 inside Lua (a capacity and a debt
    /// bound are at most `u32::MAX` tokens each and a unit at least 1 s, by
    /// their types). A [`ChargeKind::Return`] is a refund.
    fn script_charge(limit: &BucketLimit, cost: u64, kind: ChargeKind) -> ScriptCharge {
        let cap_tokens = if limit.requests_per_unit == 0 {
            0
        } else {
            u64::from(limit.burst)
        };
        let debt_tokens = if limit.requests_per_unit == 0 {
            0
        } else {
            u64::from(limit.max_debt)
        };
        let cost = match kind {
            ChargeKind::Consume | ChargeKind::Reserve(_) => cost.min(cap_tokens + debt_tokens + 1),
            // Whatever the estimate it settles, a settlement's excess is
            // clamped at the debt bound below a balance of at most the
            // capacity; book entries stop growing at the same bound.
            ChargeKind::Settle { .. } | ChargeKind::Unreserve { .. } => {
                cost.min(super::reservation::MAX_HELD_TOKENS)
            }
            // A balance is never below -u32::MAX tokens (the largest debt bound).
            ChargeKind::Refund | ChargeKind::Return { .. } => {
                cost.min(cap_tokens + u64::from(u32::MAX))
            }
        };
        ScriptCharge {
            algorithm: Self::SCRIPT_ID,
            // A unit is at most a year (31,536,000 s): it fits in 32 bits.
            params: [
                limit.requests_per_unit,
                u32::try_from(limit.unit_secs.get()).unwrap_or(u32::MAX),
                limit.burst,
            ],
            extra: debt_tokens,
            cost,
        }
    }
}

/// Micro-tokens a consume of `cost` needs: `max(cost, 1)` tokens, clamped to
/// capacity + 1 token.
fn need_micro(limit: &BucketLimit, cost: u64) -> u128 {
    let need = u128::from(cost.max(1)) * u128::from(MICRO);
    need.min(limit.capacity_micro() + u128::from(MICRO))
}

/// The capacity of `limit` in micro-tokens, signed.
fn capacity(limit: &BucketLimit) -> i128 {
    i128::try_from(limit.capacity_micro()).unwrap_or(i128::MAX)
}

/// `balance` after a debt charge of `cost` tokens on a bucket whose debt
/// bound is `debt` micro-tokens: down by the cost, clamped at `-debt`, and
/// never raised by the clamp.
pub(crate) fn charge_debt(balance: i128, cost: u64, debt: i128) -> i128 {
    let after = balance.saturating_sub(i128::from(cost) * i128::from(MICRO));
    after.max((-debt).min(balance))
}

fn to_i64(v: i128) -> i64 {
    i64::try_from(v).unwrap_or(if v < 0 { i64::MIN } else { i64::MAX })
}

/// Microseconds until a bucket holding `tokens_micro` (negative in debt) is
/// full under `limit` (0 when already full, and always 0 when `R = 0`:
/// capacity 0 is always full).
#[must_use]
pub fn time_to_full_us(limit: &BucketLimit, tokens_micro: i64) -> u128 {
    let cap = capacity(limit);
    let deficit = cap - i128::from(tokens_micro).min(cap);
    if deficit <= 0 {
        return 0;
    }
    limit.wait_us(deficit.unsigned_abs()).unwrap_or(0)
}

/// Microseconds until a bucket holding `tokens_micro` (negative in debt)
/// has `need_micro` under `limit`, at least 1 (a denial never says "now"):
/// the unit's length when `R = 0` (nothing ever refills), the time to full
/// when `need_micro` is more than the capacity (the most that can ever be
/// there). In debt this is the real time to repay: for 1000 per hour, a
/// balance of -200 tokens needs 201 tokens for a check, 723.6 s.
#[must_use]
pub fn wait_until_fits_us(limit: &BucketLimit, tokens_micro: i64, need_micro: u128) -> u128 {
    let wait = if limit.requests_per_unit == 0 {
        u128::from(limit.unit_secs.get()) * 1_000_000
    } else if need_micro > limit.capacity_micro() {
        time_to_full_us(limit, tokens_micro)
    } else {
        let need = i128::try_from(need_micro).unwrap_or(i128::MAX);
        let deficit = (need - i128::from(tokens_micro)).max(0);
        limit.wait_us(deficit.unsigned_abs()).unwrap_or(0)
    };
    wait.max(1)
}

#[cfg(test)]
mod tests {
    use super::super::{ChargeResult, ChargeSpec, MICRO_I64, RequestResult, ceil_secs};
    use super::*;

    /// The request driver over token bucket states only.
    fn apply_request(
        charges: &[(usize, ChargeSpec)],
        states: &[Option<BucketState>],
        now_us: u64,
        mut put: impl FnMut(usize, BucketState),
    ) -> RequestResult {
        let states: Vec<_> = states
            .iter()
            .map(|s| s.map(super::super::State::from))
            .collect();
        super::super::apply_request(charges, &states, now_us, |i, s| {
            put(i, *s.token_bucket().expect("a bucket"));
        })
    }

    #[test]
    fn waits_until_fits_are_never_zero_and_capped_at_full() {
        let l = lim(10, 1, 10); // 10 tokens/s, capacity 10
        let m = MICRO;
        assert_eq!(wait_until_fits_us(&l, 0, u128::from(m)), 100_000);
        assert_eq!(wait_until_fits_us(&l, 5 * MICRO_I64, u128::from(m)), 1);
        // More than the capacity: until full (1 s from empty).
        assert_eq!(wait_until_fits_us(&l, 0, 50 * u128::from(m)), 1_000_000);
        assert_eq!(wait_until_fits_us(&lim(0, 60, 0), 0, 1), 60_000_000);
    }

    fn lim(r: u32, u: u64, c: u32) -> BucketLimit {
        BucketLimit {
            requests_per_unit: r,
            unit_secs: NonZeroU64::new(u).expect("a unit of at least 1 s"),
            burst: c,
            max_debt: 0,
        }
    }

    fn spec(l: BucketLimit, cost: u64) -> ChargeSpec {
        ChargeSpec {
            limit: l.into(),
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
                tokens_micro: to_i64(t),
                updated_us: s * 1_000_000,
            };
        }
        assert_eq!(st.tokens_micro, 3 * MICRO_I64); // capped
        let mut st = BucketState {
            tokens_micro: 0,
            updated_us: 0,
        };
        let l = lim(3, 2, 100);
        let mut admitted = 0;
        for s in 1..=10u64 {
            let mut t = st.tokens_at(&l, s * 1_000_000);
            while t >= i128::from(MICRO) {
                t -= i128::from(MICRO);
                admitted += 1;
            }
            st = BucketState {
                tokens_micro: to_i64(t),
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
        assert_eq!(st.tokens_at(&l, u64::MAX), capacity(&l));
        let s = ChargeSpec {
            limit: l.into(),
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
                remaining_micro: 10 * MICRO_I64,
                window: None,
                ..ChargeResult::default()
            }
        );
        assert_eq!(
            r.charges[1],
            ChargeResult {
                enough: false,
                remaining_micro: MICRO_I64,
                window: None,
                ..ChargeResult::default()
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
        assert_eq!(r.charges[0].remaining_micro, 0);
    }

    /// A stored timestamp in the future (the clock stepped back) is taken
    /// as now: the bucket refills from now on instead of freezing until the
    /// clock catches up, and the next write stores now.
    #[test]
    fn a_timestamp_in_the_future_is_taken_as_now() {
        let l = lim(10, 1, 10);
        // Drained at 3601 s; the clock then stepped back one hour.
        let st = BucketState {
            tokens_micro: 0,
            updated_us: 3_601_000_000,
        };
        assert_eq!(st.tokens_at(&l, 1_000_000), 0);
        let mut wrote = None;
        let r = apply_request(&[(0, spec(l, 0))], &[Some(st)], 1_000_000, |_, s| {
            wrote = Some(s)
        });
        assert!(!r.admitted, "nothing refilled yet");
        // Even a denial rewrites the future timestamp as now.
        assert_eq!(
            wrote,
            Some(BucketState {
                tokens_micro: 0,
                updated_us: 1_000_000
            })
        );
        wrote = None;
        // A refund (any write) stores now, not the future timestamp.
        let refund = ChargeSpec {
            limit: l.into(),
            cost: 1,
            kind: ChargeKind::Refund,
            shadow: false,
        };
        apply_request(&[(0, refund)], &[Some(st)], 1_000_000, |_, s| {
            wrote = Some(s)
        });
        let written = wrote.expect("a refund writes");
        assert_eq!(written.updated_us, 1_000_000);
        // One second later the bucket has refilled: it is not frozen.
        assert_eq!(written.tokens_at(&l, 2_000_000), 10 * i128::from(MICRO));
    }

    #[test]
    fn a_bucket_deeper_than_a_lowered_debt_bound_keeps_its_debt() {
        let m = i128::from(MICRO);
        // Bound lowered to 10 tokens while the bucket is 80 deep: a charge
        // neither forgives the debt nor takes the bucket deeper.
        assert_eq!(charge_debt(-80 * m, 1, 10 * m), -80 * m);
        // Within the bound, charges go down to it and stop there.
        assert_eq!(charge_debt(-5 * m, 3, 10 * m), -8 * m);
        assert_eq!(charge_debt(-9 * m, 3, 10 * m), -10 * m);
    }

    /// With a debt bound the charge is always taken, clamped at `-D`, and
    /// the status comes from the balance before it.
    #[test]
    fn debt_charges_are_always_taken_and_clamped() {
        let mut l = lim(1000, 3600, 1000);
        l.max_debt = 500;
        let m = MICRO_I64;
        let st = |t: i64| BucketState {
            tokens_micro: t * m,
            updated_us: 0,
        };
        // 10 tokens left, a cost of 210: not enough, taken anyway.
        let mut wrote = None;
        let r = apply_request(&[(0, spec(l, 210))], &[Some(st(10))], 0, |_, s| {
            wrote = Some(s)
        });
        assert!(!r.admitted);
        assert_eq!(r.charges[0].remaining_micro, 10 * m, "reported before");
        assert_eq!(wrote.map(|s| s.tokens_micro), Some(-200 * m));
        // At -200 a check waits ceil(201 * 3.6 s) = 724 s.
        let wait = wait_until_fits_us(&l, -200 * m, u128::from(MICRO));
        assert_eq!(ceil_secs(wait), 724);
        // Clamped at -500, and never raised by the clamp.
        apply_request(&[(0, spec(l, 10_000))], &[Some(st(-200))], 0, |_, s| {
            wrote = Some(s)
        });
        assert_eq!(wrote.map(|s| s.tokens_micro), Some(-500 * m));
        apply_request(&[(0, spec(l, 1))], &[Some(st(-900))], 0, |_, s| {
            wrote = Some(s)
        });
        assert_eq!(wrote.map(|s| s.tokens_micro), Some(-900 * m));
        // Another denying bucket: the debt charge is taken, the other is not.
        let normal = spec(lim(1, 3600, 1), 2);
        let mut puts = Vec::new();
        let r = apply_request(
            &[(0, spec(l, 30)), (1, normal)],
            &[Some(st(100)), None],
            0,
            |i, s| puts.push((i, s.tokens_micro)),
        );
        assert!(!r.admitted);
        assert_eq!(puts, vec![(0, 70 * m)]);
        // A debt charge that denies leaves the other bucket uncharged.
        let mut puts = Vec::new();
        let r = apply_request(
            &[(0, spec(l, 1)), (1, spec(lim(5, 3600, 5), 1))],
            &[Some(st(-1)), None],
            0,
            |i, s| puts.push((i, s.tokens_micro)),
        );
        assert!(!r.admitted);
        assert_eq!(puts, vec![(0, -2 * m)]);
        assert_eq!(time_to_full_us(&l, -2 * m), 1002 * 3_600_000);
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
                    let spec = ChargeSpec { limit: limit.into(), cost: s.cost, kind, shadow: false };
                    let mut wrote = None;
                    let res = apply_request(&[(0, spec)], &[state], now, |_, st| wrote = Some(st));
                    prop_assert!(i128::from(res.charges[0].remaining_micro) <= i128::try_from(cap).unwrap_or(0));
                    if !res.admitted {
                        prop_assert!(wrote.is_none());
                        // Honest wait: retrying after it (absent other traffic) is admitted.
                        let tokens = u128::try_from(res.charges[0].remaining_micro).unwrap_or(0);
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
