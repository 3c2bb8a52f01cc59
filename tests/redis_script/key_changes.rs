//! A key whose charges change limit under it: another algorithm (a reload
//! changed the rule's `algorithm`), or another window length between the
//! charges of one request. The script and the model agree on every reply
//! and on what is stored, one request per call and as one batch per step.

use super::*;

/// Runs `steps` (per step, its requests, all on the key `key`, at 1 ms
/// steps) one request per call and then again as one batch per step, each
/// from an empty key, against the model ([`agree`]): identical replies and
/// stored state after every step. Returns the replies of the one-per-call
/// run, by step.
fn script_and_model_agree(
    conn: &mut redis::Connection,
    key: &str,
    steps: &[Vec<Vec<Charge>>],
) -> Vec<Vec<RequestResult>> {
    let at = |n: usize| T0_US + 1000 * u64::try_from(n).expect("small");
    let _: () = redis::cmd("DEL").arg(key).query(conn).expect("DEL");
    // One request per call: each its own step, at its step's time.
    let alone: Steps = steps
        .iter()
        .enumerate()
        .flat_map(|(n, requests)| requests.iter().map(move |r| (at(n), vec![r.clone()])))
        .collect();
    let replies = agree(conn, &format!("{key}, one per call"), &alone);
    let _: () = redis::cmd("DEL").arg(key).query(conn).expect("DEL");
    let batched: Steps = steps
        .iter()
        .enumerate()
        .map(|(n, requests)| (at(n), requests.clone()))
        .collect();
    agree(conn, &format!("{key}, batched"), &batched);
    // Back to the steps' grouping.
    let mut replies = replies.into_iter().flatten();
    steps
        .iter()
        .map(|requests| replies.by_ref().take(requests.len()).collect())
        .collect()
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
