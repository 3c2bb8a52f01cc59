//! All-or-nothing across hash slots: reservation, then the refunds of an
//! admitted request or the compensation of a denied (or failed) one (see the
//! module docs of [`cluster`](super)). Written over [`SlotCall`], "one atomic
//! call in one slot", so that the protocol is tested here with one memory
//! backend per slot, and runs on the cluster with one script call per slot.

use crate::metrics as m;
use crate::storage::bucket::{ChargeKind, ChargeResult, ChargeSpec, MICRO, RequestResult};
use crate::storage::{Charge, StorageError};
use std::collections::HashMap;
use std::future::Future;

/// The outcome of one slot's call.
pub(crate) type SlotOutcome = Result<RequestResult, StorageError>;

/// One atomic call in one hash slot: what the reservation protocol needs of
/// a cluster.
pub(crate) trait SlotCall: Sync {
    /// Evaluates and applies `charges`, all in hash slot `slot`, atomically
    /// (the semantics of [`bucket::apply_request`](crate::storage::bucket::apply_request)).
    fn call(&self, slot: u16, charges: &[Charge]) -> impl Future<Output = SlotOutcome> + Send;

    /// Called once the compensating refunds of a request have been sent and
    /// answered (`refunds`: what was given back, per slot), before the
    /// request is answered. Default: nothing.
    fn compensated(&self, refunds: &[(u16, Vec<Charge>)]) {
        let _ = refunds;
    }
}

/// The slots of `charges` in first-seen order, each with the indices of its
/// charges.
pub(crate) fn group_by_slot(
    charges: &[Charge],
    slot_of: impl Fn(&str) -> u16,
) -> Vec<(u16, Vec<usize>)> {
    let mut slots: Vec<(u16, Vec<usize>)> = Vec::new();
    for (i, c) in charges.iter().enumerate() {
        let s = slot_of(&c.key);
        match slots.iter_mut().find(|(slot, _)| *slot == s) {
            Some((_, idx)) => idx.push(i),
            None => slots.push((s, vec![i])),
        }
    }
    slots
}

/// The request spread over several slots (`slots` from [`group_by_slot`]):
/// reservation of every slot's consumes in parallel, then the refunds when
/// every slot admitted, or the compensation of what was reserved otherwise.
///
/// # Errors
/// The first slot error of the reservation (after compensating the other
/// slots), or of the refund phase.
pub(crate) async fn apply_slots<S: SlotCall>(
    slot_call: &S,
    charges: &[Charge],
    slots: &[(u16, Vec<usize>)],
) -> Result<RequestResult, StorageError> {
    let is_refund = |i: usize| charges[i].spec.kind == ChargeKind::Refund;
    let has_consume = charges.iter().any(|c| c.spec.kind == ChargeKind::Consume);
    let mut results: Vec<Option<ChargeResult>> = vec![None; charges.len()];

    if has_consume {
        // Phase 1: reserve, every slot in parallel.
        let calls = slots.iter().map(|(slot, idx)| {
            let part: Vec<Charge> = idx
                .iter()
                .map(|&i| {
                    if is_refund(i) {
                        probe(&charges[i])
                    } else {
                        charges[i].clone()
                    }
                })
                .collect();
            async move { slot_call.call(*slot, &part).await }
        });
        let outcomes: Vec<SlotOutcome> = futures::future::join_all(calls).await;
        let all_admitted = outcomes.iter().all(|o| matches!(o, Ok(r) if r.admitted));
        if !all_admitted {
            return compensate(slot_call, charges, slots, outcomes).await;
        }
        for ((_, idx), outcome) in slots.iter().zip(outcomes) {
            let Ok(r) = outcome else {
                unreachable!("all admitted")
            };
            for (&i, mut cr) in idx.iter().zip(r.charges) {
                if is_refund(i) {
                    cr.enough = true;
                }
                results[i] = Some(cr);
            }
        }
    }

    // Phase 2 (or the only phase of a refund-only request): refunds.
    let refund_slots: Vec<(u16, Vec<usize>)> = slots
        .iter()
        .map(|(slot, idx)| {
            (
                *slot,
                idx.iter()
                    .copied()
                    .filter(|&i| is_refund(i))
                    .collect::<Vec<_>>(),
            )
        })
        .filter(|(_, idx)| !idx.is_empty())
        .collect();
    if !refund_slots.is_empty() {
        let calls = refund_slots.iter().map(|(slot, idx)| {
            let part: Vec<Charge> = idx.iter().map(|&i| charges[i].clone()).collect();
            async move { slot_call.call(*slot, &part).await }
        });
        let outcomes = futures::future::join_all(calls).await;
        let mut after: HashMap<&str, u64> = HashMap::new();
        for ((_, idx), outcome) in refund_slots.iter().zip(outcomes) {
            let r = outcome?;
            for (&i, cr) in idx.iter().zip(r.charges) {
                after.insert(charges[i].key.as_str(), cr.tokens_micro);
                results[i] = Some(cr);
            }
        }
        // Every charge on a refunded bucket reports the tokens after the
        // whole request, as on a single node.
        for (c, r) in charges.iter().zip(results.iter_mut()) {
            if let (Some(t), Some(r)) = (after.get(c.key.as_str()), r.as_mut()) {
                r.tokens_micro = *t;
            }
        }
    }
    Ok(RequestResult {
        admitted: true,
        charges: results
            .into_iter()
            .map(|r| r.expect("every charge belongs to one slot"))
            .collect(),
    })
}

