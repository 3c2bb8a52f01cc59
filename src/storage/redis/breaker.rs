//! Circuit breaker: after `threshold` consecutive transient failures, calls
//! fail at once with [`StorageError::CircuitOpen`](crate::storage::StorageError)
//! instead of each waiting for the Redis timeout (BR-25). While open, one call
//! per `probe_interval` is let through as a probe; the first success (of a
//! probe, or of a health-check ping) closes the breaker.
//!
//! Only failures of calls *started after the failing began* count (see
//! [`CircuitBreaker::failure_of_call_started`]): when one latency spike makes
//! all the calls in flight time out together, that is one observation, not
//! `threshold` of them, so a short stall under load does not turn into an
//! outage of `probe_interval`. A Redis that is really down fails the calls
//! that follow too, and the breaker opens after `threshold` of them.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A consecutive-failure circuit breaker, shared by all calls to one node.
#[derive(Debug)]
pub struct CircuitBreaker {
    threshold: u32,
    probe_interval: Duration,
    failures: AtomicU32,
    /// While open: when the next probe may go through.
    next_probe: Mutex<Option<Instant>>,
    /// When the current run of failures began (`None` after a success).
    streak_start: Mutex<Option<Instant>>,
}

impl CircuitBreaker {
    /// A closed breaker that opens after `threshold` consecutive failures
    /// (at least 1) and then lets one probe through per `probe_interval`.
    #[must_use]
    pub fn new(threshold: u32, probe_interval: Duration) -> Self {
        Self {
            threshold: threshold.max(1),
            probe_interval,
            failures: AtomicU32::new(0),
            next_probe: Mutex::new(None),
            streak_start: Mutex::new(None),
        }
    }

    /// Whether a call may go to Redis now: always while closed; while open,
    /// only the first caller after each `probe_interval` (the probe).
    #[must_use]
    pub fn allow(&self) -> bool {
        if self.failures.load(Ordering::Acquire) < self.threshold {
            return true;
        }
        let now = Instant::now();
        let mut next = self.next_probe.lock();
        match *next {
            Some(t) if now < t => false,
            _ => {
                *next = Some(now + self.probe_interval);
                true
            }
        }
    }

    /// Records a success: closes the breaker.
    pub fn success(&self) {
        if self.failures.swap(0, Ordering::AcqRel) >= self.threshold {
            tracing::info!("Redis answers again; circuit breaker closed");
            metrics::gauge!(crate::metrics::REDIS_CIRCUIT_OPEN).set(0.0);
        }
        *self.next_probe.lock() = None;
        *self.streak_start.lock() = None;
    }

    /// Records a transient failure of a call sent at `started`. It counts
    /// only if the call started after the current run of failures began (the
    /// first failure of a run always counts and starts it): calls that were
    /// already in flight when Redis stalled add no evidence.
    pub fn failure_of_call_started(&self, started: Instant) {
        {
            let mut streak = self.streak_start.lock();
            match *streak {
                None => *streak = Some(Instant::now()),
                Some(s) if started < s => return,
                Some(_) => {}
            }
        }
        self.failure();
    }

    /// Records a transient failure (counted unconditionally); opens the
    /// breaker at the threshold.
    pub fn failure(&self) {
        let n = self
            .failures
            .fetch_add(1, Ordering::AcqRel)
            .saturating_add(1);
        if n == self.threshold {
            tracing::warn!(
                failures = n,
                probe_interval_ms =
                    u64::try_from(self.probe_interval.as_millis()).unwrap_or(u64::MAX),
                "Redis keeps failing; circuit breaker open, answering at once until a probe succeeds"
            );
            metrics::gauge!(crate::metrics::REDIS_CIRCUIT_OPEN).set(1.0);
            *self.next_probe.lock() = Some(Instant::now() + self.probe_interval);
        }
    }

    /// Whether the breaker is open now.
    #[must_use]
    pub fn is_open(&self) -> bool {
        self.failures.load(Ordering::Acquire) >= self.threshold
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_in_flight_together_count_once() {
        let b = CircuitBreaker::new(3, Duration::from_millis(30));
        let before = Instant::now();
        std::thread::sleep(Duration::from_millis(2));
        for _ in 0..10 {
            b.failure_of_call_started(before);
        }
        assert!(!b.is_open(), "one spike is one observation");
        b.failure_of_call_started(Instant::now());
        b.failure_of_call_started(Instant::now());
        assert!(b.is_open(), "later calls failing too");
        b.success();
        b.failure_of_call_started(before);
        assert!(!b.is_open());
    }

    #[test]
    fn opens_probes_and_closes() {
        let b = CircuitBreaker::new(2, Duration::from_millis(30));
        assert!(b.allow());
        b.failure();
        assert!(b.allow());
        b.failure();
        assert!(b.is_open());
        assert!(!b.allow());
        std::thread::sleep(Duration::from_millis(40));
        assert!(b.allow(), "one probe after the interval");
        assert!(!b.allow(), "only one");
        b.success();
        assert!(!b.is_open());
        assert!(b.allow());
    }
}
