//! End to end over TCP: the `bucket-rls` binary started as a user would, called
//! with a gRPC client generated from Envoy's protos.

mod common;

use common::procs::{BucketRls, bucket_rls_bin};
use common::{desc, req};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const YAML: &str = "domain: e2e\ndescriptors:\n  - key: path\n    value: /v1/search/*\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";

fn config_file(yaml: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new()
        .suffix(".yaml")
        .tempfile()
        .expect("tempfile");
    f.write_all(yaml.as_bytes()).expect("write");
    f
}

#[tokio::test]
async fn serves_ok_then_over_limit_with_honest_retry_after() {
    let cfg = config_file(YAML);
    let svc = BucketRls::start(cfg.path(), &[]).await;
    let mut client = RateLimitServiceClient::connect(format!("http://{}", svc.grpc))
        .await
        .expect("connect");
    let call = || req("e2e", vec![desc(&[("path", "/v1/search/books")])], 1);
    for want in [1, 0] {
        let r = client
            .should_rate_limit(call())
            .await
            .expect("OK")
            .into_inner();
        assert_eq!(
            (r.overall_code, r.statuses[0].limit_remaining),
            (Code::Ok as i32, want)
        );
        let l = r.statuses[0].current_limit.as_ref().expect("current_limit");
        assert_eq!((l.requests_per_unit, l.unit), (2, 2));
    }
    let r = client
        .should_rate_limit(call())
        .await
        .expect("answer")
        .into_inner();
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    let d = r.statuses[0].duration_until_reset.expect("duration");
    // One token per 30 s, and at most a few ms have passed: the wait rounds up to 30.
    assert_eq!((d.seconds, d.nanos), (30, 0));
    let ra: Vec<_> = r
        .response_headers_to_add
        .iter()
        .filter(|h| h.key == "retry-after")
        .map(|h| h.value.as_str())
        .collect();
    assert_eq!(ra, ["30"]);

    // gRPC health on the same port.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", svc.grpc))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let mut health = HealthClient::new(channel);
    for service in ["", "envoy.service.ratelimit.v3.RateLimitService"] {
        let h = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .expect("health")
            .into_inner();
        assert_eq!(
            h.status,
            ServingStatus::Serving as i32,
            "service {service:?}"
        );
    }

    // Bad input over the wire: clear errors, and the service keeps serving.
    let many: Vec<_> = (0..10_000)
        .map(|i| desc(&[("path", &format!("/v1/search/{i}"))]))
        .collect();
    let e = client
        .should_rate_limit(req("e2e", many, 1))
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (
            tonic::Code::InvalidArgument,
            "too many descriptors: 10000 (at most 1024 per request)"
        )
    );
    let big = format!("/v1/search/{}", "x".repeat(1 << 20));
    let r = client
        .should_rate_limit(req("e2e", vec![desc(&[("path", &big)])], 1))
        .await
        .expect("1 MiB value")
        .into_inner();
    assert_eq!(r.statuses[0].limit_remaining, 1);
    let e = client
        .should_rate_limit(req("", vec![desc(&[("path", "/")])], 1))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    let r = client
        .should_rate_limit(req("e2e", vec![desc(&[("path", "/v1/search/other")])], 1))
        .await
        .expect("serving")
        .into_inner();
    assert_eq!(r.statuses[0].limit_remaining, 1);
}

/// Unlabelled series exist from startup, so an alert on them has a series
/// to match before the first event.
#[tokio::test]
async fn unlabelled_series_exist_from_startup() {
    let cfg = config_file(YAML);
    let svc = BucketRls::start(cfg.path(), &[]).await;
    let m = common::http::get(svc.http, "/metrics", &[])
        .await
        .expect("metrics");
    assert!(
        m.body
            .lines()
            .any(|l| l == "bucket_rls_memory_evictions_total 0"),
        "{}",
        m.body
    );
}

