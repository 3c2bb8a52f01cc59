//! The fixed window: the Go reference service's algorithm
//! (envoyproxy/ratelimit, `src/redis/fixed_cache_impl.go` and
//! `src/limiter/base_limiter.go`), and the reference model of its script
//! part (`lua/algorithms/fixed_window.lua`), tested against it through the
//! request driver ([`apply_request`](super::apply_request),
//! `lua/request.lua`).
//!
//! Windows are aligned to the unit since the Unix epoch (a minute window
//! runs from :00 to :60 of each minute, as the Go service's key
//! `<key>_<now / unit * unit>` does). A window counts the hits charged in
//! it; a consume of `cost` fits while `count + cost <= requests_per_unit`
//! (so a check, cost 0, passes until the window is over its limit, as in
//! the Go service, where `hits_addend: 0` is over only when the count
//! already is), and a consume that does not fit is counted all the same
//! (the Go service's `INCRBY` comes before the comparison): it stands in a
//! denied request, and the window stays over its limit until it ends. A
//! consume that fits is counted only when its request is admitted
//! (all-or-nothing). A refund takes the cost off the count, never below
//! zero. A new window starts at zero: across a window edge a client can
//! get `2 × requests_per_unit` in a moment (docs/design.md, "Windows").
//!
//! Units: a window's level is its count in whole tokens; what a charge
//! reports is `requests_per_unit − count` in micro-units (negative while
//! the window is over its limit) and the time storage evaluated it at
//! ([`WindowReport::at_us`]): the wait it reports is the time to the end
//! of that window, `duration_until_reset` as the Go service computes it.

use super::{
    Algorithm, ChargeKind, Consumed, MICRO, MICRO_I64, Report, ScriptCharge, WindowReport,
};
use std::num::NonZeroU64;

/// Most a window counts, in tokens: twice the largest `requests_per_unit`.
/// A count is saturated there (a window that far over is over for every
/// limit), so that every amount stays exact in the script's doubles; a
/// consume's cost is clamped to it for the same reason.
pub const MAX_COUNT: u64 = 2 * (u32::MAX as u64);

/// The limit a window is evaluated under
/// ([`Limit::FixedWindow`](super::Limit::FixedWindow)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WindowLimit {
    /// `N`: tokens per window. 0 denies every consume of more than 0.
    pub requests_per_unit: u32,
    /// `U`: length of a window in seconds (second = 1 ... year = 31,536,000).
    pub unit_secs: NonZeroU64,
    /// A consume that does not fit is counted anyway (and stands in a
    /// denied request). Always set on a fixed window (the Go service counts
    /// a denied request's hits); the quota service sets it to charge what
    /// Envoys already admitted.
    pub counts_denied: bool,
}

impl WindowLimit {
    /// A window of `requests_per_unit` per `unit_secs` that counts denied
    /// hits (a fixed window from a rule).
    #[must_use]
    pub const fn counting(requests_per_unit: u32, unit_secs: NonZeroU64) -> Self {
        Self {
            requests_per_unit,
            unit_secs,
            counts_denied: true,
        }
    }

    /// The window's length in microseconds.
    #[must_use]
    pub fn window_us(&self) -> u64 {
        self.unit_secs.get().saturating_mul(1_000_000)
    }

    /// The number of the window holding `t_us` (windows since the epoch).
    #[must_use]
    pub fn index(&self, t_us: u64) -> u64 {
        t_us / self.window_us()
    }

    /// Microseconds from `t_us` to the end of its window (1 ..= the
    /// window's length).
    #[must_use]
    pub fn to_end_us(&self, t_us: u64) -> u64 {
        let w = self.window_us();
        w - t_us % w
    }

    /// The limit in micro-units.
    #[must_use]
    pub fn limit_micro(&self) -> i128 {
        i128::from(self.requests_per_unit) * i128::from(MICRO)
    }
}

/// Stored state of one window key: what was counted, when, and under
/// which unit (a key read under another unit is the same as never seen).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WindowState {
    /// Time of the last write, microseconds since the Unix epoch: it names
    /// the window the counts belong to.
    pub updated_us: u64,
    /// The unit, in seconds, the key was written under.
    pub unit_secs: u64,
    /// The previous window's count, in tokens (a sliding window; 0 on a
    /// fixed window).
    pub previous: u64,
    /// The count of the window of `updated_us`, in tokens.
    pub count: u64,
}

/// The fixed window algorithm (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FixedWindow;

impl Algorithm for FixedWindow {
    type Limit = WindowLimit;
    type State = WindowState;
    /// The count of the window of now, in tokens.
    type Level = u64;
    const SCRIPT_ID: u8 = 1;

