//! Attacks on the recheck of a cut bucket ([`QuotaStream::recheck`]) and the
//! unmeasured demand of a newcomer: reloads between a report and a recheck,
//! and many interleavings of reports and rechecks across streams.

use super::*;
use crate::config::compile::compile_texts;
use crate::settings::ServiceSettings;
use crate::storage::clock::ManualClock;
use crate::storage::memory::MemoryStorage;

fn config(yaml: &str) -> crate::config::Config {
    compile_texts(&[("t.yaml".into(), yaml.as_bytes().to_vec())]).expect("config")
}

fn setup(yaml: &str) -> (Arc<Limiter>, ManualClock) {
    let clock = ManualClock::new(1_000_000_000);
    let storage = Arc::new(MemoryStorage::new(Arc::new(clock.clone())));
    let limiter = Limiter::new(config(yaml), storage, ServiceSettings::default())
        .with_quota_clock(Arc::new(clock.clone()));
    (Arc::new(limiter), clock)
}

fn usage<'a>(bucket: &'a [(&'a str, &'a str)], allowed: u64, denied: u64) -> Usage<'a> {
    Usage {
        bucket,
        allowed,
        denied,
    }
}

/// `(tokens_per_fill, max_tokens)` of an answer (deny-all: nothing).
fn tokens(a: &BucketAnswer) -> (u64, u64) {
    match a.answer {
        Answer::Assign {
            action:
                Action::TokenBucket {
                    tokens_per_fill,
                    max_tokens,
                    ..
                },
            ..
        } => (u64::from(tokens_per_fill), u64::from(max_tokens)),
        Answer::Assign {
            action: Action::DenyAll,
            ..
        } => (0, 0),
        _ => panic!("not a limited assignment: {a:?}"),
    }
}

const FAST: &str = "
domain: edge
descriptors:
  - key: tenant
    value: acme
    rate_limit: { unit: second, requests_per_unit: 100 }
";

const SLOW: &str = "
domain: edge
descriptors:
  - key: tenant
    value: acme
    rate_limit: { unit: second, requests_per_unit: 10 }
";

/// A reload lowers the rule from 100/s to 10/s while a newcomer waits for
/// its part. The holder reports after the reload and takes its part of the
/// new budget; the newcomer's recheck, before its own next report, must not
/// grant it a part of the old one: what the two Envoys are sent after the
/// reload fits the new rule.
#[tokio::test]
async fn a_recheck_after_a_reload_that_lowers_the_rule_grants_from_the_new_rule() {
    let (l, clock) = setup(FAST);
    let id: &[(&str, &str)] = &[("tenant", "acme")];
    let mut a = l.quota_stream("edge").expect("bound");
    a.report(&[usage(id, 1, 0)]).await.expect("a");
    for _ in 0..2 {
        clock.advance(REPORT_INTERVAL);
        a.report(&[usage(id, 450, 500)]).await.expect("a");
    }
    let mut b = l.quota_stream("edge").expect("bound");
    let first = b.report(&[usage(id, 1, 0)]).await.expect("b");
    assert_eq!(tokens(&first[0]), (0, 0));
    assert!(b.waiting());
    l.swap_config(config(SLOW));
    clock.advance(REPORT_INTERVAL);
    let shrunk = a.report(&[usage(id, 450, 500)]).await.expect("a");
    let (ta, ma) = tokens(&shrunk[0]);
    assert!(
        ta <= 10 && ma <= 10,
        "the holder's part of 10/s: {shrunk:?}"
    );
    let grown = b.recheck().await.expect("recheck");
    let (tb, mb) = grown.first().map_or((0, 0), tokens);
    assert!(
        ta + tb <= 10 && ma + mb <= 10 + 2,
        "after the reload to 10/s the Envoys hold {ta}+{tb} a fill and {ma}+{mb} tokens: {grown:?}"
    );
}

const OPEN: &str = "
domain: edge
descriptors:
  - key: tenant
    value: acme
    rate_limit: { unlimited: true }
";

