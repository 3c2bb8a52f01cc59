//! Redis failures through the service core, against real `redis-server`
//! processes (production mode: time from Redis `TIME`):
//! `NOSCRIPT` after `SCRIPT FLUSH` and restart, an ambiguous timeout never
//! replayed, Redis down or blackholed (fast `UNAVAILABLE`, circuit breaker,
//! storage-free rules keep working, recovery without restart). The cases are
//! in docs/cases.md, "NOSCRIPT is handled", "Ambiguous calls are never
//! replayed" and "Redis down answers fast".

mod common;

use bucket_rls::grpc::ShouldRateLimit as _;
use bucket_rls::limiter::Limiter;
use bucket_rls::storage::Storage;
use bucket_rls::storage::redis::RedisStorage;
use common::redis::{FaultProxy, RedisServer, wait_ready};
use common::{desc, limiter, req, unique_prefix};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use std::sync::Arc;
use std::time::{Duration, Instant};

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;

const YAML: &str = r"
domain: rl
descriptors:
  - key: k
    value: v
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: ten
    value: v
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: free
    rate_limit: {unlimited: true}
  - key: hourly
    value: v
    rate_limit: {unit: hour, requests_per_unit: 10}
";

/// Timing tests run one at a time, so parallel tests do not skew latencies.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[path = "redis_failures/batching.rs"]
mod batching;

fn storage(url: &str, timeout_ms: u64) -> Arc<RedisStorage> {
    Arc::new(
        RedisStorage::builder(url)
            .timeout(Duration::from_millis(timeout_ms))
            .build()
            .expect("valid URL"),
    )
}

async fn call(l: &Limiter, entries: &[(&str, &str)]) -> Result<RateLimitResponse, tonic::Status> {
    l.should_rate_limit(&req("rl", vec![desc(entries)], 0))
        .await
}

async fn ok_remaining(l: &Limiter, entries: &[(&str, &str)]) -> (i32, u32) {
    let r = call(l, entries)
        .await
        .unwrap_or_else(|s| panic!("unexpected {s:?}"));
    (r.overall_code, r.statuses[0].limit_remaining)
}

/// The Redis timeout of the failure tests (`storage(url, 50)`).
const TIMEOUT: Duration = Duration::from_millis(50);
/// Consecutive failures that open the breaker (the default).
const BREAKER_THRESHOLD: usize = bucket_rls::storage::redis::DEFAULT_BREAKER_THRESHOLD as usize;

/// `n` sequential calls of `[[ten=v]]` that must all fail with
/// `UNAVAILABLE`, with Redis down: how long each took, whether each was
/// answered by the open circuit breaker (which makes no call to Redis; told
/// by the `circuit_open` kind of the storage error counter), and
/// how many probes the breaker may have let through since it could first
/// have opened (one per whole probe interval after the call that reached the
/// threshold began).
async fn failing_calls(l: &Limiter, n: usize) -> (Vec<Duration>, Vec<bool>, usize) {
    let mut took = Vec::new();
    let mut by_breaker = Vec::new();
    let mut opening = None;
    for i in 0..n {
        let before = circuit_open_errors();
        let t = Instant::now();
        if i + 1 == BREAKER_THRESHOLD {
            opening = Some(t);
        }
        let e = call(l, &[("ten", "v")]).await.expect_err("Redis is down");
        took.push(t.elapsed());
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        by_breaker.push(circuit_open_errors() - before == 1.0);
    }
    let open_for = opening.expect("more calls than the threshold").elapsed();
    let interval = bucket_rls::storage::redis::DEFAULT_PROBE_INTERVAL;
    let probes = usize::try_from(open_for.as_nanos() / interval.as_nanos()).expect("small");
    (took, by_breaker, probes)
}

/// Requests failed by the open circuit breaker so far (in this binary only
/// the breaker tests open it, one at a time).
fn circuit_open_errors() -> f64 {
    common::metrics::counter(
        bucket_rls::metrics::STORAGE_ERRORS,
        &[("kind", "circuit_open")],
    )
}

fn median(took: &[Duration]) -> Duration {
    let mut sorted = took.to_vec();
    sorted.sort();
    sorted[sorted.len() / 2]
}

fn reload_counter() -> f64 {
    bucket_rls::metrics::install()
        .render()
        .lines()
        .find_map(|l| l.strip_prefix("bucket_rls_redis_script_reload_total "))
        .map_or(0.0, |v| v.trim().parse().unwrap_or(0.0))
}

