//! The request library (Redis Functions, `FCALL`) against real
//! `redis-server` processes, where it behaves unlike the script
//! (`EVALSHA`): a `NOPERM` that refuses a key, not Functions; memory full
//! (`OOM` under `noeviction`), which refuses a function that may write
//! before it runs; the library flushed while many requests are in flight.
//! docs/redis.md, "Redis Functions"; docs/design.md, "NOSCRIPT".

mod common;

use bucket_rls::storage::redis::RedisStorage;
use bucket_rls::storage::{Charge, Storage, StorageError};
use common::redis::{RedisServer, wait_ready};
use std::sync::Arc;
use std::time::Duration;

fn storage(url: &str) -> Arc<RedisStorage> {
    Arc::new(
        RedisStorage::builder(url)
            .timeout(Duration::from_secs(2))
            // Every answer below comes from Redis, never from memory.
            .local_cache_size(0)
            .build()
            .expect("valid URL"),
    )
}

/// A charge of `cost` on a token bucket of `per_day` tokens a day (no
/// refill worth a token while a test runs).
fn charge(key: &str, cost: u64, per_day: u32) -> Charge {
    Charge {
        key: key.into(),
        spec: bucket_rls::storage::ChargeSpec {
            limit: bucket_rls::storage::Limit::TokenBucket(bucket_rls::storage::BucketLimit {
                requests_per_unit: per_day,
                unit_secs: std::num::NonZeroU64::new(86_400).expect("a day"),
                burst: per_day,
                max_debt: 0,
            }),
            cost,
            kind: bucket_rls::storage::ChargeKind::Consume,
            shadow: false,
        },
    }
}

fn kind(r: Result<bucket_rls::storage::RequestResult, StorageError>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.kind().to_owned(),
    }
}

/// Whole tokens left after an answered request of one charge.
fn left(r: &bucket_rls::storage::RequestResult) -> i64 {
    r.charges[0].remaining_micro / 1_000_000
}

/// An ACL user that may call the library but not run scripts, and may
/// touch only the keys `ok*`: a request on another key is refused
/// (`NOPERM`, about the key), and that refusal is no refusal of Functions,
/// so the requests after it still go as `FCALL` and are answered. On Redis
/// and on Valkey (whose `NOPERM` texts differ).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_the_acl_refuses_fails_only_its_own_request() {
    for server in [RedisServer::start(), RedisServer::start_valkey()] {
        for rules in [
            &["on", ">pw"][..],
            &["~ok*", "+@all", "-evalsha", "-script"][..],
        ] {
            let _: () = server.query(redis::cmd("ACL").arg("SETUSER").arg("fn").arg(rules));
        }
        let s = storage(&format!("redis://fn:pw@127.0.0.1:{}", server.port()));
        wait_ready(&s).await;
        let r = s.apply(&[charge("ok1", 1, 10)]).await.expect("answered");
        assert_eq!(left(&r), 9);
        assert_eq!(kind(s.apply(&[charge("no1", 1, 10)]).await), "NOPERM");
        let r = s
            .apply(&[charge("ok1", 1, 10)])
            .await
            .expect("a permitted key is still answered");
        assert_eq!(left(&r), 8);
        assert!(s.apply(&[charge("ok1", 1, 10)]).await.is_ok());
        assert_eq!(server.command_executions("fcall"), 3);
    }
}

