//! `bucket-rls check-config --diff OLD NEW`: the report, per rule, of what a
//! change does, and the exit codes a CI pipeline branches on; OLD as files
//! or as a running replica's `/rlconfig`.

use crate::common::procs::{BucketRls, bucket_rls_bin};
use std::path::Path;
use std::process::Command;

const OLD: &str = "domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 10, burst: 20}
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: legacy
    rate_limit: {unit: hour, requests_per_unit: 100}
";

const TIGHTER: &str = "domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 5, burst: 10}
  - key: api_key
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: export
    rate_limit: {unit: hour, requests_per_unit: 2}
";

const LOOSER: &str = "domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 20, burst: 20}
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: legacy
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: export
    rate_limit: {unit: hour, requests_per_unit: 2}
";

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write config");
    p.display().to_string()
}

/// Runs `check-config --diff old new`: (exit code, stdout, stderr).
fn diff(old: &str, new: &str) -> (i32, String, String) {
    let out = Command::new(bucket_rls_bin())
        .args(["check-config", "--diff", old, new])
        .output()
        .expect("run bucket-rls");
    (
        out.status.code().expect("exit code"),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn diff_reports_each_rule_and_exits_3_when_a_change_needs_review() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (old, new) = (
        write(dir.path(), "old.yaml", OLD),
        write(dir.path(), "new.yaml", TIGHTER),
    );
    let (code, out, err) = diff(&old, &new);
    assert_eq!(err, "");
    assert_eq!(
        out,
        "edge.api_key: changed: 5/minute burst 5 -> 5/minute burst 5 (modes none -> shadow_mode)
edge.export: added: 2/hour burst 2: buckets start full (2 tokens)
edge.legacy: removed: 100/hour burst 100: its buckets are no longer charged
edge.remote_address: tightened: 10/second burst 20 -> 5/second burst 10: existing buckets keep their tokens, capped at 10; refill at 5/second from now
4 rules changed: 1 added, 1 removed, 1 tightened, 1 changed
"
    );
    assert_eq!(code, 3);
}

#[test]
fn diff_exits_2_for_only_additions_and_loosenings_and_0_for_none() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (old, new) = (
        write(dir.path(), "old.yaml", OLD),
        write(dir.path(), "new.yaml", LOOSER),
    );
    let (code, out, _) = diff(&old, &new);
    assert_eq!(
        out,
        "edge.export: added: 2/hour burst 2: buckets start full (2 tokens)
edge.remote_address: loosened: 10/second burst 20 -> 20/second burst 20: existing buckets keep their tokens; refill at 20/second from now
2 rules changed: 1 added, 1 loosened
"
    );
    assert_eq!(code, 2);
    let (code, out, _) = diff(&old, &old);
    assert_eq!((code, out.as_str()), (0, "no rule changed\n"));
}

#[test]
fn diff_exits_1_and_names_the_error_when_a_side_does_not_load() {
    let dir = tempfile::tempdir().expect("tempdir");
    let old = write(dir.path(), "old.yaml", OLD);
    let bad = write(
        dir.path(),
        "bad.yaml",
        "domain: edge\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: -1}\n",
    );
    let (code, out, err) = diff(&old, &bad);
    assert_eq!(code, 1);
    assert_eq!(out, "");
    assert!(
        err.contains("bad.yaml") && err.contains("requests_per_unit"),
        "{err}"
    );
    let (code, _, err) = diff("http://127.0.0.1:1/rlconfig", &old);
    assert_eq!(code, 1);
    assert!(
        err.starts_with("http://127.0.0.1:1/rlconfig: connect:"),
        "{err}"
    );
}

