//! The service core over the Redis backend against real `redis-server`
//! processes: TTLs, Redis time and clock steps, token budgets in debt, several
//! service instances sharing buckets under concurrency (exact burst), high
//! rates, config changes and the local over-limit cache, block rules, and one
//! script call per request whatever the number of descriptors. The cases and
//! their values are in docs/cases.md.

mod common;

use bucket_rls::grpc::ShouldRateLimit as _;
use bucket_rls::limiter::Limiter;
use bucket_rls::storage::clock::ManualClock;
use bucket_rls::storage::redis::RedisStorage;
use common::redis::{RedisServer, decode_bucket};
use common::{config, desc, desc_hits, limiter, req, unique_prefix};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;
/// 2023-11-14 in microseconds.
const T0_US: u64 = 1_700_000_000_000_000;

/// A production-mode backend (time from Redis `TIME`).
fn storage(server: &RedisServer) -> Arc<RedisStorage> {
    Arc::new(
        RedisStorage::builder(server.url())
            .timeout(Duration::from_secs(2))
            .build()
            .expect("valid URL"),
    )
}

/// A backend with the test-only explicit clock.
fn clocked(server: &RedisServer, clock: &ManualClock) -> Arc<RedisStorage> {
    Arc::new(
        RedisStorage::builder(server.url())
            .timeout(Duration::from_secs(2))
            .test_clock(Arc::new(clock.clone()))
            .build()
            .expect("valid URL"),
    )
}

async fn call(l: &Limiter, domain: &str, entries: &[(&str, &str)], hits: u32) -> RateLimitResponse {
    l.should_rate_limit(&req(domain, vec![desc(entries)], hits))
        .await
        .unwrap_or_else(|s| panic!("unexpected {s:?}"))
}

/// `(code, remaining, duration seconds)` of status `i`.
fn st(r: &RateLimitResponse, i: usize) -> (i32, u32, Option<i64>) {
    let s = &r.statuses[i];
    (
        s.code,
        s.limit_remaining,
        s.duration_until_reset.as_ref().map(|d| d.seconds),
    )
}

/// Every key under `prefix`.
fn keys(server: &RedisServer, prefix: &str) -> Vec<String> {
    let mut conn = server.conn();
    let iter: redis::Iter<'_, String> = redis::cmd("SCAN")
        .cursor_arg(0)
        .arg("MATCH")
        .arg(format!("{prefix}*"))
        .arg("COUNT")
        .arg(1000)
        .clone()
        .iter(&mut conn)
        .expect("SCAN");
    iter.map(|k| k.expect("key")).collect()
}

fn pttl(server: &RedisServer, key: &str) -> i64 {
    server.query(redis::cmd("PTTL").arg(key))
}

fn raw(server: &RedisServer, key: &str) -> Option<Vec<u8>> {
    server.query(redis::cmd("GET").arg(key))
}

const PER_VALUE: &str = r"
domain: ttl
descriptors:
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 60}
";

