//! HTTP admin API on the admin port (default `0.0.0.0:8080`).
//!
//! Endpoints:
//! - `GET /healthcheck`: 200 `OK` when a probe charge
//!   works within [`HEALTH_PING_TIMEOUT`] ([`Limiter::check_charges`]: a
//!   real write on a single node or through Sentinel, so `READONLY` and
//!   `OOM` fail it; a ping of any node on a Cluster); 503 with a short
//!   reason otherwise. It does not wait for a first xDS config.
//! - `GET /livez`: 200 `OK` whenever the process answers HTTP at all; it never
//!   looks at storage, so a Kubernetes liveness probe on it does not restart
//!   every replica during a Redis outage (docs/design.md, "Storage failures"). Use `/healthcheck` for readiness.
//! - `GET /metrics`: Prometheus text exposition (names and labels in the
//!   README and [`crate::metrics`]), plus the identity of the config in force
//!   (`bucket_rls_config_info{hash}`, `bucket_rls_config_load_timestamp_seconds`).
//! - `GET /rlconfig`: JSON: the config in force (domains and rules with rates,
//!   bursts, units, debt bounds, names, shadow and quota flags, metadata,
//!   `replaces`), its hash and load time, the service-wide modes, the last
//!   reload error, the storage backend name and the config source (`file`
//!   or `xds`; for xDS whether it is connected, the version in force and the
//!   last push's outcome and error).
//! - `GET /rlqs`: JSON: the quota (RLQS) streams open on this replica,
//!   `{"streams": [{subscriber, domain, buckets: {"key=value,...": {rule,
//!   demand, assignment, subscribers: [{id, demand, tokens_per_fill,
//!   max_tokens}], balance}}}]}`; demands in requests a second (null until
//!   a subscriber's second report: its first measures nothing), the
//!   balance in tokens.
//! - `POST /json`: one `ShouldRateLimit` call with a `RateLimitRequest` in
//!   protobuf JSON ([`json`]): 200 with the `RateLimitResponse` when the
//!   overall code is `OK`, 429 with it when `OVER_LIMIT`, 400
//!   `{"error": "..."}` for a malformed request, 415 for a `Content-Type`
//!   other than `application/json` (a browser's cross-site `text/plain` or
//!   form post), 503 when storage is unavailable. A descriptor with
//!   `hitsAddend` 0 reads its bucket without charging it.
//! - `POST /reset`: the same request body as `/json`; makes full every
//!   bucket its descriptors map to ([`Limiter::reset`]: the same rules,
//!   `replaces` and overrides as a `ShouldRateLimit` call) and answers 200
//!   with [`crate::limiter::reset::ResetOutcome`] (`{"domain", "reset":
//!   [{descriptor, rule, name, byOverride, bucket, wasDrained}],
//!   "notReset": [{descriptor, reason}]}`); one audit log line and
//!   `bucket_rls_bucket_resets_total` per call; the errors of `/json`.
//!
//! The router is built by [`router`] so tests call it without a socket; the
//! `/rlconfig` body is [`rlconfig::RlConfig`], the one type that
//! `check-config --diff` also reads.

pub mod json;
pub mod rlconfig;

use crate::limiter::{Code, DecideError, Limiter};
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long `/healthcheck` waits for the storage ping.
pub const HEALTH_PING_TIMEOUT: Duration = Duration::from_secs(1);

/// Builds the admin router (tests call it without a socket). Installs the
/// process-wide metrics recorder if nothing did yet.
pub fn router(limiter: Arc<Limiter>) -> Router {
    router_with(limiter, None)
}