/// A reload makes the rule unlimited while a newcomer waits: the holder's
/// next report moves it to allow-all and removes its record. The
/// newcomer's recheck must not, alone in the old rule's records, take the
/// whole old rule as a token bucket: it stops waiting and sends nothing;
/// its next report allows all.
#[tokio::test]
async fn a_recheck_after_a_reload_that_lifts_the_rule_sends_nothing() {
    let (l, clock) = setup(FAST);
    let id: &[(&str, &str)] = &[("tenant", "acme")];
    let mut a = l.quota_stream("edge").expect("bound");
    a.report(&[usage(id, 1, 0)]).await.expect("a");
    clock.advance(REPORT_INTERVAL);
    a.report(&[usage(id, 450, 500)]).await.expect("a");
    let mut b = l.quota_stream("edge").expect("bound");
    b.report(&[usage(id, 1, 0)]).await.expect("b");
    assert!(b.waiting());
    l.swap_config(config(OPEN));
    clock.advance(REPORT_INTERVAL);
    let open = a.report(&[usage(id, 450, 500)]).await.expect("a");
    assert!(
        matches!(
            open[0].answer,
            Answer::Assign {
                action: Action::AllowAll,
                ..
            }
        ),
        "{open:?}"
    );
    let grown = b.recheck().await.expect("recheck");
    assert!(grown.is_empty(), "{grown:?}");
    assert!(!b.waiting());
    clock.advance(Duration::from_secs(1));
    let next = b.report(&[usage(id, 5, 0)]).await.expect("b");
    assert!(
        matches!(
            next[0].answer,
            Answer::Assign {
                action: Action::AllowAll,
                ..
            }
        ),
        "{next:?}"
    );
}

const SHAPES: &str = "
domain: edge
descriptors:
  - key: tenant
    value: wide
    rate_limit: { unit: second, requests_per_unit: 100 }
  - key: tenant
    value: narrow
    rate_limit: { unit: second, requests_per_unit: 7, burst: 3 }
  - key: tenant
    value: slow
    rate_limit: { unit: minute, requests_per_unit: 1, burst: 10 }
  - key: tenant
    value: thin
    rate_limit: { unit: second, requests_per_unit: 1000, burst: 1 }
";

