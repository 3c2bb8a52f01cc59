//! Reservations (docs/design.md, "Reservations"): a request reserves an
//! estimate, its response end settles the real cost. Through the service
//! core on the memory backend and on a real `redis-server` shared by two
//! service replicas: which calls are reserves and which settlements, the
//! exact balance after concurrent reserve/settle pairs, and the metrics.

mod common;

use bucket_rls::grpc::ShouldRateLimit as _;
use bucket_rls::limiter::Limiter;
use bucket_rls::storage::algorithm::MICRO;
use bucket_rls::storage::clock::ManualClock;
use bucket_rls::storage::key::{self, KeyValue};
use bucket_rls::storage::memory::MemoryStorage;
use bucket_rls::storage::{BucketLimit, Charge, ChargeKind, ChargeSpec, Storage};
use common::{desc_hits, req};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;

/// 1000 tokens per year (no refill to speak of during a test), debt down
/// to -500, reservations kept 60 s, at most 100 open per user.
const CONFIG: &str = "domain: llm
descriptors:
  - key: user
    descriptors:
      - key: request_id
        reservation: {ttl_seconds: 60, max_open: 100}
        rate_limit: {unit: year, requests_per_unit: 1000, max_debt: 500}
";

const BUDGET: u64 = 1000;

fn limiter_on(storage: Arc<dyn Storage>, prefix: &str) -> Arc<Limiter> {
    common::limiter(CONFIG, storage, prefix)
}

/// The reserve Envoy sends when a request starts: `[user, request_id]`
/// with the estimate as its cost.
async fn reserve(l: &Limiter, user: &str, id: &str, estimate: u64) -> i32 {
    let d = desc_hits(&[("user", user), ("request_id", id)], estimate);
    let r = l
        .should_rate_limit(&req("llm", vec![d], 0))
        .await
        .expect("answer");
    r.overall_code
}

/// The settlement Envoy sends when the response ends: the same entries
/// and `phase=settle`, with the actual cost.
async fn settle(l: &Limiter, user: &str, id: &str, actual: u64) -> i32 {
    let d = desc_hits(
        &[("user", user), ("request_id", id), ("phase", "settle")],
        actual,
    );
    let r = l
        .should_rate_limit(&req("llm", vec![d], 0))
        .await
        .expect("answer");
    assert_eq!(r.statuses.len(), 1);
    r.overall_code
}

/// The user's balance in micro-tokens, read with a check (a consume of 0)
/// on the user's bucket, which changes nothing.
async fn balance(storage: &dyn Storage, prefix: &str, user: &str) -> i64 {
    let bucket = key::reservation_bucket(
        prefix,
        "llm",
        &[("user", KeyValue::Value(user))],
        "request_id",
    );
    let limit = BucketLimit {
        requests_per_unit: 1000,
        unit_secs: NonZeroU64::new(31_536_000).expect("non-zero"),
        burst: 1000,
        max_debt: 500,
    };
    let r = storage
        .apply(&[Charge {
            key: bucket,
            spec: ChargeSpec {
                limit: limit.into(),
                cost: 0,
                kind: ChargeKind::Consume,
                shadow: false,
            },
        }])
        .await
        .expect("storage answers");
    r.charges[0].remaining_micro
}

/// Whole tokens, from micro-tokens; a year-long unit refills 1000 tokens
/// in 31,536 s, so a test's few seconds refill less than one token.
fn tokens(micro: i64) -> i64 {
    micro.div_euclid(MICRO as i64)
}

fn memory() -> (Arc<MemoryStorage>, ManualClock) {
    let clock = ManualClock::new(1_700_000_000_000_000);
    (Arc::new(MemoryStorage::new(Arc::new(clock.clone()))), clock)
}

