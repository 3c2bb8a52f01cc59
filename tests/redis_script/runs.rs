//! Runs of identical requests of several charges, the usual shape of a
//! hot multi-descriptor request: mostly plain consumes on token buckets
//! without a debt bound (the script's short cut for such runs), between
//! runs that do not qualify (a check, a shadow or refund charge, a debt
//! bound, a window, two charges on one key). Every request gets the reply
//! it gets alone, one after the other, with the same stored state and
//! expiries.

use super::*;

/// Six keys, mostly token buckets without a debt bound and a small burst
/// (so that runs cross from admitted to denied), now and then a window or
/// a bucket with a debt bound.
fn run_keys() -> impl Strategy<Value = Keys> {
    let bucket = (
        1u32..30,
        prop::sample::select(vec![1u64, 60]),
        1u32..40,
        prop_oneof![6 => Just(0u32), 1 => 1u32..10],
    )
        .prop_map(bucket_of);
    keys_of(6, 8, bucket)
}

/// The bucket limit of a rate per unit, a unit in seconds, a burst and a
/// debt bound (none at rate 0).
pub(super) fn bucket_of((r, u, c, d): (u32, u64, u32, u32)) -> BucketLimit {
    BucketLimit {
        requests_per_unit: r,
        unit_secs: NonZeroU64::new(u).expect("a unit"),
        burst: c,
        max_debt: if r == 0 { 0 } else { d },
    }
}

/// `n` keys, each a token bucket `buckets` times as often as each window
/// algorithm, with its limit of `bucket` (or a window limit).
pub(super) fn keys_of(
    n: usize,
    buckets: u32,
    bucket: impl Strategy<Value = BucketLimit>,
) -> impl Strategy<Value = Keys> {
    let kind = prop_oneof![
        buckets => Just(AlgorithmKind::TokenBucket),
        1 => Just(AlgorithmKind::FixedWindow),
        1 => Just(AlgorithmKind::SlidingWindow),
    ];
    (
        prop::collection::vec(kind, n),
        prop::collection::vec((bucket, window_limit()), n),
    )
}

/// A request of 2 to 6 charges, on distinct keys but now and then, each a
/// plain consume but now and then.
fn run_request() -> impl Strategy<Value = Vec<ChargeGen>> {
    let plain = (
        prop_oneof![12 => 1u64..5, 1 => Just(0u64), 1 => 30u64..60],
        prop_oneof![
            20 => Just(KindGen::Consume),
            1 => Just(KindGen::Refund),
        ],
        prop::bool::weighted(0.03),
    );
    (
        Just((0usize..6).collect::<Vec<_>>()).prop_shuffle(),
        prop::collection::vec(plain, 2..7),
        prop::bool::weighted(0.1),
    )
        .prop_map(|(order, charges, shared)| {
            charges
                .into_iter()
                .enumerate()
                .map(|(i, (cost, kind, shadow))| {
                    // Now and then two charges on one key.
                    let k = if shared && i == 1 { order[0] } else { order[i] };
                    (k, None, cost, kind, shadow)
                })
                .collect()
        })
}

#[test]
fn runs_of_several_charges_give_the_replies_of_one_at_a_time() {
    let step = prop_oneof![2 => Just(0i64), 2 => 1i64..2_000_000, 1 => 1i64..120_000_000];
    let batches = (
        run_keys(),
        prop::collection::vec(
            (
                step,
                prop::collection::vec((run_request(), 1usize..40), 1..4),
            ),
            1..5,
        ),
    );
    check_runs(300, 0, batches);
}

/// Batches of requests of one charge each, every one on a bucket of its
/// own (per-user limits: the script's short cut for them), now and then
/// with a request that does not qualify (a check, a shadow or refund
/// charge, a debt bound, a window, a key charged twice) and with the clock
/// stepping back (keys stored after now): every request gets the reply it
/// gets alone, one after the other, with the same stored state and
/// expiries.
#[test]
fn requests_on_buckets_of_their_own_give_the_replies_of_one_at_a_time() {
    let step = prop_oneof![
        2 => Just(0i64),
        3 => 1i64..2_000_000,
        1 => 1i64..120_000_000,
        1 => -3_000_000i64..0,
    ];
    let one = (
        prop_oneof![12 => 1u64..5, 1 => Just(0u64), 1 => 30u64..60],
        prop_oneof![20 => Just(KindGen::Consume), 1 => Just(KindGen::Refund)],
        prop::bool::weighted(0.03),
    );
    let batch = (
        Just((0usize..6).collect::<Vec<_>>()).prop_shuffle(),
        prop::collection::vec(one, 2..7),
        prop::bool::weighted(0.1),
    )
        .prop_map(|(order, requests, shared)| {
            requests
                .into_iter()
                .enumerate()
                .map(|(i, (cost, kind, shadow))| {
                    // Now and then a key charged by two requests.
                    let k = if shared && i == 1 { order[0] } else { order[i] };
                    (vec![(k, None, cost, kind, shadow)], 1)
                })
                .collect::<Vec<_>>()
        });
    let batches = (run_keys(), prop::collection::vec((step, batch), 1..6));
    check_runs(400, 20_000, batches);
}
