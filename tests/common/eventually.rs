//! Waiting for a condition with a deadline, the one way tests wait: poll,
//! and fail with a message naming what never happened. Tests never sleep for
//! a fixed time to let something happen, except where "nothing more happens"
//! is the claim.

use std::future::Future;
use std::time::{Duration, Instant};

/// How often [`eventually`] checks.
const ASYNC_PERIOD: Duration = Duration::from_millis(10);
/// How often [`eventually_blocking`] checks (its checks start processes or
/// query Redis, so less often).
const BLOCKING_PERIOD: Duration = Duration::from_millis(50);

/// Polls `check` every 10 ms until it returns `Some`, or panics after
/// `deadline` with `what`. Returns the value and the time it took.
pub async fn eventually<T, F, Fut>(deadline: Duration, what: &str, mut check: F) -> (T, Duration)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return (v, start.elapsed());
        }
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what}"
        );
        tokio::time::sleep(ASYNC_PERIOD).await;
    }
}

/// [`eventually`] for synchronous setup code (starting clusters and
/// Sentinels): polls `check` every 50 ms on this thread until it holds, or
/// panics after `deadline` with `what`. Inside a tokio runtime, call it from
/// `spawn_blocking` or `block_in_place`.
pub fn eventually_blocking(deadline: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what}"
        );
        std::thread::sleep(BLOCKING_PERIOD);
    }
}
