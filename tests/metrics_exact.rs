//! Exact metric values (docs/cases.md, "Shadow mode" and "Unknown and
//! malformed domains"), read from the Prometheus text of the process-wide
//! recorder.
//!
//! Metrics are process-global: every test here uses its own domain names, and
//! only `unknown_domain_*` sends malformed requests, so values are exact even
//! though the tests of this binary run in parallel.

mod common;

use bucket_rls::grpc::ShouldRateLimit as _;
use bucket_rls::limiter::{Limiter, MAX_DOMAIN_LABELS};
use bucket_rls::metrics as m;
use bucket_rls::storage::clock::ManualClock;
use bucket_rls::storage::memory::MemoryStorage;
use common::metrics::{metric, scrape};
use common::{desc, desc_hits, limiter, req};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use std::io::Write;
use std::sync::Arc;

/// Tests that emit or capture log lines run one at a time: `tracing` caches
/// whether a call site is enabled, and a thread without the capturing
/// subscriber hitting the same call site concurrently can make the capture
/// miss it.
static LOGGING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Captures this thread's log lines as text, and recomputes every call site's
/// interest so sites first seen without the capture are enabled for it.
fn capture_logs() -> (Captured, tracing::subscriber::DefaultGuard) {
    let logs = Captured::default();
    let sink = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || sink.clone())
        .with_ansi(false)
        .finish();
    let guard = tracing::subscriber::set_default(subscriber);
    tracing::callsite::rebuild_interest_cache();
    (logs, guard)
}

/// A memory backend on a paused clock; also installs the recorder, which must
/// exist before the first metric is recorded.
fn paused_memory() -> Arc<MemoryStorage> {
    bucket_rls::metrics::install();
    Arc::new(MemoryStorage::new(Arc::new(ManualClock::new(1_000_000))))
}

const SM: &str = "domain: sm
descriptors:
  - key: user
    value: bob
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: route
    value: r1
    rate_limit: {unit: minute, requests_per_unit: 3}
";

#[tokio::test]
async fn shadow_mode_counts_exactly() {
    let l = limiter(SM, paused_memory(), "br11:");
    let r = |rule: &str| vec![("rule", rule.to_owned())];
    let value = |name: &str, rule: &str| {
        let labels = r(rule);
        let labels: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
        metric(&scrape(), name, &labels).unwrap_or(0.0)
    };
    // (overall, shadow status (code, remaining), route status (code, remaining))
    let expected = [
        (Code::Ok, (Code::Ok, 1), (Code::Ok, 2)),
        (Code::Ok, (Code::Ok, 0), (Code::Ok, 1)),
        (Code::Ok, (Code::Ok, 0), (Code::Ok, 0)),
        (Code::OverLimit, (Code::Ok, 0), (Code::OverLimit, 0)),
    ];
    // Metrics after each call: shadow_mode(bob), over_limit(bob), over_limit(r1), within_limit(r1).
    let metrics_after = [
        (0., 0., 0., 1.),
        (0., 0., 0., 2.),
        (1., 1., 0., 3.),
        (2., 2., 1., 3.),
    ];
    for (i, (exp, after)) in expected.iter().zip(metrics_after).enumerate() {
        let resp = l
            .should_rate_limit(&req(
                "sm",
                vec![desc(&[("user", "bob")]), desc(&[("route", "r1")])],
                1,
            ))
            .await
            .unwrap();
        let s = &resp.statuses;
        assert_eq!(resp.overall_code, exp.0 as i32, "call {}", i + 1);
        assert_eq!(
            (s[0].code, s[0].limit_remaining),
            (exp.1.0 as i32, exp.1.1),
            "call {}",
            i + 1
        );
        assert_eq!(
            (s[1].code, s[1].limit_remaining),
            (exp.2.0 as i32, exp.2.1),
            "call {}",
            i + 1
        );
        if i == 2 {
            let d = s[0].duration_until_reset.as_ref().expect("shadow duration");
            assert!(d.seconds >= 1);
        }
        let got = (
            value(m::SHADOW_MODE, "sm.user_bob"),
            value(m::OVER_LIMIT, "sm.user_bob"),
            value(m::OVER_LIMIT, "sm.route_r1"),
            value(m::WITHIN_LIMIT, "sm.route_r1"),
        );
        assert_eq!(got, after, "metrics after call {}", i + 1);
    }
    assert_eq!(value(m::TOTAL_HITS, "sm.user_bob"), 4.0);
    assert_eq!(value(m::TOTAL_HITS, "sm.route_r1"), 4.0);
    assert_eq!(value(m::WITHIN_LIMIT, "sm.user_bob"), 2.0);
    // Requests by outcome: the shadow rule refused two (let through), the
    // enforced rule one.
    let requests = |rule: &str, outcome: &str| {
        metric(
            &scrape(),
            m::RULE_REQUESTS,
            &[("rule", rule), ("outcome", outcome)],
        )
    };
    assert_eq!(requests("sm.user_bob", "ok"), Some(2.0));
    assert_eq!(requests("sm.user_bob", "shadow_over_limit"), Some(2.0));
    assert_eq!(requests("sm.user_bob", "over_limit"), None);
    assert_eq!(requests("sm.route_r1", "ok"), Some(3.0));
    assert_eq!(requests("sm.route_r1", "over_limit"), Some(1.0));
}

