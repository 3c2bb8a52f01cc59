//! Connecting to Redis: ACL user and password in the URL (never echoed in
//! errors), `rediss://` over rustls with a private CA, and an invalid URL.

mod common;

use bucket_rls::limiter::Storage;
use bucket_rls::limiter::redis::RedisStorage;
use common::redis::{RedisServer, free_port};
use common::{desc, limiter, req, unique_prefix};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use std::time::{Duration, Instant};

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
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_key = rcgen::KeyPair::generate().expect("key");
    let ca_cert = ca_params.self_signed(&ca_key).expect("CA");
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let srv_key = rcgen::KeyPair::generate().expect("key");
    let srv_params =
        rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
            .expect("params");
    let srv_cert = srv_params
        .signed_by(&srv_key, &issuer)
        .expect("server cert");
    let path = |n: &str| dir.path().join(n).to_string_lossy().into_owned();
    std::fs::write(path("ca.crt"), ca_cert.pem()).expect("write");
    std::fs::write(path("server.crt"), srv_cert.pem()).expect("write");
    std::fs::write(path("server.key"), srv_key.serialize_pem()).expect("write");
    let tls_port = free_port();
    let server = RedisServer::start_with(&[
        "--tls-port",
        &tls_port.to_string(),
        "--tls-cert-file",
        &path("server.crt"),
        "--tls-key-file",
        &path("server.key"),
        "--tls-ca-cert-file",
        &path("ca.crt"),
        "--tls-auth-clients",
        "no",
    ]);
    let url = format!("rediss://127.0.0.1:{tls_port}/0");
    let s = std::sync::Arc::new(
        RedisStorage::builder(url.as_str())
            .timeout(Duration::from_secs(1))
            .tls_root_ca_pem(ca_cert.pem().into_bytes())
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
}