    /// The stored count while the state is of this unit and of the window
    /// of now; a state of a later window (a clock stepped back) is taken
    /// as of now, and stale, as a bucket's future stamp is.
    fn read(limit: &WindowLimit, stored: Option<&WindowState>, now_us: u64) -> (u64, bool) {
        match stored {
            Some(s)
                if s.unit_secs == limit.unit_secs.get()
                    && limit.index(s.updated_us) >= limit.index(now_us) =>
            {
                (s.count, s.updated_us > now_us)
            }
            _ => (0, false),
        }
    }

    fn rebase(limit: &WindowLimit, from: &WindowLimit, level: u64) -> u64 {
        if from.unit_secs == limit.unit_secs {
            level
        } else {
            0
        }
    }

    fn consume(limit: &WindowLimit, count: u64, cost: u64) -> Consumed<u64> {
        let enough = count.saturating_add(cost) <= u64::from(limit.requests_per_unit);
        let after = count.saturating_add(cost).min(MAX_COUNT);
        let (level, changed, stands) = if cost == 0 {
            (count, false, false)
        } else if enough {
            (after, true, false)
        } else if limit.counts_denied {
            (after, true, true)
        } else {
            (count, false, false)
        };
        Consumed {
            level,
            enough,
            changed,
            stands,
        }
    }

    fn refund(
        limit: &WindowLimit,
        count: u64,
        cost: u64,
        taken_at_us: Option<u64>,
        now_us: u64,
    ) -> u64 {
        match taken_at_us {
            // Counted in a window that is over: nothing of it is left here.
            Some(t) if limit.index(t) != limit.index(now_us) => count,
            _ => count.saturating_sub(cost),
        }
    }

    fn charges_when_denied(_: &WindowLimit) -> bool {
        false
    }

    fn counts_when_short(limit: &WindowLimit) -> bool {
        limit.counts_denied
    }

    fn store(limit: &WindowLimit, count: u64, now_us: u64) -> WindowState {
        WindowState {
            updated_us: now_us,
            unit_secs: limit.unit_secs.get(),
            previous: 0,
            count,
        }
    }

    fn report(limit: &WindowLimit, count: u64, now_us: u64) -> Report {
        let count = i64::try_from(count.min(MAX_COUNT)).unwrap_or(i64::MAX);
        Report {
            remaining_micro: (i64::from(limit.requests_per_unit) - count) * MICRO_I64,
            window: Some(WindowReport {
                at_us: now_us,
                previous_micro: 0,
            }),
        }
    }

    fn level_of_report(limit: &WindowLimit, report: &Report) -> u64 {
        count_of(limit, report)
    }

    /// Until the end of the state's window (0 for a count of 0, or a state
    /// of another unit: the same as never seen).
    fn expiry_us(limit: &WindowLimit, state: &WindowState) -> u128 {
        if state.count == 0 || state.unit_secs != limit.unit_secs.get() {
            return 0;
        }
        u128::from(limit.to_end_us(state.updated_us))
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

    /// `cost` tokens: a check (cost 0) needs nothing, as in the Go service.
    fn need_micro(_: &WindowLimit, cost: u64) -> u128 {
        u128::from(cost) * u128::from(MICRO)
    }

    /// The end of the window, whatever its count: the Go service's
    /// `duration_until_reset` (`unit - now % unit`).
    fn reset_us(limit: &WindowLimit, report: &Report) -> u128 {
        u128::from(to_end_us(limit, report))
    }

    /// The end of the window: a new one starts at zero. A cost above the
    /// limit never fits; the Go service reports the window's end for it
    /// too.
    fn wait_us(limit: &WindowLimit, report: &Report, _need_micro: u128) -> u128 {
        u128::from(to_end_us(limit, report)).max(1)
    }

    /// The same count until the window ends, then a new window's zero.
    fn report_later(limit: &WindowLimit, report: &Report, since_us: u64, now_us: u64) -> Report {
        let elapsed = now_us.saturating_sub(since_us);
        let at_us = report.window.map_or(0, |w| w.at_us).saturating_add(elapsed);
        let remaining_micro = if elapsed < to_end_us(limit, report) {
            report.remaining_micro
        } else {
            i64::from(limit.requests_per_unit) * MICRO_I64
        };
        Report {
            remaining_micro,
            window: Some(WindowReport {
                at_us,
                previous_micro: 0,
            }),
        }
    }

    /// Parameters `[N, U, counts_denied]`; the extra parameter is 0 but for
    /// a [`ChargeKind::Return`]: the number of the window it was taken in,
    /// plus 1. Costs are clamped to [`MAX_COUNT`], which changes no outcome
    /// (a count saturates there).
    fn script_charge(limit: &WindowLimit, cost: u64, kind: ChargeKind) -> ScriptCharge {
        window_script_charge(Self::SCRIPT_ID, limit, cost, kind)
    }
}

/// The packed charge of a window algorithm (see
/// [`FixedWindow::script_charge`]).
pub(crate) fn window_script_charge(
    algorithm: u8,
    limit: &WindowLimit,
    cost: u64,
    kind: ChargeKind,
) -> ScriptCharge {
    let extra = match kind {
        ChargeKind::Return { taken_at_us } => limit.index(taken_at_us) + 1,
        ChargeKind::Consume
        | ChargeKind::Refund
        | ChargeKind::Reserve(_)
        | ChargeKind::Settle { .. }
        | ChargeKind::Unreserve { .. } => 0,
    };
    ScriptCharge {
        algorithm,
        // A unit is at most a year (31,536,000 s): it fits in 32 bits.
        params: [
            limit.requests_per_unit,
            u32::try_from(limit.unit_secs.get()).unwrap_or(u32::MAX),
            u32::from(limit.counts_denied),
        ],
        extra,
        cost: cost.min(MAX_COUNT),
    }
}

/// The count a window's report stands for, in tokens (`N − remaining`, at
/// least 0): what the Go service's statistics compare.
#[must_use]
pub fn count_of(limit: &WindowLimit, report: &Report) -> u64 {
    let count = limit.limit_micro() - i128::from(report.remaining_micro);
    u64::try_from(count.max(0) / i128::from(MICRO)).unwrap_or(MAX_COUNT)
}

/// Microseconds from the report's evaluation to the end of its window (the
/// whole unit for a report without a time).
fn to_end_us(limit: &WindowLimit, report: &Report) -> u64 {
    report
        .window
        .map_or(limit.window_us(), |w| limit.to_end_us(w.at_us))
}

#[cfg(test)]
mod tests {
    use super::super::{ChargeResult, ChargeSpec, Limit, RequestResult, State, ceil_secs};
    use super::*;