#[tokio::test]
async fn sigterm_drains_and_exits_cleanly() {
    let cfg = config_file(YAML);
    let svc = BucketRls::start(cfg.path(), &[]).await;
    let pid = svc.proc.pid();
    let status = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if !std::path::Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| s.contains(") Z "))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still running 10 s after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let logs = svc.proc.logs();
    assert!(
        logs.contains("shutting down") && logs.contains("stopped"),
        "{logs}"
    );
}

#[test]
fn invalid_config_refuses_to_start() {
    let cfg = config_file(
        "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit:\n      unlimied: true\n",
    );
    let port = common::free_port();
    let out = Command::new(bucket_rls_bin())
        .args(["serve", "--config"])
        .arg(cfg.path())
        .args([
            "--grpc-addr",
            &format!("127.0.0.1:{port}"),
            "--http-addr",
            "127.0.0.1:0",
        ])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("invalid config")
            && err.contains("descriptors[0](key=remote_address).rate_limit: ")
            && err.contains("unknown key 'unlimied'"),
        "{err}"
    );
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "never listens"
    );
}

#[test]
fn check_config_prints_every_problem_and_sets_the_exit_code() {
    let good = config_file(YAML);
    let bad = config_file(
        "domain: x\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n  - value: b\n",
    );
    let out = Command::new(bucket_rls_bin())
        .arg("check-config")
        .arg(good.path())
        .output()
        .expect("run");
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("OK (1 domain, 1 rule,"));
    let out = Command::new(bucket_rls_bin())
        .arg("check-config")
        .arg(good.path())
        .arg(bad.path())
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let bad_name = bad.path().display().to_string();
    assert!(
        err.contains(&format!(
            "{bad_name}:4: descriptors[0](key=a).rate_limit: bad unit 'fortnight'"
        )),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "{bad_name}:5: descriptors[1](value=b): descriptor without 'key'"
        )),
        "{err}"
    );
    let out = Command::new(bucket_rls_bin())
        .arg("check-config")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/config"))
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The log reader goes away (a log shipper died, `| head -1`): writes to
/// stderr fail with EPIPE. Logging must drop those lines, never panic: calls
/// that log (an unknown domain) are still answered, a reload still applies,
/// and SIGTERM still exits 0.
#[tokio::test]
async fn a_closed_log_pipe_changes_nothing() {
    use common::free_port;
    use common::http::get as http_get;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("a.yaml"), YAML).expect("write");
    let grpc = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    let http = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut child = Command::new(bucket_rls_bin())
        .arg("serve")
        .arg("--config")
        .arg(dir.path())
        .args(["--grpc-addr", &grpc.to_string()])
        .args(["--http-addr", &http.to_string()])
        .args(["--log-level", "debug"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    // Close the read ends: every later log write gets EPIPE.
    drop(child.stdout.take());
    drop(child.stderr.take());
    let deadline = Instant::now() + Duration::from_secs(20);
    while !http_get(http, "/healthcheck", &[])
        .await
        .is_ok_and(|r| r.status == 200)
    {
        assert!(
            child.try_wait().expect("wait").is_none(),
            "exited at startup"
        );
        assert!(Instant::now() < deadline, "never healthy");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut client = RateLimitServiceClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");
    for domain in ["no-such-domain", "e2e", "another-unknown"] {
        let r = client
            .should_rate_limit(req(domain, vec![desc(&[("path", "/v1/search/x")])], 1))
            .await
            .unwrap_or_else(|e| panic!("{domain}: {e:?}"))
            .into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32, "{domain}");
    }
    std::fs::write(
        dir.path().join("b.yaml"),
        "domain: added\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1}\n",
    )
    .expect("write");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = client
            .should_rate_limit(req("added", vec![desc(&[("k", "v")])], 2))
            .await
            .expect("answer")
            .into_inner();
        if r.overall_code == Code::OverLimit as i32 {
            break;
        }
        assert!(Instant::now() < deadline, "reload never applied");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(child.try_wait().expect("wait").is_none(), "still running");
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let code = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(Instant::now() < deadline, "still running after SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(code.success(), "exit status after SIGTERM: {code:?}");
}