/// docs/cases.md, "Every key has a long enough TTL": every bucket key has a TTL
/// covering its time to full, never more than one unit here, never none; a
/// check (cost 0) writes nothing and refreshes no TTL; state survives until the
/// bucket is full (OK(29) at t=30).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_has_a_ttl_until_its_bucket_is_full() {
    let server = RedisServer::start();
    let prefix = unique_prefix("br26");
    let l = limiter(PER_VALUE, storage(&server), &prefix);
    let r = call(&l, "ttl", &[("k", "a")], 60).await;
    assert_eq!(st(&r, 0).0, OK);
    let ks = keys(&server, &prefix);
    assert_eq!(ks.len(), 1);
    let drained = ks[0].clone();
    let t = pttl(&server, &drained);
    assert!(
        (59_000..=60_000).contains(&t),
        "PTTL {t} covers the 60 s to full"
    );
    // A check leaves the key byte-identical and does not re-arm the TTL.
    let before = (raw(&server, &drained), pttl(&server, &drained));
    tokio::time::sleep(Duration::from_millis(30)).await;
    let r = l
        .should_rate_limit(&req("ttl", vec![desc_hits(&[("k", "a")], 0)], 0))
        .await
        .expect("check");
    assert_eq!(st(&r, 0).0, OVER, "a 1-hit request would be denied");
    let after = (raw(&server, &drained), pttl(&server, &drained));
    assert_eq!(after.0, before.0, "bucket bytes unchanged by a check");
    assert!(
        after.1 <= before.1 - 20,
        "TTL not refreshed: {before:?} -> {after:?}"
    );
    // 1000 distinct values: OK, OVER_LIMIT after draining, and checks.
    for i in 0..1000 {
        let v = format!("v{i}");
        match i % 3 {
            0 => {
                assert_eq!(st(&call(&l, "ttl", &[("k", &v)], 60).await, 0).0, OK);
                assert_eq!(st(&call(&l, "ttl", &[("k", &v)], 1).await, 0).0, OVER);
            }
            // 30 s to full: none expires while the test runs.
            1 => assert_eq!(st(&call(&l, "ttl", &[("k", &v)], 30).await, 0).1, 30),
            _ => {
                let r = l
                    .should_rate_limit(&req("ttl", vec![desc_hits(&[("k", &v)], 0)], 0))
                    .await
                    .expect("check");
                assert_eq!(st(&r, 0).1, 60);
            }
        }
    }
    let ks = keys(&server, &prefix);
    assert_eq!(ks.len(), 1 + 334 + 333, "checks create no key");
    for k in &ks {
        let t = pttl(&server, k);
        assert!(t > 0 && t <= 60_000, "{k}: PTTL {t}");
    }
    // t = 30 s on a paused clock (test-only explicit time): state was kept.
    let clock = ManualClock::new(T0_US);
    let l = limiter(PER_VALUE, clocked(&server, &clock), &unique_prefix("br26t"));
    assert_eq!(st(&call(&l, "ttl", &[("k", "a")], 60).await, 0).1, 0);
    clock.advance(Duration::from_secs(30));
    assert_eq!(
        st(&call(&l, "ttl", &[("k", "a")], 1).await, 0),
        (OK, 29, Some(31))
    );
}

const TEN_PER_SECOND: &str = r"
domain: skew
descriptors:
  - key: k
    value: v
    rate_limit: {unit: second, requests_per_unit: 10}
";

/// docs/cases.md, "Time comes from Redis": in production the script reads Redis
/// `TIME` (the stored timestamp is Redis's clock, whatever the service's).
/// When that clock steps back (test-only explicit clock here), a stored
/// timestamp in the future is taken as now: a drained bucket refills from
/// the step on instead of freezing until the clock catches up, and the
/// step mints nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_stepped_back_neither_freezes_nor_mints() {
    let server = RedisServer::start();
    // Production: the stored timestamp is Redis time.
    let prefix = unique_prefix("br27");
    let l = limiter(TEN_PER_SECOND, storage(&server), &prefix);
    assert_eq!(st(&call(&l, "skew", &[("k", "v")], 1).await, 0).1, 9);
    let (_, updated_us) = decode_bucket(&raw(&server, &keys(&server, &prefix)[0]).expect("bucket"));
    let (secs, micros): (u64, u64) = server.query(&redis::cmd("TIME"));
    let redis_now = secs * 1_000_000 + micros;
    assert!(redis_now >= updated_us && redis_now - updated_us < 2_000_000);
    // Drained an hour ahead, then the clock steps back one hour.
    let clock = ManualClock::new(T0_US + 3_600_000_000);
    let prefix = unique_prefix("br27s");
    let l = limiter(TEN_PER_SECOND, clocked(&server, &clock), &prefix);
    assert_eq!(st(&call(&l, "skew", &[("k", "v")], 10).await, 0).0, OK);
    assert_ne!(st(&call(&l, "skew", &[("k", "v")], 1).await, 0).0, OK);
    clock.set_us(T0_US);
    // No tokens minted by the step.
    assert_ne!(st(&call(&l, "skew", &[("k", "v")], 1).await, 0).0, OK);
    // Not frozen: one second later the bucket is full again, and no fuller.
    clock.advance(Duration::from_secs(1));
    assert_eq!(st(&call(&l, "skew", &[("k", "v")], 10).await, 0).0, OK);
    assert_ne!(st(&call(&l, "skew", &[("k", "v")], 1).await, 0).0, OK);
    let (_, stored) = decode_bucket(&raw(&server, &keys(&server, &prefix)[0]).expect("bucket"));
    assert_eq!(stored, T0_US + 1_000_000, "the write stores now");
}