    const SEC: u64 = 1_000_000;
    /// A minute boundary: 28,333,333 minutes since the epoch.
    const T: u64 = 1_699_999_980 * SEC;

    fn lim(n: u32, unit: u64) -> WindowLimit {
        WindowLimit::counting(n, NonZeroU64::new(unit).expect("a unit"))
    }

    fn spec(l: WindowLimit, cost: u64, kind: ChargeKind) -> ChargeSpec {
        ChargeSpec {
            limit: Limit::FixedWindow(l),
            cost,
            kind,
            shadow: false,
        }
    }

    /// One key of a memory-like store: the request driver with what it
    /// wrote kept for the next call.
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
    }

    #[test]
    fn a_window_admits_its_limit_then_denies_until_its_end() {
        let l = lim(3, 60);
        let mut k = Key { state: None };
        for left in [2, 1, 0] {
            let r = k.apply(&[spec(l, 1, ChargeKind::Consume)], T + 10 * SEC);
            assert!(r.admitted);
            assert_eq!(r.charges[0].remaining_micro, left * MICRO_I64);
        }
        let r = k.apply(&[spec(l, 1, ChargeKind::Consume)], T + 59 * SEC);
        assert!(!r.admitted);
        // Reported before the request: 0 left; the wait is to the window's end.
        let rep = r.charges[0].report();
        assert_eq!(rep.remaining_micro, 0);
        assert_eq!(
            Limit::FixedWindow(l).wait_us(&rep, u128::from(MICRO)),
            SEC.into()
        );
        // The denied hit was counted: the window is over its limit.
        let r = k.apply(&[spec(l, 0, ChargeKind::Consume)], T + 59 * SEC);
        assert!(!r.admitted, "a check is over once the count is over");
        assert_eq!(r.charges[0].remaining_micro, -MICRO_I64);
        // The next window starts at zero.
        let r = k.apply(&[spec(l, 3, ChargeKind::Consume)], T + 60 * SEC);
        assert!(r.admitted);
        assert_eq!(r.charges[0].remaining_micro, 0);
    }

    /// Across a window edge a fixed window admits twice its limit within
    /// a moment: the price of its simplicity (docs/design.md, "Windows").
    #[test]
    fn twice_the_limit_across_an_edge() {
        let l = lim(5, 1);
        let mut k = Key { state: None };
        let mut admitted = 0;
        for t in [T + SEC - 1, T + SEC] {
            for _ in 0..10 {
                admitted += u32::from(k.apply(&[spec(l, 1, ChargeKind::Consume)], t).admitted);
            }
        }
        assert_eq!(admitted, 10, "5 in the last microsecond, 5 in the first");
    }

    #[test]
    fn a_check_passes_until_the_count_is_over_the_limit() {
        let l = lim(2, 1);
        let mut k = Key { state: None };
        assert!(k.apply(&[spec(l, 2, ChargeKind::Consume)], T).admitted);
        let r = k.apply(&[spec(l, 0, ChargeKind::Consume)], T);
        assert!(
            r.admitted,
            "count 2 of 2: a check is OK, as in the Go service"
        );
        assert_eq!(r.charges[0].remaining_micro, 0);
    }

