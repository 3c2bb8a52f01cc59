//! The Go reference service's window tests (envoyproxy/ratelimit,
//! `test/redis/fixed_cache_impl_test.go` and
//! `test/limiter/base_limiter_test.go`) as exact cases of `fixed_window`
//! rules: the same limits, times, counts and hits give the same statuses
//! (`code`, `limit_remaining`, `duration_until_reset`) and the same
//! per-rule counts (`total_hits`, `over_limit`, `near_limit`,
//! `within_limit`, `shadow_mode`), on the memory backend and on Redis.
//!
//! The Go tests mock Redis's `INCRBY` answers; here the window really holds
//! the count the mock answered with: before each request the window is
//! brought to the count before it by charges made in storage directly
//! (no metrics), then the request runs through the service.
//!
//! Metrics are process-global: every case has its own domain per backend.

mod common;

use bucket_rls::grpc::ShouldRateLimit as _;
use bucket_rls::limiter::Limiter;
use bucket_rls::metrics as m;
use bucket_rls::settings::ServiceSettings;
use bucket_rls::storage::clock::ManualClock;
use bucket_rls::storage::key::{self, KeyValue};
use bucket_rls::storage::memory::MemoryStorage;
use bucket_rls::storage::{Charge, ChargeKind, ChargeSpec, Limit, Storage, WindowLimit};
use common::metrics::{metric, scrape};
use common::redis::RedisServer;
use common::{config, desc, desc_hits, req};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;
const SEC: u64 = 1_000_000;

/// Where the windows live.
enum Backend {
    Memory,
    Redis(RedisServer),
}

impl Backend {
    fn both() -> [Self; 2] {
        [Self::Memory, Self::Redis(RedisServer::start())]
    }

    fn name(&self) -> &'static str {
        match self {
            Self::Memory => "mem",
            Self::Redis(_) => "redis",
        }
    }
}

/// One Go test on one backend: a limiter of `fixed_window` rules on a
/// paused clock at the Go test's `UnixNow`.
struct Go {
    limiter: Arc<Limiter>,
    storage: Arc<dyn Storage>,
    domain: String,
    prefix: String,
}

impl Go {
    /// `yaml` is the domain's descriptors (with `DOMAIN` for its name).
    fn new(b: &Backend, case: &str, yaml: &str, now_secs: u64) -> Self {
        bucket_rls::metrics::install();
        let domain = format!("{case}_{}", b.name());
        let clock = ManualClock::new(now_secs * SEC);
        let storage: Arc<dyn Storage> = match b {
            Backend::Memory => Arc::new(MemoryStorage::new(Arc::new(clock))),
            Backend::Redis(server) => Arc::new(
                bucket_rls::storage::redis::RedisStorage::builder(server.url())
                    .timeout(Duration::from_secs(2))
                    .test_clock(Arc::new(clock))
                    .build()
                    .expect("valid URL"),
            ),
        };
        let prefix = common::unique_prefix("go");
        let yaml = format!(
            "domain: {domain}\n{}",
            yaml.replace("fixed}", "algorithm: fixed_window}")
        );
        let settings = ServiceSettings {
            key_prefix: prefix.clone(),
            ..ServiceSettings::default()
        };
        let limiter = Arc::new(Limiter::new(
            config(&[("go.yaml", &yaml)]),
            storage.clone(),
            settings,
        ));
        Self {
            limiter,
            storage,
            domain,
            prefix,
        }
    }

