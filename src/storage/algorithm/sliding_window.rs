//! The sliding window counter, and the reference model of its script part
//! (`lua/algorithms/sliding_window.lua`), tested against it through the
//! request driver ([`apply_request`](super::apply_request),
//! `lua/request.lua`).
//!
//! Windows are aligned to the unit since the Unix epoch, as a fixed
//! window's are, and each key counts the hits of the window of now (`cur`)
//! and of the one before (`prev`). A request at `r` microseconds before the
//! end of its window sees the estimate
//!
//! ```text
//! estimate = ceil(prev × r / U) + cur        (U: the window's length)
//! ```
//!
//! the previous window's count weighted by the part of it still inside the
//! sliding window of length `U` that ends now (rounded up, so the estimate
//! is never below the exact weighted value), plus the current count. A
//! consume of `cost` fits while `estimate + max(cost, 1) <= N` (a check is
//! answered as a one-token request, as on a bucket); one that does not fit
//! is denied and not counted (but by the quota service's charges, which
//! count what the Envoys already admitted). A refund takes its cost off the
//! current count, never below zero.
//!
//! The estimate assumes the previous window's hits were spread evenly over
//! it; the bound this gives (docs/design.md, "Sliding windows"): any
//! aligned window counts at most `N`, and any span of one unit that ends
//! `p` into a window holds at most `N + prev × p / U` (exactly `N` when the
//! previous window's hits were spread evenly, and always below `2N`).
//!
//! Units: counts are whole tokens; what a charge reports is `N − estimate`
//! in micro-units (with the estimate's weighted part in micro-units, exact),
//! the time storage evaluated it at and the previous count: the wait it
//! reports is the real time until the same request fits, computed from
//! them.

use super::fixed_window::{WindowLimit, WindowState, window_script_charge};
use super::{Algorithm, ChargeKind, Consumed, MICRO, Report, ScriptCharge, WindowReport};

/// Most a sliding window counts, in tokens (2^32): every amount the script
/// computes stays exact in its doubles. A window only goes over its limit
/// through the quota service's charges; its counts saturate there.
pub const MAX_COUNT: u64 = 1 << 32;

/// A key's working value at the request's time: the two counts and where
/// the request is in its window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlidingLevel {
    /// The previous window's count, in tokens.
    pub previous: u64,
    /// The current window's count, in tokens.
    pub count: u64,
    /// Microseconds from the request to the end of its window (1 ..= the
    /// window's length; 0 for a level that has no previous count to weigh).
    pub to_end_us: u64,
}

impl SlidingLevel {
    /// The previous count weighted by the part of the previous window still
    /// inside the sliding window, in micro-units, rounded up:
    /// `ceil(previous × to_end_us / U_secs)` (micro-units per token and
    /// microseconds per second cancel out).
    #[must_use]
    pub fn weighted_previous_micro(&self, limit: &WindowLimit) -> u128 {
        weighted_micro(self.previous, self.to_end_us, limit.unit_secs.get())
    }

    /// The estimate, in micro-units.
    #[must_use]
    pub fn estimate_micro(&self, limit: &WindowLimit) -> u128 {
        self.weighted_previous_micro(limit) + u128::from(self.count) * u128::from(MICRO)
    }
}

/// `ceil(previous × to_end_us / unit_secs)`: a count of tokens weighted by
/// the fraction `to_end_us / (unit_secs × 10^6)` of a window, in
/// micro-tokens.
fn weighted_micro(previous: u64, to_end_us: u64, unit_secs: u64) -> u128 {
    (u128::from(previous) * u128::from(to_end_us)).div_ceil(u128::from(unit_secs.max(1)))
}

/// The sliding window counter (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlidingWindow;

impl Algorithm for SlidingWindow {
    type Limit = WindowLimit;
    type State = WindowState;
    type Level = SlidingLevel;
    const SCRIPT_ID: u8 = 2;

