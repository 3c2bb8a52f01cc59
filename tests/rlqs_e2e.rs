//! End to end through real Envoy 1.40 quota filters
//! (`envoy.filters.http.rate_limit_quota`, the bootstrap of
//! `examples/envoy/rlqs/envoy.yaml` on loopback), bucket-rls as its own
//! process (memory, Redis or a Redis Cluster; one or two replicas) and an
//! upstream inside the test.
//!
//! Two groups:
//! - `envoy_client_*`: what Envoy's client does, against a scripted quota
//!   server ([`FakeQuota`]): its report cadence, what it admits before the
//!   first assignment, one token per request, the fill ratio kept on a
//!   changed assignment, the expired-assignment fallback. bucket-rls's design
//!   rests on these; if a new Envoy changes them, these fail first.
//! - the rest: several Envoys sharing one rule through bucket-rls. Rule
//!   `api_per_tenant` of `examples/envoy/rlqs/config/quota.yaml`: r = 20
//!   requests/s, burst C = 20, for the bucket `{name: api, tenant: acme}`.
//!
//! Checked over a window of T seconds that starts after every Envoy has its
//! first assignment:
//! - the bound: admitted <= C + r·T + C (the Envoys hold at most C tokens at
//!   any time and refill at most r per second together; a change of shares
//!   can mint at most C more, and the window sees about one while demand
//!   settles);
//! - no starvation: admitted >= 0.8·r·T when the offered load is at least
//!   2r, spread over the Envoys (after a demand shift onto one Envoy, the
//!   idle one keeps a part until its bucket is abandoned, 15 s or more
//!   idle: there the check is that the busy one reaches 0.75·r within
//!   three reporting intervals);
//! - no Envoy left out: no busy Envoy goes two reporting intervals (10 s)
//!   without admitting anything.
//!
//! Every test starts its own processes and takes 5 to 45 s (Envoy reports
//! every 5 s: the scenarios must span a few reports); the file fits in about
//! 90 s on two cores with the default two test threads.

mod common;

use common::cluster::RedisCluster;
use common::eventually::eventually;
use common::free_port;
use common::http::get as http_get;
use common::procs::{BucketRls, Envoy};
use common::redis::RedisServer;
use common::rlqs::{
    Answers, FakeQuota, bucket_settings, drive, example, quota_envoy, reports_received,
    start_rls_on, token_bucket, upstream,
};
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

/// The rule's rate (requests per second) and burst.
const R: f64 = 20.0;
const C: f64 = 20.0;
/// The bucket every test request falls in.
const TENANT: (&str, &str) = ("x-tenant", "acme");
/// Envoy 1.40's report period, whatever `reporting_interval` says.
const REPORT_PERIOD: Duration = Duration::from_secs(5);
/// How long a subscriber record outlives its last report (the service's
/// assignment time to live).
const RECORD_LIFETIME: Duration = Duration::from_secs(15);

/// Arguments every bucket-rls of this file gets.
const RLS_ARGS: &[&str] = &[];

/// A config directory with the example's quota.yaml.
fn config_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::copy(example("config/quota.yaml"), dir.path().join("quota.yaml"))
        .expect("copy quota.yaml");
    dir
}

/// One request with the tenant header; its status.
async fn one(envoy: &Envoy) -> u16 {
    http_get(envoy.listener, "/", &[TENANT])
        .await
        .expect("request through Envoy")
        .status
}

/// `n` requests in a row; their statuses.
async fn statuses(envoy: &Envoy, n: usize) -> Vec<u16> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(one(envoy).await);
    }
    v
}

/// Panics unless every answer was 200 or 429.
fn assert_only_200_or_429(a: &Answers, what: &str) {
    let others = a.others();
    assert!(
        others.is_empty(),
        "{what}: {} answers were neither 200 nor 429, first {:?}",
        others.len(),
        others.first()
    );
}

/// Failed checks of one scenario, reported together at its end (a
/// scenario spans several reporting intervals: one failure should not hide
/// the next).
#[derive(Default)]
struct Checks(Vec<String>);

impl Checks {
    fn check(&mut self, ok: bool, msg: impl FnOnce() -> String) {
        if !ok {
            let m = msg();
            eprintln!("CHECK FAILED: {m}");
            self.0.push(m);
        }
    }

    fn finish(self) {
        assert!(
            self.0.is_empty(),
            "{} checks failed:\n- {}",
            self.0.len(),
            self.0.join("\n- ")
        );
    }