    /// Counts `hits` in the window of `entries` (a limit of `n` per
    /// `unit_secs`) in storage, as other traffic would: the Go test's mock
    /// answers `INCRBY` with the count after them.
    async fn add(&self, entries: &[(&str, &str)], n: u32, unit_secs: u64, hits: u64) {
        let kv: Vec<(&str, KeyValue<'_>)> = entries
            .iter()
            .map(|(k, v)| (*k, KeyValue::Value(v)))
            .collect();
        let charge = Charge {
            key: key::encode(&self.prefix, &self.domain, &kv),
            spec: ChargeSpec {
                limit: Limit::FixedWindow(WindowLimit::counting(
                    n,
                    NonZeroU64::new(unit_secs).expect("a unit"),
                )),
                cost: hits,
                kind: ChargeKind::Consume,
                shadow: true,
            },
        };
        self.storage.apply(&[charge]).await.expect("storage");
    }

    async fn call(&self, descriptors: Vec<RateLimitDescriptor>, hits: u32) -> RateLimitResponse {
        self.limiter
            .should_rate_limit(&req(&self.domain, descriptors, hits))
            .await
            .expect("answered")
    }

    /// `[total_hits, over_limit, near_limit, within_limit, shadow_mode]` of
    /// the rule `<domain>.<path>` (the Go service's stat key).
    fn stats(&self, path: &str) -> [u64; 5] {
        let text = scrape();
        let label = format!("{}.{path}", self.domain);
        let v = |name| {
            metric(&text, name, &[("rule", label.as_str())]).map_or(0, |x| {
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let n = x as u64;
                n
            })
        };
        [
            v(m::TOTAL_HITS),
            v(m::OVER_LIMIT),
            v(m::NEAR_LIMIT),
            v(m::WITHIN_LIMIT),
            v(m::SHADOW_MODE),
        ]
    }
}

/// One request of a Go test: the rule's key (its value is the key's with
/// `value` for `key`), its limit per second, the count before, the hits,
/// the status `(code, remaining)` and the counts after.
type Step = (&'static str, u32, u64, u32, (i32, u32), [u64; 5]);

/// One quota-mode request: the case, its two descriptors' (entries, limit
/// per minute, count before), the overall code and the two codes.
type QuotaCase<'a> = (
    &'a str,
    [(&'a [(&'a str, &'a str)], u32, u64); 2],
    i32,
    [i32; 2],
);

/// `(code, limit_remaining, duration_until_reset seconds)` of status `i`.
fn st(r: &RateLimitResponse, i: usize) -> (i32, u32, Option<i64>) {
    let s = &r.statuses[i];
    (
        s.code,
        s.limit_remaining,
        s.duration_until_reset.as_ref().map(|d| d.seconds),
    )
}

/// `TestRedis`: a window of 10 per second at 1,234 s with 4 counted
/// answers 5 left, reset in 1 s; a minute window already at its limit
/// denies (the descriptor without a rule is OK without a limit), reset in
/// 60 − 1234 % 60 = 26 s; a check (hits 0) of an hour window at 11 of 10
/// is over and counts nothing, a day window at 12 of 10 is over, reset in
/// 800 s and 36,800 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_go_services_window_cases() {
    let yaml = "descriptors:
  - key: key
    value: value
    rate_limit: {unit: second, requests_per_unit: 10, fixed}
  - key: key2
    value: value2
    descriptors:
      - key: subkey2
        value: subvalue2
        rate_limit: {unit: minute, requests_per_unit: 10, fixed}
  - key: key3
    value: value3
    rate_limit: {unit: hour, requests_per_unit: 10, fixed}
    descriptors:
      - key: subkey3
        value: subvalue3
        rate_limit: {unit: day, requests_per_unit: 10, fixed}
";
    for b in Backend::both() {
        let go = Go::new(&b, "gowin", yaml, 1234);
        go.add(&[("key", "value")], 10, 1, 4).await;
        let r = go.call(vec![desc(&[("key", "value")])], 1).await;
        assert_eq!(st(&r, 0), (OK, 5, Some(1)), "{}", b.name());
        assert_eq!(go.stats("key_value"), [1, 0, 0, 1, 0]);

        let deep = [("key2", "value2"), ("subkey2", "subvalue2")];
        go.add(&deep, 10, 60, 10).await;
        let r = go
            .call(
                vec![desc_hits(&[("key2", "value2")], 0), desc_hits(&deep, 1)],
                0,
            )
            .await;
        assert_eq!(r.statuses[0].code, OK);
        assert!(r.statuses[0].current_limit.is_none());
        assert_eq!(st(&r, 1), (OVER, 0, Some(26)));
        assert_eq!(go.stats("key2_value2.subkey2_subvalue2"), [1, 1, 0, 0, 0]);

        // 1,000,000 s: 2,800 s into its hour, 49,600 s into its day.
        let go = Go::new(&b, "gowin3", yaml, 1_000_000);
        let hour = [("key3", "value3")];
        let day = [("key3", "value3"), ("subkey3", "subvalue3")];
        go.add(&hour, 10, 3600, 11).await;
        go.add(&day, 10, 86_400, 12).await;
        let r = go
            .call(vec![desc_hits(&hour, 0), desc_hits(&day, 1)], 0)
            .await;
        assert_eq!(st(&r, 0), (OVER, 0, Some(800)));
        assert_eq!(st(&r, 1), (OVER, 0, Some(36_800)));
        assert_eq!(go.stats("key3_value3"), [0, 0, 0, 0, 0]);
        assert_eq!(go.stats("key3_value3.subkey3_subvalue3"), [1, 1, 0, 0, 0]);
    }
}

/// `TestNearLimit`: the near-limit threshold is `floor(limit × 0.8)`; hits
/// past it are near, hits past the limit are over (and the near ones of an
/// over request are the part between the threshold and the limit), a
/// request that finds the count at the limit is all over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_go_services_near_limit_cases() {
    let yaml = "descriptors:
  - key: key4
    value: value4
    rate_limit: {unit: hour, requests_per_unit: 15, fixed}
  - key: key5
    value: value5
    rate_limit: {unit: second, requests_per_unit: 20, fixed}
  - key: key6
    value: value6
    rate_limit: {unit: second, requests_per_unit: 8, fixed}
  - key: key7
    value: value7
    rate_limit: {unit: second, requests_per_unit: 20, fixed}
  - key: key8
    value: value8
    rate_limit: {unit: second, requests_per_unit: 20, fixed}
  - key: key9
    value: value9
    rate_limit: {unit: second, requests_per_unit: 20, fixed}
  - key: key10
    value: value10
    rate_limit: {unit: second, requests_per_unit: 10, fixed}
";
    for b in Backend::both() {
        let go = Go::new(&b, "gonear", yaml, 1_000_000);
        let k4 = [("key4", "value4")];
        // INCRBY answers 11, 13, 16: counts before of 10, 12 and 15.
        go.add(&k4, 15, 3600, 10).await;
        let r = go.call(vec![desc(&k4)], 1).await;
        assert_eq!(st(&r, 0), (OK, 4, Some(800)), "{}", b.name());
        assert_eq!(go.stats("key4_value4"), [1, 0, 0, 1, 0]);
        go.add(&k4, 15, 3600, 1).await;
        let r = go.call(vec![desc(&k4)], 1).await;
        assert_eq!(st(&r, 0), (OK, 2, Some(800)));
        assert_eq!(go.stats("key4_value4"), [2, 0, 1, 2, 0]);
        go.add(&k4, 15, 3600, 2).await;
        let r = go.call(vec![desc(&k4)], 1).await;
        assert_eq!(st(&r, 0), (OVER, 0, Some(800)));
        assert_eq!(go.stats("key4_value4"), [3, 1, 1, 2, 0]);

        // At 1,234 s, hits above 1: (limit, count before, hits) -> status,
        // [hits, over, near, within, shadow].
        let go = Go::new(&b, "gonear2", yaml, 1234);
        let cases: [Step; 6] = [
            // All under the limit and the threshold (16).
            ("key5", 20, 2, 3, (OK, 15), [3, 0, 0, 3, 0]),
            // Under the limit, one of two past the threshold (6).
            ("key6", 8, 5, 2, (OK, 1), [2, 0, 1, 2, 0]),
            // Under the limit, all past the threshold.
            ("key7", 20, 16, 3, (OK, 1), [3, 0, 3, 3, 0]),
            // Two over the limit, one near.
            ("key8", 20, 19, 3, (OVER, 0), [3, 2, 1, 0, 0]),
            // Some in all three places: 1 under, 4 near, 2 over.
            ("key9", 20, 15, 7, (OVER, 0), [7, 2, 4, 0, 0]),
            // All over the limit.
            ("key10", 10, 27, 3, (OVER, 0), [3, 3, 0, 0, 0]),
        ];
        for (k, n, before, hits, (code, left), stats) in cases {
            let v = k.replace("key", "value");
            let e = [(k, v.as_str())];
            go.add(&e, n, 1, before).await;
            let r = go.call(vec![desc(&e)], hits).await;
            assert_eq!(st(&r, 0), (code, left, Some(1)), "{k}");
            assert_eq!(go.stats(&format!("{k}_{v}")), stats, "{k}");
        }
    }
}

/// `TestOverLimitWithLocalCache` and `TestOverLimitWithLocalCacheShadowRule`:
/// once over, further requests are over (the Go service answers them from
/// its local cache without counting; here from Redis or from bucket-rls's
/// own local cache) and counted over; a shadow rule answers OK and counts
/// the same hits as shadow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_go_services_over_limit_cases_with_and_without_shadow_mode() {
    let yaml = "descriptors:
  - key: key4
    value: value4
    rate_limit: {unit: hour, requests_per_unit: 15, fixed}
  - key: shadow4
    value: value4
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 15, fixed}
";
    for b in Backend::both() {
        let go = Go::new(&b, "golocal", yaml, 1_000_000);
        for (k, over_code) in [("key4", OVER), ("shadow4", OK)] {
            let e = [(k, "value4")];
            let label = format!("{k}_value4");
            go.add(&e, 15, 3600, 10).await;
            let r = go.call(vec![desc(&e)], 1).await;
            assert_eq!(st(&r, 0), (OK, 4, Some(800)), "{k} {}", b.name());
            assert_eq!(go.stats(&label), [1, 0, 0, 1, 0]);
            go.add(&e, 15, 3600, 1).await;
            let r = go.call(vec![desc(&e)], 1).await;
            assert_eq!(st(&r, 0), (OK, 2, Some(800)));
            assert_eq!(go.stats(&label), [2, 0, 1, 2, 0]);
            go.add(&e, 15, 3600, 2).await;
            let shadow = u64::from(over_code == OK);
            let r = go.call(vec![desc(&e)], 1).await;
            assert_eq!(st(&r, 0), (over_code, 0, Some(800)));
            assert_eq!(go.stats(&label), [3, 1, 1, 2, shadow]);
            let r = go.call(vec![desc(&e)], 1).await;
            assert_eq!(st(&r, 0), (over_code, 0, Some(800)));
            assert_eq!(go.stats(&label), [4, 2, 1, 2, 2 * shadow]);
        }
    }
}

