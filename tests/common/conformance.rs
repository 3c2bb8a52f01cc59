//! The service-level conformance suite: written once, run against every
//! storage backend (`conformance_tests!`). Cases come from `docs/cases.md`
//! with their exact expected values.
//!
//! Time is a paused [`ManualClock`]: the memory backend reads it directly; the
//! Redis backend passes it to the script as the test-only explicit `now`.

use super::{config, desc, desc_hits, req, unique_prefix};
use async_trait::async_trait;
use bucket_rls::grpc::ShouldRateLimit as _;
use bucket_rls::limiter::Limiter;
use bucket_rls::settings::ServiceSettings;
use bucket_rls::storage::clock::ManualClock;
use bucket_rls::storage::memory::MemoryStorage;
use bucket_rls::storage::{Charge, RequestResult, Storage, StorageError};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A storage backend under test.
#[async_trait]
pub trait Backend: Send + Sync {
    /// A storage whose notion of "now" is `clock`.
    async fn storage(&self, clock: ManualClock) -> Arc<dyn Storage>;

    /// Whether one request's keys are checked and charged in one atomic step
    /// (true for memory and a single Redis node; a Redis Cluster reserves per
    /// slot and refunds, which never over-admits but may under-admit under
    /// concurrency).
    fn atomic_across_keys(&self) -> bool {
        true
    }
}

/// The embedded memory backend.
pub struct MemoryBackend;

#[async_trait]
impl Backend for MemoryBackend {
    async fn storage(&self, clock: ManualClock) -> Arc<dyn Storage> {
        Arc::new(MemoryStorage::new(Arc::new(clock)))
    }
}

/// The single-node Redis backend on a server of its own (`redis-server`,
/// or `valkey-server` for the Valkey run), with the test-only explicit
/// clock (the paused `ManualClock` is sent to the script as `now_us`).
pub struct RedisBackend {
    /// The server; stopped when the case ends.
    pub server: super::redis::RedisServer,
}

#[async_trait]
impl Backend for RedisBackend {
    async fn storage(&self, clock: ManualClock) -> Arc<dyn Storage> {
        // A generous timeout: these cases test answers, not latency.
        let s = bucket_rls::storage::redis::RedisStorage::builder(self.server.url())
            .timeout(Duration::from_secs(2))
            .test_clock(Arc::new(clock))
            .build()
            .expect("valid URL");
        Arc::new(s)
    }
}

/// Wraps a storage and counts calls, to assert "no storage access".
#[derive(Debug)]
pub struct Counting {
    inner: Arc<dyn Storage>,
    calls: AtomicU64,
}

#[async_trait]
impl Storage for Counting {
    async fn apply(&self, charges: &[Charge]) -> Result<RequestResult, StorageError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.apply(charges).await
    }
    async fn ping(&self) -> Result<(), StorageError> {
        self.inner.ping().await
    }
    async fn reset(&self, keys: &[&str]) -> Result<Vec<bool>, StorageError> {
        self.inner.reset(keys).await
    }
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn invalidate_local_cache(&self) {
        self.inner.invalidate_local_cache();
    }
    fn sweep(&self) {
        self.inner.sweep();
    }
    fn hold_existing(&self, prefix: &str, hold_us: u64) {
        self.inner.hold_existing(prefix, hold_us);
    }
}

/// One case: a limiter on a fresh key prefix, its clock and a storage call counter.
pub struct Case {
    /// The service core.
    pub limiter: Arc<Limiter>,
    /// The paused clock.
    pub clock: ManualClock,
    storage: Arc<Counting>,
}

/// A realistic epoch start (2023-11-14), in microseconds.
pub const T0_US: u64 = 1_700_000_000_000_000;

impl Case {
    /// Builds a case for one YAML file.
    pub async fn new(b: &dyn Backend, yaml: &str) -> Self {
        Self::with_settings(b, yaml, |_| {}).await
    }

    /// Builds a case for one YAML file with settings changed by `tune`.
    pub async fn with_settings(
        b: &dyn Backend,
        yaml: &str,
        tune: impl FnOnce(&mut ServiceSettings),
    ) -> Self {
        let clock = ManualClock::new(T0_US);
        let storage = Arc::new(Counting {
            inner: b.storage(clock.clone()).await,
            calls: AtomicU64::new(0),
        });
        let mut settings = ServiceSettings {
            key_prefix: unique_prefix("conf"),
            ..ServiceSettings::default()
        };
        tune(&mut settings);
        let limiter = Arc::new(Limiter::new(
            config(&[("test.yaml", yaml)]),
            storage.clone(),
            settings,
        ));
        Self {
            limiter,
            clock,
            storage,
        }
    }

    /// Calls the service; panics on a gRPC error.
    pub async fn call(&self, r: RateLimitRequest) -> RateLimitResponse {
        self.limiter
            .should_rate_limit(&r)
            .await
            .unwrap_or_else(|s| panic!("unexpected gRPC error {s:?} for {r:?}"))
    }

    /// One-descriptor call with request-level `hits`.
    pub async fn one(
        &self,
        domain: &str,
        entries: &[(&str, &str)],
        hits: u32,
    ) -> RateLimitResponse {
        self.call(req(domain, vec![desc(entries)], hits)).await
    }

    /// Moves the paused clock forward.
    pub fn advance_ms(&self, ms: u64) {
        self.clock.advance(Duration::from_millis(ms));
    }

    /// Number of storage calls so far.
    pub fn storage_calls(&self) -> u64 {
        self.storage.calls.load(Ordering::SeqCst)
    }

    /// Applies a new config as a reload would.
    pub fn reload(&self, yaml: &str) {
        self.limiter.swap_config(config(&[("test.yaml", yaml)]));
    }
}

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;

/// `(code, limit_remaining, duration seconds)` of status `i`.
pub fn st(r: &RateLimitResponse, i: usize) -> (i32, u32, Option<i64>) {
    let s = &r.statuses[i];
    if let Some(d) = &s.duration_until_reset {
        assert_eq!(d.nanos, 0, "durations are whole seconds");
    }
    (
        s.code,
        s.limit_remaining,
        s.duration_until_reset.as_ref().map(|d| d.seconds),
    )
}

/// `(code, remaining)` of status `i`.
pub fn cr(r: &RateLimitResponse, i: usize) -> (i32, u32) {
    (r.statuses[i].code, r.statuses[i].limit_remaining)
}

/// Asserts status `i` is "no limit": OK, no current_limit, remaining 0, no duration.
pub fn assert_no_limit(r: &RateLimitResponse, i: usize) {
    let s = &r.statuses[i];
    assert_eq!(
        (
            s.code,
            s.current_limit.is_none(),
            s.limit_remaining,
            s.duration_until_reset.is_none()
        ),
        (OK, true, 0, true),
        "{s:?}"
    );
}

fn rpu(r: &RateLimitResponse, i: usize) -> u32 {
    r.statuses[i]
        .current_limit
        .as_ref()
        .map_or(u32::MAX, |l| l.requests_per_unit)
}

fn retry_after(r: &RateLimitResponse) -> Option<String> {
    r.response_headers_to_add
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case("retry-after"))
        .map(|h| h.value.clone())
}

/// docs/cases.md, "Misspelt keys fail loudly": a misspelt key never loads; a
/// rejected reload keeps the old config.
pub async fn misspelt_key_never_loads_and_a_bad_reload_keeps_the_old_config(b: &dyn Backend) {
    let v1 = "domain: edge\ndescriptors:\n  - key: remote_address\n    value: 10.0.0.7\n    descriptors:\n      - key: api_path\n        value: /api\n        rate_limit: {unit: minute, requests_per_unit: 1}\n";
    let typo = v1.replace(
        "rate_limit: {unit: minute, requests_per_unit: 1}",
        "rate_limit:\n          unlimied: true",
    );
    let err = bucket_rls::config::compile::compile_texts(&[(
        "edge.yaml".into(),
        typo.clone().into_bytes(),
    )])
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("edge.yaml")
            && err.contains("unknown key 'unlimied'")
            && err.contains("descriptors[0](key=remote_address, value=10.0.0.7).descriptors[0](key=api_path, value=/api).rate_limit: "),
        "{err}"
    );
    let c = Case::new(b, v1).await;
    let e = [("remote_address", "10.0.0.7"), ("api_path", "/api")];
    assert_eq!(cr(&c.one("edge", &e, 1).await, 0), (OK, 0));
    assert_eq!(cr(&c.one("edge", &e, 1).await, 0).0, OVER);
    // The reload fails to compile, so nothing is swapped: v1 still applies.
    assert!(
        bucket_rls::config::compile::compile_texts(&[("edge.yaml".into(), typo.into_bytes())])
            .is_err()
    );
    assert_eq!(cr(&c.one("edge", &e, 1).await, 0).0, OVER);
    // The other IP has no rule at depth 2 with that value.
    assert_no_limit(
        &c.one(
            "edge",
            &[("remote_address", "10.0.0.8"), ("api_path", "/api")],
            1,
        )
        .await,
        0,
    );
}

/// docs/cases.md, "A zero rate blocks": `requests_per_unit: 0` blocks; duration
/// one unit; nothing stored.
pub async fn zero_rate_blocks_for_one_unit(b: &dyn Backend) {
    let c = Case::new(b, "domain: block\ndescriptors:\n  - key: user_agent\n    value: bad-scanner\n    rate_limit: {unit: minute, requests_per_unit: 0}\n").await;
    for hits in [1, 1, 1, 0] {
        let r = c.one("block", &[("user_agent", "bad-scanner")], hits).await;
        assert_eq!(st(&r, 0), (OVER, 0, Some(60)));
        assert_eq!(r.overall_code, OVER);
        let l = r.statuses[0].current_limit.as_ref().expect("current_limit");
        assert_eq!((l.requests_per_unit, l.unit), (0, 2 /* MINUTE */));
        assert_eq!(retry_after(&r).as_deref(), Some("60"));
    }
    let r = c
        .call(req(
            "block",
            vec![desc_hits(&[("user_agent", "bad-scanner")], 0)],
            0,
        ))
        .await;
    assert_eq!(st(&r, 0), (OVER, 0, Some(60)));
}