/// With a 50 ms timeout every call ends with UNAVAILABLE long before a
/// client library's default timeout (seconds) would. This is a hang detector,
/// not a speed target (speed is measured by benchmarks, never asserted): the
/// bound is generous so a busy CI machine cannot make it flaky. The median is
/// printed for the record.
fn assert_bounded(took: &[Duration]) {
    let mut sorted = took.to_vec();
    sorted.sort();
    println!(
        "median {:?}, max {:?}",
        sorted[sorted.len() / 2],
        sorted[sorted.len() - 1]
    );
    assert!(
        took.iter().all(|d| *d <= Duration::from_millis(500)),
        "a call was not bounded by the timeout: {took:?}"
    );
}

/// `FUNCTION FLUSH` with `SCRIPT FLUSH` (a) and a restart without
/// persistence (b) are
/// handled transparently: the library is loaded again and the call retried
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_library_after_flush_and_restart_is_loaded_again() {
    let _serial = SERIAL.lock().await;
    let mut server = RedisServer::start();
    let s = storage(&server.url(), 1000);
    let l = limiter(YAML, s.clone(), &unique_prefix("br23"));
    wait_ready(&s).await;
    for want in [99, 98, 97] {
        assert_eq!(ok_remaining(&l, &[("k", "v")]).await, (OK, want));
    }
    let before = reload_counter();
    let _: () = server.query(redis::cmd("FUNCTION").arg("FLUSH"));
    let _: () = server.query(redis::cmd("SCRIPT").arg("FLUSH"));
    assert_eq!(
        ok_remaining(&l, &[("k", "v")]).await,
        (OK, 96),
        "(a) exactly one token consumed"
    );
    assert!(reload_counter() >= before + 1.0, "reload counted");
    server.restart();
    wait_ready(&s).await;
    assert_eq!(
        ok_remaining(&l, &[("k", "v")]).await,
        (OK, 99),
        "(b) fresh bucket, no error"
    );
    // Function not found, then one retry (or none lost: the health task
    // loads the library again once Redis answers after a failed ping).
    assert_eq!(server.command_executions("fcall"), 1, "ran once");
    assert!(server.command_calls("fcall") <= 2, "at most one retry");
}

/// A Redis that refuses Functions runs the same script as `EVALSHA`, with
/// the same answers; `SCRIPT FLUSH` (docs/cases.md, "NOSCRIPT is handled")
/// then costs one `SCRIPT LOAD` and one retry, and exactly one token.
async fn refused_functions_fall_back_to_evalsha(server: &RedisServer, url: &str, why: &str) {
    let s = storage(url, 1000);
    let l = limiter(YAML, s.clone(), &unique_prefix("nofn"));
    wait_ready(&s).await;
    for want in [99, 98, 97] {
        assert_eq!(ok_remaining(&l, &[("k", "v")]).await, (OK, want), "{why}");
    }
    let before = reload_counter();
    let _: () = server.query(redis::cmd("SCRIPT").arg("FLUSH"));
    assert_eq!(
        ok_remaining(&l, &[("k", "v")]).await,
        (OK, 96),
        "{why}: exactly one token consumed"
    );
    assert!(reload_counter() >= before + 1.0, "{why}: reload counted");
    assert_eq!(server.command_executions("fcall"), 0, "{why}: no FCALL ran");
    assert!(
        server.command_executions("evalsha") >= 4,
        "{why}: the script ran as EVALSHA"
    );
}

/// Functions refused by the ACL (`NOPERM`): the script runs as `EVALSHA`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_refused_functions_runs_the_script_as_evalsha() {
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start();
    let _: () = server.query(
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg("nofn")
            .arg("on")
            .arg(">pw"),
    );
    let _: () = server.query(
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg("nofn")
            .arg("~*")
            .arg("+@all")
            .arg("-fcall")
            .arg("-function"),
    );
    let url = format!("redis://nofn:pw@127.0.0.1:{}", server.port());
    refused_functions_fall_back_to_evalsha(&server, &url, "ACL").await;
    let listed: redis::Value = server.query(redis::cmd("FUNCTION").arg("LIST"));
    assert_eq!(listed, redis::Value::Array(vec![]), "no library loaded");
}

/// A Redis without `FCALL` and `FUNCTION` (as before Redis 7: here the
/// commands are renamed away, so they are unknown): the script runs as
/// `EVALSHA`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_without_functions_runs_the_script_as_evalsha() {
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start_with(&[
        "--rename-command",
        "FCALL",
        "",
        "--rename-command",
        "FUNCTION",
        "",
    ]);
    refused_functions_fall_back_to_evalsha(&server, &server.url(), "unknown commands").await;
}

