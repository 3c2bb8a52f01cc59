//! Runs of identical requests at the edges of the script's short cuts (a
//! batch that is one run answered at once, a run of several charges
//! answered with one summary, a run of one charge answered by the token
//! bucket's steps): rate 0, burst 0, costs 0, 1, at and above the
//! capacity, huge; balances near 2^53 micro-tokens; a key stored after now;
//! a key in debt from a limit with a debt bound charged under one without;
//! a key of another algorithm; runs of one request; runs followed by other
//! runs on the same keys; runs next to reservations; long runs of many
//! charges. Every request of a batch gets the reply it gets alone, one
//! after the other (the model), with the same stored state.

use super::consume as charge;
use super::*;

/// A token bucket limit.
fn tb(rate: u32, unit: u64, burst: u32, debt: u32) -> Limit {
    Limit::TokenBucket(BucketLimit {
        requests_per_unit: rate,
        unit_secs: NonZeroU64::new(unit).expect("a unit"),
        burst,
        max_debt: debt,
    })
}

/// `times` copies of `request`.
fn run(request: &[Charge], times: usize) -> Vec<Vec<Charge>> {
    std::iter::repeat_n(request.to_vec(), times).collect()
}

/// Named edge cases, each on keys of its own.
#[test]
fn runs_at_the_edges_give_the_replies_of_one_at_a_time() {
    let (_server, mut conn) = server_with_script();
    let t = T0_US;
    let max1 = tb(u32::MAX, 1, u32::MAX, 0);
    let max_year = tb(u32::MAX, 31_536_000, u32::MAX, 0);
    let max_year_debt = tb(u32::MAX, 31_536_000, u32::MAX, u32::MAX);
    let small = tb(5, 60, 3, 0);
    let small_debt = tb(5, 60, 3, 10);
    let zero_rate = tb(0, 60, 5, 0);
    let zero_burst = tb(5, 1, 0, 0);
    let cases: Vec<(&str, Steps)> = vec![
        // Rate 0 and burst 0, alone and next to a bucket with room.
        ("rate0", vec![(t, run(&[charge("r0:a", zero_rate, 1)], 4))]),
        (
            "rate0-multi",
            vec![(
                t,
                run(
                    &[charge("r0m:a", small, 1), charge("r0m:b", zero_rate, 1)],
                    4,
                ),
            )],
        ),
        (
            "burst0",
            vec![(t, run(&[charge("b0:a", zero_burst, 1)], 4))],
        ),
        (
            "burst0-multi",
            vec![(
                t,
                run(
                    &[charge("b0m:a", small, 1), charge("b0m:b", zero_burst, 2)],
                    3,
                ),
            )],
        ),
        // Costs 0, 1, the capacity, one above, two above, huge.
        (
            "costs",
            vec![
                (t, run(&[charge("c:0", small, 0)], 3)),
                (t, run(&[charge("c:1", small, 3)], 3)),
                (t, run(&[charge("c:2", small, 4)], 3)),
                (t, run(&[charge("c:3", small, 5)], 3)),
                (t, run(&[charge("c:4", small, u64::MAX)], 3)),
                (
                    t,
                    run(
                        &[charge("c:5", small, 1), charge("c:6", small, u64::MAX)],
                        3,
                    ),
                ),
                (
                    t,
                    run(&[charge("c:7", small, 0), charge("c:8", small, 1)], 5),
                ),
            ],
        ),
        // Balances near 2^53 micro-tokens.
        (
            "huge",
            vec![
                (t, run(&[charge("h:a", max1, u64::from(u32::MAX) / 3)], 5)),
                (
                    t + 1,
                    run(
                        &[
                            charge("h:a", max1, u64::from(u32::MAX) / 2),
                            charge("h:b", max_year, u64::from(u32::MAX) - 1),
                        ],
                        4,
                    ),
                ),
                (
                    t + 1_000_000_004_207,
                    run(
                        &[
                            charge("h:b", max_year, 1 << 20),
                            charge("h:c", max_year, u64::MAX),
                        ],
                        6,
                    ),
                ),
                (
                    t + 2_000_000_000_000,
                    run(&[charge("h:b", max_year, 12_345_678)], 128),
                ),
            ],
        ),
        // Debt written under a limit with a debt bound, charged under one
        // without (one charge, several, refilling).
        (
            "debt",
            vec![
                (t, vec![vec![charge("d:a", small_debt, 12)]]),
                (t, run(&[charge("d:a", small, 1)], 3)),
                (
                    t + 1,
                    run(&[charge("d:a", small, 1), charge("d:b", small, 1)], 3),
                ),
                (
                    t + 200_000_000,
                    run(&[charge("d:b", small, 1), charge("d:a", small, 1)], 4),
                ),
                (
                    t + 200_000_001,
                    vec![vec![charge("d:c", max_year_debt, u64::MAX)]],
                ),
                (
                    t + 200_000_002,
                    run(&[charge("d:c", max_year, 1), charge("d:d", max_year, 1)], 3),
                ),
            ],
        ),
        // A key stored after now (the clock stepped back).
        (
            "stale",
            vec![
                (t + 5_000_000, vec![vec![charge("s:a", small, 1)]]),
                (t, run(&[charge("s:a", small, 1)], 4)),
                (t + 6_000_000, vec![vec![charge("s:b", small, 2)]]),
                (
                    t + 1_000_000,
                    run(&[charge("s:a", small, 1), charge("s:b", small, 1)], 4),
                ),
                (
                    t + 1_000_000,
                    run(&[charge("s:c", small, 1), charge("s:b", small, 1)], 4),
                ),
            ],
        ),
        // Two charges of one request on one key, in a run.
        (
            "shared",
            vec![
                (
                    t,
                    run(
                        &[
                            charge("sh:a", small, 1),
                            charge("sh:a", tb(5, 60, 2, 0), 1),
                            charge("sh:b", small, 1),
                        ],
                        4,
                    ),
                ),
                (
                    t + 1,
                    run(&[charge("sh:a", small, 1), charge("sh:a", small, 1)], 3),
                ),
            ],
        ),
        // Runs of one request, and runs followed by other runs on the
        // same keys.
        (
            "sequence",
            vec![(
                t,
                [
                    run(&[charge("q:a", small, 1), charge("q:b", small, 1)], 1),
                    run(&[charge("q:a", small, 1)], 1),
                    run(&[charge("q:a", small, 1), charge("q:b", small, 1)], 2),
                    run(&[charge("q:b", small, 1), charge("q:a", small, 1)], 2),
                    run(&[charge("q:b", tb(5, 60, 8, 0), 1)], 3),
                    run(
                        &[charge("q:a", small, 1), charge("q:b", tb(5, 60, 8, 0), 1)],
                        3,
                    ),
                    run(&[charge("q:b", small_debt, 1)], 2),
                    run(&[charge("q:b", small, 1), charge("q:c", small, 1)], 3),
                ]
                .concat(),
            )],
        ),
        // A several-charge run next to reservations.
        (
            "reservations",
            vec![(
                t,
                [
                    run(&[charge("v:a", small, 1), charge("v:b", small, 1)], 2),
                    vec![vec![Charge {
                        key: "v:a".into(),
                        spec: ChargeSpec {
                            limit: small,
                            cost: 1,
                            kind: ChargeKind::Reserve(Reserve {
                                id: reservation_id(1),
                                ttl_secs: 60,
                                max_open: 2,
                            }),
                            shadow: false,
                        },
                    }]],
                    run(&[charge("v:a", small, 1), charge("v:b", small, 1)], 3),
                    run(&[charge("v:b", small, 1), charge("v:c", small, 1)], 3),
                ]
                .concat(),
            )],
        ),
    ];
    for (name, steps) in &cases {
        agree(&mut conn, name, steps);
    }
}