/// `TestGetResponseStatusOverLimit`, `...ShadowMode`, `...BelowLimit` and
/// `...BelowLimitShadowMode` (whose counts before and after a request are
/// given directly in Go; here the request's hits are their difference): a
/// limit of 5 with 2 counted and 5 more is over by 2, near by 1; a limit of
/// 10 with 2 counted and 4 more leaves 4 and is not near (threshold 8).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_go_services_response_status_cases() {
    let yaml = "descriptors:
  - key: over
    value: v
    rate_limit: {unit: second, requests_per_unit: 5, fixed}
  - key: overshadow
    value: v
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 5, fixed}
  - key: below
    value: v
    rate_limit: {unit: second, requests_per_unit: 10, fixed}
  - key: belowshadow
    value: v
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 10, fixed}
";
    for b in Backend::both() {
        let go = Go::new(&b, "gostatus", yaml, 1234);
        for (k, n, hits, want, stats) in [
            ("over", 5, 5, (OVER, 0), [5, 2, 1, 0, 0]),
            ("overshadow", 5, 5, (OK, 0), [5, 2, 1, 0, 2]),
            ("below", 10, 4, (OK, 4), [4, 0, 0, 4, 0]),
            ("belowshadow", 10, 4, (OK, 4), [4, 0, 0, 4, 0]),
        ] {
            let e = [(k, "v")];
            go.add(&e, n, 1, 2).await;
            let r = go.call(vec![desc(&e)], hits).await;
            assert_eq!(st(&r, 0), (want.0, want.1, Some(1)), "{k} {}", b.name());
            assert_eq!(go.stats(&format!("{k}_v")), stats, "{k}");
        }
    }
}

