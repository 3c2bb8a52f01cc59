//! Unit tests of the script call's arguments and reply parsing.

use super::*;
use crate::storage::algorithm::BucketLimit;

fn charge(key: &str, cost: u64, kind: ChargeKind, shadow: bool) -> Charge {
    Charge {
        key: key.into(),
        spec: ChargeSpec {
            limit: BucketLimit {
                requests_per_unit: 10,
                unit_secs: std::num::NonZeroU64::new(60).expect("a minute"),
                burst: 20,
                max_debt: 0,
            }
            .into(),
            cost,
            kind,
            shadow,
        },
    }
}

#[test]
fn arguments_group_keys_and_clamp_costs() {
    let call = ScriptCall::new(
        &[
            charge("a", u64::MAX, ChargeKind::Consume, false),
            charge("b", 0, ChargeKind::Consume, true),
            charge("a", 1000, ChargeKind::Refund, false),
        ],
        None,
    )
    .expect("valid");
    assert_eq!(call.keys, vec!["a", "b"]);
    assert_eq!(call.charges, 3);
    // (key index, R, U, C, cost, flags) per charge, packed.
    let mut packed = Vec::new();
    for (k, cost, flags) in [(1u32, 21u64, 0u64), (2, 0, 2), (1, 1000, 1)] {
        packed.extend_from_slice(&k.to_be_bytes());
        packed.extend_from_slice(&10u32.to_be_bytes());
        packed.extend_from_slice(&60u32.to_be_bytes());
        packed.extend_from_slice(&20u32.to_be_bytes());
        packed.extend_from_slice(&cost.to_be_bytes());
        packed.extend_from_slice(&flags.to_be_bytes());
    }
    assert_eq!(call.args, vec![Vec::new(), Vec::new(), packed]);
    assert!(ScriptCall::new(&[charge("a", 1, ChargeKind::Consume, false)], Some(1 << 53)).is_err());
}

#[test]
fn consecutive_identical_requests_are_sent_as_one_run() {
    let one = |key: &str| {
        ScriptCall::new(&[charge(key, 1, ChargeKind::Consume, false)], None).expect("valid")
    };
    let (a, b) = (one("a"), one("b"));
    let call = ScriptCall::batch(&[&a, &a, &a, &b, &a, &a]);
    assert_eq!(call.keys, vec!["a", "b"]);
    assert_eq!(call.requests, vec![1; 6]);
    // Runs: 3 x a, 1 x b, 2 x a; each run's charge packed once.
    let mut sizes = Vec::new();
    for times in [3u32, 1, 2] {
        sizes.extend_from_slice(&1u32.to_be_bytes());
        sizes.extend_from_slice(&times.to_be_bytes());
    }
    assert_eq!(call.args[3], sizes);
    assert_eq!(call.args[2].len(), 3 * CHARGE_BYTES);
    assert_eq!(
        call.args[2][..CHARGE_BYTES],
        call.args[2][2 * CHARGE_BYTES..]
    );
    assert_ne!(
        call.args[2][..CHARGE_BYTES],
        call.args[2][CHARGE_BYTES..2 * CHARGE_BYTES]
    );
}

#[test]
fn replies_are_checked() {
    let packed = |admitted: u8, charges: &[(u8, i64)]| {
        let mut v = vec![admitted];
        for (e, t) in charges {
            v.push(*e);
            v.extend_from_slice(&t.to_be_bytes());
        }
        Value::BulkString(v)
    };
    let ok = packed(1, &[(1, 5)]);
    let r = parse_reply(&ok, 1).expect("valid");
    assert!(r.admitted);
    assert_eq!(
        (r.charges[0].enough, r.charges[0].remaining_micro),
        (true, 5)
    );
    assert!(parse_reply(&ok, 2).is_err());
    let debt = parse_reply(&packed(0, &[(0, -5)]), 1).expect("valid");
    assert!(!debt.admitted);
    assert_eq!(debt.charges[0].remaining_micro, -5);
    assert!(parse_reply(&packed(2, &[(1, 5)]), 1).is_err());
    assert!(parse_reply(&packed(1, &[(7, 5)]), 1).is_err());
    assert!(parse_reply(&Value::Array(vec![Value::Int(1)]), 0).is_err());
    assert!(parse_reply(&Value::Nil, 0).is_err());
}

/// A run answered at once expands to each request's own result; a run
/// that claims more requests than are left, more admitted than its
/// requests, or a take of 0 is refused.
#[test]
fn run_summaries_expand_to_each_request_and_are_checked() {
    let two = ScriptCall::new(
        &[
            charge("a", 2, ChargeKind::Consume, false),
            charge("b", 1, ChargeKind::Consume, false),
        ],
        None,
    )
    .expect("valid");
    let call = ScriptCall::batch(&[&two, &two, &two, &two]);
    let summary = |times: u32, admitted: u32, takes: [i64; 2]| {
        let mut v = vec![3u8];
        v.extend_from_slice(&times.to_be_bytes());
        v.extend_from_slice(&admitted.to_be_bytes());
        // a: 5 tokens, 2 a request, enough for the one denied; b: 2.
        for (start, take, enough) in [(5_000_000i64, takes[0], 1u8), (2_000_000, takes[1], 0)] {
            v.extend_from_slice(&start.to_be_bytes());
            v.extend_from_slice(&take.to_be_bytes());
            v.push(enough);
        }
        v
    };
    let ok = summary(4, 2, [2_000_000, 1_000_000]);
    let got = call
        .parse_batch_reply(&Value::BulkString(ok))
        .expect("valid");
    let view: Vec<(bool, Vec<(bool, i64)>)> = got
        .iter()
        .map(|r| {
            let r = r.as_ref().expect("no error");
            (
                r.admitted,
                r.charges
                    .iter()
                    .map(|c| (c.enough, c.remaining_micro))
                    .collect(),
            )
        })
        .collect();
    assert_eq!(
        view,
        vec![
            (true, vec![(true, 3_000_000), (true, 1_000_000)]),
            (true, vec![(true, 1_000_000), (true, 0)]),
            (false, vec![(true, 1_000_000), (false, 0)]),
            (false, vec![(true, 1_000_000), (false, 0)]),
        ]
    );
    // Two runs of two make the same four requests.
    let mut halves = summary(2, 2, [2_000_000, 1_000_000]);
    halves.extend(summary(2, 0, [2_000_000, 1_000_000]));
    assert_eq!(
        call.parse_batch_reply(&Value::BulkString(halves))
            .expect("valid")
            .len(),
        4
    );
    // A run over requests of another size is refused.
    let one = ScriptCall::new(&[charge("a", 2, ChargeKind::Consume, false)], None).expect("valid");
    let mixed = ScriptCall::batch(&[&two, &two, &one]);
    let over = summary(3, 1, [2_000_000, 1_000_000]);
    assert!(mixed.parse_batch_reply(&Value::BulkString(over)).is_err());
    for bad in [
        summary(5, 2, [2_000_000, 1_000_000]),
        summary(4, 5, [2_000_000, 1_000_000]),
        summary(0, 0, [2_000_000, 1_000_000]),
        summary(4, 2, [0, 1_000_000]),
        summary(4, 2, [i64::MAX, 1_000_000]),
        summary(2, 2, [2_000_000, 1_000_000]),
    ] {
        assert!(call.parse_batch_reply(&Value::BulkString(bad)).is_err());
    }
}