#[tokio::test]
async fn diff_against_a_running_replica_reads_its_rlconfig() {
    let dir = tempfile::tempdir().expect("tempdir");
    let served = tempfile::tempdir().expect("tempdir");
    write(served.path(), "edge.yaml", OLD);
    let rls = BucketRls::start(served.path(), &[]).await;
    let new = write(dir.path(), "new.yaml", TIGHTER);
    let url = format!("http://{}/rlconfig", rls.http);
    let (code, out, err) = tokio::task::spawn_blocking(move || diff(&url, &new))
        .await
        .expect("diff");
    assert_eq!(err, "");
    assert_eq!(code, 3);
    assert!(
        out.ends_with("4 rules changed: 1 added, 1 removed, 1 tightened, 1 changed\n"),
        "{out}"
    );
    // The replica serves the file: diffing it against the same file is empty.
    let url = format!("http://{}/rlconfig", rls.http);
    let same = served.path().join("edge.yaml").display().to_string();
    let (code, out, _) = tokio::task::spawn_blocking(move || diff(&url, &same))
        .await
        .expect("diff");
    assert_eq!((code, out.as_str()), (0, "no rule changed\n"));
}

/// A change of algorithm is a change to review (exit 3), saying what it does
/// to stored state; a window's change of rate says its windows keep their
/// counts. `--default-algorithm` gives both sides' rules that name none.
#[test]
fn a_change_of_algorithm_is_a_change_to_review() {
    let dir = tempfile::tempdir().expect("tempdir");
    let old = write(
        dir.path(),
        "old.yaml",
        "domain: edge
descriptors:
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: win
    rate_limit: {unit: minute, requests_per_unit: 10, algorithm: fixed_window}
",
    );
    let new = write(
        dir.path(),
        "new.yaml",
        "domain: edge
descriptors:
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 5, algorithm: fixed_window}
  - key: win
    rate_limit: {unit: minute, requests_per_unit: 20, algorithm: fixed_window}
",
    );
    let (code, out, err) = diff(&old, &new);
    assert_eq!(err, "");
    assert_eq!(
        out,
        "edge.api_key: changed: 5/minute burst 5 -> 5/minute fixed_window (algorithm token_bucket -> fixed_window: every window starts at zero)
edge.win: loosened: 10/minute fixed_window -> 20/minute fixed_window: existing windows keep their counts, now against 20 per minute
2 rules changed: 1 loosened, 1 changed
"
    );
    assert_eq!(code, 3);
    // Under --default-algorithm fixed_window the old api_key rule is a
    // window already: only the loosening is left.
    let out = Command::new(bucket_rls_bin())
        .args([
            "check-config",
            "--default-algorithm",
            "fixed_window",
            "--diff",
            &old,
            &new,
        ])
        .output()
        .expect("run bucket-rls");
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stdout).ends_with("1 rule changed: 1 loosened\n"),
        "{out:?}"
    );
}

/// A replica started with `--max-debt-bursts` shows the debt bound in
/// force in `/rlconfig`; the diff applies that setting to the file's rules,
/// so the file it serves diffs as unchanged, and a change of burst says
/// what it does to the bound in force. A rule's own `max_debt` and a
/// `quota_mode` rule (no debt from the setting) are compared as they are.
#[tokio::test]
async fn diff_against_a_replica_with_max_debt_bursts_compares_the_bound_in_force() {
    const SERVED: &str = "domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 10, burst: 20}
  - key: own_debt
    rate_limit: {unit: minute, requests_per_unit: 5, max_debt: 7}
  - key: quota
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: win
    rate_limit: {unit: minute, requests_per_unit: 10, algorithm: fixed_window}
";
    let dir = tempfile::tempdir().expect("tempdir");
    let served = tempfile::tempdir().expect("tempdir");
    let same = write(served.path(), "edge.yaml", SERVED);
    let rls = BucketRls::start(served.path(), &["--max-debt-bursts", "2"]).await;
    let url = format!("http://{}/rlconfig", rls.http);
    let (code, out, err) = {
        let url = url.clone();
        tokio::task::spawn_blocking(move || diff(&url, &same))
            .await
            .expect("diff")
    };
    assert_eq!(err, "");
    assert_eq!((code, out.as_str()), (0, "no rule changed\n"));
    let wider = write(
        dir.path(),
        "wider.yaml",
        &SERVED.replace("burst: 20}", "burst: 30}"),
    );
    let (code, out, err) = tokio::task::spawn_blocking(move || diff(&url, &wider))
        .await
        .expect("diff");
    assert_eq!(err, "");
    assert_eq!(
        out,
        "edge.remote_address: changed: 10/second burst 20 -> 10/second burst 30: existing buckets keep their tokens and refill to 30 (not at once) (max_debt 40 -> 60: charges may take a bucket down to -60 tokens)
1 rule changed: 1 changed
"
    );
    assert_eq!(code, 3);
}