    /// The global bound over a window of `t` seconds: admitted <= C + r·T + C.
    fn bound(&mut self, a: &Answers, t: f64, what: &str) {
        let admitted = a.admitted(None) as f64;
        let max = C + R * t + C;
        self.check(admitted <= max, || {
            format!("{what}: {admitted} admitted in {t} s, more than C + r·T + C = {max}: the Envoys do not share the limit")
        });
    }

    /// No starvation: admitted in `[from, to)` >= 0.8·r·(to - from), for a
    /// window in which the Envoys were together offered at least 2r.
    fn floor(&mut self, a: &Answers, from: Duration, to: Duration, what: &str) {
        let admitted = a.count(None, 200, from, to) as f64;
        let min = 0.8 * R * (to - from).as_secs_f64();
        self.check(admitted >= min, || {
            format!("{what}: {admitted} admitted in [{from:?}, {to:?}), less than 0.8·r·T = {min}: starved")
        });
    }

    /// None of `n` busy Envoys (each offered at least its even part of r)
    /// goes more than two reporting intervals without admitting anything in
    /// a `secs`-second run. A newcomer to a rule another Envoy holds whole
    /// gets what is left (often nothing) until that Envoy's next report
    /// gives part of it back, and its own recheck (every second while it is
    /// cut) takes it: one reporting interval and about a second; the bound
    /// checked leaves a loaded machine the rest of a second interval.
    fn each_served(&mut self, a: &Answers, n: usize, secs: u64, what: &str) {
        for i in 0..n {
            let per_second = a.admitted_per_second(Some(i), secs);
            let longest = per_second
                .split(|&x| x > 0)
                .map(<[usize]>::len)
                .max()
                .unwrap_or(0) as u64;
            self.check(longest <= 2 * REPORT_PERIOD.as_secs(), || {
                format!(
                    "{what}: Envoy {i} admitted nothing for {longest} s in a row while busy (more than two reporting intervals); per second {per_second:?}"
                )
            });
        }
    }
}

/// Prints what each of `n` Envoys admitted per second, and the totals.
fn show(a: &Answers, n: usize, secs: u64, what: &str) {
    for i in 0..n {
        eprintln!(
            "{what}: Envoy {i} admitted {} denied {}, per second {:?}",
            a.admitted(Some(i)),
            a.denied(Some(i)),
            a.admitted_per_second(Some(i), secs)
        );
    }
    eprintln!(
        "{what}: together admitted {} denied {}",
        a.admitted(None),
        a.denied(None)
    );
}

/// Opens the tenant's bucket on each Envoy (one request each: it passes,
/// by `no_assignment_behavior` ALLOW_ALL) and waits until `rls` has received
/// that many reports and a little longer for the assignments to land.
async fn open_buckets(envoys: &[&Envoy], rls: &[&BucketRls]) {
    // At the same time on every Envoy: their first reports reach the
    // service together, as when a fleet starts.
    let first = futures::future::join_all(envoys.iter().map(|e| one(e))).await;
    assert!(
        first.iter().all(|&s| s == 200),
        "the first requests pass (ALLOW_ALL): {first:?}"
    );
    let want = envoys.len() as f64;
    eventually(
        Duration::from_secs(5),
        "every Envoy's first report",
        || async {
            let mut sum = 0.0;
            for r in rls {
                sum += reports_received(r.http).await;
            }
            (sum >= want).then_some(())
        },
    )
    .await;
    // The assignment is sent in answer to the report; give it time to land.
    tokio::time::sleep(Duration::from_millis(500)).await;
}

// ---------------------------------------------------------------------------
// What Envoy 1.40's client does (scripted server).
// ---------------------------------------------------------------------------

