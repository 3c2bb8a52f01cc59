//! The HTTP admin API through the router (no socket), then once over real
//! sockets with `app::run`, including the gRPC health drain on shutdown.

mod common;

use async_trait::async_trait;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use bucket_rls::app::{self, Listeners};
use bucket_rls::config::source::watch::ReloadError;
use bucket_rls::limiter::Limiter;
use bucket_rls::metrics as m;
use bucket_rls::storage::clock::ManualClock;
use bucket_rls::storage::memory::MemoryStorage;
use bucket_rls::storage::{Charge, RequestResult, Storage, StorageError};
use common::http::request;
use common::metrics::metric;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tower::ServiceExt;

const YAML: &str = "domain: adm
descriptors:
  - key: user
    rate_limit: {name: per_user, unit: minute, requests_per_unit: 2, burst: 3}
  - key: route
    value: r1
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: vip
    value: v
    rate_limit: {unlimited: true}
  - key: tier
    value: gold
    rate_limit: {unit: hour, requests_per_unit: 100, replaces: [{name: per_user}]}
";

fn memory() -> Arc<dyn Storage> {
    Arc::new(MemoryStorage::new(Arc::new(ManualClock::new(1_000_000))))
}

/// A backend that is down.
#[derive(Debug)]
struct Down;

#[async_trait]
impl Storage for Down {
    async fn apply(&self, _: &[Charge]) -> Result<RequestResult, StorageError> {
        Err(StorageError::unreachable("connection refused"))
    }
    async fn ping(&self) -> Result<(), StorageError> {
        Err(StorageError::unreachable("connection refused"))
    }
    fn name(&self) -> &'static str {
        "down"
    }
}

async fn call(
    l: &Arc<Limiter>,
    method: &str,
    path: &str,
    body: &str,
) -> (StatusCode, String, String) {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .body(Body::from(body.to_owned()))
        .unwrap();
    let resp = bucket_rls::http::router(l.clone())
        .oneshot(req)
        .await
        .unwrap();
    let status = resp.status();
    let ctype = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    (status, ctype, String::from_utf8(bytes.to_vec()).unwrap())
}

async fn post_json(l: &Arc<Limiter>, body: Value) -> (StatusCode, Value) {
    let (s, ctype, b) = call(l, "POST", "/json", &body.to_string()).await;
    assert_eq!(ctype, "application/json");
    (s, serde_json::from_str(&b).unwrap())
}

#[tokio::test]
async fn healthcheck_is_200_with_storage_and_503_without() {
    let ok = common::limiter(YAML, memory(), "h:");
    assert_eq!(call(&ok, "GET", "/healthcheck", "").await.0, StatusCode::OK);
    let down = common::limiter(YAML, Arc::new(Down), "h:");
    let (s, _, body) = call(&down, "GET", "/healthcheck", "").await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        body.contains("storage unavailable") && body.contains("connection refused"),
        "{body}"
    );
    // Liveness never looks at storage.
    assert_eq!(call(&down, "GET", "/livez", "").await.0, StatusCode::OK);
}

#[tokio::test]
async fn metrics_render_prometheus_text_with_config_identity() {
    let l = common::limiter(YAML, memory(), "m:");
    let (s, _) = post_json(&l, json!({"domain": "adm", "descriptors": [{"entries": [{"key": "user", "value": "metrics"}]}]})).await;
    assert_eq!(s, StatusCode::OK);
    let (s, ctype, text) = call(&l, "GET", "/metrics", "").await;
    assert_eq!(s, StatusCode::OK);
    assert!(ctype.starts_with("text/plain; version=0.0.4"), "{ctype}");
    assert!(metric(&text, m::TOTAL_HITS, &[("rule", "adm.user")]).unwrap() >= 1.0);
    let hash = l.config().hash.clone();
    assert_eq!(metric(&text, m::CONFIG_INFO, &[("hash", &hash)]), Some(1.0));
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with(m::CONFIG_INFO))
            .count(),
        1
    );
    let loaded = metric(&text, m::CONFIG_LOAD_TIMESTAMP, &[]).unwrap();
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        loaded > now - 600.0 && loaded <= now + 1.0,
        "{loaded} vs {now}"
    );
    // Latency histogram with the documented buckets, 100 us .. 100 ms.
    assert!(
        text.contains(&format!("{}_bucket{{le=\"0.0001\"}}", m::REQUEST_DURATION)),
        "{text}"
    );
    assert!(text.contains(&format!("{}_bucket{{le=\"0.1\"}}", m::REQUEST_DURATION)));
    assert!(text.contains(&format!("# TYPE {} counter", m::TOTAL_HITS)));
    // The standard process series: this process's resident memory and
    // open files (at least stdin, stdout, stderr).
    let rss = metric(&text, "process_resident_memory_bytes", &[]).expect("RSS series");
    assert!(rss > 1_000_000.0, "{rss}");
    assert!(metric(&text, "process_open_fds", &[]).expect("fd series") >= 3.0);
    assert!(metric(&text, "process_cpu_seconds_total", &[]).expect("CPU series") >= 0.0);
}

