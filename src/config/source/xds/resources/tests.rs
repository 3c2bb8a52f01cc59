//! Tests of the mapping of `RateLimitConfig` resources onto configs.
use super::*;
use crate::config::{Policy, Unit};

fn desc(key: &str, value: &str) -> RateLimitDescriptor {
    RateLimitDescriptor {
        key: key.into(),
        value: value.into(),
        ..Default::default()
    }
}

fn limit(rpu: u32, unit: RateLimitUnit) -> Option<RateLimitPolicy> {
    Some(RateLimitPolicy {
        unit: unit as i32,
        requests_per_unit: rpu,
        ..Default::default()
    })
}

/// The shape Envoy Gateway sends for a route rule with a header match.
fn eg(domain: &str, rpu: u32, unit: RateLimitUnit) -> RateLimitConfig {
    let mut leaf = desc("rule-0-match-0", "rule-0-match-0");
    leaf.rate_limit = limit(rpu, unit);
    let mut route = desc(
        "httproute/default/backend/rule/0/match/0/*",
        "httproute/default/backend/rule/0/match/0/*",
    );
    route.descriptors = vec![leaf];
    RateLimitConfig {
        name: domain.into(),
        domain: domain.into(),
        descriptors: vec![route],
    }
}

#[test]
fn envoy_gateway_shapes_compile_to_the_rules_a_file_would_give() {
    let mut cidr = desc("masked_remote_address", "0.0.0.0/0");
    let mut per_ip = desc("remote_address", "");
    per_ip.rate_limit = limit(3, RateLimitUnit::Month);
    per_ip.shadow_mode = true;
    cidr.descriptors = vec![per_ip];
    let mut shared = desc("default/policy/rule/0", "default/policy/rule/0");
    let mut week = desc("rule-0-match--1", "rule-0-match--1");
    week.rate_limit = limit(7, RateLimitUnit::Week);
    shared.descriptors = vec![week, cidr];
    let set = [
        pack(&eg("default/eg/http", 5, RateLimitUnit::Second)),
        pack(&RateLimitConfig {
            name: "default/policy".into(),
            domain: "default/policy".into(),
            descriptors: vec![shared],
        }),
    ];
    let c = compile_resources(&set, LoadOptions::default()).unwrap();
    assert_eq!(c.domains.len(), 2);
    let d = &c.domains["default/policy"];
    let ip = d
        .rules
        .iter()
        .find(|r| r.path.ends_with(".remote_address"))
        .unwrap();
    assert_eq!(
        ip.path,
        "default/policy.default/policy/rule/0_default/policy/rule/0.masked_remote_address_0.0.0.0/0.remote_address"
    );
    assert!(ip.shadow_mode);
    assert_eq!(
        ip.policy,
        Policy::Limited {
            requests_per_unit: 3,
            unit: Unit::Month,
            burst: 3,
            max_debt: None,
            algorithm: crate::storage::AlgorithmKind::TokenBucket,
        }
    );
    let wk = d
        .rules
        .iter()
        .find(|r| r.path.ends_with("rule-0-match--1"))
        .unwrap();
    assert_eq!(
        wk.policy,
        Policy::Limited {
            requests_per_unit: 7,
            unit: Unit::Week,
            burst: 7,
            max_debt: None,
            algorithm: crate::storage::AlgorithmKind::TokenBucket,
        }
    );
    assert_eq!(d.file, "default/policy");
}

#[test]
fn hash_depends_on_content_not_on_resource_order() {
    let a = pack(&eg("a", 1, RateLimitUnit::Minute));
    let b = pack(&eg("b", 2, RateLimitUnit::Minute));
    let one = compile_resources(&[a.clone(), b.clone()], LoadOptions::default()).unwrap();
    let two = compile_resources(&[b, a.clone()], LoadOptions::default()).unwrap();
    assert_eq!(one.hash, two.hash);
    let other = compile_resources(&[a], LoadOptions::default()).unwrap();
    assert_ne!(one.hash, other.hash);
    assert_ne!(
        compile_resources(&[], LoadOptions::default()).unwrap().hash,
        other.hash
    );
}

#[test]
fn empty_set_is_a_config_without_domains() {
    let c = compile_resources(&[], LoadOptions::default()).unwrap();
    assert!(c.domains.is_empty());
}