const SLOW: &str = r"
domain: shared
descriptors:
  - key: k
    value: v
    rate_limit: {unit: hour, requests_per_unit: 1, burst: 50}
";

/// Two service instances on one Redis, 16 concurrent clients: exactly the
/// burst is admitted (refill of 1/hour adds no whole token during the test).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_admit_exactly_the_burst() {
    let server = RedisServer::start();
    let prefix = unique_prefix("two");
    let instances = [
        limiter(SLOW, storage(&server), &prefix),
        limiter(SLOW, storage(&server), &prefix),
    ];
    let admitted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for c in 0..16 {
        let l = instances[c % 2].clone();
        let admitted = admitted.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..10 {
                let r = call(&l, "shared", &[("k", "v")], 1).await;
                if r.overall_code == OK {
                    admitted.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("client");
    }
    assert_eq!(admitted.load(Ordering::SeqCst), 50);
}

const GROUP_AND_EXPORT: &str = r"
domain: api
descriptors:
  - key: group
    value: reports
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: special
    value: export
    rate_limit: {unit: minute, requests_per_unit: 3}
";

/// docs/cases.md, "A denied request charges nothing", under concurrency: 50
/// concurrent callers through two instances; at most 3 admitted on `special`,
/// and `group` is charged only for those.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_instances_never_over_admit_across_buckets() {
    let server = RedisServer::start();
    let prefix = unique_prefix("br16");
    let instances = [
        limiter(GROUP_AND_EXPORT, storage(&server), &prefix),
        limiter(GROUP_AND_EXPORT, storage(&server), &prefix),
    ];
    let mut tasks = Vec::new();
    for c in 0..50 {
        let l = instances[c % 2].clone();
        tasks.push(tokio::spawn(async move {
            let r = l
                .should_rate_limit(&req(
                    "api",
                    vec![
                        desc(&[("group", "reports")]),
                        desc(&[("special", "export")]),
                    ],
                    0,
                ))
                .await
                .expect("answer");
            r.overall_code == OK
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        if t.await.expect("caller") {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 3, "exactly the special budget");
    let r = call(&instances[0], "api", &[("group", "reports")], 1).await;
    assert_eq!(st(&r, 0).0, OK);
    assert_eq!(st(&r, 0).1, 6, "group charged only by admitted requests");
}

const FAST: &str = r"
domain: fast
descriptors:
  - key: k
    value: fast
    rate_limit: {unit: second, requests_per_unit: 6000}
  - key: k
    value: huge
    rate_limit: {unit: second, requests_per_unit: 1000000}
";

/// docs/cases.md, "High rates and large numbers", with Redis time: 64
/// concurrent streams send 12,000 hits at a 6000/s rule (admitted <= 6000 +
/// 6000 T + 1, no errors); a 10^6/s bucket drained by one hit of 10^6 keeps its
/// key (PTTL >= 1 ms) and denies the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn high_rates_limit_exactly_under_concurrency() {
    let server = RedisServer::start();
    let prefix = unique_prefix("br17");
    let l = limiter(FAST, storage(&server), &prefix);
    let admitted = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let l = l.clone();
        let admitted = admitted.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..(12_000 / 64 + 1) {
                let r = call(&l, "fast", &[("k", "fast")], 1).await;
                if r.overall_code == OK {
                    admitted.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("stream");
    }
    let t = started.elapsed().as_secs_f64();
    let admitted = admitted.load(Ordering::SeqCst) as f64;
    assert!(
        admitted <= 6000.0 + 6000.0 * t + 1.0,
        "{admitted} admitted in {t} s"
    );
    assert!(admitted >= 6000.0, "the burst is available: {admitted}");
    let r = call(&l, "fast", &[("k", "huge")], 1_000_000).await;
    assert_eq!(st(&r, 0).0, OK);
    let ks: Vec<String> = keys(&server, &prefix)
        .into_iter()
        .filter(|k| k.contains("huge"))
        .collect();
    assert_eq!(ks.len(), 1);
    let p = pttl(&server, &ks[0]);
    assert!(p >= 1, "PTTL {p}");
    let r = call(&l, "fast", &[("k", "huge")], 1_000_000).await;
    assert_eq!(st(&r, 0), (OVER, 0, Some(1)));
}

const CACHE_V1: &str = r"
domain: reload
descriptors:
  - key: tenant
    value: t1
    rate_limit: {unit: minute, requests_per_unit: 1}
";
const CACHE_V2: &str = r"
domain: reload
descriptors:
  - key: tenant
    value: t1
    rate_limit: {unit: minute, requests_per_unit: 100}
";

/// docs/cases.md, "Changed limits apply to existing buckets", with Redis time
/// and the local cache: a denial is cached and answers the same as Redis
/// without a call; a config change clears it and the new limit applies at once,
/// with the tokens carried over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raising_reload_clears_cached_denials() {
    // The metrics recorder must exist before the hit to count it.
    bucket_rls::metrics::install();
    let server = RedisServer::start();
    let s = storage(&server);
    let l = limiter(CACHE_V1, s.clone(), &unique_prefix("br21"));
    assert_eq!(
        st(&call(&l, "reload", &[("tenant", "t1")], 1).await, 0),
        (OK, 0, Some(60))
    );
    let _: () = server.query(redis::cmd("CONFIG").arg("RESETSTAT"));
    let denied = call(&l, "reload", &[("tenant", "t1")], 1).await;
    assert_eq!(st(&denied, 0), (OVER, 0, Some(60)));
    assert_eq!(s.local_cache_len(), 1, "denial cached");
    let cached = call(&l, "reload", &[("tenant", "t1")], 1).await;
    assert_eq!(cached, denied, "the cache answers exactly as Redis did");
    assert_eq!(server.script_calls(), 1, "second denial from the cache");
    let hits = bucket_rls::metrics::install()
        .render()
        .lines()
        .find_map(|l| l.strip_prefix("bucket_rls_local_cache_hits_total "))
        .and_then(|v| v.trim().parse::<f64>().ok());
    assert!(hits >= Some(1.0), "cache hits counted: {hits:?}");
    // At 100/min a token takes 0.6 s; a stale "empty for 60 s" entry would deny.
    tokio::time::sleep(Duration::from_millis(700)).await;
    l.swap_config(config(&[("test.yaml", CACHE_V2)]));
    assert_eq!(s.local_cache_len(), 0);
    let r = call(&l, "reload", &[("tenant", "t1")], 1).await;
    assert_eq!(st(&r, 0).0, OK, "the new limit applies at once");
    assert!(
        st(&r, 0).1 < 10,
        "carried over, not refilled to 100: {:?}",
        st(&r, 0)
    );
}

const BLOCK: &str = r"
domain: block
descriptors:
  - key: user_agent
    value: bad-scanner
    rate_limit: {unit: minute, requests_per_unit: 0}
";

/// docs/cases.md, "A zero rate blocks", with Redis: a 0-rate rule denies
/// everything for one unit, without a script error, and leaves no key behind
/// (hence no inf/nan anywhere).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_rate_rule_denies_and_writes_nothing() {
    let server = RedisServer::start();
    let prefix = unique_prefix("br04");
    let l = limiter(BLOCK, storage(&server), &prefix);
    for hits in [1, 1, 1, 0] {
        let r = call(&l, "block", &[("user_agent", "bad-scanner")], hits).await;
        assert_eq!(st(&r, 0), (OVER, 0, Some(60)));
        assert_eq!(
            r.statuses[0]
                .current_limit
                .as_ref()
                .map(|c| c.requests_per_unit),
            Some(0)
        );
    }
    let r = l
        .should_rate_limit(&req(
            "block",
            vec![desc_hits(&[("user_agent", "bad-scanner")], 0)],
            0,
        ))
        .await
        .expect("check");
    assert_eq!(st(&r, 0), (OVER, 0, Some(60)));
    assert!(keys(&server, &prefix).is_empty(), "no key for a block rule");
}

const MANY: &str = r"
domain: many
descriptors:
  - key: d
    rate_limit: {unit: minute, requests_per_unit: 100}
";

/// One `EVALSHA` per `ShouldRateLimit` on a single node, whatever the number
/// of descriptors, and no other command (BENCHMARKS.md, "Redis storage").
/// Inside it, one `MGET` reads every bucket; one `EXISTS` checks the
/// buckets `MGET` found missing (a key of another type reads as missing
/// too), and a `GET` per bucket follows only when some of them exist, so
/// buckets that exist cost nothing more and new ones one `EXISTS`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_script_call_per_request() {
    let server = RedisServer::start();
    let s = storage(&server);
    let l = limiter(MANY, s.clone(), &unique_prefix("cmds"));
    // Warm-up: connection, script load, startup checks.
    let _ = call(&l, "many", &[("d", "warm")], 1).await;
    server.wait_startup_checks();
    let mut report = Vec::new();
    for n in [1usize, 5, 20] {
        // First new buckets, then the same ones again.
        for (round, new_buckets) in [(1, true), (2, false)] {
            let _: () = server.query(redis::cmd("CONFIG").arg("RESETSTAT"));
            let descriptors = (0..n)
                .map(|i| desc(&[("d", &format!("{n}-{i}"))]))
                .collect();
            let r = l
                .should_rate_limit(&req("many", descriptors, 1))
                .await
                .expect("answer");
            assert_eq!(r.overall_code, OK);
            let all = server.all_command_calls();
            let count = |name: &str| all.iter().find(|(c, _)| c == name).map_or(0, |(_, n)| *n);
            // Sent by the client: everything but the background health
            // PING, the measuring commands and what the script itself calls
            // inside EVALSHA.
            let sent: Vec<&(String, u64)> = all
                .iter()
                .filter(|(c, _)| {
                    !matches!(
                        c.as_str(),
                        "ping"
                            | "info"
                            | "config|resetstat"
                            | "mget"
                            | "get"
                            | "exists"
                            | "set"
                            | "del"
                            | "time"
                    )
                })
                .collect();
            assert_eq!(
                sent,
                vec![&("fcall".to_owned(), 1)],
                "{n} descriptors: {all:?}"
            );
            assert_eq!(count("mget"), 1, "one MGET for every bucket: {all:?}");
            // New buckets: one EXISTS for all of them (none exists, so
            // none is of another type and no GET follows).
            let exists = u64::from(new_buckets);
            assert_eq!(count("exists"), exists, "EXISTS of round {round}: {all:?}");
            assert_eq!(count("get"), 0, "GETs of round {round}: {all:?}");
            assert_eq!(count("set"), n as u64, "one SET per bucket: {all:?}");
            report.push(format!("{n} descriptors, round {round}: {all:?}"));
        }
    }
    println!("{}", report.join("\n"));
}

/// The first request may reach Redis before the startup `FUNCTION LOAD`:
/// its `Function not found` is the first load, not a lost library, so the
/// request after it is one `FCALL` (no second clock check, no cache
/// clearing). A library lost once it has run (here `FUNCTION FLUSH`) is
/// lost state: the call after it checks the script's clock again (one
/// `EVAL`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_library_lost_after_it_ran_checks_the_clock_again() {
    let server = RedisServer::start();
    let s = storage(&server);
    // The startup load has run (it runs once), so it cannot follow the flush.
    common::eventually::eventually(Duration::from_secs(10), "the startup library load", || {
        let listed: redis::Value = server.query(&common::redis::list_the_library());
        let loaded = common::redis::lists_the_library(&listed);
        async move { loaded.then_some(()) }
    })
    .await;
    let l = limiter(MANY, s.clone(), &unique_prefix("first"));
    // As if the first request had beaten the startup load.
    let _: () = server.query(redis::cmd("FUNCTION").arg("FLUSH"));
    assert_eq!(call(&l, "many", &[("d", "a")], 1).await.overall_code, OK);
    let sent = |server: &RedisServer| {
        let all = server.all_command_calls();
        let n = |name: &str| all.iter().find(|(c, _)| c == name).map_or(0, |(_, n)| *n);
        (n("fcall"), n("eval"))
    };
    let _: () = server.query(redis::cmd("CONFIG").arg("RESETSTAT"));
    assert_eq!(call(&l, "many", &[("d", "a")], 1).await.overall_code, OK);
    assert_eq!(sent(&server), (1, 0), "after the first load: one FCALL");
    // Lost after it ran: Function not found, FUNCTION LOAD, FCALL again;
    // the next call checks the clock first.
    let _: () = server.query(redis::cmd("FUNCTION").arg("FLUSH"));
    assert_eq!(call(&l, "many", &[("d", "a")], 1).await.overall_code, OK);
    let _: () = server.query(redis::cmd("CONFIG").arg("RESETSTAT"));
    assert_eq!(call(&l, "many", &[("d", "a")], 1).await.overall_code, OK);
    assert_eq!(
        sent(&server),
        (1, 1),
        "after a lost library: the clock check, then FCALL"
    );
}