/// `/rlconfig` shows the debt bound in force: a rule's own `max_debt`, the
/// service-wide multiple of the burst for a rule without one, none for
/// `max_debt: 0`, and the service-wide setting in `modes`.
#[tokio::test]
async fn rlconfig_shows_the_debt_bound_in_force() {
    let yaml = "domain: llm\ndescriptors:\n  - key: own\n    rate_limit: {unit: hour, requests_per_unit: 1000, max_debt: 500}\n  - key: wide\n    rate_limit: {unit: hour, requests_per_unit: 10, burst: 20}\n  - key: off\n    rate_limit: {unit: hour, requests_per_unit: 10, max_debt: 0}\n";
    let settings = bucket_rls::settings::ServiceSettings {
        max_debt_bursts: 3,
        ..bucket_rls::settings::ServiceSettings::default()
    };
    let l = Arc::new(Limiter::new(
        common::config(&[("llm.yaml", yaml)]),
        memory(),
        settings,
    ));
    let (_, _, body) = call(&l, "GET", "/rlconfig", "").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    let rules = v["domains"][0]["rules"].as_array().unwrap();
    let debt = |p: &str| {
        rules
            .iter()
            .find(|r| r["path"] == p)
            .map(|r| r.get("max_debt").cloned())
    };
    assert_eq!(debt("llm.own"), Some(Some(json!(500))));
    assert_eq!(debt("llm.wide"), Some(Some(json!(60))));
    assert_eq!(debt("llm.off"), Some(None));
    // The setting the bounds include, for `check-config --diff` to apply
    // to a file's rules.
    assert_eq!(v["modes"]["max_debt_bursts"], json!(3));
}

/// `/rlconfig` names each limited rule's algorithm (a window shows no
/// debt bound even under `--max-debt-bursts`), and `/metrics` counts the
/// limited rules per algorithm, every algorithm with its series.
#[tokio::test]
async fn rlconfig_and_metrics_show_the_algorithm() {
    let yaml = "domain: algo\ndescriptors:\n  - key: b\n    rate_limit: {unit: hour, requests_per_unit: 10}\n  - key: w\n    rate_limit: {unit: hour, requests_per_unit: 10, algorithm: fixed_window}\n  - key: w2\n    rate_limit: {unit: minute, requests_per_unit: 1, algorithm: fixed_window}\n  - key: s\n    rate_limit: {unit: minute, requests_per_unit: 1, algorithm: sliding_window}\n  - key: u\n    rate_limit: {unlimited: true}\n";
    let settings = bucket_rls::settings::ServiceSettings {
        max_debt_bursts: 3,
        ..bucket_rls::settings::ServiceSettings::default()
    };
    let l = Arc::new(Limiter::new(
        common::config(&[("algo.yaml", yaml)]),
        memory(),
        settings,
    ));
    let (_, _, body) = call(&l, "GET", "/rlconfig", "").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    let rules = v["domains"][0]["rules"].as_array().unwrap();
    let field = |p: &str, f: &str| {
        rules
            .iter()
            .find(|r| r["path"] == p)
            .and_then(|r| r.get(f).cloned())
    };
    assert_eq!(field("algo.b", "algorithm"), Some(json!("token_bucket")));
    assert_eq!(field("algo.w", "algorithm"), Some(json!("fixed_window")));
    assert_eq!(field("algo.u", "algorithm"), None);
    assert_eq!(field("algo.b", "max_debt"), Some(json!(30)));
    assert_eq!(field("algo.w", "max_debt"), None);
    let (_, _, text) = call(&l, "GET", "/metrics", "").await;
    let rules = |a: &str| metric(&text, m::CONFIG_RULES, &[("algorithm", a)]);
    assert_eq!(rules("token_bucket"), Some(1.0));
    assert_eq!(rules("fixed_window"), Some(2.0));
    assert_eq!(rules("sliding_window"), Some(1.0));
    assert_eq!(field("algo.s", "algorithm"), Some(json!("sliding_window")));
}