/// Long runs (the batch's longest and more), of many charges (the
/// one-run short cut's 16 and one more).
#[test]
fn long_runs_of_many_charges_give_the_replies_of_one_at_a_time() {
    let (_server, mut conn) = server_with_script();
    let t = T0_US;
    for (n, (charges, times)) in [(1usize, 128usize), (1, 300), (16, 128), (17, 129), (40, 3)]
        .into_iter()
        .enumerate()
    {
        let request: Vec<Charge> = (0..charges)
            .map(|c| {
                let burst = u32::try_from(50 + 7 * c).expect("small");
                charge(&format!("long:{n}:{c}"), tb(10, 1, burst, 0), 1)
            })
            .collect();
        agree(
            &mut conn,
            &format!("long {charges}x{times}"),
            &[
                (t, run(&request, times)),
                (t + 3_000_000, run(&request, times)),
                (t + 3_000_000, run(&request[..charges / 2 + 1], times)),
            ],
        );
    }
}

/// A key of another algorithm under a run of token bucket charges, and the
/// other way round.
#[test]
fn runs_on_a_key_of_another_algorithm_start_afresh() {
    let (_server, mut conn) = server_with_script();
    let t = T0_US;
    let small = tb(5, 60, 3, 0);
    let window = Limit::FixedWindow(WindowLimit {
        requests_per_unit: 4,
        unit_secs: NonZeroU64::new(60).expect("a unit"),
        counts_denied: true,
    });
    agree(
        &mut conn,
        "algorithms",
        &[
            (t, run(&[charge("w:a", window, 2)], 2)),
            (t, run(&[charge("w:a", small, 1)], 4)),
            (
                t,
                run(&[charge("w:a", window, 1), charge("w:b", window, 1)], 2),
            ),
            (
                t,
                run(&[charge("w:a", small, 1), charge("w:b", small, 1)], 4),
            ),
            (
                t,
                [
                    run(&[charge("w:a", window, 1)], 2),
                    run(&[charge("w:a", small, 1), charge("w:b", small, 1)], 2),
                    run(&[charge("w:b", window, 1), charge("w:a", window, 1)], 2),
                    run(&[charge("w:a", small, 1), charge("w:b", small, 1)], 2),
                ]
                .concat(),
            ),
        ],
    );
}

