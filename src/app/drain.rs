//! Shutdown: health turns NOT_SERVING, an optional delay while every port
//! keeps serving (so load balancers see the change first), then every
//! quota (RLQS) stream sends TTL-0 assignments and closes, the ports stop
//! accepting and in-flight requests get a grace period.

use super::HEALTH_SERVICE_NAMES;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{broadcast, oneshot};

/// Waits for `shutdown`, marks `health` draining and every gRPC health name
/// NOT_SERVING, waits `delay`, then closes the quota streams of `limiter`
/// (TTL-0 assignments first), tells the ports to stop (`stop`) and returns
/// the moment the drain started through `draining`.
pub(super) fn spawn(
    shutdown: impl Future<Output = ()> + Send + 'static,
    limiter: Arc<crate::limiter::Limiter>,
    health: Option<Arc<crate::go::health::Health>>,
    reporter: tonic_health::server::HealthReporter,
    delay: Duration,
    stop: broadcast::Sender<()>,
    draining: oneshot::Sender<()>,
) {
    tokio::spawn(async move {
        shutdown.await;
        if let Some(h) = &health {
            h.set_draining();
        }
        for name in HEALTH_SERVICE_NAMES
            .into_iter()
            .chain([crate::grpc::reflection::RATE_LIMIT_SERVICE])
        {
            reporter
                .set_service_status(name, tonic_health::ServingStatus::NotServing)
                .await;
        }
        if !delay.is_zero() {
            tracing::info!(
                shutdown_delay = ?delay,
                "shutting down: reporting unhealthy before draining"
            );
            tokio::time::sleep(delay).await;
        }
        tracing::info!("shutting down: draining in-flight requests");
        limiter.quotas().close_all();
        let _ = stop.send(());
        let _ = draining.send(());
    });
}

/// Resolves `grace` after the drain started; never when it does not (the
/// sender was dropped without a drain).
pub(super) async fn deadline(draining: oneshot::Receiver<()>, grace: Duration) {
    if draining.await.is_ok() {
        tokio::time::sleep(grace).await;
    } else {
        std::future::pending::<()>().await;
    }
}