/// docs/cases.md, "Wildcards": wildcards at every level, one bucket per value,
/// exact beats wildcard.
pub async fn wildcards_nest_and_bucket_per_value(b: &dyn Backend) {
    let c = Case::new(
        b,
        r"
domain: test-domain
descriptors:
  - key: path
    value: /api/*
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: path
    value: /api/special
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: tenant
    value: acme
    descriptors:
      - key: path
        value: /files/*
        rate_limit: {unit: minute, requests_per_unit: 1}
",
    )
    .await;
    let d = "test-domain";
    assert_eq!(cr(&c.one(d, &[("path", "/api/a")], 1).await, 0), (OK, 1));
    assert_eq!(cr(&c.one(d, &[("path", "/api/a")], 1).await, 0), (OK, 0));
    assert_eq!(cr(&c.one(d, &[("path", "/api/a")], 1).await, 0).0, OVER);
    assert_eq!(cr(&c.one(d, &[("path", "/api/b")], 1).await, 0), (OK, 1));
    for want in (0..5).rev() {
        let r = c.one(d, &[("path", "/api/special")], 1).await;
        assert_eq!(cr(&r, 0), (OK, want));
        assert_eq!(rpu(&r, 0), 5);
    }
    assert_no_limit(&c.one(d, &[("path", "/api")], 1).await, 0);
    assert_eq!(cr(&c.one(d, &[("path", "/api/")], 1).await, 0), (OK, 1));
    assert_eq!(
        cr(
            &c.one(d, &[("tenant", "acme"), ("path", "/files/x")], 1)
                .await,
            0
        ),
        (OK, 0)
    );
    assert_eq!(
        cr(
            &c.one(d, &[("tenant", "acme"), ("path", "/files/x")], 1)
                .await,
            0
        )
        .0,
        OVER
    );
    assert_no_limit(
        &c.one(d, &[("tenant", "other"), ("path", "/files/x")], 1)
            .await,
        0,
    );
}

/// `share_threshold`: all values of a wildcard share one bucket.
pub async fn share_threshold(b: &dyn Backend) {
    let c = Case::new(b, "domain: s\ndescriptors:\n  - key: path\n    value: /api/*\n    share_threshold: true\n    rate_limit: {unit: minute, requests_per_unit: 2}\n").await;
    assert_eq!(cr(&c.one("s", &[("path", "/api/a")], 1).await, 0), (OK, 1));
    assert_eq!(cr(&c.one("s", &[("path", "/api/b")], 1).await, 0), (OK, 0));
    assert_eq!(cr(&c.one("s", &[("path", "/api/c")], 1).await, 0).0, OVER);
}

/// docs/cases.md, "Depth must match": depth must match; key-only rules have one
/// bucket per value.
pub async fn depth_must_match_and_key_only_buckets_per_value(b: &dyn Backend) {
    let c = Case::new(
        b,
        "domain: example\ndescriptors:\n  - key: svc\n    value: api\n    rate_limit: {unit: minute, requests_per_unit: 1}\n    descriptors:\n      - key: caller\n        rate_limit: {unit: minute, requests_per_unit: 2}\n",
    )
    .await;
    let d = "example";
    assert_eq!(cr(&c.one(d, &[("svc", "api")], 1).await, 0), (OK, 0));
    assert_eq!(cr(&c.one(d, &[("svc", "api")], 1).await, 0).0, OVER);
    assert_eq!(
        cr(&c.one(d, &[("svc", "api"), ("caller", "a")], 1).await, 0),
        (OK, 1)
    );
    assert_eq!(
        cr(&c.one(d, &[("svc", "api"), ("caller", "a")], 1).await, 0),
        (OK, 0)
    );
    assert_eq!(
        cr(&c.one(d, &[("svc", "api"), ("caller", "a")], 1).await, 0).0,
        OVER
    );
    assert_eq!(
        cr(&c.one(d, &[("svc", "api"), ("caller", "b")], 1).await, 0),
        (OK, 1)
    );
    let calls = c.storage_calls();
    assert_no_limit(
        &c.one(d, &[("svc", "api"), ("caller", "a"), ("extra", "x")], 1)
            .await,
        0,
    );
    assert_eq!(c.storage_calls(), calls, "no storage access without a rule");
}

/// docs/cases.md, "Unlimited applies to its own tuple": `unlimited` applies
/// only to its own tuple and never touches storage.
pub async fn unlimited_applies_to_its_own_tuple_only(b: &dyn Backend) {
    let c = Case::new(
        b,
        r"
domain: edge
descriptors:
  - key: remote_address
    value: 10.0.0.7
    rate_limit: {unlimited: true}
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: PATH
    value: /v2/items
    descriptors:
      - key: remote_address
        rate_limit: {unit: second, requests_per_unit: 5}
",
    )
    .await;
    for _ in 0..100 {
        let r = c.one("edge", &[("remote_address", "10.0.0.7")], 1).await;
        let s = &r.statuses[0];
        assert_eq!(
            (
                s.code,
                s.current_limit.is_none(),
                s.limit_remaining,
                s.duration_until_reset.is_none()
            ),
            (OK, true, u32::MAX, true)
        );
    }
    assert_eq!(c.storage_calls(), 0, "unlimited never touches storage");
    for want in (0..5).rev() {
        assert_eq!(
            cr(
                &c.one("edge", &[("remote_address", "10.0.0.8")], 1).await,
                0
            ),
            (OK, want)
        );
    }
    assert_eq!(
        cr(
            &c.one("edge", &[("remote_address", "10.0.0.8")], 1).await,
            0
        )
        .0,
        OVER
    );
    for want in (0..5).rev() {
        assert_eq!(
            cr(
                &c.one(
                    "edge",
                    &[("PATH", "/v2/items"), ("remote_address", "10.0.0.7")],
                    1
                )
                .await,
                0
            ),
            (OK, want)
        );
    }
    assert_eq!(
        cr(
            &c.one(
                "edge",
                &[("PATH", "/v2/items"), ("remote_address", "10.0.0.7")],
                1
            )
            .await,
            0
        )
        .0,
        OVER
    );
}

/// docs/cases.md, "Replaces": `replaces` drops the named limit for that request
/// only.
pub async fn replaces_drops_the_named_limit_for_that_request(b: &dyn Backend) {
    let c = Case::new(
        b,
        r"
domain: quota
descriptors:
  - key: group
    value: reads
    descriptors:
      - key: user
        value: alice
        rate_limit: {name: reads_user, unit: minute, requests_per_unit: 2}
  - key: endpoint
    value: get_item
    descriptors:
      - key: user
        value: alice
        rate_limit:
          replaces: [{name: reads_user}]
          unit: minute
          requests_per_unit: 5
",
    )
    .await;
    let both = || {
        req(
            "quota",
            vec![
                desc(&[("group", "reads"), ("user", "alice")]),
                desc(&[("endpoint", "get_item"), ("user", "alice")]),
            ],
            1,
        )
    };
    for want in (0..5).rev() {
        let r = c.call(both()).await;
        assert_eq!(r.overall_code, OK);
        assert_no_limit(&r, 0);
        assert_eq!(cr(&r, 1), (OK, want));
    }
    let r = c.call(both()).await;
    assert_eq!(r.overall_code, OVER);
    assert_no_limit(&r, 0);
    assert_eq!(cr(&r, 1).0, OVER);
    assert_eq!(
        cr(
            &c.one("quota", &[("group", "reads"), ("user", "alice")], 1)
                .await,
            0
        ),
        (OK, 1)
    );
    assert_eq!(
        cr(
            &c.one("quota", &[("group", "reads"), ("user", "alice")], 1)
                .await,
            0
        ),
        (OK, 0)
    );
    assert_eq!(
        cr(
            &c.one("quota", &[("group", "reads"), ("user", "alice")], 1)
                .await,
            0
        )
        .0,
        OVER
    );
}

/// docs/cases.md, "Shadow mode": shadow mode keeps accounting, answers OK,
/// never short-circuits.
pub async fn shadow_mode_counts_but_never_denies(b: &dyn Backend) {
    let c = Case::new(
        b,
        "domain: sm\ndescriptors:\n  - key: user\n    value: bob\n    shadow_mode: true\n    rate_limit: {unit: minute, requests_per_unit: 2}\n  - key: route\n    value: r1\n    rate_limit: {unit: minute, requests_per_unit: 3}\n",
    )
    .await;
    let call = || {
        req(
            "sm",
            vec![desc(&[("user", "bob")]), desc(&[("route", "r1")])],
            1,
        )
    };
    let r = c.call(call()).await;
    assert_eq!(
        (r.overall_code, cr(&r, 0), cr(&r, 1)),
        (OK, (OK, 1), (OK, 2))
    );
    let r = c.call(call()).await;
    assert_eq!(
        (r.overall_code, cr(&r, 0), cr(&r, 1)),
        (OK, (OK, 0), (OK, 1))
    );
    let r = c.call(call()).await;
    assert_eq!(
        (r.overall_code, cr(&r, 0), cr(&r, 1)),
        (OK, (OK, 0), (OK, 0))
    );
    assert!(
        st(&r, 0).2.is_some_and(|d| d >= 1),
        "shadowed status carries the wait"
    );
    assert!(retry_after(&r).is_none());
    let r = c.call(call()).await;
    assert_eq!(
        (r.overall_code, cr(&r, 0), cr(&r, 1).0),
        (OVER, (OK, 0), OVER)
    );
}

/// docs/cases.md, "Costs above the remaining tokens": a cost above the
/// remaining tokens is denied without consuming.
pub async fn cost_above_remaining_is_denied_without_consuming(b: &dyn Backend) {
    let c = Case::new(
        b,
        "domain: d\ndescriptors:\n  - key: api_key\n    value: k1\n    rate_limit: {unit: minute, requests_per_unit: 10}\n  - key: api_key\n    value: k2\n    rate_limit: {unit: minute, requests_per_unit: 10}\n",
    )
    .await;
    let k1 = [("api_key", "k1")];
    assert_eq!(st(&c.one("d", &k1, 8).await, 0), (OK, 2, Some(48)));
    assert_eq!(st(&c.one("d", &k1, 5).await, 0), (OVER, 0, Some(18)));
    assert_eq!(st(&c.one("d", &k1, 2).await, 0), (OK, 0, Some(60)));
    let r = c.one("d", &k1, 1).await;
    assert_eq!(st(&r, 0), (OVER, 0, Some(6)));
    assert_eq!(retry_after(&r).as_deref(), Some("6"));
    let r = c.call(req("d", vec![desc_hits(&k1, 1_000_000)], 0)).await;
    assert_eq!(st(&r, 0), (OVER, 0, Some(60)));
    // The huge cost changed nothing: still one token after 6 s.
    c.advance_ms(6_000);
    assert_eq!(st(&c.one("d", &k1, 1).await, 0), (OK, 0, Some(60)));
    let k2 = [("api_key", "k2")];
    for want in [2, 1, 0] {
        let hits = if want == 2 { 8 } else { 1 };
        assert_eq!(cr(&c.one("d", &k2, hits).await, 0), (OK, want));
    }
    assert_eq!(cr(&c.one("d", &k2, 1).await, 0).0, OVER);
}

/// One request with several descriptors on the same bucket (the same
/// descriptor twice, or two values of a `share_threshold` wildcard): a denial
/// reports the wait until the whole request fits, not only its own cost, so
/// a client retrying after `retry-after` is admitted.
pub async fn same_bucket_twice_waits_for_all(b: &dyn Backend) {
    let c = Case::new(
        b,
        "domain: d\ndescriptors:\n  - key: slow\n    rate_limit: {unit: minute, requests_per_unit: 6, burst: 5}\n  - key: sh\n    value: p*\n    share_threshold: true\n    rate_limit: {unit: minute, requests_per_unit: 1, burst: 10}\n",
    )
    .await;
    let d1 = [("slow", "d1")];
    assert_eq!(
        cr(&c.call(req("d", vec![desc_hits(&d1, 2)], 0)).await, 0),
        (OK, 3)
    );
    // 3 tokens; the request needs 2 + 2: one token short at 0.1 token/s.
    let twice = || req("d", vec![desc_hits(&d1, 2), desc_hits(&d1, 2)], 0);
    let r = c.call(twice()).await;
    assert_eq!(r.overall_code, OVER);
    assert_eq!(st(&r, 1), (OVER, 0, Some(10)));
    assert_eq!(retry_after(&r).as_deref(), Some("10"));
    c.advance_ms(9_000);
    assert_eq!(c.call(twice()).await.overall_code, OVER);
    c.advance_ms(1_000);
    let r = c.call(twice()).await;
    assert_eq!((r.overall_code, cr(&r, 1)), (OK, (OK, 0)));

    // Shared bucket: 7 left, [p1 cost 4, p2 cost 4] is one token short at
    // 1 token/min.
    let r = c
        .call(req("d", vec![desc_hits(&[("sh", "p0")], 3)], 0))
        .await;
    assert_eq!(cr(&r, 0), (OK, 7));
    let pair = || {
        req(
            "d",
            vec![desc_hits(&[("sh", "p1")], 4), desc_hits(&[("sh", "p2")], 4)],
            0,
        )
    };
    let r = c.call(pair()).await;
    assert_eq!(st(&r, 1), (OVER, 0, Some(60)));
    assert_eq!(retry_after(&r).as_deref(), Some("60"));
    c.advance_ms(60_000);
    assert_eq!(c.call(pair()).await.overall_code, OK);
}

/// A reload that raises a burst or slows a rate never refills a drained
/// bucket, even once the bucket would have been full under the old limit
/// (when the memory backend sweeps full buckets and Redis keys expire).
pub async fn loosening_reload_never_refills(b: &dyn Backend) {
    let rule = |r: &str| format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{{r}}}\n");
    let c = Case::new(b, &rule("unit: minute, requests_per_unit: 60, burst: 5")).await;
    let spend = |v: &'static str, n: u64| req("d", vec![desc_hits(&[("k", v)], n)], 0);
    assert_eq!(cr(&c.call(spend("a", 5)).await, 0), (OK, 0));
    // Burst 5 -> 100: 10 s later (past the old time to full, 5 s), 10
    // tokens at 1 per second, not 100.
    c.reload(&rule("unit: minute, requests_per_unit: 60, burst: 100"));
    c.advance_ms(10_000);
    c.storage.sweep();
    assert_eq!(cr(&c.call(spend("a", 0)).await, 0), (OK, 10));
    // Drained at 1 per second (full again in 100 s), then slowed to 1 per
    // hour: 200 s later it has less than one token, not 100.
    assert_eq!(cr(&c.call(spend("b", 100)).await, 0), (OK, 0));
    c.reload(&rule("unit: hour, requests_per_unit: 1, burst: 100"));
    c.advance_ms(200_000);
    c.storage.sweep();
    assert_eq!(cr(&c.call(spend("b", 0)).await, 0), (OVER, 0));
}

/// docs/cases.md, "Zero hits": request-level 0 means 1; a per-descriptor
/// explicit 0 only checks.
pub async fn zero_hits_means_one_and_descriptor_zero_only_checks(b: &dyn Backend) {
    let c = Case::new(
        b,
        "domain: d\ndescriptors:\n  - key: tenant\n    value: t1\n    rate_limit: {unit: minute, requests_per_unit: 10}\n  - key: tenant\n    value: t2\n    rate_limit: {unit: minute, requests_per_unit: 10}\n  - key: tenant\n    value: t3\n    rate_limit: {unit: minute, requests_per_unit: 10}\n",
    )
    .await;
    let t1 = [("tenant", "t1")];
    assert_eq!(cr(&c.one("d", &t1, 0).await, 0), (OK, 9));
    assert_eq!(cr(&c.one("d", &t1, 3).await, 0), (OK, 6));
    assert_eq!(
        cr(&c.call(req("d", vec![desc_hits(&t1, 0)], 0)).await, 0),
        (OK, 6)
    );
    assert_eq!(
        cr(&c.call(req("d", vec![desc_hits(&t1, 6)], 0)).await, 0),
        (OK, 0)
    );
    let r = c.call(req("d", vec![desc_hits(&t1, 0)], 0)).await;
    assert_eq!(st(&r, 0), (OVER, 0, Some(6)));
    let r = c
        .call(req(
            "d",
            vec![desc(&[("tenant", "t2")]), desc_hits(&[("tenant", "t3")], 5)],
            2,
        ))
        .await;
    assert_eq!((cr(&r, 0), cr(&r, 1)), ((OK, 8), (OK, 5)));
}

/// docs/cases.md, "Admissions never exceed the refill", first part: 3/s polled
/// every 100 ms for 3 s admits exactly 11; no impossible remaining.
pub async fn polling_admits_exactly_the_refill(b: &dyn Backend) {
    let c = Case::new(b, "domain: d\ndescriptors:\n  - key: k\n    value: a\n    rate_limit: {unit: second, requests_per_unit: 3}\n").await;
    let mut admitted = 0;
    let mut after_over = false;
    for i in 0..30 {
        if i > 0 {
            c.advance_ms(100);
        }
        let r = c.one("d", &[("k", "a")], 1).await;
        let (code, rem) = cr(&r, 0);
        if code == OK {
            admitted += 1;
            if after_over {
                assert_eq!(
                    rem, 0,
                    "call {i}: remaining after an OVER_LIMIT must be explained by refill"
                );
            }
            if i >= 2 {
                assert_ne!(rem, 2, "call {i}");
            }
        } else {
            after_over = true;
            assert!(st(&r, 0).2.is_some_and(|d| d >= 1));
        }
    }
    assert_eq!(admitted, 11);
}

/// Deterministic xorshift for reproducible pseudo-random sequences.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// docs/cases.md, "Admissions never exceed the refill", second part: random
/// costs and gaps; every answer equals the reference model, admissions never
/// exceed `C + r*T + 1`, remaining never exceeds `C`, and every OVER_LIMIT
/// duration is at least 1 s and honest (a retry after it is admitted).
pub async fn random_traffic_matches_the_reference_model(b: &dyn Backend) {
    use bucket_rls::storage::algorithm::{
        self, BucketLimit, ChargeKind, ChargeSpec, Limit, MICRO, State,
    };
    for (ci, cap) in [1u64, 7, 100, 4_294_967_295].into_iter().enumerate() {
        for unit in ["second", "minute"] {
            let unit_secs = if unit == "second" { 1 } else { 60 };
            let yaml = format!(
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{unit: {unit}, requests_per_unit: {cap}}}\n"
            );
            let c = Case::new(b, &yaml).await;
            let limit = Limit::TokenBucket(BucketLimit {
                requests_per_unit: u32::try_from(cap).unwrap_or(u32::MAX),
                unit_secs: std::num::NonZeroU64::new(unit_secs).expect("a unit"),
                burst: u32::try_from(cap).unwrap_or(u32::MAX),
                max_debt: 0,
            });
            let mut model: Option<State> = None;
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (ci as u64 * 31 + unit_secs));
            let mut admitted_log: Vec<(u64, u64)> = Vec::new(); // (time us, hits)
            let mut t_us = 0u64;
            for step in 0..400 {
                let gap_ms = rng.below(2001);
                c.advance_ms(gap_ms);
                t_us += gap_ms * 1000;
                let hits = 1 + rng.below(cap.min(1 << 20));
                let r = c
                    .call(req("d", vec![desc_hits(&[("k", "v")], hits)], 0))
                    .await;
                let now = T0_US + t_us;
                let spec = ChargeSpec {
                    limit,
                    cost: hits,
                    kind: ChargeKind::Consume,
                    shadow: false,
                };
                let mut put = None;
                let want =
                    algorithm::apply_request(&[(0, spec)], &[model], now, |_, s| put = Some(s));
                if let Some(s) = put {
                    model = Some(s);
                }
                let (code, rem, dur) = st(&r, 0);
                assert_eq!(code == OK, want.admitted, "cap {cap} {unit} step {step}");
                assert_eq!(
                    u64::from(rem),
                    want.charges[0].remaining_micro.unsigned_abs() / MICRO
                        * u64::from(want.admitted),
                    "cap {cap} {unit} step {step}"
                );
                assert!(u64::from(rem) <= cap);
                if code == OK {
                    admitted_log.push((t_us, hits));
                } else {
                    assert!(dur.is_some_and(|d| d >= 1));
                }
            }
            // Admissions over any window [a, b] stay within C + r*(b-a) + 1.
            for i in 0..admitted_log.len() {
                let mut sum = 0u128;
                for j in i..admitted_log.len() {
                    sum += u128::from(admitted_log[j].1);
                    let span_us = u128::from(admitted_log[j].0 - admitted_log[i].0);
                    let bound = u128::from(cap)
                        + u128::from(cap) * span_us / (u128::from(unit_secs) * 1_000_000)
                        + 1;
                    assert!(sum <= bound, "cap {cap} {unit}: {sum} hits in {span_us} us");
                }
            }
        }
    }
}

/// docs/cases.md, "Waits are rounded up", the property: a retry after the
/// reported duration is admitted.
pub async fn retry_after_the_reported_wait_is_admitted(b: &dyn Backend) {
    let c = Case::new(
        b,
        "domain: d\ndescriptors:\n  - key: k\n    value: a\n    rate_limit: {unit: minute, requests_per_unit: 6}\n  - key: k\n    value: b\n    rate_limit: {unit: second, requests_per_unit: 2}\n",
    )
    .await;
    let a = [("k", "a")];
    assert_eq!(st(&c.one("d", &a, 6).await, 0), (OK, 0, Some(60)));
    c.advance_ms(2_500);
    assert_eq!(st(&c.one("d", &a, 1).await, 0), (OVER, 0, Some(8)));
    c.advance_ms(2_500);
    assert_eq!(st(&c.one("d", &a, 1).await, 0), (OVER, 0, Some(5)));
    c.advance_ms(4_500);
    assert_eq!(st(&c.one("d", &a, 1).await, 0), (OVER, 0, Some(1)));
    c.advance_ms(550);
    assert_eq!(cr(&c.one("d", &a, 1).await, 0).0, OK);
    let bb = [("k", "b")];
    assert_eq!(st(&c.one("d", &bb, 2).await, 0), (OK, 0, Some(1)));
    c.advance_ms(100);
    let r = c.one("d", &bb, 1).await;
    assert_eq!(st(&r, 0), (OVER, 0, Some(1)));
    assert_eq!(retry_after(&r).as_deref(), Some("1"));
    c.advance_ms(1_000);
    assert_eq!(cr(&c.one("d", &bb, 1).await, 0).0, OK);
}

/// docs/cases.md, "A denied request charges nothing": a request denied by one
/// descriptor consumes none of the others.
pub async fn denied_request_charges_no_other_bucket(b: &dyn Backend) {
    let yaml = "domain: api\ndescriptors:\n  - key: group\n    value: reports\n    rate_limit: {unit: minute, requests_per_unit: 10}\n  - key: special\n    value: export\n    rate_limit: {unit: minute, requests_per_unit: 3}\n";
    let c = Case::new(b, yaml).await;
    let both = || {
        req(
            "api",
            vec![
                desc(&[("group", "reports")]),
                desc(&[("special", "export")]),
            ],
            1,
        )
    };
    for (g, s) in [(9, 2), (8, 1), (7, 0)] {
        let r = c.call(both()).await;
        assert_eq!(
            (r.overall_code, cr(&r, 0), cr(&r, 1)),
            (OK, (OK, g), (OK, s))
        );
    }
    for _ in 0..2 {
        let r = c.call(both()).await;
        assert_eq!(r.overall_code, OVER);
        assert_eq!(cr(&r, 0), (OK, 7));
        assert_eq!(st(&r, 1), (OVER, 0, Some(20)));
    }
    for want in (0..7).rev() {
        assert_eq!(
            cr(&c.one("api", &[("group", "reports")], 1).await, 0),
            (OK, want)
        );
    }
    assert_eq!(
        cr(&c.one("api", &[("group", "reports")], 1).await, 0).0,
        OVER
    );
    // 50 concurrent callers: at most 3 admitted on special, and group charged only for those.
    let c = Arc::new(Case::new(b, yaml).await);
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let c = c.clone();
            tokio::spawn(async move {
                c.call(req(
                    "api",
                    vec![
                        desc(&[("group", "reports")]),
                        desc(&[("special", "export")]),
                    ],
                    1,
                ))
                .await
                .overall_code
                    == OK
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        if t.await.expect("task") {
            admitted += 1;
        }
    }
    if b.atomic_across_keys() {
        assert_eq!(admitted, 3);
    } else {
        // Per-slot reservations can under-admit while another request's
        // reservation is being refunded; they never over-admit.
        assert!((1..=3).contains(&admitted), "admitted {admitted}");
    }
    // group was charged exactly for the admitted requests.
    assert_eq!(
        cr(&c.one("api", &[("group", "reports")], 1).await, 0),
        (OK, 9 - admitted)
    );
}

/// docs/cases.md, "High rates and large numbers": very high rates and huge
/// costs neither overflow nor disable limiting.
pub async fn high_rates_and_huge_costs_do_not_overflow(b: &dyn Backend) {
    let c = Arc::new(
        Case::new(
            b,
            "domain: d\ndescriptors:\n  - key: k\n    value: fast\n    rate_limit: {unit: second, requests_per_unit: 6000}\n  - key: k\n    value: huge\n    rate_limit: {unit: second, requests_per_unit: 1000000}\n  - key: k\n    value: max\n    rate_limit: {unit: day, requests_per_unit: 4294967295}\n",
        )
        .await,
    );
    // 64 concurrent streams, 12,000 calls, paused clock: exactly the burst.
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let c = c.clone();
            tokio::spawn(async move {
                let mut ok = 0u32;
                for _ in 0..(12_000 / 64 + u32::from(i < 12_000 % 64)) {
                    if c.one("d", &[("k", "fast")], 1).await.overall_code == OK {
                        ok += 1;
                    }
                }
                ok
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.expect("task");
    }
    assert_eq!(admitted, 6000);
    let huge = [("k", "huge")];
    assert_eq!(cr(&c.one("d", &huge, 1_000_000).await, 0), (OK, 0));
    assert_eq!(
        st(&c.one("d", &huge, 1_000_000).await, 0),
        (OVER, 0, Some(1))
    );
    c.advance_ms(1_100);
    assert_eq!(cr(&c.one("d", &huge, 1_000_000).await, 0).0, OK);
    let max = [("k", "max")];
    assert_eq!(
        st(&c.one("d", &max, 1).await, 0),
        (OK, 4_294_967_294, Some(1))
    );
    c.advance_ms(10);
    assert_eq!(
        st(
            &c.call(req("d", vec![desc_hits(&max, 4_294_967_295)], 0))
                .await,
            0
        ),
        (OK, 0, Some(86_400))
    );
    assert_eq!(
        st(
            &c.call(req("d", vec![desc_hits(&max, 4_294_967_295)], 0))
                .await,
            0
        ),
        (OVER, 0, Some(86_400))
    );
    assert_eq!(
        st(
            &c.call(req("d", vec![desc_hits(&max, 1 << 40)], 0)).await,
            0
        ),
        (OVER, 0, Some(86_400))
    );
    assert_eq!(
        st(
            &c.call(req("d", vec![desc_hits(&max, u64::MAX)], 0)).await,
            0
        ),
        (OVER, 0, Some(86_400))
    );
}

/// docs/cases.md, "The denying status drives the headers": durations are always
/// set; the denying status has remaining 0.
pub async fn durations_set_and_denial_has_zero_remaining(b: &dyn Backend) {
    let c = Case::new(
        b,
        "domain: llm\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 60}\n  - key: spend\n    rate_limit: {unit: hour, requests_per_unit: 5}\n",
    )
    .await;
    assert_eq!(
        st(&c.one("llm", &[("user", "u1")], 1).await, 0),
        (OK, 59, Some(1))
    );
    let mut last = None;
    for _ in 0..5 {
        last = Some(c.one("llm", &[("spend", "u1")], 1).await);
    }
    assert_eq!(st(&last.expect("calls"), 0), (OK, 0, Some(3600)));
    c.advance_ms(500);
    let r = c
        .call(req(
            "llm",
            vec![desc(&[("user", "u1")]), desc(&[("spend", "u1")])],
            1,
        ))
        .await;
    assert_eq!(r.overall_code, OVER);
    assert_eq!(st(&r, 0), (OK, 59, Some(1)));
    assert_eq!(st(&r, 1), (OVER, 0, Some(720)));
    assert_eq!(retry_after(&r).as_deref(), Some("720"));
    // Variant: an over-cost request on a bucket with 2 tokens left still reports 0.
    assert_eq!(cr(&c.one("llm", &[("spend", "u2")], 3).await, 0), (OK, 2));
    assert_eq!(cr(&c.one("llm", &[("spend", "u2")], 3).await, 0), (OVER, 0));
    // A full bucket: duration 0 only when checking without consuming.
    let r = c
        .call(req("llm", vec![desc_hits(&[("user", "fresh")], 0)], 0))
        .await;
    assert_eq!(st(&r, 0), (OK, 60, Some(0)));
}

/// docs/cases.md, "Changed limits apply to existing buckets": a changed limit
/// applies to existing buckets at once, both ways.
pub async fn changed_limit_applies_to_existing_buckets(b: &dyn Backend) {
    let cfg = |rate: u32| {
        format!(
            "domain: d\ndescriptors:\n  - key: tenant\n    value: t1\n    rate_limit: {{unit: minute, requests_per_unit: {rate}}}\n"
        )
    };
    let t1 = [("tenant", "t1")];
    // Lower.
    let c = Case::new(b, &cfg(100)).await;
    assert_eq!(cr(&c.one("d", &t1, 10).await, 0), (OK, 90));
    c.advance_ms(1_000);
    c.reload(&cfg(10));
    c.advance_ms(1_000);
    let r = c.one("d", &t1, 1).await;
    assert_eq!((cr(&r, 0), rpu(&r, 0)), ((OK, 9), 10));
    for want in (0..9).rev() {
        assert_eq!(cr(&c.one("d", &t1, 1).await, 0), (OK, want));
    }
    assert_eq!(cr(&c.one("d", &t1, 1).await, 0).0, OVER);
    // Raise.
    let c = Case::new(b, &cfg(10)).await;
    assert_eq!(cr(&c.one("d", &t1, 3).await, 0), (OK, 7));
    c.advance_ms(1_000);
    c.reload(&cfg(1000));
    c.advance_ms(1_000);
    let r = c.one("d", &t1, 1).await;
    assert_eq!((r.statuses[0].code, rpu(&r, 0)), (OK, 1000));
    assert!((6..=39).contains(&r.statuses[0].limit_remaining), "{r:?}");
    // A cached OVER_LIMIT must not survive a raise.
    let c = Case::new(b, &cfg(1)).await;
    assert_eq!(cr(&c.one("d", &t1, 1).await, 0).0, OK);
    assert_eq!(cr(&c.one("d", &t1, 1).await, 0).0, OVER);
    assert_eq!(cr(&c.one("d", &t1, 1).await, 0).0, OVER);
    // A reload takes a moment; at 100/min one second refills 1.67 tokens, while
    // a stale "empty until +60 s" cache entry would still deny.
    c.advance_ms(1_000);
    c.reload(&cfg(100));
    assert_eq!(cr(&c.one("d", &t1, 1).await, 0).0, OK);
}

/// docs/cases.md, "Rewriting the config never refills": reloading an identical
/// config never refills a bucket.
pub async fn identical_reload_never_refills(b: &dyn Backend) {
    let yaml = "domain: d\ndescriptors:\n  - key: k\n    value: v\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";
    let c = Case::new(b, yaml).await;
    assert_eq!(cr(&c.one("d", &[("k", "v")], 2).await, 0), (OK, 0));
    c.reload(yaml);
    assert_eq!(cr(&c.one("d", &[("k", "v")], 1).await, 0).0, OVER);
}

/// Refunds (`is_negative_hits`) give tokens back, capped, and are never OVER_LIMIT.
pub async fn refunds(b: &dyn Backend) {
    let c = Case::new(b, "domain: d\ndescriptors:\n  - key: k\n    value: v\n    rate_limit: {unit: hour, requests_per_unit: 3}\n").await;
    let v = [("k", "v")];
    assert_eq!(cr(&c.one("d", &v, 3).await, 0), (OK, 0));
    let refund = |n: u64| RateLimitDescriptor {
        is_negative_hits: true,
        ..desc_hits(&v, n)
    };
    let r = c.call(req("d", vec![refund(1)], 0)).await;
    assert_eq!((r.overall_code, cr(&r, 0)), (OK, (OK, 1)));
    assert_eq!(cr(&c.one("d", &v, 1).await, 0), (OK, 0));
    // A refund never raises a bucket above full.
    let r = c.call(req("d", vec![refund(100)], 0)).await;
    assert_eq!(cr(&r, 0), (OK, 3));
    assert_eq!(cr(&c.one("d", &v, 3).await, 0), (OK, 0));
    assert_eq!(cr(&c.one("d", &v, 1).await, 0).0, OVER);
}

/// Per-request `limit` overrides replace the rule's rate; UNKNOWN unit is invalid.
pub async fn overrides(b: &dyn Backend) {
    let c = Case::new(b, "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 100}\n").await;
    let with = |rpu: u32, unit: i32| RateLimitDescriptor {
        limit: Some(RateLimitOverride {
            requests_per_unit: rpu,
            unit,
        }),
        ..desc(&[("k", "v")])
    };
    let r = c.call(req("d", vec![with(2, 1 /* SECOND */)], 1)).await;
    assert_eq!((cr(&r, 0), rpu(&r, 0)), ((OK, 1), 2));
    assert_eq!(cr(&c.call(req("d", vec![with(2, 1)], 1)).await, 0), (OK, 0));
    assert_eq!(
        st(&c.call(req("d", vec![with(2, 1)], 1)).await, 0),
        (OVER, 0, Some(1))
    );
    let e = c
        .limiter
        .should_rate_limit(&req("d", vec![with(2, 0 /* UNKNOWN */)], 1))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
}