/// Envoy reports every 5 s although `reporting_interval` says 1 s; the
/// first report of a bucket leaves right after its first request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_client_reports_every_5s_whatever_reporting_interval_says() {
    let fake = FakeQuota::start().await;
    let up = upstream().await;
    let mut b = quota_envoy(&[fake.addr], up);
    for s in bucket_settings(&mut b) {
        s["reporting_interval"] = "1s".into();
    }
    let envoy = Envoy::start(&b).await;
    let first = Instant::now();
    assert_eq!(one(&envoy).await, 200);
    // Keep the bucket busy for 12 s: two or three periodic reports.
    let load = drive(&[(envoy.listener, 4.0)], Duration::from_secs(12), &[TENANT]).await;
    assert_eq!(load.admitted(None), 48, "no assignment: everything passes");
    let reports = fake.reports();
    let times: Vec<Duration> = reports
        .iter()
        .map(|(t, _)| t.duration_since(first))
        .collect();
    eprintln!("report times after the first request: {times:?}");
    assert!(times.len() >= 3, "{times:?}");
    assert!(
        times[0] < Duration::from_millis(500),
        "the first report waits for no period: {times:?}"
    );
    for w in times[1..].windows(2) {
        let gap = w[1] - w[0];
        assert!(
            gap > Duration::from_millis(4500) && gap < Duration::from_millis(5500),
            "reports {gap:?} apart, not 5 s, with reporting_interval 1s: {times:?}"
        );
    }
    // Every report names the domain and the bucket built from the request.
    for (_, r) in &reports {
        assert_eq!(r.domain, "quota");
        let id = r.bucket_quota_usages[0]
            .bucket_id
            .as_ref()
            .expect("bucket id");
        assert_eq!(id.bucket.get("name").map(String::as_str), Some("api"));
        assert_eq!(id.bucket.get("tenant").map(String::as_str), Some("acme"));
    }
}

/// Before the first assignment every request passes (ALLOW_ALL); an
/// assignment starts full; each request costs exactly one token; a changed
/// assignment keeps the bucket's fill ratio (rounded down).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_client_allows_before_assignment_then_one_token_per_request() {
    let fake = FakeQuota::start().await;
    let up = upstream().await;
    let envoy = Envoy::start(&quota_envoy(&[fake.addr], up)).await;
    assert_eq!(
        statuses(&envoy, 10).await,
        [200; 10],
        "ALLOW_ALL until assigned"
    );
    eventually(Duration::from_secs(5), "the first report", || async {
        (!fake.reports().is_empty()).then_some(())
    })
    .await;
    // Refill 1 token per 60 s: nothing refills during the test.
    let ttl = Duration::from_secs(60);
    fake.push(&token_bucket(5, 1, 60), ttl).await;
    // Applying it takes Envoy's main thread a moment; nothing to poll
    // without spending tokens.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let s = statuses(&envoy, 8).await;
    assert_eq!(
        s,
        [200, 200, 200, 200, 200, 429, 429, 429],
        "a new assignment starts full"
    );

    // Changed assignment: max 10 from an empty bucket stays empty (ratio 0).
    fake.push(&token_bucket(10, 1, 60), ttl).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        one(&envoy).await,
        429,
        "a changed assignment keeps the fill ratio (0)"
    );
}

/// A changed assignment keeps the fill ratio: 6 of 10 moved to max 20
/// admits 12.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_client_keeps_the_fill_ratio_on_a_changed_assignment() {
    let fake = FakeQuota::start().await;
    let up = upstream().await;
    let envoy = Envoy::start(&quota_envoy(&[fake.addr], up)).await;
    let ttl = Duration::from_secs(60);
    fake.answer_with(Some((token_bucket(10, 1, 60), ttl)));
    assert_eq!(one(&envoy).await, 200, "ALLOW_ALL until assigned");
    eventually(Duration::from_secs(5), "the first report", || async {
        (!fake.reports().is_empty()).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(statuses(&envoy, 4).await, [200; 4], "4 of 10 spent");
    fake.answer_with(None);
    fake.push(&token_bucket(20, 2, 60), ttl).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let s = statuses(&envoy, 14).await;
    let admitted = s.iter().filter(|&&c| c == 200).count();
    assert_eq!(admitted, 12, "6/10 full moved to max 20 admits 12: {s:?}");
}

/// When an assignment's time to live runs out and no new one comes, Envoy
/// applies `expired_assignment_behavior`'s fallback, a token bucket of its
/// own (the example's is 10, 10 per second; 5 refilled once a minute here,
/// to count it exactly), and keeps serving: a token bucket there is safe,
/// unlike in `no_assignment_behavior`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_client_applies_the_expired_assignment_fallback() {
    let fake = FakeQuota::start().await;
    let up = upstream().await;
    let mut b = quota_envoy(&[fake.addr], up);
    for s in bucket_settings(&mut b) {
        s["expired_assignment_behavior"]["fallback_rate_limit"]["token_bucket"] =
            serde_json::json!({"max_tokens": 5, "tokens_per_fill": 1, "fill_interval": "60s"});
    }
    let mut envoy = Envoy::start(&b).await;
    // A 2 s assignment that denies everything, given once.
    fake.answer_with(Some((token_bucket(0, 0, 60), Duration::from_secs(2))));
    assert_eq!(one(&envoy).await, 200, "ALLOW_ALL until assigned");
    eventually(Duration::from_secs(5), "the first report", || async {
        (!fake.reports().is_empty()).then_some(())
    })
    .await;
    fake.answer_with(None);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(one(&envoy).await, 429, "the assignment denies");
    // After the TTL: the fallback, 5 tokens (the one that shows it spends
    // one).
    let (_, took) = eventually(
        Duration::from_secs(5),
        "the fallback after expiry",
        || async { (one(&envoy).await == 200).then_some(()) },
    )
    .await;
    eprintln!("fallback in force {took:?} after the first denial");
    assert_eq!(statuses(&envoy, 6).await, [200, 200, 200, 200, 429, 429]);
    envoy.proc.assert_running();
}

