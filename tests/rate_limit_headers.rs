//! Optional `RateLimit` headers (`--rate-limit-headers`), computed from the most
//! restrictive status as Envoy does (BR-19).

mod common;

use bucket_rls::limiter::clock::ManualClock;
use bucket_rls::limiter::memory::MemoryStorage;
use bucket_rls::service::Limiter;
use bucket_rls::settings::{RateLimitHeaders, ServiceSettings};
use common::{config, desc, req};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use std::sync::Arc;
use std::time::Duration;

const LLM: &str = "domain: llm\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 60}\n  - key: spend\n    rate_limit: {name: spend, unit: hour, requests_per_unit: 5}\n";

fn headers(r: &RateLimitResponse) -> Vec<(String, String)> {
    r.response_headers_to_add
        .iter()
        .map(|h| (h.key.clone(), h.value.clone()))
        .collect()
}

async fn br_19_third_call(mode: RateLimitHeaders) -> RateLimitResponse {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let settings = ServiceSettings {
        rate_limit_headers: mode,
        ..ServiceSettings::default()
    };
    let l = Limiter::new(
        config(&[("llm.yaml", LLM)]),
        Arc::new(MemoryStorage::new(Arc::new(clock.clone()))),
        settings,
    );
    l.should_rate_limit(&req("llm", vec![desc(&[("user", "u1")])], 1))
        .await
        .expect("ok");
    for _ in 0..5 {
        l.should_rate_limit(&req("llm", vec![desc(&[("spend", "u1")])], 1))
            .await
            .expect("ok");
    }
    clock.advance(Duration::from_millis(500));
    l.should_rate_limit(&req(
        "llm",
        vec![desc(&[("user", "u1")]), desc(&[("spend", "u1")])],
        1,
    ))
    .await
    .expect("ok")
}

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

#[tokio::test]
async fn off_by_default_only_retry_after() {
    let r = br_19_third_call(RateLimitHeaders::Off).await;
    assert_eq!(headers(&r), pairs(&[("retry-after", "720")]));
}

#[tokio::test]
async fn draft03_headers_describe_the_denying_limit() {
    let r = br_19_third_call(RateLimitHeaders::Draft03).await;
    assert_eq!(
        headers(&r),
        pairs(&[
            ("retry-after", "720"),
            ("ratelimit-limit", "5, 60;w=60, 5;w=3600"),
            ("ratelimit-remaining", "0"),
            ("ratelimit-reset", "720"),
        ])
    );
}

#[tokio::test]
async fn ietf_headers_name_the_policies() {
    let r = br_19_third_call(RateLimitHeaders::Ietf).await;
    assert_eq!(
        headers(&r),
        pairs(&[
            ("retry-after", "720"),
            (
                "ratelimit-policy",
                "\"limit0\";q=60;w=60, \"spend\";q=5;w=3600"
            ),
            ("ratelimit", "\"spend\";r=0;t=720"),
        ])
    );
}
