//! The Sentinel backend against a real setup (one master, one replica, three
//! Sentinels on 127.0.0.1): discovery, a failover during traffic that ends with
//! correct answers without restarting the storage, a killed master, and 50
//! concurrent requests after a failover to a node without the script are all OK
//! (docs/cases.md, "NOSCRIPT is handled"); a master with a password
//! (`--redis-master-password`).

mod common;

use bucket_rls::grpc::ShouldRateLimit as _;
use bucket_rls::limiter::Limiter;
use bucket_rls::storage::Storage;
use bucket_rls::storage::key::{KeyValue, encode};
use bucket_rls::storage::redis::sentinel::RedisSentinelStorage;
use common::eventually::eventually_blocking;
use common::sentinel::{MASTER_NAME, SentinelSetup};
use common::{desc, desc_hits, limiter, req, unique_prefix};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const OK: i32 = Code::Ok as i32;

/// 100 per hour: refill stays below one token during a test.
const YAML: &str = "
domain: d
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: probe
    rate_limit: {unit: hour, requests_per_unit: 1000000}
  - key: t
    rate_limit: {unit: day, requests_per_unit: 1, burst: 100000}
";

async fn setup() -> SentinelSetup {
    tokio::task::spawn_blocking(SentinelSetup::start)
        .await
        .expect("sentinel setup")
}

/// Waits up to `deadline` until the storage has discovered a master.
async fn discovered(st: &RedisSentinelStorage, deadline: Duration) {
    common::eventually::eventually(
        deadline,
        "a master discovered through the Sentinels",
        || {
            let done = st.master_addr().is_some();
            async move { done.then_some(()) }
        },
    )
    .await;
}

async fn storage(s: &SentinelSetup) -> Arc<RedisSentinelStorage> {
    let st = RedisSentinelStorage::builder(s.sentinel_addrs(), MASTER_NAME)
        .timeout(Duration::from_millis(500))
        .build()
        .expect("valid sentinels");
    discovered(&st, Duration::from_secs(10)).await;
    Arc::new(st)
}

/// `limit_remaining` of one `[[k=v]]` call, or `None` on UNAVAILABLE.
async fn one(l: &Limiter, v: &str) -> Option<u32> {
    match l
        .should_rate_limit(&req("d", vec![desc(&[("k", v)])], 0))
        .await
    {
        Ok(r) => {
            assert_eq!(r.overall_code, OK, "{r:?}");
            Some(r.statuses[0].limit_remaining)
        }
        Err(s) => {
            assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}");
            None
        }
    }
}

/// Tokens left in `[[k=v]]` by a cost-0 check.
async fn remaining(l: &Limiter, v: &str) -> u32 {
    let r = l
        .should_rate_limit(&req("d", vec![desc_hits(&[("k", v)], 0)], 0))
        .await
        .expect("check");
    r.statuses[0].limit_remaining
}

/// Waits until the master has shipped everything to the replica.
fn wait_replicated(s: &SentinelSetup, master: u16) {
    let replica = s.data.iter().find(|n| n.port != master).expect("replica");
    eventually_blocking(Duration::from_secs(30), "replica caught up", || {
        let m: String = s
            .data_node(master)
            .query(redis::cmd("INFO").arg("replication"));
        let r: String = replica.query(redis::cmd("INFO").arg("replication"));
        let off = |info: &str, field: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(field))
                .map(|v| v.trim().to_owned())
        };
        off(&m, "master_repl_offset:").is_some()
            && off(&m, "master_repl_offset:") == off(&r, "slave_repl_offset:")
    });
}

