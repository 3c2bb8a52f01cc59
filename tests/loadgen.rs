//! `bucket-rls loadgen` end to end: the real binary serves a small config on
//! loopback port 0, the real binary loads it, and the printed figures add up.
//! No timing assertions: only counts and the presence of every figure.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_bucket-rls");

const CONFIG: &str = "\
domain: lg
descriptors:
  - key: small
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: big
    rate_limit: {unit: second, requests_per_unit: 1000000000}
";

/// The service binary on ephemeral loopback ports; killed on drop.
struct Server {
    child: Child,
    grpc: String,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `serve` on port 0 and reads the bound gRPC address from its JSON log.
fn start_server() -> Server {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("lg.yaml");
    std::fs::write(&cfg, CONFIG).expect("write config");
    let mut child = Command::new(BIN)
        .args(["serve", "--config"])
        .arg(&cfg)
        .args([
            "--grpc-addr",
            "127.0.0.1:0",
            "--http-addr",
            "127.0.0.1:0",
            "--log-format",
            "json",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn serve");
    let stderr = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    let mut grpc = None;
    for line in lines.by_ref() {
        let line = line.expect("read serve log");
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if let Some(addr) = v["fields"]["grpc"].as_str() {
            grpc = Some(addr.to_owned());
            break;
        }
    }
    let Some(grpc) = grpc else {
        let _ = child.kill();
        panic!("serve exited without logging its gRPC address");
    };
    // Keep draining the log so the server never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Server {
        child,
        grpc,
        _dir: dir,
    }
}

fn loadgen(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("loadgen")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run loadgen")
}

/// `name: value` lines of the final report.
fn figures(out: &Output) -> HashMap<String, String> {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "loadgen failed: {}\nstdout:\n{text}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

fn count(f: &HashMap<String, String>, name: &str) -> u64 {
    f.get(name)
        .unwrap_or_else(|| panic!("no `{name}:` line in {f:?}"))
        .parse()
        .unwrap_or_else(|e| panic!("`{name}` is not a count: {e}"))
}

#[test]
fn closed_loop_counts_add_up_and_small_rule_goes_over_limit() {
    let server = start_server();
    let json = tempfile::NamedTempFile::new().expect("temp json");
    let json_path = json.path().to_str().expect("utf-8 path").to_owned();
    let out = loadgen(&[
        "--target",
        &server.grpc,
        "--domain",
        "lg",
        "--descriptor",
        "small=x",
        "--requests",
        "2000",
        "--concurrency",
        "16",
        "--connections",
        "2",
        "--json",
        &json_path,
        "--quiet",
    ]);
    let f = figures(&out);
    for name in [
        "requests/s",
        "p50",
        "p90",
        "p99",
        "p99.9",
        "max",
        "ok",
        "over_limit",
        "errors",
    ] {
        assert!(f.contains_key(name), "missing `{name}:` line in {f:?}");
    }
    let rps: f64 = f["requests/s"].parse().expect("requests/s is a number");
    assert!(rps > 0.0);
    assert!(f["p99"].ends_with(" ms"), "{}", f["p99"]);
    let (requests, ok, over, errors) = (
        count(&f, "requests"),
        count(&f, "ok"),
        count(&f, "over_limit"),
        count(&f, "errors"),
    );
    assert_eq!(requests, 2000);
    assert_eq!(ok + over + errors, requests, "{f:?}");
    assert_eq!(errors, 0, "{f:?}");
    // 100 tokens, refilling 100/minute: at least the first 100 pass, most do not.
    assert!(ok >= 100, "{f:?}");
    assert!(over > 0 && over > ok, "{f:?}");

    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(json.path()).expect("read json")).expect("json");
    assert_eq!(v["requests"], 2000);
    assert_eq!(
        v["ok"].as_u64().unwrap() + v["over_limit"].as_u64().unwrap(),
        2000
    );
    assert!(v["latency_us"]["p99"].as_u64().is_some());
}

#[test]
fn open_loop_with_many_keys_answers_every_request() {
    let server = start_server();
    let out = loadgen(&[
        "--target",
        &server.grpc,
        "--domain",
        "lg",
        "--descriptor",
        "big=client",
        "--descriptor",
        "small=ip",
        "--keys",
        "100000",
        "--distribution",
        "zipf",
        "--rate",
        "2000",
        "--requests",
        "400",
        "--quiet",
    ]);
    let f = figures(&out);
    assert_eq!(count(&f, "requests"), 400);
    assert_eq!(
        count(&f, "ok") + count(&f, "over_limit") + count(&f, "errors"),
        400
    );
    assert_eq!(count(&f, "errors"), 0, "{f:?}");
    assert!(f["mode"].starts_with("open loop"), "{f:?}");
}

#[test]
fn non_loopback_target_is_refused() {
    for target in ["192.0.2.1:8081", "[2001:db8::1]:8081"] {
        let out = loadgen(&[
            "--target",
            target,
            "--domain",
            "lg",
            "--descriptor",
            "small=x",
            "--requests",
            "1",
        ]);
        assert!(!out.status.success(), "{target} was not refused");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("not a loopback address"), "{err}");
        assert!(out.stdout.is_empty());
    }
}

/// Runs are bounded: a duration past 10 minutes is refused up front instead
/// of being cut short without a word.
#[test]
fn duration_past_ten_minutes_is_refused() {
    let out = loadgen(&[
        "--target",
        "127.0.0.1:1",
        "--domain",
        "lg",
        "--descriptor",
        "small=x",
        "--duration",
        "11m",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("at most 600 s"), "{err}");
}
