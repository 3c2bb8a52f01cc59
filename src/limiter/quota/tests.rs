use super::*;
use crate::config::compile::compile_texts;
use crate::settings::ServiceSettings;
use crate::storage::clock::ManualClock;
use crate::storage::key::{self, KeyValue};
use crate::storage::memory::MemoryStorage;
use crate::storage::quota::Held;
use crate::storage::{BucketLimit, Charge, Limit, Storage};

const YAML: &str = "
domain: edge
descriptors:
  - key: tenant
    value: acme
    rate_limit: { unit: second, requests_per_unit: 100 }
    descriptors:
      - key: route
        rate_limit: { unit: minute, requests_per_unit: 6000 }
  - key: free
    rate_limit: { unlimited: true }
  - key: blocked
    rate_limit: { unit: second, requests_per_unit: 0 }
";

fn setup(settings: ServiceSettings) -> (Arc<Limiter>, ManualClock, Arc<MemoryStorage>) {
    let config = compile_texts(&[("t.yaml".into(), YAML.as_bytes().to_vec())]).expect("config");
    let clock = ManualClock::new(1_000_000_000);
    let storage = Arc::new(MemoryStorage::new(Arc::new(clock.clone())));
    let limiter =
        Limiter::new(config, storage.clone(), settings).with_quota_clock(Arc::new(clock.clone()));
    (Arc::new(limiter), clock, storage)
}

fn usage<'a>(bucket: &'a [(&'a str, &'a str)], allowed: u64, denied: u64) -> Usage<'a> {
    Usage {
        bucket,
        allowed,
        denied,
    }
}

fn action(a: &BucketAnswer) -> Action {
    match a.answer {
        Answer::Assign { action, .. } => action,
        Answer::Abandon => panic!("abandoned: {a:?}"),
    }
}

#[tokio::test]
async fn blanket_rules_and_bad_input() {
    let (l, _, _) = setup(ServiceSettings::default());
    let mut s = l.quota_stream("edge").expect("bound");
    let got = s
        .report(&[
            usage(&[("nothing", "x")], 1, 0),
            usage(&[("free", "x")], 1, 0),
            usage(&[("blocked", "x")], 1, 0),
        ])
        .await
        .expect("answered");
    let actions: Vec<Action> = got.iter().map(action).collect();
    assert_eq!(
        actions,
        [Action::AllowAll, Action::AllowAll, Action::DenyAll]
    );
    assert!(matches!(
        s.report(&[usage(&[], 1, 0)]).await,
        Err(QuotaError::Invalid(m)) if m.contains("no entries")
    ));
    assert!(matches!(
        s.report(&[usage(&[("", "v")], 1, 0)]).await,
        Err(QuotaError::Invalid(m)) if m.contains("empty key")
    ));
    let long = "v".repeat(257);
    assert!(matches!(
        s.report(&[usage(&[("k", &long)], 1, 0)]).await,
        Err(QuotaError::Invalid(_))
    ));
    assert!(matches!(l.quota_stream(""), Err(QuotaError::Invalid(_))));

    let (l, _, _) = setup(ServiceSettings {
        rlqs_deny_unmatched: true,
        ..ServiceSettings::default()
    });
    let mut s = l.quota_stream("edge").expect("bound");
    let got = s
        .report(&[usage(&[("nothing", "x")], 1, 0)])
        .await
        .expect("answered");
    assert_eq!(action(&got[0]), Action::DenyAll);
    // An unknown domain: every bucket unmatched.
    let mut s = l.quota_stream("other").expect("bound");
    let got = s
        .report(&[usage(&[("tenant", "acme")], 1, 0)])
        .await
        .expect("answered");
    assert_eq!(action(&got[0]), Action::DenyAll);
}

