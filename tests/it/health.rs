//! `/healthcheck` reflects whether charges work, and health checks never
//! flap the circuit breaker.

use crate::common::eventually::eventually;
use crate::common::procs::BucketRls;
use crate::common::redis::RedisServer;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use std::time::Duration;

const CONFIG: &str = "domain: h\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 1000}\n";

/// The attack: Redis answers `PING` but refuses every write (`OOM` under
/// `noeviction` once `maxmemory` is reached; a replica's `READONLY` is the
/// same case). Before, `/healthcheck` said 200 while every charge failed,
/// and each health ping closed the circuit breaker, which reopened and
/// logged once per check. Now health is a real charge: 503 while charges
/// fail, the breaker stays open through the checks, and both recover when
/// Redis takes writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_fails_while_charges_fail_and_checks_never_close_the_breaker() {
    let redis = RedisServer::start_with(&["--maxmemory-policy", "noeviction"]);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("h.yaml");
    std::fs::write(&config, CONFIG).unwrap();
    let rls = BucketRls::start(&config, &["--redis-url", &redis.url()]).await;
    let mut c = RateLimitServiceClient::connect(format!("http://{}", rls.grpc))
        .await
        .expect("connect");
    let call = |c: &mut RateLimitServiceClient<tonic::transport::Channel>, i: u32| {
        let mut c = c.clone();
        async move {
            c.should_rate_limit(crate::common::req(
                "h",
                vec![crate::common::desc(&[("user", &format!("u{i}"))])],
                1,
            ))
            .await
        }
    };
    assert!(call(&mut c, 0).await.is_ok());

    let _: () = redis.query(redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("1"));
    // Open the breaker with failing charges.
    for i in 1..=10 {
        let e = call(&mut c, i).await.expect_err("charges fail with OOM");
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    }
    let health = |rls: &BucketRls| {
        let addr = rls.http;
        async move {
            crate::common::http::get(addr, "/healthcheck", &[])
                .await
                .expect("healthcheck")
        }
    };
    for _ in 0..10 {
        let r = health(&rls).await;
        assert_eq!(r.status, 503, "healthy while every charge fails: {r:?}");
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let logs = rls.proc.logs();
    assert!(
        !logs.contains("circuit breaker closed"),
        "health checks closed the breaker:\n{logs}"
    );

    let _: () = redis.query(redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("0"));
    eventually(Duration::from_secs(15), "healthy again", || async {
        (health(&rls).await.status == 200).then_some(())
    })
    .await;
    assert!(call(&mut c, 99).await.is_ok(), "charges work again");
}