/// A foreign value (a list) under one key of a run: every request of the
/// run charging it fails, as alone, and the other keys are untouched or
/// written as alone.
#[test]
fn a_foreign_key_in_a_run_fails_its_requests_only() {
    let (_server, mut conn) = server_with_script();
    let script = BucketScript::new();
    let _: () = redis::cmd("LPUSH")
        .arg("fk:list")
        .arg("x")
        .query(&mut conn)
        .expect("LPUSH");
    let small = tb(5, 60, 3, 0);
    let batches: Vec<Vec<Vec<Charge>>> = vec![
        run(&[charge("fk:a", small, 1), charge("fk:list", small, 1)], 3),
        run(&[charge("fk:list", small, 1)], 3),
        [
            run(&[charge("fk:b", small, 1), charge("fk:list", small, 1)], 3),
            run(&[charge("fk:b", small, 1), charge("fk:c", small, 1)], 4),
        ]
        .concat(),
    ];
    let mut model = Model::default();
    for (n, requests) in batches.iter().enumerate() {
        let calls: Vec<ScriptCall> = requests
            .iter()
            .map(|c| {
                ScriptCall::new(c, Some(T0_US))
                    .expect("encodable")
                    .with_min_ttl_ms(0)
            })
            .collect();
        let call = ScriptCall::batch(&calls.iter().collect::<Vec<_>>());
        let reply: redis::Value = script.evalsha_cmd(&call).query(&mut conn).expect("script");
        let got = call.parse_batch_reply(&reply).expect("batch reply");
        assert_eq!(got.len(), requests.len(), "batch {n}");
        for (i, (g, charges)) in got.iter().zip(requests).enumerate() {
            if charges.iter().any(|c| c.key == "fk:list") {
                let e = g.as_ref().expect_err("a foreign key fails its request");
                assert_eq!(e.code(), Some("WRONGTYPE"), "batch {n}, request {i}");
            } else {
                let (want, _) = run_model(&mut model, charges, T0_US);
                assert_eq!(g.as_ref().ok(), Some(&want), "batch {n}, request {i}");
            }
        }
        for key in ["fk:a", "fk:b", "fk:c"] {
            let raw: Option<Vec<u8>> = redis::cmd("GET").arg(key).query(&mut conn).expect("GET");
            assert_eq!(
                raw.as_deref().map(decode_state),
                model.get(key).copied(),
                "batch {n}, key {key}"
            );
            let _: i64 = redis::cmd("PERSIST")
                .arg(key)
                .query(&mut conn)
                .expect("PERSIST");
        }
    }
}

