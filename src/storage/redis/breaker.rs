//! Circuit breaker: after `threshold` consecutive transient failures, calls
//! fail at once with [`StorageError::CircuitOpen`](crate::storage::StorageError)
//! instead of each waiting for the Redis timeout (see `docs/design.md`, "Storage
//! failures"). While open, one call
//! per `probe_interval` is let through as a probe; the first success (of a
//! probe, or of a health-check ping) closes the breaker.
//!
//! Only failures of calls *started after the failing began* count (see
//! [`CircuitBreaker::failure_of_call_started`]): when one latency spike makes
//! all the calls in flight time out together, that is one observation, not
//! `threshold` of them, so a short stall under load does not turn into an
//! outage of `probe_interval`. A Redis that is really down fails the calls
//! that follow too, and the breaker opens after `threshold` of them.
//!
//! Time comes from an injected clock (the monotonic clock in production), so
//! the unit tests move time by hand instead of sleeping.

use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A run of failures at least this long is logged when it ends, also when
/// it never opened the breaker.
pub const LOG_RECOVERY_AFTER: Duration = Duration::from_secs(1);

/// Where the breaker reads the time: [`Instant::now`] in production.
type Now = Arc<dyn Fn() -> Instant + Send + Sync>;

/// A consecutive-failure circuit breaker, shared by all calls to one node.
pub struct CircuitBreaker {
    threshold: u32,
    probe_interval: Duration,
    now: Now,
    failures: AtomicU32,
    /// While open: when the next probe may go through.
    next_probe: Mutex<Option<Instant>>,
    /// When the current run of failures began (`None` after a success).
    streak_start: Mutex<Option<Instant>>,
}

impl std::fmt::Debug for CircuitBreaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CircuitBreaker")
            .field("threshold", &self.threshold)
            .field("probe_interval", &self.probe_interval)
            .field("failures", &self.failures)
            .field("next_probe", &self.next_probe)
            .field("streak_start", &self.streak_start)
            .finish_non_exhaustive()
    }
}

impl CircuitBreaker {
    /// A closed breaker that opens after `threshold` consecutive failures
    /// (at least 1) and then lets one probe through per `probe_interval`.
    #[must_use]
    pub fn new(threshold: u32, probe_interval: Duration) -> Self {
        Self {
            threshold: threshold.max(1),
            probe_interval,
            now: Arc::new(Instant::now),
            failures: AtomicU32::new(0),
            next_probe: Mutex::new(None),
            streak_start: Mutex::new(None),
        }
    }

    /// Like [`CircuitBreaker::new`], reading the time from `now`.
    #[cfg(test)]
    fn with_clock(threshold: u32, probe_interval: Duration, now: Now) -> Self {
        Self {
            now,
            ..Self::new(threshold, probe_interval)
        }
    }

    /// Whether a call may go to Redis now: always while closed; while open,
    /// only the first caller after each `probe_interval` (the probe).
    #[must_use]
    pub fn allow(&self) -> bool {
        if self.failures.load(Ordering::Acquire) < self.threshold {
            return true;
        }
        let now = (self.now)();
        let mut next = self.next_probe.lock();
        match *next {
            Some(t) if now < t => false,
            _ => {
                *next = Some(now + self.probe_interval);
                true
            }
        }
    }

    /// Records a success: closes the breaker. After a run of failures the
    /// recovery is logged with the outage's length (from the first failure
    /// of the run): always when the breaker was open, else when the run
    /// lasted at least [`LOG_RECOVERY_AFTER`] (shorter blips stay quiet; the
    /// error metrics count them).
    pub fn success(&self) {
        let failures = self.failures.swap(0, Ordering::AcqRel);
        if failures == 0 {
            return;
        }
        *self.next_probe.lock() = None;
        let began = self.streak_start.lock().take();
        let outage = began.map(|b| (self.now)().saturating_duration_since(b));
        let outage_ms = outage.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        if failures >= self.threshold {
            tracing::info!(
                outage_ms,
                failures,
                "Redis answers again; circuit breaker closed"
            );
            metrics::gauge!(crate::metrics::REDIS_CIRCUIT_OPEN).set(0.0);
        } else if outage.is_some_and(|d| d >= LOG_RECOVERY_AFTER) {
            tracing::info!(
                outage_ms,
                failures,
                "Redis answers again after failing calls"
            );
        }
    }