/// The bucket id in any order reaches the rule the tree orders it by, and
/// its bucket is the one ShouldRateLimit charges for that descriptor.
#[tokio::test]
async fn one_rule_two_protocols_share_a_bucket() {
    let (l, _, storage) = setup(ServiceSettings::default());
    let mut s = l.quota_stream("edge").expect("bound");
    let got = s
        .report(&[usage(&[("route", "/a"), ("tenant", "acme")], 40, 0)])
        .await
        .expect("answered");
    // 6000/min: r = 100/s, F = 1 s; one subscriber holds it all.
    assert_eq!(
        action(&got[0]),
        Action::TokenBucket {
            max_tokens: 6000,
            tokens_per_fill: 100,
            fill_interval_secs: 1
        }
    );
    let key = key::encode(
        "rls:",
        "edge",
        &[
            ("tenant", KeyValue::Value("acme")),
            ("route", KeyValue::Value("/a")),
        ],
    );
    // The 40 allowed were charged to that bucket.
    let probe = Charge {
        key,
        spec: ChargeSpec {
            limit: Limit::TokenBucket(BucketLimit {
                requests_per_unit: 6000,
                unit_secs: std::num::NonZeroU64::new(60).expect("minute"),
                burst: 6000,
                max_debt: 0,
            }),
            cost: 0,
            kind: ChargeKind::Consume,
            shadow: false,
        },
    };
    let r = storage.apply(&[probe]).await.expect("memory");
    assert_eq!(r.charges[0].remaining_micro, 5960 * 1_000_000);
}

/// Two streams of domain `edge` that have each reported `tenant=acme`
/// once (100/s: F = 1 s, 100 tokens a fill, burst 100).
async fn two_streams_on_acme() -> (Arc<Limiter>, ManualClock, QuotaStream, QuotaStream) {
    let (l, clock, _) = setup(ServiceSettings::default());
    let mut a = l.quota_stream("edge").expect("bound");
    let mut b = l.quota_stream("edge").expect("bound");
    let id: &[(&str, &str)] = &[("tenant", "acme")];
    a.report(&[usage(id, 1, 0)]).await.expect("a");
    b.report(&[usage(id, 1, 0)]).await.expect("b");
    (l, clock, a, b)
}

#[tokio::test]
async fn two_subscribers_share_by_demand() {
    let (l, clock, mut a, mut b) = two_streams_on_acme().await;
    let id: &[(&str, &str)] = &[("tenant", "acme")];
    let mut last = (None, None);
    for _ in 0..6 {
        clock.advance(REPORT_INTERVAL);
        let ga = a.report(&[usage(id, 450, 500)]).await.expect("a");
        let gb = b.report(&[usage(id, 1, 0)]).await.expect("b");
        last = (Some(action(&ga[0])), Some(action(&gb[0])));
    }
    let (
        Some(Action::TokenBucket {
            tokens_per_fill: ta,
            max_tokens: ma,
            ..
        }),
        Some(Action::TokenBucket {
            tokens_per_fill: tb,
            max_tokens: mb,
            ..
        }),
    ) = last
    else {
        panic!("token buckets: {last:?}");
    };
    assert!(ta + tb <= 100 && ma + mb <= 100, "{last:?}");
    // The idle one keeps only its floor; the busy one gets the rest.
    assert!(ta >= 90 && tb <= 6, "{last:?}");
    let view = l.quotas().view();
    assert_eq!(view.len(), 2);
    assert_eq!(view[0].buckets["tenant=acme"].subscribers.len(), 2);
}

/// A busy Envoy holds the whole rule (100/s); a second one reports its first
/// request. It is cut to what the holder leaves (nothing) and waits; at the
/// holder's next report the newcomer's unmeasured demand counts as the
/// holder's, so the holder shrinks to half; the newcomer's recheck, before
/// its own next report, then gets the other half.
#[tokio::test]
async fn a_newcomer_gets_its_part_at_a_recheck_after_the_holder_shrinks() {
    let (l, clock, _) = setup(ServiceSettings::default());
    let id: &[(&str, &str)] = &[("tenant", "acme")];
    let mut a = l.quota_stream("edge").expect("bound");
    a.report(&[usage(id, 1, 0)]).await.expect("a");
    for _ in 0..2 {
        clock.advance(REPORT_INTERVAL);
        a.report(&[usage(id, 450, 500)]).await.expect("a");
    }
    assert!(!a.waiting());
    let mut b = l.quota_stream("edge").expect("bound");
    let first = b.report(&[usage(id, 1, 0)]).await.expect("b");
    assert_eq!(action(&first[0]), Action::DenyAll);
    assert!(b.waiting(), "cut below its part, b checks again");
    // Nothing moved yet: the recheck answers nothing.
    assert!(b.recheck().await.expect("recheck").is_empty());
    assert!(b.waiting());
    clock.advance(REPORT_INTERVAL);
    let shrunk = a.report(&[usage(id, 450, 500)]).await.expect("a");
    let Action::TokenBucket {
        tokens_per_fill: ta,
        ..
    } = action(&shrunk[0])
    else {
        panic!("{shrunk:?}");
    };
    assert_eq!(
        ta, 50,
        "the newcomer counts as asking as much as the holder"
    );
    let grown = b.recheck().await.expect("recheck");
    assert_eq!(grown.len(), 1, "{grown:?}");
    let Action::TokenBucket {
        tokens_per_fill: tb,
        max_tokens: mb,
        ..
    } = action(&grown[0])
    else {
        panic!("{grown:?}");
    };
    assert_eq!((tb, mb), (50, 50));
    assert!(!b.waiting());
    assert!(b.recheck().await.expect("recheck").is_empty());
}