const COSTS: &str = r"
domain: cost
descriptors:
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 10}
";

/// docs/cases.md, "Costs above the remaining tokens" and "Zero hits", on the
/// stored bytes: a denied cost (even 10^6, above the capacity) and a check
/// (cost 0) leave the bucket's value byte-identical and its TTL not re-armed;
/// the TTL never exceeds the time to full (60 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denied_costs_and_checks_write_nothing() {
    let server = RedisServer::start();
    let prefix = unique_prefix("br13");
    let l = limiter(COSTS, storage(&server), &prefix);
    assert_eq!(
        st(&call(&l, "cost", &[("api_key", "k1")], 8).await, 0),
        (OK, 2, Some(48))
    );
    let key = keys(&server, &prefix).pop().expect("bucket");
    let before = (raw(&server, &key), pttl(&server, &key));
    assert!(before.1 > 47_000 && before.1 <= 48_000, "PTTL {}", before.1);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let denied = call(&l, "cost", &[("api_key", "k1")], 5).await;
    assert_eq!(st(&denied, 0), (OVER, 0, Some(18)));
    for hits in [0u64, 1_000_000] {
        let r = l
            .should_rate_limit(&req("cost", vec![desc_hits(&[("api_key", "k1")], hits)], 0))
            .await
            .expect("answer");
        assert_eq!(st(&r, 0).0, if hits == 0 { OK } else { OVER });
        if hits == 1_000_000 {
            assert_eq!(
                st(&r, 0),
                (OVER, 0, Some(48)),
                "cost above capacity: time to full"
            );
        }
    }
    let after = (raw(&server, &key), pttl(&server, &key));
    assert_eq!(after.0, before.0, "value unchanged");
    assert!(
        after.1 <= before.1 - 20,
        "TTL not re-armed: {before:?} -> {after:?}"
    );
    assert_eq!(st(&call(&l, "cost", &[("api_key", "k1")], 2).await, 0).1, 0);
}