/// Runs `check-config` with `args`: (exit code, stdout, stderr).
fn check_config(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(bucket_rls_bin())
        .arg("check-config")
        .args(args)
        .output()
        .expect("run bucket-rls");
    (
        out.status.code().expect("exit code"),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A replica started with `--default-algorithm` gives its rules that name
/// no algorithm that one and states it in `/rlconfig`; the diff loads the
/// file with the same, so the file it serves diffs as unchanged without
/// `check-config --default-algorithm`, and a file the replica would refuse
/// under it (a `burst` on a rule that is a window by default) is refused.
/// An explicit `check-config --default-algorithm` still decides how NEW is
/// loaded (a planned change of the flag), with a note when it differs from
/// the replica's.
#[tokio::test]
async fn diff_against_a_replica_with_a_default_algorithm_compares_like_for_like() {
    const SERVED: &str = "domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: bucket
    rate_limit: {unit: minute, requests_per_unit: 5, burst: 8, algorithm: token_bucket}
  - key: slide
    rate_limit: {unit: hour, requests_per_unit: 100, algorithm: sliding_window}
";
    let dir = tempfile::tempdir().expect("tempdir");
    let served = tempfile::tempdir().expect("tempdir");
    let same = write(served.path(), "edge.yaml", SERVED);
    let rls = BucketRls::start(served.path(), &["--default-algorithm", "fixed_window"]).await;
    let url = format!("http://{}/rlconfig", rls.http);
    let with_burst = write(
        dir.path(),
        "burst.yaml",
        &SERVED.replace(
            "requests_per_unit: 10}",
            "requests_per_unit: 10, burst: 20}",
        ),
    );
    let runs = tokio::task::spawn_blocking(move || {
        [
            check_config(&["--diff", &url, &same]),
            check_config(&["--default-algorithm", "fixed_window", "--diff", &url, &same]),
            check_config(&[
                "--default-algorithm",
                "sliding_window",
                "--diff",
                &url,
                &same,
            ]),
            check_config(&["--diff", &url, &with_burst]),
        ]
        .map(|r| (r, url.clone()))
    })
    .await
    .expect("diff");
    let [(unchanged, _), (same_flag, _), (planned, url), (refused, _)] = runs;
    assert_eq!(
        unchanged,
        (
            0,
            "no rule changed
"
            .to_owned(),
            String::new()
        )
    );
    assert_eq!(
        same_flag,
        (
            0,
            "no rule changed
"
            .to_owned(),
            String::new()
        )
    );
    assert_eq!(
        planned,
        (
            3,
            "edge.remote_address: changed: 10/second fixed_window -> 10/second sliding_window (algorithm fixed_window -> sliding_window: every window starts at zero)
1 rule changed: 1 changed
"
            .to_owned(),
            format!("note: {url} serves with --default-algorithm fixed_window; NEW's rules that name no algorithm are compared as sliding_window (check-config --default-algorithm)\n"),
        )
    );
    let (code, out, err) = refused;
    assert_eq!((code, out.as_str()), (1, ""));
    assert!(
        err.contains("burst.yaml")
            && err.contains("by the default algorithm fixed_window (--default-algorithm)")
            && err.contains("--default-algorithm fixed_window (/rlconfig modes.default_algorithm)"),
        "{err}"
    );
}