#[tokio::test]
async fn idle_buckets_are_abandoned_and_shutdown_expires_all() {
    let (l, clock, _) = setup(ServiceSettings::default());
    let mut s = l.quota_stream("edge").expect("bound");
    let id: &[(&str, &str)] = &[("tenant", "acme")];
    s.report(&[usage(id, 3, 0)]).await.expect("answered");
    assert_eq!(s.expire_all().len(), 1);
    assert!(matches!(
        s.expire_all()[0].answer,
        Answer::Assign { ttl, .. } if ttl.is_zero()
    ));
    for _ in 0..2 {
        clock.advance(REPORT_INTERVAL);
        let got = s.report(&[usage(id, 0, 0)]).await.expect("answered");
        assert!(matches!(got[0].answer, Answer::Assign { .. }));
    }
    clock.advance(REPORT_INTERVAL);
    let got = s.report(&[usage(id, 0, 0)]).await.expect("answered");
    assert_eq!(got[0].answer, Answer::Abandon);
    assert_eq!(s.buckets(), 0);
    assert!(s.expire_all().is_empty());
}

/// The number of subscriber records storage holds for the bucket of
/// `tenant=acme` (read through a report of a probe subscriber that leaves).
async fn records_of_acme(l: &Arc<Limiter>) -> usize {
    let mut probe = l.quota_stream("edge").expect("bound");
    let got = probe
        .report(&[usage(&[("tenant", "acme")], 0, 0)])
        .await
        .expect("answered");
    assert!(matches!(got[0].answer, Answer::Assign { .. }));
    let n = probe.view.lock().buckets["tenant=acme"].subscribers.len();
    probe.leave().await.expect("left");
    n - 1
}

#[tokio::test]
async fn a_stream_that_leaves_frees_its_share_at_once() {
    let (l, clock, mut a, mut b) = two_streams_on_acme().await;
    let id: &[(&str, &str)] = &[("tenant", "acme")];
    for _ in 0..4 {
        clock.advance(REPORT_INTERVAL);
        a.report(&[usage(id, 450, 0)]).await.expect("a");
        b.report(&[usage(id, 5, 0)]).await.expect("b");
    }
    assert_eq!(records_of_acme(&l).await, 2);
    a.leave().await.expect("left");
    assert_eq!(records_of_acme(&l).await, 1);
    // Long before a's record would have expired, b's demand rises and it
    // gets the whole rule.
    clock.advance(REPORT_INTERVAL);
    b.report(&[usage(id, 450, 0)]).await.expect("b");
    clock.advance(REPORT_INTERVAL);
    let got = b.report(&[usage(id, 450, 0)]).await.expect("b");
    assert!(
        matches!(
            action(&got[0]),
            Action::TokenBucket {
                tokens_per_fill: 100,
                max_tokens: 100,
                ..
            }
        ),
        "{got:?}"
    );
}

#[tokio::test]
async fn an_abandoned_bucket_leaves_its_record() {
    let (l, clock, _) = setup(ServiceSettings::default());
    let mut s = l.quota_stream("edge").expect("bound");
    let id: &[(&str, &str)] = &[("tenant", "acme")];
    s.report(&[usage(id, 3, 0)]).await.expect("answered");
    assert_eq!(records_of_acme(&l).await, 1);
    for _ in 0..3 {
        clock.advance(REPORT_INTERVAL);
        s.report(&[usage(id, 0, 0)]).await.expect("answered");
    }
    assert_eq!(s.buckets(), 0, "abandoned");
    assert_eq!(records_of_acme(&l).await, 0);
}

