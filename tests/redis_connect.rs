//! Connecting to Redis: ACL user and password in the URL (never echoed in
//! errors), `rediss://` over rustls with a private CA (single node and a
//! Redis Cluster with `tls-cluster yes`), and an invalid URL.

mod common;

use bucket_rls::grpc::ShouldRateLimit as _;
use bucket_rls::storage::Storage;
use bucket_rls::storage::redis::RedisStorage;
use common::free_port;
use common::redis::RedisServer;
use common::tls::{tls_server_args, write_tls_files};
use common::{desc, limiter, req, unique_prefix};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long cluster or replication setup may take to settle.
const SETUP_DEADLINE: Duration = Duration::from_secs(30);

const YAML: &str = r"
domain: c
descriptors:
  - key: k
    value: v
    rate_limit: {unit: minute, requests_per_unit: 10}
";

async fn ready(s: &RedisStorage) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if s.ping().await.is_ok() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An ACL user with a password from the URL works; a wrong password gives
/// `UNAVAILABLE`, and neither password appears in errors or in the URL shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acl_user_and_password() {
    let server =
        RedisServer::start_with(&["--user", "app", "on", ">s3cret-pw", "~*", "&*", "+@all"]);
    let url = format!("redis://app:s3cret-pw@127.0.0.1:{}/0", server.port());
    let s = std::sync::Arc::new(
        RedisStorage::builder(url.as_str())
            .timeout(Duration::from_secs(1))
            .build()
            .expect("valid URL"),
    );
    assert!(!s.url().contains("s3cret-pw"), "{}", s.url());
    assert!(ready(&s).await, "authenticated connection");
    let l = limiter(YAML, s.clone(), &unique_prefix("acl"));
    let r = l
        .should_rate_limit(&req("c", vec![desc(&[("k", "v")])], 1))
        .await
        .expect("OK");
    assert_eq!(
        (r.overall_code, r.statuses[0].limit_remaining),
        (Code::Ok as i32, 9)
    );

    let bad = format!("redis://app:wr0ng-pw@127.0.0.1:{}/0", server.port());
    let s = std::sync::Arc::new(
        RedisStorage::builder(bad.as_str())
            .timeout(Duration::from_millis(200))
            .build()
            .expect("valid URL"),
    );
    let l = limiter(YAML, s.clone(), &unique_prefix("acl"));
    let e = l
        .should_rate_limit(&req("c", vec![desc(&[("k", "v")])], 1))
        .await
        .expect_err("wrong password");
    assert_eq!(e.code(), tonic::Code::Unavailable);
    assert!(!e.message().contains("wr0ng-pw"), "{}", e.message());
    let e = s.ping().await.expect_err("wrong password");
    assert!(!e.to_string().contains("wr0ng-pw"), "{e}");
}

/// `rediss://` with rustls (ring provider) against a server certificate
/// signed by a private CA given to the builder (`--redis-tls-ca-file`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_private_ca() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = write_tls_files(dir.path());
    let tls_port = free_port();
    let mut args = tls_server_args(dir.path());
    args.extend(["--tls-port".into(), tls_port.to_string()]);
    let server = RedisServer::start_with(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let url = format!("rediss://127.0.0.1:{tls_port}/0");
    let s = std::sync::Arc::new(
        RedisStorage::builder(url.as_str())
            .timeout(Duration::from_secs(1))
            .tls_root_ca_pem(ca.clone())
            .build()
            .expect("valid URL"),
    );
    assert!(ready(&s).await, "TLS connection with the private CA");
    let l = limiter(YAML, s.clone(), &unique_prefix("tls"));
    let r = l
        .should_rate_limit(&req("c", vec![desc(&[("k", "v")])], 2))
        .await
        .expect("OK");
    assert_eq!(
        (r.overall_code, r.statuses[0].limit_remaining),
        (Code::Ok as i32, 8)
    );
    // Without the CA the server certificate is rejected: UNAVAILABLE, not OK.
    let s = std::sync::Arc::new(
        RedisStorage::builder(url.as_str())
            .timeout(Duration::from_millis(300))
            .build()
            .expect("valid URL"),
    );
    let l = limiter(YAML, s.clone(), &unique_prefix("tls"));
    let e = l
        .should_rate_limit(&req("c", vec![desc(&[("k", "v")])], 1))
        .await
        .expect_err("untrusted certificate");
    assert_eq!(e.code(), tonic::Code::Unavailable);
    drop(server);
}

