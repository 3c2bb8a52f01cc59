//! The `bucket-rls serve` binary with `--redis-url`: it starts and stays up
//! while Redis is down (`/healthcheck` 503, no crash loop), becomes ready
//! when Redis comes up, never logs the Redis password, and warns about an
//! `allkeys-*` eviction policy (docs/cases.md, "Redis down answers fast" and
//! "Every key has a long enough TTL").

mod common;

use common::free_port;
use common::http::get as http_get;
use common::procs::{BucketRls, Proc, bucket_rls_bin};
use common::redis::RedisServer;
use std::net::{Ipv4Addr, SocketAddr};
use std::process::Command;
use std::time::{Duration, Instant};

const YAML: &str = r"
domain: p
descriptors:
  - key: k
    value: v
    rate_limit: {unit: minute, requests_per_unit: 10}
";

fn config_file() -> tempfile::NamedTempFile {
    let f = tempfile::Builder::new()
        .suffix(".yaml")
        .tempfile()
        .expect("temp file");
    std::fs::write(f.path(), YAML).expect("write config");
    f
}

async fn health(http: SocketAddr) -> Option<u16> {
    http_get(http, "/healthcheck", &[])
        .await
        .ok()
        .map(|r| r.status)
}

/// Started while Redis is down (docs/cases.md, "Redis down answers fast",
/// step 2), the process stays up and
/// reports not ready; once Redis is up it becomes ready without a restart.
/// The password of the URL never appears in its logs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_while_redis_is_down_and_recovers() {
    let mut redis =
        RedisServer::start_with(&["--user", "app", "on", ">pw-Zq81x", "~*", "&*", "+@all"]);
    redis.stop();
    let cfg = config_file();
    let http = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let grpc = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let mut cmd = Command::new(bucket_rls_bin());
    cmd.arg("serve")
        .arg("--config")
        .arg(cfg.path())
        .arg("--grpc-addr")
        .arg(grpc.to_string())
        .arg("--http-addr")
        .arg(http.to_string())
        .arg("--redis-url")
        .arg(format!("redis://app:pw-Zq81x@127.0.0.1:{}/0", redis.port()))
        .env("BUCKET_RLS_LOG_LEVEL", "debug");
    let mut proc = Proc::spawn("bucket-rls", cmd);
    let deadline = Instant::now() + Duration::from_secs(20);
    while health(http).await.is_none() {
        proc.assert_running();
        assert!(
            Instant::now() < deadline,
            "admin port never answered:\n{}",
            proc.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        health(http).await,
        Some(503),
        "not ready while Redis is down"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    proc.assert_running();
    assert_eq!(health(http).await, Some(503));
    redis.restart();
    let t = Instant::now();
    while health(http).await != Some(200) {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "not ready 5 s after Redis came up:\n{}",
            proc.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let logs = proc.logs();
    assert!(
        logs.contains("app:***@127.0.0.1"),
        "the redacted URL is logged:\n{logs}"
    );
    assert!(!logs.contains("pw-Zq81x"), "password in the logs:\n{logs}");
}

/// An eviction policy that may evict buckets in use is reported at startup
/// (docs/design.md, "Key expiry"): `volatile-lru` too, since every bucket
/// key has a TTL; `volatile-ttl` is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warns_about_eviction_policies_that_evict_buckets_in_use() {
    for (policy, warned) in [
        ("allkeys-lru", true),
        ("volatile-lru", true),
        ("volatile-ttl", false),
    ] {
        let redis = RedisServer::start_with(&["--maxmemory-policy", policy]);
        let cfg = config_file();
        let svc = BucketRls::start(
            cfg.path(),
            &[
                "--redis-url",
                &redis.url(),
                "--log-level",
                "bucket_rls=debug,info",
            ],
        )
        .await;
        let t = Instant::now();
        // The policy is logged either way (debug when it keeps the limits).
        while !svc.proc.logs().contains(policy) {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "policy {policy} never logged:\n{}",
                svc.proc.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let logs = svc.proc.logs();
        assert_eq!(
            logs.contains("may evict rate limit buckets that are in use"),
            warned,
            "{policy}:\n{logs}"
        );
    }
}
