//! Reservations on a token bucket: an estimate taken when a request starts
//! and settled against the real cost when its response ends
//! (docs/design.md, "Reservations").
//!
//! A bucket's open reservations are its *book*: per reservation id, the
//! tokens it holds and when it is forgotten. The book lives beside the
//! bucket and changes in the same atomic step as the bucket's balance (the
//! memory backend's shard lock; one Redis script call, with the book in a
//! hash in the bucket's hash slot). This module holds the types and the
//! arithmetic; the request driver ([`apply_request_with_books`]) applies
//! them, and `lua/request.lua` mirrors it.
//!
//! [`apply_request_with_books`]: super::apply_request_with_books

use super::MICRO;
use super::token_bucket::{BucketLimit, charge_debt};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// Longest reservation id accepted, in bytes (Envoy's generated
/// `x-request-id` is a 36-byte UUID). A longer id is refused as an invalid
/// request, so a client cannot make the service hash megabytes per call.
pub const MAX_RESERVATION_ID_BYTES: usize = 128;

/// Default most open reservations per bucket (`reservation.max_open`).
pub const DEFAULT_MAX_OPEN: u32 = 1000;

/// Most open reservations per bucket a rule may allow.
pub const MAX_MAX_OPEN: u32 = 100_000;

/// Most tokens one reservation holds, and the largest settlement cost
/// stored or sent to the script (2^33, about 8.6 billion tokens: beyond a
/// capacity plus a debt bound, each at most `u32::MAX`, so no outcome
/// changes, and times a million still exact in Lua's doubles).
pub const MAX_HELD_TOKENS: u64 = 1 << 33;

/// Longest reservation TTL a rule may set, in seconds (one week).
pub const MAX_TTL_SECS: u32 = 7 * 24 * 3600;

/// A reservation id as stored: the first 16 bytes of the SHA-256 of the
/// id the request carried, so every id takes the same few bytes in
/// storage and no id is stored verbatim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReservationId(pub [u8; 16]);

impl ReservationId {
    /// The stored form of the request's id `id` (at most
    /// [`MAX_RESERVATION_ID_BYTES`]; the caller checks).
    #[must_use]
    pub fn of(id: &str) -> Self {
        Self::of_bytes(id.as_bytes())
    }

    /// [`ReservationId::of`] for an id given as bytes.
    #[must_use]
    pub fn of_bytes(id: &[u8]) -> Self {
        let digest = Sha256::digest(id);
        let mut out = [0u8; 16];
        out.copy_from_slice(&digest[..16]);
        Self(out)
    }
}

/// A reserve: take the estimate (the charge's cost) like any consume and,
/// when the request is admitted, keep it under `id` for `ttl_secs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reserve {
    /// The reservation's id.
    pub id: ReservationId,
    /// Seconds the reservation is kept when never settled (1 ..
    /// [`MAX_TTL_SECS`]).
    pub ttl_secs: u32,
    /// Most open reservations the bucket keeps; a new id past it is denied.
    pub max_open: u32,
}

/// One open reservation: the tokens it holds and when it is forgotten.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Held {
    /// Tokens taken by the reserves of this id.
    pub tokens: u64,
    /// When it is forgotten (its estimate stays charged), microseconds
    /// since the Unix epoch on storage's clock.
    pub expires_us: u64,
}

/// A bucket's open reservations, by id (ordered, so two books compare
/// equal whatever order they were built in).
pub type Book = BTreeMap<ReservationId, Held>;

/// What a reserve or a settlement did to the book, reported per charge.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ReservationOutcome {
    /// Not a reservation charge, or a reserve the bucket lacked tokens for.
    #[default]
    None,
    /// A reserve opened a new reservation.
    Opened,
    /// A reserve added its estimate to a reservation still open.
    Added,
    /// A reserve refused: the bucket already holds `max_open` open
    /// reservations.
    Full,
    /// A settlement found its reservation and settled it.
    Settled,
    /// A settlement found no open reservation (expired, or settled
    /// already): charged in full.
    Unmatched,
}

