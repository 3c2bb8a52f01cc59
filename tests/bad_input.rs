//! Bad input: every case gets a clear answer or error, nothing panics, and the
//! service keeps serving afterwards.

mod common;

use bucket_rls::config::compile::compile_texts;
use bucket_rls::grpc::ShouldRateLimit as _;
use bucket_rls::limiter::Limiter;
use bucket_rls::settings::ServiceSettings;
use bucket_rls::storage::memory::MemoryStorage;
use common::{config, desc, req};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use std::sync::Arc;

const YAML: &str =
    "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";

fn limiter(settings: ServiceSettings) -> Limiter {
    Limiter::new(
        config(&[("d.yaml", YAML)]),
        Arc::new(MemoryStorage::default()),
        settings,
    )
}

#[tokio::test]
async fn ten_thousand_descriptors_are_refused_clearly() {
    let l = limiter(ServiceSettings::default());
    let many: Vec<_> = (0..10_000)
        .map(|i| desc(&[("k", &format!("v{i}"))]))
        .collect();
    let e = l
        .should_rate_limit(&req("d", many.clone(), 1))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert_eq!(
        e.message(),
        "too many descriptors: 10000 (at most 1024 per request)"
    );
    // Still serving.
    let r = l
        .should_rate_limit(&req("d", vec![desc(&[("k", "a")])], 1))
        .await
        .expect("serves");
    assert_eq!(r.statuses[0].limit_remaining, 1);
    // With the cap raised, 10,000 descriptors are answered, one status each.
    let l = limiter(ServiceSettings {
        max_descriptors: 10_000,
        ..ServiceSettings::default()
    });
    let r = l
        .should_rate_limit(&req("d", many, 1))
        .await
        .expect("answered");
    assert_eq!(r.statuses.len(), 10_000);
    assert_eq!(r.overall_code, Code::Ok as i32);
}

/// A descriptor longer than any rule can be deep gets OK without a limit,
/// as the Go service answers it, and the request's other descriptors are
/// still decided and charged (a refusal would make Envoy fall back to its
/// failure mode for all of them).
#[tokio::test]
async fn a_descriptor_longer_than_any_rule_is_answered_without_a_limit_and_the_others_are_decided()
{
    let l = Limiter::new(
        config(&[(
            "d.yaml",
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 10}\n",
        )]),
        Arc::new(MemoryStorage::default()),
        ServiceSettings::default(),
    );
    for (charged, count) in [65, 100, 10_000].into_iter().enumerate() {
        let entries: Vec<(String, String)> = (0..count)
            .map(|i| (format!("k{i}"), "v".to_owned()))
            .collect();
        let refs: Vec<(&str, &str)> = entries
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        // With an override too: no bucket keyed by every entry is made.
        let mut long = desc(&refs);
        long.limit = Some(RateLimitOverride {
            requests_per_unit: 1,
            unit: Unit::Minute as i32,
        });
        let r = l
            .should_rate_limit(&req("d", vec![long, desc(&[("k", "a")])], 1))
            .await
            .expect("answered");
        assert_eq!(r.overall_code, Code::Ok as i32, "{count} entries: {r:?}");
        assert_eq!(r.statuses[0].code, Code::Ok as i32);
        assert!(r.statuses[0].current_limit.is_none(), "{r:?}");
        // The other descriptor is charged on every call: 9, 8, 7 left.
        assert_eq!(
            u64::from(r.statuses[1].limit_remaining),
            9 - charged as u64,
            "{r:?}"
        );
    }
}

#[tokio::test]
async fn one_mib_values_get_their_own_buckets_and_are_not_stored_verbatim() {
    let storage = MemoryStorage::default();
    let l = Limiter::new(
        config(&[("d.yaml", YAML)]),
        Arc::new(storage.clone()),
        ServiceSettings::default(),
    );
    let big_a = "a".repeat(1 << 20);
    let mut big_b = big_a.clone();
    big_b.pop();
    big_b.push('b');
    for (v, want) in [(&big_a, 1), (&big_a, 0), (&big_b, 1)] {
        let r = l
            .should_rate_limit(&req("d", vec![desc(&[("k", v)])], 1))
            .await
            .expect("answered");
        assert_eq!(r.statuses[0].limit_remaining, want);
    }
    assert_eq!(storage.len(), 2);
}

#[tokio::test]
async fn hostile_characters_in_values_are_just_values() {
    let l = limiter(ServiceSettings::default());
    for v in [
        "",
        "\0",
        "{tag}",
        "}{",
        "a|k1:x=v1:y",
        "%7B",
        "\u{202e}rtl",
        "k",
    ] {
        let r = l
            .should_rate_limit(&req("d", vec![desc(&[("k", v)])], 1))
            .await
            .expect("answered");
        assert_eq!(
            (r.statuses[0].code, r.statuses[0].limit_remaining),
            (Code::Ok as i32, 1),
            "value {v:?}"
        );
    }
    // Unknown keys and an empty key match nothing.
    let r = l
        .should_rate_limit(&req("d", vec![desc(&[("", "x")])], 1))
        .await
        .expect("answered");
    assert!(r.statuses[0].current_limit.is_none());
}

#[test]
fn a_config_of_100000_rules_loads_and_matches() {
    let mut yaml = String::from("domain: big\ndescriptors:\n");
    for i in 0..100_000 {
        yaml.push_str(&format!("  - key: user\n    value: u{i}\n    rate_limit: {{unit: minute, requests_per_unit: {}}}\n", i % 1000 + 1));
    }
    let c = compile_texts(&[("big.yaml".into(), yaml.clone().into_bytes())])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.rule_count(), 100_000);
    let d = &c.domains["big"];
    let m = bucket_rls::matcher::find(&d.root, &[("user", "u99999")]).expect("last rule matches");
    assert_eq!(d.rules[m.rule].path, "big.user_u99999");
    // One bad rule among 100,000 is found and named.
    let bad = yaml.replacen(
        "value: u77777\n    rate_limit: {unit: minute",
        "value: u77777\n    rate_limit: {unit: minnute",
        1,
    );
    let e = compile_texts(&[("big.yaml".into(), bad.into_bytes())])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("big.yaml:233336:")
            && e.contains("descriptors[77777](key=user, value=u77777).rate_limit: ")
            && e.contains("bad unit 'minnute'"),
        "{e}"
    );
}

#[test]
fn deeply_nested_config_is_an_error_not_a_crash() {
    let mut yaml = String::from("domain: deep\ndescriptors:\n");
    let depth = 5_000;
    for i in 0..depth {
        let pad = "  ".repeat(2 * i);
        yaml.push_str(&format!("{pad}  - key: k{i}\n{pad}    descriptors:\n"));
    }
    let r = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || {
            compile_texts(&[("deep.yaml".into(), yaml.into_bytes())])
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
        .expect("spawn")
        .join()
        .expect("no stack overflow or panic");
    let e = r.unwrap_err();
    assert!(e.starts_with("deep.yaml"), "{e}");
    assert!(e.contains("nested too deeply"), "says what is wrong: {e}");
}

#[test]
fn huge_garbage_is_an_error() {
    let junk: Vec<u8> = (0..1_000_000u32)
        .map(|i| b"{[:- \n\"'"[(i % 8) as usize])
        .collect();
    let e = compile_texts(&[("junk.yaml".into(), junk)])
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("junk.yaml"), "{e}");
}