/// `/rlconfig` states `--default-algorithm` in `modes`, for `check-config
/// --diff` to load a file's rules that name no algorithm as the replica
/// did.
#[tokio::test]
async fn rlconfig_states_the_default_algorithm() {
    let settings = bucket_rls::settings::ServiceSettings {
        default_algorithm: bucket_rls::storage::AlgorithmKind::SlidingWindow,
        ..bucket_rls::settings::ServiceSettings::default()
    };
    let l = Arc::new(Limiter::new(
        common::config(&[("adm.yaml", YAML)]),
        memory(),
        settings,
    ));
    let (_, _, body) = call(&l, "GET", "/rlconfig", "").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["modes"]["default_algorithm"], json!("sliding_window"));
}

#[tokio::test]
async fn rlconfig_lists_domains_rules_hash_and_last_error() {
    let l = common::limiter(YAML, memory(), "r:");
    let (s, ctype, body) = call(&l, "GET", "/rlconfig", "").await;
    assert_eq!((s, ctype.as_str()), (StatusCode::OK, "application/json"));
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["hash"], json!(l.config().hash));
    assert_eq!(v["backend"], "memory");
    assert_eq!(v["last_reload_error"], Value::Null);
    assert_eq!(
        v["modes"],
        json!({"shadow_mode": false, "quota_mode": false, "response_dynamic_metadata": false, "max_debt_bursts": 0, "default_algorithm": "token_bucket"})
    );
    assert!(v["loaded_at"].as_str().unwrap().ends_with('Z'));
    assert!(v["loaded_at_unix_ms"].as_u64().unwrap() > 1_600_000_000_000);
    let domain = &v["domains"][0];
    assert_eq!(domain["domain"], "adm");
    let rules = domain["rules"].as_array().unwrap();
    assert_eq!(rules.len(), 4);
    let by_path = |p: &str| {
        rules
            .iter()
            .find(|r| r["path"] == p)
            .unwrap_or_else(|| panic!("{p} in {rules:?}"))
    };
    let user = by_path("adm.user");
    assert_eq!(
        (
            &user["name"],
            &user["requests_per_unit"],
            &user["unit"],
            &user["burst"],
            &user["unlimited"]
        ),
        (
            &json!("per_user"),
            &json!(2),
            &json!("minute"),
            &json!(3),
            &json!(false)
        )
    );
    assert_eq!(by_path("adm.route_r1")["shadow_mode"], true);
    assert_eq!(
        (
            &user["quota_mode"],
            &user["value_to_metric"],
            &user["metadata"]
        ),
        (&json!(false), &json!(false), &Value::Null)
    );
    assert_eq!(by_path("adm.vip_v")["unlimited"], true);
    assert!(by_path("adm.vip_v").get("unit").is_none());
    assert_eq!(by_path("adm.tier_gold")["replaces"], json!(["per_user"]));

    l.config_handle().set_last_error(Some(ReloadError {
        at: SystemTime::now(),
        message: "adm.yaml:3: unknown key 'unlimied'".into(),
    }));
    let (_, _, body) = call(&l, "GET", "/rlconfig", "").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["last_reload_error"]["message"],
        "adm.yaml:3: unknown key 'unlimied'"
    );
    assert!(
        v["last_reload_error"]["at"]
            .as_str()
            .unwrap()
            .ends_with('Z')
    );
}

