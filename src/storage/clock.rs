//! Time source for the memory backend: injected so tests run on a paused clock.
//! (The Redis backend never uses it: Redis takes time from `TIME`, docs/design.md, "Time".)
//! The service runs the memory backend on [`MonotonicClock`], so a step of
//! the wall clock neither mints tokens nor freezes a bucket.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// A source of wall-clock time in microseconds since the Unix epoch.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Current time, microseconds since the Unix epoch.
    fn now_us(&self) -> u64;
}

/// The system clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_us(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    }
}

/// Wall-clock time read once, then moved on by the monotonic clock
/// ([`std::time::Instant`]): never steps, never goes back. Its readings
/// drift from the wall clock by whatever the wall clock stepped since the
/// start, which the memory backend (state lives only in this process) does
/// not care about.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock {
    anchor_us: u64,
    start: std::time::Instant,
}

impl MonotonicClock {
    /// A monotonic clock reading `anchor_us` microseconds now.
    #[must_use]
    pub fn starting_at(anchor_us: u64) -> Self {
        Self {
            anchor_us,
            start: std::time::Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    /// Anchored at the system clock's reading now.
    fn default() -> Self {
        Self::starting_at(SystemClock.now_us())
    }
}

impl Clock for MonotonicClock {
    fn now_us(&self) -> u64 {
        let elapsed = u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.anchor_us.saturating_add(elapsed)
    }
}

/// A clock that moves only when told to; clones share the same time.
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock starting at `start_us` microseconds.
    #[must_use]
    pub fn new(start_us: u64) -> Self {
        Self(Arc::new(AtomicU64::new(start_us)))
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: std::time::Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.0.fetch_add(us, Ordering::SeqCst);
    }

    /// Sets the clock to `us` microseconds (may move backwards, to test skew).
    pub fn set_us(&self, us: u64) {
        self.0.store(us, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_us(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The monotonic clock moves with elapsed real time only: its readings
    /// never go back and advance by at most the time the test took, however
    /// the wall clock steps.
    #[test]
    fn the_monotonic_clock_follows_elapsed_time_only() {
        let started = std::time::Instant::now();
        let c = MonotonicClock::starting_at(1_000_000);
        let mut last = c.now_us();
        assert!(last >= 1_000_000);
        for _ in 0..1000 {
            let t = c.now_us();
            assert!(t >= last, "went back from {last} to {t}");
            last = t;
        }
        let bound = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        assert!(
            last - 1_000_000 <= bound,
            "{} us in {bound} us",
            last - 1_000_000
        );
        assert!(
            MonotonicClock::default().now_us() > 1_600_000_000_000_000,
            "anchored at the wall clock"
        );
    }
}