const SHORT: &str = r"
domain: short
descriptors:
  - key: s
    rate_limit: {unit: second, requests_per_unit: 2}
";

/// docs/cases.md, "Every key has a long enough TTL", step 4, scaled to a 1 s
/// unit: once every bucket is full again, no key is left (unique values cannot
/// grow Redis without bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_gone_once_full_again() {
    let server = RedisServer::start();
    let prefix = unique_prefix("gone");
    let l = limiter(SHORT, storage(&server), &prefix);
    for i in 0..200 {
        let v = format!("v{i}");
        let hits = if i % 2 == 0 { 2 } else { 1 };
        assert_eq!(st(&call(&l, "short", &[("s", &v)], hits).await, 0).0, OK);
        if i % 2 == 0 {
            assert_eq!(st(&call(&l, "short", &[("s", &v)], 1).await, 0).0, OVER);
        }
    }
    // Buckets written last are still there (at most 1 s to full).
    assert!(!keys(&server, &prefix).is_empty());
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(
        keys(&server, &prefix),
        Vec::<String>::new(),
        "every key expired"
    );
}

/// Real time, real Redis expiry: a bucket drained at 10 per second (its key
/// expires when full again, 0.5 s later) and then slowed by a reload to 1
/// per minute is kept: the reload extends its key's TTL in the background,
/// so a second later the bucket still has no token instead of coming back
/// full (a reload never refills a bucket).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slowing_reload_keeps_drained_keys() {
    let server = RedisServer::start();
    let prefix = unique_prefix("hold");
    // An unchanged rule beside it (`other`, 5 a minute) keeps its own expiry.
    let other = "  - key: other\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";
    let l = limiter(
        &format!(
            "domain: hold\ndescriptors:\n  - key: k\n    rate_limit: {{unit: second, requests_per_unit: 10, burst: 5}}\n{other}"
        ),
        storage(&server),
        &prefix,
    );
    let drain = req("hold", vec![desc_hits(&[("k", "a")], 5)], 0);
    assert_eq!(st(&l.should_rate_limit(&drain).await.unwrap(), 0).1, 0);
    let key = keys(&server, &prefix).pop().expect("one key");
    assert!(pttl(&server, &key) <= 500, "expires when full: 0.5 s");
    let one = req("hold", vec![desc_hits(&[("other", "x")], 1)], 0);
    assert_eq!(st(&l.should_rate_limit(&one).await.unwrap(), 0).1, 4);
    let other_key = keys(&server, &prefix)
        .into_iter()
        .find(|k| k != &key)
        .expect("the other rule's key");
    // One token at 5 a minute: full again within 12 s.
    assert!(pttl(&server, &other_key) <= 12_000);
    l.swap_config(config(&[(
        "test.yaml",
        &format!("domain: hold\ndescriptors:\n  - key: k\n    rate_limit: {{unit: minute, requests_per_unit: 1, burst: 5}}\n{other}"),
    )]));
    // The new longest time to full: 5 tokens at 1 per minute = 300 s.
    let deadline = Instant::now() + Duration::from_secs(5);
    while pttl(&server, &key) < 250_000 {
        assert!(
            Instant::now() < deadline,
            "TTL not extended: {}",
            pttl(&server, &key)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let check = req("hold", vec![desc_hits(&[("k", "a")], 0)], 0);
    let r = l.should_rate_limit(&check).await.unwrap();
    assert_eq!((st(&r, 0).0, st(&r, 0).1), (OVER, 0), "{r:?}");
    // The hold was k's alone: the unchanged rule's key was not pinned for
    // k's 300 s (before, every key under the prefix was).
    assert!(
        pttl(&server, &other_key) <= 12_000,
        "{}",
        pttl(&server, &other_key)
    );
}

const BUDGET: &str = r"
domain: llm
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000, max_debt: 500}
";