/// 20 reserves of 300 on a budget of 1000 before any settles: exactly 3
/// admitted, the denied ones charge nothing (also on a `max_debt` rule).
/// Settled at their actual costs, the balance is exactly the budget less
/// what they used; a repeated settlement is charged in full, down to the
/// debt floor; a reservation never settled leaves its estimate charged.
#[tokio::test]
async fn reserves_admit_budget_over_estimate_and_settlements_leave_the_exact_balance() {
    let (storage, clock) = memory();
    let l = limiter_on(storage.clone(), "m:");
    let mut admitted = Vec::new();
    for i in 0..20 {
        if reserve(&l, "ann", &format!("id-{i}"), 300).await == OK {
            admitted.push(i);
        }
    }
    assert_eq!(admitted, vec![0, 1, 2]);
    assert_eq!(tokens(balance(&*storage, "m:", "ann").await), 100);
    // Actual costs 250 and 420 (20 above the estimate, 50 back):
    // 1000 - 250 - 420 - 300 (the third still open).
    assert_eq!(settle(&l, "ann", "id-0", 250).await, OK);
    assert_eq!(settle(&l, "ann", "id-1", 420).await, OK);
    assert_eq!(tokens(balance(&*storage, "m:", "ann").await), 30);
    // Settled twice: the second one is charged in full.
    assert_eq!(settle(&l, "ann", "id-1", 420).await, OK);
    assert_eq!(tokens(balance(&*storage, "m:", "ann").await), -390);
    // Down to the debt floor, never below.
    assert_eq!(settle(&l, "ann", "id-1", 420).await, OK);
    assert_eq!(tokens(balance(&*storage, "m:", "ann").await), -500);
    // id-2 never settles: after its TTL it is forgotten, the estimate
    // stays charged, and a late settlement is charged in full.
    assert_eq!(
        storage
            .open_reservations(&key::reservation_bucket(
                "m:",
                "llm",
                &[("user", KeyValue::Value("ann"))],
                "request_id"
            ))
            .len(),
        1
    );
    clock.advance(Duration::from_secs(61));
    assert_eq!(
        storage
            .open_reservations(&key::reservation_bucket(
                "m:",
                "llm",
                &[("user", KeyValue::Value("ann"))],
                "request_id"
            ))
            .len(),
        0
    );
    storage.sweep();
    // Two users do not share a budget.
    assert_eq!(reserve(&l, "bob", "id-0", 1000).await, OK);
    assert_eq!(reserve(&l, "ann", "id-9", 1).await, OVER);
    assert_eq!(tokens(balance(&*storage, "m:", "bob").await), 0);
}

/// A settlement needs no rule of its own and is told from a reserve only
/// by its `phase=settle` entry: a reserve whose id is open adds to it, a
/// settlement with nothing open is charged in full.
#[tokio::test]
async fn the_phase_entry_alone_tells_a_settlement_from_a_reserve() {
    let (storage, _clock) = memory();
    let l = limiter_on(storage.clone(), "m:");
    assert_eq!(reserve(&l, "ann", "x", 100).await, OK);
    // The same id again without the marker: another reserve, added.
    assert_eq!(reserve(&l, "ann", "x", 100).await, OK);
    assert_eq!(tokens(balance(&*storage, "m:", "ann").await), 800);
    // Settled at 150: 200 reserved, 50 back.
    assert_eq!(settle(&l, "ann", "x", 150).await, OK);
    assert_eq!(tokens(balance(&*storage, "m:", "ann").await), 850);
    // A settlement of an id never reserved: charged in full.
    assert_eq!(settle(&l, "ann", "never", 70).await, OK);
    assert_eq!(tokens(balance(&*storage, "m:", "ann").await), 780);
    // Another final entry is no settlement: no rule, no limit.
    let d = desc_hits(
        &[("user", "ann"), ("request_id", "y"), ("phase", "other")],
        5,
    );
    let r = l.should_rate_limit(&req("llm", vec![d], 0)).await.unwrap();
    assert!(r.statuses[0].current_limit.is_none());
    assert_eq!(tokens(balance(&*storage, "m:", "ann").await), 780);
}

/// Past `max_open` a new reservation is denied and charges nothing.
#[tokio::test]
async fn a_bucket_holds_at_most_max_open_reservations() {
    let (storage, _clock) = memory();
    let yaml = CONFIG.replace("max_open: 100", "max_open: 2");
    let l = common::limiter(&yaml, storage.clone(), "m:");
    assert_eq!(reserve(&l, "ann", "a", 1).await, OK);
    assert_eq!(reserve(&l, "ann", "b", 1).await, OK);
    assert_eq!(reserve(&l, "ann", "c", 1).await, OVER);
    assert_eq!(tokens(balance(&*storage, "m:", "ann").await), 998);
    assert_eq!(settle(&l, "ann", "a", 1).await, OK);
    assert_eq!(reserve(&l, "ann", "c", 1).await, OK);
}

