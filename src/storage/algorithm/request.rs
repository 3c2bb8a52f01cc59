//! The per-request driver every backend runs ([`apply_request`]): the
//! charges of one request evaluated together, all-or-nothing, whatever mix
//! of algorithms and reservations they carry; and what the limiter derives
//! from a request's charges (its needs, the remaining count after a
//! denial, whole units, whole seconds). The Lua driver `lua/request.lua`
//! mirrors [`apply_request_with_books`] and is tested against it.

use super::*;

/// Evaluates and applies all charges of one request atomically
/// (docs/design.md, "All-or-nothing requests"):
///
/// 1. Charges are simulated in order on working copies, so two charges on
///    the same key add up. A shadow charge that lacks tokens does not deny
///    (and is not charged, but by a fixed window, which counts it).
/// 2. If every non-shadow consume charge had enough, the simulated states
///    are written (`put`); otherwise nothing is written, refunds included,
///    except the charges that stand ([`Consumed::stands`]): the consumes on
///    a bucket with `max_debt: D > 0`, always, and on a fixed window, the
///    hits it had no room for. In a denied request those charges are
///    applied on their own (in order, from the stored state), so the other
///    keys stay uncharged.
///
/// `states[i]` is the stored state of key `i` (`None` = never seen; a
/// state of another algorithm is read as never seen); charges on the same
/// key must carry the same key index and the same algorithm. `put`
/// receives `(key index, new state)` for every key whose state changed,
/// stored under the limit of the key's last charge. Cost-0 checks and
/// refunds on a full bucket write nothing.
pub fn apply_request(
    charges: &[(usize, ChargeSpec)],
    states: &[Option<State>],
    now_us: u64,
    put: impl FnMut(usize, State),
) -> RequestResult {
    apply_request_with_books(charges, states, &[], now_us, put, |_, _| {})
}

