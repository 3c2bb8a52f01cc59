//! The Redis Cluster backend against a real six-node cluster (three masters,
//! three replicas) on 127.0.0.1: no `CROSSSLOT`, keys on three masters, a
//! slot migrated while traffic runs, a lost slot range (docs/cases.md, "No
//! CROSSSLOT on a cluster"), all-or-nothing across slots under concurrency,
//! `NOSCRIPT` on cluster nodes, an ambiguous timeout never replayed. The
//! latency against slots touched is measured by `benches/cluster_latency.rs`.

mod common;

use bucket_rls::grpc::ShouldRateLimit as _;
use bucket_rls::limiter::Limiter;
use bucket_rls::storage::Storage;
use bucket_rls::storage::algorithm::{BucketLimit, ChargeKind, ChargeSpec, Limit};
use bucket_rls::storage::key::{KeyValue, encode};
use bucket_rls::storage::redis::cluster::{RedisClusterStorage, key_slot};
use bucket_rls::storage::{Charge, StorageError};
use common::cluster::{RedisCluster, bucket, connected, delay_proxy, storage, value_in};
use common::{desc, desc_hits, limiter, req, unique_prefix};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

#[path = "redis_cluster/lost_slots.rs"]
mod lost_slots;

/// How long cluster or replication setup may take to settle.
const SETUP_DEADLINE: Duration = Duration::from_secs(30);

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;

/// The cluster shared by the tests that do not break it.
fn shared() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    CLUSTER.get_or_init(RedisCluster::start)
}

async fn shared_async() -> &'static RedisCluster {
    tokio::task::spawn_blocking(shared).await.expect("cluster")
}

async fn own_cluster() -> RedisCluster {
    tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .expect("cluster")
}

fn st(r: &RateLimitResponse, i: usize) -> (i32, u32) {
    (r.statuses[i].code, r.statuses[i].limit_remaining)
}

fn dur(r: &RateLimitResponse, i: usize) -> i64 {
    r.statuses[i]
        .duration_until_reset
        .as_ref()
        .map_or(-1, |d| d.seconds)
}

async fn call(l: &Limiter, domain: &str, descs: &[(&str, &str)]) -> RateLimitResponse {
    let r = req(
        domain,
        descs.iter().map(|(k, v)| desc(&[(k, v)])).collect(),
        0,
    );
    l.should_rate_limit(&r)
        .await
        .unwrap_or_else(|s| panic!("unexpected gRPC error {s:?}"))
}

/// Sum of `errorstat_CROSSSLOT` over every running node.
fn crossslot_errors(c: &RedisCluster) -> u64 {
    c.nodes
        .iter()
        .filter(|n| n.running())
        .map(|n| {
            let info: String = n.query(redis::cmd("INFO").arg("errorstats"));
            info.lines()
                .find_map(|l| l.strip_prefix("errorstat_CROSSSLOT:count="))
                .map_or(0, |v| v.trim().parse().expect("count"))
        })
        .sum()
}

const USER_AND_ROUTE: &str = "
domain: c
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: route
    rate_limit: {unit: minute, requests_per_unit: 100}
";