    /// The counts of the state's window as now's, or its count as the
    /// previous one when it was written in the window before now's; a
    /// state of a later window (a clock stepped back) is taken as now's,
    /// and stale.
    fn read(
        limit: &WindowLimit,
        stored: Option<&WindowState>,
        now_us: u64,
    ) -> (SlidingLevel, bool) {
        let to_end_us = limit.to_end_us(now_us);
        let fresh = SlidingLevel {
            previous: 0,
            count: 0,
            to_end_us,
        };
        let Some(s) = stored.filter(|s| s.unit_secs == limit.unit_secs.get()) else {
            return (fresh, false);
        };
        let (ks, kn) = (limit.index(s.updated_us), limit.index(now_us));
        if ks >= kn {
            let level = SlidingLevel {
                previous: s.previous,
                count: s.count,
                to_end_us,
            };
            (level, s.updated_us > now_us)
        } else if ks + 1 == kn {
            let level = SlidingLevel {
                previous: s.count,
                count: 0,
                to_end_us,
            };
            (level, false)
        } else {
            (fresh, false)
        }
    }

    fn rebase(limit: &WindowLimit, from: &WindowLimit, level: SlidingLevel) -> SlidingLevel {
        if from.unit_secs == limit.unit_secs {
            level
        } else {
            SlidingLevel {
                previous: 0,
                count: 0,
                to_end_us: 0,
            }
        }
    }

    fn consume(limit: &WindowLimit, level: SlidingLevel, cost: u64) -> Consumed<SlidingLevel> {
        let cap = u128::from(limit.requests_per_unit) * u128::from(MICRO);
        let need = (u128::from(cost.max(1)) * u128::from(MICRO)).min(cap + u128::from(MICRO));
        let enough = level.estimate_micro(limit) + need <= cap;
        let after = SlidingLevel {
            count: level.count.saturating_add(cost).min(MAX_COUNT),
            ..level
        };
        let (level, changed, stands) = if cost == 0 {
            (level, false, false)
        } else if enough {
            (after, true, false)
        } else if limit.counts_denied {
            (after, true, true)
        } else {
            (level, false, false)
        };
        Consumed {
            level,
            enough,
            changed,
            stands,
        }
    }

    /// Off the current count, or with `taken_at_us` off the count of the
    /// window it was taken in (the previous one's, or nothing once that
    /// one is over too), never below zero.
    fn refund(
        limit: &WindowLimit,
        level: SlidingLevel,
        cost: u64,
        taken_at_us: Option<u64>,
        now_us: u64,
    ) -> SlidingLevel {
        let kn = limit.index(now_us);
        match taken_at_us.map(|t| limit.index(t)) {
            Some(k) if k + 1 == kn => SlidingLevel {
                previous: level.previous.saturating_sub(cost),
                ..level
            },
            Some(k) if k != kn => level,
            _ => SlidingLevel {
                count: level.count.saturating_sub(cost),
                ..level
            },
        }
    }

    fn charges_when_denied(_: &WindowLimit) -> bool {
        false
    }

    fn counts_when_short(limit: &WindowLimit) -> bool {
        limit.counts_denied
    }

    fn store(limit: &WindowLimit, level: SlidingLevel, now_us: u64) -> WindowState {
        WindowState {
            updated_us: now_us,
            unit_secs: limit.unit_secs.get(),
            previous: level.previous,
            count: level.count,
        }
    }

    fn report(limit: &WindowLimit, level: SlidingLevel, now_us: u64) -> Report {
        let left =
            limit.limit_micro() - i128::try_from(level.estimate_micro(limit)).unwrap_or(i128::MAX);
        Report {
            remaining_micro: i64::try_from(left).unwrap_or(i64::MIN),
            window: Some(WindowReport {
                at_us: now_us,
                previous_micro: level.previous.saturating_mul(MICRO),
            }),
        }
    }

    fn level_of_report(limit: &WindowLimit, report: &Report) -> SlidingLevel {
        level_of(limit, report)
    }

    /// The end of the next window while the current window has a count
    /// (it is the previous one until then), else the end of the current
    /// window while the previous one has a count, else 0 (the same as
    /// never seen).
    fn expiry_us(limit: &WindowLimit, state: &WindowState) -> u128 {
        if state.unit_secs != limit.unit_secs.get() {
            return 0;
        }
        let to_end = u128::from(limit.to_end_us(state.updated_us));
        if state.count > 0 {
            to_end + u128::from(limit.window_us())
        } else if state.previous > 0 {
            to_end
        } else {
            0
        }
    }

    fn updated_us(state: &WindowState) -> u64 {
        state.updated_us
    }

    fn capacity_micro(limit: &WindowLimit) -> u128 {
        u128::from(limit.requests_per_unit) * u128::from(MICRO)
    }