/// 32 concurrent streams finishing at once on one token budget, through two
/// service instances on one Redis, charge exactly the sum of their costs
/// (down to `-max_debt`), and a key in debt expires when its bucket would
/// be full again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_stream_done_charges_add_up_exactly_down_to_the_floor() {
    let server = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let prefix = unique_prefix("debt");
    let replicas = [
        Arc::new(limiter(BUDGET, clocked(&server, &clock), &prefix)),
        Arc::new(limiter(BUDGET, clocked(&server, &clock), &prefix)),
    ];
    let charge_all = |costs: Vec<u64>| {
        let tasks: Vec<_> = costs
            .into_iter()
            .enumerate()
            .map(|(i, cost)| {
                let l = replicas[i % 2].clone();
                tokio::spawn(async move {
                    let r = req("llm", vec![desc_hits(&[("user", "alice")], cost)], 0);
                    l.should_rate_limit(&r).await.expect("answered")
                })
            })
            .collect();
        async move {
            for t in tasks {
                t.await.expect("task");
            }
        }
    };
    let check = || async {
        let r = req("llm", vec![desc_hits(&[("user", "alice")], 0)], 0);
        st(
            &replicas[0].should_rate_limit(&r).await.expect("answered"),
            0,
        )
    };
    // 10 + 11 + ... + 41 = 816 tokens.
    charge_all((10..42).collect()).await;
    assert_eq!(check().await, (OK, 184, Some(2938)));
    // 32 x 40 more: 1280 above a balance of 184, clamped at -500.
    charge_all(vec![40; 32]).await;
    assert_eq!(check().await, (OVER, 0, Some(1804)));
    let key = &keys(&server, &prefix)[0];
    assert_eq!(
        decode_bucket(&raw(&server, key).expect("bucket")).0,
        -500_000_000
    );
    // Production mode (Redis TIME) writes the exact time to full from -500:
    // 1500 tokens at 3.6 s each.
    let prod_prefix = unique_prefix("debtp");
    let prod = limiter(BUDGET, storage(&server), &prod_prefix);
    let r = req("llm", vec![desc_hits(&[("user", "bob")], 5000)], 0);
    assert_eq!(
        st(&prod.should_rate_limit(&r).await.expect("answered"), 0).0,
        OVER
    );
    let ttl = pttl(&server, &keys(&server, &prod_prefix)[0]);
    assert!((5_399_000..=5_400_000).contains(&ttl), "PTTL {ttl}");
}