/// An assignment with time to live 0 (what a service sends when it shuts
/// down) ends the current one at once: the fallback applies, and it keeps
/// the bucket's fill ratio as a changed assignment does (10 of 20 left, a
/// fallback of 4 admits 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_client_takes_a_ttl_0_assignment_as_expired() {
    let fake = FakeQuota::start().await;
    let up = upstream().await;
    let mut b = quota_envoy(&[fake.addr], up);
    for s in bucket_settings(&mut b) {
        s["expired_assignment_behavior"]["fallback_rate_limit"]["token_bucket"] =
            serde_json::json!({"max_tokens": 4, "tokens_per_fill": 1, "fill_interval": "60s"});
    }
    let envoy = Envoy::start(&b).await;
    fake.answer_with(Some((token_bucket(20, 1, 60), Duration::from_secs(60))));
    assert_eq!(one(&envoy).await, 200, "ALLOW_ALL until assigned");
    eventually(Duration::from_secs(5), "the first report", || async {
        (!fake.reports().is_empty()).then_some(())
    })
    .await;
    fake.answer_with(None);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(statuses(&envoy, 10).await, [200; 10], "20 tokens assigned");
    fake.push(&token_bucket(20, 1, 60), Duration::ZERO).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        statuses(&envoy, 4).await,
        [200, 200, 429, 429],
        "TTL 0: the fallback (4 tokens) at once, half full as the bucket was"
    );
}

// ---------------------------------------------------------------------------
// Envoys sharing one rule through bucket-rls.
// ---------------------------------------------------------------------------

/// Two Envoys, one bucket-rls on the memory backend: together they stay
/// within the rule and are not starved, and neither is left with nothing;
/// when all demand moves to one Envoy, its share follows within three
/// reporting intervals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_envoys_share_one_limit_and_follow_a_demand_shift() {
    let dir = config_dir();
    let rls = BucketRls::start(dir.path(), RLS_ARGS).await;
    let up = upstream().await;
    let a = Envoy::start(&quota_envoy(&[rls.grpc], up)).await;
    let b = Envoy::start(&quota_envoy(&[rls.grpc], up)).await;
    open_buckets(&[&a, &b], &[&rls]).await;
    let mut c = Checks::default();
    both_busy(&mut c, &a, &b, 15, "both busy").await;

    // All demand on b (2r) for 20 s: b's share follows within three
    // reports (b admits at least 0.75·r in some second by then).
    let t2 = 20u64;
    let load = drive(
        &[(a.listener, 0.0), (b.listener, 2.0 * R)],
        Duration::from_secs(t2),
        &[TENANT],
    )
    .await;
    assert_only_200_or_429(&load, "demand on b only");
    show(&load, 2, t2, "demand on b only");
    c.bound(&load, t2 as f64, "demand on b only");
    let per_second = load.admitted_per_second(Some(1), t2);
    let within = 3 * REPORT_PERIOD.as_secs() + 1;
    let reached = per_second.iter().position(|&n| n as f64 >= 0.75 * R);
    c.check(reached.is_some_and(|s| s as u64 <= within), || {
        format!(
            "demand on b only: b reached 0.75·r per second after {reached:?} s, not within three reporting intervals ({within} s): {per_second:?}"
        )
    });
    c.finish();
}