/// A token budget: the hit counters count tokens, the request counter
/// counts requests. A 0-cost check, a 120,000-token charge taken into debt,
/// a refused check and a 5,000-token charge: three refusals and 125,000
/// tokens taken, one admitted check.
#[tokio::test]
async fn token_budgets_count_requests_and_tokens_apart() {
    let l = limiter(
        "domain: budget\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 1000, max_debt: 200000}\n",
        paused_memory(),
        "budget:",
    );
    for (cost, want) in [
        (0, Code::Ok),
        (120_000, Code::OverLimit),
        (0, Code::OverLimit),
        (5_000, Code::OverLimit),
    ] {
        let r = l
            .should_rate_limit(&req("budget", vec![desc_hits(&[("user", "ann")], cost)], 1))
            .await
            .unwrap();
        assert_eq!(r.overall_code, want as i32, "cost {cost}");
    }
    let text = scrape();
    let requests = |outcome| {
        metric(
            &text,
            m::RULE_REQUESTS,
            &[("rule", "budget.user"), ("outcome", outcome)],
        )
    };
    assert_eq!(requests("ok"), Some(1.0));
    assert_eq!(requests("over_limit"), Some(3.0));
    let hits = |name| metric(&text, name, &[("rule", "budget.user")]);
    assert_eq!(hits(m::OVER_LIMIT), Some(125_000.0));
    assert_eq!(hits(m::TOTAL_HITS), Some(125_000.0));
}

/// A `tracing` writer that keeps everything written, for counting log lines.
#[derive(Clone, Default)]
struct Captured(Arc<parking_lot::Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn unknown_domain_counted_warned_once_and_malformed_rejected() {
    let _serial = LOGGING.blocking_lock();
    let (logs, _guard) = capture_logs();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let l = limiter(
            "domain: api\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: minute, requests_per_unit: 10}\n",
            paused_memory(),
            "br32:",
        );
        let dnf = || metric(&scrape(), m::DOMAIN_NOT_FOUND, &[("domain", "ambassador")]).unwrap_or(0.0);
        let invalid = || {
            metric(&scrape(), m::SERVICE_ERROR, &[("kind", "invalid_argument")]).unwrap_or(0.0)
        };
        // 1. Unknown domain x100: OK with no limit, counted 100 times, warned once.
        for _ in 0..100 {
            let r = l
                .should_rate_limit(&req("ambassador", vec![desc(&[("remote_address", "10.0.0.9")])], 1))
                .await
                .unwrap();
            assert_eq!(r.overall_code, Code::Ok as i32);
            assert!(r.statuses[0].current_limit.is_none());
        }
        assert_eq!(dnf(), 100.0);
        let text = String::from_utf8(logs.0.lock().clone()).unwrap();
        let warnings = text.lines().filter(|l| l.contains("unknown domain") && l.contains("ambassador")).count();
        assert_eq!(warnings, 1, "one warning per domain per minute:\n{text}");
        // A client-chosen domain is logged clipped, control characters as
        // `_`: no forged line, no terminal escape reaches the log.
        let forged = "evil\n2026-11-29T00:00:00Z ERROR bucket_rls: FORGED\u{1b}[31m";
        l.should_rate_limit(&req(forged, vec![desc(&[("remote_address", "1")])], 1))
            .await
            .unwrap();
        let text = String::from_utf8(logs.0.lock().clone()).unwrap();
        assert!(!text.lines().any(|l| l.starts_with("2026-11-29T00:00:00Z")), "{text}");
        assert!(!text.contains('\u{1b}'), "{text}");
        assert!(text.contains("domain=evil_2026"), "{text}");

        // 2. and 3. Malformed: INVALID_ARGUMENT with the message, service_error +2.
        let before = invalid();
        let e = l
            .should_rate_limit(&req("", vec![desc(&[("remote_address", "10.0.0.9")])], 1))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert_eq!(e.message(), "domain must not be empty");
        let e = l.should_rate_limit(&req("api", vec![], 1)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert_eq!(e.message(), "descriptor list must not be empty");
        assert_eq!(invalid() - before, 2.0);

        // 4. One descriptor with zero entries: OK, no limit, not an error.
        let r = l.should_rate_limit(&req("api", vec![desc(&[])], 1)).await.unwrap();
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert!(r.statuses[0].current_limit.is_none());
        assert_eq!(invalid() - before, 2.0);
        assert_eq!(dnf(), 100.0, "a known domain is not counted");
    });
}

