//! End to end through a real Envoy: Envoy runs the bootstrap of
//! `examples/envoy/envoy.yaml` (ports and cluster addresses rewritten for
//! loopback), bucket-rls runs as its own process, and the upstream is an
//! axum server inside the test. Every test starts its own stack, so buckets
//! never leak between tests.
//!
//! The upstream answers `200 ok`; with `nowork` in the query it also sends
//! `x-ratelimit-refund: 1`, the signal of the refund recipe, and with
//! `tokens=N` it reports `x-tokens-used: N`, as an LLM upstream reports the
//! tokens a response used (the token budget recipe).

mod common;

use common::http::{HttpResponse, get as http_get, get_from as http_get_from};
use common::procs::{BucketRls, Envoy, envoy_for_loopback, yaml_file};
use common::redis::RedisServer;
use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit as ProtoUnit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use serde_json::Value;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

fn example(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/envoy")
        .join(rel)
}

/// The example's bucket-rls config (domain `edge`).
fn edge_config() -> String {
    std::fs::read_to_string(example("ratelimit/edge.yaml")).expect("read ratelimit/edge.yaml")
}

/// A test upstream: counts requests; `nowork` in the query asks for a
/// refund; `tokens=N` reports N tokens used; `hold` holds the answer until
/// the returned gate is opened (a response still running); every answer
/// echoes the request's `x-request-id` as `x-seen-request-id`.
async fn upstream() -> (SocketAddr, Arc<AtomicU64>, tokio::sync::watch::Sender<bool>) {
    let hits = Arc::new(AtomicU64::new(0));
    let counter = hits.clone();
    let (gate, opened) = tokio::sync::watch::channel(false);
    let app = axum::Router::new().fallback(
        move |uri: axum::http::Uri, req_headers: axum::http::HeaderMap| {
            let counter = counter.clone();
            let mut opened = opened.clone();
            async move {
                counter.fetch_add(1, Ordering::SeqCst);
                if uri
                    .query()
                    .is_some_and(|q| q.split('&').any(|p| p == "hold"))
                {
                    let _ = opened.wait_for(|open| *open).await;
                }
                let mut headers = axum::http::HeaderMap::new();
                if let Some(id) = req_headers.get("x-request-id") {
                    headers.insert("x-seen-request-id", id.clone());
                }
                if uri.query().is_some_and(|q| q.contains("nowork")) {
                    headers.insert(
                        "x-ratelimit-refund",
                        axum::http::HeaderValue::from_static("1"),
                    );
                }
                let tokens = uri
                    .query()
                    .and_then(|q| q.split('&').find_map(|p| p.strip_prefix("tokens=")));
                if let Some(v) = tokens.and_then(|t| axum::http::HeaderValue::from_str(t).ok()) {
                    headers.insert("x-tokens-used", v);
                }
                (headers, "ok\n")
            }
        },
    );
    let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .await
        .expect("bind upstream");
    let addr = listener.local_addr().expect("upstream addr");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("upstream server") });
    (addr, hits, gate)
}

/// Envoy + bucket-rls (one or more replicas) + upstream.
struct Stack {
    rls: Vec<BucketRls>,
    envoy: Envoy,
    upstream_hits: Arc<AtomicU64>,
    /// Opens the upstream's answers to `hold` requests.
    upstream_gate: tokio::sync::watch::Sender<bool>,
    /// The bucket-rls config directory (`edge.yaml` inside).
    config_dir: tempfile::TempDir,
}

impl Stack {
    /// Starts the stack with `rls_yaml` as the only file of bucket-rls's
    /// config directory (memory backend), and the example Envoy bootstrap,
    /// changed by `tweak`.
    async fn start(rls_yaml: &str, tweak: impl FnOnce(&mut Value)) -> Self {
        Self::start_with(rls_yaml, 1, &[], tweak).await
    }

    /// As [`Stack::start`], with `replicas` bucket-rls processes (all in
    /// Envoy's `bucket_rls` cluster, round robin) started with `rls_args`.
    async fn start_with(
        rls_yaml: &str,
        replicas: usize,
        rls_args: &[&str],
        tweak: impl FnOnce(&mut Value),
    ) -> Self {
        let config_dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(config_dir.path().join("edge.yaml"), rls_yaml).expect("write config");
        let mut rls = Vec::new();
        for _ in 0..replicas {
            rls.push(BucketRls::start(config_dir.path(), rls_args).await);
        }
        let grpc: Vec<SocketAddr> = rls.iter().map(|r| r.grpc).collect();
        let (up, upstream_hits, upstream_gate) = upstream().await;
        let mut bootstrap = envoy_for_loopback(
            yaml_file(&example("envoy.yaml")),
            &[("bucket_rls", &grpc), ("upstream", &[up])],
        );
        // The example's 100 ms budget is for production. A CI machine running
        // many tests on two cores can stall a process for longer, and a
        // timeout fails open (200) where a test expects 429: give 2 s here.
        ratelimit_filter(&mut bootstrap)["timeout"] = "2s".into();
        tweak(&mut bootstrap);
        let envoy = Envoy::start(&bootstrap).await;
        Self {
            rls,
            envoy,
            upstream_hits,
            upstream_gate,
            config_dir,
        }
    }

    async fn get(&self, path: &str, headers: &[(&str, &str)]) -> HttpResponse {
        http_get(self.envoy.listener, path, headers)
            .await
            .expect("request through Envoy")
    }

    async fn get_from(&self, ip: [u8; 4], path: &str) -> HttpResponse {
        http_get_from(
            IpAddr::V4(Ipv4Addr::from(ip)),
            self.envoy.listener,
            path,
            &[],
        )
        .await
        .expect("request through Envoy")
    }

    fn hits(&self) -> u64 {
        self.upstream_hits.load(Ordering::SeqCst)
    }
}

/// Envoy's rate limit timeout in the tests that check failures are fast.
/// A failure that waited for it would take this long; a fast failure (a
/// refused connection, bucket-rls's own `UNAVAILABLE`) must take less than
/// half of it, which no stall of a busy machine reaches.
const LONG_RLS_TIMEOUT: Duration = Duration::from_secs(10);

/// Sets Envoy's rate limit timeout to [`LONG_RLS_TIMEOUT`].
fn long_rls_timeout(bootstrap: &mut Value) {
    ratelimit_filter(bootstrap)["timeout"] = format!("{}s", LONG_RLS_TIMEOUT.as_secs()).into();
}

/// The `envoy.filters.http.ratelimit` typed_config in the bootstrap.
fn ratelimit_filter(bootstrap: &mut Value) -> &mut Value {
    let hcm = &mut bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"];
    let filters = hcm["http_filters"].as_array_mut().expect("http_filters");
    let f = filters
        .iter_mut()
        .find(|f| f["name"] == "envoy.filters.http.ratelimit")
        .expect("ratelimit filter in envoy.yaml");
    &mut f["typed_config"]
}

