//! `/json` against cross-site posts: a browser may send `text/plain` and form
//! bodies to any origin without asking first, so those are refused and a web
//! page cannot spend a client's budget through a visitor's browser.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use bucket_rls::storage::clock::ManualClock;
use bucket_rls::storage::memory::MemoryStorage;
use std::sync::Arc;
use tower::ServiceExt;

const CONFIG: &str = "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";
const BODY: &str = r#"{"domain":"web","descriptors":[{"entries":[{"key":"user","value":"ann"}]}]}"#;

async fn post(router: &axum::Router, content_type: Option<&str>) -> (StatusCode, String) {
    let mut req = Request::post("/json");
    if let Some(t) = content_type {
        req = req.header("content-type", t);
    }
    let resp = router
        .clone()
        .oneshot(req.body(Body::from(BODY)).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

#[tokio::test]
async fn json_refuses_bodies_a_browser_can_post_cross_site() {
    let storage = Arc::new(MemoryStorage::new(Arc::new(ManualClock::new(1_000_000))));
    let l = crate::common::limiter(CONFIG, storage, "");
    let router = bucket_rls::http::router(l);
    for t in [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ] {
        let (status, body) = post(&router, Some(t)).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{t}: {body}");
        assert!(body.contains("application/json"), "{body}");
    }
    // None of those spent the one token of the hour.
    let (status, body) = post(&router, Some("application/json; charset=utf-8")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, _) = post(&router, None).await;
    assert_eq!(
        status,
        StatusCode::TOO_MANY_REQUESTS,
        "no Content-Type is accepted"
    );
}
