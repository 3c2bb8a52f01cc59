//! The background tasks of a serving process: storage and metrics upkeep,
//! the gRPC certificate reloader, and the Go health follower. They run
//! until [`Tasks`] is dropped.

use crate::limiter::Limiter;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;

/// How often the storage's housekeeping (e.g. memory bucket eviction) and
/// the metrics upkeep (draining histogram samples) run.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(5);

/// How often the `ratelimit` gRPC health status is brought in line with
/// the Go health state ([`crate::go::health::Health::check_go`]).
pub const GO_HEALTH_INTERVAL: Duration = Duration::from_secs(1);

/// Running background tasks, aborted when dropped.
#[derive(Debug, Default)]
pub(super) struct Tasks(Vec<JoinHandle<()>>);

impl Tasks {
    /// Keeps `task` until the set is dropped.
    pub(super) fn push(&mut self, task: JoinHandle<()>) {
        self.0.push(task);
    }
}

impl Drop for Tasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// Every [`SWEEP_INTERVAL`]: the storage's sweep and the metrics upkeep,
/// off the async workers (sweeping a million buckets takes tens of
/// milliseconds, which requests queued on the worker would wait).
pub(super) fn sweeper(limiter: Arc<Limiter>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(SWEEP_INTERVAL);
        loop {
            tick.tick().await;
            let l = limiter.clone();
            let _ = tokio::task::spawn_blocking(move || {
                l.storage().sweep();
                crate::metrics::upkeep();
            })
            .await;
        }
    })
}

/// Go health: the `ratelimit` gRPC health name follows `/healthcheck`
/// ([`crate::go::health::Health::check_go`]) every [`GO_HEALTH_INTERVAL`] until
/// the process drains.
pub(super) fn go_health(
    health: Arc<crate::go::health::Health>,
    reporter: tonic_health::server::HealthReporter,
    limiter: Arc<Limiter>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(GO_HEALTH_INTERVAL);
        let mut last = None;
        while !health.is_draining() {
            tick.tick().await;
            let status = match health.check_go(&limiter).await {
                Ok(()) => tonic_health::ServingStatus::Serving,
                Err(_) => tonic_health::ServingStatus::NotServing,
            };
            if last != Some(status) && !health.is_draining() {
                reporter.set_service_status("ratelimit", status).await;
                last = Some(status);
            }
        }
    })
}