/// docs/cases.md, "No CROSSSLOT on a cluster", step 1: the three buckets of one
/// request live on three different masters; calls 1-2 OK, call 3 OVER_LIMIT on
/// both users and OK on the route (not charged); no CROSSSLOT anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keys_of_one_request_on_three_masters() {
    let c = shared_async().await;
    let prefix = unique_prefix("br28");
    let shards = c.shards();
    assert_eq!(shards.len(), 3, "three masters");
    let a = value_in(&shards[0], &prefix, "c", "user", "a", &[]);
    let b = value_in(&shards[1], &prefix, "c", "user", "b", &[]);
    let r = value_in(&shards[2], &prefix, "c", "route", "r", &[]);
    let evalsha_before: Vec<u64> = shards.iter().map(|s| c.script_calls(s.master)).collect();
    let s = storage(c, Duration::from_secs(1)).await;
    let l = limiter(USER_AND_ROUTE, Arc::new(s), &prefix);
    let d = [
        ("user", a.as_str()),
        ("user", b.as_str()),
        ("route", r.as_str()),
    ];
    let r1 = call(&l, "c", &d).await;
    assert_eq!(r1.overall_code, OK);
    assert_eq!(
        (st(&r1, 0), st(&r1, 1), st(&r1, 2)),
        ((OK, 1), (OK, 1), (OK, 99))
    );
    let r2 = call(&l, "c", &d).await;
    assert_eq!(r2.overall_code, OK);
    assert_eq!(
        (st(&r2, 0), st(&r2, 1), st(&r2, 2)),
        ((OK, 0), (OK, 0), (OK, 98))
    );
    let r3 = call(&l, "c", &d).await;
    assert_eq!(r3.overall_code, OVER);
    assert_eq!(st(&r3, 0), (OVER, 0));
    assert_eq!(st(&r3, 1), (OVER, 0));
    assert_eq!(st(&r3, 2), (OK, 98), "route not charged by the denied call");
    assert_eq!(dur(&r3, 0), 30, "one token of 2/min is 30 s away");
    // The route bucket was charged exactly twice (the denied call's
    // reservation, if any, was given back).
    let raw = c
        .get(&bucket(&prefix, "c", "route", &r))
        .expect("route bucket stored");
    let (tokens, _) = common::redis::decode_bucket(&raw);
    assert!(
        (98_000_000..98_500_000).contains(&tokens),
        "route tokens {tokens}"
    );
    // Every master ran scripts; no node ever answered CROSSSLOT.
    for (s, before) in shards.iter().zip(evalsha_before) {
        assert!(
            c.script_calls(s.master) > before,
            "master {} got no script call",
            s.master
        );
    }
    assert_eq!(crossslot_errors(c), 0);
}

const GROUP_AND_EXPORT: &str = "
domain: api
descriptors:
  - key: group
    value: reports
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: special
    value: export
    rate_limit: {unit: minute, requests_per_unit: 3}
";

/// A prefix under which `group=reports` and `special=export` live on
/// different masters.
fn split_prefix(c: &RedisCluster, name: &str) -> String {
    loop {
        let p = unique_prefix(name);
        let g = c.shard_of(key_slot(&bucket(&p, "api", "group", "reports")));
        let s = c.shard_of(key_slot(&bucket(&p, "api", "special", "export")));
        if g.master != s.master {
            return p;
        }
    }
}

/// docs/cases.md, "A denied request charges nothing", with the two buckets on
/// different masters: exact sequential values.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn denied_request_charges_nothing_across_masters() {
    let c = shared_async().await;
    let prefix = split_prefix(c, "br16s");
    let l = limiter(
        GROUP_AND_EXPORT,
        Arc::new(storage(c, Duration::from_secs(1)).await),
        &prefix,
    );
    let both = [("group", "reports"), ("special", "export")];
    for (i, (g, s)) in [(9, 2), (8, 1), (7, 0)].into_iter().enumerate() {
        let r = call(&l, "api", &both).await;
        assert_eq!(r.overall_code, OK, "call {}", i + 1);
        assert_eq!((st(&r, 0), st(&r, 1)), ((OK, g), (OK, s)));
    }
    for _ in 0..2 {
        let r = call(&l, "api", &both).await;
        assert_eq!(r.overall_code, OVER);
        assert_eq!(st(&r, 0), (OK, 7), "group not consumed");
        assert_eq!(st(&r, 1), (OVER, 0));
        assert_eq!(dur(&r, 1), 20);
    }
    for rem in (0..7).rev() {
        let r = call(&l, "api", &[("group", "reports")]).await;
        assert_eq!(st(&r, 0), (OK, rem));
    }
    let r = call(&l, "api", &[("group", "reports")]).await;
    assert_eq!(r.overall_code, OVER);
}