const KEY: (&str, &str) = ("x-api-key", "k1");
const LIMIT_HEADERS: [&str; 3] = [
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
];

/// The walkthrough of examples/envoy/README.md, on the example's config:
/// 5 per minute per API key (one token per 12 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budget_spent_then_429_with_rate_limit_headers_and_one_retry_after() {
    let s = Stack::start(&edge_config(), |_| {}).await;
    for i in 1..=5u64 {
        let r = s.get("/hello", &[KEY]).await;
        assert_eq!(r.status, 200, "request {i}: {r:?}");
        assert_eq!(
            r.header("x-ratelimit-limit"),
            Some(r#"5, 10;w=1;name="per_ip", 5;w=60;name="per_api_key""#)
        );
        assert_eq!(r.num("x-ratelimit-remaining"), 5 - i, "request {i}");
        // Until the key's bucket is full again: i tokens at 12 s each, minus
        // the few ms the test has taken, rounded up.
        assert_eq!(r.num("x-ratelimit-reset"), 12 * i, "request {i}");
        assert_eq!(r.header("retry-after"), None);
    }
    let r = s.get("/hello", &[KEY]).await;
    assert_eq!(r.status, 429, "{r:?}");
    assert_eq!(r.header("x-envoy-ratelimited"), Some("true"));
    assert_eq!(
        r.header("x-ratelimit-limit"),
        Some(r#"5, 10;w=1;name="per_ip", 5;w=60;name="per_api_key""#)
    );
    assert_eq!(r.num("x-ratelimit-remaining"), 0);
    // The next token is 12 s away (minus ms): 12 after rounding up, in both
    // headers; bucket-rls's retry-after is the only one (Envoy's
    // enable_retry_after_header never overwrites the service's).
    assert_eq!(r.num("x-ratelimit-reset"), 12);
    assert_eq!(r.all("retry-after"), vec!["12"]);
    assert_eq!(s.hits(), 5, "the 429 never reached the upstream");

    // Without a key only the per-IP rule applies, and it still has tokens.
    let r = s.get("/hello", &[]).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-ratelimit-limit"),
        Some(r#"10, 10;w=1;name="per_ip""#)
    );
}

/// One token per 2.5 s: the wait is fractional, so the headers must round it
/// up, and a client that comes back after the whole announced wait is
/// admitted, while one that comes back after the truncated wait is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_the_rounded_up_token_wait_and_waiting_it_is_enough() {
    let yaml = "domain: edge\ndescriptors:\n  - key: api_key\n    rate_limit: {name: slow, unit: minute, requests_per_unit: 24, burst: 1}\n";
    let s = Stack::start(yaml, |_| {}).await;
    assert_eq!(s.get("/a", &[KEY]).await.status, 200);
    let denied = s.get("/a", &[KEY]).await;
    let t0 = Instant::now();
    assert_eq!(denied.status, 429);
    // 2.5 s minus the ms since the charge: ceil gives 3, never 2.
    assert_eq!(denied.all("retry-after"), vec!["3"]);
    assert_eq!(denied.num("x-ratelimit-reset"), 3);
    assert_eq!(denied.num("x-ratelimit-remaining"), 0);

    // Coming back after 2 s (the wait truncated) is too early: 0.5 s left.
    tokio::time::sleep(Duration::from_secs(2).saturating_sub(t0.elapsed())).await;
    let early = s.get("/a", &[KEY]).await;
    assert_eq!(early.status, 429, "admitted before the announced wait");
    assert_eq!(early.all("retry-after"), vec!["1"]);

    // After the announced 3 s: admitted.
    tokio::time::sleep(Duration::from_secs(3).saturating_sub(t0.elapsed())).await;
    let r = s.get("/a", &[KEY]).await;
    assert_eq!(
        r.status, 200,
        "a client that waited retry-after was refused: {r:?}"
    );
}

/// The example's per-IP rule (10/s, burst 20): a burst of about 20 passes,
/// then about 10 per second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_then_steady_refill_rate() {
    let s = Stack::start(&edge_config(), |_| {}).await;
    let ip = [127, 0, 0, 2];
    let start = Instant::now();
    let mut burst = 0u64;
    // When the request that ended the burst was sent and answered.
    let burst_denied = loop {
        let sent = Instant::now();
        let r = s.get_from(ip, "/burst").await;
        if r.status == 429 {
            assert_eq!(r.all("retry-after"), vec!["1"]);
            break (sent, Instant::now());
        }
        assert_eq!(r.status, 200);
        burst += 1;
        assert!(burst < 100, "never limited");
    };
    let burst_secs = start.elapsed().as_secs_f64();
    // 20 tokens, plus what refilled while the burst was being sent.
    let most = 20.0 + 10.0 * burst_secs + 1.0;
    assert!(
        burst >= 20 && (burst as f64) <= most,
        "burst admitted {burst} in {burst_secs:.2} s"
    );
    eprintln!("burst: {burst} admitted in {burst_secs:.3} s");

    // Steady state for about 3 s: admitted at exactly the refill rate. Each
    // denial leaves less than one token, so between the burst's denial and
    // the last denial below the bucket admitted its refill (10 per second)
    // give or take one token. A request is served at some moment between
    // being sent and being answered, so the refill time lies between "first
    // answer to last send" and "first send to last answer": slow round
    // trips on a busy machine widen these bounds instead of breaking them.
    let steady = Instant::now();
    let (mut ok, mut denied) = (0u64, 0u64);
    let mut last_denial = None;
    while steady.elapsed() < Duration::from_secs(3) {
        let sent = Instant::now();
        match s.get_from(ip, "/steady").await.status {
            200 => ok += 1,
            429 => {
                denied += 1;
                last_denial = Some((ok, sent, Instant::now()));
            }
            other => panic!("status {other}"),
        }
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    eprintln!(
        "steady: {ok} admitted, {denied} denied in {:?}",
        steady.elapsed()
    );
    let (admitted, sent, answered) =
        last_denial.expect("the client was not limited in the steady phase");
    let most = 10.0 * answered.duration_since(burst_denied.0).as_secs_f64() + 1.0;
    let least = 10.0 * sent.saturating_duration_since(burst_denied.1).as_secs_f64() - 1.0;
    assert!(
        (admitted as f64) <= most && (admitted as f64) >= least,
        "{admitted} admitted before the last denial; the refill explains {least:.1} to {most:.1}"
    );
    assert!(ok > 0, "nothing admitted in the steady phase");

    // Another client (another source IP) has its own full bucket.
    assert_eq!(s.get_from([127, 0, 0, 3], "/other").await.status, 200);
}