/// `TestServicePerDescriptorQuotaMode`, `TestServiceMixedPerDescriptorModes`,
/// `...UnderLimit`, `TestServiceQuotaModeOnlyAllOverTheLimit` and
/// `...OnlySomeOverTheLimit` (`test/service/ratelimit_test.go`), on fixed
/// windows: a normal rule over its limit denies whatever the quota rules
/// say; quota rules deny only when every one of them is over; a quota window
/// over its limit counts its hit (as the Go service's `INCRBY` does) and
/// says `OVER_LIMIT` in a request that passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_go_services_quota_mode_cases() {
    let yaml = "descriptors:
  - key: regular
    value: limit
    rate_limit: {unit: minute, requests_per_unit: 5, fixed}
  - key: quota
    value: limit
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 3, fixed}
  - key: quota1
    value: limit
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 5, fixed}
  - key: quota2
    value: limit
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 3, fixed}
";
    let (regular, quota) = ([("regular", "limit")], [("quota", "limit")]);
    let (quota1, quota2) = ([("quota1", "limit")], [("quota2", "limit")]);
    for b in Backend::both() {
        // (case, [(entries, limit, count before)], overall, codes)
        let cases: [QuotaCase<'_>; 5] = [
            ("goq1", [(&regular, 5, 5), (&quota, 3, 0)], OVER, [OVER, OK]),
            ("goq2", [(&regular, 5, 0), (&quota, 3, 3)], OVER, [OK, OVER]),
            ("goq3", [(&regular, 5, 0), (&quota, 3, 0)], OK, [OK, OK]),
            (
                "goq4",
                [(&quota1, 5, 5), (&quota2, 3, 3)],
                OVER,
                [OVER, OVER],
            ),
            ("goq5", [(&quota1, 5, 5), (&quota2, 3, 0)], OK, [OVER, OK]),
        ];
        for (case, rules, overall, codes) in cases {
            let go = Go::new(&b, case, yaml, 1234);
            for (e, n, before) in rules {
                go.add(e, n, 60, before).await;
            }
            let r = go.call(vec![desc(rules[0].0), desc(rules[1].0)], 1).await;
            assert_eq!(
                (r.overall_code, [r.statuses[0].code, r.statuses[1].code]),
                (overall, codes),
                "{case} {}",
                b.name()
            );
            for s in &r.statuses {
                assert_eq!(s.duration_until_reset.as_ref().map(|d| d.seconds), Some(26));
            }
        }
        // A quota window over its limit counted its hit: the Go service's
        // over count, in a request that passed.
        let go = Go::new(&b, "goq6", yaml, 1234);
        go.add(&quota1, 5, 60, 5).await;
        let r = go.call(vec![desc(&quota1), desc(&quota2)], 1).await;
        assert_eq!(r.overall_code, OK);
        assert_eq!(go.stats("quota1_limit"), [1, 1, 0, 0, 0]);
        assert_eq!(go.stats("quota2_limit"), [1, 0, 0, 1, 0]);
        let r = go.call(vec![desc(&quota1)], 0).await;
        assert_eq!(st(&r, 0), (OVER, 0, Some(26)), "6 of 5 counted");
    }
}