/// A small deterministic generator (xorshift64*), so a failure names its
/// seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Two to five Envoys report one rule's bucket in random order (each at
/// least every reporting interval and a second), their streams recheck at
/// random moments in between, demands shift at random. After every step
/// the assignments last sent to the Envoys fit the rule (per fill: the
/// budget; held: the burst plus one per subscriber). Then demands hold
/// still for twelve reporting rounds (each Envoy reporting every interval, in
/// one order): by then no stream is still cut and
/// rechecking.
#[tokio::test]
async fn reports_and_rechecks_in_any_order_fit_the_rule_and_settle() {
    let shapes: [(&str, Budget); 4] = [
        ("wide", Budget::new(100, 1, 100).expect("budget")),
        ("narrow", Budget::new(7, 1, 3).expect("budget")),
        ("slow", Budget::new(1, 60, 10).expect("budget")),
        ("thin", Budget::new(1000, 1, 1).expect("budget")),
    ];
    for seed in 1..=200u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let (name, budget) = shapes[usize::try_from(seed % 4).expect("small")];
        let (l, clock) = setup(SHAPES);
        let id: &[(&str, &str)] = &[("tenant", name)];
        let n = 2 + usize::try_from(rng.below(4)).expect("small");
        let mut streams: Vec<QuotaStream> = (0..n)
            .map(|_| l.quota_stream("edge").expect("bound"))
            .collect();
        let mut sent: Vec<(u64, u64)> = vec![(0, 0); n];
        let mut demand: Vec<u64> = (0..n).map(|_| 1 + rng.below(400)).collect();
        let check = |sent: &[(u64, u64)], step: &str| {
            let t: u64 = sent.iter().map(|s| s.0).sum();
            let m: u64 = sent.iter().map(|s| s.1).sum();
            assert!(
                t <= budget.tokens_per_fill && m <= budget.max_tokens + n as u64,
                "seed {seed} ({name}, {n} Envoys) after {step}: sent {sent:?}, budget {budget:?}"
            );
        };
        let rounds = 4 + 12;
        let mut order: Vec<usize> = (0..n).collect();
        for round in 0..rounds {
            // Steady: every Envoy reports every reporting interval, in the
            // same order, asking as much.
            let steady = round >= 4;
            if !steady {
                for i in (1..n).rev() {
                    order.swap(i, usize::try_from(rng.below(i as u64 + 1)).expect("small"));
                }
            }
            for &who in &order {
                if !steady && rng.below(3) == 0 {
                    demand[who] = 1 + rng.below(400);
                }
                // Some rechecks, by any stream, before this report.
                for _ in 0..rng.below(3) {
                    let r = usize::try_from(rng.below(n as u64)).expect("small");
                    if streams[r].waiting() {
                        for a in streams[r].recheck().await.expect("recheck") {
                            sent[r] = tokens(&a);
                        }
                        check(&sent, &format!("round {round}: recheck of {r}"));
                    }
                }
                clock.advance(Duration::from_millis(
                    REPORT_INTERVAL.as_millis() as u64 / n as u64,
                ));
                let d = demand[who];
                let got = streams[who]
                    .report(&[usage(id, d / 2, d - d / 2)])
                    .await
                    .expect("report");
                sent[who] = tokens(&got[0]);
                check(&sent, &format!("round {round}: report of {who}"));
            }
        }
        // Rechecks before the next reports: nobody is still waiting.
        for (i, s) in streams.iter_mut().enumerate() {
            if s.waiting() {
                for a in s.recheck().await.expect("recheck") {
                    sent[i] = tokens(&a);
                }
            }
        }
        let waiting: Vec<usize> = (0..n).filter(|&i| streams[i].waiting()).collect();
        assert!(
            waiting.is_empty(),
            "seed {seed} ({name}, {n} Envoys, demands {demand:?}): still waiting after twelve steady rounds: {waiting:?}, sent {sent:?}"
        );
    }
}
/// Two replicas on one storage whose configs disagree on a rule (a reload
/// that failed on one of them, or a rollout half done): 100/s on one, 10/s
/// on the other. The Envoy on the 100/s replica holds most of 100; the one
/// on the 10/s replica is cut (nothing is left of 10) and waits for the
/// other to move to a target it never reaches. Its stream should not go on
/// making a storage call every second for as long as the disagreement
/// lasts: after six reporting intervals it no longer waits.
#[tokio::test]
async fn a_stream_cut_for_good_by_replicas_that_disagree_stops_rechecking() {
    let clock = ManualClock::new(1_000_000_000);
    let storage = Arc::new(MemoryStorage::new(Arc::new(clock.clone())));
    let replica = |yaml: &str| {
        Arc::new(
            Limiter::new(config(yaml), storage.clone(), ServiceSettings::default())
                .with_quota_clock(Arc::new(clock.clone())),
        )
    };
    let (fast, slow) = (replica(FAST), replica(SLOW));
    let id: &[(&str, &str)] = &[("tenant", "acme")];
    let mut a = fast.quota_stream("edge").expect("bound");
    let mut b = slow.quota_stream("edge").expect("bound");
    let mut rechecks = 0;
    for _ in 0..6 {
        a.report(&[usage(id, 450, 500)]).await.expect("a");
        clock.advance(Duration::from_secs(2));
        b.report(&[usage(id, 450, 500)]).await.expect("b");
        for _ in 0..3 {
            clock.advance(Duration::from_secs(1));
            if b.waiting() {
                rechecks += 1;
                b.recheck().await.expect("recheck");
            }
        }
    }
    assert!(
        !b.waiting(),
        "still waiting after {rechecks} rechecks (one storage call each): {:#?}",
        slow.quotas().view()
    );
}

/// An Envoy that reports `u64::MAX` requests has a measured demand from its
/// second report on, however large: it never reads as the unmeasured
/// sentinel (in its record or the admin view), so it does not turn into a
/// stand-in of the others' mean.
#[tokio::test]
async fn a_demand_of_u64_max_requests_stays_measured() {
    let (l, clock) = setup(FAST);
    let id: &[(&str, &str)] = &[("tenant", "acme")];
    let mut a = l.quota_stream("edge").expect("bound");
    let mut b = l.quota_stream("edge").expect("bound");
    for _ in 0..3 {
        a.report(&[usage(id, u64::MAX, u64::MAX)]).await.expect("a");
        b.report(&[usage(id, 10, 0)]).await.expect("b");
        clock.advance(REPORT_INTERVAL);
    }
    let view = l.quotas().view();
    let bucket = &view[0].buckets["tenant=acme"];
    assert!(bucket.demand.is_some_and(|d| d > 1e12), "{bucket:?}");
    assert!(
        bucket.subscribers.iter().all(|s| s.demand.is_some()),
        "{bucket:?}"
    );
    let got = a.report(&[usage(id, u64::MAX, 0)]).await.expect("a");
    assert!(
        tokens(&got[0]).0 >= 90,
        "the busy one keeps nearly all: {got:?}"
    );
}
