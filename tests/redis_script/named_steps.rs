//! Named cases of the differential test: steps of requests at given
//! times through the script and through the model.

use super::*;

/// A plain consume of `cost` on `key` under `limit`.
pub(crate) fn consume(key: &str, limit: Limit, cost: u64) -> Charge {
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

/// Steps of a case: per step its time (µs) and its requests.
pub(crate) type Steps = Vec<(u64, Vec<Vec<Charge>>)>;

/// Runs each step (a time and its requests) as one script call against
/// the model one request at a time at that time: identical replies, and
/// identical stored state of every key named in the steps after each step.
/// Returns each step's replies. (A step of one request is a call of its
/// own, not a batch.)
pub(crate) fn agree(
    conn: &mut redis::Connection,
    name: &str,
    steps: &[(u64, Vec<Vec<Charge>>)],
) -> Vec<Vec<RequestResult>> {
    let script = BucketScript::new();
    let mut model = Model::default();
    let mut keys: Vec<String> = steps
        .iter()
        .flat_map(|(_, rs)| rs.iter().flatten().map(|c| c.key.clone()))
        .collect();
    keys.sort();
    keys.dedup();
    let mut replies = Vec::with_capacity(steps.len());
    for (n, (now, requests)) in steps.iter().enumerate() {
        let expected: Vec<RequestResult> = requests
            .iter()
            .map(|charges| run_model(&mut model, charges, *now).0)
            .collect();
        let calls: Vec<ScriptCall> = requests
            .iter()
            .map(|charges| {
                ScriptCall::new(charges, Some(*now))
                    .expect("encodable")
                    .with_min_ttl_ms(0)
            })
            .collect();
        let call = ScriptCall::batch(&calls.iter().collect::<Vec<_>>());
        let reply: redis::Value = script.evalsha_cmd(&call).query(conn).expect("script");
        let got: Vec<RequestResult> = if call.requests.is_empty() {
            vec![call.parse_reply(&reply).expect("reply")]
        } else {
            call.parse_batch_reply(&reply)
                .expect("reply")
                .into_iter()
                .map(|r| r.expect("no error"))
                .collect()
        };
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g, e, "{name}: step {n}, request {i}: {:?}", requests[i]);
        }
        assert_eq!(got.len(), expected.len(), "{name}: step {n}");
        for key in &keys {
            let raw: Option<Vec<u8>> = redis::cmd("GET").arg(key).query(conn).expect("GET");
            assert_eq!(
                raw.as_deref().map(decode_state),
                model.get(key).copied(),
                "{name}: step {n}, key {key}"
            );
            // Keep it: Redis expires in real time, the model in test time.
            let _: i64 = redis::cmd("PERSIST").arg(key).query(conn).expect("PERSIST");
        }
        replies.push(got);
    }
    replies
}