/// `POST /reset` (the limiter's reset): the buckets a request maps to are
/// made full, the same request is then admitted with `limit_remaining` =
/// burst − cost, and no other bucket changes (a drained neighbour stays
/// drained). On Redis the local over-limit cache, which learned the
/// denial, is cleared with it.
pub async fn a_reset_makes_the_requests_buckets_full(b: &dyn Backend) {
    use bucket_rls::limiter::{Descriptor, Request};
    let c = Case::new(
        b,
        "domain: d
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 5, name: per_user}
  - key: route
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: vip
    rate_limit: {unlimited: true}
",
    )
    .await;
    let both = || {
        req(
            "d",
            vec![desc(&[("user", "bob")]), desc(&[("route", "r1")])],
            3,
        )
    };
    let r = c.call(both()).await;
    assert_eq!((cr(&r, 0), cr(&r, 1)), ((OK, 2), (OK, 7)));
    let r = c.call(both()).await;
    assert_eq!(r.overall_code, OVER);
    // Twice, so a cached denial would answer the second.
    assert_eq!(c.call(both()).await.overall_code, OVER);
    // A neighbour drained too.
    assert_eq!(cr(&c.one("d", &[("user", "eve")], 5).await, 0), (OK, 0));
    let reset = Request {
        domain: "d",
        descriptors: vec![
            Descriptor::new(vec![("user", "bob")]),
            Descriptor::new(vec![("route", "r1")]),
            Descriptor::new(vec![("user", "ann")]),
            Descriptor::new(vec![("vip", "x")]),
            Descriptor::new(vec![("nomatch", "x")]),
        ],
        hits_addend: 0,
    };
    let out = c.limiter.reset(&reset).await.expect("reset");
    let summary: Vec<(usize, Option<&str>, Option<&str>, bool)> = out
        .reset
        .iter()
        .map(|b| {
            (
                b.descriptor,
                b.rule.as_deref(),
                b.name.as_deref(),
                b.was_drained,
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            (0, Some("d.user"), Some("per_user"), true),
            (1, Some("d.route"), None, true),
            (2, Some("d.user"), Some("per_user"), false),
        ]
    );
    let not: Vec<(usize, &str)> = out
        .not_reset
        .iter()
        .map(|n| (n.descriptor, n.reason))
        .collect();
    assert_eq!(not, [(3, "unlimited"), (4, "no limit")]);
    // Full again: burst - cost.
    let r = c.call(both()).await;
    assert_eq!((cr(&r, 0), cr(&r, 1)), ((OK, 2), (OK, 7)));
    // The neighbour was not reset.
    assert_eq!(c.one("d", &[("user", "eve")], 1).await.overall_code, OVER);
    // An unknown domain resets nothing.
    let unknown = Request {
        domain: "nope",
        ..reset
    };
    let out = c.limiter.reset(&unknown).await.expect("reset");
    assert!(out.reset.is_empty() && out.not_reset.len() == 5, "{out:?}");
}

