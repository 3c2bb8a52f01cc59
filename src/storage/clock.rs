//! Time source for the memory backend: injected so tests run on a paused clock.
//! (The Redis backend never uses it: Redis takes time from `TIME`, docs/design.md, "Time".)

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