/// docs/cases.md, "A denied request charges nothing", under concurrency
/// across masters: 50 concurrent callers; at most 3
/// admitted on `special`, and once the refunds have landed `group` has been
/// charged exactly once per admitted request.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_callers_never_over_admit_across_masters() {
    let c = shared_async().await;
    let prefix = split_prefix(c, "br16c");
    let l = limiter(
        GROUP_AND_EXPORT,
        Arc::new(storage(c, Duration::from_secs(2)).await),
        &prefix,
    );
    let admitted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let l = l.clone();
        let admitted = admitted.clone();
        tasks.push(tokio::spawn(async move {
            let r = call(&l, "api", &[("group", "reports"), ("special", "export")]).await;
            if r.overall_code == OK {
                admitted.fetch_add(1, Ordering::SeqCst);
            }
        }));
    }
    for t in tasks {
        t.await.expect("caller");
    }
    let n = u32::try_from(admitted.load(Ordering::SeqCst)).expect("small");
    assert!((1..=3).contains(&n), "admitted {n}, must be 1..=3");
    // A cost-0 check reports the group's tokens: 10 minus one per admitted
    // request (refill is 1 token per 6 s, far longer than this test).
    let check = req(
        "api",
        vec![common::desc_hits(&[("group", "reports")], 0)],
        0,
    );
    let r = l.should_rate_limit(&check).await.expect("check");
    assert_eq!(
        st(&r, 0),
        (OK, 10 - n),
        "group charged only for admitted requests"
    );
    let r = call(&l, "api", &[("special", "export")]).await;
    if n == 3 {
        assert_eq!(st(&r, 0), (OVER, 0));
    }
}

/// docs/cases.md, "NOSCRIPT is handled", on a cluster: after `FUNCTION
/// FLUSH` and `SCRIPT FLUSH` on every master, requests spanning all masters
/// still succeed (each node's `Function not found` answered with one
/// `FUNCTION LOAD` on that node), and exactly one token is consumed per
/// bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lost_scripts_on_cluster_nodes_are_transparent() {
    let c = shared_async().await;
    let prefix = unique_prefix("noscript");
    let shards = c.shards();
    let a = value_in(&shards[0], &prefix, "c", "route", "a", &[]);
    let b = value_in(&shards[1], &prefix, "c", "route", "b", &[]);
    let d = value_in(&shards[2], &prefix, "c", "route", "d", &[]);
    let l = limiter(
        USER_AND_ROUTE,
        Arc::new(storage(c, Duration::from_secs(1)).await),
        &prefix,
    );
    let descs = [
        ("route", a.as_str()),
        ("route", b.as_str()),
        ("route", d.as_str()),
    ];
    let r = call(&l, "c", &descs).await;
    assert_eq!(
        (st(&r, 0), st(&r, 1), st(&r, 2)),
        ((OK, 99), (OK, 99), (OK, 99))
    );
    for s in &shards {
        let _: () = c.node(s.master).query(redis::cmd("FUNCTION").arg("FLUSH"));
        let _: () = c.node(s.master).query(redis::cmd("SCRIPT").arg("FLUSH"));
    }
    let r = call(&l, "c", &descs).await;
    assert_eq!(r.overall_code, OK);
    assert_eq!(
        (st(&r, 0), st(&r, 1), st(&r, 2)),
        ((OK, 98), (OK, 98), (OK, 98))
    );
    for s in &shards {
        let listed: redis::Value = c.node(s.master).query(&common::redis::list_the_library());
        assert!(
            common::redis::lists_the_library(&listed),
            "master {} has the library again: {listed:?}",
            s.master
        );
    }
}

/// docs/cases.md, "No CROSSSLOT on a cluster", step 2: the slot holding
/// `user=a` is migrated to another master (`CLUSTER SETSLOT ...
/// IMPORTING/MIGRATING`, `MIGRATE`, `SETSLOT NODE`) while requests run at about
/// 200/s. ASK and MOVED are followed; every answer is correct, at most a few
/// transient UNAVAILABLE, and the bucket moves with its tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slot_migration_under_traffic() {
    let c = Arc::new(own_cluster().await);
    let prefix = unique_prefix("reshard");
    let shards = c.shards();
    let (src, dst) = (shards[0].clone(), shards[1].clone());
    let user = value_in(&src, &prefix, "c", "user", "a", &[]);
    let route = value_in(&shards[2], &prefix, "c", "route", "r", &[]);
    let key = bucket(&prefix, "c", "user", &user);
    let slot = key_slot(&key);
    // 1000 per hour: no refill worth a token during the test.
    let yaml = "
domain: c
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000}
  - key: route
    rate_limit: {unit: hour, requests_per_unit: 100000}
