//! The Prometheus alert rules and the Grafana dashboard under
//! `examples/observability/`: the rules pass `promtool check rules` and their
//! unit tests (`promtool test rules`), and every metric either file names is
//! one the service exports.

use bucket_rls::metrics as m;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/observability")
}

fn promtool(args: &[&str]) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(dir())
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run promtool (install the Debian package prometheus): {e}")
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

/// Every `bucket_rls_*` name in `text`, histogram suffixes removed.
fn metric_names(text: &str) -> BTreeSet<String> {
    names_with_prefix(text, "bucket_rls_")
}

/// Every name starting with `prefix` in `text`, the request duration
/// histogram's suffixes removed.
fn names_with_prefix(text: &str, prefix: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find(prefix) {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let base = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .filter(|b| *b == m::REQUEST_DURATION)
            .unwrap_or(name);
        names.insert(base.to_owned());
        rest = &tail[end..];
    }
    names
}

fn exported() -> BTreeSet<String> {
    [
        m::TOTAL_HITS,
        m::WITHIN_LIMIT,
        m::OVER_LIMIT,
        m::NEAR_LIMIT,
        m::SHADOW_MODE,
        m::GLOBAL_SHADOW_MODE,
        m::HITS_EXCEED_CAPACITY,
        m::DOMAIN_NOT_FOUND,
        m::SERVICE_ERROR,
        m::STORAGE_ERRORS,
        m::CONFIG_LOAD,
        m::CONFIG_LAST_RELOAD_SUCCESSFUL,
        m::CONFIG_LAST_RELOAD_TIMESTAMP,
        m::REDIS_SCRIPT_RELOAD,
        m::LOCAL_CACHE_HITS,
        m::REDIS_CIRCUIT_OPEN,
        m::REQUEST_DURATION,
        m::CONFIG_INFO,
        m::CONFIG_LOAD_TIMESTAMP,
        m::BUILD_INFO,
        bucket_rls::metrics::MEMORY_EVICTIONS,
        m::GLOBAL_SHADOW_MODE,
        m::RULE_REQUESTS,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

/// The Go service's names bucket-rls exports on `--go-metrics-addr`
/// (`go::metrics`), and Envoy's rate limit filter statistics
/// (`cluster.<route cluster>.ratelimit.*` as Envoy's Prometheus endpoint
/// names them), which the alerts for a silent stop read.
const GO_AND_ENVOY_NAMES: &[&str] = &[
    "ratelimit_service_config_load_success",
    "ratelimit_service_config_load_error",
    "ratelimit_service_total_requests",
    "ratelimit_service_should_rate_limit_error",
    "envoy_cluster_ratelimit_ok",
    "envoy_cluster_ratelimit_over_limit",
    "envoy_cluster_ratelimit_error",
    "envoy_cluster_ratelimit_failure_mode_allowed",
];

#[test]
fn alerts_name_only_go_names_the_service_exports_and_envoys_filter_statistics() {
    let text = std::fs::read_to_string(dir().join("alerts.yaml")).expect("alerts.yaml");
    let mut used = names_with_prefix(&text, "ratelimit_service_");
    used.extend(names_with_prefix(&text, "envoy_cluster_ratelimit_"));
    let known: BTreeSet<String> = GO_AND_ENVOY_NAMES.iter().map(|s| (*s).to_owned()).collect();
    let unknown: Vec<_> = used.difference(&known).collect();
    assert!(
        unknown.is_empty(),
        "alerts.yaml names unknown metrics: {unknown:?}"
    );
    // Each limiting-stopped alert exists for both name sets.
    for needed in [
        "ratelimit_service_config_load_success",
        "ratelimit_service_total_requests",
        "ratelimit_service_should_rate_limit_error",
        "envoy_cluster_ratelimit_failure_mode_allowed",
    ] {
        assert!(used.contains(needed), "alerts.yaml does not read {needed}");
    }
}

#[test]
fn alert_rules_pass_promtool_check_and_their_unit_tests() {
    let checked = promtool(&["check", "rules", "alerts.yaml"]);
    assert!(checked.contains("SUCCESS: 13 rules found"), "{checked}");
    let tested = promtool(&["test", "rules", "alerts_test.yaml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");
}

#[test]
fn every_alert_rule_has_a_unit_test() {
    let rules = std::fs::read_to_string(dir().join("alerts.yaml")).expect("alerts.yaml");
    let tests = std::fs::read_to_string(dir().join("alerts_test.yaml")).expect("alerts_test.yaml");
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert_eq!(alerts.len(), 13);
    for a in alerts {
        assert!(
            tests.contains(&format!("alertname: {a}")),
            "alert {a} has no test in alerts_test.yaml"
        );
    }
}

#[test]
fn dashboard_and_alerts_name_only_exported_metrics() {
    let known = exported();
    for file in ["alerts.yaml", "grafana-dashboard.json"] {
        let text = std::fs::read_to_string(dir().join(file)).expect(file);
        let used = metric_names(&text);
        assert!(used.len() >= 7, "{file} names only {used:?}");
        let unknown: Vec<_> = used.difference(&known).collect();
        assert!(
            unknown.is_empty(),
            "{file} names metrics the service does not export: {unknown:?}"
        );
    }
}

#[test]
fn dashboard_is_grafana_json_with_one_datasource_variable() {
    let text = std::fs::read_to_string(dir().join("grafana-dashboard.json")).expect("dashboard");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("dashboard is JSON");
    let panels = dash["panels"].as_array().expect("panels");
    assert!(panels.len() >= 10);
    for p in panels {
        assert_eq!(
            p["datasource"]["uid"], "${datasource}",
            "panel {}",
            p["title"]
        );
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {} has no query", p["title"]);
        for t in targets {
            let expr = t["expr"].as_str().expect("expr");
            assert!(
                expr.contains("$job") && expr.contains("$instance"),
                "{expr}"
            );
        }
    }
    // Panel ids are unique and panels do not overlap.
    let ids: BTreeSet<_> = panels.iter().map(|p| p["id"].as_u64()).collect();
    assert_eq!(ids.len(), panels.len());
    let mut cells = BTreeSet::new();
    for p in panels {
        let g = &p["gridPos"];
        let (x, y, w, h) = (
            g["x"].as_u64().unwrap(),
            g["y"].as_u64().unwrap(),
            g["w"].as_u64().unwrap(),
            g["h"].as_u64().unwrap(),
        );
        assert!(x + w <= 24, "panel {} wider than the grid", p["title"]);
        for cx in x..x + w {
            for cy in y..y + h {
                assert!(
                    cells.insert((cx, cy)),
                    "panel {} overlaps another",
                    p["title"]
                );
            }
        }
    }
}

/// `GET path` through `router`, as text.
async fn scrape(router: axum::Router, path: &str) -> String {
    use tower::ServiceExt as _;
    let resp = router
        .oneshot(
            axum::http::Request::get(path)
                .body(axum::body::Body::empty())
                .expect("request"),
        )
        .await
        .expect("answer");
    assert_eq!(resp.status(), 200, "GET {path}");
    let bytes = axum::body::to_bytes(resp.into_body(), 16 << 20)
        .await
        .expect("body");
    String::from_utf8(bytes.to_vec()).expect("UTF-8")
}

/// `promtool check metrics` on `text` (its stdin): exit status and output.
fn promtool_check_metrics(text: &str) -> (bool, String) {
    use std::io::Write as _;
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot run promtool (install the Debian package prometheus): {e}")
        });
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("promtool");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success() && said.trim().is_empty(), said)
}