#[tokio::test]
async fn unknown_domain_label_set_is_capped() {
    let _serial = LOGGING.lock().await;
    let l: Arc<Limiter> = limiter("domain: capped\ndescriptors: []\n", paused_memory(), "cap:");
    let extra = 50;
    for i in 0..MAX_DOMAIN_LABELS + extra {
        let domain = format!("cap-{i}");
        for _ in 0..2 {
            l.should_rate_limit(&req(&domain, vec![desc(&[("k", "v")])], 1))
                .await
                .unwrap();
        }
    }
    let text = scrape();
    let labelled = text
        .lines()
        .filter(|l| l.starts_with(m::DOMAIN_NOT_FOUND) && l.contains("domain=\"cap-"))
        .count();
    assert_eq!(
        labelled, MAX_DOMAIN_LABELS,
        "first {MAX_DOMAIN_LABELS} domains get a label"
    );
    assert_eq!(
        metric(&text, m::DOMAIN_NOT_FOUND, &[("domain", "cap-0")]),
        Some(2.0)
    );
    assert_eq!(
        metric(
            &text,
            m::DOMAIN_NOT_FOUND,
            &[("domain", &format!("cap-{MAX_DOMAIN_LABELS}"))]
        ),
        None
    );
    assert_eq!(
        metric(&text, m::DOMAIN_NOT_FOUND, &[("domain", "other")]),
        Some(2.0 * extra as f64),
        "later domains share `other`"
    );
}

/// A backend that is down.
#[derive(Debug)]
struct Down;

#[async_trait::async_trait]
impl bucket_rls::storage::Storage for Down {
    async fn apply(
        &self,
        _: &[bucket_rls::storage::Charge],
    ) -> Result<bucket_rls::storage::RequestResult, bucket_rls::storage::StorageError> {
        Err(bucket_rls::storage::StorageError::unreachable(
            "connection refused",
        ))
    }
    async fn ping(&self) -> Result<(), bucket_rls::storage::StorageError> {
        Ok(())
    }
    fn name(&self) -> &'static str {
        "down"
    }
}

#[test]
fn storage_errors_counted_each_logged_at_most_once_per_second() {
    let _serial = LOGGING.blocking_lock();
    bucket_rls::metrics::install();
    let (logs, _guard) = capture_logs();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let l = limiter(
            "domain: down\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 10}\n",
            Arc::new(Down),
            "down:",
        );
        let errors = || {
            metric(&scrape(), m::STORAGE_ERRORS, &[("kind", "unreachable")]).unwrap_or(0.0)
        };
        let service = || metric(&scrape(), m::SERVICE_ERROR, &[("kind", "storage")]).unwrap_or(0.0);
        let (e0, s0) = (errors(), service());
        for _ in 0..50 {
            let e = l
                .should_rate_limit(&req("down", vec![desc(&[("k", "v")])], 1))
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unavailable);
        }
        assert_eq!(errors() - e0, 50.0);
        assert_eq!(service() - s0, 50.0);
        let text = String::from_utf8(logs.0.lock().clone()).unwrap();
        let lines = text.lines().filter(|l| l.contains("storage call failed")).count();
        assert_eq!(lines, 1, "{text}");
    });
}

#[tokio::test]
async fn near_limit_counts_hits_past_the_ratio() {
    let l = limiter(
        "domain: near\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 10}\n",
        paused_memory(),
        "near:",
    );
    for _ in 0..11 {
        l.should_rate_limit(&req("near", vec![desc(&[("k", "v")])], 1))
            .await
            .unwrap();
    }
    let text = scrape();
    let v = |name| metric(&text, name, &[("rule", "near.k")]);
    // Ratio 0.8 of 10: the 9th and 10th admitted hits are near the limit.
    assert_eq!(v(m::NEAR_LIMIT), Some(2.0));
    assert_eq!(v(m::WITHIN_LIMIT), Some(10.0));
    assert_eq!(v(m::OVER_LIMIT), Some(1.0));
    assert_eq!(v(m::TOTAL_HITS), Some(11.0));
}

/// A `hits_addend` near u64::MAX counts u32::MAX hits per request, so two
/// such requests cannot wrap a counter (Prometheus would read the drop as a
/// counter reset).
#[tokio::test]
async fn huge_hits_addend_cannot_wrap_counters() {
    let l = limiter(
        "domain: huge\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 10}\n",
        paused_memory(),
        "huge:",
    );
    for _ in 0..2 {
        let r = l
            .should_rate_limit(&req("huge", vec![desc_hits(&[("k", "v")], u64::MAX)], 1))
            .await
            .unwrap();
        assert_eq!(r.overall_code, Code::OverLimit as i32);
    }
    let text = scrape();
    let v = |name| metric(&text, name, &[("rule", "huge.k")]);
    let want = 2.0 * f64::from(u32::MAX);
    assert_eq!(v(m::TOTAL_HITS), Some(want));
    assert_eq!(v(m::OVER_LIMIT), Some(want));
}