#[tokio::test]
async fn bucket_bound_per_stream() {
    let (l, _, _) = setup(ServiceSettings::default());
    let mut s = l.quota_stream("edge").expect("bound");
    let values: Vec<String> = (0..=Bounds::DEFAULT.max_buckets)
        .map(|i| i.to_string())
        .collect();
    let ids: Vec<[(&str, &str); 1]> = values.iter().map(|v| [("user", v.as_str())]).collect();
    let usages: Vec<Usage<'_>> = ids.iter().map(|id| usage(id, 1, 0)).collect();
    assert!(matches!(
        s.report(&usages[..Bounds::DEFAULT.max_buckets]).await,
        Ok(v) if v.len() == Bounds::DEFAULT.max_buckets
    ));
    assert!(matches!(
        s.report(&usages).await,
        Err(QuotaError::Invalid(m)) if m.contains("more than 1000 buckets")
    ));
}

/// A backend that holds the first recording call (a report charging
/// nothing) until told to go on: another stream's report lands between a
/// stream's read of the records and its recording of the new assignment.
#[derive(Debug)]
pub(super) struct Gated {
    inner: Arc<dyn Storage>,
    #[allow(clippy::type_complexity)]
    gate: Mutex<
        Option<(
            tokio::sync::oneshot::Sender<()>,
            tokio::sync::oneshot::Receiver<()>,
        )>,
    >,
}

impl Gated {
    /// `inner` with an armed gate: the receiver resolves when a recording
    /// call reaches it, and the sender lets that call go on.
    pub(super) fn new(
        inner: Arc<dyn Storage>,
    ) -> (
        Self,
        tokio::sync::oneshot::Receiver<()>,
        tokio::sync::oneshot::Sender<()>,
    ) {
        let (reached, reached_rx) = tokio::sync::oneshot::channel();
        let (go, go_rx) = tokio::sync::oneshot::channel();
        let gated = Self {
            inner,
            gate: Mutex::new(Some((reached, go_rx))),
        };
        (gated, reached_rx, go)
    }
}

#[async_trait::async_trait]
impl Storage for Gated {
    async fn apply(
        &self,
        charges: &[Charge],
    ) -> Result<crate::storage::RequestResult, StorageError> {
        self.inner.apply(charges).await
    }

    async fn ping(&self) -> Result<(), StorageError> {
        Ok(())
    }

    async fn report(
        &self,
        reports: &[QuotaReport],
    ) -> Result<Vec<crate::storage::quota::QuotaView>, StorageError> {
        if reports.iter().all(|r| r.charge.cost == 0) {
            let gate = self.gate.lock().take();
            if let Some((reached, go)) = gate {
                let _ = reached.send(());
                let _ = go.await;
            }
        }
        self.inner.report(reports).await
    }

    fn name(&self) -> &'static str {
        "gated"
    }
}

fn tokens(a: Action) -> (u32, u32) {
    match a {
        Action::TokenBucket {
            tokens_per_fill,
            max_tokens,
            ..
        } => (tokens_per_fill, max_tokens),
        Action::DenyAll => (0, 0),
        Action::AllowAll => panic!("allow-all for a limited rule"),
    }
}