/// Random runs over edge limits (rate 0 or u32::MAX, burst 0 or u32::MAX,
/// units of a second to a year, a debt bound now and then, on keys that
/// other requests charge with one), edge costs, long runs and many
/// charges, with steps back in time.
#[test]
fn runs_over_edge_limits_give_the_replies_of_one_at_a_time() {
    let bucket = (
        prop::sample::select(vec![0u32, 1, 2, 7, u32::MAX - 1, u32::MAX]),
        prop::sample::select(vec![1u64, 60, 31_536_000]),
        prop::sample::select(vec![0u32, 1, 3, 10, u32::MAX - 1, u32::MAX]),
        prop_oneof![5 => Just(0u32), 1 => Just(5u32), 1 => Just(u32::MAX)],
    )
        .prop_map(runs::bucket_of);
    let keys = runs::keys_of(20, 12, bucket.clone());
    let cost = prop_oneof![
        1 => Just(0u64),
        6 => 1u64..4,
        1 => Just(10u64),
        1 => Just(11u64),
        1 => Just(u64::from(u32::MAX) / 3),
        1 => Just(u64::from(u32::MAX)),
        1 => Just(u64::MAX),
    ];
    // A charge: a key, now and then a limit with a debt bound of its own.
    let charge = (
        0usize..20,
        prop_oneof![
            8 => Just(None),
            1 => (bucket, window_limit(), any::<bool>()).prop_map(|(mut b, w, debt)| {
                if debt && b.requests_per_unit > 0 {
                    b.max_debt = 7;
                }
                Some((b, w))
            }),
        ],
        cost,
        prop_oneof![12 => Just(KindGen::Consume), 1 => kind()],
        prop::bool::weighted(0.03),
    );
    let request = prop_oneof![
        3 => prop::collection::vec(charge.clone(), 1..2),
        3 => prop::collection::vec(charge.clone(), 2..5),
        1 => prop::collection::vec(charge, 15..19),
    ];
    let times =
        prop_oneof![4 => 1usize..4, 2 => 4usize..20, 1 => Just(128usize), 1 => 129usize..300];
    let step = prop_oneof![
        3 => Just(0i64),
        2 => 1i64..2_000_000,
        1 => 1i64..100_000_000_000,
        1 => -5_000_000i64..0,
    ];
    let batches = (
        keys,
        prop::collection::vec((step, prop::collection::vec((request, times), 1..4)), 1..5),
    );
    check_runs(300, 1_000_000, batches);
}

/// Runs over a small world (four keys, small rates, bursts and costs, a
/// debt bound now and then, every kind of charge), so that runs share
/// keys, cross from admitted to denied and follow one another often.
#[test]
fn runs_over_a_small_world_give_the_replies_of_one_at_a_time() {
    let bucket = (
        0u32..3,
        prop::sample::select(vec![1u64, 60]),
        0u32..5,
        prop_oneof![3 => Just(0u32), 1 => 1u32..3],
    )
        .prop_map(runs::bucket_of);
    let keys = runs::keys_of(4, 6, bucket.clone());
    let charge = (
        0usize..4,
        prop_oneof![6 => Just(None), 1 => (bucket, window_limit()).prop_map(Some)],
        prop_oneof![1 => Just(0u64), 6 => 1u64..4, 1 => 4u64..7],
        prop_oneof![12 => Just(KindGen::Consume), 1 => kind()],
        prop::bool::weighted(0.03),
    );
    let request = prop::collection::vec(charge, 1..4);
    let step = prop_oneof![3 => Just(0i64), 2 => 1i64..3_000_000, 1 => -3_000_000i64..0];
    let batches = (
        keys,
        prop::collection::vec(
            (step, prop::collection::vec((request, 1usize..6), 1..5)),
            1..6,
        ),
    );
    check_runs(1500, 2_000_000, batches);
}

/// A lone request of thousands of charges (an operator may raise
/// `--max-descriptors` that far): its reply is packed in slices, within
/// the values Lua's `unpack` can push, and it gets the model's reply and
/// state; token buckets, windows (their reply carries more values per
/// charge) and keys charged twice, admitted and then denied.
#[test]
fn a_request_of_thousands_of_charges_is_answered_whole() {
    let (_server, mut conn) = server_with_script();
    let t = T0_US;
    let window = Limit::FixedWindow(WindowLimit {
        requests_per_unit: 3,
        unit_secs: NonZeroU64::new(60).expect("a unit"),
        counts_denied: true,
    });
    let request: Vec<Charge> = (0..4_500usize)
        .map(|c| {
            if c % 3 == 0 {
                charge(&format!("many:w:{c}"), window, 2)
            } else {
                // Every 50th charge on the key of the charge before it.
                let k = if c % 50 == 1 { c - 1 } else { c };
                charge(&format!("many:b:{k}"), tb(10, 60, 5, 0), 2)
            }
        })
        .collect();
    agree(
        &mut conn,
        "4,500 charges",
        &[(t, vec![request.clone()]), (t + 1_000, vec![request])],
    );
}