impl ReservationOutcome {
    /// The outcome's number in the script's reply (bits 2..4 of a
    /// charge's flags byte).
    #[must_use]
    pub const fn code(self) -> u8 {
        match self {
            Self::None => 0,
            Self::Opened => 1,
            Self::Added => 2,
            Self::Full => 3,
            Self::Settled => 4,
            Self::Unmatched => 5,
        }
    }

    /// The outcome of number `code` ([`ReservationOutcome::code`]).
    #[must_use]
    pub const fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => Self::None,
            1 => Self::Opened,
            2 => Self::Added,
            3 => Self::Full,
            4 => Self::Settled,
            5 => Self::Unmatched,
            _ => return None,
        })
    }
}

/// What a reserve finds in `book` for `r` at `now_us`: whether the bucket
/// is full of other open reservations, and how many expired entries it
/// dropped from `book` to find out (the id's own expired entry, and at the
/// cap every expired entry).
pub(crate) fn make_room(book: &mut Book, r: &Reserve, now_us: u64) -> (bool, u32) {
    let mut expired = 0;
    match book.get(&r.id) {
        Some(h) if h.expires_us > now_us => return (false, 0),
        Some(_) => {
            book.remove(&r.id);
            expired += 1;
        }
        None => {}
    }
    if book.len() >= r.max_open as usize {
        let before = book.len();
        book.retain(|_, h| h.expires_us > now_us);
        expired += u32::try_from(before - book.len()).unwrap_or(u32::MAX);
    }
    (book.len() >= r.max_open as usize, expired)
}

/// Records an admitted reserve of `cost` tokens in `book`: a new entry, or
/// the cost added to the id's open entry; either way kept `ttl_secs` from
/// now.
pub(crate) fn record(book: &mut Book, r: &Reserve, cost: u64, now_us: u64) -> ReservationOutcome {
    let expires_us = now_us.saturating_add(u64::from(r.ttl_secs) * 1_000_000);
    match book.get_mut(&r.id) {
        Some(h) => {
            h.tokens = h.tokens.saturating_add(cost).min(MAX_HELD_TOKENS);
            h.expires_us = expires_us;
            ReservationOutcome::Added
        }
        None => {
            book.insert(
                r.id,
                Held {
                    tokens: cost.min(MAX_HELD_TOKENS),
                    expires_us,
                },
            );
            ReservationOutcome::Opened
        }
    }
}

/// A settlement of `actual` tokens for `id` on a bucket at `level`
/// (micro-tokens): removes the reservation from `book` and returns the
/// level after it, the outcome and whether an expired entry was dropped.
/// Found: the difference to its estimate is charged (down to `-max_debt`,
/// never raised by the clamp) or given back (never above the capacity).
/// Not found (or expired): `actual` is charged in full, the same way.
/// `actual` counts at most [`MAX_HELD_TOKENS`].
pub(crate) fn settle(
    limit: &BucketLimit,
    level: i128,
    book: &mut Book,
    id: &ReservationId,
    actual: u64,
    now_us: u64,
) -> (i128, ReservationOutcome, bool) {
    let debt = i128::try_from(limit.debt_micro()).unwrap_or(0);
    let actual = actual.min(MAX_HELD_TOKENS);
    match book.remove(id) {
        Some(h) if h.expires_us > now_us => {
            let level = if actual >= h.tokens {
                charge_debt(level, actual - h.tokens, debt)
            } else {
                let cap = i128::try_from(limit.capacity_micro()).unwrap_or(i128::MAX);
                let back = i128::from(h.tokens - actual) * i128::from(MICRO);
                level.saturating_add(back).min(cap).max(level)
            };
            (level, ReservationOutcome::Settled, false)
        }
        held => (
            charge_debt(level, actual, debt),
            ReservationOutcome::Unmatched,
            held.is_some(),
        ),
    }
}