/// docs/cases.md, "A denied request charges nothing", through Envoy: a request
/// denied by the export rule charges neither the key's nor the IP's bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_descriptor_does_not_charge_the_others() {
    let s = Stack::start(&edge_config(), |_| {}).await;
    for i in 1..=2u64 {
        let r = s.get("/v1/export", &[KEY]).await;
        assert_eq!(r.status, 200, "export {i}");
        // The export rule (2/hour) is the closest to its limit.
        assert_eq!(r.num("x-ratelimit-remaining"), 2 - i);
    }
    // Spellings of the same endpoint are the same rule (normalised path,
    // query string ignored by the example's header_value_match).
    for path in ["/v1/export?format=csv", "/v1/export/", "//v1/./export"] {
        let r = s.get(path, &[KEY]).await;
        assert_eq!(r.status, 429, "{path}");
        assert_eq!(
            r.header("x-ratelimit-limit"),
            Some(
                r#"2, 10;w=1;name="per_ip", 5;w=60;name="per_api_key", 2;w=3600;name="export_per_key""#
            )
        );
        // One export token per 30 minutes.
        assert_eq!(r.num("x-ratelimit-reset"), 1800);
        assert_eq!(r.all("retry-after"), vec!["1800"]);
    }
    assert_eq!(s.hits(), 2);
    // The key spent 2 tokens (the two admitted exports), not 5: this request
    // leaves 2. Charging denied requests would have left nothing (429).
    let r = s.get("/other", &[KEY]).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.num("x-ratelimit-remaining"), 2);
}

/// The refund recipe of `/v1/reports/`: charged on the way in, given back
/// when the upstream says it did no work; never refunded for a 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refund_on_stream_done_returns_the_token() {
    let s = Stack::start(&edge_config(), |_| {}).await;
    // The refund is sent when the stream ends, after the client has its
    // response; give it a moment to land before the next request.
    let settle = || tokio::time::sleep(Duration::from_millis(300));
    for i in 0..6 {
        let r = s.get("/v1/reports/daily?nowork=1", &[KEY]).await;
        assert_eq!(r.status, 200, "no-work request {i}");
        // Charged one of five; the previous one's token came back.
        assert_eq!(r.num("x-ratelimit-remaining"), 4, "no-work request {i}");
        assert_eq!(
            r.header("x-ratelimit-refund"),
            None,
            "the signal header leaks to the client"
        );
        settle().await;
    }
    // Six no-work requests on a budget of five: the budget is intact.
    for i in 1..=5u64 {
        let r = s.get("/v1/reports/daily", &[KEY]).await;
        assert_eq!(r.status, 200, "work request {i}");
        assert_eq!(r.num("x-ratelimit-remaining"), 5 - i);
        settle().await;
    }
    assert_eq!(s.get("/v1/reports/daily", &[KEY]).await.status, 429);
    // A 429 never reached the upstream, so nothing is refunded for it.
    let r = s.get("/v1/reports/daily?nowork=1", &[KEY]).await;
    assert_eq!(r.status, 429);
    settle().await;
    assert_eq!(
        s.get("/v1/reports/daily?nowork=1", &[KEY]).await.status,
        429
    );
    assert_eq!(s.hits(), 11);
}

/// The token budget recipe of `/v1/chat/` (1000 tokens per hour per key,
/// `max_debt: 1000`): requests pass while the key has budget left, each
/// charged after the response with the tokens the upstream reported; the
/// response that overdraws is still charged, and the next request is 429
/// with `retry-after` the real time to repay; another key is unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_budget_charged_after_the_response_goes_into_debt() {
    let s = Stack::start(&edge_config(), |_| {}).await;
    let alice = ("x-api-key", "alice");
    // Charges land when the stream is done, after the client has its
    // response: wait until the budget shows them.
    let remaining_is = |want: u64| {
        let s = &s;
        async move {
            common::eventually::eventually(
                Duration::from_secs(10),
                "the charge landed",
                || async {
                    let r = s.get("/v1/chat/ask", &[alice]).await;
                    (r.status == 200 && r.num("x-ratelimit-remaining") == want).then_some(())
                },
            )
            .await;
        }
    };
    for (tokens, left) in [(400, 600), (400, 200)] {
        let r = s
            .get(&format!("/v1/chat/ask?tokens={tokens}"), &[alice])
            .await;
        assert_eq!(r.status, 200);
        remaining_is(left).await;
    }
    // 200 left: let in, and its 400 tokens are charged anyway (-200).
    let r = s.get("/v1/chat/ask?tokens=400", &[alice]).await;
    assert_eq!(r.status, 200);
    // Probes report no tokens, so one let in before the charge lands costs
    // nothing.
    let (r, _) = common::eventually::eventually(Duration::from_secs(10), "in debt", || async {
        let r = s.get("/v1/chat/ask", &[alice]).await;
        (r.status == 429).then_some(r)
    })
    .await;
    // ceil(201 * 3.6 s) = 724 s, less the (sub-second) time since the charge.
    let wait = r.num("retry-after");
    assert!((723..=724).contains(&wait), "retry-after {wait}");
    assert_eq!(r.num("x-ratelimit-remaining"), 0);
    // The 429 was not charged: the wait is the same a moment later.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let again = s.get("/v1/chat/ask?tokens=400", &[alice]).await;
    assert_eq!(again.status, 429);
    assert!((723..=724).contains(&again.num("retry-after")));
    // Another key has its whole budget.
    let bob = s.get("/v1/chat/ask", &[("x-api-key", "bob")]).await;
    assert_eq!((bob.status, bob.num("x-ratelimit-remaining")), (200, 1000));
    // Three requests reached the upstream with a cost, plus the probes;
    // none after the 429s.
    assert!(s.hits() >= 3);
}

/// `failure_mode_deny: false` (the example): with bucket-rls gone, requests
/// pass unlimited, without rate limit headers, and Envoy counts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bucket_rls_down_fails_open_as_documented() {
    let mut s = Stack::start(&edge_config(), long_rls_timeout).await;
    for _ in 0..5 {
        assert_eq!(s.get("/x", &[KEY]).await.status, 200);
    }
    assert_eq!(s.get("/x", &[KEY]).await.status, 429);
    s.rls[0].proc.kill();
    for _ in 0..5 {
        let started = Instant::now();
        let r = s.get("/x", &[KEY]).await;
        assert_eq!(r.status, 200, "fail open: {r:?}");
        assert!(
            started.elapsed() < LONG_RLS_TIMEOUT / 2,
            "failed open only after {:?}: Envoy waited for its rate limit timeout",
            started.elapsed()
        );
        for h in LIMIT_HEADERS.iter().chain(&["retry-after"]) {
            assert_eq!(r.header(h), None, "{h} without a rate limit answer");
        }
    }
    assert_eq!(
        s.envoy
            .stat("cluster.upstream.ratelimit.failure_mode_allowed")
            .await,
        5
    );
    assert_eq!(s.hits(), 10);
}

