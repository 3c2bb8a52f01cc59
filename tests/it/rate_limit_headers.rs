//! Optional `RateLimit` headers (`--rate-limit-headers`), computed from the most
//! restrictive status as Envoy does (docs/cases.md, "The denying status drives
//! the headers").

use crate::common::{config, desc, req};
use bucket_rls::grpc::ShouldRateLimit as _;
use bucket_rls::limiter::Limiter;
use bucket_rls::settings::{RateLimitHeaders, ServiceSettings};
use bucket_rls::storage::clock::ManualClock;
use bucket_rls::storage::memory::MemoryStorage;
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

async fn denied_by_spend_call(mode: RateLimitHeaders) -> RateLimitResponse {
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
    let r = denied_by_spend_call(RateLimitHeaders::Off).await;
    assert_eq!(headers(&r), pairs(&[("retry-after", "720")]));
}

#[tokio::test]
async fn draft03_headers_describe_the_denying_limit() {
    let r = denied_by_spend_call(RateLimitHeaders::Draft03).await;
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
    let r = denied_by_spend_call(RateLimitHeaders::Ietf).await;
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

const MIXED: &str = "domain: mx\ndescriptors:\n  - key: rt\n    rate_limit: {unit: minute, requests_per_unit: 20, burst: 1}\n  - key: z\n    rate_limit: {name: zero, unit: hour, requests_per_unit: 0}\n  - key: sm\n    shadow_mode: true\n    rate_limit: {name: shadow, unit: minute, requests_per_unit: 60, burst: 1}\n";

async fn mixed(mode: RateLimitHeaders) -> Limiter {
    let settings = ServiceSettings {
        rate_limit_headers: mode,
        ..ServiceSettings::default()
    };
    Limiter::new(
        config(&[("mx.yaml", MIXED)]),
        Arc::new(MemoryStorage::new(Arc::new(ManualClock::new(
            1_700_000_000_000_000,
        )))),
        settings,
    )
}

/// One call to domain `mx`, one descriptor `[k=v]` per pair.
async fn call(l: &Limiter, pairs: &[(&str, &str)]) -> RateLimitResponse {
    let descs = pairs.iter().map(|p| desc(&[*p])).collect();
    l.should_rate_limit(&req("mx", descs, 1)).await.expect("ok")
}

/// Two denials (3 s and a rate-0 rule's 3600 s): the headers describe the
/// one `retry-after` reports, so they never contradict it.
#[tokio::test]
async fn over_limit_headers_agree_with_retry_after() {
    let l = mixed(RateLimitHeaders::Draft03).await;
    call(&l, &[("rt", "a")]).await;
    let r = call(&l, &[("rt", "a"), ("z", "a")]).await;
    assert_eq!(
        headers(&r),
        pairs(&[
            ("retry-after", "3600"),
            ("ratelimit-limit", "0, 20;w=60, 0;w=3600"),
            ("ratelimit-remaining", "0"),
            ("ratelimit-reset", "3600"),
        ])
    );
}

/// Shadow rules never deny, so they are never announced to clients, on a
/// 200 or on a 429.
#[tokio::test]
async fn shadow_rules_are_not_announced() {
    let l = mixed(RateLimitHeaders::Ietf).await;
    for _ in 0..2 {
        call(&l, &[("sm", "a")]).await;
    }
    let r = call(&l, &[("sm", "a"), ("rt", "b")]).await;
    assert_eq!(
        headers(&r),
        pairs(&[
            ("ratelimit-policy", "\"limit1\";q=20;w=60"),
            ("ratelimit", "\"limit1\";r=0;t=3"),
        ])
    );
    let r = call(&l, &[("sm", "a"), ("rt", "b")]).await;
    assert_eq!(
        headers(&r),
        pairs(&[
            ("retry-after", "3"),
            ("ratelimit-policy", "\"limit1\";q=20;w=60"),
            ("ratelimit", "\"limit1\";r=0;t=3"),
        ])
    );
}

/// `--rate-limit-headers go` sends the Go service's headers: its default
/// names, or the configured ones, and `RateLimit-Limit` as the bare number
/// (no `;w=` policy list as draft 03 has).
#[tokio::test]
async fn go_headers_use_the_go_names_and_the_bare_limit() {
    let r = denied_by_spend_call(RateLimitHeaders::Go).await;
    let h = headers(&r);
    assert!(h.contains(&("RateLimit-Limit".into(), "5".into())), "{h:?}");
    assert!(
        h.contains(&("RateLimit-Remaining".into(), "0".into())),
        "{h:?}"
    );
    assert!(h.iter().any(|(k, _)| k == "RateLimit-Reset"), "{h:?}");
    assert!(h.iter().any(|(k, _)| k == "retry-after"), "{h:?}");

    let settings = ServiceSettings {
        rate_limit_headers: RateLimitHeaders::Go,
        header_names: bucket_rls::settings::HeaderNames {
            limit: "X-RL-Limit".into(),
            remaining: "X-RL-Left".into(),
            reset: "X-RL-Reset".into(),
        },
        ..ServiceSettings::default()
    };
    let clock = ManualClock::new(1_700_000_000_000_000);
    let l = Limiter::new(
        config(&[("llm.yaml", LLM)]),
        Arc::new(MemoryStorage::new(Arc::new(clock))),
        settings,
    );
    let r = l
        .should_rate_limit(&req("llm", vec![desc(&[("spend", "u2")])], 1))
        .await
        .expect("ok");
    assert_eq!(
        headers(&r),
        pairs(&[
            ("X-RL-Limit", "5"),
            ("X-RL-Left", "4"),
            ("X-RL-Reset", "720")
        ])
    );
}