/// A reserve of 0 is a check: it reads the user's balance, reserves
/// nothing and opens no reservation, so reads never fill `max_open`.
#[tokio::test]
async fn a_check_of_zero_reads_the_balance_and_opens_no_reservation() {
    let (storage, _clock) = memory();
    let yaml = CONFIG.replace("max_open: 100", "max_open: 1");
    let l = common::limiter(&yaml, storage.clone(), "m:");
    assert_eq!(reserve(&l, "ann", "a", 300).await, OK);
    for i in 0..3 {
        let d = desc_hits(&[("user", "ann"), ("request_id", &format!("read-{i}"))], 0);
        let r = l.should_rate_limit(&req("llm", vec![d], 0)).await.unwrap();
        assert_eq!(r.overall_code, OK);
        assert_eq!(r.statuses[0].limit_remaining, 700, "the balance, read");
    }
    let bucket = key::reservation_bucket(
        "m:",
        "llm",
        &[("user", KeyValue::Value("ann"))],
        "request_id",
    );
    assert_eq!(
        storage.open_reservations(&bucket).len(),
        1,
        "only the real reserve is open"
    );
    // The one slot is taken by "a" alone: once it settles, the next reserve fits.
    assert_eq!(reserve(&l, "ann", "b", 100).await, OVER);
    assert_eq!(settle(&l, "ann", "a", 300).await, OK);
    assert_eq!(reserve(&l, "ann", "b", 100).await, OK);
    assert_eq!(tokens(balance(&*storage, "m:", "ann").await), 600);
}

/// A `limit` override on a reservation rule limits the user's one bucket
/// (at the override's rate), never one bucket per request id; reserves and
/// settlements work on it as on the rule's own bucket.
#[tokio::test]
async fn an_override_on_a_reservation_rule_limits_the_users_one_bucket() {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
    use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
    let (storage, _clock) = memory();
    let l = limiter_on(storage.clone(), "m:");
    let call = |id: String, settle: bool, hits: u64| {
        let mut entries = vec![("user", "ov".to_owned()), ("request_id", id)];
        if settle {
            entries.push(("phase", "settle".to_owned()));
        }
        let pairs: Vec<(&str, &str)> = entries.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut d = desc_hits(&pairs, hits);
        d.limit = Some(RateLimitOverride {
            requests_per_unit: 2,
            unit: RateLimitUnit::Hour as i32,
        });
        req("llm", vec![d], 0)
    };
    let mut admitted = 0;
    for i in 0..5 {
        let r = l
            .should_rate_limit(&call(format!("id-{i}"), false, 1))
            .await
            .unwrap();
        if r.overall_code == OK {
            admitted += 1;
        }
    }
    assert_eq!(
        admitted, 2,
        "two of five distinct ids fit the override of 2"
    );
    // Settling id-0 at 0 gives its estimate back: one more reserve fits.
    let r = l
        .should_rate_limit(&call("id-0".into(), true, 0))
        .await
        .unwrap();
    assert_eq!(r.overall_code, OK);
    let r = l
        .should_rate_limit(&call("id-9".into(), false, 1))
        .await
        .unwrap();
    assert_eq!(r.overall_code, OK, "the estimate given back is there again");
    let r = l
        .should_rate_limit(&call("id-10".into(), false, 1))
        .await
        .unwrap();
    assert_eq!(r.overall_code, OVER);
}

/// `is_negative_hits` on a reservation rule's descriptor gives tokens back
/// to the user's bucket (not to a bucket of its own per id) and answers
/// that bucket's balance; the reservation stays as it was.
#[tokio::test]
async fn negative_hits_on_a_reservation_rule_refund_the_users_bucket() {
    let (storage, _clock) = memory();
    let l = limiter_on(storage.clone(), "m:");
    assert_eq!(reserve(&l, "ann", "a", 300).await, OK);
    for entries in [
        &[("user", "ann"), ("request_id", "a")][..],
        &[("user", "ann"), ("request_id", "a"), ("phase", "settle")][..],
    ] {
        let mut d = desc_hits(entries, 100);
        d.is_negative_hits = true;
        let r = l.should_rate_limit(&req("llm", vec![d], 0)).await.unwrap();
        assert_eq!(r.overall_code, OK);
    }
    assert_eq!(tokens(balance(&*storage, "m:", "ann").await), 900);
    let bucket = key::reservation_bucket(
        "m:",
        "llm",
        &[("user", KeyValue::Value("ann"))],
        "request_id",
    );
    assert_eq!(
        storage.open_reservations(&bucket).len(),
        1,
        "the reservation stays open"
    );
    // Settled at 300: its estimate was 300, nothing more to charge.
    assert_eq!(settle(&l, "ann", "a", 300).await, OK);
    assert_eq!(tokens(balance(&*storage, "m:", "ann").await), 900);
}