/// [`apply_request`] with the books of reservations
/// ([`reservation`], docs/design.md, "Reservations"): `books[i]` is the
/// stored book of key `i` (missing or `None`: empty). A
/// [`ChargeKind::Reserve`] is a consume that never stands in a denied
/// request and, in an admitted one, records its estimate; a
/// [`ChargeKind::Settle`] always has enough and always stands, with its
/// book change. `put_book` receives `(key index, new book)` for every
/// book that changed (an empty book: delete it): in an admitted request
/// what every charge left, in a denied one what the settlements alone
/// left. Reservation charges on a key that is not a token bucket act as a
/// plain consume.
pub fn apply_request_with_books(
    charges: &[(usize, ChargeSpec)],
    states: &[Option<State>],
    books: &[Option<&Book>],
    now_us: u64,
    mut put: impl FnMut(usize, State),
    mut put_book: impl FnMut(usize, Book),
) -> RequestResult {
    // Per key: the level after every charge, whether it changed and the
    // limit of its last charge; the level after only the charges that
    // stand, with the limit of the last of them; the level read before any
    // charge when the stored state is stale.
    let mut work: SmallVec<[Option<(Level, bool, Limit)>; 4]> = smallvec![None; states.len()];
    let mut kept: SmallVec<[Option<(Level, Limit)>; 4]> = smallvec![None; states.len()];
    let mut stale: SmallVec<[Option<Level>; 4]> = smallvec![None; states.len()];
    // Per key touched by a reservation charge: the working book and
    // whether it changed; the book after the settlements alone.
    let mut wbook: SmallVec<[Option<(Book, bool)>; 4]> = SmallVec::new();
    let mut kbook: SmallVec<[Option<(Book, bool)>; 4]> = SmallVec::new();
    let stored_book = |key: usize| {
        books
            .get(key)
            .copied()
            .flatten()
            .cloned()
            .unwrap_or_default()
    };
    let mut results = Vec::with_capacity(charges.len());
    let mut admitted = true;
    for (key, spec) in charges {
        let limit = &spec.limit;
        let slot = match &mut work[*key] {
            // A later charge on the same key may carry another limit.
            Some(slot) => {
                slot.0 = limit.rebase(&slot.2, slot.0, now_us);
                slot.2 = *limit;
                slot
            }
            none => {
                let (level, is_stale) = limit.read(states[*key].as_ref(), now_us);
                if is_stale {
                    stale[*key] = Some(level);
                }
                none.insert((level, false, *limit))
            }
        };
        let bucket = match (limit, spec.kind) {
            (
                Limit::TokenBucket(l),
                ChargeKind::Reserve(_) | ChargeKind::Settle { .. } | ChargeKind::Unreserve { .. },
            ) => {
                if wbook.is_empty() {
                    wbook = smallvec![None; states.len()];
                    kbook = smallvec![None; states.len()];
                }
                Some(*l)
            }
            _ => None,
        };
        match (spec.kind, bucket) {
            (ChargeKind::Reserve(r), Some(l)) => {
                let (book, book_dirty) =
                    wbook[*key].get_or_insert_with(|| (stored_book(*key), false));
                let (full, expired) = reservation::make_room(book, &r, now_us);
                // A reserve never stands: the bucket's debt bound does not
                // apply to it.
                let plain = Limit::TokenBucket(BucketLimit { max_debt: 0, ..l });
                let c = plain.consume(slot.0, spec.cost, now_us);
                let enough = c.enough && !full;
                let mut outcome = if full {
                    ReservationOutcome::Full
                } else {
                    ReservationOutcome::None
                };
                if expired > 0 {
                    *book_dirty = true;
                }
                if enough {
                    if c.changed {
                        slot.0 = c.level;
                        slot.1 = true;
                    }
                    outcome = reservation::record(book, &r, spec.cost, now_us);
                    *book_dirty = true;
                } else if !spec.shadow {
                    admitted = false;
                }
                results.push(ChargeResult {
                    enough,
                    reservation: outcome,
                    expired,
                    ..ChargeResult::default()
                });
            }
            (ChargeKind::Settle { id }, Some(l)) => {
                let Level::TokenBucket(v) = slot.0 else {
                    unreachable!("a token bucket limit reads a token bucket level")
                };
                let (book, book_dirty) =
                    wbook[*key].get_or_insert_with(|| (stored_book(*key), false));
                let (after, outcome, expired) =
                    reservation::settle(&l, v, book, &id, spec.cost, now_us);
                if after != v {
                    slot.0 = Level::TokenBucket(after);
                    slot.1 = true;
                }
                if outcome == ReservationOutcome::Settled || expired {
                    *book_dirty = true;
                }
                // Stands: the same settlement on the level and book of
                // the charges that stand.
                let from = match kept[*key] {
                    Some((k, from)) => limit.rebase(&from, k, now_us),
                    None => limit.read(states[*key].as_ref(), now_us).0,
                };
                let Level::TokenBucket(kv) = from else {
                    unreachable!("a token bucket limit reads a token bucket level")
                };
                let (kb, kb_dirty) = kbook[*key].get_or_insert_with(|| (stored_book(*key), false));
                let (kafter, kout, kexp) = reservation::settle(&l, kv, kb, &id, spec.cost, now_us);
                if kout == ReservationOutcome::Settled || kexp {
                    *kb_dirty = true;
                }
                kept[*key] = Some((Level::TokenBucket(kafter), *limit));
                results.push(ChargeResult {
                    enough: true,
                    reservation: outcome,
                    expired: u32::from(expired),
                    ..ChargeResult::default()
                });
            }
            (ChargeKind::Unreserve { id }, Some(l)) => {
                let Level::TokenBucket(v) = slot.0 else {
                    unreachable!("a token bucket limit reads a token bucket level")
                };
                let (book, book_dirty) =
                    wbook[*key].get_or_insert_with(|| (stored_book(*key), false));
                let (after, changed) = reservation::unreserve(&l, v, book, &id, spec.cost, now_us);
                if after != v {
                    slot.0 = Level::TokenBucket(after);
                    slot.1 = true;
                }
                if changed {
                    *book_dirty = true;
                }
                results.push(ChargeResult {
                    enough: true,
                    ..ChargeResult::default()
                });
            }
            (ChargeKind::Refund | ChargeKind::Return { .. } | ChargeKind::Unreserve { .. }, _) => {
                let taken_at_us = match spec.kind {
                    ChargeKind::Return { taken_at_us } => Some(taken_at_us),
                    _ => None,
                };
                let new = limit.refund(slot.0, spec.cost, taken_at_us, now_us);
                if new != slot.0 {
                    slot.0 = new;
                    slot.1 = true;
                }
                results.push(ChargeResult {
                    enough: true,
                    ..ChargeResult::default()
                });
            }
            (ChargeKind::Consume | ChargeKind::Reserve(_) | ChargeKind::Settle { .. }, _) => {
                let c = limit.consume(slot.0, spec.cost, now_us);
                if c.changed {
                    slot.0 = c.level;
                    slot.1 = true;
                }
                if c.stands {
                    let from = match kept[*key] {
                        Some((k, from)) => limit.rebase(&from, k, now_us),
                        None => limit.read(states[*key].as_ref(), now_us).0,
                    };
                    kept[*key] = Some((limit.consume(from, spec.cost, now_us).level, *limit));
                }
                if !c.enough && !spec.shadow {
                    admitted = false;
                }
                results.push(ChargeResult {
                    enough: c.enough,
                    ..ChargeResult::default()
                });
            }
        }
    }
    for i in 0..states.len() {
        let Some((level, dirty, last)) = work[i] else {
            continue;
        };
        let written = if admitted {
            dirty.then_some(level)
        } else {
            // The charges that stand were applied under their own limits:
            // their level is rebased to the limit it is stored under (the
            // key's last charge), as the next request reads it.
            kept[i].map(|(k, from)| last.rebase(&from, k, now_us))
        };
        // Every write stores now. A key stamped after now (a clock stepped
        // back) that nothing else writes is written as it was read, stamped
        // now, admitted or not: otherwise every later call would read "no
        // time elapsed" until the clock caught up (a freeze).
        let Some(level) = written.or(stale[i]) else {
            continue;
        };
        put(i, last.store(level, now_us));
    }
    let written_books = if admitted { &mut wbook } else { &mut kbook };
    for (i, b) in written_books.iter_mut().enumerate() {
        if let Some((book, true)) = b.take() {
            put_book(i, book);
        }
    }
    if admitted {
        // Report what is left after the whole request, under the limit of
        // the key's last charge.
        for ((key, _), r) in charges.iter().zip(results.iter_mut()) {
            if let Some((level, _, last)) = work[*key] {
                let report = last.report(level, now_us);
                r.remaining_micro = report.remaining_micro;
                r.window = report.window;
            }
        }
    } else {
        // Report what was left before the request, under each charge's limit.
        for ((key, spec), r) in charges.iter().zip(results.iter_mut()) {
            let report = spec
                .limit
                .report(spec.limit.read(states[*key].as_ref(), now_us).0, now_us);
            r.remaining_micro = report.remaining_micro;
            r.window = report.window;
            // A denied request keeps no reserve; expired entries count only
            // where their book was written.
            if spec.kind.takes() {
                r.expired = 0;
                if r.reservation != ReservationOutcome::Full {
                    r.reservation = ReservationOutcome::None;
                }
            }
        }
    }
    RequestResult {
        admitted,
        charges: results,
    }
}

