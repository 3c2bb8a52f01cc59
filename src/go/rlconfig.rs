//! The Go service's debug port (`--debug-addr`, the Go service's
//! `DEBUG_HOST`/`DEBUG_PORT`): its [`router`] and the plain-text
//! `/rlconfig` it answers ([`rlconfig_text`]), read by
//! `egctl config envoy-ratelimit`.

use crate::config::{Config, Policy};
use crate::limiter::Limiter;
use crate::storage::AlgorithmKind;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use std::sync::Arc;

/// The endpoints of the Go debug port, as `GET /` lists them.
const DEBUG_ENDPOINTS: &str = "/rlconfig: the config in force, one rule per line\n";

/// The router of the Go debug port: `GET /rlconfig` answers the config in
/// force as plain text ([`rlconfig_text`]); `GET /` lists the endpoints, and
/// an unknown path answers 404 with the same list.
pub fn router(limiter: Arc<Limiter>) -> Router {
    Router::new()
        .route("/", get(|| async { DEBUG_ENDPOINTS }))
        .route(
            "/rlconfig",
            get(|State(limiter): State<Arc<Limiter>>| async move {
                rlconfig_text(&limiter.config())
            }),
        )
        .fallback(|| async { (StatusCode::NOT_FOUND, DEBUG_ENDPOINTS) })
        .with_state(limiter)
}

/// The Go debug port's `/rlconfig`: one line per rule, in path order,
/// `<path>: unit=<UNIT> requests_per_unit=<n>, shadow_mode: <bool>` (the
/// Go service's line, for a fixed window; a token bucket has bucket-rls's
/// `burst=<n>` after the rate, another algorithm `algorithm=<name>`), or
/// `<path>: unlimited, shadow_mode: <bool>`.
#[must_use]
pub fn rlconfig_text(config: &Config) -> String {
    let mut lines: Vec<String> = config
        .domains
        .values()
        .flat_map(|d| d.rules.iter())
        .map(|r| match &r.policy {
            Policy::Unlimited => format!("{}: unlimited, shadow_mode: {}", r.path, r.shadow_mode),
            Policy::Limited {
                requests_per_unit,
                unit,
                burst,
                algorithm,
                ..
            } => {
                let extra = match algorithm {
                    AlgorithmKind::TokenBucket => format!(" burst={burst}"),
                    AlgorithmKind::FixedWindow => String::new(),
                    AlgorithmKind::SlidingWindow => " algorithm=sliding_window".to_owned(),
                };
                format!(
                    "{}: unit={} requests_per_unit={requests_per_unit}{extra}, shadow_mode: {}",
                    r.path,
                    unit.as_str().to_ascii_uppercase(),
                    r.shadow_mode
                )
            }
        })
        .collect();
    lines.sort();
    let mut out = lines.join("\n");
    out.push('\n');
    out
}