/// Envoys `a` and `b` both offered 2r for `t` seconds: together within the
/// rule, not starved, neither left with nothing (checks into `c`).
async fn both_busy(c: &mut Checks, a: &Envoy, b: &Envoy, t: u64, what: &str) {
    let load = drive(
        &[(a.listener, 2.0 * R), (b.listener, 2.0 * R)],
        Duration::from_secs(t),
        &[TENANT],
    )
    .await;
    assert_only_200_or_429(&load, what);
    show(&load, 2, t, what);
    c.bound(&load, t as f64, what);
    c.floor(&load, Duration::ZERO, Duration::from_secs(t), what);
    c.each_served(&load, 2, t, what);
}

/// Two Envoys, each on its own bucket-rls replica, the replicas on one
/// Redis Cluster (three masters): the replicas agree on the shares through
/// the subscriber records beside the bucket in its slot, so together the
/// Envoys stay within the one rule, are not starved, and neither is left
/// with nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_envoys_on_two_replicas_with_redis_cluster_share_one_limit() {
    let cluster = tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .expect("start the cluster");
    let seeds = cluster.seeds().join(",");
    let dir = config_dir();
    let args: Vec<&str> = RLS_ARGS
        .iter()
        .copied()
        .chain(["--redis-cluster", seeds.as_str()])
        .collect();
    let r1 = BucketRls::start(dir.path(), &args).await;
    let r2 = BucketRls::start(dir.path(), &args).await;
    let up = upstream().await;
    let a = Envoy::start(&quota_envoy(&[r1.grpc], up)).await;
    let b = Envoy::start(&quota_envoy(&[r2.grpc], up)).await;
    // Half a reporting interval apart: the first Envoy's next report gives
    // part of the rule back before the second's next report asks (started
    // together, the second may wait two intervals for its part, which
    // `two_envoys_share_one_limit_and_follow_a_demand_shift` covers).
    open_buckets(&[&a], &[&r1]).await;
    tokio::time::sleep(REPORT_PERIOD / 2).await;
    open_buckets(&[&b], &[&r2]).await;
    let mut c = Checks::default();
    both_busy(&mut c, &a, &b, 12, "two replicas, Redis Cluster").await;
    c.finish();
}

/// A rule whose burst is smaller than the number of Envoys (here 20/s with
/// burst 1, two Envoys): an Envoy's part of the burst rounds to 0 tokens,
/// but an Envoy needs at least one token to admit anything, so each one with
/// a part of the rate holds one, and the rate still reaches both once the
/// shares have settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_smaller_than_the_envoy_count_still_admits_the_rate() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("quota.yaml"),
        "domain: quota\ndescriptors:\n  - key: name\n    value: api\n    descriptors:\n      - key: tenant\n        rate_limit: {unit: second, requests_per_unit: 20, burst: 1}\n",
    )
    .expect("write config");
    let rls = BucketRls::start(dir.path(), RLS_ARGS).await;
    let up = upstream().await;
    let a = Envoy::start(&quota_envoy(&[rls.grpc], up)).await;
    let b = Envoy::start(&quota_envoy(&[rls.grpc], up)).await;
    open_buckets(&[&a, &b], &[&rls]).await;
    let t = 12;
    let load = drive(
        &[(a.listener, 2.0 * R), (b.listener, 2.0 * R)],
        Duration::from_secs(t),
        &[TENANT],
    )
    .await;
    let what = "burst 1, two Envoys";
    assert_only_200_or_429(&load, what);
    show(&load, 2, t, what);
    let mut c = Checks::default();
    // Burst 1: at most 1 + r·T (+ one token per Envoy if each holds one).
    let admitted = load.admitted(None) as f64;
    c.check(admitted <= 1.0 + R * t as f64 + 2.0, || {
        format!("{what}: {admitted} admitted in {t} s, more than 1 + r·T + 2")
    });
    // Neither Envoy is left without a share (no deny-all: each holds at
    // least one token of its part of the rate) beyond the two reporting
    // intervals a newcomer waits for the holder to give part back.
    c.each_served(&load, 2, t, what);
    // How fast the two shares even out is not checked here: hysteresis can
    // keep a newcomer's cut share for several reports (an open limitation,
    // docs/design.md "Sharing by demand"); the even-demand floor is checked
    // by the two- and three-Envoy tests.
    c.finish();
}

