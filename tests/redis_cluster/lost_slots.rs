//! A lost slot range (a master and its replica stopped) fails only the
//! requests and quota reports that touch it.

use super::*;

/// docs/cases.md, "No CROSSSLOT on a cluster", step 3: a master and its replica
/// stopped. Requests touching the lost slots answer UNAVAILABLE (kind
/// CLUSTERDOWN) for the whole request; requests whose buckets all live
/// elsewhere keep working, before and after the cluster marks the nodes failed;
/// a mixed request charges nothing. A quota report touching the lost slots
/// fails (its answer is skipped), one on live slots is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lost_slot_range_fails_only_its_requests() {
    let mut c = own_cluster().await;
    let prefix = unique_prefix("lost");
    let shards = c.shards();
    let lost = shards[0].clone();
    let live_a = value_in(&shards[1], &prefix, "c", "route", "x", &[]);
    let live_b = value_in(&shards[2], &prefix, "c", "route", "y", &[]);
    let dead = value_in(&lost, &prefix, "c", "route", "z", &[]);
    // No breaker in the way: this test checks what each call answers.
    let s = RedisClusterStorage::builder(c.seeds())
        .timeout(Duration::from_millis(500))
        .breaker(1_000_000, Duration::from_millis(500))
        .build()
        .expect("seeds");
    while !s.connected() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let s = Arc::new(s);
    let l = limiter(USER_AND_ROUTE, s.clone(), &prefix);
    let r = call(&l, "c", &[("route", &live_a), ("route", &dead)]).await;
    assert_eq!(r.overall_code, OK);

    c.node_mut(lost.master).stop();
    for p in &lost.replicas {
        c.node_mut(*p).stop();
    }
    // 100 per hour: refill stays far below a token during the test.
    let limit = Limit::TokenBucket(BucketLimit {
        requests_per_unit: 100,
        unit_secs: std::num::NonZeroU64::new(3600).expect("an hour"),
        burst: 100,
        max_debt: 0,
    });
    let charge = |v: &str| Charge {
        key: bucket(&prefix, "c", "route", v),
        spec: ChargeSpec {
            limit,
            cost: 1,
            kind: ChargeKind::Consume,
            shadow: false,
        },
    };
    let mut live_ok = 0;
    let mut expected_live_b = 100;
    let started = Instant::now();
    // 3 s: before and after the cluster marks the nodes failed (node timeout 1 s).
    while started.elapsed() < Duration::from_secs(3) {
        match s.apply(&[charge(&dead)]).await {
            Err(e) if e.kind() == "CLUSTERDOWN" => {}
            other => panic!("lost slot answered {other:?}"),
        }
        // Mixed: whole request fails, the live bucket is not charged.
        match s.apply(&[charge(&live_b), charge(&dead)]).await {
            Err(e) => assert_eq!(e.kind(), "CLUSTERDOWN"),
            Ok(r) => panic!("mixed request answered {r:?}"),
        }
        let r = s
            .apply(&[charge(&live_a), charge(&live_b)])
            .await
            .unwrap_or_else(|e| panic!("live slots failed after {:?}: {e}", started.elapsed()));
        assert!(r.admitted);
        expected_live_b -= 1;
        assert_eq!(r.charges[1].remaining_micro / 1_000_000, expected_live_b);
        live_ok += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(live_ok > 20, "{live_ok} live requests");
    // Through the service: UNAVAILABLE for the whole request.
    let e = l
        .should_rate_limit(&req(
            "c",
            vec![desc(&[("route", &live_a)]), desc(&[("route", &dead)])],
            0,
        ))
        .await
        .expect_err("lost slot");
    assert_eq!(e.code(), tonic::Code::Unavailable);
    assert!(
        s.ping().await.is_ok(),
        "health stays up while other masters answer"
    );

    // A quota (RLQS) report with a bucket in the lost slots fails whole
    // (its answer is skipped); the live slot's call stands: its subscriber
    // record is written. A report on live slots only is answered.
    use bucket_rls::limiter::quota::{Answer, QuotaError, Usage};
    let mut stream = l.quota_stream("c").expect("bound");
    let (id_a, id_b, id_dead) = (
        [("route", live_a.as_str())],
        [("route", live_b.as_str())],
        [("route", dead.as_str())],
    );
    let mixed = [
        Usage {
            bucket: &id_a,
            allowed: 1,
            denied: 0,
        },
        Usage {
            bucket: &id_dead,
            allowed: 1,
            denied: 0,
        },
    ];
    match stream.report(&mixed).await {
        Err(QuotaError::Storage(e)) => assert_eq!(e.kind(), "CLUSTERDOWN", "{e}"),
        other => panic!("a report touching the lost slots answered {other:?}"),
    }
    let records = bucket_rls::storage::quota::subscribers_key(
        &prefix,
        &bucket(&prefix, "c", "route", &live_a),
    );
    let n: u64 = c.query_on(&records, redis::cmd("HLEN").arg(&records));
    assert_eq!(n, 1, "the live slot's call stands");
    let live = [
        Usage {
            bucket: &id_a,
            allowed: 1,
            denied: 0,
        },
        Usage {
            bucket: &id_b,
            allowed: 1,
            denied: 0,
        },
    ];
    let got = stream
        .report(&live)
        .await
        .unwrap_or_else(|e| panic!("a report on live slots failed: {e}"));
    assert!(
        got.iter()
            .all(|a| matches!(a.answer, Answer::Assign { .. })),
        "{got:?}"
    );
}