/// The other choice, `failure_mode_deny: true`: bucket-rls gone means
/// `status_on_error` (503) and nothing reaches the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bucket_rls_down_with_failure_mode_deny_returns_503() {
    let mut s = Stack::start(&edge_config(), |b| {
        ratelimit_filter(b)["failure_mode_deny"] = true.into();
    })
    .await;
    assert_eq!(s.get("/x", &[KEY]).await.status, 200);
    s.rls[0].proc.kill();
    for _ in 0..3 {
        let r = s.get("/x", &[KEY]).await;
        assert_eq!(r.status, 503, "{r:?}");
    }
    assert_eq!(s.envoy.stat("cluster.upstream.ratelimit.error").await, 3);
    assert_eq!(s.hits(), 1);
}

/// A config change on disk (write to a temp file, rename over, as editors
/// and config management do) shows in Envoy's answers within 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_change_on_disk_takes_effect_through_envoy_within_2s() {
    let s = Stack::start(&edge_config(), |_| {}).await;
    let r = s.get("/x", &[("x-api-key", "before")]).await;
    assert_eq!(
        r.header("x-ratelimit-limit"),
        Some(r#"5, 10;w=1;name="per_ip", 5;w=60;name="per_api_key""#)
    );

    let changed = edge_config().replace(
        "name: per_api_key\n      unit: minute\n      requests_per_unit: 5",
        "name: per_api_key_v2\n      unit: minute\n      requests_per_unit: 7",
    );
    assert!(
        changed.contains("per_api_key_v2"),
        "the example config changed shape; update this test"
    );
    let tmp = s.config_dir.path().join(".edge.yaml.tmp");
    std::fs::write(&tmp, changed).expect("write");
    std::fs::rename(&tmp, s.config_dir.path().join("edge.yaml")).expect("rename");
    let changed_at = Instant::now();

    let want = r#"7, 10;w=1;name="per_ip", 7;w=60;name="per_api_key_v2""#;
    let mut n = 0;
    loop {
        // A fresh key each time, so the answer shows the rule, not a bucket.
        let key = format!("after-{n}");
        n += 1;
        // The target is on bucket-rls: a request sent 2 s after the change
        // must see it. Judged by the send time, so a slow round trip through
        // Envoy on a busy machine does not count against bucket-rls.
        let sent = changed_at.elapsed();
        let r = s.get("/x", &[("x-api-key", &key)]).await;
        if r.header("x-ratelimit-limit") == Some(want) {
            eprintln!(
                "config change visible through Envoy after {:?}",
                changed_at.elapsed()
            );
            break;
        }
        assert!(
            sent < Duration::from_secs(2),
            "still {:?} in a request sent {sent:?} after the change",
            r.header("x-ratelimit-limit")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Requests per host of an Envoy cluster, from the admin `/clusters` page.
async fn requests_per_host(envoy: &Envoy, cluster: &str) -> Vec<u64> {
    let page = http_get(envoy.admin, "/clusters", &[])
        .await
        .expect("GET /clusters")
        .body;
    page.lines()
        .filter(|l| l.starts_with(&format!("{cluster}::")) && l.contains("::rq_total::"))
        .map(|l| {
            l.rsplit("::")
                .next()
                .and_then(|n| n.parse().ok())
                .expect("rq_total")
        })
        .collect()
}

/// The docker-compose topology on loopback: two bucket-rls replicas on one
/// Redis, behind Envoy's round-robin cluster, share every bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_redis_share_the_budget() {
    let redis = RedisServer::start();
    let url = redis.url();
    let s = Stack::start_with(&edge_config(), 2, &["--redis-url", &url], |_| {}).await;
    for i in 1..=5u64 {
        let r = s.get("/hello", &[KEY]).await;
        assert_eq!(r.status, 200, "request {i}: {r:?}");
        assert_eq!(r.num("x-ratelimit-remaining"), 5 - i, "request {i}");
        assert_eq!(r.num("x-ratelimit-reset"), 12 * i, "request {i}");
    }
    let r = s.get("/hello", &[KEY]).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.num("x-ratelimit-reset"), 12);
    assert_eq!(r.all("retry-after"), vec!["12"]);
    let per_host = requests_per_host(&s.envoy, "bucket_rls").await;
    assert_eq!(per_host.len(), 2, "{per_host:?}");
    assert!(
        per_host.iter().all(|n| *n >= 2),
        "both replicas must have answered: {per_host:?}"
    );
}

/// Redis stopped: bucket-rls answers UNAVAILABLE within its Redis timeout, so
/// Envoy fails open (the example's choice) without noticeable delay; the
/// service stays up and limits again soon after Redis is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_fails_open_fast_and_recovers() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    let mut s =
        Stack::start_with(&edge_config(), 1, &["--redis-url", &url], long_rls_timeout).await;
    for _ in 0..5 {
        assert_eq!(s.get("/x", &[KEY]).await.status, 200);
    }
    assert_eq!(s.get("/x", &[KEY]).await.status, 429);

    redis.stop();
    let mut slowest = Duration::ZERO;
    for i in 0..10 {
        let started = Instant::now();
        let r = s.get("/x", &[KEY]).await;
        let took = started.elapsed();
        assert_eq!(r.status, 200, "request {i} with Redis down: {r:?}");
        assert!(
            took < LONG_RLS_TIMEOUT / 2,
            "request {i} took {took:?} with Redis down: not answered before Envoy's timeout"
        );
        slowest = slowest.max(took);
        for h in LIMIT_HEADERS.iter().chain(&["retry-after"]) {
            assert_eq!(r.header(h), None, "{h} without a rate limit answer");
        }
    }
    eprintln!("slowest request through Envoy with Redis down: {slowest:?}");
    assert_eq!(
        s.envoy
            .stat("cluster.upstream.ratelimit.failure_mode_allowed")
            .await,
        10
    );
    s.rls[0].proc.assert_running();

    // Redis back (empty): rate limit answers again within 5 s, no restart.
    redis.restart();
    let back = Instant::now();
    loop {
        let r = s.get("/x", &[KEY]).await;
        if r.header("x-ratelimit-limit").is_some() {
            assert_eq!(r.status, 200);
            assert_eq!(
                r.num("x-ratelimit-remaining"),
                4,
                "a fresh bucket after the Redis restart"
            );
            eprintln!("limits back {:?} after Redis restarted", back.elapsed());
            break;
        }
        assert!(
            back.elapsed() < Duration::from_secs(5),
            "no rate limit answers 5 s after Redis came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Redis stopped with `failure_mode_deny: true`: 503, nothing reaches the
/// upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_with_failure_mode_deny_returns_503() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    let s = Stack::start_with(&edge_config(), 1, &["--redis-url", &url], |b| {
        long_rls_timeout(b);
        ratelimit_filter(b)["failure_mode_deny"] = true.into();
    })
    .await;
    assert_eq!(s.get("/x", &[KEY]).await.status, 200);
    redis.stop();
    for _ in 0..3 {
        let started = Instant::now();
        assert_eq!(s.get("/x", &[KEY]).await.status, 503);
        // A 503 also follows Envoy's own timeout: this one must be
        // bucket-rls's UNAVAILABLE, well before that.
        assert!(
            started.elapsed() < LONG_RLS_TIMEOUT / 2,
            "503 after {:?}",
            started.elapsed()
        );
    }
    assert_eq!(s.hits(), 1);
}