/// Memory full under `noeviction`: a charge that would write fails with
/// `OOM` (and `/healthcheck`'s probe charge with it), but a request that
/// writes nothing, a denial or a check, is answered as it was with the
/// script (docs/design.md, "Batched script calls": only a batch fails
/// whole). Redis refuses a function that may write before running it, so
/// such a request must not be left to `FCALL` alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denial_is_answered_while_memory_is_full() {
    for server in [RedisServer::start(), RedisServer::start_valkey()] {
        let s = storage(&server.url());
        wait_ready(&s).await;
        let r = s
            .apply(&[charge("drained", 10, 10)])
            .await
            .expect("answered");
        assert!(r.admitted);
        let full = |bytes: &str| {
            let _: () = server.query(redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(bytes));
        };
        full("1");
        let denied = s.apply(&[charge("drained", 1, 10)]).await;
        let check = s.apply(&[charge("drained", 0, 10)]).await;
        let write = s.apply(&[charge("fresh", 1, 10)]).await;
        full("0");
        let denied = denied.expect("a denial writes nothing: answered");
        assert!(!denied.admitted, "{denied:?}");
        assert_eq!(left(&denied), 0);
        let check = check.expect("a check writes nothing: answered");
        assert!(!check.charges[0].enough, "{check:?}");
        assert_eq!(kind(write), "OOM");
        let fresh: Option<Vec<u8>> = server.query(redis::cmd("GET").arg("fresh"));
        assert_eq!(fresh, None, "nothing written under OOM");
        // Memory back: the calls go as `FCALL` again.
        let before = server.command_executions("fcall");
        assert!(s.apply(&[charge("fresh", 1, 10)]).await.is_ok());
        assert_eq!(server.command_executions("fcall"), before + 1);
    }
}

/// The same on a Cluster node whose memory is full: the call goes once
/// more as `EVAL` on that node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denial_is_answered_by_a_cluster_node_whose_memory_is_full() {
    let c = common::cluster::RedisCluster::start();
    let s = bucket_rls::storage::redis::cluster::RedisClusterStorage::builder(c.seeds())
        .timeout(Duration::from_secs(2))
        .local_cache_size(0)
        .build()
        .expect("valid seeds");
    common::cluster::connected(&s).await;
    let (drained, fresh) = ("{oom}drained", "{oom}fresh");
    let r = s.apply(&[charge(drained, 10, 10)]).await.expect("answered");
    assert!(r.admitted);
    let master = c.node(c.shard_of(c.keyslot(drained)).master);
    let full = |bytes: &str| {
        let _: () = master.query(redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(bytes));
    };
    full("1");
    let denied = s.apply(&[charge(drained, 1, 10)]).await;
    let write = s.apply(&[charge(fresh, 1, 10)]).await;
    full("0");
    let denied = denied.expect("a denial writes nothing: answered");
    assert!(!denied.admitted, "{denied:?}");
    assert_eq!(left(&denied), 0);
    assert_eq!(kind(write), "OOM");
    assert_eq!(c.get(fresh), None, "nothing written under OOM");
}

/// `FUNCTION FLUSH` while many requests are in flight: every request is
/// answered (no `Function not found` reaches a caller) and takes exactly
/// one token.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_library_flushed_under_load_charges_each_request_once() {
    const REQUESTS: usize = 400;
    let server = RedisServer::start();
    let s = storage(&server.url());
    wait_ready(&s).await;
    let flusher = server.conn();
    let flusher = std::sync::Mutex::new(flusher);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..REQUESTS {
        let s = s.clone();
        tasks.spawn(async move { s.apply(&[charge("hot", 1, 100_000)]).await });
        if i == REQUESTS / 2 {
            let _: () = redis::cmd("FUNCTION")
                .arg("FLUSH")
                .query(&mut *flusher.lock().expect("lock"))
                .expect("FUNCTION FLUSH");
            tokio::task::yield_now().await;
        }
    }
    let mut answered = 0;
    while let Some(r) = tasks.join_next().await {
        let r = r.expect("task");
        assert!(r.as_ref().is_ok_and(|r| r.admitted), "{r:?}");
        answered += 1;
    }
    assert_eq!(answered, REQUESTS);
    let r = s
        .apply(&[charge("hot", 0, 100_000)])
        .await
        .expect("answered");
    assert_eq!(left(&r), 100_000 - REQUESTS as i64, "one token each");
}

