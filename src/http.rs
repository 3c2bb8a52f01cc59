//! HTTP admin API on the admin port.
//!
//! Endpoints:
//! - `GET /healthcheck`: 200 `OK` when a config is loaded and storage answers,
//!   503 with a short reason otherwise.

use crate::service::Limiter;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use std::sync::Arc;

/// Builds the admin router (tests call it without a socket).
pub fn router(limiter: Arc<Limiter>) -> Router {
    Router::new()
        .route("/healthcheck", get(healthcheck))
        .with_state(limiter)
}

async fn healthcheck(State(limiter): State<Arc<Limiter>>) -> (StatusCode, String) {
    match limiter.storage().ping().await {
        Ok(()) => (StatusCode::OK, "OK\n".into()),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("storage unavailable: {e}\n"),
        ),
    }
}