    #[test]
    fn refunds_never_go_below_zero_and_returns_stay_in_their_window() {
        let l = lim(10, 60);
        let mut k = Key { state: None };
        assert!(k.apply(&[spec(l, 4, ChargeKind::Consume)], T).admitted);
        let r = k.apply(&[spec(l, 9, ChargeKind::Refund)], T + SEC);
        assert!(r.admitted);
        assert_eq!(r.charges[0].remaining_micro, 10 * MICRO_I64);
        assert_eq!(k.state, None, "a count of zero is forgotten");
        // A return of a charge taken in the previous window gives nothing back.
        assert!(
            k.apply(&[spec(l, 4, ChargeKind::Consume)], T + 60 * SEC)
                .admitted
        );
        let back = ChargeKind::Return {
            taken_at_us: T + 59 * SEC,
        };
        let r = k.apply(&[spec(l, 4, back)], T + 61 * SEC);
        assert_eq!(r.charges[0].remaining_micro, 6 * MICRO_I64);
        let back = ChargeKind::Return {
            taken_at_us: T + 60 * SEC,
        };
        let r = k.apply(&[spec(l, 4, back)], T + 61 * SEC);
        assert_eq!(r.charges[0].remaining_micro, 10 * MICRO_I64);
    }

    /// `duration_until_reset` is the Go service's `unit - now % unit`,
    /// rounded up to whole seconds.
    #[test]
    fn the_reset_is_the_end_of_the_window() {
        let l = Limit::FixedWindow(lim(10, 3600));
        let at = |t: u64| Report {
            remaining_micro: 0,
            window: Some(WindowReport {
                at_us: t,
                previous_micro: 0,
            }),
        };
        // 1,000,000 s is 997,200 s + 2,800 s into its hour.
        assert_eq!(ceil_secs(l.reset_us(&at(1_000_000 * SEC))), 800);
        assert_eq!(ceil_secs(l.reset_us(&at(1_000_000 * SEC + 1))), 800);
        assert_eq!(ceil_secs(l.reset_us(&at(997_200 * SEC))), 3600);
        assert_eq!(ceil_secs(l.wait_us(&at(1_000_000 * SEC), 1)), 800);
    }

    /// A state of another algorithm or another unit is the same as never
    /// seen; a state stamped in a later window (a clock stepped back) keeps
    /// its count and is rewritten now.
    #[test]
    fn foreign_and_future_states() {
        let l = lim(5, 60);
        let bucket = State::TokenBucket(super::super::BucketState {
            tokens_micro: 0,
            updated_us: T,
        });
        let mut k = Key {
            state: Some(bucket),
        };
        let r = k.apply(&[spec(l, 1, ChargeKind::Consume)], T);
        assert_eq!(r.charges[0].remaining_micro, 4 * MICRO_I64);
        let hour = State::FixedWindow(WindowState {
            updated_us: T,
            unit_secs: 3600,
            previous: 0,
            count: 5,
        });
        let mut k = Key { state: Some(hour) };
        assert!(k.apply(&[spec(l, 5, ChargeKind::Consume)], T).admitted);
        let later = WindowState {
            updated_us: T + 120 * SEC,
            unit_secs: 60,
            previous: 0,
            count: 5,
        };
        let mut k = Key {
            state: Some(State::FixedWindow(later)),
        };
        let r = k.apply(&[spec(l, 0, ChargeKind::Consume)], T);
        assert!(r.admitted, "a check writes nothing but the stale stamp");
        assert_eq!(r.charges[0].remaining_micro, 0);
        assert_eq!(
            k.state.and_then(|s| s.window().map(|w| w.updated_us)),
            Some(T)
        );
    }

    /// A denied request charges a window only with the hits it had no room
    /// for; a window that fits in a request another rule denies is not
    /// charged.
    #[test]
    fn all_or_nothing_with_counted_denials() {
        let fits = spec(lim(10, 60), 2, ChargeKind::Consume);
        let over = spec(lim(1, 60), 2, ChargeKind::Consume);
        let mut puts = Vec::new();
        let r = super::super::apply_request(&[(0, fits), (1, over)], &[None, None], T, |i, s| {
            puts.push((i, s));
        });
        assert!(!r.admitted);
        assert_eq!(
            r.charges[0],
            ChargeResult {
                enough: true,
                remaining_micro: 10 * MICRO_I64,
                window: Some(WindowReport {
                    at_us: T,
                    previous_micro: 0
                }),
                ..ChargeResult::default()
            }
        );
        assert_eq!(puts.len(), 1);
        assert_eq!(puts[0].0, 1);
        assert_eq!(puts[0].1.window().map(|w| w.count), Some(2));
    }
}