/// Waits (bounded) until the storage answers again after a failover, on a
/// bucket of its own.
async fn wait_answers(l: &Limiter) -> Duration {
    let t = Instant::now();
    loop {
        if l.should_rate_limit(&req("d", vec![desc(&[("probe", "p")])], 0))
            .await
            .is_ok()
        {
            return t.elapsed();
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "no answer after the failover"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A failover (`SENTINEL FAILOVER`) while requests run every 5 ms: the same
/// storage follows the new master, answers are UNAVAILABLE at most during
/// the switch, and from then on every call takes exactly one token.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failover_during_traffic() {
    let s = setup().await;
    let st = storage(&s).await;
    let first = s.master_port();
    assert_eq!(
        st.master_addr().as_deref(),
        Some(format!("127.0.0.1:{first}").as_str())
    );
    let l = limiter(YAML, st.clone(), &unique_prefix("failover"));
    let call = |l: Arc<Limiter>| async move {
        match l
            .should_rate_limit(&req("d", vec![desc(&[("t", "v")])], 0))
            .await
        {
            Ok(r) => {
                assert_eq!(r.overall_code, OK, "{r:?}");
                Some(r.statuses[0].limit_remaining)
            }
            Err(e) => {
                assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
                None
            }
        }
    };
    assert_eq!(call(l.clone()).await, Some(99_999));

    let stop = Arc::new(AtomicBool::new(false));
    let traffic = {
        let (l, stop) = (l.clone(), stop.clone());
        tokio::spawn(async move {
            let mut log = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let r = call(l.clone()).await;
                log.push((Instant::now(), r));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            log
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    tokio::task::block_in_place(|| wait_replicated(&s, first));
    let new = tokio::task::block_in_place(|| s.failover());
    assert_ne!(new, first);
    let switched = Instant::now();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    stop.store(true, Ordering::SeqCst);
    let log = traffic.await.expect("traffic");
    let unavailable = log.iter().filter(|(_, r)| r.is_none()).count();
    eprintln!("failover: {} calls, {unavailable} UNAVAILABLE", log.len());
    // 1.5 s after the Sentinels agreed (the storage re-asks them every
    // second), every call is OK and takes exactly one token. Writes the old
    // master accepted before it was demoted are lost with it: Redis
    // replication is asynchronous.
    let settled: Vec<u32> = log
        .iter()
        .filter(|(t, _)| *t > switched + Duration::from_millis(1500))
        .map(|(t, r)| {
            r.unwrap_or_else(|| panic!("UNAVAILABLE {:?} after the switch", *t - switched))
        })
        .collect();
    assert!(
        settled.len() > 20,
        "{} calls after the switch",
        settled.len()
    );
    for w in settled.windows(2) {
        assert_eq!(w[1] + 1, w[0], "one token per call: {settled:?}");
    }
    assert_eq!(
        st.master_addr().as_deref(),
        Some(format!("127.0.0.1:{new}").as_str()),
        "the same storage follows the new master"
    );
    assert!(st.discoveries() >= 2);
    assert!(st.ping().await.is_ok());
    // The new master's script clock was checked before it served (`EVAL`
    // of the check; the bucket calls are `FCALL`s).
    let stats: String = s
        .data_node(new)
        .query(redis::cmd("INFO").arg("commandstats"));
    assert!(
        stats.lines().any(|l| l.starts_with("cmdstat_eval:")),
        "the new master's script clock is checked: {stats}"
    );
}

/// The master is killed (no graceful failover): requests answer UNAVAILABLE
/// until the Sentinels promote the replica, then OK on the new master.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn master_killed() {
    let mut s = setup().await;
    let st = storage(&s).await;
    let l = limiter(YAML, st.clone(), &unique_prefix("killed"));
    assert_eq!(one(&l, "v").await, Some(99));
    let first = s.master_port();
    tokio::task::block_in_place(|| wait_replicated(&s, first));
    s.stop_data(first);
    assert_eq!(one(&l, "v").await, None, "the dead master cannot answer");
    let new = tokio::task::block_in_place(|| s.wait_master_change(first));
    let waited = wait_answers(&l).await;
    eprintln!("answers again {waited:?} after the Sentinels agreed");
    assert_eq!(
        st.master_addr().as_deref(),
        Some(format!("127.0.0.1:{new}").as_str())
    );
    assert_eq!(
        one(&l, "v").await,
        Some(98),
        "the replicated bucket carries on"
    );
}

/// docs/cases.md, "NOSCRIPT is handled": after a failover to a node whose
/// script cache is empty, 50 concurrent requests are all OK; no NOSCRIPT
/// reaches a caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn noscript_after_failover_to_a_fresh_replica() {
    let s = setup().await;
    let st = storage(&s).await;
    let l = limiter(YAML, st.clone(), &unique_prefix("br23c"));
    for want in [99, 98, 97] {
        assert_eq!(one(&l, "v").await, Some(want));
    }
    let first = s.master_port();
    tokio::task::block_in_place(|| wait_replicated(&s, first));
    let new = tokio::task::block_in_place(|| s.failover());
    wait_answers(&l).await;
    // The storage re-asks the Sentinels every second.
    let want = Some(format!("127.0.0.1:{new}"));
    common::eventually::eventually(
        Duration::from_secs(5),
        "the storage on the new master",
        || {
            let done = st.master_addr() == want;
            async move { done.then_some(()) }
        },
    )
    .await;
    // The storage loads the library when it finds a new master (and the
    // replica had it from the old one); remove it so these requests meet a
    // node that lacks it.
    let _: () = s.data_node(new).query(redis::cmd("FUNCTION").arg("FLUSH"));
    let _: () = s.data_node(new).query(redis::cmd("SCRIPT").arg("FLUSH"));
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let l = l.clone();
        tasks.push(tokio::spawn(async move { one(&l, "v").await }));
    }
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.expect("caller").expect("OK, not UNAVAILABLE"));
    }
    got.sort_unstable();
    assert_eq!(got, (47..=96).collect::<Vec<u32>>(), "one token each");
    let listed: redis::Value = s.data_node(new).query(&common::redis::list_the_library());
    assert!(
        common::redis::lists_the_library(&listed),
        "the requests loaded the library again: {listed:?}"
    );
    assert_eq!(remaining(&l, "v").await, 47);
}