    fn unit_secs(limit: &WindowLimit) -> u64 {
        limit.unit_secs.get()
    }

    fn admits_nothing(limit: &WindowLimit) -> bool {
        limit.requests_per_unit == 0
    }

    /// `max(cost, 1)` tokens, as on a bucket.
    fn need_micro(_: &WindowLimit, cost: u64) -> u128 {
        u128::from(cost.max(1)) * u128::from(MICRO)
    }

    /// Until the estimate is 0: the end of the next window when the
    /// current one has a count, of this one when only the previous has.
    fn reset_us(limit: &WindowLimit, report: &Report) -> u128 {
        let l = level_of(limit, report);
        if l.count > 0 {
            u128::from(l.to_end_us) + u128::from(limit.window_us())
        } else if l.previous > 0 {
            u128::from(l.to_end_us)
        } else {
            0
        }
    }

    fn wait_us(limit: &WindowLimit, report: &Report, need_micro: u128) -> u128 {
        wait_until_fits_us(limit, &level_of(limit, report), need_micro)
    }

    fn report_later(limit: &WindowLimit, report: &Report, since_us: u64, now_us: u64) -> Report {
        let at = report.window.map_or(0, |w| w.at_us);
        let later = at.saturating_add(now_us.saturating_sub(since_us));
        let l = level_of(limit, report);
        let (previous, count) = match limit.index(later).saturating_sub(limit.index(at)) {
            0 => (l.previous, l.count),
            1 => (l.count, 0),
            _ => (0, 0),
        };
        let level = SlidingLevel {
            previous,
            count,
            to_end_us: limit.to_end_us(later),
        };
        Self::report(limit, level, later)
    }

    /// Parameters `[N, U, counts_denied]`; the extra parameter is 0 but for
    /// a [`ChargeKind::Return`]: the number of the window it was taken in,
    /// plus 1. Costs are clamped to the fixed window's most count, which
    /// changes no outcome.
    fn script_charge(limit: &WindowLimit, cost: u64, kind: ChargeKind) -> ScriptCharge {
        window_script_charge(Self::SCRIPT_ID, limit, cost, kind)
    }
}

/// The level a report stands for: its time's position in the window, the
/// previous count it carries and the current count that makes up the rest
/// of the estimate.
fn level_of(limit: &WindowLimit, report: &Report) -> SlidingLevel {
    let Some(w) = report.window else {
        return SlidingLevel {
            previous: 0,
            count: 0,
            to_end_us: limit.window_us(),
        };
    };
    let previous = w.previous_micro / MICRO;
    let to_end_us = limit.to_end_us(w.at_us);
    let weighted = i128::try_from(weighted_micro(previous, to_end_us, limit.unit_secs.get()))
        .unwrap_or(i128::MAX);
    let count_micro = limit.limit_micro() - i128::from(report.remaining_micro) - weighted;
    SlidingLevel {
        previous,
        count: u64::try_from(count_micro.max(0) / i128::from(MICRO)).unwrap_or(MAX_COUNT),
        to_end_us,
    }
}

/// Microseconds from `level`'s time until a consume needing `need_micro`
/// fits, with no other traffic, at least 1: the time the previous count's
/// weight takes to fall far enough (in this window, or in the next one,
/// where the current count becomes the previous one). A need above the
/// limit never fits: the time until the window is back to zero. A limit of
/// 0: one unit.
#[must_use]
pub fn wait_until_fits_us(limit: &WindowLimit, level: &SlidingLevel, need_micro: u128) -> u128 {
    let cap = u128::from(limit.requests_per_unit) * u128::from(MICRO);
    let w = u128::from(limit.window_us());
    let to_end = u128::from(level.to_end_us);
    let unit_secs = u128::from(limit.unit_secs.get());
    let wait = if limit.requests_per_unit == 0 {
        w
    } else if need_micro > cap {
        if level.count > 0 { to_end + w } else { to_end }
    } else {
        let count_micro = u128::from(level.count) * u128::from(MICRO);
        let prev = u128::from(level.previous);
        if count_micro + need_micro <= cap {
            // In this window: ceil(prev × r / U) <= room, for r the time left
            // to its end, holds for r <= floor(room × U / prev).
            let room = cap - need_micro - count_micro;
            // No previous count: nothing to wait for.
            (room * unit_secs)
                .checked_div(prev)
                .map_or(0, |r_max| to_end.saturating_sub(r_max))
        } else {
            // In the next window, where this count is the previous one:
            // fits once r <= floor((cap - need) × U / count).
            let room = cap - need_micro;
            let r_max = (room * unit_secs / u128::from(level.count.max(1))).min(w);
            to_end + (w - r_max)
        }
    };
    wait.max(1)
}