/// A reply delayed past the timeout gives `UNAVAILABLE` quickly, and
/// the call is not replayed: the next call sees exactly one more token gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambiguous_timeout_is_not_replayed() {
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port()).await;
    let s = storage(&proxy.url(), 50);
    let l = limiter(YAML, s.clone(), &unique_prefix("br24"));
    wait_ready(&s).await;
    // Loaded now, so the count below is not raced by the background load.
    let _: String = server.query(
        redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(&bucket_rls::storage::redis::script::LIBRARY.code),
    );
    let _: () = server.query(redis::cmd("CONFIG").arg("RESETSTAT"));
    assert_eq!(ok_remaining(&l, &[("ten", "v")]).await, (OK, 9));
    // Replies are held for 1 s: an answer well before that came from the
    // 50 ms timeout, not from the late reply.
    proxy.delay_replies_ms(1000);
    let t = Instant::now();
    let e = call(&l, &[("ten", "v")]).await.expect_err("timed out");
    let took = t.elapsed();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(
        took <= Duration::from_millis(500),
        "UNAVAILABLE after {took:?}"
    );
    proxy.delay_replies_ms(0);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(
        ok_remaining(&l, &[("ten", "v")]).await,
        (OK, 7),
        "OK(6) would be a replay"
    );
    assert_eq!(
        server.script_executions(),
        3,
        "the script ran exactly 3 times"
    );
    // (An `EVAL` here may be the script clock check: a health ping that
    // fell in the held second failed, and a failed ping has the clock
    // checked again. The bucket script itself is never sent as `EVAL` on a
    // single node.)
}

/// Redis stopped (docs/cases.md, "Redis down answers fast", steps 1 and 3).
/// Fast `UNAVAILABLE`, never `OVER_LIMIT`; the breaker answers at once after
/// repeated failures; unlimited and unmatched descriptors still answer OK; a
/// mixed request is `UNAVAILABLE`; the health check fails; recovery without
/// restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_then_back() {
    let _serial = SERIAL.lock().await;
    let mut server = RedisServer::start();
    let s = storage(&server.url(), 50);
    let l = limiter(YAML, s.clone(), &unique_prefix("br25"));
    wait_ready(&s).await;
    assert_eq!(ok_remaining(&l, &[("ten", "v")]).await, (OK, 9));
    server.stop();
    let (took, by_breaker, probes) = failing_calls(&l, 20).await;
    assert_bounded(&took);
    assert!(s.circuit_open(), "breaker open after 20 failures");
    // The last ten calls are answered by the open breaker, without a call to
    // Redis (so without waiting for the timeout), except the probes it lets
    // through, at most one per probe interval.
    assert!(
        by_breaker[10..].iter().filter(|b| **b).count() >= 10_usize.saturating_sub(probes),
        "the open breaker answers without calling Redis: {by_breaker:?} {took:?}"
    );
    for _ in 0..5 {
        let r = call(&l, &[("free", "x")])
            .await
            .expect("unlimited needs no Redis");
        assert_eq!(
            (r.overall_code, r.statuses[0].limit_remaining),
            (OK, u32::MAX)
        );
        let r = call(&l, &[("nomatch", "1")])
            .await
            .expect("no match needs no Redis");
        assert_eq!(r.overall_code, OK);
        assert!(r.statuses[0].current_limit.is_none());
    }
    let e = l
        .should_rate_limit(&req(
            "rl",
            vec![desc(&[("ten", "v")]), desc(&[("free", "x")])],
            0,
        ))
        .await
        .expect_err("mixed request needs Redis");
    assert_eq!(e.code(), tonic::Code::Unavailable);
    assert!(s.ping().await.is_err(), "health check reports not ready");
    server.restart();
    let t = Instant::now();
    loop {
        match call(&l, &[("ten", "v")]).await {
            Ok(r) => {
                // Fresh Redis without persistence: a full bucket.
                assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 9));
                break;
            }
            Err(e) => assert_eq!(e.code(), tonic::Code::Unavailable),
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "not recovered within 5 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!s.circuit_open());
}