/// The L4 example (`envoy-l4.yaml`, `ratelimit/tcp.yaml`): one check per new
/// connection; a client IP gets 10 connections at once, the 11th is closed
/// before reaching the upstream; another IP is unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l4_example_limits_new_connections_per_client_ip() {
    let config_dir = tempfile::tempdir().expect("tempdir");
    std::fs::copy(
        example("ratelimit/tcp.yaml"),
        config_dir.path().join("tcp.yaml"),
    )
    .expect("copy tcp.yaml");
    let rls = BucketRls::start(config_dir.path(), &[]).await;
    let (up, hits, _gate) = upstream().await;
    let mut bootstrap = envoy_for_loopback(
        yaml_file(&example("envoy-l4.yaml")),
        &[("bucket_rls", &[rls.grpc]), ("upstream", &[up])],
    );
    let filters = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
        .as_array_mut()
        .expect("filters");
    assert_eq!(filters[0]["name"], "envoy.filters.network.ratelimit");
    filters[0]["typed_config"]["timeout"] = "2s".into(); // as in Stack::start
    let envoy = Envoy::start(&bootstrap).await;

    let alice = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
    for i in 0..10 {
        let r = http_get_from(alice, envoy.listener, "/db", &[]).await;
        assert_eq!(r.map(|r| r.status).ok(), Some(200), "connection {i}");
    }
    let refused = http_get_from(alice, envoy.listener, "/db", &[]).await;
    assert!(
        refused.is_err(),
        "11th connection got an answer: {refused:?}"
    );
    assert_eq!(hits.load(Ordering::SeqCst), 10);
    assert_eq!(envoy.stat("ratelimit.postgres.over_limit").await, 1);

    let bob = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3));
    let r = http_get_from(bob, envoy.listener, "/db", &[])
        .await
        .expect("another client IP");
    assert_eq!(r.status, 200);
}

/// The docker-compose topology on loopback, running the README walkthrough:
/// the edge Envoy, the demo upstream (`upstream.yaml`, an Envoy), two
/// bucket-rls replicas on one Redis. The values asserted here are the ones
/// examples/envoy/README.md shows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compose_topology_on_loopback_matches_the_readme() {
    let redis = RedisServer::start();
    let url = redis.url();
    let config_dir = tempfile::tempdir().expect("tempdir");
    for f in ["edge.yaml", "tcp.yaml"] {
        std::fs::copy(
            example(&format!("ratelimit/{f}")),
            config_dir.path().join(f),
        )
        .expect("copy config");
    }
    let rls1 = BucketRls::start(config_dir.path(), &["--redis-url", &url]).await;
    let rls2 = BucketRls::start(config_dir.path(), &["--redis-url", &url]).await;
    let demo = Envoy::start(&envoy_for_loopback(
        yaml_file(&example("upstream.yaml")),
        &[],
    ))
    .await;
    let mut bootstrap = envoy_for_loopback(
        yaml_file(&example("envoy.yaml")),
        &[
            ("bucket_rls", &[rls1.grpc, rls2.grpc]),
            ("upstream", &[demo.listener]),
        ],
    );
    ratelimit_filter(&mut bootstrap)["timeout"] = "2s".into(); // as in Stack::start
    let edge = Envoy::start(&bootstrap).await;
    let get = |path: &'static str, key: &'static str| {
        let listener = edge.listener;
        async move {
            http_get(listener, path, &[("x-api-key", key)])
                .await
                .expect("curl")
        }
    };

    // 1. Five requests per minute per key.
    let r = get("/", "alice").await;
    assert_eq!((r.status, r.body.as_str()), (200, "hello from upstream\n"));
    assert_eq!(
        r.header("x-ratelimit-limit"),
        Some(r#"5, 10;w=1;name="per_ip", 5;w=60;name="per_api_key""#)
    );
    assert_eq!(
        (r.num("x-ratelimit-remaining"), r.num("x-ratelimit-reset")),
        (4, 12)
    );
    for i in 2..=5 {
        assert_eq!(get("/", "alice").await.status, 200, "alice {i}");
    }
    let r = get("/", "alice").await;
    assert_eq!(r.status, 429);
    assert_eq!(r.all("retry-after"), vec!["12"]);
    assert_eq!(
        (r.num("x-ratelimit-remaining"), r.num("x-ratelimit-reset")),
        (0, 12)
    );

    // 2. Exports: 2 per hour per key; a denied export costs nothing.
    assert_eq!(get("/v1/export", "bob").await.status, 200);
    assert_eq!(get("/v1/export", "bob").await.status, 200);
    let r = get("/v1/export", "bob").await;
    assert_eq!(r.status, 429);
    assert_eq!(r.all("retry-after"), vec!["1800"]);
    assert_eq!(get("/", "bob").await.num("x-ratelimit-remaining"), 2);

    // 3. Refunds: the demo upstream answers ?nowork=1 from "cache".
    for _ in 0..3 {
        let r = get("/v1/reports/daily?nowork=1", "carol").await;
        assert_eq!((r.status, r.body.as_str()), (200, "served from cache\n"));
        assert_eq!(r.num("x-ratelimit-remaining"), 4);
        assert_eq!(r.header("x-ratelimit-refund"), None);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(
        get("/v1/reports/daily", "carol")
            .await
            .num("x-ratelimit-remaining"),
        4
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        get("/v1/reports/daily", "carol")
            .await
            .num("x-ratelimit-remaining"),
        3
    );

    assert!(
        requests_per_host(&edge, "bucket_rls")
            .await
            .iter()
            .all(|n| *n > 0),
        "both replicas used"
    );
}

/// docs/cases.md, "The denying status drives the headers", through Envoy:
/// when one descriptor denies, the `X-RateLimit-*`
/// headers and `Retry-After` describe that descriptor (remaining 0, its
/// wait), not the one with tokens left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_denying_descriptor_drives_the_rate_limit_headers() {
    let yaml = "domain: edge\ndescriptors:\n  - key: api_key\n    rate_limit: {unit: minute, requests_per_unit: 60}\n    descriptors:\n      - key: path\n        value: /v1/export\n        rate_limit: {unit: hour, requests_per_unit: 5}\n";
    let s = Stack::start(yaml, |_| {}).await;
    for _ in 0..5 {
        assert_eq!(s.get("/v1/export", &[KEY]).await.status, 200);
    }
    let r = s.get("/v1/export", &[KEY]).await;
    assert_eq!(r.status, 429);
    // The per-minute rule still has 55 tokens; the hourly one has none and
    // its next token is 720 s away.
    assert_eq!(r.header("x-ratelimit-limit"), Some("5, 60;w=60, 5;w=3600"));
    assert_eq!(r.num("x-ratelimit-remaining"), 0);
    assert_eq!(r.num("x-ratelimit-reset"), 720);
    assert_eq!(r.all("retry-after"), vec!["720"]);
}

