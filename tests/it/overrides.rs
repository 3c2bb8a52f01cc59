//! `limit` overrides: on a descriptor that matches no rule, what state it
//! creates and the setting that refuses to create any; on a rule, what it
//! takes from the rule (nothing: not its shadow mode, name or `replaces`).

use bucket_rls::grpc::ShouldRateLimit;
use bucket_rls::limiter::Limiter;
use bucket_rls::settings::ServiceSettings;
use bucket_rls::storage::clock::ManualClock;
use bucket_rls::storage::memory::MemoryStorage;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use std::sync::Arc;
use std::time::Duration;

const CONFIG: &str = "domain: ov\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 10}\n";

/// 100 requests, each with a unique unmatched descriptor and a 1-per-year
/// override (the attack: keys that live a year, at the request rate).
async fn flood(l: &Limiter) -> Vec<bool> {
    let mut limited = Vec::new();
    for i in 0..100 {
        let mut d = crate::common::desc(&[("path", &format!("/unique/{i}"))]);
        d.limit = Some(RateLimitOverride {
            requests_per_unit: 1,
            unit: RateLimitUnit::Year as i32,
        });
        let r = l
            .should_rate_limit(&crate::common::req("ov", vec![d], 1))
            .await
            .expect("answer");
        limited.push(r.statuses[0].current_limit.is_some());
    }
    limited
}

fn limiter(ignore: bool) -> (Arc<Limiter>, Arc<MemoryStorage>, ManualClock) {
    let clock = ManualClock::new(1_000_000);
    let storage = Arc::new(MemoryStorage::new(Arc::new(clock.clone())));
    let settings = ServiceSettings {
        ignore_unmatched_overrides: ignore,
        ..ServiceSettings::default()
    };
    let l = Limiter::new(
        crate::common::config(&[("ov.yaml", CONFIG)]),
        storage.clone(),
        settings,
    );
    (Arc::new(l), storage, clock)
}

/// By default (as the Go service) each unmatched override gets a bucket,
/// held until it is full again: one unit of the override, never longer.
#[tokio::test]
async fn unmatched_overrides_hold_state_for_at_most_one_unit_of_the_override() {
    let (l, storage, clock) = limiter(false);
    assert!(flood(&l).await.iter().all(|&x| x), "each one limited");
    assert_eq!(storage.len(), 100);
    clock.advance(Duration::from_secs(365 * 86_400 - 60));
    assert_eq!(storage.sweep(), 100, "kept until full");
    clock.advance(Duration::from_secs(61));
    assert_eq!(storage.sweep(), 0, "gone one unit after the last charge");
}

/// With `--ignore-unmatched-overrides` they are answered OK without a limit
/// and create no state; overrides on matched descriptors still apply.
#[tokio::test]
async fn ignoring_unmatched_overrides_creates_no_state() {
    let (l, storage, _) = limiter(true);
    assert!(flood(&l).await.iter().all(|&x| !x), "none limited");
    assert!(storage.is_empty(), "{} buckets", storage.len());
    let mut d = crate::common::desc(&[("user", "ann")]);
    d.limit = Some(RateLimitOverride {
        requests_per_unit: 3,
        unit: RateLimitUnit::Hour as i32,
    });
    let r = l
        .should_rate_limit(&crate::common::req("ov", vec![d], 1))
        .await
        .unwrap();
    let cl = r.statuses[0]
        .current_limit
        .as_ref()
        .expect("override applied");
    assert_eq!(cl.requests_per_unit, 3);
}

/// As in the Go service, a `limit` override is enforced on a rule in shadow
/// mode (Envoy's per-tenant overrides keep working during a shadow rollout
/// of the rule), carries no rule name, and is neither dropped by another
/// rule's `replaces` nor drops the rule its own rule replaces.
#[tokio::test]
async fn overrides_are_enforced_on_shadow_rules_and_stay_outside_replaces() {
    let yaml = "domain: sh
descriptors:
  - key: tenant
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1, name: per_tenant}
  - key: plan
    value: gold
    rate_limit: {unit: minute, requests_per_unit: 50, replaces: [{name: per_tenant}]}
";
    let l = Limiter::new(
        crate::common::config(&[("sh.yaml", yaml)]),
        Arc::new(MemoryStorage::default()),
        ServiceSettings::default(),
    );
    let over = |entries: &[(&str, &str)], rpu: u32| {
        let mut d = crate::common::desc(entries);
        d.limit = Some(RateLimitOverride {
            requests_per_unit: rpu,
            unit: RateLimitUnit::Minute as i32,
        });
        d
    };
    let mut codes = Vec::new();
    for _ in 0..3 {
        let r = l
            .should_rate_limit(&crate::common::req(
                "sh",
                vec![
                    over(&[("tenant", "t1")], 2),
                    crate::common::desc(&[("plan", "gold")]),
                ],
                1,
            ))
            .await
            .expect("answer");
        let cl = r.statuses[0]
            .current_limit
            .as_ref()
            .expect("the override applies");
        assert_eq!((cl.requests_per_unit, cl.name.as_str()), (2, ""));
        codes.push((
            r.overall_code,
            r.statuses[0].code,
            r.statuses[0].limit_remaining,
        ));
    }
    // OK 1, OK 0, then enforced: OVER_LIMIT overall, not the shadow's OK.
    assert_eq!(codes, [(1, 1, 1), (1, 1, 0), (2, 2, 0)]);
    // The override on the replacing rule replaces nothing: the shadow rule
    // is evaluated (and, in shadow mode, answers OK with what it has left).
    let r = l
        .should_rate_limit(&crate::common::req(
            "sh",
            vec![
                crate::common::desc(&[("tenant", "t2")]),
                over(&[("plan", "gold")], 5),
            ],
            1,
        ))
        .await
        .expect("answer");
    let cl = r.statuses[0].current_limit.as_ref().expect("not replaced");
    assert_eq!(
        (cl.name.as_str(), r.statuses[0].limit_remaining),
        ("per_tenant", 0)
    );
}