/// [`router`] with a shared health state: with [`HealthMode::Go`],
/// `/healthcheck` answers with the Go service's semantics
/// ([`crate::go::health::Health::check_go`]): 200 `OK`, or 500 with the reason.
///
/// [`HealthMode::Go`]: crate::settings::HealthMode::Go
pub fn router_with(
    limiter: Arc<Limiter>,
    health: Option<Arc<crate::go::health::Health>>,
) -> Router {
    crate::metrics::install();
    let healthcheck = match health {
        Some(h) if matches!(h.mode(), crate::settings::HealthMode::Go { .. }) => {
            get(move |State(limiter): State<Arc<Limiter>>| async move {
                match h.check_go(&limiter).await {
                    Ok(()) => (StatusCode::OK, "OK".to_owned()),
                    Err(why) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{why}\n")),
                }
            })
        }
        _ => get(healthcheck),
    };
    Router::new()
        .route("/healthcheck", healthcheck)
        .route("/livez", get(livez))
        .route("/metrics", get(metrics))
        .route("/rlconfig", get(rlconfig))
        .route("/rlqs", get(rlqs))
        .route("/json", post(json))
        .route("/reset", post(reset))
        .route_layer(axum::middleware::from_fn(within_request_budget))
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .with_state(limiter)
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    let allowed = if matches!(uri.path(), "/json" | "/reset") {
        "POST"
    } else {
        "GET"
    };
    let mut r = error(
        StatusCode::METHOD_NOT_ALLOWED,
        &format!("{method} is not allowed on {}; use {allowed}", uri.path()),
    );
    if let Ok(v) = header::HeaderValue::from_str(allowed) {
        r.headers_mut().insert(header::ALLOW, v);
    }
    r
}

async fn not_found(uri: axum::http::Uri) -> Response {
    error(
        StatusCode::NOT_FOUND,
        &format!(
            "no endpoint {}; endpoints: /healthcheck, /livez, /metrics, /rlconfig, /rlqs (GET), /json, /reset (POST)",
            uri.path()
        ),
    )
}

async fn livez() -> &'static str {
    "OK\n"
}

async fn healthcheck(State(limiter): State<Arc<Limiter>>) -> (StatusCode, String) {
    match tokio::time::timeout(HEALTH_PING_TIMEOUT, limiter.check_charges()).await {
        Ok(Ok(())) => (StatusCode::OK, "OK\n".into()),
        Ok(Err(e)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("storage unavailable: {e}\n"),
        ),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "storage unavailable: no answer to the health probe within {HEALTH_PING_TIMEOUT:?}\n"
            ),
        ),
    }
}

async fn metrics(State(limiter): State<Arc<Limiter>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        {
            let config = limiter.config();
            let source = limiter.config_handle().source_status();
            let xds_version =
                (source.kind == "xds").then(|| source.version.as_deref().unwrap_or(""));
            let mut out =
                crate::metrics::render_native(&config.hash, config.loaded_at, xds_version);
            let rules: Vec<(&str, usize)> = config
                .rules_by_algorithm()
                .into_iter()
                .map(|(k, n)| (k.as_str(), n))
                .collect();
            out.push_str(&crate::metrics::render_rules(&rules));
            out
        },
    )
        .into_response()
}

/// `GET /rlqs`: the open quota streams of this replica, each with its
/// buckets (rule, demand, the assignment sent last, and every live
/// subscriber of the rule's bucket with its demand and assignment).
async fn rlqs(State(limiter): State<Arc<Limiter>>) -> Response {
    json_response(
        StatusCode::OK,
        &serde_json::json!({ "streams": limiter.quotas().view() }),
    )
}

async fn rlconfig(State(limiter): State<Arc<Limiter>>) -> Response {
    let view = rlconfig::RlConfig::of(&limiter.config(), &limiter);
    json_response(StatusCode::OK, &view)
}

/// Whether a `/json` or `/reset` request's `Content-Type` is acceptable: absent, or
/// `application/json` (any parameters). The types a browser may send
/// cross-site without asking first (`text/plain`, forms) are refused, so a
/// web page cannot spend a client's budget through a visitor's browser.
fn json_content_type_ok(path: &str, headers: &axum::http::HeaderMap) -> Result<(), String> {
    let Some(v) = headers.get(header::CONTENT_TYPE) else {
        return Ok(());
    };
    let mime = v
        .to_str()
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim();
    if mime.eq_ignore_ascii_case("application/json") {
        Ok(())
    } else {
        let shown: String = mime.chars().take(64).collect();
        Err(format!(
            "POST {path} takes Content-Type: application/json, not {shown:?} (curl: -H 'content-type: application/json')"
        ))
    }
}

