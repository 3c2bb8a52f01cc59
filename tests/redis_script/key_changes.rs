//! A key whose charges change limit under it: another algorithm (a reload
//! changed the rule's `algorithm`), or another window length between the
//! charges of one request. The script and the model agree on every reply
//! and on what is stored, one request per call and as one batch per step.

use super::*;

/// Runs `steps` (per step, its requests, all on the key `key`) one
/// request per call and then again as one batch per step, each from an
/// empty key, against the model: identical replies and stored state after
/// every step. Returns the replies of the one-per-call run.
fn script_and_model_agree(
    conn: &mut redis::Connection,
    key: &str,
    steps: &[Vec<Vec<Charge>>],
) -> Vec<Vec<RequestResult>> {
    let script = BucketScript::new();
    let mut alone = Vec::new();
    for batched in [false, true] {
        let _: () = redis::cmd("DEL").arg(key).query(conn).expect("DEL");
        let mut model = Model::default();
        for (n, requests) in steps.iter().enumerate() {
            let now = T0_US + 1000 * u64::try_from(n).expect("small");
            let expected: Vec<RequestResult> = requests
                .iter()
                .map(|charges| run_model(&mut model, charges, now).0)
                .collect();
            let calls: Vec<ScriptCall> = requests
                .iter()
                .map(|charges| {
                    ScriptCall::new(charges, Some(now))
                        .expect("encodable")
                        .with_min_ttl_ms(0)
                })
                .collect();
            let got: Vec<RequestResult> = if batched {
                let call = ScriptCall::batch(&calls.iter().collect::<Vec<_>>());
                let reply: redis::Value = script.evalsha_cmd(&call).query(conn).expect("script");
                if call.requests.is_empty() {
                    vec![call.parse_reply(&reply).expect("reply")]
                } else {
                    call.parse_batch_reply(&reply)
                        .expect("reply")
                        .into_iter()
                        .map(|r| r.expect("no error"))
                        .collect()
                }
            } else {
                calls
                    .iter()
                    .map(|call| {
                        let reply: redis::Value =
                            script.evalsha_cmd(call).query(conn).expect("script");
                        call.parse_reply(&reply).expect("reply")
                    })
                    .collect()
            };
            assert_eq!(got, expected, "step {n}, batched {batched}");
            let raw: Option<Vec<u8>> = redis::cmd("GET").arg(key).query(conn).expect("GET");
            assert_eq!(
                raw.as_deref().map(decode_state),
                model.get(key).copied(),
                "step {n}, batched {batched}"
            );
            if !batched {
                alone.push(got);
            }
        }
    }
    alone
}

fn consume(key: &str, limit: Limit, cost: u64) -> Charge {
    Charge {
        key: key.into(),
        spec: ChargeSpec {
            limit,
            cost,
            kind: ChargeKind::Consume,
            shadow: false,
        },
    }
}

/// A key charged under another algorithm than the one that wrote it is
/// read as never seen, stored or written earlier in the same batch.
#[test]
fn a_key_read_under_another_algorithm_starts_afresh() {
    let (_server, mut conn) = server_with_script();
    let bucket = Limit::TokenBucket(BucketLimit {
        requests_per_unit: 10,
        unit_secs: NonZeroU64::new(60).expect("a unit"),
        burst: 10,
        max_debt: 0,
    });
    let window = Limit::FixedWindow(WindowLimit {
        requests_per_unit: 10,
        unit_secs: NonZeroU64::new(60).expect("a unit"),
        counts_denied: true,
    });
    let hourly = Limit::FixedWindow(WindowLimit {
        requests_per_unit: 10,
        unit_secs: NonZeroU64::new(3600).expect("a unit"),
        counts_denied: true,
    });
    let sliding = Limit::SlidingWindow(WindowLimit {
        requests_per_unit: 10,
        unit_secs: NonZeroU64::new(60).expect("a unit"),
        counts_denied: false,
    });
    let c = |limit: Limit, cost: u64| vec![consume("switch", limit, cost)];
    let steps: Vec<Vec<Vec<Charge>>> = vec![
        vec![c(bucket, 4)],
        vec![c(window, 3)],
        vec![c(bucket, 2), c(window, 5), c(hourly, 1), c(window, 2)],
        vec![c(hourly, 4), c(sliding, 3), c(bucket, 1)],
        vec![c(sliding, 2), c(window, 1), c(sliding, 9)],
    ];
    let got = script_and_model_agree(&mut conn, "switch", &steps);
    // The window does not see the bucket's 4 tokens taken.
    assert_eq!(got[1][0].charges[0].remaining_micro, 7_000_000);
    // The key ends as the sliding window that charged it last.
    let raw: Option<Vec<u8>> = redis::cmd("GET")
        .arg("switch")
        .query(&mut conn)
        .expect("GET");
    assert!(
        matches!(
            raw.as_deref().map(decode_state),
            Some(State::SlidingWindow(_))
        ),
        "the sliding window charged last holds the key"
    );
}

/// A denied request whose hits stand (a window that counts the hits that
/// do not fit) under one window length, with a later charge on the same
/// key under another length: the key is stored under the last charge's
/// length, and the standing hits start anew there, as between the charges
/// of an admitted request. A batch gives what the requests give alone.
/// (The script and the model used to store the standing hits as a count
/// of the last charge's window; in a batch, the next request read them
/// back otherwise than from Redis, so batches and single calls differed.)
#[test]
fn hits_that_stand_under_another_window_length_start_anew() {
    let (_server, mut conn) = server_with_script();
    for (name, kind) in [("fixed", 0), ("sliding", 1)] {
        let window = |n: u32, unit: u64, counts_denied: bool| {
            let l = WindowLimit {
                requests_per_unit: n,
                unit_secs: NonZeroU64::new(unit).expect("a unit"),
                counts_denied,
            };
            if kind == 0 {
                Limit::FixedWindow(l)
            } else {
                Limit::SlidingWindow(l)
            }
        };
        let minute = window(2, 60, true);
        let hour = window(5, 3600, false);
        let denied = vec![consume("len", minute, 4), consume("len", hour, 1)];
        let hourly = vec![consume("len", hour, 5)];
        let steps: Vec<Vec<Vec<Charge>>> = vec![
            vec![denied.clone(), hourly.clone()],
            vec![denied, vec![consume("len", minute, 1)], hourly],
        ];
        let got = script_and_model_agree(&mut conn, "len", &steps);
        assert!(!got[0][0].admitted, "{name}: the minute's 4 do not fit");
        assert!(
            got[0][1].admitted,
            "{name}: the hour window holds none of the minute's hits"
        );
        assert_eq!(got[0][1].charges[0].remaining_micro, 0, "{name}");
    }
}