    /// Records a transient failure of a call sent at `started`. It counts
    /// only if the call started after the current run of failures began (the
    /// first failure of a run always counts and starts it): calls that were
    /// already in flight when Redis stalled add no evidence.
    pub fn failure_of_call_started(&self, started: Instant) {
        {
            let mut streak = self.streak_start.lock();
            match *streak {
                None => *streak = Some((self.now)()),
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
            *self.next_probe.lock() = Some((self.now)() + self.probe_interval);
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

    /// A clock that moves only when told to, and a breaker reading it.
    fn manual(threshold: u32, probe_interval: Duration) -> (CircuitBreaker, ManualTime) {
        let t = ManualTime(Arc::new(Mutex::new(Instant::now())));
        let read = t.clone();
        let b = CircuitBreaker::with_clock(threshold, probe_interval, Arc::new(move || read.now()));
        (b, t)
    }

    #[derive(Clone)]
    struct ManualTime(Arc<Mutex<Instant>>);

    impl ManualTime {
        fn now(&self) -> Instant {
            *self.0.lock()
        }
        fn advance(&self, d: Duration) {
            *self.0.lock() += d;
        }
    }

    fn logged(f: impl FnOnce()) -> String {
        crate::test_log::logged(tracing::Level::INFO, f)
    }

    #[test]
    fn recovery_is_logged_with_the_outage_length() {
        let (b, t) = manual(2, Duration::from_millis(100));
        let log = logged(|| {
            b.failure_of_call_started(t.now());
            t.advance(Duration::from_millis(10));
            b.failure_of_call_started(t.now());
            assert!(b.is_open());
            t.advance(Duration::from_millis(2_490));
            b.success();
        });
        assert!(!b.is_open());
        assert!(
            log.contains("Redis answers again; circuit breaker closed"),
            "{log}"
        );
        assert!(log.contains("outage_ms=2500"), "{log}");
        // A short blip below the threshold stays quiet; a long one is logged.
        let (b, t) = manual(5, Duration::from_millis(100));
        let quiet = logged(|| {
            b.failure_of_call_started(t.now());
            t.advance(Duration::from_millis(200));
            b.success();
        });
        assert_eq!(quiet, "");
        let long = logged(|| {
            b.failure_of_call_started(t.now());
            t.advance(Duration::from_millis(1_500));
            b.success();
            b.success();
        });
        assert_eq!(
            long.matches("Redis answers again after failing calls")
                .count(),
            1,
            "{long}"
        );
        assert!(long.contains("outage_ms=1500"), "{long}");
    }

    #[test]
    fn calls_in_flight_together_count_once() {
        let (b, t) = manual(3, Duration::from_millis(30));
        let before = t.now();
        t.advance(Duration::from_millis(2));
        for _ in 0..10 {
            b.failure_of_call_started(before);
        }
        assert!(!b.is_open(), "one spike is one observation");
        t.advance(Duration::from_millis(1));
        b.failure_of_call_started(t.now());
        b.failure_of_call_started(t.now());
        assert!(b.is_open(), "later calls failing too");
        b.success();
        b.failure_of_call_started(before);
        assert!(!b.is_open());
    }

    #[test]
    fn opens_probes_and_closes() {
        let (b, t) = manual(2, Duration::from_millis(30));
        assert!(b.allow());
        b.failure();
        assert!(b.allow());
        b.failure();
        assert!(b.is_open());
        assert!(!b.allow());
        t.advance(Duration::from_millis(29));
        assert!(!b.allow(), "no probe before the interval");
        t.advance(Duration::from_millis(1));
        assert!(b.allow(), "one probe after the interval");
        assert!(!b.allow(), "only one");
        t.advance(Duration::from_millis(29));
        assert!(!b.allow(), "the next probe waits a whole interval");
        t.advance(Duration::from_millis(1));
        assert!(b.allow(), "the next probe");
        b.success();
        assert!(!b.is_open());
        assert!(b.allow());
    }

    #[test]
    fn the_real_clock_is_the_default() {
        let b = CircuitBreaker::new(1, Duration::from_secs(3600));
        b.failure();
        assert!(b.is_open());
        assert!(!b.allow(), "the first probe is an hour away");
    }
}
