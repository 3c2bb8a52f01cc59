//! The local over-limit cache never keeps a denial Redis no longer holds for
//! long: an entry answers for at most a second whatever the refill rate, and
//! SIGHUP and a Redis restart clear it.

use crate::common::eventually::eventually;
use crate::common::procs::BucketRls;
use crate::common::redis::RedisServer;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use std::process::Command;
use std::time::Duration;

/// One token an hour: without a bound on an entry's life, a denial would be
/// answered from memory for the hour.
const CONFIG: &str =
    "domain: lc\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";

type Client = RateLimitServiceClient<tonic::transport::Channel>;

/// The overall code for one request of user `ann` (1 = OK, 2 = OVER_LIMIT).
async fn code(c: &mut Client) -> i32 {
    c.should_rate_limit(crate::common::req(
        "lc",
        vec![crate::common::desc(&[("user", "ann")])],
        1,
    ))
    .await
    .expect("answer")
    .into_inner()
    .overall_code
}

async fn cache_hits(rls: &BucketRls) -> f64 {
    let r = crate::common::http::get(rls.http, "/metrics", &[])
        .await
        .expect("scrape");
    crate::common::metrics::metric(&r.body, "bucket_rls_local_cache_hits_total", &[]).unwrap_or(0.0)
}

/// Drains `ann` and checks that the last denial came from the cache.
async fn drain(rls: &BucketRls, c: &mut Client) {
    while code(c).await == 1 {}
    let hits = cache_hits(rls).await;
    assert_eq!(code(c).await, 2);
    assert!(cache_hits(rls).await > hits, "denied from the local cache");
}

/// The attack: an operator resets a drained bucket (`FLUSHALL`), or Redis
/// restarts and loses it; before the fix the replica kept answering
/// `OVER_LIMIT` from its cache until the bucket would have refilled (an hour
/// here). Now SIGHUP clears the cache at once, and after a restart the
/// cleared bucket is admitted within the entry's one-second life.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_or_restarted_redis_is_seen_after_sighup_and_within_a_second() {
    let mut redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("lc.yaml");
    std::fs::write(&config, CONFIG).unwrap();
    let rls = BucketRls::start(&config, &["--redis-url", &redis.url()]).await;
    let mut c = RateLimitServiceClient::connect(format!("http://{}", rls.grpc))
        .await
        .expect("connect");

    drain(&rls, &mut c).await;
    redis.flush();
    Command::new("kill")
        .args(["-HUP", &rls.proc.pid().to_string()])
        .status()
        .expect("kill -HUP");
    eventually(Duration::from_secs(10), "SIGHUP handled", || async {
        rls.proc
            .logs()
            .contains("clearing the local over-limit cache")
            .then_some(())
    })
    .await;
    assert_eq!(
        code(&mut c).await,
        1,
        "the reset bucket admits after SIGHUP"
    );

    drain(&rls, &mut c).await;
    redis.restart();
    eventually(
        Duration::from_secs(15),
        "the bucket Redis lost admits again",
        || async {
            // Each call may fail while Redis comes back; only an OK ends it.
            let r = c
                .clone()
                .should_rate_limit(crate::common::req(
                    "lc",
                    vec![crate::common::desc(&[("user", "ann")])],
                    1,
                ))
                .await;
            let ok = matches!(r, Ok(r) if r.get_ref().overall_code == 1);
            if !ok {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            ok.then_some(())
        },
    )
    .await;
}