";
    let l = limiter(
        yaml,
        Arc::new(storage(&c, Duration::from_millis(500)).await),
        &prefix,
    );
    let r = call(&l, "c", &[("user", &user), ("route", &route)]).await;
    assert_eq!(st(&r, 0), (OK, 999));

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = {
        let (l, stop, user, route) = (l.clone(), stop.clone(), user.clone(), route.clone());
        tokio::spawn(async move {
            let (mut ok, mut unavailable, mut last_remaining) = (0u32, 0u32, 999u32);
            while !stop.load(Ordering::SeqCst) {
                let r = req(
                    "c",
                    vec![desc(&[("user", &user)]), desc(&[("route", &route)])],
                    0,
                );
                match l.should_rate_limit(&r).await {
                    Ok(r) => {
                        assert_eq!(r.overall_code, OK, "{r:?}");
                        let rem = r.statuses[0].limit_remaining;
                        // Exactly one token per admitted call; an
                        // UNAVAILABLE call may or may not have taken one.
                        assert!(
                            rem < last_remaining && last_remaining - rem <= 1 + unavailable,
                            "remaining went from {last_remaining} to {rem}"
                        );
                        last_remaining = rem;
                        ok += 1;
                    }
                    Err(s) => {
                        assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}");
                        unavailable += 1;
                    }
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (ok, unavailable, last_remaining)
        })
    };
    let migrate = {
        let c = c.clone();
        let key = key.clone();
        tokio::task::spawn_blocking(move || {
            let id = |p: u16| -> String { c.node(p).query(redis::cmd("CLUSTER").arg("MYID")) };
            let (src_id, dst_id) = (id(src.master), id(dst.master));
            let setslot = |p: u16, state: &str, node: &str| {
                let _: () = c.node(p).query(
                    redis::cmd("CLUSTER")
                        .arg("SETSLOT")
                        .arg(slot)
                        .arg(state)
                        .arg(node),
                );
            };
            std::thread::sleep(Duration::from_millis(200));
            setslot(dst.master, "IMPORTING", &src_id);
            setslot(src.master, "MIGRATING", &dst_id);
            std::thread::sleep(Duration::from_millis(300));
            let keys: Vec<String> = c.node(src.master).query(
                redis::cmd("CLUSTER")
                    .arg("GETKEYSINSLOT")
                    .arg(slot)
                    .arg(100),
            );
            assert!(keys.contains(&key), "{keys:?}");
            let _: redis::Value = c.node(src.master).query(
                redis::cmd("MIGRATE")
                    .arg("127.0.0.1")
                    .arg(dst.master)
                    .arg("")
                    .arg(0)
                    .arg(5000)
                    .arg("KEYS")
                    .arg(&keys),
            );
            // Requests now get ASK from the source.
            std::thread::sleep(Duration::from_millis(300));
            for m in [dst.master, src.master, shards[2].master] {
                setslot(m, "NODE", &dst_id);
            }
            // Requests now get MOVED until the client's slot map is refreshed.
            std::thread::sleep(Duration::from_millis(500));
        })
    };
    migrate.await.expect("migration");
    stop.store(true, Ordering::SeqCst);
    let (ok, unavailable, last) = traffic.await.expect("traffic");
    assert!(ok > 100, "{ok} calls answered");
    assert!(unavailable <= 5, "{unavailable} UNAVAILABLE");
    common::eventually::eventually_blocking(
        SETUP_DEADLINE,
        "every node sees the slot moved",
        || {
            c.nodes.iter().all(|n| {
                n.try_query::<String>(redis::cmd("CLUSTER").arg("NODES"))
                    .is_ok_and(|_| c.shard_of(slot).master == dst.master)
            })
        },
    );
    assert!(
        c.command_calls(dst.master, "asking") > 0,
        "ASK was followed (ASKING sent to the target)"
    );
    // The bucket lives on the target with every token it lost.
    let raw: Option<Vec<u8>> = c.node(dst.master).query(redis::cmd("GET").arg(&key));
    let (tokens, _) = common::redis::decode_bucket(&raw.expect("bucket migrated"));
    assert_eq!(u32::try_from(tokens / 1_000_000).expect("small"), last);
    let r = call(&l, "c", &[("user", &user), ("route", &route)]).await;
    assert_eq!(st(&r, 0), (OK, last - 1));
    assert_eq!(crossslot_errors(&c), 0);
}

/// A master dies and the cluster promotes its replica (node timeout 1 s):
/// requests on its slots answer UNAVAILABLE meanwhile, then OK on the
/// promoted replica (which never saw `SCRIPT LOAD`: NOSCRIPT is answered
/// with EVAL), carrying on from the replicated bucket; other slots never
/// fail. The storage is not rebuilt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_failover_of_one_master() {
    let mut c = own_cluster().await;
    let prefix = unique_prefix("cfail");
    let shards = c.shards();
    let victim = shards[0].clone();
    let moved = value_in(&victim, &prefix, "c", "route", "m", &[]);
    let other = value_in(&shards[1], &prefix, "c", "route", "o", &[]);
    let yaml = "