/// `TestOverLimitWithStopCacheKeyIncrementWhenOverlimitConfig`: with the
/// Go service's `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`, a request that
/// one key would take over its limit increments only that key, as
/// bucket-rls's all-or-nothing does: two hourly windows of 15 and 14 at 10,
/// then 11 (hits 1, 2): both OK; at 13 with hits 2 the second is over, is
/// counted to 15, and the first is left at 13 (2 remaining). The over key's
/// counts are the Go service's; the first key, which neither counts, is not
/// counted within the limit here (the Go service counts it so).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_go_services_stop_increment_when_over_limit_case() {
    let yaml = "descriptors:
  - key: key4
    value: value4
    rate_limit: {unit: hour, requests_per_unit: 15, fixed}
  - key: key5
    value: value5
    rate_limit: {unit: hour, requests_per_unit: 14, fixed}
";
    let (k4, k5) = ([("key4", "value4")], [("key5", "value5")]);
    for b in Backend::both() {
        let go = Go::new(&b, "gostop", yaml, 1_000_000);
        go.add(&k4, 15, 3600, 10).await;
        go.add(&k5, 14, 3600, 10).await;
        let both = |h: u64| vec![desc_hits(&k4, h), desc_hits(&k5, h)];
        let r = go.call(both(1), 0).await;
        assert_eq!(
            (st(&r, 0), st(&r, 1)),
            ((OK, 4, Some(800)), (OK, 3, Some(800)))
        );
        let r = go.call(both(2), 0).await;
        assert_eq!(
            (st(&r, 0), st(&r, 1)),
            ((OK, 2, Some(800)), (OK, 1, Some(800)))
        );
        assert_eq!(go.stats("key4_value4"), [3, 0, 1, 3, 0], "{}", b.name());
        assert_eq!(go.stats("key5_value5"), [3, 0, 2, 3, 0]);
        let r = go.call(both(2), 0).await;
        assert_eq!(r.overall_code, OVER);
        assert_eq!(
            (st(&r, 0), st(&r, 1)),
            ((OK, 2, Some(800)), (OVER, 0, Some(800)))
        );
        assert_eq!(go.stats("key5_value5"), [5, 1, 3, 3, 0]);
        assert_eq!(go.stats("key4_value4")[..2], [5, 0]);
        // key4 was left at 13, key5 counted to 15.
        let r = go.call(vec![desc_hits(&k4, 0), desc_hits(&k5, 0)], 0).await;
        assert_eq!((st(&r, 0).1, st(&r, 1).0), (2, OVER));
    }
}