/// `pairs` users' worth of concurrent reserve/settle pairs, spread over
/// `replicas`: reserve E = 20, settle A = 10 + i % 25; returns ΣA.
async fn concurrent_pairs(replicas: &[Arc<Limiter>], pairs: usize) -> u64 {
    let mut tasks = Vec::new();
    for i in 0..pairs {
        let l = replicas[i % replicas.len()].clone();
        let other = replicas[(i + 1) % replicas.len()].clone();
        tasks.push(tokio::spawn(async move {
            let id = format!("pair-{i}");
            assert_eq!(reserve(&l, "ann", &id, 20).await, OK);
            let actual = 10 + (i as u64 % 25);
            // The settlement may reach another replica.
            assert_eq!(settle(&other, "ann", &id, actual).await, OK);
            actual
        }));
    }
    let mut sum = 0;
    for t in tasks {
        sum += t.await.expect("task");
    }
    sum
}

/// 32 concurrent reserve/settle pairs on the memory backend leave the
/// exact balance: the budget less the actual costs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_pairs_leave_the_exact_balance_in_memory() {
    let (storage, _clock) = memory();
    let l = limiter_on(storage.clone(), "m:");
    let used = concurrent_pairs(&[l.clone(), l], 32).await;
    let left = balance(&*storage, "m:", "ann").await;
    assert_eq!(left, (BUDGET as i64 - used as i64) * MICRO as i64);
    assert!(
        storage
            .open_reservations(&key::reservation_bucket(
                "m:",
                "llm",
                &[("user", KeyValue::Value("ann"))],
                "request_id"
            ))
            .is_empty()
    );
}

/// A production-mode Redis backend (time from Redis `TIME`).
fn redis_storage(
    server: &common::redis::RedisServer,
) -> Arc<bucket_rls::storage::redis::RedisStorage> {
    Arc::new(
        bucket_rls::storage::redis::RedisStorage::builder(server.url())
            .timeout(Duration::from_secs(5))
            .build()
            .expect("valid URL"),
    )
}

/// Two service replicas on one `redis-server`: 32 concurrent
/// reserve/settle pairs, each settled on the other replica, leave the exact
/// balance and no open reservation; the books expire in Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_pairs_leave_the_exact_balance_on_redis_with_two_replicas() {
    let server = common::redis::RedisServer::start();
    let prefix = common::unique_prefix("reserve");
    let a = redis_storage(&server);
    let b = redis_storage(&server);
    let replicas = [limiter_on(a.clone(), &prefix), limiter_on(b, &prefix)];
    let used = concurrent_pairs(&replicas, 32).await;
    assert_eq!(
        tokens(balance(&*a, &prefix, "ann").await),
        BUDGET as i64 - used as i64
    );
    let bucket = key::reservation_bucket(
        &prefix,
        "llm",
        &[("user", KeyValue::Value("ann"))],
        "request_id",
    );
    let open: u64 = server.query(redis::cmd("HLEN").arg(key::book_key(&bucket)));
    assert_eq!(open, 0);
    // Reserves beyond the budget are denied and charge nothing; a
    // reservation left open is kept with a TTL of at most its own.
    let left = BUDGET - used;
    assert_eq!(reserve(&replicas[0], "ann", "big", left + 1).await, OVER);
    assert_eq!(reserve(&replicas[1], "ann", "open", 5).await, OK);
    assert_eq!(tokens(balance(&*a, &prefix, "ann").await), left as i64 - 5);
    let pttl: i64 = server.query(redis::cmd("PTTL").arg(key::book_key(&bucket)));
    assert!((1..=60_000).contains(&pttl), "book PTTL {pttl}");
    // Settled on the other replica beyond the estimate, and again.
    assert_eq!(settle(&replicas[0], "ann", "open", 25).await, OK);
    assert_eq!(settle(&replicas[1], "ann", "open", 25).await, OK);
    assert_eq!(tokens(balance(&*a, &prefix, "ann").await), left as i64 - 50);
}