/// A single node that refused Functions (its ACL: calls go as
/// `EVALSHA`) and is back with them after a restart (its configured user
/// may call them): once the background ping has seen it down, the library
/// is loaded when it answers, and calls go as `FCALL` again, without a
/// restart of the service (docs/redis.md, "Redis Functions").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn functions_are_used_again_after_redis_comes_back_with_them() {
    let mut server = RedisServer::start_with(&["--user", "fn", "on", ">pw", "~*", "+@all"]);
    let _: () = server.query(
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg("fn")
            .arg("-fcall")
            .arg("-function"),
    );
    let s = storage(&format!("redis://fn:pw@127.0.0.1:{}", server.port()));
    wait_ready(&s).await;
    assert!(s.apply(&[charge("k", 1, 10)]).await.is_ok());
    assert_eq!(server.command_executions("fcall"), 0);
    assert!(server.command_executions("evalsha") >= 1);
    server.stop();
    // Down long enough for a few background pings to fail.
    tokio::time::sleep(bucket_rls::storage::redis::HEALTH_INTERVAL * 3).await;
    server.restart();
    common::eventually::eventually(
        Duration::from_secs(10),
        "calls go as FCALL again",
        || async {
            let answered = s.apply(&[charge("k", 1, 10)]).await.is_ok();
            (answered && server.command_executions("fcall") > 0).then_some(())
        },
    )
    .await;
}

/// An ACL user allowed `FCALL` but not `FUNCTION LOAD` (an operator loads
/// the library): its calls go as `FCALL` of the library loaded for it;
/// once the library is lost (`FUNCTION FLUSH`), the refused load makes
/// them go as `EVALSHA`, with exactly one token per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_function_load_calls_a_library_loaded_for_it() {
    let server = RedisServer::start();
    let _: String =
        server.query(&bucket_rls::storage::redis::script::BucketScript::function_load_cmd());
    for rules in [&["on", ">pw"][..], &["~*", "+@all", "-function"][..]] {
        let _: () = server.query(redis::cmd("ACL").arg("SETUSER").arg("fn").arg(rules));
    }
    let s = storage(&format!("redis://fn:pw@127.0.0.1:{}", server.port()));
    wait_ready(&s).await;
    let r = s.apply(&[charge("k", 1, 10)]).await.expect("answered");
    assert_eq!(left(&r), 9);
    assert_eq!(server.command_executions("fcall"), 1, "the library ran");
    let _: () = server.query(redis::cmd("FUNCTION").arg("FLUSH"));
    let r = s.apply(&[charge("k", 1, 10)]).await.expect("answered");
    assert_eq!(left(&r), 8, "exactly one token");
    let r = s.apply(&[charge("k", 1, 10)]).await.expect("answered");
    assert_eq!(left(&r), 7);
    assert_eq!(server.command_executions("fcall"), 1);
    assert_eq!(server.command_executions("evalsha"), 2, "the script ran");
}

/// A restart with persistence keeps the library (the append-only file has
/// its `FUNCTION LOAD`), so no `Function not found` tells that Redis went
/// away, as `NOSCRIPT` did for the script: the script's clock is checked
/// again all the same once the background ping has seen Redis down, as
/// after any reconnection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clock_is_checked_again_after_a_restart_that_kept_the_library() {
    let mut server = RedisServer::start_with(&["--appendonly", "yes"]);
    let s = storage(&server.url());
    wait_ready(&s).await;
    assert!(s.apply(&[charge("k", 1, 10)]).await.is_ok());
    server.stop();
    // Down long enough for a few background pings to fail.
    tokio::time::sleep(bucket_rls::storage::redis::HEALTH_INTERVAL * 3).await;
    server.restart();
    wait_ready(&s).await;
    let r = s.apply(&[charge("k", 1, 10)]).await.expect("answered");
    assert_eq!(left(&r), 8, "the bucket was kept");
    assert_eq!(
        server.command_calls("fcall"),
        1,
        "the library was kept: no Function not found"
    );
    assert_eq!(server.command_calls("eval"), 1, "one clock check");
}