/// Gives back what the admitted slots reserved, then answers: the first
/// error if a slot failed, else `OVER_LIMIT` with the tokens each bucket
/// had before the reservation.
async fn compensate<S: SlotCall>(
    slot_call: &S,
    charges: &[Charge],
    slots: &[(u16, Vec<usize>)],
    outcomes: Vec<SlotOutcome>,
) -> Result<RequestResult, StorageError> {
    let mut results: Vec<Option<ChargeResult>> = vec![None; charges.len()];
    let mut first_error = None;
    let mut refunds: Vec<(u16, Vec<Charge>)> = Vec::new();
    for ((slot, idx), outcome) in slots.iter().zip(outcomes) {
        let r = match outcome {
            Ok(r) => r,
            Err(e) => {
                first_error.get_or_insert(e);
                continue;
            }
        };
        // Micro-tokens this slot's call took from each bucket.
        let mut taken: HashMap<&str, u128> = HashMap::new();
        if r.admitted {
            let mut give_back = Vec::new();
            for (&i, cr) in idx.iter().zip(&r.charges) {
                let c = &charges[i];
                if c.spec.kind == ChargeKind::Consume && cr.enough && c.spec.cost > 0 {
                    *taken.entry(c.key.as_str()).or_default() +=
                        u128::from(c.spec.cost) * u128::from(MICRO);
                    give_back.push(Charge {
                        key: c.key.clone(),
                        spec: ChargeSpec {
                            kind: ChargeKind::Refund,
                            shadow: false,
                            ..c.spec
                        },
                    });
                }
            }
            if !give_back.is_empty() {
                refunds.push((*slot, give_back));
            }
        }
        for (&i, cr) in idx.iter().zip(r.charges) {
            let c = &charges[i];
            let before =
                u128::from(cr.tokens_micro) + taken.get(c.key.as_str()).copied().unwrap_or(0);
            results[i] = Some(ChargeResult {
                enough: cr.enough || c.spec.kind == ChargeKind::Refund,
                tokens_micro: u64::try_from(before.min(c.spec.limit.capacity_micro()))
                    .unwrap_or(u64::MAX),
            });
        }
    }
    let calls = refunds
        .iter()
        .map(|(slot, part)| async move { (*slot, slot_call.call(*slot, part).await) });
    for (slot, outcome) in futures::future::join_all(calls).await {
        if let Err(e) = outcome {
            metrics::counter!(m::STORAGE_ERRORS, "kind" => "cluster_refund_lost").increment(1);
            tracing::warn!(slot, error = %e, "could not give back a reservation in a Redis Cluster slot; its buckets stay charged until they refill (under-admission only)");
        }
    }
    if !refunds.is_empty() {
        slot_call.compensated(&refunds);
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    // A slot call that did not answer left `None`: impossible here, since
    // every outcome was either an error (returned above) or a result.
    Ok(RequestResult {
        admitted: false,
        charges: results
            .into_iter()
            .map(|r| r.expect("every slot answered"))
            .collect(),
    })
}

/// A cost-0 shadow check on a refund's bucket: reads its tokens, writes
/// nothing, never denies.
fn probe(c: &Charge) -> Charge {
    Charge {
        key: c.key.clone(),
        spec: ChargeSpec {
            kind: ChargeKind::Consume,
            cost: 0,
            shadow: true,
            ..c.spec
        },
    }
}