/// A URL that does not parse is a startup error naming the URL without its password.
#[tokio::test]
async fn invalid_url_is_reported_redacted() {
    let e = RedisStorage::builder("redis://app:s3cret@[::1")
        .build()
        .expect_err("invalid");
    let msg = e.to_string();
    assert!(!msg.contains("s3cret"), "{msg}");
    let e = RedisStorage::builder("http://app:s3cret@host")
        .build()
        .expect_err("scheme");
    assert!(!e.to_string().contains("s3cret"), "{e}");
    // A password in the query is ignored by the client on TCP URLs (every
    // call would get NOAUTH): refused, and not echoed.
    let e = RedisStorage::builder("redis://127.0.0.1:6379/0?password=s3cret")
        .build()
        .expect_err("password in the query");
    let msg = e.to_string();
    assert!(msg.contains("redis://[user]:PASSWORD@host:port"), "{msg}");
    assert!(!msg.contains("s3cret"), "{msg}");
    // On a unix socket URL the crate reads `pass=`: accepted, shown masked.
    let s = RedisStorage::builder("redis+unix:///tmp/no-such.sock?pass=s3cret")
        .build()
        .expect("valid unix URL");
    assert_eq!(s.url(), "redis+unix:///tmp/no-such.sock?pass=***");
}

/// A Redis Cluster that speaks only TLS to clients and on its bus
/// (`tls-cluster yes`), reached through `rediss://` seeds with a private CA
/// (`--redis-cluster rediss://... --redis-tls-ca-file`): requests spanning
/// all three masters are decided exactly. Without the CA every call is
/// UNAVAILABLE, never OK.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_cluster_with_private_ca() {
    use bucket_rls::storage::redis::cluster::RedisClusterStorage;
    use common::cluster::Node;

    let dir = tempfile::tempdir().expect("tempdir");
    let ca = write_tls_files(dir.path());
    let mut nodes = Vec::new();
    let mut tls_ports = Vec::new();
    for i in 0..3 {
        let (port, tls_port) = (free_port(), free_port());
        let mut tls = tls_server_args(dir.path());
        tls.extend(["--tls-port".into(), tls_port.to_string()]);
        tls.extend(["--tls-cluster".into(), "yes".into()]);
        let tls: Vec<&str> = tls.iter().map(String::as_str).collect();
        let args = common::cluster::cluster_node_args(port, dir.path(), &tls);
        nodes.push(Node::start(
            "redis-server",
            &args,
            port,
            dir.path(),
            &format!("tls-node{i}-{port}"),
        ));
        tls_ports.push(tls_port);
    }
    common::cluster::create_cluster(&nodes, 0);
    common::eventually::eventually_blocking(
        SETUP_DEADLINE,
        "cluster_state:ok on every node",
        || {
            nodes.iter().all(|n| {
                n.try_query::<String>(redis::cmd("CLUSTER").arg("INFO"))
                    .is_ok_and(|i| i.contains("cluster_state:ok"))
            })
        },
    );

    let seeds: Vec<String> = tls_ports
        .iter()
        .map(|p| format!("rediss://127.0.0.1:{p}"))
        .collect();
    let yaml = "
domain: c
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 3}
";
    // Values whose buckets land on different masters.
    let descs = || {
        ["a", "b", "c", "d", "e", "f"]
            .iter()
            .map(|v| desc(&[("k", v)]))
            .collect::<Vec<_>>()
    };
    let s = Arc::new(
        RedisClusterStorage::builder(seeds.clone())
            .timeout(Duration::from_secs(1))
            .tls_root_ca_pem(ca)
            .build()
            .expect("valid seeds"),
    );
    let l = limiter(yaml, s, &unique_prefix("tls-cluster"));
    let deadline = Instant::now() + Duration::from_secs(15);
    let first = loop {
        match l.should_rate_limit(&req("c", descs(), 1)).await {
            Ok(r) => break r,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "TLS cluster never answered: {e:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let remaining = |r: &envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse| {
        r.statuses
            .iter()
            .map(|s| s.limit_remaining)
            .collect::<Vec<_>>()
    };
    assert_eq!(first.overall_code, Code::Ok as i32);
    assert_eq!(remaining(&first), vec![2; 6]);
    for left in [1, 0] {
        let r = l
            .should_rate_limit(&req("c", descs(), 1))
            .await
            .expect("OK");
        assert_eq!(
            (r.overall_code, remaining(&r)),
            (Code::Ok as i32, vec![left; 6])
        );
    }
    let r = l
        .should_rate_limit(&req("c", descs(), 1))
        .await
        .expect("answer");
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    // The keys really are spread over the three masters.
    let used: usize = nodes
        .iter()
        .filter(|n| n.query::<i64>(&redis::cmd("DBSIZE")) > 0)
        .count();
    assert_eq!(used, 3, "buckets on every master");

    // Without the CA, the servers' certificates are not trusted.
    let s = Arc::new(
        RedisClusterStorage::builder(seeds)
            .timeout(Duration::from_millis(300))
            .build()
            .expect("valid seeds"),
    );
    let l = limiter(yaml, s, &unique_prefix("tls-cluster"));
    for _ in 0..3 {
        let e = l
            .should_rate_limit(&req("c", descs(), 1))
            .await
            .expect_err("untrusted certificates");
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    }
}