/// `value_to_metric`: on wildcard and key-only levels the label carries the
/// request's value (the Go service's rule), and with `share_threshold` the
/// pattern stays.
#[tokio::test]
async fn value_to_metric_labels_carry_the_request_values() {
    let yaml = "domain: vtm
descriptors:
  - key: route
    value: api/*
    value_to_metric: true
    descriptors:
      - key: method
        value_to_metric: true
        rate_limit: {unit: minute, requests_per_unit: 60}
  - key: shared
    value: s/*
    share_threshold: true
    value_to_metric: true
    descriptors:
      - key: method
        rate_limit: {unit: minute, requests_per_unit: 60}
  - key: plain
    value: p/*
    descriptors:
      - key: method
        value: GET
        value_to_metric: true
        rate_limit: {unit: minute, requests_per_unit: 60}
";
    let l = limiter(yaml, paused_memory(), "vtm:");
    for entries in [
        [("route", "api/users"), ("method", "POST")],
        [("shared", "s/x"), ("method", "PUT")],
        [("plain", "p/y"), ("method", "GET")],
    ] {
        l.should_rate_limit(&req("vtm", vec![desc(&entries)], 1))
            .await
            .unwrap();
    }
    let text = scrape();
    for rule in [
        "vtm.route_api/users.method_POST",
        "vtm.shared_s/*.method",
        "vtm.plain_p/*.method_GET",
    ] {
        assert_eq!(
            metric(&text, m::TOTAL_HITS, &[("rule", rule)]),
            Some(1.0),
            "{rule} in\n{text}"
        );
    }
}

/// The reservation counters (docs/design.md, "Reservations") count each
/// outcome exactly; a reserve refused at `max_open` is logged once per
/// interval whatever the number of refusals.
#[test]
fn reservation_outcomes_counted_and_refusals_logged_once() {
    let _serial = LOGGING.blocking_lock();
    bucket_rls::metrics::install();
    let (logs, _guard) = capture_logs();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let clock = ManualClock::new(1_000_000);
        let storage = Arc::new(MemoryStorage::new(Arc::new(clock.clone())));
        let l = limiter(
            "domain: res\ndescriptors:\n  - key: user\n    descriptors:\n      - key: id\n        reservation: {ttl_seconds: 10, max_open: 2}\n        rate_limit: {unit: hour, requests_per_unit: 1000}\n",
            storage,
            "res:",
        );
        let call = |id: &'static str, settle: bool, cost: u64| {
            let l = l.clone();
            async move {
                let mut entries = vec![("user", "u"), ("id", id)];
                if settle {
                    entries.push(("phase", "settle"));
                }
                l.should_rate_limit(&req("res", vec![desc_hits(&entries, cost)], 0))
                    .await
                    .expect("answer")
                    .overall_code
            }
        };
        let names = [
            m::RESERVATIONS_OPENED,
            m::RESERVATIONS_ADDED,
            m::RESERVATIONS_SETTLED,
            m::SETTLEMENTS_UNMATCHED,
            m::RESERVATIONS_REFUSED,
            m::RESERVATIONS_EXPIRED,
        ];
        let counts = || {
            let text = scrape();
            names.map(|n| metric(&text, n, &[]).unwrap_or(0.0))
        };
        let before = counts();
        assert_eq!(call("a", false, 10).await, Code::Ok as i32);
        assert_eq!(call("a", false, 10).await, Code::Ok as i32);
        assert_eq!(call("a", true, 15).await, Code::Ok as i32);
        assert_eq!(call("a", true, 15).await, Code::Ok as i32);
        assert_eq!(call("b", false, 10).await, Code::Ok as i32);
        assert_eq!(call("c", false, 10).await, Code::Ok as i32);
        // b and c open: d and e are refused.
        assert_eq!(call("d", false, 10).await, Code::OverLimit as i32);
        assert_eq!(call("e", false, 10).await, Code::OverLimit as i32);
        // After the TTL: d finds both expired and drops them.
        clock.advance(std::time::Duration::from_secs(11));
        assert_eq!(call("d", false, 10).await, Code::Ok as i32);
        let after = counts();
        let delta: Vec<f64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
        // opened a, b, c, d; added a; settled a; a again unmatched;
        // refused d, e; expired b, c.
        assert_eq!(delta, vec![4.0, 1.0, 1.0, 1.0, 2.0, 2.0]);
        let text = String::from_utf8(logs.0.lock().clone()).unwrap();
        assert_eq!(text.matches("reservation refused").count(), 1, "{text}");
    });
}