/// `rate_limited_as_resource_exhausted: true`: a limited gRPC call gets
/// grpc-status 8 (RESOURCE_EXHAUSTED) instead of 14 (UNAVAILABLE), which
/// gRPC retry policies would retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limited_grpc_calls_get_resource_exhausted() {
    let s = Stack::start(&edge_config(), |_| {}).await;
    let grpc = [KEY, ("content-type", "application/grpc")];
    for _ in 0..5 {
        assert_eq!(s.get("/pkg.Service/Method", &[KEY]).await.status, 200);
    }
    let r = s.get("/pkg.Service/Method", &grpc).await;
    assert_eq!(r.status, 200, "gRPC errors travel in grpc-status: {r:?}");
    assert_eq!(r.header("grpc-status"), Some("8"), "{r:?}");
    assert_eq!(r.all("retry-after"), vec!["12"]);
}

/// A stand-in rate limit service that always answers OVER_LIMIT with a 7 s
/// wait and the given `response_headers_to_add`.
struct FakeRls {
    headers: Vec<(&'static str, &'static str)>,
}

#[tonic::async_trait]
impl RateLimitService for FakeRls {
    async fn should_rate_limit(
        &self,
        _: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        Ok(tonic::Response::new(RateLimitResponse {
            overall_code: Code::OverLimit as i32,
            statuses: vec![DescriptorStatus {
                code: Code::OverLimit as i32,
                current_limit: Some(RateLimit {
                    name: "fake".into(),
                    requests_per_unit: 1,
                    unit: ProtoUnit::Minute as i32,
                }),
                limit_remaining: 0,
                duration_until_reset: Some(PbDuration {
                    seconds: 7,
                    nanos: 0,
                }),
                quota: None,
            }],
            response_headers_to_add: self
                .headers
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: (*k).into(),
                    value: (*v).into(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }))
    }
}

/// Who sets `Retry-After`: with `enable_retry_after_header: true` (the
/// example) Envoy adds its own from `duration_until_reset` when the service
/// sends none, and never adds a second one when the service sends it; the
/// service's value wins. bucket-rls always sends it, with the same value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_adds_retry_after_only_when_the_service_does_not() {
    for (headers, want) in [(vec![], "7"), (vec![("retry-after", "9")], "9")] {
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .expect("bind");
        let rls = listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(RateLimitServiceServer::new(FakeRls { headers }))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    async {
                        let _ = stopped.await;
                    },
                ),
        );
        let (up, hits, _gate) = upstream().await;
        let mut bootstrap = envoy_for_loopback(
            yaml_file(&example("envoy.yaml")),
            &[("bucket_rls", &[rls]), ("upstream", &[up])],
        );
        ratelimit_filter(&mut bootstrap)["timeout"] = "2s".into(); // as in Stack::start
        let envoy = Envoy::start(&bootstrap).await;
        let r = http_get(envoy.listener, "/", &[]).await.expect("request");
        assert_eq!(r.status, 429);
        assert_eq!(r.all("retry-after"), vec![want]);
        assert_eq!(r.num("x-ratelimit-reset"), 7);
        assert_eq!(hits.load(Ordering::SeqCst), 0);
        let _ = stop.send(());
        let _ = server.await;
    }
}

/// An upstream that answers `from <name>`.
async fn named_upstream(name: &'static str) -> SocketAddr {
    let app = axum::Router::new().fallback(move || async move { format!("from {name}\n") });
    let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .await
        .expect("bind upstream");
    let addr = listener.local_addr().expect("upstream addr");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("upstream server") });
    addr
}

/// Routing on the response's dynamic metadata (the Go service's multi-service
/// quota pattern): each request carries one quota descriptor per upstream
/// service; bucket-rls returns the `metadata` of the services that still
/// have quota, Envoy copies `service_with_quota.name` into `envoy.lb`
/// metadata, and the subset load balancer sends the request there. When no
/// service has quota left the request is denied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_on_dynamic_metadata_picks_the_upstream_with_quota() {
    let yaml = "domain: rl
descriptors:
  - key: service
    value: service_1
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 2}
    metadata: {service_with_quota: {name: service_1}}
  - key: service
    value: service_2
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 3}
    metadata: {service_with_quota: {name: service_2}}