/// docs/cases.md, "Unknown and malformed domains": unknown domain is OK/no
/// limit; empty domain or list is INVALID_ARGUMENT.
pub async fn unknown_domain_ok_and_empty_request_invalid(b: &dyn Backend) {
    let c = Case::new(b, "domain: api\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: minute, requests_per_unit: 10}\n").await;
    for _ in 0..100 {
        let r = c
            .one("ambassador", &[("remote_address", "10.0.0.9")], 1)
            .await;
        assert_eq!(r.overall_code, OK);
        assert_no_limit(&r, 0);
    }
    assert_eq!(c.storage_calls(), 0);
    let e = c
        .limiter
        .should_rate_limit(&req("", vec![desc(&[("remote_address", "10.0.0.9")])], 1))
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (tonic::Code::InvalidArgument, "domain must not be empty")
    );
    let e = c
        .limiter
        .should_rate_limit(&req("api", vec![], 1))
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (
            tonic::Code::InvalidArgument,
            "descriptor list must not be empty"
        )
    );
    let r = c.call(req("api", vec![desc(&[])], 1)).await;
    assert_eq!(r.overall_code, OK);
    assert_no_limit(&r, 0);
}

/// Two upstream services in quota mode (1 and 2 per minute) and a normal
/// per-user rule, as in the Go service's multi-service quota walkthrough.
const QUOTA_YAML: &str = "domain: q
descriptors:
  - key: service
    value: s1
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
    metadata: {service_with_quota: {name: service_1}, tier: gold}
  - key: service
    value: s2
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 2}
    metadata: {service_with_quota: {name: service_2, zone: b}, tier: silver}
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 10}
";