domain: c
descriptors:
  - key: route
    rate_limit: {unit: day, requests_per_unit: 1, burst: 1000}
";
    let s = RedisClusterStorage::builder(c.seeds())
        .timeout(Duration::from_millis(200))
        .breaker(1_000_000, Duration::from_millis(100))
        .build()
        .expect("seeds");
    while !s.connected() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let l = limiter(yaml, Arc::new(s), &prefix);
    for want in [999, 998, 997] {
        assert_eq!(
            st(&call(&l, "c", &[("route", &moved)]).await, 0),
            (OK, want)
        );
    }
    // Let the replica catch up, then kill the master.
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.node_mut(victim.master).stop();
    let killed = Instant::now();
    let (mut unavailable, mut other_ok) = (0, 0);
    let rem = loop {
        let r = req("c", vec![desc(&[("route", &moved)])], 0);
        match l.should_rate_limit(&r).await {
            Ok(r) => break r.statuses[0].limit_remaining,
            Err(e) => {
                assert_eq!(e.code(), tonic::Code::Unavailable);
                unavailable += 1;
            }
        }
        assert!(
            killed.elapsed() < Duration::from_secs(20),
            "slots of the dead master never came back"
        );
        let r = call(&l, "c", &[("route", &other)]).await;
        assert_eq!(r.overall_code, OK, "other slots keep working");
        other_ok += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!(
        "cluster failover: slots back after {:?} ({unavailable} UNAVAILABLE, {other_ok} OK elsewhere meanwhile)",
        killed.elapsed()
    );
    assert_eq!(rem, 996, "the promoted replica had the bucket");
    let slot = key_slot(&bucket(&prefix, "c", "route", &moved));
    tokio::task::block_in_place(|| {
        common::eventually::eventually_blocking(SETUP_DEADLINE, "the replica is master", || {
            victim.replicas.contains(&c.shard_of(slot).master)
        });
    });
    assert_eq!(st(&call(&l, "c", &[("route", &moved)]).await, 0), (OK, 995));
}

/// docs/cases.md, "Ambiguous calls are never replayed", on a cluster: a slot
/// call whose reply arrives after the timeout answers UNAVAILABLE in about the
/// timeout and is never replayed (the client is built without automatic
/// retries): the master ran the script exactly once and exactly one token is
/// gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ambiguous_timeout_is_not_replayed() {
    let c = own_cluster().await;
    let prefix = unique_prefix("br24");
    let shards = c.shards();
    let slow = shards[0].clone();
    let v = value_in(&slow, &prefix, "c", "route", "s", &[]);
    let key = bucket(&prefix, "c", "route", &v);
    // Replies of this master go through a proxy; made 1 s late below, so an
    // answer well before that came from the 50 ms timeout, not the reply.
    let delay_ms = Arc::new(AtomicU64::new(0));
    let p = delay_proxy(slow.master, delay_ms.clone()).await;
    let _: () = c.node(slow.master).query(
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("cluster-announce-port")
            .arg(p),
    );
    tokio::task::block_in_place(|| {
        common::eventually::eventually_blocking(
            SETUP_DEADLINE,
            "every node announces the proxy",
            || {
                c.nodes
                    .iter()
                    .all(|n| c.shards_from(n.port).iter().any(|s| s.master == p))
            },
        );
    });
    let s = RedisClusterStorage::builder([format!("127.0.0.1:{}", shards[1].master)])
        .timeout(Duration::from_millis(50))
        .local_cache_size(0)
        .build()
        .expect("seeds");
    connected(&s).await;
    let limit = Limit::TokenBucket(BucketLimit {
        requests_per_unit: 10,
        unit_secs: std::num::NonZeroU64::new(3600).expect("an hour"),
        burst: 10,
        max_debt: 0,
    });
    let charge = Charge {
        key: key.clone(),
        spec: ChargeSpec {
            limit,
            cost: 1,
            kind: ChargeKind::Consume,
            shadow: false,
        },
    };
    // Warm up: open the connection to that master while it is fast.
    let warm = Charge {
        key: bucket(
            &prefix,
            "c",
            "route",
            &value_in(&slow, &prefix, "c", "route", "w", &[]),
        ),
        spec: charge.spec,
    };
    assert!(s.apply(std::slice::from_ref(&warm)).await.is_ok());
    delay_ms.store(1000, Ordering::SeqCst);
    let before = c.script_calls(slow.master) + c.command_calls(slow.master, "eval");
    let t = Instant::now();
    let e = s
        .apply(std::slice::from_ref(&charge))
        .await
        .expect_err("late reply");
    let took = t.elapsed();
    assert!(matches!(e, StorageError::Timeout(_)), "{e:?}");
    assert!(
        took < Duration::from_millis(500),
        "answered after {took:?}, not before the late reply"
    );
    // Let the late reply arrive and anything that would replay run.
    tokio::time::sleep(Duration::from_millis(1400)).await;
    let after = c.script_calls(slow.master) + c.command_calls(slow.master, "eval");
    assert_eq!(after - before, 1, "the script ran exactly once");
    let raw: Option<Vec<u8>> = c.node(slow.master).query(redis::cmd("GET").arg(&key));
    let (tokens, _) = common::redis::decode_bucket(&raw.expect("charged once"));
    assert_eq!(tokens / 1_000_000, 9, "exactly one token consumed");
}