#[test]
fn errors_name_the_resource_and_the_descriptor_path() {
    let mut bad = eg("default/eg/http", 5, RateLimitUnit::Unknown);
    bad.descriptors[0].descriptors.push(desc("", "x"));
    let e = compile_resources(&[pack(&bad)], LoadOptions::default())
        .unwrap_err()
        .to_string();
    // Each level names its key and value, as a file's errors do; the
    // proto's empty key shows as "".
    let route = "descriptors[0](key=httproute/default/backend/rule/0/match/0/*, value=httproute/default/backend/rule/0/match/0/*)";
    assert!(
        e.contains(&format!("default/eg/http: {route}.descriptors[0](key=rule-0-match-0, value=rule-0-match-0).rate_limit: bad unit 'UNKNOWN'")),
        "{e}"
    );
    assert!(
        e.contains(&format!(
            "default/eg/http: {route}.descriptors[1](key=\"\", value=x): descriptor without 'key'"
        )),
        "{e}"
    );
}

#[test]
fn duplicate_domains_and_unlimited_with_a_unit_are_refused() {
    let a = pack(&eg("d", 1, RateLimitUnit::Minute));
    let mut b = eg("d", 2, RateLimitUnit::Minute);
    b.name = "other".into();
    let e = compile_resources(&[a, pack(&b)], LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("duplicate domain 'd'"), "{e}");
    let mut u = eg("u", 1, RateLimitUnit::Minute);
    u.descriptors[0].descriptors[0]
        .rate_limit
        .as_mut()
        .unwrap()
        .unlimited = true;
    let e = compile_resources(&[pack(&u)], LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("'unit' must not be given with 'unlimited: true'"),
        "{e}"
    );
    // Unlimited without a unit is fine.
    u.descriptors[0].descriptors[0]
        .rate_limit
        .as_mut()
        .unwrap()
        .unit = 0;
    let c = compile_resources(&[pack(&u)], LoadOptions::default()).unwrap();
    assert_eq!(c.domains["u"].rules[0].policy, Policy::Unlimited);
}

