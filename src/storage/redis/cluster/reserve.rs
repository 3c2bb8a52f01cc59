//! All-or-nothing across hash slots: reservation, then the refunds of an
//! admitted request or the compensation of a denied (or failed) one (see the
//! module docs of [`cluster`](super)). Written over [`SlotCall`], "one atomic
//! call in one slot", so that the protocol is tested here with one memory
//! backend per slot, and runs on the cluster with one script call per slot.

use crate::metrics as m;
use crate::storage::algorithm::{
    ChargeKind, ChargeResult, ChargeSpec, RequestResult, ReservationOutcome,
};
use crate::storage::{Charge, StorageError};
use std::collections::HashMap;
use std::future::Future;

/// The outcome of one slot's call.
pub(crate) type SlotOutcome = Result<RequestResult, StorageError>;

/// One atomic call in one hash slot: what the reservation protocol needs of
/// a cluster.
pub(crate) trait SlotCall: Sync {
    /// Evaluates and applies `charges`, all in hash slot `slot`, atomically
    /// (the semantics of [`algorithm::apply_request`](crate::storage::algorithm::apply_request)).
    fn call(&self, slot: u16, charges: &[Charge]) -> impl Future<Output = SlotOutcome> + Send;

    /// Called once the compensating refunds of a request have been sent and
    /// answered (`refunds`: what was given back, per slot), before the
    /// request is answered. Default: nothing.
    fn compensated(&self, refunds: &[(u16, Vec<Charge>)]) {
        let _ = refunds;
    }
}