/// The largest request body the admin port reads (axum's default body
/// limit, 2 MiB).
const BODY_LIMIT_BYTES: usize = 2 << 20;

/// Reserves a request's body bytes of the process-wide request budget
/// ([`crate::conn_limit::reserve_request_bytes`]) before the body is read:
/// its `Content-Length` (at most the body limit), the body limit for a body
/// of unknown length, nothing for a request without a body. 503 when the
/// budget cannot hold it; the reservation is given back with the response.
async fn within_request_budget(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let bytes = match declared {
        Some(n) => n.min(BODY_LIMIT_BYTES),
        None if req.headers().contains_key(header::TRANSFER_ENCODING) => BODY_LIMIT_BYTES,
        None => 0,
    };
    let Some(_held) = crate::conn_limit::reserve_request_bytes(bytes) else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the service's memory budget for requests being read is used up; retry later",
        );
    };
    next.run(req).await
}

/// The request body of `/json` and `/reset`: its `Content-Type` checked,
/// read whole and parsed; the error status and message otherwise.
fn json_request(
    path: &str,
    headers: &axum::http::HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<json::JsonRequest, (StatusCode, String)> {
    json_content_type_ok(path, headers).map_err(|msg| (StatusCode::UNSUPPORTED_MEDIA_TYPE, msg))?;
    // A body over the limit (413) or one that fails to arrive: the same JSON
    // error shape as every other answer.
    let body = body.map_err(|r| (r.status(), r.body_text()))?;
    json::JsonRequest::parse(&body).map_err(|msg| (StatusCode::BAD_REQUEST, msg))
}

/// The error response of a [`DecideError`]: 400 or 503.
fn decide_error(e: &DecideError) -> Response {
    let code = match e {
        DecideError::Invalid(_) => StatusCode::BAD_REQUEST,
        DecideError::Storage(_) | DecideError::NoConfig => StatusCode::SERVICE_UNAVAILABLE,
    };
    error(code, &e.to_string())
}

async fn json(
    State(limiter): State<Arc<Limiter>>,
    headers: axum::http::HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let req = match json_request("/json", &headers, body) {
        Ok(r) => r,
        Err((code, msg)) => return error(code, &msg),
    };
    match limiter.decide(&req.to_request()).await {
        Ok(decision) => {
            let code = if decision.overall_code == Code::OverLimit {
                StatusCode::TOO_MANY_REQUESTS
            } else {
                StatusCode::OK
            };
            json_response(code, &json::JsonResponse::from_decision(&decision))
        }
        Err(e) => decide_error(&e),
    }
}

/// `POST /reset`: makes full the buckets of the request's descriptors.
async fn reset(
    State(limiter): State<Arc<Limiter>>,
    headers: axum::http::HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let req = match json_request("/reset", &headers, body) {
        Ok(r) => r,
        Err((code, msg)) => return error(code, &msg),
    };
    match limiter.reset(&req.to_request()).await {
        Ok(outcome) => json_response(StatusCode::OK, &outcome),
        Err(e) => decide_error(&e),
    }
}

fn json_response(code: StatusCode, body: &impl Serialize) -> Response {
    match serde_json::to_vec(body) {
        Ok(bytes) => (code, [(header::CONTENT_TYPE, "application/json")], bytes).into_response(),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    }
}

fn error(code: StatusCode, message: &str) -> Response {
    let body = serde_json::json!({ "error": message }).to_string();
    (code, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// Formats `t` as RFC 3339 UTC with milliseconds (`2024-01-31T12:00:00.123Z`).
#[must_use]
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3_600,
        rem % 3_600 / 60,
        rem % 60,
        d.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::rfc3339;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn rfc3339_formats_known_instants() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_709_210_096_789);
        assert_eq!(rfc3339(t), "2024-02-29T12:34:56.789Z");
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(t), "2000-02-29T00:00:00.000Z");
    }
}