#[cfg(test)]
mod tests {
    use super::super::{ChargeSpec, Limit, RequestResult, State, ceil_secs};
    use super::*;
    use std::num::NonZeroU64;

    const SEC: u64 = 1_000_000;
    /// A minute boundary (1,699,999,980 s).
    const T: u64 = 1_699_999_980 * SEC;

    fn lim(n: u32, unit: u64) -> WindowLimit {
        WindowLimit {
            requests_per_unit: n,
            unit_secs: NonZeroU64::new(unit).expect("a unit"),
            counts_denied: false,
        }
    }

    fn spec(l: WindowLimit, cost: u64, kind: ChargeKind) -> ChargeSpec {
        ChargeSpec {
            limit: Limit::SlidingWindow(l),
            cost,
            kind,
            shadow: false,
        }
    }

    /// One key: the request driver with what it wrote kept for the next call.
    struct Key {
        state: Option<State>,
    }

    impl Key {
        fn apply(&mut self, specs: &[ChargeSpec], now: u64) -> RequestResult {
            let charges: Vec<(usize, ChargeSpec)> = specs.iter().map(|s| (0, *s)).collect();
            let mut wrote = None;
            let r = super::super::apply_request(&charges, &[self.state], now, |_, s| {
                wrote = Some(s);
            });
            if let Some(s) = wrote {
                let l = specs.last().expect("a charge").limit;
                self.state = (l.expiry_us(&s) > 0).then_some(s);
            }
            r
        }

        fn admits(&mut self, l: WindowLimit, now: u64) -> bool {
            self.apply(&[spec(l, 1, ChargeKind::Consume)], now).admitted
        }
    }

    /// The previous window's count weighs by the part of it still inside
    /// the sliding window.
    #[test]
    fn the_previous_window_weighs_by_its_part_in_the_sliding_window() {
        let l = lim(60, 60);
        let mut k = Key { state: None };
        for _ in 0..60 {
            assert!(k.admits(l, T + 59 * SEC));
        }
        assert!(!k.admits(l, T + 59 * SEC));
        // 30 s into the next window, half of the previous one is inside the
        // sliding window: 60 × 30/60 = 30 of the estimate, 30 left.
        let mut admitted = 0;
        while k.admits(l, T + 90 * SEC) {
            admitted += 1;
        }
        assert_eq!(admitted, 30);
        // The estimate rounds up: 1 µs later 29.99999... of the previous
        // window still count 30.
        assert!(!k.admits(l, T + 90 * SEC + 1));
        // 1 s later 29 of it: one more.
        assert!(k.admits(l, T + 91 * SEC));
        assert!(!k.admits(l, T + 91 * SEC));
    }

    /// The stated bound, exactly: the previous window's hits all at its
    /// end, then as many as fit `p` into the next window. A span of one
    /// unit ending there holds `N + prev × p / U`; an aligned window `N`.
    #[test]
    fn a_span_of_one_unit_holds_at_most_n_plus_the_stated_bound() {
        let l = lim(60, 60);
        for p in [1u64, 15, 30, 45, 59] {
            let mut k = Key { state: None };
            let mut before = 0u64;
            while k.admits(l, T + 60 * SEC - 1) {
                before += 1;
            }
            let mut after = 0u64;
            while k.admits(l, T + 60 * SEC + p * SEC) {
                after += 1;
            }
            assert_eq!(before, 60);
            // The span (T + p, T + 60 + p] holds both.
            assert_eq!(before + after, 60 + 60 * p / 60, "p = {p}");
            assert!(before + after < 2 * 60);
        }
    }