/// The slots of `keys` (a request's charges, a report's buckets) in
/// first-seen order, each with the indices of its keys.
pub(crate) fn group_by_slot<'a>(
    keys: impl IntoIterator<Item = &'a str>,
    slot_of: impl Fn(&str) -> u16,
) -> Vec<(u16, Vec<usize>)> {
    let mut slots: Vec<(u16, Vec<usize>)> = Vec::new();
    let mut at: HashMap<u16, usize> = HashMap::new();
    for (i, k) in keys.into_iter().enumerate() {
        let s = slot_of(k);
        let j = *at.entry(s).or_insert_with(|| {
            slots.push((s, Vec::new()));
            slots.len() - 1
        });
        slots[j].1.push(i);
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
    // Consumes, reserves and settlements go in the first phase.
    let has_consume = charges.iter().any(|c| !c.spec.kind.gives_back());
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
        let mut after: HashMap<&str, i64> = HashMap::new();
        for ((_, idx), outcome) in refund_slots.iter().zip(outcomes) {
            let r = outcome?;
            for (&i, cr) in idx.iter().zip(r.charges) {
                after.insert(charges[i].key.as_str(), cr.remaining_micro);
                results[i] = Some(cr);
            }
        }
        // Every charge on a refunded key reports what is left after the
        // whole request, as on a single node.
        for (c, r) in charges.iter().zip(results.iter_mut()) {
            if let (Some(t), Some(r)) = (after.get(c.key.as_str()), r.as_mut()) {
                r.remaining_micro = *t;
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
        // Micro-units this slot's call took from each key.
        let mut taken: HashMap<&str, i128> = HashMap::new();
        if r.admitted {
            let mut give_back = Vec::new();
            for (&i, cr) in idx.iter().zip(&r.charges) {
                let c = &charges[i];
                // A reserve this slot admitted is undone: its estimate
                // comes back and is taken off its reservation (forgotten
                // when nothing is left; another reserve of the same id
                // keeps its own). A settlement stands, as a debt charge
                // does.
                if let ChargeKind::Reserve(res) = c.spec.kind {
                    if cr.enough {
                        *taken.entry(c.key.as_str()).or_default() +=
                            i128::try_from(c.spec.cost_micro()).unwrap_or(i128::MAX);
                        give_back.push(Charge {
                            key: c.key.clone(),
                            spec: ChargeSpec {
                                kind: ChargeKind::Unreserve { id: res.id },
                                shadow: false,
                                ..c.spec
                            },
                        });
                    }
                    continue;
                }
                let stands = c.spec.stood(cr.enough);
                if c.spec.kind == ChargeKind::Consume && (cr.enough || stands) && c.spec.cost > 0 {
                    *taken.entry(c.key.as_str()).or_default() +=
                        i128::try_from(c.spec.cost_micro()).unwrap_or(i128::MAX);
                    // A debt charge is taken whatever the request's outcome
                    // (docs/design.md, "Debt"), and so are the hits a fixed
                    // window counts when they do not fit: they are not
                    // given back.
                    if stands {
                        continue;
                    }
                    // A window gets it back in the window it was counted
                    // in (nothing once that is over: the count is gone).
                    let kind = match cr.window {
                        Some(w) => ChargeKind::Return {
                            taken_at_us: w.at_us,
                        },
                        None => ChargeKind::Refund,
                    };
                    give_back.push(Charge {
                        key: c.key.clone(),
                        spec: ChargeSpec {
                            kind,
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
                i128::from(cr.remaining_micro) + taken.get(c.key.as_str()).copied().unwrap_or(0);
            let cap = i128::try_from(c.spec.limit.capacity_micro()).unwrap_or(i128::MAX);
            // A denied request keeps no reservation: only a refusal at the
            // cap is reported (as on a single node).
            let (reservation, expired) = match c.spec.kind {
                ChargeKind::Reserve(_) if cr.reservation != ReservationOutcome::Full => {
                    (ReservationOutcome::None, 0)
                }
                _ => (cr.reservation, cr.expired),
            };
            results[i] = Some(ChargeResult {
                enough: cr.enough || c.spec.kind == ChargeKind::Refund,
                remaining_micro: i64::try_from(before.min(cap)).unwrap_or(i64::MAX),
                window: cr.window,
                reservation,
                expired,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::BackendKind;
    use crate::storage::algorithm::{BucketLimit, Limit, MICRO, MICRO_I64};
    use crate::storage::clock::ManualClock;
    use crate::storage::memory::MemoryStorage;
    use crate::storage::redis::cluster::slot::key_slot;
    use parking_lot::Mutex;
    use std::collections::HashSet;
    use std::num::NonZeroU64;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// A cluster made of one memory backend per hash slot: each slot call is
    /// atomic on its own slot, as a script call is on its node. Slots in
    /// `failing` answer `CLUSTERDOWN` and apply nothing.
    struct MemorySlots {
        clock: ManualClock,
        slots: Mutex<HashMap<u16, Arc<MemoryStorage>>>,
        failing: Mutex<HashSet<u16>>,
        compensations: AtomicUsize,
    }

    impl MemorySlots {
        fn new(clock: &ManualClock) -> Self {
            Self {
                clock: clock.clone(),
                slots: Mutex::new(HashMap::new()),
                failing: Mutex::new(HashSet::new()),
                compensations: AtomicUsize::new(0),
            }
        }

        fn slot(&self, slot: u16) -> Arc<MemoryStorage> {
            self.slots
                .lock()
                .entry(slot)
                .or_insert_with(|| Arc::new(MemoryStorage::new(Arc::new(self.clock.clone()))))
                .clone()
        }

        fn fail(&self, key: &str, failing: bool) {
            let slot = key_slot(key);
            if failing {
                self.failing.lock().insert(slot);
            } else {
                self.failing.lock().remove(&slot);
            }
        }

        /// Micro-tokens in `key`'s bucket now, read by a check that writes
        /// nothing.
        fn tokens(&self, key: &str, limit: Limit) -> i64 {
            let check = Charge {
                key: key.into(),
                spec: ChargeSpec {
                    limit,
                    cost: 0,
                    kind: ChargeKind::Consume,
                    shadow: true,
                },
            };
            self.slot(key_slot(key)).apply_sync(&[check]).charges[0].remaining_micro
        }

        async fn apply(&self, charges: &[Charge]) -> Result<RequestResult, StorageError> {
            apply_slots(
                self,
                charges,
                &group_by_slot(charges.iter().map(|c| c.key.as_str()), key_slot),
            )
            .await
        }
    }

    impl SlotCall for MemorySlots {
        async fn call(&self, slot: u16, charges: &[Charge]) -> SlotOutcome {
            // A slot call is a round trip: let other requests interleave.
            tokio::task::yield_now().await;
            assert!(
                charges.iter().all(|c| key_slot(&c.key) == slot),
                "a call with keys of another slot (CROSSSLOT)"
            );
            if self.failing.lock().contains(&slot) {
                return Err(StorageError::backend(
                    BackendKind::ClusterDown,
                    format!("hash slot {slot} unreachable"),
                ));
            }
            let storage = self.slot(slot);
            Ok(storage.apply_sync(charges))
        }

        fn compensated(&self, _refunds: &[(u16, Vec<Charge>)]) {
            self.compensations.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Five keys in five different hash slots.
    const KEYS: [&str; 5] = ["a", "b", "c", "d", "e"];

    fn limit(requests_per_unit: u32, unit_secs: u64, burst: u32) -> Limit {
        bucket(requests_per_unit, unit_secs, burst).into()
    }

    fn bucket(requests_per_unit: u32, unit_secs: u64, burst: u32) -> BucketLimit {
        BucketLimit {
            requests_per_unit,
            unit_secs: NonZeroU64::new(unit_secs).expect("a unit"),
            burst,
            max_debt: 0,
        }
    }

    fn charge(key: &str, limit: Limit, cost: u64, kind: ChargeKind, shadow: bool) -> Charge {
        Charge {
            key: key.into(),
            spec: ChargeSpec {
                limit,
                cost,
                kind,
                shadow,
            },
        }
    }

    fn consume(key: &str, limit: Limit, cost: u64) -> Charge {
        charge(key, limit, cost, ChargeKind::Consume, false)
    }

    /// A book lives in its bucket's hash slot, whether or not the bucket
    /// key has a hash tag of its own.
    #[test]
    fn a_book_is_in_its_buckets_slot() {
        for k in ["a", "rls:d3:llm|k4:user=v3:ann", "{tenant}:x", "x}{y}z"] {
            let book = crate::storage::key::book_key(k);
            assert_eq!(key_slot(&book), key_slot(k), "{k} -> {book}");
        }
    }

    fn reserve_on(key: &str, id: &str, cost: u64) -> Charge {
        let mut limit = bucket(100, 3600, 100);
        limit.max_debt = 50;
        let mut c = charge(
            key,
            limit.into(),
            cost,
            ChargeKind::Reserve(crate::storage::algorithm::Reserve {
                id: crate::storage::algorithm::ReservationId::of(id),
                ttl_secs: 60,
                max_open: 10,
            }),
            false,
        );
        c.spec.shadow = false;
        c
    }

    /// A reserve in one slot beside a charge another slot denies is undone:
    /// its estimate comes back and its reservation is forgotten; a
    /// settlement beside a denying slot stands, its book change with it.
    #[tokio::test]
    async fn a_spread_reserve_is_undone_with_the_request_and_a_settlement_stands() {
        let clock = ManualClock::new(1_000_000);
        let slots = MemorySlots::new(&clock);
        let l = limit(100, 3600, 100);
        let mut debt = bucket(100, 3600, 100);
        debt.max_debt = 50;
        let r = slots
            .apply(&[
                reserve_on("a", "r1", 30),
                consume("b", limit(1, 3600, 1), 2),
            ])
            .await
            .expect("answer");
        assert!(!r.admitted);
        assert_eq!(r.charges[0].reservation, ReservationOutcome::None);
        assert_eq!(slots.tokens("a", debt.into()), 100 * MICRO_I64);
        assert!(slots.slot(key_slot("a")).open_reservations("a").is_empty());
        // Admitted: kept.
        let r = slots
            .apply(&[reserve_on("a", "r1", 30), consume("b", l, 1)])
            .await
            .expect("answer");
        assert!(r.admitted);
        assert_eq!(r.charges[0].reservation, ReservationOutcome::Opened);
        assert_eq!(slots.tokens("a", debt.into()), 70 * MICRO_I64);
        // The same id again, denied elsewhere: its added estimate comes
        // back and is taken off the reservation, which keeps the first 30.
        let r = slots
            .apply(&[
                reserve_on("a", "r1", 10),
                consume("b", limit(1, 3600, 1), 2),
            ])
            .await
            .expect("answer");
        assert!(!r.admitted);
        assert_eq!(slots.tokens("a", debt.into()), 70 * MICRO_I64);
        assert_eq!(
            slots.slot(key_slot("a")).open_reservations("a"),
            vec![(30, 61_000_000)]
        );
        // Settled at 40 beside a denying slot: 10 more taken, book emptied.
        let mut settle = reserve_on("a", "r1", 40);
        settle.spec.kind = ChargeKind::Settle {
            id: crate::storage::algorithm::ReservationId::of("r1"),
        };
        let r = slots
            .apply(&[settle, consume("b", limit(1, 3600, 1), 2)])
            .await
            .expect("answer");
        assert!(!r.admitted);
        assert_eq!(r.charges[0].reservation, ReservationOutcome::Settled);
        assert_eq!(slots.tokens("a", debt.into()), 60 * MICRO_I64);
        assert!(slots.slot(key_slot("a")).open_reservations("a").is_empty());
    }

    #[test]
    fn the_test_keys_are_in_different_slots() {
        let slots: HashSet<u16> = KEYS.iter().map(|k| key_slot(k)).collect();
        assert_eq!(slots.len(), KEYS.len());
    }

    /// Without other traffic, a request spread over slots answers exactly
    /// as one node does (statuses included) and leaves the same tokens, for
    /// random requests of consumes, checks, shadow charges and refunds (on
    /// buckets the same request does not consume: the documented
    /// difference). The unit is one second, where refill is a whole number
    /// of micro-tokens per microsecond: with longer units a compensation's
    /// write drops the refill remainder below one micro-token (see the
    /// module docs of the cluster).
    #[tokio::test]
    async fn spread_requests_answer_as_one_node() {
        let clock = ManualClock::new(1_000_000_000);
        let slots = MemorySlots::new(&clock);
        let one_node = MemoryStorage::new(Arc::new(clock.clone()));
        let l = limit(5, 1, 5);
        let mut seed: u64 = 0x2545_F491_4F6C_DD1D;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let (mut admitted, mut denied) = (0, 0);
        for step in 0..2000 {
            clock.advance(Duration::from_micros(next(400_000)));
            let n = 1 + next(4);
            let mut charges: Vec<Charge> = Vec::new();
            for _ in 0..n {
                let key = KEYS[usize::try_from(next(5)).expect("small")];
                let consumed = charges
                    .iter()
                    .any(|c| c.key == key && c.spec.kind == ChargeKind::Consume);
                let refunded = charges
                    .iter()
                    .any(|c| c.key == key && c.spec.kind == ChargeKind::Refund);
                let c = if next(6) == 0 && !consumed {
                    charge(key, l, next(4), ChargeKind::Refund, false)
                } else if refunded {
                    continue;
                } else {
                    charge(key, l, next(4), ChargeKind::Consume, next(8) == 0)
                };
                charges.push(c);
            }
            let want = one_node.apply_sync(&charges);
            let got = slots.apply(&charges).await.expect("no slot fails");
            assert_eq!(got, want, "step {step}: {charges:?}");
            if want.admitted {
                admitted += 1;
            } else {
                denied += 1;
            }
            for key in KEYS {
                let single = one_node.apply_sync(&[charge(key, l, 0, ChargeKind::Consume, true)]);
                assert_eq!(
                    slots.tokens(key, l),
                    single.charges[0].remaining_micro,
                    "step {step}: tokens of {key}"
                );
            }
        }
        assert!(
            admitted > 100 && denied > 100,
            "{admitted} admitted, {denied} denied"
        );
    }

    /// A slot that denies makes the others give back exactly what they
    /// reserved (no more: the bucket is below capacity), and the statuses
    /// report the tokens before the reservation.
    #[tokio::test]
    async fn a_denying_slot_makes_the_others_give_back_what_they_reserved() {
        let clock = ManualClock::new(1_000_000_000);
        let slots = MemorySlots::new(&clock);
        // Nothing refills during the test.
        let l = limit(5, 31_536_000, 5);
        assert!(
            slots
                .apply(&[consume("a", l, 2)])
                .await
                .expect("ok")
                .admitted
        );
        assert!(
            slots
                .apply(&[consume("b", l, 5)])
                .await
                .expect("ok")
                .admitted
        );
        let r = slots
            .apply(&[
                consume("a", l, 2),
                charge("c", l, 1, ChargeKind::Consume, true),
                consume("b", l, 1),
            ])
            .await
            .expect("no slot fails");
        assert!(!r.admitted);
        let tokens: Vec<(bool, i64)> = r
            .charges
            .iter()
            .map(|c| (c.enough, c.remaining_micro))
            .collect();
        assert_eq!(
            tokens,
            [(true, 3 * MICRO_I64), (true, 5 * MICRO_I64), (false, 0)]
        );
        assert_eq!(slots.tokens("a", l), 3 * MICRO_I64, "a got back exactly 2");
        assert_eq!(
            slots.tokens("c", l),
            5 * MICRO_I64,
            "the shadow charge was given back"
        );
        assert_eq!(slots.tokens("b", l), 0);
        assert_eq!(slots.compensations.load(Ordering::SeqCst), 1);
    }

    /// Debt charges are taken whatever the outcome, in the slot that denies
    /// and in the slots that admit, and are never compensated; the other
    /// charges of a denied request are given back exactly.
    #[tokio::test]
    async fn debt_charges_are_kept_when_the_others_are_compensated() {
        let clock = ManualClock::new(1_000_000_000);
        let slots = MemorySlots::new(&clock);
        let l = limit(5, 31_536_000, 5);
        let debt = Limit::from(BucketLimit {
            max_debt: 10,
            ..bucket(100, 31_536_000, 100)
        });
        assert!(
            slots
                .apply(&[consume("b", l, 5)])
                .await
                .expect("ok")
                .admitted
        );
        // "b" denies; "a" (debt) and "c" admitted in their slots.
        let r = slots
            .apply(&[
                consume("a", debt, 30),
                consume("b", l, 1),
                consume("c", l, 2),
            ])
            .await
            .expect("no slot fails");
        assert!(!r.admitted);
        assert_eq!(
            r.charges[0],
            ChargeResult {
                enough: true,
                remaining_micro: 100 * MICRO_I64,
                window: None,
                ..ChargeResult::default()
            }
        );
        assert_eq!(
            slots.tokens("a", debt),
            70 * MICRO_I64,
            "the debt charge is kept"
        );
        assert_eq!(slots.tokens("c", l), 5 * MICRO_I64, "c got its 2 back");
        // The debt rule itself denies (in its own slot): charged and clamped
        // at -10; "c" is compensated.
        let r = slots
            .apply(&[consume("a", debt, 500), consume("c", l, 1)])
            .await
            .expect("no slot fails");
        assert!(!r.admitted);
        assert_eq!(
            r.charges[0],
            ChargeResult {
                enough: false,
                remaining_micro: 70 * MICRO_I64,
                window: None,
                ..ChargeResult::default()
            }
        );
        assert_eq!(slots.tokens("a", debt), -10 * MICRO_I64);
        assert_eq!(slots.tokens("c", l), 5 * MICRO_I64);
    }

    /// A slot that fails fails the whole request, every time, and the other
    /// slots get their reservations back: a failing slot never admits a
    /// request nor leaves the others charged. Once it answers again, the
    /// same request is admitted and charged once.
    #[tokio::test]
    async fn a_failing_slot_fails_the_request_and_the_others_get_their_tokens_back() {
        let clock = ManualClock::new(1_000_000_000);
        let slots = MemorySlots::new(&clock);
        let l = limit(10, 31_536_000, 10);
        assert!(
            slots
                .apply(&[consume("a", l, 3)])
                .await
                .expect("ok")
                .admitted
        );
        slots.fail("b", true);
        let request = [consume("a", l, 2), consume("b", l, 1), consume("c", l, 4)];
        for _ in 0..20 {
            let e = slots.apply(&request).await.expect_err("slot b is down");
            assert_eq!(e.kind(), "CLUSTERDOWN");
            assert_eq!(slots.tokens("a", l), 7 * MICRO_I64);
            assert_eq!(slots.tokens("c", l), 10 * MICRO_I64);
        }
        assert_eq!(slots.compensations.load(Ordering::SeqCst), 20);
        slots.fail("b", false);
        assert!(slots.apply(&request).await.expect("ok").admitted);
        assert_eq!(slots.tokens("a", l), 5 * MICRO_I64);
        assert_eq!(slots.tokens("b", l), 9 * MICRO_I64);
        assert_eq!(slots.tokens("c", l), 6 * MICRO_I64);
    }

    /// Many requests at once over overlapping buckets in different slots,
    /// with reservations and compensations interleaving: no bucket ever
    /// admits more than its capacity, and when all are done every bucket
    /// holds exactly its capacity minus what admitted requests took (no
    /// token lost to a compensation, none created by one).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_spread_requests_keep_the_budget_exact() {
        let clock = ManualClock::new(1_000_000_000);
        let slots = Arc::new(MemorySlots::new(&clock));
        let cap = 40u32;
        let l = limit(cap, 31_536_000, cap);
        let shapes: [&[(&str, u64)]; 4] = [
            &[("a", 1), ("b", 1)],
            &[("b", 2), ("c", 1)],
            &[("a", 1), ("c", 3), ("d", 1)],
            &[("d", 2), ("a", 1)],
        ];
        let tasks: Vec<_> = (0..200)
            .map(|i| {
                let slots = slots.clone();
                let shape = shapes[i % shapes.len()];
                tokio::spawn(async move {
                    let charges: Vec<Charge> =
                        shape.iter().map(|(k, cost)| consume(k, l, *cost)).collect();
                    let r = slots.apply(&charges).await.expect("no slot fails");
                    r.admitted.then_some(shape)
                })
            })
            .collect();
        let mut taken: HashMap<&str, u64> = HashMap::new();
        let mut admitted = 0;
        for t in tasks {
            if let Some(shape) = t.await.expect("task") {
                admitted += 1;
                for (k, cost) in shape {
                    *taken.entry(k).or_default() += cost;
                }
            }
        }
        assert!(admitted > 0 && admitted < 200, "{admitted} admitted");
        for key in ["a", "b", "c", "d"] {
            let took = taken.get(key).copied().unwrap_or(0);
            assert!(took <= u64::from(cap), "{key}: {took} admitted");
            assert_eq!(
                slots.tokens(key, l),
                i64::try_from((u64::from(cap) - took) * MICRO).expect("small"),
                "{key}: tokens after the run"
            );
        }
    }
}