/// Redis unreachable (docs/cases.md, "Redis down answers fast", steps 1 and
/// 2): blackholed, without a reset, from startup. Every call is
/// `UNAVAILABLE`, bounded by the timeout; then the breaker answers without
/// calling Redis; when traffic flows again, answers are normal within 5 s
/// without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackholed_from_startup() {
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port()).await;
    proxy.hold(true);
    let s = storage(&proxy.url(), 50);
    let l = limiter(YAML, s.clone(), &unique_prefix("br25b"));
    let (took, by_breaker, probes) = failing_calls(&l, 20).await;
    assert_bounded(&took);
    assert!(s.circuit_open());
    // Blackholed, a call sent to Redis waits for the whole 50 ms timeout; the
    // open breaker answers without calling Redis. The last ten calls are the
    // breaker's, except the probes (one per probe interval).
    assert!(
        by_breaker[10..].iter().filter(|b| **b).count() >= 10_usize.saturating_sub(probes),
        "the open breaker answers without calling Redis: {by_breaker:?} {took:?}"
    );
    assert!(
        median(&took[10..]) < TIMEOUT,
        "the breaker answers faster than a call that waits for the timeout: {took:?}"
    );
    assert!(s.ping().await.is_err(), "not ready while blackholed");
    let r = call(&l, &[("free", "x")])
        .await
        .expect("unlimited needs no Redis");
    assert_eq!(r.overall_code, OK);
    proxy.hold(false);
    let t = Instant::now();
    loop {
        if let Ok(r) = call(&l, &[("ten", "v")]).await {
            assert_eq!(r.overall_code, OK);
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "not recovered within 5 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn charge(key: &str, cost: u64) -> bucket_rls::storage::Charge {
    bucket_rls::storage::Charge {
        key: key.into(),
        spec: bucket_rls::storage::ChargeSpec {
            limit: bucket_rls::storage::Limit::TokenBucket(bucket_rls::storage::BucketLimit {
                requests_per_unit: 10,
                unit_secs: std::num::NonZeroU64::new(60).expect("a minute"),
                burst: 10,
                max_debt: 0,
            }),
            cost,
            kind: bucket_rls::storage::ChargeKind::Consume,
            shadow: false,
        },
    }
}

/// Redis error replies are classified by kind (the `kind` label of
/// `bucket_rls_storage_errors_total`), and none is mistaken for an answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_replies_are_classified() {
    let primary = RedisServer::start();
    let s = storage(&primary.url(), 1000);
    wait_ready(&s).await;
    let kind = |r: Result<_, bucket_rls::storage::StorageError>| match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.kind().to_owned(),
    };
    // A foreign value under a bucket's name.
    let _: () = primary.query(redis::cmd("HSET").arg("foreign").arg("f").arg("v"));
    assert_eq!(kind(s.apply(&[charge("foreign", 1)]).await), "WRONGTYPE");
    // Memory full with `noeviction`.
    let _: () = primary.query(redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("1"));
    assert_eq!(kind(s.apply(&[charge("b", 1)]).await), "OOM");
    let _: () = primary.query(redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("0"));
    // A time the script cannot compute with exactly (an explicit test
    // clock above 2^53 us): refused before sending. (A burst above u32 and
    // a unit of 0 s cannot be expressed at all.)
    let clock = bucket_rls::storage::clock::ManualClock::new(1 << 53);
    let late = RedisStorage::builder(primary.url())
        .timeout(Duration::from_millis(1000))
        .test_clock(Arc::new(clock))
        .build()
        .expect("valid URL");
    assert_eq!(kind(late.apply(&[charge("b", 1)]).await), "argument");
    // A read-only replica (stale primary after a failover).
    let replica = RedisServer::start();
    let _: () = replica.query(redis::cmd("REPLICAOF").arg("127.0.0.1").arg(primary.port()));
    let r = storage(&replica.url(), 1000);
    wait_ready(&r).await;
    assert_eq!(kind(r.apply(&[charge("b", 1)]).await), "READONLY");
    // Even a check, which writes nothing: the library's function may
    // write, so a replica refuses it before it runs (a stale primary is
    // seen at the first request of any kind).
    assert_eq!(kind(r.apply(&[charge("b", 0)]).await), "READONLY");
}