/// The undoing of an admitted reserve of `cost` tokens for `id` on a
/// bucket at `level`: `cost` given back (never above the capacity) and
/// taken off the open reservation, which is forgotten when that leaves
/// nothing. Returns the level after it and whether the book changed.
/// `cost` counts at most [`MAX_HELD_TOKENS`].
pub(crate) fn unreserve(
    limit: &BucketLimit,
    level: i128,
    book: &mut Book,
    id: &ReservationId,
    cost: u64,
    now_us: u64,
) -> (i128, bool) {
    let cost = cost.min(MAX_HELD_TOKENS);
    let cap = i128::try_from(limit.capacity_micro()).unwrap_or(i128::MAX);
    let level = level
        .saturating_add(i128::from(cost) * i128::from(MICRO))
        .min(cap)
        .max(level);
    let changed = match book.get_mut(id) {
        Some(h) if h.expires_us > now_us => {
            if h.tokens <= cost {
                book.remove(id);
            } else {
                h.tokens -= cost;
            }
            true
        }
        _ => false,
    };
    (level, changed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU64;

    fn lim(max_debt: u32) -> BucketLimit {
        BucketLimit {
            requests_per_unit: 1000,
            unit_secs: NonZeroU64::new(3600).expect("non-zero"),
            burst: 1000,
            max_debt,
        }
    }

    const M: i128 = MICRO as i128;

    #[test]
    fn a_settlement_charges_the_excess_and_gives_back_the_rest() {
        let id = ReservationId::of("a");
        let r = Reserve {
            id,
            ttl_secs: 60,
            max_open: 10,
        };
        let mut book = Book::new();
        assert_eq!(record(&mut book, &r, 100, 0), ReservationOutcome::Opened);
        // Actual 150: 50 more.
        let (l, o, exp) = settle(&lim(500), 500 * M, &mut book.clone(), &id, 150, 1);
        assert_eq!((l, o, exp), (450 * M, ReservationOutcome::Settled, false));
        // Actual 30: 70 back, never above the capacity.
        let (l, _, _) = settle(&lim(500), 500 * M, &mut book.clone(), &id, 30, 1);
        assert_eq!(l, 570 * M);
        let (l, _, _) = settle(&lim(500), 990 * M, &mut book.clone(), &id, 30, 1);
        assert_eq!(l, 1000 * M);
        // In debt the excess is clamped at -max_debt.
        let (l, _, _) = settle(&lim(500), -400 * M, &mut book.clone(), &id, 400, 1);
        assert_eq!(l, -500 * M);
        // Settled: gone, a second settlement is charged in full.
        let (l, o, _) = settle(&lim(500), 500 * M, &mut book, &id, 150, 1);
        assert_eq!((l, o), (450 * M, ReservationOutcome::Settled));
        let (l, o, exp) = settle(&lim(500), l, &mut book, &id, 150, 2);
        assert_eq!((l, o, exp), (300 * M, ReservationOutcome::Unmatched, false));
    }

    #[test]
    fn an_expired_reservation_is_dropped_and_its_settlement_charged_in_full() {
        let id = ReservationId::of("late");
        let r = Reserve {
            id,
            ttl_secs: 1,
            max_open: 10,
        };
        let mut book = Book::new();
        record(&mut book, &r, 100, 0);
        let (l, o, exp) = settle(&lim(0), 800 * M, &mut book, &id, 40, 1_000_000);
        assert_eq!((l, o, exp), (760 * M, ReservationOutcome::Unmatched, true));
        assert!(book.is_empty());
        // Without a debt bound a settlement takes what is there, down to 0.
        let (l, _, _) = settle(&lim(0), 10 * M, &mut book, &id, 40, 2_000_000);
        assert_eq!(l, 0);
    }

    #[test]
    fn the_cap_counts_open_reservations_only() {
        let r = |s: &str| Reserve {
            id: ReservationId::of(s),
            ttl_secs: 1,
            max_open: 2,
        };
        let mut book = Book::new();
        record(&mut book, &r("a"), 1, 0);
        record(&mut book, &r("b"), 1, 500_000);
        assert_eq!(make_room(&mut book, &r("c"), 900_000), (true, 0));
        // The open id itself always has room.
        assert_eq!(make_room(&mut book, &r("a"), 900_000), (false, 0));
        // Once "a" expired, its slot is free again.
        assert_eq!(make_room(&mut book, &r("c"), 1_000_000), (false, 1));
        assert_eq!(book.len(), 1);
        assert_eq!(
            record(&mut book, &r("b"), 2, 1_000_000),
            ReservationOutcome::Added
        );
        assert_eq!(book[&ReservationId::of("b")].tokens, 3);
    }

    use super::super::{ChargeKind, ChargeSpec, RequestResult, State, apply_request_with_books};

    /// One bucket under the request driver: its state and book, kept
    /// between calls as a backend would keep them.
    struct Bucket {
        limit: BucketLimit,
        state: Option<State>,
        book: Option<Book>,
    }

    impl Bucket {
        fn new(limit: BucketLimit) -> Self {
            Self {
                limit,
                state: None,
                book: None,
            }
        }

        /// Applies one request of `(key 0 or 1, kind, cost)` charges, key 1
        /// being a plain bucket of 5 tokens.
        fn apply(
            &mut self,
            other: &mut Option<State>,
            charges: &[(usize, ChargeKind, u64)],
            now: u64,
        ) -> RequestResult {
            let plain = BucketLimit {
                requests_per_unit: 5,
                unit_secs: NonZeroU64::new(3600).expect("non-zero"),
                burst: 5,
                max_debt: 0,
            };
            let specs: Vec<(usize, ChargeSpec)> = charges
                .iter()
                .map(|&(k, kind, cost)| {
                    let limit = if k == 0 { self.limit } else { plain };
                    (
                        k,
                        ChargeSpec {
                            limit: limit.into(),
                            cost,
                            kind,
                            shadow: false,
                        },
                    )
                })
                .collect();
            let states = [self.state, *other];
            let books = [self.book.as_ref(), None];
            let mut puts = Vec::new();
            let mut book_puts = Vec::new();
            let r = apply_request_with_books(
                &specs,
                &states,
                &books,
                now,
                |i, s| puts.push((i, s)),
                |i, b| book_puts.push((i, b)),
            );
            for (i, s) in puts {
                if i == 0 {
                    self.state = Some(s)
                } else {
                    *other = Some(s)
                }
            }
            for (i, b) in book_puts {
                assert_eq!(i, 0, "only the reserving bucket has a book");
                self.book = Some(b);
            }
            r
        }

        fn balance(&self, now: u64) -> i128 {
            self.state
                .and_then(|s| s.token_bucket().map(|b| b.tokens_at(&self.limit, now)))
                .unwrap_or(i128::from(self.limit.burst) * M)
        }

        fn open(&self) -> usize {
            self.book.as_ref().map_or(0, Book::len)
        }
    }

    fn reserve(id: &str) -> ChargeKind {
        ChargeKind::Reserve(Reserve {
            id: ReservationId::of(id),
            ttl_secs: 60,
            max_open: 100,
        })
    }

    fn settle_of(id: &str) -> ChargeKind {
        ChargeKind::Settle {
            id: ReservationId::of(id),
        }
    }

    /// Budget 1000, estimate 300: three reserves pass, the next ones are
    /// denied and charged nothing, also on a rule with a debt bound.
    #[test]
    fn reserves_admit_floor_of_budget_over_estimate_and_denied_ones_take_nothing() {
        // A rate of 1 per year: no refill during the test.
        let limit = BucketLimit {
            requests_per_unit: 1000,
            unit_secs: NonZeroU64::new(31_536_000).expect("non-zero"),
            burst: 1000,
            max_debt: 5000,
        };
        let mut b = Bucket::new(limit);
        let mut none = None;
        let admitted: Vec<bool> = (0..20)
            .map(|i| {
                b.apply(&mut none, &[(0, reserve(&format!("r{i}")), 300)], 0)
                    .admitted
            })
            .collect();
        assert_eq!(admitted.iter().filter(|a| **a).count(), 3);
        assert!(admitted[..3].iter().all(|a| *a));
        assert_eq!(b.balance(0), 100 * M);
        assert_eq!(b.open(), 3);
        // Settled at 250, 300 and 400: 1000 - 950 left.
        for (i, a) in [250, 300, 400].into_iter().enumerate() {
            let r = b.apply(&mut none, &[(0, settle_of(&format!("r{i}")), a)], 1);
            assert!(r.admitted && r.charges[0].enough);
            assert_eq!(r.charges[0].reservation, ReservationOutcome::Settled);
        }
        assert_eq!(b.balance(1), 50 * M);
        assert_eq!(b.open(), 0);
        // A repeated settlement is charged in full, down to the debt floor.
        let r = b.apply(&mut none, &[(0, settle_of("r2"), 400)], 2);
        assert_eq!(r.charges[0].reservation, ReservationOutcome::Unmatched);
        assert_eq!(b.balance(2), -350 * M);
        b.apply(&mut none, &[(0, settle_of("r2"), 100_000)], 3);
        assert_eq!(b.balance(3), -5000 * M);
    }

    /// A reserve is all-or-nothing with the request's other charges; a
    /// settlement stands in a denied request, its book change with it.
    #[test]
    fn reserves_are_all_or_nothing_and_settlements_always_stand() {
        let mut b = Bucket::new(lim(500));
        let mut other = None;
        // The other bucket has 5: a reserve beside a cost of 6 is denied.
        let r = b.apply(
            &mut other,
            &[(0, reserve("a"), 100), (1, ChargeKind::Consume, 6)],
            0,
        );
        assert!(!r.admitted);
        assert_eq!(r.charges[0].reservation, ReservationOutcome::None);
        assert_eq!((b.balance(0), b.open()), (1000 * M, 0));
        let r = b.apply(
            &mut other,
            &[(0, reserve("a"), 100), (1, ChargeKind::Consume, 1)],
            0,
        );
        assert!(r.admitted);
        assert_eq!(r.charges[0].reservation, ReservationOutcome::Opened);
        assert_eq!((b.balance(0), b.open()), (900 * M, 1));
        // Settled at 40 beside a denied charge: 60 back, reservation gone,
        // the other bucket untouched.
        let r = b.apply(
            &mut other,
            &[(0, settle_of("a"), 40), (1, ChargeKind::Consume, 6)],
            0,
        );
        assert!(!r.admitted);
        assert!(r.charges[0].enough);
        assert_eq!((b.balance(0), b.open()), (960 * M, 0));
        assert_eq!(
            other.and_then(|s| s.token_bucket().map(|s| s.tokens_micro)),
            Some(4 * MICRO as i64)
        );
    }

    /// Past `max_open` a new id is refused (nothing charged), an open id
    /// may still add to its reservation, and an expired one frees its slot.
    #[test]
    fn the_cap_refuses_new_ids_only() {
        let mut b = Bucket::new(lim(0));
        let mut none = None;
        let capped = |id: &str| {
            ChargeKind::Reserve(Reserve {
                id: ReservationId::of(id),
                ttl_secs: 10,
                max_open: 2,
            })
        };
        assert!(b.apply(&mut none, &[(0, capped("a"), 10)], 0).admitted);
        assert!(
            b.apply(&mut none, &[(0, capped("b"), 10)], 5_000_000)
                .admitted
        );
        let r = b.apply(&mut none, &[(0, capped("c"), 10)], 6_000_000);
        assert!(!r.admitted);
        assert_eq!(r.charges[0].reservation, ReservationOutcome::Full);
        let r = b.apply(&mut none, &[(0, capped("a"), 10)], 6_000_000);
        assert_eq!(r.charges[0].reservation, ReservationOutcome::Added);
        // "a" was renewed at 6 s; "b" expires at 15 s.
        let r = b.apply(&mut none, &[(0, capped("c"), 10)], 15_000_000);
        assert!(r.admitted);
        assert_eq!(
            (r.charges[0].reservation, r.charges[0].expired),
            (ReservationOutcome::Opened, 1)
        );
        assert_eq!(b.open(), 2);
        // Never settled: the estimates stay charged (1000 per hour refills
        // 4.17 tokens in 15 s, so only the refill is back).
        assert!(b.balance(15_000_000) < 1000 * M - 30 * M);
    }
}