#[tokio::test]
async fn json_consume_check_refund_and_over_limit() {
    let l = common::limiter(YAML, memory(), "j:");
    let user = |extra: Value| {
        let mut d = json!({"entries": [{"key": "user", "value": "alice"}]});
        d.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        json!({"domain": "adm", "descriptors": [d]})
    };
    // Consume: burst 3.
    let (s, v) = post_json(&l, user(json!({}))).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        v,
        json!({"overallCode": "OK", "statuses": [{"code": "OK",
            "currentLimit": {"name": "per_user", "requestsPerUnit": 2, "unit": "MINUTE"},
            "limitRemaining": 2, "durationUntilReset": "30s"}]})
    );
    // Check (hitsAddend 0, as a string): consumes nothing.
    let (s, v) = post_json(&l, user(json!({"hitsAddend": "0"}))).await;
    assert_eq!(
        (s, &v["statuses"][0]["limitRemaining"]),
        (StatusCode::OK, &json!(2))
    );
    // Consume the rest (snake_case names accepted), then over limit: 429.
    let (s, _) = post_json(
        &l,
        json!({"domain": "adm", "hits_addend": 2,
        "descriptors": [{"entries": [{"key": "user", "value": "alice"}]}]}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (s, v) = post_json(&l, user(json!({}))).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(v["overallCode"], "OVER_LIMIT");
    assert_eq!(v["statuses"][0]["code"], "OVER_LIMIT");
    assert_eq!(v["statuses"][0]["durationUntilReset"], "30s");
    assert_eq!(
        v["responseHeadersToAdd"],
        json!([{"key": "retry-after", "value": "30"}])
    );
    // Refund one: admitted again.
    let (s, v) = post_json(&l, user(json!({"hitsAddend": 1, "isNegativeHits": true}))).await;
    assert_eq!((s, &v["overallCode"]), (StatusCode::OK, &json!("OK")));
    let (s, v) = post_json(&l, user(json!({}))).await;
    assert_eq!(
        (s, &v["statuses"][0]["limitRemaining"]),
        (StatusCode::OK, &json!(0))
    );
    // Override with a unit name; unlimited; unknown domain.
    let (s, v) = post_json(
        &l,
        json!({"domain": "adm", "descriptors": [{"entries": [{"key": "user", "value": "bob"}],
            "limit": {"requestsPerUnit": 9, "unit": "HOUR"}}]}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["statuses"][0]["currentLimit"]["unit"], "HOUR");
    let (_, v) = post_json(
        &l,
        json!({"domain": "adm", "descriptors": [{"entries": [{"key": "vip", "value": "v"}]}]}),
    )
    .await;
    assert_eq!(
        v["statuses"][0],
        json!({"code": "OK", "limitRemaining": 4294967295_u32})
    );
    let (_, v) = post_json(
        &l,
        json!({"domain": "nope", "descriptors": [{"entries": [{"key": "a", "value": "b"}]}]}),
    )
    .await;
    assert_eq!(v["statuses"][0], json!({"code": "OK", "limitRemaining": 0}));
}

#[tokio::test]
async fn json_rejects_bad_requests_with_400_and_storage_down_with_503() {
    let l = common::limiter(YAML, memory(), "b:");
    for (body, needle) in [
        ("{not json", "invalid RateLimitRequest JSON"),
        (
            r#"{"domain":"adm","descriptor":[]}"#,
            "unknown field `descriptor`",
        ),
        (
            r#"{"domain":"","descriptors":[{"entries":[]}]}"#,
            "domain must not be empty",
        ),
        (
            r#"{"domain":"adm","descriptors":[]}"#,
            "descriptor list must not be empty",
        ),
        (
            r#"{"domain":"adm","descriptors":[{"hitsAddend":-1}]}"#,
            "hitsAddend",
        ),
        (
            r#"{"domain":"adm","descriptors":[{"entries":[{"key":"user","value":"x"}],"limit":{"requestsPerUnit":1,"unit":"UNKNOWN"}}]}"#,
            "limit.unit",
        ),
        // Positional arrays are not protobuf JSON.
        (
            r#"["adm",[{"entries":[{"key":"user","value":"x"}]}]]"#,
            "expected a JSON object",
        ),
        ("  [1,2]", "expected a JSON object"),
    ] {
        let (s, ctype, b) = call(&l, "POST", "/json", body).await;
        assert_eq!(
            (s, ctype.as_str()),
            (StatusCode::BAD_REQUEST, "application/json"),
            "{body}: {b}"
        );
        let v: Value = serde_json::from_str(&b).unwrap();
        assert!(v["error"].as_str().unwrap().contains(needle), "{body}: {b}");
    }
    // Every other refusal has the same JSON shape: a body over axum's 2 MB
    // limit, a wrong method (with Allow), an unknown path.
    let big = format!(r#"{{"domain":"{}"}}"#, "x".repeat(3 << 20));
    for (method, path, body, want, needle) in [
        (
            "POST",
            "/json",
            big.as_str(),
            StatusCode::PAYLOAD_TOO_LARGE,
            "length limit",
        ),
        (
            "GET",
            "/json",
            "",
            StatusCode::METHOD_NOT_ALLOWED,
            "use POST",
        ),
        (
            "POST",
            "/metrics",
            "",
            StatusCode::METHOD_NOT_ALLOWED,
            "use GET",
        ),
        (
            "GET",
            "/nope",
            "",
            StatusCode::NOT_FOUND,
            "no endpoint /nope",
        ),
    ] {
        let (s, ctype, b) = call(&l, method, path, body).await;
        assert_eq!(
            (s, ctype.as_str()),
            (want, "application/json"),
            "{method} {path}: {b}"
        );
        let v: Value = serde_json::from_str(&b).unwrap();
        assert!(
            v["error"].as_str().unwrap().contains(needle),
            "{method} {path}: {b}"
        );
    }
    let down = common::limiter(YAML, Arc::new(Down), "b:");
    let (s, v) = post_json(
        &down,
        json!({"domain": "adm", "descriptors": [{"entries": [{"key": "user", "value": "a"}]}]}),
    )
    .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert!(v["error"].as_str().unwrap().contains("unavailable"), "{v}");
    // No storage needed: still answered while storage is down.
    let (s, _) = post_json(
        &down,
        json!({"domain": "adm", "descriptors": [{"entries": [{"key": "vip", "value": "v"}]}]}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_over_sockets_and_health_not_serving_while_draining() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

    let l = common::limiter(YAML, memory(), "s:");
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (grpc_addr, http_addr) = (grpc.local_addr().unwrap(), admin.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(app::run(
        Listeners { grpc, http: admin },
        l.clone(),
        async move {
            let _ = stopped.await;
        },
    ));

    let r = request(http_addr, "GET", "/healthcheck", None).await;
    assert_eq!((r.status, r.body.as_str()), (200, "OK\n"));
    let r = request(http_addr, "GET", "/rlconfig", None).await;
    assert_eq!(r.status, 200);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["hash"], json!(l.config().hash));
    let body = r#"{"domain":"adm","descriptors":[{"entries":[{"key":"user","value":"sock"}],"hitsAddend":3}]}"#;
    let r = request(http_addr, "POST", "/json", Some(body)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = request(http_addr, "POST", "/json", Some(body)).await;
    assert_eq!(r.status, 429, "{}", r.body);
    let r = request(http_addr, "GET", "/metrics", None).await;
    assert_eq!(r.status, 200);
    assert!(metric(&r.body, m::OVER_LIMIT, &[("rule", "adm.user")]).unwrap() >= 1.0);

    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc_addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let check = |s: HealthCheckResponse| ServingStatus::try_from(s.status).unwrap();
    let resp = health
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap();
    assert_eq!(check(resp.into_inner()), ServingStatus::Serving);
    let mut watch = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!(check(first), ServingStatus::Serving);

    stop.send(()).unwrap();
    let next = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("a status update while draining");
    assert_eq!(check(next.unwrap().unwrap()), ServingStatus::NotServing);
    drop(watch);
    drop(health);
    tokio::time::timeout(Duration::from_secs(15), server)
        .await
        .expect("the server stops after draining")
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_is_bounded_even_with_a_health_watch_held_open() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    let l = common::limiter(YAML, memory(), "g:");
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc_addr = grpc.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let grace = Duration::from_millis(300);
    let server = tokio::spawn(app::run_with_grace(
        Listeners { grpc, http: admin },
        l,
        async move {
            let _ = stopped.await;
        },
        grace,
    ));
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc_addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let mut watch = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    watch.message().await.unwrap().unwrap();
    let started = std::time::Instant::now();
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("shutdown bounded by the grace period")
        .unwrap()
        .unwrap();
    assert!(
        started.elapsed() >= grace,
        "in-flight work got the grace period"
    );
    drop(watch);
}

/// `POST /reset` takes the `/json` request: the buckets it maps to are
/// made full (the answer names the rules and buckets), the metric counts
/// them, and the same request is then admitted with `limitRemaining` =
/// burst − cost. Its method, content type and storage errors are those of
/// `/json`.
#[tokio::test]
async fn reset_makes_a_drained_bucket_full_and_says_which() {
    let l = common::limiter(YAML, memory(), "rs:");
    let body = json!({"domain": "adm", "descriptors": [
        {"entries": [{"key": "user", "value": "carol"}]},
        {"entries": [{"key": "vip", "value": "v"}]}]});
    let (s, _) = post_json(
        &l,
        json!({"domain": "adm", "hitsAddend": 3,
        "descriptors": [{"entries": [{"key": "user", "value": "carol"}]}]}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        post_json(&l, body.clone()).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    let before = resets();
    let (s, ctype, b) = call(&l, "POST", "/reset", &body.to_string()).await;
    assert_eq!((s, ctype.as_str()), (StatusCode::OK, "application/json"));
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(
        v,
        json!({"domain": "adm",
            "reset": [{"descriptor": 0, "rule": "adm.user", "name": "per_user",
                "byOverride": false, "bucket": "rs:d3:adm|k4:user=v5:carol",
                "wasDrained": true}],
            "notReset": [{"descriptor": 1, "reason": "unlimited"}]})
    );
    assert!(resets() - before >= 1.0, "counted");
    // burst 3 - cost 1.
    let (s, v) = post_json(&l, body.clone()).await;
    assert_eq!(
        (s, &v["statuses"][0]["limitRemaining"]),
        (StatusCode::OK, &json!(2))
    );
    let (s, _, _) = call(&l, "GET", "/reset", "").await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
    let req = Request::builder()
        .method("POST")
        .uri("/reset")
        .header("content-type", "text/plain")
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = bucket_rls::http::router(l.clone())
        .oneshot(req)
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let (s, _, b) = call(&l, "POST", "/reset", r#"{"domain": ""}"#).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    let down = common::limiter(YAML, Arc::new(Down), "rs:");
    let (s, _, b) = call(&down, "POST", "/reset", &body.to_string()).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{b}");
}

/// `bucket_rls_bucket_resets_total` as the admin port renders it.
fn resets() -> f64 {
    let text = bucket_rls::metrics::render_native("", SystemTime::now(), None);
    metric(&text, m::BUCKET_RESETS, &[]).unwrap_or(0.0)
}

/// Reading a quota without charging it: `/json` with a descriptor's
/// `hitsAddend` 0 answers what is left, with the RateLimit headers, and
/// takes nothing (a second read and the next charge see the same balance).
#[tokio::test]
async fn a_zero_cost_json_request_reads_the_quota_with_its_headers_without_charging() {
    let l = Arc::new(Limiter::new(
        common::config(&[("adm.yaml", YAML)]),
        memory(),
        bucket_rls::settings::ServiceSettings {
            key_prefix: "rd:".into(),
            rate_limit_headers: bucket_rls::settings::RateLimitHeaders::Draft03,
            ..Default::default()
        },
    ));
    let user = |hits: u64| {
        json!({"domain": "adm", "descriptors": [
            {"entries": [{"key": "user", "value": "dave"}], "hitsAddend": hits}]})
    };
    assert_eq!(post_json(&l, user(1)).await.0, StatusCode::OK);
    for _ in 0..2 {
        let (s, v) = post_json(&l, user(0)).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(v["statuses"][0]["limitRemaining"], json!(2));
        assert_eq!(
            v["responseHeadersToAdd"],
            json!([{"key": "ratelimit-limit", "value": "2, 2;w=60"},
                {"key": "ratelimit-remaining", "value": "2"},
                {"key": "ratelimit-reset", "value": "30"}]),
            "{v}"
        );
    }
    let (_, v) = post_json(&l, user(1)).await;
    assert_eq!(v["statuses"][0]["limitRemaining"], json!(1));
}