/// Two streams whose reports interleave between the read of the records
/// and the recording of the new assignment: A reads alone (and computes
/// the whole rule), B reports in full meanwhile (and takes its part), then
/// A records. What A is sent, and what the records hold, still fit the
/// rule's budget (100 a fill, 100 held).
#[tokio::test]
async fn interleaved_reports_never_assign_above_the_budget() {
    static ID: &[(&str, &str)] = &[("tenant", "acme")];
    let config = compile_texts(&[("t.yaml".into(), YAML.as_bytes().to_vec())]).expect("config");
    let clock = ManualClock::new(1_000_000_000);
    let memory: Arc<dyn Storage> = Arc::new(MemoryStorage::new(Arc::new(clock.clone())));
    let (gated, reached, go) = Gated::new(memory.clone());
    let l = Arc::new(
        Limiter::new(config, Arc::new(gated), ServiceSettings::default())
            .with_quota_clock(Arc::new(clock.clone())),
    );
    let mut a = l.quota_stream("edge").expect("bound");
    let mut b = l.quota_stream("edge").expect("bound");
    let a_sub = a.subscriber().to_owned();
    let task = tokio::spawn(async move {
        let got = a.report(&[usage(ID, 10, 0)]).await.expect("a");
        (a, got)
    });
    reached.await.expect("a reaches its recording call");
    let gb = b.report(&[usage(ID, 10, 0)]).await.expect("b");
    go.send(()).expect("a waits");
    let (_a, ga) = task.await.expect("a answers");
    let (ta, ma) = tokens(action(&ga[0]));
    let (tb, mb) = tokens(action(&gb[0]));
    assert!(tb > 0, "b got its part: {gb:?}");
    assert!(ta + tb <= 100 && ma + mb <= 100, "sent {ga:?} and {gb:?}");
    // The records: read by a third subscriber that holds nothing.
    let key = key::encode("rls:", "edge", &[("tenant", KeyValue::Value("acme"))]);
    let probe = QuotaReport {
        subscribers: subscribers_key("rls:", &key),
        bucket: key,
        charge: ChargeSpec {
            limit: Limit::TokenBucket(BucketLimit {
                requests_per_unit: 100,
                unit_secs: std::num::NonZeroU64::MIN,
                burst: 100,
                max_debt: 600,
            }),
            cost: 0,
            kind: ChargeKind::Consume,
            shadow: false,
        },
        subscriber: "probe".into(),
        demand_milli: 0,
        held: None,
        budget: Held {
            tokens_per_fill: 100,
            max_tokens: 100,
        },
        live_ms: 15_000,
    };
    let views = memory.report(&[probe]).await.expect("memory");
    let held: Vec<Held> = views[0].subscribers.iter().filter_map(|s| s.held).collect();
    assert_eq!(held.len(), 2, "{views:?}");
    let sum = held.iter().fold((0, 0), |(t, m), h| {
        (t + h.tokens_per_fill, m + h.max_tokens)
    });
    assert_eq!(sum, (ta + tb, ma + mb), "recorded is what was sent");
    assert!(
        views[0]
            .subscribers
            .iter()
            .any(|s| s.id.starts_with(&format!("{a_sub}/"))),
        "{views:?}"
    );
}

/// Bucket ids of one stream that a `share_threshold` rule maps to one
/// storage key divide that key's budget: together they never hold more
/// than the rule.
#[tokio::test]
async fn bucket_ids_sharing_one_key_divide_its_budget() {
    let yaml = "domain: shared\ndescriptors:\n  - key: path\n    value: /api/*\n    share_threshold: true\n    rate_limit: { unit: second, requests_per_unit: 100 }\n";
    let config = compile_texts(&[("s.yaml".into(), yaml.as_bytes().to_vec())]).expect("config");
    let clock = ManualClock::new(1_000_000_000);
    let storage = Arc::new(MemoryStorage::new(Arc::new(clock.clone())));
    let l = Arc::new(
        Limiter::new(config, storage, ServiceSettings::default())
            .with_quota_clock(Arc::new(clock.clone())),
    );
    let mut s = l.quota_stream("shared").expect("bound");
    let paths = ["/api/a", "/api/b", "/api/c"];
    let mut max = 0u64;
    for round in 0..4 {
        let entries: Vec<[(&str, &str); 1]> = paths.iter().map(|p| [("path", *p)]).collect();
        let usages: Vec<Usage<'_>> = entries.iter().map(|e| usage(e, 50, 50)).collect();
        let got = s.report(&usages).await.expect("answered");
        max = 0;
        let mut tpf = 0u64;
        for a in &got {
            if let Action::TokenBucket {
                max_tokens,
                tokens_per_fill,
                ..
            } = action(a)
            {
                max += u64::from(max_tokens);
                tpf += u64::from(tokens_per_fill);
            }
        }
        assert!(
            max <= 100 && tpf <= 100,
            "round {round}: {max} held, {tpf} per fill"
        );
        clock.advance(std::time::Duration::from_secs(5));
    }
    assert!(max > 0, "the shared rule still gives a share");
}

/// A report that names more bucket ids than a stream may hold is refused
/// before any work that grows with it.
#[tokio::test]
async fn a_report_of_too_many_buckets_is_refused_at_once() {
    let (l, _, _) = setup(ServiceSettings::default());
    let mut s = l.quota_stream("edge").expect("bound");
    let values: Vec<String> = (0..1001).map(|i| i.to_string()).collect();
    let entries: Vec<[(&str, &str); 1]> = values.iter().map(|v| [("x", v.as_str())]).collect();
    let usages: Vec<Usage<'_>> = entries.iter().map(|e| usage(e, 1, 0)).collect();
    let e = s.report(&usages).await.expect_err("too many");
    assert!(
        matches!(&e, QuotaError::Invalid(m) if m.contains("1001 bucket usages")),
        "{e:?}"
    );
}