fn quota_request() -> RateLimitRequest {
    req(
        "q",
        vec![
            desc(&[("service", "s1")]),
            desc(&[("service", "s2")]),
            desc(&[("user", "u")]),
        ],
        1,
    )
}

/// `(field path) -> string` in a response's dynamic metadata.
fn md_str(r: &RateLimitResponse, path: &[&str]) -> Option<String> {
    use envoy_types::pb::google::protobuf::value::Kind;
    let mut fields = &r.dynamic_metadata.as_ref()?.fields;
    for (i, key) in path.iter().enumerate() {
        let v = fields.get(*key)?;
        match &v.kind {
            Some(Kind::StructValue(s)) if i + 1 < path.len() => fields = &s.fields,
            Some(Kind::StringValue(s)) if i + 1 == path.len() => return Some(s.clone()),
            _ => return None,
        }
    }
    None
}

/// Quota mode: a quota descriptor over its limit keeps its own code and
/// wait, but denies the request only when every quota descriptor is over
/// (or a normal one is). A request the quota rules deny charges nothing.
/// The Go service behaves the same for the codes; it has no all-or-nothing
/// and keeps counting the denied request (its counters reset at the window
/// edge, where a bucket refills continuously, hence the waits here).
pub async fn quota_mode_denies_only_when_every_quota_rule_is_over(b: &dyn Backend) {
    let c = Case::new(b, QUOTA_YAML).await;
    let r = c.call(quota_request()).await;
    assert_eq!(r.overall_code, OK);
    assert_eq!(
        (cr(&r, 0), cr(&r, 1), cr(&r, 2)),
        ((OK, 0), (OK, 1), (OK, 9))
    );
    // s1 is spent: the request still passes on s2's quota.
    let r = c.call(quota_request()).await;
    assert_eq!(r.overall_code, OK);
    assert_eq!(st(&r, 0), (OVER, 0, Some(60)));
    assert_eq!((cr(&r, 1), cr(&r, 2)), ((OK, 0), (OK, 8)));
    assert_eq!(retry_after(&r), None);
    // Both spent: denied. The wait is until one of them has a token again
    // (s2 refills one every 30 s: 18 s after 12 s), and the user's bucket
    // (8 tokens, plus 2 refilled) is not charged.
    c.advance_ms(12_000);
    let r = c.call(quota_request()).await;
    assert_eq!(r.overall_code, OVER);
    assert_eq!(st(&r, 0), (OVER, 0, Some(48)));
    assert_eq!(st(&r, 1), (OVER, 0, Some(18)));
    assert_eq!(cr(&r, 2), (OK, 10));
    assert_eq!(retry_after(&r).as_deref(), Some("18"));
    let r = c.one("q", &[("user", "u")], 1).await;
    assert_eq!(cr(&r, 0), (OK, 9), "the denied request took nothing");

    // A normal descriptor over its limit denies whatever the quota says,
    // and the quota buckets are not charged either.
    let c = Case::new(b, QUOTA_YAML).await;
    let spend = req("q", vec![desc_hits(&[("user", "u")], 10)], 1);
    assert_eq!(c.call(spend).await.overall_code, OK);
    let r = c.call(quota_request()).await;
    assert_eq!(r.overall_code, OVER);
    assert_eq!((cr(&r, 0), cr(&r, 1)), ((OK, 1), (OK, 2)));
    assert_eq!(st(&r, 2), (OVER, 0, Some(6)));
    assert_eq!(retry_after(&r).as_deref(), Some("6"));
    let r = c.one("q", &[("service", "s1")], 1).await;
    assert_eq!(cr(&r, 0), (OK, 0), "s1 still had its token");
}

/// A refund descriptor in quota mode asks for nothing, so it is no quota
/// that lets a request pass; a request the quota rules deny writes nothing,
/// so a limit override in it cannot refill a drained bucket; a shadow quota
/// rule over its limit returns no metadata.
pub async fn quota_refunds_overrides_and_shadow_never_bypass(b: &dyn Backend) {
    let yaml = "domain: qr
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 20}
  - key: svc
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: dry
    quota_mode: true
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
    metadata: {route_to: dry}
";
    let c = Case::with_settings(b, yaml, |s| s.response_dynamic_metadata = true).await;
    assert_eq!(c.one("qr", &[("svc", "a")], 1).await.overall_code, OK);
    let refund = RateLimitDescriptor {
        is_negative_hits: true,
        ..desc_hits(&[("svc", "a")], 0)
    };
    for _ in 0..3 {
        let r = c
            .call(req(
                "qr",
                vec![
                    desc(&[("user", "x")]),
                    desc(&[("svc", "a")]),
                    refund.clone(),
                ],
                1,
            ))
            .await;
        assert_eq!(r.overall_code, OVER, "the only quota with a cost is spent");
        assert_eq!(cr(&r, 0), (OK, 20), "nothing charged");
    }
    // An override on a drained bucket, in a request the quota denies.
    assert_eq!(c.one("qr", &[("user", "d")], 20).await.overall_code, OK);
    let fast = RateLimitDescriptor {
        limit: Some(RateLimitOverride {
            requests_per_unit: 1_000_000,
            unit: 1, // SECOND
        }),
        ..desc(&[("user", "d")])
    };
    c.advance_ms(1_000);
    let r = c
        .call(req("qr", vec![fast, desc(&[("svc", "a")])], 1))
        .await;
    assert_eq!(r.overall_code, OVER);
    let r = c.one("qr", &[("user", "d")], 1).await;
    // A Cluster reserves per slot and gives back what other slots refused,
    // and that write still refills at the override's rate (the override
    // sharing the rule's bucket is a known fault of its own); elsewhere a
    // denied request writes nothing.
    if b.atomic_across_keys() {
        assert_eq!(
            st(&r, 0),
            (OVER, 0, Some(180)),
            "still drained: 1 token every 180 s"
        );
    }
    // A shadow quota rule never denies, and once over it returns no metadata.
    for expect in [Some("dry"), None, None] {
        let r = c.one("qr", &[("dry", "z")], 1).await;
        assert_eq!(r.overall_code, OK);
        assert_eq!(md_str(&r, &["metadata", "route_to"]).as_deref(), expect);
    }
}

/// Retry-After waits for a quota that can pass, never for one whose cost is
/// above its burst; and a refund descriptor passes on no metadata.
pub async fn quota_waits_and_metadata_come_from_quotas_that_can_pass(b: &dyn Backend) {
    let c = Case::with_settings(b, QUOTA_YAML, |s| s.response_dynamic_metadata = true).await;
    // s2 (2 per minute) spent; s1 asked for more than its burst of 1.
    for _ in 0..2 {
        assert_eq!(c.one("q", &[("service", "s2")], 1).await.overall_code, OK);
    }
    let r = c
        .call(req(
            "q",
            vec![
                desc_hits(&[("service", "s1")], 5),
                desc(&[("service", "s2")]),
            ],
            1,
        ))
        .await;
    assert_eq!(r.overall_code, OVER);
    assert_eq!(retry_after(&r).as_deref(), Some("30"), "s2 refills in 30 s");
    // A refund on s1 beside s2 spent: denied, and s1's metadata is not sent.
    let refund = RateLimitDescriptor {
        is_negative_hits: true,
        ..desc(&[("service", "s1")])
    };
    let r = c
        .call(req("q", vec![refund, desc(&[("service", "s2")])], 1))
        .await;
    assert_eq!(r.overall_code, OVER);
    assert_eq!(md_str(&r, &["metadata", "tier"]), None);
}