/// Three Envoys on two bucket-rls replicas sharing one Redis (two Envoys on
/// the first replica, one on the second): the replicas agree on the shares,
/// so together the Envoys stay within the one rule and are not starved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_envoys_on_two_replicas_with_redis_share_one_limit() {
    let redis = RedisServer::start();
    let url = redis.url();
    let dir = config_dir();
    let args: Vec<&str> = RLS_ARGS
        .iter()
        .copied()
        .chain(["--redis-url", url.as_str()])
        .collect();
    let r1 = BucketRls::start(dir.path(), &args).await;
    let r2 = BucketRls::start(dir.path(), &args).await;
    let up = upstream().await;
    let e1 = Envoy::start(&quota_envoy(&[r1.grpc], up)).await;
    let e2 = Envoy::start(&quota_envoy(&[r2.grpc], up)).await;
    let e3 = Envoy::start(&quota_envoy(&[r1.grpc], up)).await;
    open_buckets(&[&e1, &e2, &e3], &[&r1, &r2]).await;
    // Offered 3r in all (r per Envoy) for 15 s.
    let t = 15.0;
    let load = drive(
        &[(e1.listener, R), (e2.listener, R), (e3.listener, R)],
        Duration::from_secs_f64(t),
        &[TENANT],
    )
    .await;
    let what = "three Envoys, two replicas, Redis";
    assert_only_200_or_429(&load, what);
    show(&load, 3, 15, what);
    let mut c = Checks::default();
    c.bound(&load, t, what);
    c.floor(&load, Duration::ZERO, Duration::from_secs_f64(t), what);
    c.each_served(&load, 3, 15, what);
    let (n1, n2) = (
        reports_received(r1.http).await,
        reports_received(r2.http).await,
    );
    c.check(n1 >= 2.0 && n2 >= 1.0, || {
        format!("reports: {n1} on the first replica (two Envoys), {n2} on the second")
    });
    c.finish();
}

/// The service is killed while an Envoy is busy: the Envoy keeps enforcing
/// its last assignment (it lives for a few reporting intervals) and keeps
/// serving; when the service is back on the same port, the Envoy reconnects
/// on its next 5 s tick and is limited again, and not starved: memory
/// backend (the restarted service knows nothing of the old stream).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_killed_and_back_memory() {
    killed_and_back(None).await;
}

/// As [`service_killed_and_back_memory`] with Redis: the killed replica's
/// subscriber record outlives it in Redis and holds its share until it
/// expires, 15 s after its last report (docs/design.md, "Quota lifecycle
/// and bounds"); once it has, the Envoy's new stream gets the share back at
/// its next report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_killed_and_back_redis() {
    let redis = RedisServer::start();
    killed_and_back(Some(&redis)).await;
}