/// A key of another type under a bucket's name fails the whole request with
/// WRONGTYPE, even beside hot buckets that exist (the script reads them
/// together): the foreign key is left as it was and no other bucket of the
/// request is charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_key_beside_existing_buckets_fails_the_request_and_is_kept() {
    let primary = RedisServer::start();
    let s = storage(&primary.url(), 1000);
    wait_ready(&s).await;
    // Two buckets that exist (one token taken from each of 10).
    let first = s
        .apply(&[charge("hot1", 1), charge("hot2", 1)])
        .await
        .expect("admitted");
    assert!(first.admitted);
    let _: () = primary.query(redis::cmd("SADD").arg("foreign").arg("member"));
    let e = s
        .apply(&[charge("hot1", 1), charge("foreign", 1), charge("hot2", 1)])
        .await
        .expect_err("a set under a bucket's name");
    assert_eq!(e.kind(), "WRONGTYPE");
    let kind: String = primary.query(redis::cmd("TYPE").arg("foreign"));
    assert_eq!(kind, "set");
    let members: Vec<String> = primary.query(redis::cmd("SMEMBERS").arg("foreign"));
    assert_eq!(members, vec!["member".to_owned()]);
    // Still 9 of 10 in each: the failed request charged nothing.
    let after = s
        .apply(&[charge("hot1", 0), charge("hot2", 0)])
        .await
        .expect("a check");
    for c in &after.charges {
        assert!(
            (8_999_000..=9_100_000).contains(&c.remaining_micro),
            "{after:?}"
        );
    }
}

/// A request with more buckets than one read of the script takes (it reads
/// in slices of 512 keys) reads and charges every one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_a_thousand_buckets_charges_each_once() {
    let primary = RedisServer::start();
    let s = storage(&primary.url(), 5000);
    wait_ready(&s).await;
    let charges: Vec<_> = (0..1000).map(|i| charge(&format!("b{i}"), 1)).collect();
    for round in 1..=2 {
        let r = s.apply(&charges).await.expect("admitted");
        assert!(r.admitted);
        assert_eq!(r.charges.len(), 1000);
        for (i, c) in r.charges.iter().enumerate() {
            // 10 - round tokens left, plus at most a little refill.
            let left = (10 - round) * 1_000_000;
            assert!(
                (left..left + 100_000).contains(&c.remaining_micro),
                "round {round}, bucket {i}: {c:?}"
            );
        }
    }
    let keys: i64 = primary.query(&redis::cmd("DBSIZE"));
    assert_eq!(keys, 1000);
}

/// `--on-storage-error allow|deny` with Redis down: `allow` answers OK with
/// no `current_limit` (never a limit it did not check), `deny` answers
/// OVER_LIMIT for the descriptors that needed Redis; storage-free
/// descriptors keep their normal answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_policies_with_redis_down() {
    use bucket_rls::settings::{OnStorageError, ServiceSettings};
    let mut server = RedisServer::start();
    let s = storage(&server.url(), 50);
    wait_ready(&s).await;
    server.stop();
    for (policy, code) in [
        (OnStorageError::Allow, OK),
        (OnStorageError::Deny, Code::OverLimit as i32),
    ] {
        let settings = ServiceSettings {
            key_prefix: unique_prefix("policy"),
            on_storage_error: policy,
            ..ServiceSettings::default()
        };
        let l = Limiter::new(common::config(&[("t.yaml", YAML)]), s.clone(), settings);
        let r = l
            .should_rate_limit(&req(
                "rl",
                vec![desc(&[("ten", "v")]), desc(&[("free", "x")])],
                0,
            ))
            .await
            .expect("answered by policy");
        assert_eq!(r.overall_code, code, "{policy:?}");
        assert_eq!(r.statuses[0].code, code);
        assert!(r.statuses[0].current_limit.is_none(), "{policy:?}: {r:?}");
        assert_eq!(
            (r.statuses[1].code, r.statuses[1].limit_remaining),
            (OK, u32::MAX)
        );
    }
}

/// A latency spike that times out every call in flight at once counts as
/// one failure: the breaker stays closed and the next calls go to Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latency_spike_does_not_open_the_breaker() {
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port()).await;
    let s = storage(&proxy.url(), 50);
    let l = Arc::new(limiter(YAML, s.clone(), &unique_prefix("spike")));
    wait_ready(&s).await;
    proxy.delay_replies_ms(120);
    let calls: Vec<_> = (0..16)
        .map(|_| {
            let l = l.clone();
            tokio::spawn(async move { call(&l, &[("k", "v")]).await.is_err() })
        })
        .collect();
    for c in calls {
        assert!(c.await.expect("call"), "timed out");
    }
    assert!(
        !s.circuit_open(),
        "16 calls in flight together are one observation"
    );
    proxy.delay_replies_ms(0);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = call(&l, &[("k", "v")]).await.expect("Redis answers again");
    assert_eq!(r.overall_code, OK);
}