#[test]
fn merged_domains_follow_the_load_options() {
    let a = pack(&eg("d", 1, RateLimitUnit::Minute));
    let mut b = eg("d", 2, RateLimitUnit::Minute);
    b.name = "other".into();
    b.descriptors[0].key = "another".into();
    let c = compile_resources(
        &[a, pack(&b)],
        LoadOptions {
            merge_domains: true,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    assert_eq!(c.domains["d"].rules.len(), 2);
}

#[test]
fn wrong_type_url_unknown_unit_and_garbage_are_errors() {
    let mut wrong = pack(&eg("a", 1, RateLimitUnit::Minute));
    wrong.type_url = "type.googleapis.com/envoy.config.cluster.v3.Cluster".into();
    let garbage = Any {
        type_url: RATE_LIMIT_CONFIG_TYPE_URL.into(),
        value: vec![0xff, 0xff, 0xff],
    };
    let mut odd = eg("b", 1, RateLimitUnit::Minute);
    odd.descriptors[0].descriptors[0]
        .rate_limit
        .as_mut()
        .unwrap()
        .unit = 42;
    let e = compile_resources(&[wrong, garbage, pack(&odd)], LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(
            "resources[0]: type URL 'type.googleapis.com/envoy.config.cluster.v3.Cluster' is not"
        ),
        "{e}"
    );
    assert!(
        e.contains("resources[1]: does not decode as RateLimitConfig"),
        "{e}"
    );
    assert!(e.contains("bad unit 'enum value 42'"), "{e}");
}

#[test]
fn strings_that_look_like_yaml_stay_literal() {
    let mut d = desc("k: v", "~");
    d.rate_limit = limit(1, RateLimitUnit::Hour);
    let mut q = desc("\"quoted\"\n", "010");
    q.rate_limit = limit(2, RateLimitUnit::Hour);
    let c = compile_resources(
        &[pack(&RateLimitConfig {
            name: String::new(),
            domain: "y: es #".into(),
            descriptors: vec![d, q],
        })],
        LoadOptions::default(),
    )
    .unwrap();
    let d = &c.domains["y: es #"];
    assert_eq!(d.rules[0].path, "y: es #.k: v_~");
    assert_eq!(d.rules[1].path, "y: es #.\"quoted\"\n_010");
}

#[test]
fn metadata_becomes_the_rules_metadata() {
    let mut d = desc("k", "v");
    d.rate_limit = limit(1, RateLimitUnit::Hour);
    d.metadata = Some(json_struct(
        serde_json::json!({"team": "a", "n": 2.5, "l": [true, null]})
            .as_object()
            .unwrap(),
    ));
    let c = compile_resources(
        &[pack(&RateLimitConfig {
            name: "m".into(),
            domain: "m".into(),
            descriptors: vec![d],
        })],
        LoadOptions::default(),
    )
    .unwrap();
    let m = c.domains["m"].rules[0].metadata.as_deref().unwrap();
    assert_eq!(
        serde_json::Value::Object(m.clone()),
        serde_json::json!({"team": "a", "n": 2.5, "l": [true, null]})
    );
}

#[test]
fn envoy_gateway_dump_parses_and_compiles() {
    let dump = r#"name: first-listener
domain: first-listener
descriptors:
  - key: first-route
    value: ""
    rate_limit: null
    descriptors:
      - key: rule-0-match-0
        value: rule-0-match-0
        rate_limit:
          requests_per_unit: 5
          unit: MONTH
          unlimited: false
          name: ""
          replaces: []
        descriptors: []
        shadow_mode: false
        quota_mode: false
        detailed_metric: false
        value_to_metric: false
        share_threshold: false
    shadow_mode: false
    detailed_metric: false
---
name: test-namespace/test-policy-1
domain: test-namespace/test-policy-1
descriptors:
  - key: x
    rate_limit:
      requests_per_unit: 1
      unit: 7
"#;
    let configs = parse_dump("dump.yaml", dump).unwrap();
    assert_eq!(configs.len(), 2);
    let c = compile_configs(&configs, LoadOptions::default()).unwrap();
    let r = &c.domains["first-listener"].rules[0];
    assert_eq!(
        r.path,
        "first-listener.first-route.rule-0-match-0_rule-0-match-0"
    );
    assert_eq!(
        c.domains["test-namespace/test-policy-1"].rules[0].policy,
        Policy::Limited {
            requests_per_unit: 1,
            unit: Unit::Week,
            burst: 1,
            max_debt: None,
            algorithm: crate::storage::AlgorithmKind::TokenBucket,
        }
    );
    // The same resources pushed over xDS hash the same.
    let packed: Vec<Any> = configs.iter().map(pack).collect();
    assert_eq!(
        compile_resources(&packed, LoadOptions::default())
            .unwrap()
            .hash,
        c.hash
    );
}

#[test]
fn dump_errors_name_the_document_and_the_field() {
    let dump = "domain: a\ndescriptors:\n  - key: k\n    share_threshold: true\n    rate_limit: {unit: FORTNIGHT}\n";
    let e = parse_dump("d.yaml", dump).unwrap_err().to_string();
    assert!(
        e.contains(
            "d.yaml[document 0]: descriptors[0](key=k): share_threshold: true cannot be sent over xDS"
        ),
        "{e}"
    );
    assert!(
        e.contains(
            "d.yaml[document 0]: descriptors[0](key=k).rate_limit: unit: unknown unit 'FORTNIGHT'"
        ),
        "{e}"
    );
}

/// A pushed descriptor is named as a file's is, with its key and value cut
/// to 64 characters, also where the mapping itself refuses it (metadata that
/// cannot be a `Struct`): a NACK stays short whatever a control plane sends.
#[test]
fn a_pushed_descriptors_long_value_is_cut_in_its_errors() {
    let long = "v".repeat(10_000);
    let mut d = desc("k", &long);
    d.metadata = Some(Struct {
        fields: [(
            "n".to_owned(),
            PbValue {
                kind: Some(Kind::NumberValue(f64::NAN)),
            },
        )]
        .into(),
    });
    let c = RateLimitConfig {
        name: "r".into(),
        domain: "r".into(),
        descriptors: vec![d],
    };
    let e = compile_resources(&[pack(&c)], LoadOptions::default())
        .unwrap_err()
        .to_string();
    let at = format!("r: descriptors[0](key=k, value={}…)", "v".repeat(64));
    assert!(
        e.starts_with(&format!(
            "{at}.metadata: number NaN cannot be a protobuf Struct value"
        )),
        "{e}"
    );
    assert!(e.len() < 200, "{e}");
}

/// A pushed config names no algorithm (the xDS API has no such field): its
/// rules take the service's `--default-algorithm`, so a migration from the
/// Go service gets fixed windows for Envoy Gateway's policies too.
#[test]
fn pushed_rules_take_the_default_algorithm() {
    use crate::storage::AlgorithmKind;
    let set = [pack(&eg("default/eg/http", 5, RateLimitUnit::Minute))];
    for kind in AlgorithmKind::ALL {
        let load = LoadOptions {
            default_algorithm: kind,
            ..LoadOptions::default()
        };
        let c = compile_resources(&set, load).unwrap();
        assert_eq!(
            c.domains["default/eg/http"].rules[0].policy,
            Policy::Limited {
                requests_per_unit: 5,
                unit: Unit::Minute,
                burst: 5,
                max_debt: None,
                algorithm: kind,
            }
        );
    }
}