/// `--quota-mode` with a refund descriptor that matches no rule and carries
/// an override: still one quota that can deny.
pub async fn global_quota_mode_ignores_refund_descriptors(b: &dyn Backend) {
    let yaml = "domain: gq\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";
    let c = Case::with_settings(b, yaml, |s| s.global_quota_mode = true).await;
    let refund = RateLimitDescriptor {
        is_negative_hits: true,
        limit: Some(RateLimitOverride {
            requests_per_unit: 1_000_000,
            unit: 1,
        }),
        ..desc_hits(&[("nomatch", "x")], 0)
    };
    let r = || req("gq", vec![desc(&[("user", "g")]), refund.clone()], 1);
    let codes = [
        c.call(r()).await.overall_code,
        c.call(r()).await.overall_code,
        c.call(r()).await.overall_code,
    ];
    assert_eq!(codes, [OK, OK, OVER]);
}

/// `--quota-mode` puts every rule in quota mode: the request is denied only
/// when all its limited descriptors are over.
pub async fn global_quota_mode_needs_every_descriptor_over(b: &dyn Backend) {
    let yaml = "domain: g\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 1}\n  - key: b\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";
    let c = Case::with_settings(b, yaml, |s| s.global_quota_mode = true).await;
    let both = || req("g", vec![desc(&[("a", "x")]), desc(&[("b", "x")])], 1);
    assert_eq!(c.call(both()).await.overall_code, OK);
    let r = c.call(both()).await;
    assert_eq!(
        (r.overall_code, cr(&r, 0).0, cr(&r, 1)),
        (OK, OVER, (OK, 0))
    );
    let r = c.call(both()).await;
    assert_eq!(r.overall_code, OVER);
    assert_eq!(retry_after(&r).as_deref(), Some("60"));
}

/// `--shadow-mode` evaluates and charges every rule but never denies: the
/// overall code is OK, each status keeps its real code and wait (as in the
/// Go service), and no `retry-after` is sent.
pub async fn global_shadow_mode_never_denies(b: &dyn Backend) {
    let yaml = "domain: s\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 2}\n  - key: n\n    rate_limit: {unit: minute, requests_per_unit: 9}\n";
    let c = Case::with_settings(b, yaml, |s| s.global_shadow_mode = true).await;
    let two = || req("s", vec![desc(&[("k", "v")]), desc(&[("n", "v")])], 1);
    for (k, n) in [(1, 8), (0, 7)] {
        let r = c.call(two()).await;
        assert_eq!(
            (r.overall_code, cr(&r, 0), cr(&r, 1)),
            (OK, (OK, k), (OK, n))
        );
    }
    for n in [6, 5, 4] {
        let r = c.call(two()).await;
        assert_eq!(r.overall_code, OK);
        assert_eq!(st(&r, 0), (OVER, 0, Some(30)));
        assert_eq!(cr(&r, 1), (OK, n), "the other rule is still charged");
        assert_eq!(retry_after(&r), None);
    }
}

/// `--response-dynamic-metadata`: the domain, the request's descriptors,
/// and the merged metadata of the rules not over their limit, first value
/// winning (the Go service's shape; Envoy routes on it).
pub async fn dynamic_metadata_names_the_rules_with_quota_left(b: &dyn Backend) {
    let c = Case::with_settings(b, QUOTA_YAML, |s| s.response_dynamic_metadata = true).await;
    let r = c.call(quota_request()).await;
    assert_eq!(md_str(&r, &["domain"]).as_deref(), Some("q"));
    assert_eq!(
        md_str(&r, &["metadata", "service_with_quota", "name"]).as_deref(),
        Some("service_1")
    );
    // Nested mappings merge: s2's zone is added under the first name.
    assert_eq!(
        md_str(&r, &["metadata", "service_with_quota", "zone"]).as_deref(),
        Some("b")
    );
    assert_eq!(md_str(&r, &["metadata", "tier"]).as_deref(), Some("gold"));
    let r = c.call(quota_request()).await;
    assert_eq!(
        md_str(&r, &["metadata", "service_with_quota", "name"]).as_deref(),
        Some("service_2"),
        "s1 is over: only s2's metadata remains"
    );
    let r = c.call(quota_request()).await;
    assert_eq!(r.overall_code, OVER);
    assert_eq!(md_str(&r, &["metadata", "tier"]), None);
    assert_eq!(md_str(&r, &["domain"]).as_deref(), Some("q"));
    // Off by default.
    let plain = Case::new(b, QUOTA_YAML).await;
    assert!(plain.call(quota_request()).await.dynamic_metadata.is_none());
}

/// A token budget charged after the response (`max_debt`): checks pass
/// while the balance covers one token; a charge above the balance is
/// answered `OVER_LIMIT` (decided on the balance before it) and still taken,
/// with the wait until the same charge fits again (the balance after it);
/// the next check waits the real time to repay (1000 per hour at -200 tokens:
/// ceil(201 * 3.6 s) = 724 s); a charge is clamped at `-max_debt`; another
/// user is unaffected; after the reported wait a check passes.
pub async fn debt_charges_are_taken_and_repaid_in_real_time(b: &dyn Backend) {
    let c = Case::new(b, "domain: llm\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 1000, max_debt: 500}\n").await;
    let alice = [("user", "alice")];
    let call = |cost: u64| c.call(req("llm", vec![desc_hits(&alice, cost)], 0));
    assert_eq!(st(&call(0).await, 0), (OK, 1000, Some(0)));
    assert_eq!(st(&call(900).await, 0), (OK, 100, Some(3240)));
    assert_eq!(st(&call(0).await, 0), (OK, 100, Some(3240)));
    // 300 above a balance of 100: denied, taken (-200), and the wait is
    // until 300 fit again: 500 tokens, 1800 s.
    let r = call(300).await;
    assert_eq!((r.overall_code, st(&r, 0)), (OVER, (OVER, 0, Some(1800))));
    assert_eq!(retry_after(&r).as_deref(), Some("1800"));
    let r = call(0).await;
    assert_eq!((r.overall_code, st(&r, 0)), (OVER, (OVER, 0, Some(724))));
    assert_eq!(retry_after(&r).as_deref(), Some("724"));
    // A huge charge (above the burst: it never fits) is clamped at -500:
    // (1000 + 500) * 3.6 s until full.
    assert_eq!(st(&call(10_000).await, 0), (OVER, 0, Some(5400)));
    let r = call(0).await;
    assert_eq!(st(&r, 0), (OVER, 0, Some(1804)), "ceil(501 * 3.6 s)");
    assert_eq!(retry_after(&r).as_deref(), Some("1804"));
    let bob = c
        .call(req("llm", vec![desc_hits(&[("user", "bob")], 0)], 0))
        .await;
    assert_eq!(st(&bob, 0), (OK, 1000, Some(0)));
    // Refill runs at the normal rate in debt: 501.1 tokens in 1804 s.
    c.advance_ms(1_803_000);
    assert_eq!(st(&call(0).await, 0).0, OVER);
    c.advance_ms(1_000);
    assert_eq!(st(&call(0).await, 0), (OK, 1, Some(3597)));
}

/// A request-count rule with a debt bound (as `--max-debt-bursts` gives
/// every rule): a denied request is still charged, and a client that waits
/// the reported `retry-after` and sends the same request again is admitted,
/// each time (the wait counts the charge the denied request took).
pub async fn waiting_the_reported_time_admits_a_retry_on_a_debt_rule(b: &dyn Backend) {
    let c = Case::new(
        b,
        "domain: e\ndescriptors:\n  - key: ip\n    rate_limit: {unit: minute, requests_per_unit: 60, burst: 5, max_debt: 5}\n",
    )
    .await;
    let ip = [("ip", "10.0.0.1")];
    for _ in 0..5 {
        assert_eq!(c.one("e", &ip, 1).await.overall_code, OK);
    }
    for _ in 0..6 {
        let r = c.one("e", &ip, 1).await;
        assert_eq!(r.overall_code, OVER);
        // Balance 0, charged to -1: 2 tokens to refill at 1 per second.
        let wait = retry_after(&r).expect("retry-after");
        assert_eq!(wait, "2");
        c.advance_ms(2_000);
        assert_eq!(
            c.one("e", &ip, 1).await.overall_code,
            OK,
            "after waiting {wait} s"
        );
    }
}

const DEBT_AND_ROUTES: &str = "domain: llm\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 1000, max_debt: 500}\n  - key: route\n    value: chat\n    rate_limit: {unit: hour, requests_per_unit: 1}\n  - key: route\n    value: other\n    rate_limit: {unit: hour, requests_per_unit: 5}\n";

/// A debt rule is charged in a request another descriptor denies, and a
/// request its debt rule denies charges no other descriptor.
pub async fn debt_rules_are_charged_when_denied_and_deny_alone(b: &dyn Backend) {
    let c = Case::new(b, DEBT_AND_ROUTES).await;
    let user = |cost: u64| desc_hits(&[("user", "alice")], cost);
    let route = |v: &str| desc_hits(&[("route", v)], 1);
    let check = |d: RateLimitDescriptor| c.call(req("llm", vec![d], 0));
    let r = c.call(req("llm", vec![user(10), route("chat")], 0)).await;
    assert_eq!(
        (r.overall_code, cr(&r, 0), cr(&r, 1)),
        (OK, (OK, 990), (OK, 0))
    );
    // The route denies; the debt rule is charged anyway, and its status
    // shows the balance after that charge.
    let r = c.call(req("llm", vec![user(10), route("chat")], 0)).await;
    assert_eq!(
        (r.overall_code, cr(&r, 0), cr(&r, 1)),
        (OVER, (OK, 980), (OVER, 0))
    );
    assert_eq!(cr(&check(user(0)).await, 0), (OK, 980));
    // Into debt: 1500 above 980, clamped at -500.
    assert_eq!(cr(&check(user(1500)).await, 0), (OVER, 0));
    // Denied by the debt rule: the other route is not charged.
    let r = c.call(req("llm", vec![user(10), route("other")], 0)).await;
    assert_eq!(
        (r.overall_code, cr(&r, 0), cr(&r, 1)),
        (OVER, (OVER, 0), (OK, 5))
    );
    assert_eq!(cr(&check(route("other")).await, 0), (OK, 4));
    assert_eq!(st(&check(user(0)).await, 0), (OVER, 0, Some(1804)));
}