async fn killed_and_back(redis: Option<&RedisServer>) {
    let what = if redis.is_some() { "redis" } else { "memory" };
    let dir = config_dir();
    let url = redis.map(RedisServer::url);
    let mut args: Vec<&str> = RLS_ARGS.to_vec();
    if let Some(u) = &url {
        args.extend(["--redis-url", u.as_str()]);
    }
    let grpc = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let http = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let mut rls = start_rls_on(dir.path(), grpc, http, &args).await;
    let up = upstream().await;
    let mut envoy = Envoy::start(&quota_envoy(&[grpc], up)).await;
    open_buckets(&[&envoy], &[&rls]).await;
    let busy = [(envoy.listener, 2.0 * R)];
    let mut c = Checks::default();

    let before = drive(&busy, Duration::from_secs(4), &[TENANT]).await;
    assert_only_200_or_429(&before, "before the kill");
    show(&before, 1, 4, &format!("{what}, before the kill"));
    c.bound(&before, 4.0, "before the kill");
    c.floor(
        &before,
        Duration::ZERO,
        Duration::from_secs(4),
        "before the kill",
    );

    rls.proc.kill();
    let killed = Instant::now();
    let down = drive(&busy, Duration::from_secs(4), &[TENANT]).await;
    assert_only_200_or_429(&down, "service down");
    show(&down, 1, 4, &format!("{what}, service down"));
    c.bound(&down, 4.0, "service down: the last assignment still holds");
    envoy.proc.assert_running();

    let back = Instant::now();
    let rls = start_rls_on(dir.path(), grpc, http, &args).await;
    // Keep the bucket busy while waiting: Envoy reopens the stream on its
    // next report.
    let trickle = [(envoy.listener, 5.0)];
    let waiting = drive(&trickle, Duration::from_secs(8), &[TENANT]);
    let reconnected = eventually(
        REPORT_PERIOD + Duration::from_secs(3),
        "a report on the restarted service",
        || async { (reports_received(rls.http).await >= 1.0).then_some(()) },
    );
    let (_, (_, took)) = tokio::join!(waiting, reconnected);
    eprintln!(
        "{what}: Envoy reported to the restarted service {took:?} after it was healthy ({:?} after its start)",
        back.elapsed()
    );
    // With Redis the killed replica's record holds its share until it
    // expires (15 s after its last report, at most 15 s after the kill);
    // the new stream gets the share at its first report after that.
    let settled = if redis.is_some() {
        killed + RECORD_LIFETIME + REPORT_PERIOD + Duration::from_secs(1)
    } else {
        Instant::now()
    };
    tokio::time::sleep_until(settled.max(Instant::now()).into()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = drive(&busy, Duration::from_secs(5), &[TENANT]).await;
    assert_only_200_or_429(&after, "after the service came back");
    show(
        &after,
        1,
        5,
        &format!("{what}, after the service came back"),
    );
    c.bound(&after, 5.0, "after the service came back");
    c.floor(
        &after,
        Duration::ZERO,
        Duration::from_secs(5),
        "after the service came back",
    );
    envoy.proc.assert_running();
    c.finish();
}

/// On SIGTERM the service ends its assignments (time to live 0) before it
/// closes: the Envoy switches to its `expired_assignment_behavior` fallback
/// at once instead of enforcing a share nobody keeps for up to 15 s. The
/// fallback here is 3 tokens refilled once a minute, so it is told apart from
/// the share (20 tokens).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_sends_envoy_to_its_fallback_at_once() {
    let dir = config_dir();
    let mut rls = BucketRls::start(dir.path(), RLS_ARGS).await;
    let up = upstream().await;
    let mut b = quota_envoy(&[rls.grpc], up);
    for s in bucket_settings(&mut b) {
        s["expired_assignment_behavior"]["fallback_rate_limit"]["token_bucket"] =
            serde_json::json!({"max_tokens": 3, "tokens_per_fill": 1, "fill_interval": "60s"});
    }
    let envoy = Envoy::start(&b).await;
    open_buckets(&[&envoy], &[&rls]).await;
    let s = statuses(&envoy, 6).await;
    assert_eq!(s, [200; 6], "the share (burst 20) admits 6 in a row");
    // Refilled (20 a second) before the switch: the fallback keeps the
    // bucket's fill ratio, so it starts full too.
    tokio::time::sleep(Duration::from_secs(1)).await;
    rls.proc.terminate(Duration::from_secs(10));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let s = statuses(&envoy, 6).await;
    assert_eq!(
        s,
        [200, 200, 200, 429, 429, 429],
        "after SIGTERM the Envoy applies its fallback (3 tokens) at once"
    );
}

/// The service receives one report message per Envoy per 5 s, whatever the
/// request rate: 5 requests/s and 100 requests/s for 10 s each cost it the
/// same number of messages (`bucket_rls_rlqs_reports_total`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_messages_do_not_grow_with_the_request_rate() {
    let dir = config_dir();
    let rls = BucketRls::start(dir.path(), RLS_ARGS).await;
    let up = upstream().await;
    let envoy = Envoy::start(&quota_envoy(&[rls.grpc], up)).await;
    open_buckets(&[&envoy], &[&rls]).await;
    let c0 = reports_received(rls.http).await;
    let slow = drive(&[(envoy.listener, 5.0)], Duration::from_secs(10), &[TENANT]).await;
    let c1 = reports_received(rls.http).await;
    let fast = drive(
        &[(envoy.listener, 100.0)],
        Duration::from_secs(10),
        &[TENANT],
    )
    .await;
    let c2 = reports_received(rls.http).await;
    assert_only_200_or_429(&slow, "slow");
    assert_only_200_or_429(&fast, "fast");
    let (n_slow, n_fast) = (c1 - c0, c2 - c1);
    eprintln!(
        "reports: {n_slow} for {} requests, {n_fast} for {} requests",
        slow.0.len(),
        fast.0.len()
    );
    assert!(
        (1.0..=3.0).contains(&n_slow) && (1.0..=3.0).contains(&n_fast),
        "one report per 5 s: {n_slow} in 10 s at 5/s, {n_fast} in 10 s at 100/s"
    );
    assert!(
        n_fast <= n_slow + 1.0,
        "{n_fast} reports at 100/s against {n_slow} at 5/s"
    );
}