";
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("rl.yaml"), yaml).expect("write config");
    let rls = BucketRls::start(dir.path(), &["--response-dynamic-metadata"]).await;
    let (s1, s2) = (
        named_upstream("service_1").await,
        named_upstream("service_2").await,
    );
    let endpoint = |addr: SocketAddr, service: &str| {
        serde_json::json!({
            "endpoint": {"address": {"socket_address": {
                "address": addr.ip().to_string(), "port_value": addr.port()}}},
            "metadata": {"filter_metadata": {"envoy.lb": {"service": service}}}
        })
    };
    let generic = |value: &str| {
        serde_json::json!({"actions": [{"generic_key": {
            "descriptor_key": "service", "descriptor_value": value}}]})
    };
    let bootstrap = serde_json::json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [{
                "name": "ingress",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "ingress",
                        "route_config": {"virtual_hosts": [{
                            "name": "all", "domains": ["*"],
                            "routes": [{"match": {"prefix": "/"}, "route": {
                                "cluster": "multiservice",
                                "rate_limits": [generic("service_1"), generic("service_2")]
                            }}]
                        }]},
                        "http_filters": [
                            {"name": "envoy.filters.http.ratelimit", "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
                                "domain": "rl",
                                "timeout": "2s",
                                "failure_mode_deny": true,
                                "rate_limit_service": {
                                    "grpc_service": {"envoy_grpc": {"cluster_name": "bucket_rls"}},
                                    "transport_api_version": "V3"}}},
                            {"name": "envoy.filters.http.header_mutation", "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
                                "mutations": {"request_mutations": [{"append": {
                                    "header": {"key": "x-service-with-quota",
                                        "value": "%DYNAMIC_METADATA(envoy.filters.http.ratelimit:metadata:service_with_quota:name)%"},
                                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}}]}}},
                            {"name": "envoy.filters.http.header_to_metadata", "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
                                "request_rules": [{"header": "x-service-with-quota",
                                    "on_header_present": {"metadata_namespace": "envoy.lb",
                                        "key": "service", "type": "STRING"}}]}},
                            {"name": "envoy.filters.http.router", "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
                        ]
                    }
                }]}]
            }],
            "clusters": [
                {
                    "name": "multiservice", "type": "STATIC", "connect_timeout": "1s",
                    "lb_subset_config": {"fallback_policy": "NO_FALLBACK",
                        "subset_selectors": [{"keys": ["service"]}]},
                    "load_assignment": {"cluster_name": "multiservice", "endpoints": [
                        {"lb_endpoints": [endpoint(s1, "service_1"), endpoint(s2, "service_2")]}]}
                },
                {
                    "name": "bucket_rls", "type": "STATIC", "connect_timeout": "1s",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "explicit_http_config": {"http2_protocol_options": {}}}},
                    "load_assignment": {"cluster_name": "bucket_rls", "endpoints": [{"lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {
                            "address": "127.0.0.1", "port_value": rls.grpc.port()}}}}]}]}
                }
            ]
        }
    });
    let envoy = Envoy::start(&bootstrap).await;
    let mut served = Vec::new();
    for _ in 0..5 {
        let r = http_get(envoy.listener, "/work", &[])
            .await
            .expect("request through Envoy");
        served.push(if r.status == 200 {
            r.body.trim().to_owned()
        } else {
            r.status.to_string()
        });
    }
    // Every request charges both services; service_1 (2 per minute) runs
    // out first, then service_2 (3 per minute), then nothing is left.
    assert_eq!(
        served,
        [
            "from service_1",
            "from service_1",
            "from service_2",
            "429",
            "429"
        ],
        "bucket-rls log:\n{}",
        rls.proc.logs()
    );
}

/// The reserve/settle route of the example (`/v1/llm/`: 500 tokens
/// reserved per request, settled with `x-tokens-used`) on a budget of 2200
/// tokens per year (no refill to speak of), reservations kept 3 s.
fn reserve_config() -> String {
    let yaml = edge_config()
        .replace(
            "reservation: {ttl_seconds: 3600}",
            "reservation: {ttl_seconds: 3}",
        )
        .replace(
            "name: llm_tokens_per_user\n          unit: hour\n          requests_per_unit: 2000",
            "name: llm_tokens_per_user\n          unit: year\n          requests_per_unit: 2200",
        );
    assert!(
        yaml.contains("ttl_seconds: 3}") && yaml.contains("requests_per_unit: 2200"),
        "the example's reservation rule changed shape; update this test"
    );
    yaml
}

/// A user's balance in whole tokens (0 in debt), asked of bucket-rls
/// directly with a settlement of 0 tokens for an id never reserved, which
/// changes nothing.
async fn llm_balance(s: &Stack, user: &str) -> u32 {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
        RateLimitDescriptor, rate_limit_descriptor::Entry,
    };
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    let mut client = RateLimitServiceClient::connect(format!("http://{}", s.rls[0].grpc))
        .await
        .expect("connect to bucket-rls");
    let entry = |k: &str, v: &str| Entry {
        key: k.into(),
        value: v.into(),
    };
    let d = RateLimitDescriptor {
        entries: vec![
            entry("user", user),
            entry("request_id", "balance-probe"),
            entry("phase", "settle"),
        ],
        hits_addend: Some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 }),
        ..Default::default()
    };
    let r = client
        .should_rate_limit(RateLimitRequest {
            domain: "edge".into(),
            descriptors: vec![d],
            hits_addend: 0,
        })
        .await
        .expect("answer")
        .into_inner();
    r.statuses[0].limit_remaining
}

/// A settlement sent again, as a second Envoy or a replay would: the
/// entries of `/v1/llm/`'s stream-done descriptor for request `id`.
async fn settle_again(s: &Stack, user: &str, id: &str, tokens: u64) {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
        RateLimitDescriptor, rate_limit_descriptor::Entry,
    };
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    let mut client = RateLimitServiceClient::connect(format!("http://{}", s.rls[0].grpc))
        .await
        .expect("connect to bucket-rls");
    let entry = |k: &str, v: &str| Entry {
        key: k.into(),
        value: v.into(),
    };
    let d = RateLimitDescriptor {
        entries: vec![
            entry("user", user),
            entry("request_id", id),
            entry("phase", "settle"),
        ],
        hits_addend: Some(envoy_types::pb::google::protobuf::UInt64Value { value: tokens }),
        ..Default::default()
    };
    let r = client
        .should_rate_limit(RateLimitRequest {
            domain: "edge".into(),
            descriptors: vec![d],
            hits_addend: 0,
        })
        .await
        .expect("answer")
        .into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32);
}

/// Waits until `user`'s balance is `want` whole tokens (settlements are
/// sent when a response ends, after the client has it).
async fn balance_becomes(s: &Stack, user: &str, want: u32) {
    common::eventually::eventually(Duration::from_secs(10), "the settlement landed", || async {
        (llm_balance(s, user).await == want).then_some(())
    })
    .await;
}