/// A master (and replica) with `requirepass`: the Sentinels name it, but
/// calls only get through with the master's credentials
/// (`--redis-master-password`). Without them every call answers UNAVAILABLE
/// and no token is charged; with them the budget is exact, also on the node
/// promoted by a failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn master_with_password() {
    const PW: &str = "m4st3r-pw";
    let s = tokio::task::spawn_blocking(|| SentinelSetup::start_with_password(Some(PW)))
        .await
        .expect("sentinel setup");
    let prefix = unique_prefix("sentinel-auth");

    let without = RedisSentinelStorage::builder(s.sentinel_addrs(), MASTER_NAME)
        .timeout(Duration::from_millis(500))
        .build()
        .expect("valid sentinels");
    let l = limiter(YAML, Arc::new(without), &prefix);
    for _ in 0..3 {
        let e = l
            .should_rate_limit(&req("d", vec![desc(&[("k", "a")])], 0))
            .await
            .expect_err("no master credentials");
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        assert!(!e.message().contains(PW), "{e:?}");
    }

    let with = RedisSentinelStorage::builder(s.sentinel_addrs(), MASTER_NAME)
        .timeout(Duration::from_millis(500))
        .master_auth(None, Some(PW.into()))
        .build()
        .expect("valid sentinels");
    let l = limiter(YAML, Arc::new(with), &prefix);
    wait_answers(&l).await;
    // 100 per hour; the refused calls above charged nothing.
    assert_eq!(one(&l, "a").await, Some(99));
    assert_eq!(one(&l, "a").await, Some(98));

    let old = s.master_port();
    wait_replicated(&s, old);
    let new = tokio::task::block_in_place(|| s.failover());
    assert_ne!(new, old);
    wait_answers(&l).await;
    assert_eq!(remaining(&l, "a").await, 98);
    assert_eq!(one(&l, "a").await, Some(97));
}

/// Sentinels and master reached over TLS (`rediss://` Sentinel addresses
/// with `--redis-tls-ca-file`): the master the Sentinels name, by its TLS
/// port, is used over TLS and decides exactly. Without the CA nothing is
/// answered OK.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tls_sentinels_and_master() {
    let (s, ca) = tokio::task::spawn_blocking(SentinelSetup::start_tls)
        .await
        .expect("sentinel setup");
    let prefix = unique_prefix("sentinel-tls");
    let st = RedisSentinelStorage::builder(s.sentinel_tls_urls(), MASTER_NAME)
        .timeout(Duration::from_secs(1))
        .tls_root_ca_pem(ca)
        .build()
        .expect("valid sentinels");
    discovered(&st, Duration::from_secs(15)).await;
    let l = limiter(YAML, Arc::new(st), &prefix);
    wait_answers(&l).await;
    assert_eq!(one(&l, "a").await, Some(99));
    assert_eq!(one(&l, "a").await, Some(98));
    // On the master the Sentinels named: the bucket of [[k=a]], and the probe
    // bucket unless it is full again already (it refills in milliseconds).
    let bucket = |k: &str, v: &str| encode(&prefix, "d", &[(k, KeyValue::Value(v))]);
    let mut keys: Vec<String> = s.data[0].query(redis::cmd("KEYS").arg(format!("{prefix}*")));
    keys.retain(|k| *k != bucket("probe", "p"));
    assert_eq!(keys, vec![bucket("k", "a")]);

    let untrusted = RedisSentinelStorage::builder(s.sentinel_tls_urls(), MASTER_NAME)
        .timeout(Duration::from_millis(300))
        .build()
        .expect("valid sentinels");
    let l = limiter(YAML, Arc::new(untrusted), &prefix);
    for _ in 0..3 {
        let e = l
            .should_rate_limit(&req("d", vec![desc(&[("k", "a")])], 0))
            .await
            .expect_err("untrusted certificates");
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    }
}