#[tokio::test]
async fn streams_together_hold_at_most_the_process_bound_of_bucket_state() {
    let (l, clock, storage) = setup(ServiceSettings::default());
    let id = |v: &'static str| -> BucketId { vec![("tenant".into(), v.into())] };
    let one = track_cost(&id("a1"));
    let bounds = Bounds {
        max_process_bytes: 3 * one,
        ..Bounds::DEFAULT
    };
    let config = compile_texts(&[("t.yaml".into(), YAML.as_bytes().to_vec())]).expect("config");
    let l2 = Arc::new(
        Limiter::new(config, storage, ServiceSettings::default())
            .with_quota_clock(Arc::new(clock.clone()))
            .with_quota_bounds(bounds),
    );
    drop(l);
    let mut a = l2.quota_stream("edge").expect("bound");
    let mut b = l2.quota_stream("edge").expect("bound");
    a.report(&[
        usage(&[("tenant", "a1")], 1, 0),
        usage(&[("tenant", "a2")], 1, 0),
    ])
    .await
    .expect("within the bound");
    let refused = b
        .report(&[
            usage(&[("tenant", "b1")], 1, 0),
            usage(&[("tenant", "b2")], 1, 0),
        ])
        .await;
    assert!(
        matches!(refused, Err(QuotaError::Exhausted(_))),
        "{refused:?}"
    );
    // Known buckets cost nothing more.
    a.report(&[usage(&[("tenant", "a1")], 1, 0)])
        .await
        .expect("known bucket");
    drop(a);
    b.report(&[
        usage(&[("tenant", "b1")], 1, 0),
        usage(&[("tenant", "b2")], 1, 0),
    ])
    .await
    .expect("a's state was given back");
    // Abandoned buckets give theirs back too.
    for _ in 0..3 {
        clock.advance(REPORT_INTERVAL);
        b.report(&[
            usage(&[("tenant", "b1")], 1, 0),
            usage(&[("tenant", "b2")], 0, 0),
        ])
        .await
        .expect("answered");
    }
    assert_eq!(b.buckets(), 1, "b2 abandoned");
    b.report(&[
        usage(&[("tenant", "b3")], 1, 0),
        usage(&[("tenant", "b4")], 1, 0),
    ])
    .await
    .expect("b2's state was given back");
}

/// A window rule reached through the quota service: what the Envoys
/// admitted is counted in the rule's window (past its limit too, as it was
/// admitted already), the window ShouldRateLimit charges for the same
/// descriptor; the shares are cut from the rule's rate as for a bucket.
#[tokio::test]
async fn a_window_rule_counts_what_the_envoys_admitted() {
    for algorithm in ["fixed_window", "sliding_window"] {
        let yaml = format!(
            "domain: w\ndescriptors:\n  - key: tenant\n    rate_limit: {{ unit: minute, requests_per_unit: 60, algorithm: {algorithm} }}\n"
        );
        let config = compile_texts(&[("t.yaml".into(), yaml.into_bytes())]).expect("config");
        let clock = ManualClock::new(1_699_999_980_000_000);
        let storage = Arc::new(MemoryStorage::new(Arc::new(clock.clone())));
        let l = Arc::new(
            Limiter::new(config, storage.clone(), ServiceSettings::default())
                .with_quota_clock(Arc::new(clock.clone())),
        );
        let mut s = l.quota_stream("w").expect("bound");
        let got = s
            .report(&[usage(&[("tenant", "acme")], 70, 0)])
            .await
            .expect("answered");
        assert!(
            matches!(action(&got[0]), Action::TokenBucket { .. }),
            "{algorithm}"
        );
        // 70 counted of 60: ShouldRateLimit on the same tenant is over.
        let req = crate::limiter::Request {
            domain: "w",
            descriptors: vec![crate::limiter::Descriptor {
                entries: vec![("tenant", "acme")],
                limit: None,
                hits_addend: None,
                is_negative_hits: false,
            }],
            hits_addend: 1,
        };
        let d = l.decide(&req).await.expect("decided");
        assert_eq!(
            d.overall_code,
            crate::limiter::Code::OverLimit,
            "{algorithm}"
        );
    }
}