    /// The wait reported to a denied request is the real time until the
    /// same request fits, rounded up to seconds: never early, and exact to
    /// the microsecond before the rounding.
    #[test]
    fn the_wait_is_the_time_until_the_request_fits() {
        let l = lim(10, 60);
        let mut k = Key { state: None };
        for _ in 0..10 {
            assert!(k.admits(l, T + 50 * SEC));
        }
        let r = k.apply(&[spec(l, 4, ChargeKind::Consume)], T + 50 * SEC);
        assert!(!r.admitted);
        let wait = Limit::SlidingWindow(l).wait_us(&r.charges[0].report(), 4 * u128::from(MICRO));
        // In the next window the 10 weigh 10 × r/60; 4 fit once that is
        // at most 6: r <= 36 s, 24 s into the window: 10 + 24 = 34 s.
        assert_eq!(wait, 34 * u128::from(SEC));
        let retry = |t: u64, k: &Key| {
            let mut k = Key { state: k.state };
            k.apply(&[spec(l, 4, ChargeKind::Consume)], t).admitted
        };
        assert!(!retry(T + 50 * SEC + 34 * SEC - 1, &k));
        assert!(retry(T + 50 * SEC + 34 * SEC, &k));
        assert_eq!(ceil_secs(wait), 34);
        // Within the window: 5 of 10 in the previous minute, 3 in this one.
        let mut k = Key { state: None };
        for _ in 0..5 {
            assert!(k.admits(l, T + 10 * SEC));
        }
        for _ in 0..3 {
            assert!(k.admits(l, T + 70 * SEC));
        }
        // 10 s in: 5 × 50/60 -> 5 (ceil 4.17); estimate 8, a cost of 3
        // needs it at 7: 5 × r/60 <= 4, r <= 48 s: 2 s from now.
        let r = k.apply(&[spec(l, 3, ChargeKind::Consume)], T + 70 * SEC);
        assert!(!r.admitted);
        let wait = Limit::SlidingWindow(l).wait_us(&r.charges[0].report(), 3 * u128::from(MICRO));
        assert_eq!(wait, 2 * u128::from(SEC));
        let retry3 = |t: u64| {
            let mut k2 = Key { state: k.state };
            k2.apply(&[spec(l, 3, ChargeKind::Consume)], t).admitted
        };
        assert!(!retry3(T + 72 * SEC - 1));
        assert!(retry3(T + 72 * SEC));
    }

    /// A key expires at the end of the next window while its current window
    /// has a count, at the end of its window when only the previous has.
    #[test]
    fn keys_expire_at_the_end_of_what_they_must_remember() {
        let l = lim(10, 60);
        let st = |previous, count| WindowState {
            updated_us: T + 20 * SEC,
            unit_secs: 60,
            previous,
            count,
        };
        assert_eq!(
            SlidingWindow::expiry_us(&l, &st(0, 1)),
            u128::from(100 * SEC)
        );
        assert_eq!(
            SlidingWindow::expiry_us(&l, &st(3, 0)),
            u128::from(40 * SEC)
        );
        assert_eq!(SlidingWindow::expiry_us(&l, &st(0, 0)), 0);
        assert_eq!(SlidingWindow::expiry_us(&lim(10, 3600), &st(0, 1)), 0);
    }

    /// A denied request whose first charge counts its hits although they
    /// do not fit (they stand) and whose last charge, on the same key,
    /// has another window length: the key is stored under the last
    /// charge's length, and hits counted under another length start anew
    /// there, as they do between the charges of an admitted request. (They
    /// used to be stored as the count of the last charge's window, which a
    /// later request on that key read as its own hits.)
    #[test]
    fn hits_that_stand_under_another_window_length_start_anew() {
        let minute = WindowLimit {
            counts_denied: true,
            ..lim(2, 60)
        };
        let hour = lim(5, 3600);
        let mut k = Key { state: None };
        let r = k.apply(
            &[
                spec(minute, 4, ChargeKind::Consume),
                spec(hour, 1, ChargeKind::Consume),
            ],
            T + 10 * SEC,
        );
        assert!(!r.admitted);
        let r = k.apply(&[spec(hour, 5, ChargeKind::Consume)], T + 10 * SEC);
        assert!(
            r.admitted,
            "the hour window holds none of the minute's hits"
        );
        assert_eq!(r.charges[0].remaining_micro, 0);
        // Under one window length the standing hits stay counted.
        let mut k = Key { state: None };
        let r = k.apply(
            &[
                spec(minute, 4, ChargeKind::Consume),
                spec(minute, 1, ChargeKind::Consume),
            ],
            T + 10 * SEC,
        );
        assert!(!r.admitted);
        assert_eq!(
            k.state.and_then(|s| s.window().map(|w| w.count)),
            Some(5),
            "both charges count their hits when they do not fit"
        );
    }

