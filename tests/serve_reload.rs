//! The `bucket-rls serve` binary: hot reload visible on `/rlconfig` and
//! `/metrics`, SIGHUP forcing a reload, and `--log-format json` writing one
//! JSON object per line.

mod common;

use common::eventually::eventually;
use common::http::request;
use common::metrics::metric;
use common::procs::BucketRls;
use serde_json::Value;
use std::process::Command;
use std::time::Duration;

fn yaml(rpu: u32) -> String {
    format!(
        "domain: srv\ndescriptors:\n  - key: user\n    rate_limit: {{unit: minute, requests_per_unit: {rpu}}}\n"
    )
}

fn log_lines(svc: &BucketRls, needle: &str) -> usize {
    svc.proc
        .logs()
        .lines()
        .filter(|l| l.contains(needle))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_sighup_and_json_logs_in_the_binary() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("srv.yaml");
    std::fs::write(&file, yaml(1)).unwrap();
    let svc = BucketRls::start(&file, &["--log-format", "json"]).await;

    let rlconfig = || async {
        let r = request(svc.http, "GET", "/rlconfig", None).await;
        assert_eq!(r.status, 200);
        serde_json::from_str::<Value>(&r.body).unwrap()
    };
    let v1 = rlconfig().await;
    let metrics = request(svc.http, "GET", "/metrics", None).await.body;
    let h1 = v1["hash"].as_str().unwrap().to_owned();
    assert_eq!(
        metric(&metrics, "bucket_rls_config_info", &[("hash", &h1)]),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &metrics,
            "bucket_rls_config_load_total",
            &[("result", "success")]
        ),
        Some(1.0),
        "the startup load counts"
    );
    let gauge = |m: &str, name: &str| metric(m, name, &[]);
    assert_eq!(
        metric(
            &metrics,
            "bucket_rls_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        Some(1.0)
    );
    assert_eq!(
        gauge(&metrics, "bucket_rls_config_last_reload_successful"),
        Some(1.0)
    );
    let t0 = gauge(&metrics, "bucket_rls_config_last_reload_timestamp_seconds").unwrap();
    assert!(t0 > 1.6e9, "{t0}");

    // A change on disk applies within 2 s and is visible on both endpoints.
    let tmp = dir.path().join("srv.yaml.tmp");
    std::fs::write(&tmp, yaml(7)).unwrap();
    std::fs::rename(&tmp, &file).unwrap();
    let (v2, _) = eventually(
        Duration::from_secs(2),
        "the new config on /rlconfig",
        || async {
            let v = rlconfig().await;
            (v["hash"] != v1["hash"]).then_some(v)
        },
    )
    .await;
    assert_eq!(v2["domains"][0]["rules"][0]["requests_per_unit"], 7);
    let metrics = request(svc.http, "GET", "/metrics", None).await.body;
    let h2 = v2["hash"].as_str().unwrap();
    assert_eq!(
        metric(&metrics, "bucket_rls_config_info", &[("hash", h2)]),
        Some(1.0)
    );
    assert_eq!(
        metric(&metrics, "bucket_rls_config_info", &[("hash", &h1)]),
        None
    );

    // A broken file: reported once; SIGHUP reports it again; config kept.
    std::fs::write(
        &tmp,
        "domain: srv\ndescriptors:\n  - key: user\n    rate_limit: {unlimied: true}\n",
    )
    .unwrap();
    std::fs::rename(&tmp, &file).unwrap();
    eventually(Duration::from_secs(2), "the reload error", || async {
        let v = rlconfig().await;
        v["last_reload_error"]["message"]
            .as_str()
            .map(str::to_owned)
    })
    .await;
    assert_eq!(log_lines(&svc, "config reload failed"), 1);
    let hup = Command::new("kill")
        .args(["-HUP", &svc.proc.pid().to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    eventually(Duration::from_secs(2), "the forced reload", || async {
        (log_lines(&svc, "config reload failed") == 2).then_some(())
    })
    .await;
    assert_eq!(rlconfig().await["hash"], v2["hash"], "the old config stays");
    assert_eq!(log_lines(&svc, "SIGHUP"), 1);
    let metrics = request(svc.http, "GET", "/metrics", None).await.body;
    assert_eq!(
        gauge(&metrics, "bucket_rls_config_last_reload_successful"),
        Some(0.0),
        "the file on disk is not the config in force"
    );
    assert!(gauge(&metrics, "bucket_rls_config_last_reload_timestamp_seconds").unwrap() >= t0);

    // Fixed on disk: logged once as good again, the gauge back at 1.
    std::fs::write(&tmp, yaml(9)).unwrap();
    std::fs::rename(&tmp, &file).unwrap();
    eventually(Duration::from_secs(2), "the fixed config", || async {
        (rlconfig().await["domains"][0]["rules"][0]["requests_per_unit"] == 9).then_some(())
    })
    .await;
    // The log line follows the swap: waited for, then counted once.
    eventually(
        Duration::from_secs(5),
        "the 'good again' log line",
        || async { (log_lines(&svc, "good again") > 0).then_some(()) },
    )
    .await;
    assert_eq!(log_lines(&svc, "good again"), 1, "logged once");
    let metrics = request(svc.http, "GET", "/metrics", None).await.body;
    assert_eq!(
        gauge(&metrics, "bucket_rls_config_last_reload_successful"),
        Some(1.0)
    );

    // Every line on the log is one JSON object with a level and a message.
    let logs = svc.proc.logs();
    for line in logs.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(
            v["level"].is_string() && v["fields"]["message"].is_string(),
            "{line}"
        );
    }
}