/// While every Sentinel is unreachable the service keeps the master it knows
/// (requests keep working) and says once that a failover would go unseen;
/// before, nothing was logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_every_sentinel_is_logged_once_and_the_known_master_is_kept() {
    let mut s = setup().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("d.yaml");
    std::fs::write(
        &config,
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 100}\n",
    )
    .unwrap();
    let addrs = s.sentinel_addrs().join(",");
    let rls = common::procs::BucketRls::start(
        &config,
        &[
            "--redis-sentinel",
            &addrs,
            "--redis-master-name",
            MASTER_NAME,
        ],
    )
    .await;
    for n in &mut s.sentinels {
        n.stop();
    }
    let needle = "no Sentinel answers";
    common::eventually::eventually(Duration::from_secs(20), "the warning", || async {
        rls.proc.logs().contains(needle).then_some(())
    })
    .await;
    // Still served by the known master, and warned once only.
    let r = common::http::get(rls.http, "/healthcheck", &[])
        .await
        .expect("health");
    assert_eq!(r.status, 200, "{r:?}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        rls.proc.logs().matches(needle).count(),
        1,
        "{}",
        rls.proc.logs()
    );
}

/// Reservations through a master found by the Sentinels (docs/design.md,
/// "Reservations"): 16 concurrent reserve/settle pairs leave the exact
/// balance (1000 - the tokens used) and an empty book on the master; a
/// settlement sent twice is charged in full.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reserve_and_settle_through_the_discovered_master() {
    const BUDGET: &str = "
domain: llm
descriptors:
  - key: user
    descriptors:
      - key: request_id
        reservation: {ttl_seconds: 60}
        rate_limit: {unit: year, requests_per_unit: 1000, max_debt: 500}
";
    let s = setup().await;
    let prefix = unique_prefix("sentinel-reserve");
    let l = limiter(BUDGET, storage(&s).await, &prefix);
    let call = |l: Arc<Limiter>, id: String, settle: Option<u64>| async move {
        let mut entries = vec![("user", "ann"), ("request_id", id.as_str())];
        if settle.is_some() {
            entries.push(("phase", "settle"));
        }
        let d = desc_hits(&entries, settle.unwrap_or(50));
        let r = l
            .should_rate_limit(&req("llm", vec![d], 0))
            .await
            .expect("answer");
        (r.overall_code, r.statuses[0].limit_remaining)
    };
    let mut tasks = Vec::new();
    for i in 0..16u64 {
        let l = l.clone();
        tasks.push(tokio::spawn(async move {
            let id = format!("r{i}");
            assert_eq!(call(l.clone(), id.clone(), None).await.0, OK);
            assert_eq!(call(l, id, Some(20 + i)).await.0, OK);
            20 + i
        }));
    }
    let mut used = 0;
    for t in tasks {
        used += t.await.expect("pair");
    }
    // A settlement of 0 for an id never reserved reports the balance.
    let left = 1000 - u32::try_from(used).expect("small");
    assert_eq!(call(l.clone(), "probe".into(), Some(0)).await.1, left);
    let user = bucket_rls::storage::key::reservation_bucket(
        &prefix,
        "llm",
        &[("user", KeyValue::Value("ann"))],
        "request_id",
    );
    let book = bucket_rls::storage::key::book_key(&user);
    let open: u64 = s
        .data_node(s.master_port())
        .query(redis::cmd("HLEN").arg(&book));
    assert_eq!(open, 0);
    // r0 again: charged in full.
    call(l.clone(), "r0".into(), Some(20)).await;
    assert_eq!(call(l, "probe".into(), Some(0)).await.1, left - 20);
}