    #[test]
    fn refunds_never_go_below_zero_and_returns_find_their_window() {
        let l = lim(10, 60);
        let mut k = Key { state: None };
        for _ in 0..4 {
            assert!(k.admits(l, T + 30 * SEC));
        }
        let r = k.apply(&[spec(l, 9, ChargeKind::Refund)], T + 31 * SEC);
        assert_eq!(r.charges[0].remaining_micro, 10 * 1_000_000);
        for _ in 0..4 {
            assert!(k.admits(l, T + 40 * SEC));
        }
        // In the next window the 4 are the previous count: a return of a
        // charge taken then comes off it, a refund off the current count.
        let back = |t: u64| ChargeKind::Return { taken_at_us: t };
        let level = |k: &Key| {
            k.state
                .and_then(|s| s.window().map(|w| (w.previous, w.count)))
        };
        k.apply(&[spec(l, 1, ChargeKind::Consume)], T + 70 * SEC);
        assert_eq!(level(&k), Some((4, 1)));
        k.apply(&[spec(l, 3, back(T + 40 * SEC))], T + 70 * SEC);
        assert_eq!(level(&k), Some((1, 1)));
        k.apply(&[spec(l, 5, back(T + 70 * SEC))], T + 71 * SEC);
        assert_eq!(level(&k), Some((1, 0)));
        k.apply(&[spec(l, 5, back(T - 60 * SEC))], T + 71 * SEC);
        assert_eq!(level(&k), Some((1, 0)), "two windows ago: nothing left");
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(200))]
            /// Random traffic on one key: every aligned window admits at
            /// most N, every span of one unit at most N + prev × p / U
            /// (below 2N), and a denied request retried after its
            /// reported wait (in whole seconds, no other traffic) is
            /// admitted.
            #[test]
            fn sliding_window_bounds_and_honest_waits(
                n in 1u32..12,
                unit in prop_oneof![Just(1u64), Just(60)],
                steps in proptest::collection::vec((0u64..3_000_000, 1u64..4), 1..150),
            ) {
                let l = lim(n, unit);
                let w = unit * SEC;
                let mut k = Key { state: None };
                let mut now = T;
                let mut admitted: Vec<(u64, u64)> = Vec::new();
                for (gap, cost) in steps {
                    now += gap * unit;
                    let s = spec(l, cost, ChargeKind::Consume);
                    let before = k.state;
                    let r = k.apply(&[s], now);
                    if r.admitted {
                        admitted.push((now, cost));
                    } else if cost <= u64::from(n) {
                        let wait = Limit::SlidingWindow(l).wait_us(&r.charges[0].report(), s.need_micro());
                        let later = now + ceil_secs(wait) * SEC;
                        let mut retry = Key { state: before };
                        prop_assert!(retry.apply(&[s], later).admitted, "retry after {} s", ceil_secs(wait));
                        let mut early = Key { state: before };
                        let exact = now + u64::try_from(wait).unwrap_or(u64::MAX);
                        prop_assert!(early.apply(&[s], exact).admitted, "at the exact wait");
                        if wait > 1 {
                            let mut earlier = Key { state: before };
                            prop_assert!(!earlier.apply(&[s], exact - 1).admitted, "1 us before the wait");
                        }
                    }
                }
                for &(t, _) in &admitted {
                    let window = t / w;
                    let in_window: u64 = admitted.iter().filter(|(u, _)| u / w == window).map(|x| x.1).sum();
                    prop_assert!(in_window <= u64::from(n));
                    // The span (t - U, t]: the previous window's hits in it,
                    // at most all of them, and the current window's.
                    let prev: u64 = admitted.iter().filter(|(u, _)| u / w + 1 == window).map(|x| x.1).sum();
                    let span: u64 = admitted.iter().filter(|(u, _)| *u + w > t && *u <= t).map(|x| x.1).sum();
                    let p = t % w;
                    let bound = u128::from(n) + u128::from(prev) * u128::from(p) / u128::from(w);
                    prop_assert!(u128::from(span) <= bound, "{} in the span ending {}, bound {}", span, t, bound);
                    prop_assert!(span < 2 * u64::from(n));
                }
            }
        }
    }
}