/// Real time on a Redis Cluster: buckets drained at 10 per second on all
/// three masters, then slowed by a reload to 1 per minute, keep their keys
/// (the reload scans every master and extends the TTLs), so a second later
/// they still have no token instead of coming back full.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slowing_reload_keeps_drained_keys_on_every_master() {
    let c = tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .expect("cluster");
    let s = Arc::new(storage(&c, Duration::from_secs(1)).await);
    let prefix = unique_prefix("hold");
    let l = limiter(
        "domain: hold\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 10, burst: 5}\n",
        s,
        &prefix,
    );
    let values = ["a", "b", "c", "d", "e", "f", "g", "h"];
    for v in values {
        let r = l
            .should_rate_limit(&req("hold", vec![desc_hits(&[("k", v)], 5)], 0))
            .await
            .expect("drain");
        assert_eq!(r.statuses[0].limit_remaining, 0);
    }
    let keys: Vec<String> = values
        .iter()
        .map(|v| encode(&prefix, "hold", &[("k", KeyValue::Value(v))]))
        .collect();
    let masters: std::collections::HashSet<u16> = keys
        .iter()
        .map(|k| c.shard_of(c.keyslot(k)).master)
        .collect();
    assert_eq!(masters.len(), 3, "keys on every master");
    l.swap_config(common::config(&[(
        "test.yaml",
        "domain: hold\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1, burst: 5}\n",
    )]));
    let pttl = |k: &str| -> i64 {
        c.node(c.shard_of(c.keyslot(k)).master)
            .query(redis::cmd("PTTL").arg(k))
    };
    common::eventually::eventually(
        Duration::from_secs(5),
        "TTLs extended on every master",
        || {
            let done = keys.iter().all(|k| pttl(k) >= 250_000);
            async move { done.then_some(()) }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    for v in values {
        let r = l
            .should_rate_limit(&req("hold", vec![desc_hits(&[("k", v)], 0)], 0))
            .await
            .expect("check");
        assert_eq!(r.statuses[0].limit_remaining, 0, "{v}: {r:?}");
    }
}

const BUDGETS: &str = "domain: llm
descriptors:
  - key: route
    rate_limit: {unit: minute, requests_per_unit: 1000}
  - key: tight
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: user
    descriptors:
      - key: request_id
        reservation: {ttl_seconds: 60}
        rate_limit: {unit: year, requests_per_unit: 1000, max_debt: 500}
";

/// Reservations on a real cluster (docs/design.md, "Reservations"): the
/// book is in its bucket's slot (as the server computes it); 40 concurrent
/// reserves of 100 on a budget of 1000, each beside a descriptor on
/// another master, admit exactly 10; a reserve beside a denying descriptor
/// on another master is undone (estimate back, reservation forgotten);
/// settlements on a second service instance leave the exact balance and
/// an empty book.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reserves_and_settlements_stay_atomic_across_masters() {
    let c = shared_async().await;
    let prefix = loop {
        let p = unique_prefix("reserve");
        let user = bucket_rls::storage::key::reservation_bucket(
            &p,
            "llm",
            &[("user", KeyValue::Value("ann"))],
            "request_id",
        );
        let route = bucket(&p, "llm", "route", "r");
        let tight = bucket(&p, "llm", "tight", "t");
        let m = |k: &str| c.shard_of(key_slot(k)).master;
        if m(&user) != m(&route) && m(&user) != m(&tight) {
            break p;
        }
    };
    let user = bucket_rls::storage::key::reservation_bucket(
        &prefix,
        "llm",
        &[("user", KeyValue::Value("ann"))],
        "request_id",
    );
    let book = bucket_rls::storage::key::book_key(&user);
    assert_eq!(c.keyslot(&book), c.keyslot(&user), "{book}");
    let a = limiter(
        BUDGETS,
        Arc::new(storage(c, Duration::from_secs(2)).await),
        &prefix,
    );
    let b = limiter(
        BUDGETS,
        Arc::new(storage(c, Duration::from_secs(2)).await),
        &prefix,
    );
    let reserve = |l: Arc<Limiter>, id: String, beside: (&'static str, &'static str)| async move {
        let r = req(
            "llm",
            vec![
                desc_hits(&[("user", "ann"), ("request_id", &id)], 100),
                desc_hits(&[beside], 1),
            ],
            0,
        );
        l.should_rate_limit(&r).await.expect("answer").overall_code
    };
    // Denied on another master: nothing charged, nothing kept.
    assert_eq!(
        reserve(a.clone(), "undone".into(), ("tight", "t")).await,
        OK
    );
    assert_eq!(
        reserve(a.clone(), "undone".into(), ("tight", "t")).await,
        OVER
    );
    let mut tasks = Vec::new();
    for i in 0..40 {
        let l = if i % 2 == 0 { a.clone() } else { b.clone() };
        tasks.push(tokio::spawn(reserve(l, format!("id-{i}"), ("route", "r"))));
    }
    let mut admitted = Vec::new();
    for (i, t) in tasks.into_iter().enumerate() {
        if t.await.expect("caller") == OK {
            admitted.push(i);
        }
    }
    // 1000 - 100 ("undone" the first time, admitted) leaves room for 9.
    assert_eq!(admitted.len(), 9, "{admitted:?}");
    let master = c.shard_of(key_slot(&book)).master;
    let node = redis::Client::open(format!("redis://127.0.0.1:{master}")).expect("url");
    let mut node = node.get_connection().expect("node");
    let open: u64 = redis::cmd("HLEN")
        .arg(&book)
        .query(&mut node)
        .expect("HLEN");
    // Ten reservations, and the field "m" (the latest expiry written).
    assert_eq!(open, 10 + 1);
    // Settled on the other instance: actual 60 + i % 7 each, "undone" at 0.
    let mut used = 0;
    for &i in &admitted {
        let actual = 60 + (i as u64 % 7);
        used += actual;
        let l = if i % 2 == 0 { &b } else { &a };
        let d = desc_hits(
            &[
                ("user", "ann"),
                ("request_id", &format!("id-{i}")),
                ("phase", "settle"),
            ],
            actual,
        );
        let r = l
            .should_rate_limit(&req("llm", vec![d], 0))
            .await
            .expect("answer");
        assert_eq!(r.overall_code, OK);
    }
    let d = desc_hits(
        &[
            ("user", "ann"),
            ("request_id", "undone"),
            ("phase", "settle"),
        ],
        0,
    );
    a.should_rate_limit(&req("llm", vec![d], 0))
        .await
        .expect("answer");
    let open: u64 = redis::cmd("HLEN")
        .arg(&book)
        .query(&mut node)
        .expect("HLEN");
    assert_eq!(open, 0);
    // The balance: a reserve of the whole rest is admitted, one more token
    // is not (the year-long unit refills nothing meanwhile).
    let left = 1000 - used;
    let probe = |id: &'static str, cost: u64| {
        let a = a.clone();
        async move {
            let r = req(
                "llm",
                vec![desc_hits(&[("user", "ann"), ("request_id", id)], cost)],
                0,
            );
            a.should_rate_limit(&r).await.expect("answer").overall_code
        }
    };
    assert_eq!(probe("rest+1", left + 1).await, OVER);
    assert_eq!(probe("rest", left).await, OK);
}