/// A request whose quota descriptors are only partly over is asked again
/// without the spent quota; its debt charge was taken by the first call
/// and is not taken again.
pub async fn a_debt_charge_is_taken_once_when_quotas_ask_again(b: &dyn Backend) {
    let yaml = "domain: llm\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 1000, max_debt: 500}\n  - key: q1\n    quota_mode: true\n    rate_limit: {unit: hour, requests_per_unit: 1}\n  - key: q2\n    quota_mode: true\n    rate_limit: {unit: hour, requests_per_unit: 5}\n";
    let c = Case::new(b, yaml).await;
    let q = |k: &str| desc_hits(&[(k, "v")], 1);
    assert_eq!(cr(&c.call(req("llm", vec![q("q1")], 0)).await, 0), (OK, 0));
    let user = |cost: u64| desc_hits(&[("user", "alice")], cost);
    let r = c
        .call(req("llm", vec![user(10), q("q1"), q("q2")], 0))
        .await;
    assert_eq!(r.overall_code, OK);
    assert_eq!(cr(&r, 2), (OK, 4));
    let r = c.call(req("llm", vec![user(0)], 0)).await;
    assert_eq!(cr(&r, 0), (OK, 990), "charged once");
}

/// The service-wide `max_debt_bursts` gives every rule without its own
/// `max_debt` a debt bound of that many bursts; `max_debt: 0` opts out;
/// a rule without a debt bound is unchanged (a charge above the balance
/// takes nothing).
pub async fn service_wide_debt_bound_in_bursts(b: &dyn Backend) {
    let yaml = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 10}\n  - key: off\n    rate_limit: {unit: hour, requests_per_unit: 10, max_debt: 0}\n";
    let c = Case::with_settings(b, yaml, |s| s.max_debt_bursts = 1).await;
    let k = |cost: u64| req("d", vec![desc_hits(&[("k", "v")], cost)], 0);
    assert_eq!(st(&c.call(k(25)).await, 0).0, OVER);
    // Clamped at -10: 11 tokens at 360 s each.
    assert_eq!(st(&c.call(k(0)).await, 0), (OVER, 0, Some(3960)));
    let off = |cost: u64| req("d", vec![desc_hits(&[("off", "v")], cost)], 0);
    assert_eq!(st(&c.call(off(25)).await, 0).0, OVER);
    assert_eq!(cr(&c.call(off(0)).await, 0), (OK, 10));
    let plain = Case::new(b, yaml).await;
    assert_eq!(st(&plain.call(k(25)).await, 0).0, OVER);
    assert_eq!(cr(&plain.call(k(0)).await, 0), (OK, 10));
    // Quota rules keep their quota semantics under the service-wide bound:
    // one quota over its limit does not deny while another has tokens.
    let quotas = Case::with_settings(b, QUOTA_YAML, |s| s.max_debt_bursts = 1).await;
    let codes: Vec<i32> = [
        quotas.call(quota_request()).await.overall_code,
        quotas.call(quota_request()).await.overall_code,
    ]
    .into();
    let plain_quotas = Case::new(b, QUOTA_YAML).await;
    let want: Vec<i32> = [
        plain_quotas.call(quota_request()).await.overall_code,
        plain_quotas.call(quota_request()).await.overall_code,
    ]
    .into();
    assert_eq!(codes, want, "the same answers as without --max-debt-bursts");
}

/// A per-request `limit` override never refills the rule's bucket at its
/// own rate: it has its own bucket per override rate. Rule 1/year, burst
/// 10, drained; one request overriding to 1,000,000/second on the same
/// entries; the next plain requests are still denied. The same entries
/// twice in one request, with and without the override, are two buckets
/// (on a Redis Cluster in two hash slots, so the override's reservation is
/// compensated at the override's rate, on its own bucket).
pub async fn an_override_never_refills_the_rules_bucket(b: &dyn Backend) {
    let c = Case::new(b, "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: year, requests_per_unit: 1, burst: 10}\n").await;
    let kv = [("k", "v")];
    let fast = || RateLimitDescriptor {
        limit: Some(RateLimitOverride {
            requests_per_unit: 1_000_000,
            unit: 1, // SECOND
        }),
        ..desc(&kv)
    };
    for _ in 0..10 {
        assert_eq!(cr(&c.one("d", &kv, 1).await, 0).0, OK);
    }
    assert_eq!(cr(&c.one("d", &kv, 1).await, 0).0, OVER);
    c.advance_ms(1_000);
    let r = c.call(req("d", vec![fast()], 1)).await;
    assert_eq!((r.overall_code, cr(&r, 0)), (OK, (OK, 999_999)));
    for _ in 0..3 {
        assert_eq!(cr(&c.one("d", &kv, 1).await, 0).0, OVER);
    }
    let r = c.call(req("d", vec![desc(&kv), fast()], 1)).await;
    assert_eq!((r.overall_code, cr(&r, 0).0, cr(&r, 1).0), (OVER, OVER, OK));
    c.advance_ms(1_000);
    assert_eq!(cr(&c.one("d", &kv, 1).await, 0).0, OVER);
    let r = c.call(req("d", vec![fast()], 0)).await;
    assert_eq!(cr(&r, 0), (OK, 999_999));
}

/// A clock stepped back (a stored timestamp in the future) neither mints
/// tokens nor freezes a bucket: the timestamp is taken as now, and the
/// bucket refills from there at its rate.
pub async fn a_clock_stepped_back_never_freezes_a_bucket(b: &dyn Backend) {
    let c = Case::new(b, "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 10}\n").await;
    let kv = [("k", "v")];
    c.advance_ms(3_600_000);
    assert_eq!(cr(&c.one("d", &kv, 10).await, 0), (OK, 0));
    assert_eq!(cr(&c.one("d", &kv, 1).await, 0).0, OVER);
    c.clock.set_us(T0_US);
    assert_eq!(cr(&c.one("d", &kv, 1).await, 0).0, OVER, "nothing minted");
    c.advance_ms(1_000);
    assert_eq!(cr(&c.one("d", &kv, 10).await, 0), (OK, 0), "not frozen");
    assert_eq!(cr(&c.one("d", &kv, 1).await, 0).0, OVER);
}

/// docs/design.md, "Windows": at a window edge a fixed window admits its
/// limit again at once (twice the limit within 2 ms here), where a token
/// bucket admits at most `burst + r·t` (its 5, and 5 tokens/s × 1 ms is
/// not one token more).
pub async fn a_fixed_window_admits_twice_its_limit_across_an_edge(b: &dyn Backend) {
    let c = Case::new(
        b,
        "domain: w\ndescriptors:\n  - key: k\n    value: fixed\n    rate_limit: {unit: second, requests_per_unit: 5, algorithm: fixed_window}\n  - key: k\n    value: bucket\n    rate_limit: {unit: second, requests_per_unit: 5}\n",
    )
    .await;
    let (fixed, bucket) = ([("k", "fixed")], [("k", "bucket")]);
    // T0 is on a second: 999 ms in, the window has 1 ms left.
    c.advance_ms(999);
    let mut admitted = (0, 0);
    for left in (0..5).rev() {
        assert_eq!(st(&c.one("w", &fixed, 1).await, 0), (OK, left, Some(1)));
        admitted.0 += 1;
        assert_eq!(cr(&c.one("w", &bucket, 1).await, 0).0, OK);
        admitted.1 += 1;
    }
    let r = c.one("w", &fixed, 1).await;
    assert_eq!(st(&r, 0), (OVER, 0, Some(1)));
    assert_eq!(retry_after(&r).as_deref(), Some("1"));
    assert_eq!(cr(&c.one("w", &bucket, 1).await, 0).0, OVER);
    // The edge: a new window, counting from zero.
    c.advance_ms(1);
    for left in (0..5).rev() {
        assert_eq!(st(&c.one("w", &fixed, 1).await, 0), (OK, left, Some(1)));
        admitted.0 += 1;
    }
    assert_eq!(st(&c.one("w", &fixed, 1).await, 0), (OVER, 0, Some(1)));
    assert_eq!(cr(&c.one("w", &bucket, 1).await, 0).0, OVER);
    assert_eq!(
        admitted,
        (10, 5),
        "2 × 5 in 2 ms; the bucket 5 + 5/s × 2 ms"
    );
}

/// The Go service's fixed window: aligned to the unit since the epoch,
/// `duration_until_reset` the time to its end, a check (hits 0) passing
/// until the count is over the limit, and a denied request's hits counted,
/// so the window stays over until it ends.
pub async fn a_fixed_window_counts_denied_hits_until_its_end(b: &dyn Backend) {
    let c = Case::new(
        b,
        "domain: w\ndescriptors:\n  - key: k\n    value: m\n    rate_limit: {unit: minute, requests_per_unit: 3, algorithm: fixed_window}\n",
    )
    .await;
    let m = [("k", "m")];
    let check = || req("w", vec![desc_hits(&m, 0)], 0);
    // T0 is 20 s into its minute: the window ends in 40 s.
    for left in [2, 1, 0] {
        assert_eq!(st(&c.one("w", &m, 1).await, 0), (OK, left, Some(40)));
    }
    assert_eq!(st(&c.call(check()).await, 0), (OK, 0, Some(40)));
    let r = c.one("w", &m, 1).await;
    assert_eq!(st(&r, 0), (OVER, 0, Some(40)));
    assert_eq!(retry_after(&r).as_deref(), Some("40"));
    // The denied hit was counted: 4 of 3, so even a check is over now.
    assert_eq!(st(&c.call(check()).await, 0), (OVER, 0, Some(40)));
    c.advance_ms(39_500);
    assert_eq!(st(&c.one("w", &m, 1).await, 0), (OVER, 0, Some(1)));
    c.advance_ms(500);
    assert_eq!(st(&c.one("w", &m, 3).await, 0), (OK, 0, Some(60)));
    assert_eq!(st(&c.one("w", &m, 1).await, 0), (OVER, 0, Some(60)));
    // A cost above the limit never fits: denied, and the window's end is
    // still the answer (as in the Go service).
    c.advance_ms(60_000);
    assert_eq!(st(&c.one("w", &m, 7).await, 0), (OVER, 0, Some(60)));
    assert_eq!(st(&c.call(check()).await, 0), (OVER, 0, Some(60)));
}