/// For a denied request: per charge, what its key has left after every
/// charge of the request [taken when denied](ChargeSpec::taken_when_denied)
/// on that key (micro-units, replayed from what storage reported before the
/// request), or `None` for a key no such charge touched. Empty when the
/// request has no such charge (the usual case).
#[must_use]
pub fn remaining_after_denial(
    charges: &[crate::storage::Charge],
    result: &RequestResult,
) -> Vec<Option<i64>> {
    if !charges.iter().any(|c| c.spec.taken_when_denied()) {
        return Vec::new();
    }
    let mut level: std::collections::HashMap<&str, (Level, Limit, u64)> =
        std::collections::HashMap::new();
    for (c, r) in charges.iter().zip(&result.charges) {
        if !c.spec.taken_when_denied() {
            continue;
        }
        let limit = &c.spec.limit;
        let at = r.window.map_or(0, |w| w.at_us);
        let (l, from, _) = level
            .entry(c.key.as_str())
            .or_insert_with(|| (limit.level_of_report(&r.report()), *limit, at));
        *l = limit
            .consume(limit.rebase(from, *l, at), c.spec.cost, at)
            .level;
        *from = *limit;
    }
    charges
        .iter()
        .map(|c| {
            level
                .get(c.key.as_str())
                .map(|(l, limit, at)| limit.report(*l, *at).remaining_micro)
        })
        .collect()
}

/// Micro-units each charge needs on its key for the whole request to pass,
/// in charge order: a consume needs its own cost (at least 1 token: a check
/// needs one) plus the costs of the earlier consumes of the same request on
/// the same key (shadow ones too: they take tokens). An earlier refund is
/// not subtracted, so a wait computed from it is never too short. Refunds
/// need 0.
#[must_use]
pub fn request_needs(charges: &[crate::storage::Charge]) -> Vec<u128> {
    // Taken so far per key: a list searched in order for a few charges (no
    // hashing), a map for many.
    const LINEAR_UP_TO: usize = 16;
    let mut few: SmallVec<[(&str, u128); LINEAR_UP_TO]> = SmallVec::new();
    let mut many: std::collections::HashMap<&str, u128> = std::collections::HashMap::new();
    charges
        .iter()
        .map(|c| {
            if !c.spec.kind.takes() {
                return 0;
            }
            let key = c.key.as_str();
            let taken_before = if charges.len() <= LINEAR_UP_TO {
                let i = few.iter().position(|(k, _)| *k == key).unwrap_or_else(|| {
                    few.push((key, 0));
                    few.len() - 1
                });
                &mut few[i].1
            } else {
                many.entry(key).or_insert(0)
            };
            let need = *taken_before + c.spec.own_need_micro();
            *taken_before += c.spec.cost_micro();
            need
        })
        .collect()
}

/// Whole units left for `remaining_micro` (rounded down; 0 while in debt).
#[must_use]
pub fn whole(remaining_micro: i64) -> u32 {
    u32::try_from(remaining_micro.max(0).unsigned_abs() / MICRO).unwrap_or(u32::MAX)
}

/// Whole seconds, rounded up, for a wait in microseconds (docs/design.md,
/// "Durations": Envoy reads only `seconds`, so 2.5 s must be sent as 3).
#[must_use]
pub fn ceil_secs(us: u128) -> u64 {
    u64::try_from(us.div_ceil(1_000_000)).unwrap_or(u64::MAX)
}