/// Reserve, then settle, through a real Envoy (examples/envoy/README.md,
/// "Reserve, then settle"): 20 concurrent calls reserving 500 on a budget
/// of 2200 admit exactly 4 while all are in flight, and the 16 denied take
/// nothing; once they end, each settlement leaves exactly the budget less
/// the tokens used (one above the estimate charges the difference);
/// another user has its own budget; a settlement sent twice is charged in
/// full the second time; a call whose client goes away before the answer
/// sends no settlement, and its estimate stays charged after the TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_then_settle_through_envoy_keeps_the_exact_budget() {
    let s = Arc::new(Stack::start(&reserve_config(), |_| {}).await);
    // A client that goes away while its response is held: Envoy resets
    // the stream before response headers and sends no settlement.
    let gone = tokio::spawn({
        let s = s.clone();
        async move {
            s.get("/v1/llm/a?hold&tokens=100", &[("x-api-key", "cat")])
                .await
        }
    });
    common::eventually::eventually(Duration::from_secs(10), "cat's call upstream", || async {
        (s.hits() == 1).then_some(())
    })
    .await;
    gone.abort();
    // 20 at once: tokens used 250, 400, 550 or 520 (550 and 520 above the
    // estimate), so any four admitted use at most 2200.
    let used = |i: u64| [250, 400, 550, 520][usize::try_from(i % 4).expect("small")];
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..20u64 {
        let s = s.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let r = s
                .get(
                    &format!("/v1/llm/a?hold&tokens={}", used(i)),
                    &[("x-api-key", "ann")],
                )
                .await;
            let _ = tx.send((i, r.status));
        });
    }
    drop(tx);
    // The denied ones answer while the admitted ones are held upstream.
    let mut denied = 0;
    while denied < 16 {
        let (_, status) = rx.recv().await.expect("an answer");
        assert_eq!(status, 429, "only 4 of 20 fit 2200 at 500 each");
        denied += 1;
    }
    common::eventually::eventually(Duration::from_secs(10), "4 held upstream", || async {
        (s.hits() == 5).then_some(())
    })
    .await;
    // 2200 - 4 x 500: the 16 denied reserves took nothing.
    assert_eq!(llm_balance(&s, "ann").await, 200);
    s.upstream_gate.send_replace(true);
    let mut spent = 0;
    while let Some((i, status)) = rx.recv().await {
        assert_eq!(status, 200);
        spent += used(i);
    }
    balance_becomes(&s, "ann", u32::try_from(2200 - spent).expect("small")).await;
    // Another user: its own 2200. A call that used 800 (300 above the
    // estimate) is charged 800.
    assert_eq!(llm_balance(&s, "bob").await, 2200);
    let r = s.get("/v1/llm/b?tokens=800", &[("x-api-key", "bob")]).await;
    assert_eq!(r.status, 200);
    balance_becomes(&s, "bob", 1400).await;
    // Its settlement again (as a replay would send it): no reservation is
    // open any more, so it is charged in full.
    let id = r
        .header("x-seen-request-id")
        .expect("the upstream saw x-request-id")
        .to_owned();
    settle_again(&s, "bob", &id, 800).await;
    assert_eq!(llm_balance(&s, "bob").await, 600);
    // ... down to the debt floor (-2000), which the next call shows as
    // a 429.
    settle_again(&s, "bob", &id, 10_000).await;
    let r = s.get("/v1/llm/b?tokens=1", &[("x-api-key", "bob")]).await;
    assert_eq!(r.status, 429);
    // The call whose client went away: after the TTL its reservation is
    // forgotten and its estimate stays charged.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(llm_balance(&s, "cat").await, 1700);
    let metrics = common::http::get(s.rls[0].http, "/metrics", &[])
        .await
        .expect("metrics");
    let count = |name: &str| -> u64 {
        metrics
            .body
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0)
    };
    assert_eq!(count("bucket_rls_reservations_opened_total "), 6);
    assert_eq!(count("bucket_rls_reservations_settled_total "), 5);
}

/// The `/v1/llm/` route's `rate_limits` in the bootstrap.
fn llm_rate_limits<'a>(bootstrap: &'a mut Value, prefix: &str) -> &'a mut Value {
    let hcm = &mut bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"];
    let routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
        .as_array_mut()
        .expect("routes");
    let route = routes
        .iter_mut()
        .find(|r| r["match"]["prefix"] == prefix)
        .expect("the route in envoy.yaml");
    &mut route["typed_per_filter_config"]["envoy.filters.http.ratelimit"]["rate_limits"]
}

/// What Envoy 1.40 sends when the numbers are missing (checked here, as
/// examples/envoy/README.md states it): with the estimate from
/// `%REQ(x-estimate)%`, a request without the header, or with a value that
/// is not a number, is let in unchecked (Envoy drops the request-time
/// descriptor); a response whose `x-tokens-used` is missing, negative, not
/// a number or above 2^32 gets no settlement, so its estimate stays
/// charged; `%CEL(request.size / 4)%` gives an estimate from the request's
/// size; a client's own `x-request-id` is replaced at this edge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_sends_no_reserve_or_settlement_without_a_number() {
    let s =
        Stack::start(&reserve_config(), |b| {
            let limits = llm_rate_limits(b, "/v1/llm/");
            limits[0]["hits_addend"] = serde_json::json!({"format": "%REQ(x-estimate)%"});
            // /v1/cel/: the same entries, the estimate a quarter of the size.
            let mut cel = limits.clone();
            cel[0]["hits_addend"] = serde_json::json!({"format": "%CEL(request.size / 4)%"});
            let hcm = &mut b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
                ["typed_config"];
            let routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
                .as_array_mut()
                .expect("routes");
            let mut route = routes
                .iter()
                .find(|r| r["match"]["prefix"] == "/v1/llm/")
                .expect("llm route")
                .clone();
            route["match"]["prefix"] = "/v1/cel/".into();
            route["typed_per_filter_config"]["envoy.filters.http.ratelimit"]["rate_limits"] = cel;
            routes.insert(0, route);
        })
        .await;
    let dan = ("x-api-key", "dan");
    // Drain dan's budget to the debt floor.
    settle_again(&s, "dan", "drain", 10_000).await;
    assert_eq!(
        s.get("/v1/llm/x?tokens=1", &[dan, ("x-estimate", "5")])
            .await
            .status,
        429
    );
    // No estimate, or one that is not a number: not checked at all.
    assert_eq!(s.get("/v1/llm/x", &[dan]).await.status, 200);
    assert_eq!(
        s.get("/v1/llm/x", &[dan, ("x-estimate", "abc")])
            .await
            .status,
        200
    );
    // Estimates of 100 whose responses report no usable number: no
    // settlement, each estimate stays charged. Then one that settles.
    let eve = ("x-api-key", "eve");
    for tokens in ["", "&tokens=-5", "&tokens=abc", "&tokens=4294967296"] {
        let r = s
            .get(
                &format!("/v1/llm/x?a=1{tokens}"),
                &[eve, ("x-estimate", "100")],
            )
            .await;
        assert_eq!(r.status, 200);
    }
    let r = s
        .get("/v1/llm/x?tokens=100", &[eve, ("x-estimate", "100")])
        .await;
    assert_eq!(r.status, 200);
    balance_becomes(&s, "eve", 2200 - 5 * 100).await;
    // At this edge (use_remote_address) Envoy replaces a client's
    // x-request-id with its own: a client cannot choose its ids.
    let r = s
        .get(
            "/v1/llm/x?tokens=1",
            &[
                eve,
                ("x-estimate", "1"),
                ("x-request-id", "chosen-by-client"),
            ],
        )
        .await;
    let seen = r
        .header("x-seen-request-id")
        .expect("an x-request-id upstream");
    assert_ne!(seen, "chosen-by-client");
    // %CEL(request.size / 4)%: a 400-byte body reserves 100.
    let body = "x".repeat(400);
    let r = common::http::send(
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        s.envoy.listener,
        "POST",
        "/v1/cel/x",
        &[("x-api-key", "fay")],
        Some(&body),
    )
    .await
    .expect("through Envoy");
    assert_eq!(r.status, 200);
    assert_eq!(llm_balance(&s, "fay").await, 2100);
}
