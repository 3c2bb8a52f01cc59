//! End to end over TCP: the `bucket-rls` binary started with
//! `--redis-cluster` and with `--redis-sentinel`/`--redis-master-name`, as a
//! user would, against real servers; and the flag combinations it refuses.

mod common;

use common::cluster::RedisCluster;
use common::http::get as http_get;
use common::procs::{BucketRls, bucket_rls_bin};
use common::sentinel::{MASTER_NAME, SentinelSetup};
use common::{desc, req};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use std::io::Write;
use std::process::Command;

const YAML: &str = "domain: e2e\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n  - key: route\n    rate_limit: {unit: minute, requests_per_unit: 100}\n";

fn config_file() -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new()
        .suffix(".yaml")
        .tempfile()
        .expect("tempfile");
    f.write_all(YAML.as_bytes()).expect("write");
    f
}

/// `[[user=a], [user=b], [route=r]]` three times: OK, OK, then OVER_LIMIT
/// on both users with the route untouched (docs/cases.md, "No CROSSSLOT on
/// a cluster", step 1, through gRPC).
async fn three_calls(svc: &BucketRls) {
    let mut client = RateLimitServiceClient::connect(format!("http://{}", svc.grpc))
        .await
        .expect("connect");
    let call = || {
        req(
            "e2e",
            vec![
                desc(&[("user", "a")]),
                desc(&[("user", "b")]),
                desc(&[("route", "r")]),
            ],
            1,
        )
    };
    let mut got = Vec::new();
    for _ in 0..3 {
        let r = client
            .should_rate_limit(call())
            .await
            .expect("answer")
            .into_inner();
        got.push((
            r.overall_code,
            r.statuses
                .iter()
                .map(|s| (s.code, s.limit_remaining))
                .collect::<Vec<_>>(),
        ));
    }
    let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
    assert_eq!(
        got,
        vec![
            (ok, vec![(ok, 1), (ok, 1), (ok, 99)]),
            (ok, vec![(ok, 0), (ok, 0), (ok, 98)]),
            (over, vec![(over, 0), (over, 0), (ok, 98)]),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_from_a_redis_cluster() {
    let c = tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .expect("cluster");
    let cfg = config_file();
    let seeds = c.seeds().join(",");
    let svc = BucketRls::start(cfg.path(), &["--redis-cluster", &seeds]).await;
    three_calls(&svc).await;
    // The buckets are in the cluster (three keys with the default prefix).
    let keys: usize = c
        .shards()
        .iter()
        .map(|s| {
            let k: Vec<String> = c.node(s.master).query(redis::cmd("KEYS").arg("rls:*"));
            k.len()
        })
        .sum();
    assert_eq!(keys, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_from_the_master_sentinel_names() {
    // The master has a password, given with --redis-master-password.
    let s = tokio::task::spawn_blocking(|| SentinelSetup::start_with_password(Some("m-pw")))
        .await
        .expect("sentinel setup");
    let cfg = config_file();
    let sentinels = s.sentinel_addrs().join(",");
    let svc = BucketRls::start(
        cfg.path(),
        &[
            "--redis-sentinel",
            &sentinels,
            "--redis-master-name",
            MASTER_NAME,
            "--redis-master-password",
            "m-pw",
        ],
    )
    .await;
    // Unlabelled series exist before any event.
    let m = http_get(svc.http, "/metrics", &[]).await.expect("metrics");
    for series in [
        "bucket_rls_redis_circuit_open 0",
        "bucket_rls_redis_script_reload_total 0",
        "bucket_rls_local_cache_hits_total 0",
    ] {
        assert!(m.body.lines().any(|l| l == series), "{series}:\n{}", m.body);
    }
    three_calls(&svc).await;
    let master = s.data_node(s.master_port());
    let keys: Vec<String> = master.query(redis::cmd("KEYS").arg("rls:*"));
    assert_eq!(keys.len(), 3);
}

#[test]
fn refuses_ambiguous_or_incomplete_redis_flags() {
    let cfg = config_file();
    for args in [
        &[
            "--redis-url",
            "redis://127.0.0.1:1",
            "--redis-cluster",
            "127.0.0.1:2",
        ][..],
        &[
            "--redis-cluster",
            "127.0.0.1:2",
            "--redis-sentinel",
            "127.0.0.1:3",
        ][..],
        &["--redis-sentinel", "127.0.0.1:3"][..],
    ] {
        let err = refused(cfg.path(), args);
        assert!(
            err.contains("--redis-master-name") || err.contains("only one of"),
            "{args:?}: {err}"
        );
    }
    // Settings that would be ignored or would refuse every request.
    for (args, want) in [
        (
            &["--redis-master-password", "pw"][..],
            "apply only with --redis-sentinel",
        ),
        (
            &[
                "--redis-url",
                "redis://127.0.0.1:1",
                "--redis-master-username",
                "u",
            ][..],
            "apply only with --redis-sentinel",
        ),
        (
            &["--redis-tls-ca-file", "/etc/hostname"][..],
            "needs a Redis backend",
        ),
        (
            &[
                "--redis-url",
                "rediss://127.0.0.1:1",
                "--redis-tls-ca-file",
                "/etc/hostname",
            ][..],
            "no PEM certificate",
        ),
        (&["--max-descriptors", "0"][..], "must be at least 1"),
    ] {
        let err = refused(cfg.path(), args);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// Runs `serve` with `args`, expects a non-zero exit, returns stderr.
fn refused(config: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new(bucket_rls_bin())
        .arg("serve")
        .arg("--config")
        .arg(config)
        .args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .args(args)
        .output()
        .expect("run bucket-rls");
    assert!(!out.status.success(), "{args:?} must be refused");
    String::from_utf8_lossy(&out.stderr).into_owned()
}