/// All-or-nothing across algorithms: a request a fixed window denies charges
/// no bucket (only the window counts its own denied hits), and a request a
/// bucket denies charges no window.
pub async fn a_request_denied_by_a_window_charges_nothing_else(b: &dyn Backend) {
    let c = Case::new(
        b,
        "domain: mix\ndescriptors:\n  - key: plan\n    value: free\n    rate_limit: {unit: minute, requests_per_unit: 10}\n  - key: user\n    value: u1\n    rate_limit: {unit: minute, requests_per_unit: 2, algorithm: fixed_window}\n  - key: tight\n    value: t\n    rate_limit: {unit: hour, requests_per_unit: 1}\n  - key: user\n    value: u2\n    rate_limit: {unit: minute, requests_per_unit: 10, algorithm: fixed_window}\n",
    )
    .await;
    let both = |a: (&str, &str), b: (&str, &str)| req("mix", vec![desc(&[a]), desc(&[b])], 1);
    let (plan, u1) = (("plan", "free"), ("user", "u1"));
    for (p, u) in [(9, 1), (8, 0)] {
        let r = c.call(both(plan, u1)).await;
        assert_eq!(
            (r.overall_code, cr(&r, 0), cr(&r, 1)),
            (OK, (OK, p), (OK, u))
        );
    }
    for _ in 0..3 {
        let r = c.call(both(plan, u1)).await;
        assert_eq!(r.overall_code, OVER);
        assert_eq!(cr(&r, 0), (OK, 8), "the bucket is not charged");
        assert_eq!(st(&r, 1), (OVER, 0, Some(40)));
    }
    assert_eq!(cr(&c.one("mix", &[plan], 1).await, 0), (OK, 7));
    // Vice versa: the bucket denies, the window is not charged.
    let (tight, u2) = (("tight", "t"), ("user", "u2"));
    let r = c.call(both(tight, u2)).await;
    assert_eq!(
        (r.overall_code, cr(&r, 0), cr(&r, 1)),
        (OK, (OK, 0), (OK, 9))
    );
    for _ in 0..3 {
        let r = c.call(both(tight, u2)).await;
        assert_eq!(r.overall_code, OVER);
        assert_eq!(cr(&r, 0).0, OVER);
        assert_eq!(cr(&r, 1), (OK, 9), "the window is not charged");
    }
    assert_eq!(cr(&c.one("mix", &[u2], 1).await, 0), (OK, 8));
}

/// A fixed window's refunds never take its count below zero; a shadow
/// window counts and never denies; a request's `limit` override follows the
/// service's default algorithm, not the rule it lands on.
pub async fn fixed_window_refunds_shadow_and_overrides(b: &dyn Backend) {
    let c = Case::with_settings(
        b,
        "domain: w\ndescriptors:\n  - key: r\n    value: x\n    rate_limit: {unit: hour, requests_per_unit: 3, algorithm: fixed_window}\n  - key: s\n    value: y\n    shadow_mode: true\n    rate_limit: {unit: hour, requests_per_unit: 1, algorithm: fixed_window}\n  - key: o\n    rate_limit: {unit: hour, requests_per_unit: 100}\n",
        |s| s.default_algorithm = bucket_rls::storage::AlgorithmKind::FixedWindow,
    )
    .await;
    let x = [("r", "x")];
    let refund = |n: u64| RateLimitDescriptor {
        is_negative_hits: true,
        ..desc_hits(&x, n)
    };
    assert_eq!(cr(&c.one("w", &x, 2).await, 0), (OK, 1));
    let r = c.call(req("w", vec![refund(5)], 0)).await;
    assert_eq!((r.overall_code, cr(&r, 0)), (OK, (OK, 3)));
    assert_eq!(cr(&c.one("w", &x, 3).await, 0), (OK, 0));
    assert_eq!(cr(&c.one("w", &x, 1).await, 0).0, OVER);
    // Shadow: over from the second request on, answered OK.
    for want in [0, 0, 0] {
        let r = c.one("w", &[("s", "y")], 1).await;
        assert_eq!((r.overall_code, cr(&r, 0)), (OK, (OK, want)));
    }
    // An override of 2 per minute on the bucket rule is a fixed window
    // here: the third request waits for the minute's end (40 s), not the
    // 30 s a bucket refills one token in.
    let with = RateLimitDescriptor {
        limit: Some(RateLimitOverride {
            requests_per_unit: 2,
            unit: 2, /* MINUTE */
        }),
        ..desc(&[("o", "v")])
    };
    for left in [1, 0] {
        assert_eq!(
            st(&c.call(req("w", vec![with.clone()], 1)).await, 0),
            (OK, left, Some(40))
        );
    }
    assert_eq!(
        st(&c.call(req("w", vec![with.clone()], 1)).await, 0),
        (OVER, 0, Some(40))
    );
}

/// docs/design.md, "Sliding windows": the previous window's hits all at its
/// very end, then as many as fit 30 s into the next window. The sliding
/// window admits exactly its stated bound, `N + prev × p / U` = 60 + 30 in
/// the minute that ends there (a fixed window would admit 120), reports the
/// real wait of the next request, and counts no denied hit.
pub async fn a_sliding_window_admits_its_limit_plus_its_stated_bound_across_an_edge(
    b: &dyn Backend,
) {
    let c = Case::new(
        b,
        "domain: s\ndescriptors:\n  - key: k\n    value: v\n    rate_limit: {unit: minute, requests_per_unit: 60, algorithm: sliding_window}\n",
    )
    .await;
    let v = [("k", "v")];
    // T0 is 20 s into its minute: 1 ms before the minute's end.
    c.advance_ms(39_999);
    // Until the estimate is 0: the end of the next window (60.001 s).
    for left in (0..60).rev() {
        assert_eq!(st(&c.one("s", &v, 1).await, 0), (OK, left, Some(61)));
    }
    let r = c.one("s", &v, 1).await;
    // It fits once 60 × r/60 <= 59: 1 s into the next window, 1.001 s away.
    assert_eq!(st(&r, 0), (OVER, 0, Some(2)));
    // 30 s into the next window half of the previous one still counts.
    c.advance_ms(30_001);
    let mut after = 0;
    while c.one("s", &v, 1).await.overall_code == OK {
        after += 1;
    }
    assert_eq!(after, 30, "60 + 60 × 30/60 in the minute ending now");
    // The next fits when 60 × r/60 <= 29: 1 s from now.
    let r = c.one("s", &v, 1).await;
    assert_eq!(st(&r, 0), (OVER, 0, Some(1)));
    assert_eq!(retry_after(&r).as_deref(), Some("1"));
    // A check is answered as a one-token request.
    let check = c.call(req("s", vec![desc_hits(&v, 0)], 0)).await;
    assert_eq!(st(&check, 0), (OVER, 0, Some(1)));
    c.advance_ms(1_000);
    assert_eq!(cr(&c.one("s", &v, 1).await, 0), (OK, 0));
    assert_eq!(cr(&c.one("s", &v, 1).await, 0).0, OVER);
}

/// All-or-nothing with a sliding window: a request it denies charges no
/// bucket and no fixed window (and counts nothing on the sliding window
/// itself), one a bucket denies charges no sliding window; its refunds
/// never go below zero.
pub async fn a_request_denied_by_a_sliding_window_charges_nothing(b: &dyn Backend) {
    let c = Case::new(
        b,
        "domain: mix\ndescriptors:\n  - key: plan\n    value: free\n    rate_limit: {unit: minute, requests_per_unit: 10}\n  - key: fixed\n    value: f\n    rate_limit: {unit: minute, requests_per_unit: 10, algorithm: fixed_window}\n  - key: user\n    value: u1\n    rate_limit: {unit: minute, requests_per_unit: 2, algorithm: sliding_window}\n",
    )
    .await;
    let all = || {
        req(
            "mix",
            vec![
                desc(&[("plan", "free")]),
                desc(&[("fixed", "f")]),
                desc(&[("user", "u1")]),
            ],
            1,
        )
    };
    for (left, u) in [(9, 1), (8, 0)] {
        let r = c.call(all()).await;
        assert_eq!(
            (r.overall_code, cr(&r, 0), cr(&r, 1), cr(&r, 2)),
            (OK, (OK, left), (OK, left), (OK, u))
        );
    }
    for _ in 0..3 {
        let r = c.call(all()).await;
        assert_eq!(r.overall_code, OVER);
        assert_eq!((cr(&r, 0), cr(&r, 1)), ((OK, 8), (OK, 8)));
        assert_eq!(cr(&r, 2), (OVER, 0));
    }
    assert_eq!(cr(&c.one("mix", &[("plan", "free")], 1).await, 0), (OK, 7));
    assert_eq!(cr(&c.one("mix", &[("fixed", "f")], 1).await, 0), (OK, 7));
    // Refunds: 5 back on a count of 2 leave 0, never below.
    let refund = RateLimitDescriptor {
        is_negative_hits: true,
        ..desc_hits(&[("user", "u1")], 5)
    };
    let r = c.call(req("mix", vec![refund], 0)).await;
    assert_eq!(cr(&r, 0), (OK, 2));
    // The bucket denies: the sliding window is not charged.
    for _ in 0..7 {
        c.one("mix", &[("plan", "free")], 1).await;
    }
    let r = c
        .call(req(
            "mix",
            vec![desc(&[("plan", "free")]), desc(&[("user", "u1")])],
            1,
        ))
        .await;
    assert_eq!(
        (r.overall_code, cr(&r, 0).0, cr(&r, 1)),
        (OVER, OVER, (OK, 2))
    );
    assert_eq!(cr(&c.one("mix", &[("user", "u1")], 1).await, 0), (OK, 1));
}

/// Generates one `#[tokio::test]` per conformance case for a backend.
/// `$make` is an async fn returning a value implementing [`Backend`].
#[macro_export]
macro_rules! conformance_tests {
    ($make:path) => {
        $crate::conformance_tests!(@cases $make;
            misspelt_key_never_loads_and_a_bad_reload_keeps_the_old_config
            zero_rate_blocks_for_one_unit
            wildcards_nest_and_bucket_per_value
            share_threshold
            depth_must_match_and_key_only_buckets_per_value
            unlimited_applies_to_its_own_tuple_only
            replaces_drops_the_named_limit_for_that_request
            shadow_mode_counts_but_never_denies
            cost_above_remaining_is_denied_without_consuming
            zero_hits_means_one_and_descriptor_zero_only_checks
            polling_admits_exactly_the_refill
            random_traffic_matches_the_reference_model
            denied_request_charges_no_other_bucket
            high_rates_and_huge_costs_do_not_overflow
            retry_after_the_reported_wait_is_admitted
            durations_set_and_denial_has_zero_remaining
            changed_limit_applies_to_existing_buckets
            identical_reload_never_refills
            refunds
            overrides
            unknown_domain_ok_and_empty_request_invalid
            same_bucket_twice_waits_for_all
            loosening_reload_never_refills
            quota_mode_denies_only_when_every_quota_rule_is_over
            global_quota_mode_needs_every_descriptor_over
            global_shadow_mode_never_denies
            dynamic_metadata_names_the_rules_with_quota_left
            quota_refunds_overrides_and_shadow_never_bypass
            global_quota_mode_ignores_refund_descriptors
            quota_waits_and_metadata_come_from_quotas_that_can_pass
            debt_charges_are_taken_and_repaid_in_real_time
            debt_rules_are_charged_when_denied_and_deny_alone
            waiting_the_reported_time_admits_a_retry_on_a_debt_rule
            service_wide_debt_bound_in_bursts
            a_debt_charge_is_taken_once_when_quotas_ask_again
            an_override_never_refills_the_rules_bucket
            a_clock_stepped_back_never_freezes_a_bucket
            a_reset_makes_the_requests_buckets_full
            a_fixed_window_admits_twice_its_limit_across_an_edge
            a_fixed_window_counts_denied_hits_until_its_end
            a_request_denied_by_a_window_charges_nothing_else
            fixed_window_refunds_shadow_and_overrides
            a_sliding_window_admits_its_limit_plus_its_stated_bound_across_an_edge
            a_request_denied_by_a_sliding_window_charges_nothing
        );
    };
    (@cases $make:path; $($case:ident)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                let backend = $make().await;
                $crate::common::conformance::$case(&backend).await;
            }
        )*
    };
}