/// An engine whose scripts may not read `TIME` (as some managed services
/// forbid; here an ACL user without `TIME`, which Redis applies inside
/// scripts too): the backend refuses to serve from it, before any bucket
/// is touched, with an error naming the engine problem; the health probe
/// says the same; once `TIME` is allowed the next check passes and
/// requests are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_whose_scripts_cannot_read_time_is_refused_with_the_reason() {
    let server = RedisServer::start();
    let acl = |rule: &str| {
        let _: () = server.query(
            redis::cmd("ACL")
                .arg("SETUSER")
                .arg("limited")
                .arg("on")
                .arg(">pw")
                .arg("~*")
                .arg("+@all")
                .arg(rule),
        );
    };
    acl("-time");
    let s = storage(
        &format!("redis://limited:pw@127.0.0.1:{}", server.port()),
        1_000,
    );
    // The ping checks the clock once connected.
    let (why, _) =
        common::eventually::eventually(Duration::from_secs(5), "the clock refused", || {
            let s = s.clone();
            async move {
                s.ping()
                    .await
                    .err()
                    .filter(|e| e.to_string().contains("TIME"))
            }
        })
        .await;
    assert!(why.to_string().contains("refused the clock check"), "{why}");
    let l = limiter(YAML, s.clone(), &unique_prefix("clock"));
    let e = call(&l, &[("k", "v")]).await.expect_err("refused");
    assert_eq!(e.code(), tonic::Code::Unavailable);
    assert!(
        e.message()
            .contains("refused the clock check, TIME inside a Lua script"),
        "{}",
        e.message()
    );
    let why = l.check_charges().await.expect_err("unhealthy");
    assert!(
        why.to_string().contains("TIME inside a Lua script"),
        "{why}"
    );
    assert_eq!(server.script_executions(), 0, "no bucket script ran");
    acl("+time");
    tokio::time::sleep(bucket_rls::storage::redis::script_clock::RECHECK_AFTER).await;
    assert_eq!(ok_remaining(&l, &[("k", "v")]).await, (OK, 99));
    l.check_charges().await.expect("healthy");
}

/// Hard quotas across a Redis crash (docs/redis.md, "Budgets that survive a
/// restart"): with `appendonly yes` and `appendfsync always`, a bucket
/// drained before Redis is killed with SIGKILL is still drained when Redis
/// restarts from its append-only file; without persistence the same
/// restart starts it full (the over-admission docs/design.md states for a
/// restart without AOF: one burst per bucket).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drained_buckets_stay_drained_across_sigkill_with_aof_always() {
    for (persistence, after_restart) in [
        (
            &["--appendonly", "yes", "--appendfsync", "always"][..],
            (OVER, 0),
        ),
        (&[][..], (OK, 9)),
    ] {
        let mut server = RedisServer::start_with(persistence);
        // Without the local over-limit cache, whose denial of a second
        // would answer for Redis right after a quick restart.
        let s = Arc::new(
            RedisStorage::builder(server.url())
                .timeout(Duration::from_secs(1))
                .local_cache_size(0)
                .build()
                .expect("valid URL"),
        );
        wait_ready(&s).await;
        let l = limiter(YAML, s.clone(), &unique_prefix("aof"));
        for left in (0..10).rev() {
            assert_eq!(ok_remaining(&l, &[("hourly", "v")]).await, (OK, left));
        }
        assert_eq!(ok_remaining(&l, &[("hourly", "v")]).await.0, OVER);
        // SIGKILL: no shutdown save, only what the AOF already holds.
        server.restart();
        let (answer, _) = common::eventually::eventually(
            Duration::from_secs(10),
            "served again after the restart",
            || async { call(&l, &[("hourly", "v")]).await.ok() },
        )
        .await;
        assert_eq!(
            (answer.overall_code, answer.statuses[0].limit_remaining),
            after_restart,
            "{persistence:?}"
        );
    }
}

/// A charge of 1 on `key`, a bucket of `burst` tokens refilled once an hour.
fn hourly(key: &str, burst: u32) -> bucket_rls::storage::Charge {
    let mut c = charge(key, 1);
    c.spec.limit = bucket_rls::storage::Limit::TokenBucket(bucket_rls::storage::BucketLimit {
        requests_per_unit: burst,
        unit_secs: std::num::NonZeroU64::new(3600).expect("an hour"),
        burst,
        max_debt: 0,
    });
    c
}