#[tokio::test]
async fn every_metrics_endpoint_passes_promtool_check_metrics() {
    use bucket_rls::grpc::ShouldRateLimit as _;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    let storage = std::sync::Arc::new(bucket_rls::storage::memory::MemoryStorage::new(
        std::sync::Arc::new(bucket_rls::storage::clock::ManualClock::new(1_000_000)),
    ));
    let l = crate::common::limiter(
        "domain: lint\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 1}\n",
        storage,
        "",
    );
    // Traffic, so that the per-rule series, the histogram and the error
    // counters exist: an admitted call, a denied one, an unknown domain.
    for domain in ["lint", "lint", "nowhere"] {
        let req = RateLimitRequest {
            domain: domain.into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "user".into(),
                    value: "ann".into(),
                }],
                ..Default::default()
            }],
            ..Default::default()
        };
        l.should_rate_limit(&req).await.expect("decided");
    }
    for (port, text) in [
        (
            "admin /metrics",
            scrape(bucket_rls::http::router(l.clone()), "/metrics").await,
        ),
        (
            "Go-named /metrics",
            scrape(bucket_rls::go::metrics::router("/metrics"), "/metrics").await,
        ),
    ] {
        assert!(text.contains("process_resident_memory_bytes"), "{port}");
        let (clean, said) = promtool_check_metrics(&text);
        assert!(clean, "{port}: promtool check metrics:\n{said}\n{text}");
    }
}
