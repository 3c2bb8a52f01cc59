//! The algorithm seam: what a limit is, what a key stores, and how all the
//! charges of one request are evaluated together.
//!
//! An algorithm (today only the [`token_bucket`]) is a zero-sized type
//! implementing [`Algorithm`]: its limit type, its stored state, the working
//! value of a key during a request (its *level*), and the evaluation of one
//! charge against it. The enums [`Limit`], [`State`] and the private `Level`
//! have one variant per algorithm and dispatch with a `match` (static
//! dispatch, nothing allocated), so adding a variant makes the compiler list
//! every site a new algorithm must handle. [`apply_request`] is the
//! per-request driver every backend runs (the memory backend directly; the
//! Lua driver `lua/request.lua` mirrors it and is tested against it):
//! charges on one key add up, and the request is all-or-nothing.
//!
//! Units: amounts are counted in **micro-units** ([`MICRO`] per token or
//! request) and time in **microseconds**, both as integers. What a charge
//! reports back ([`ChargeResult::remaining_micro`]) is what its limit has
//! left, in micro-units (negative while a bucket is in debt); the limiter
//! turns it into remaining counts and waits through [`Limit`]'s methods
//! ([`Limit::reset_us`], [`Limit::wait_us`]), so it does no arithmetic of an
//! algorithm's own.

pub mod token_bucket;

use smallvec::{SmallVec, smallvec};
pub use token_bucket::{BucketLimit, BucketState, TokenBucket};

/// Micro-units per token (or request).
pub const MICRO: u64 = 1_000_000;

/// [`MICRO`] as a signed amount (a bucket's balance goes below zero in debt).
pub const MICRO_I64: i64 = 1_000_000;

/// What every algorithm provides to the request driver ([`apply_request`]),
/// to the storage backends (stored state, expiry, the script's packed
/// arguments) and to the limiter (remaining counts and waits from what a
/// charge reported). Implemented by one zero-sized type per algorithm; its
/// script part (`lua/algorithms/<name>.lua`) implements the same functions
/// for the Lua driver.
pub trait Algorithm {
    /// The limit a key is evaluated under: taken from the rule (or a
    /// request's override) on every call, never stored with the key.
    type Limit: Copy + Eq + std::fmt::Debug;
    /// What is stored per key (memory backend; the script part encodes it
    /// in a Redis string of its own format).
    type State: Copy + Eq + std::fmt::Debug;
    /// The working value of a key while a request is evaluated.
    type Level: Copy + Eq + std::fmt::Debug;
    /// The algorithm's number in the script's packed charges (the first
    /// byte of each charge; the index of its table in the Lua driver).
    const SCRIPT_ID: u8;

    /// The level of a key at `now_us` under `limit`, from its stored state
    /// (`None`: never seen or expired).
    fn level(limit: &Self::Limit, stored: Option<&Self::State>, now_us: u64) -> Self::Level;
    /// Whether a stored state must be written again even when no charge
    /// changes it (stamped after `now_us`: a clock stepped back).
    fn is_stale(stored: &Self::State, now_us: u64) -> bool;
    /// A level reached under another limit, as seen under `limit` (a later
    /// charge on the same key may carry another limit).
    fn rebase(limit: &Self::Limit, level: Self::Level) -> Self::Level;
    /// A consume of `cost` tokens (0: check only): whether it had enough, and
    /// the level after it (taken only when it had enough, or always on a
    /// limit that [`Algorithm::charges_when_denied`]).
    fn consume(limit: &Self::Limit, level: Self::Level, cost: u64) -> Consumed<Self::Level>;
    /// A refund of `cost` tokens: the level after it.
    fn refund(limit: &Self::Limit, level: Self::Level, cost: u64) -> Self::Level;
    /// Whether a consume of more than 0 on this limit is taken even when
    /// the request is denied (a bucket with a debt bound).
    fn charges_when_denied(limit: &Self::Limit) -> bool;
    /// The state written for `level` at `now_us`.
    fn store(level: Self::Level, now_us: u64) -> Self::State;
    /// What a charge reports for `level`: what is left, in micro-units.
    fn report(level: Self::Level) -> i64;
    /// The level a report stands for (to replay the charges that are taken
    /// when denied, from the level reported before them).
    fn level_of_report(remaining_micro: i64) -> Self::Level;
    /// Microseconds until `state`, written under `limit`, is the same as
    /// never seen (0: forget it now). Memory drops the key then; the script
    /// part expires the Redis key then.
    fn expiry_us(limit: &Self::Limit, state: &Self::State) -> u128;
    /// When `state` was written, microseconds since the Unix epoch.
    fn updated_us(state: &Self::State) -> u64;
    /// The most the limit can hold, in micro-units.
    fn capacity_micro(limit: &Self::Limit) -> u128;
    /// Length of the limit's unit, in seconds (the RateLimit headers' window).
    fn unit_secs(limit: &Self::Limit) -> u64;
    /// Whether the limit admits nothing, ever (a rate of 0).
    fn admits_nothing(limit: &Self::Limit) -> bool;
    /// Microseconds until a key that reported `remaining_micro` is back to
    /// its fresh state (`duration_until_reset` of an admitted descriptor).
    fn reset_us(limit: &Self::Limit, remaining_micro: i64) -> u128;
    /// Microseconds until a key that reported `remaining_micro` has
    /// `need_micro`, at least 1 (`duration_until_reset` of a denied
    /// descriptor, `retry-after`).
    fn wait_us(limit: &Self::Limit, remaining_micro: i64, need_micro: u128) -> u128;
    /// What a key that reported `remaining_micro` at `since_us` has at
    /// `now_us` with no charge in between (the local over-limit cache).
    fn remaining_later(
        limit: &Self::Limit,
        remaining_micro: i64,
        since_us: u64,
        now_us: u64,
    ) -> i128;
    /// The limit's parameters and the cost as the script's packed charge
    /// carries them.
    fn script_charge(limit: &Self::Limit, cost: u64, kind: ChargeKind) -> ScriptCharge;
}

/// What a consume did (see [`Algorithm::consume`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Consumed<L> {
    /// The level after the consume.
    pub level: L,
    /// The key had enough for it.
    pub enough: bool,
    /// The key's state changed (it must be written if the request stands).
    pub changed: bool,
}

/// One charge's limit and cost as the script's packed argument carries them
/// (lua/request.lua, `ARGV[3]`): three 32-bit parameters and one extra
/// parameter, whose meaning is the algorithm's, and the cost, clamped so
/// that no outcome changes and Lua computes exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScriptCharge {
    /// [`Algorithm::SCRIPT_ID`].
    pub algorithm: u8,
    /// The limit's parameters.
    pub params: [u32; 3],
    /// The extra parameter (`flags / 4` in the packed charge), below 2^32.
    pub extra: u64,
    /// The cost in tokens, clamped.
    pub cost: u64,
}

/// The limit a key is evaluated under, and which algorithm evaluates it;
/// taken from the rule (or a per-request override) on every call, never
/// stored with the key, so a config change applies at once
/// (docs/design.md, "Reloads").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Limit {
    /// A token bucket ([`token_bucket`]).
    TokenBucket(BucketLimit),
}

impl From<BucketLimit> for Limit {
    fn from(l: BucketLimit) -> Self {
        Self::TokenBucket(l)
    }
}

impl Limit {
    /// The token bucket limit, if this is one.
    #[must_use]
    pub fn token_bucket(&self) -> Option<&BucketLimit> {
        match self {
            Self::TokenBucket(l) => Some(l),
        }
    }

    /// How far below zero a charge may take the state, in tokens (`max_debt`;
    /// 0 for an algorithm without debt).
    #[must_use]
    pub fn max_debt(&self) -> u32 {
        match self {
            Self::TokenBucket(l) => l.max_debt,
        }
    }

    /// The most the limit can hold, in micro-units (a bucket's capacity; 0
    /// when it admits nothing).
    #[must_use]
    pub fn capacity_micro(&self) -> u128 {
        match self {
            Self::TokenBucket(l) => TokenBucket::capacity_micro(l),
        }
    }

    /// Length of the unit in seconds.
    #[must_use]
    pub fn unit_secs(&self) -> u64 {
        match self {
            Self::TokenBucket(l) => TokenBucket::unit_secs(l),
        }
    }

    /// Whether the limit admits nothing, ever (a rate of 0).
    #[must_use]
    pub fn admits_nothing(&self) -> bool {
        match self {
            Self::TokenBucket(l) => TokenBucket::admits_nothing(l),
        }
    }

    /// Whether a consume of more than 0 is taken even when the request is
    /// denied (a bucket with a `max_debt`).
    #[must_use]
    pub fn charges_when_denied(&self) -> bool {
        match self {
            Self::TokenBucket(l) => TokenBucket::charges_when_denied(l),
        }
    }

    /// Whether `need_micro` can ever be admitted (the limit admits something
    /// and holds that much).
    #[must_use]
    pub fn can_ever_fit(&self, need_micro: u128) -> bool {
        !self.admits_nothing() && need_micro <= self.capacity_micro()
    }

    /// Whether `need_micro` is more than the limit can ever hold (false for a
    /// limit that admits nothing: it has no capacity to exceed).
    #[must_use]
    pub fn exceeds_capacity(&self, need_micro: u128) -> bool {
        !self.admits_nothing() && need_micro > self.capacity_micro()
    }

    /// Microseconds until a key that reported `remaining_micro` is back to
    /// its fresh state (a bucket: full again; 0 when it already is).
    #[must_use]
    pub fn reset_us(&self, remaining_micro: i64) -> u128 {
        match self {
            Self::TokenBucket(l) => TokenBucket::reset_us(l, remaining_micro),
        }
    }

    /// Microseconds until a key that reported `remaining_micro` has
    /// `need_micro`, at least 1 (a denial never says "now").
    #[must_use]
    pub fn wait_us(&self, remaining_micro: i64, need_micro: u128) -> u128 {
        match self {
            Self::TokenBucket(l) => TokenBucket::wait_us(l, remaining_micro, need_micro),
        }
    }

    /// What a key that reported `remaining_micro` at `since_us` has at
    /// `now_us`, with no charge in between.
    #[must_use]
    pub fn remaining_later(&self, remaining_micro: i64, since_us: u64, now_us: u64) -> i128 {
        match self {
            Self::TokenBucket(l) => {
                TokenBucket::remaining_later(l, remaining_micro, since_us, now_us)
            }
        }
    }

    /// Microseconds until `state`, written under this limit, is the same as
    /// never seen (0: forget it now).
    #[must_use]
    pub fn expiry_us(&self, state: &State) -> u128 {
        match (self, state) {
            (Self::TokenBucket(l), State::TokenBucket(s)) => TokenBucket::expiry_us(l, s),
        }
    }

    /// This limit, `cost` and `kind` as the script's packed charge carries
    /// them.
    #[must_use]
    pub fn script_charge(&self, cost: u64, kind: ChargeKind) -> ScriptCharge {
        match self {
            Self::TokenBucket(l) => TokenBucket::script_charge(l, cost, kind),
        }
    }

    fn level(&self, stored: Option<&State>, now_us: u64) -> Level {
        match self {
            Self::TokenBucket(l) => Level::TokenBucket(TokenBucket::level(
                l,
                stored.map(|State::TokenBucket(s)| s),
                now_us,
            )),
        }
    }

    fn rebase(&self, level: Level) -> Level {
        match (self, level) {
            (Self::TokenBucket(l), Level::TokenBucket(v)) => {
                Level::TokenBucket(TokenBucket::rebase(l, v))
            }
        }
    }

    fn consume(&self, level: Level, cost: u64) -> Consumed<Level> {
        match (self, level) {
            (Self::TokenBucket(l), Level::TokenBucket(v)) => {
                let c = TokenBucket::consume(l, v, cost);
                Consumed {
                    level: Level::TokenBucket(c.level),
                    enough: c.enough,
                    changed: c.changed,
                }
            }
        }
    }

    fn refund(&self, level: Level, cost: u64) -> Level {
        match (self, level) {
            (Self::TokenBucket(l), Level::TokenBucket(v)) => {
                Level::TokenBucket(TokenBucket::refund(l, v, cost))
            }
        }
    }

    fn level_of_report(&self, remaining_micro: i64) -> Level {
        match self {
            Self::TokenBucket(_) => {
                Level::TokenBucket(TokenBucket::level_of_report(remaining_micro))
            }
        }
    }
}

/// What is stored for one key: the state of its algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum State {
    /// A token bucket's balance and stamp.
    TokenBucket(BucketState),
}

impl From<BucketState> for State {
    fn from(s: BucketState) -> Self {
        Self::TokenBucket(s)
    }
}

impl State {
    /// When the state was written, microseconds since the Unix epoch.
    #[must_use]
    pub fn updated_us(&self) -> u64 {
        match self {
            Self::TokenBucket(s) => TokenBucket::updated_us(s),
        }
    }

    /// The token bucket state, if this is one.
    #[must_use]
    pub fn token_bucket(&self) -> Option<&BucketState> {
        match self {
            Self::TokenBucket(s) => Some(s),
        }
    }

    fn is_stale(&self, now_us: u64) -> bool {
        match self {
            Self::TokenBucket(s) => TokenBucket::is_stale(s, now_us),
        }
    }
}

/// A key's working value during one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Level {
    TokenBucket(<TokenBucket as Algorithm>::Level),
}

impl Level {
    fn report(self) -> i64 {
        match self {
            Self::TokenBucket(v) => TokenBucket::report(v),
        }
    }

    fn store(self, now_us: u64) -> State {
        match self {
            Self::TokenBucket(v) => State::TokenBucket(TokenBucket::store(v, now_us)),
        }
    }
}

/// What to do with one key in a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChargeKind {
    /// Take `cost` tokens if the whole request is admitted (always, on a
    /// limit that [`Limit::charges_when_denied`]). Cost 0 only checks.
    Consume,
    /// Give `cost` tokens back (`is_negative_hits`), capped at the capacity.
    Refund,
}

/// One descriptor's charge against one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChargeSpec {
    /// Limit (and algorithm) to evaluate under.
    pub limit: Limit,
    /// Cost in tokens (0 = check only).
    pub cost: u64,
    /// Consume or refund.
    pub kind: ChargeKind,
    /// Shadow mode: evaluated, never denies the request.
    pub shadow: bool,
}

impl ChargeSpec {
    /// Micro-units this charge needs to be admitted: `max(cost, 1)` (a
    /// check-only call is answered as a 1-token request would be,
    /// docs/design.md, "Costs"), and anything above the capacity is clamped
    /// to capacity + 1 token (it can never be admitted).
    #[must_use]
    pub fn need_micro(&self) -> u128 {
        self.own_need_micro()
            .min(self.limit.capacity_micro() + u128::from(MICRO))
    }

    /// Micro-units this charge asks for on its own, unclamped: `max(cost, 1)`
    /// tokens.
    #[must_use]
    pub fn own_need_micro(&self) -> u128 {
        u128::from(self.cost.max(1)) * u128::from(MICRO)
    }

    /// The cost in micro-units.
    #[must_use]
    pub fn cost_micro(&self) -> u128 {
        u128::from(self.cost) * u128::from(MICRO)
    }

    /// Whether this charge is taken even when the request is denied: a
    /// consume of more than 0 on a limit that [`Limit::charges_when_denied`]
    /// (a debt charge, docs/design.md, "Debt").
    #[must_use]
    pub fn taken_when_denied(&self) -> bool {
        self.kind == ChargeKind::Consume && self.cost > 0 && self.limit.charges_when_denied()
    }
}

/// Result for one charge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChargeResult {
    /// The key had enough for this charge (always true for refunds).
    pub enough: bool,
    /// What the key's limit has left, in micro-units (a bucket's balance):
    /// after the request when it was admitted, before it otherwise (a denied
    /// request's debt charges are taken but not reported). Negative while in
    /// debt.
    pub remaining_micro: i64,
}

/// Result for a whole request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestResult {
    /// Every non-shadow consume charge had enough, so all were charged.
    pub admitted: bool,
    /// One result per charge, in request order.
    pub charges: Vec<ChargeResult>,
}

/// Evaluates and applies all charges of one request atomically
/// (docs/design.md, "All-or-nothing requests"):
///
/// 1. Charges are simulated in order on working copies, so two charges on
///    the same key add up. A shadow charge that lacks tokens is skipped (not
///    charged) and does not deny.
/// 2. If every non-shadow consume charge had enough, the simulated states
///    are written (`put`); otherwise nothing is written, refunds included,
///    except the charges [`taken when denied`](ChargeSpec::taken_when_denied).
///
/// A charge taken when denied (a consume on a bucket with `max_debt: D > 0`)
/// is always taken, whether it had enough, whether the request is
/// admitted; it lacks tokens, and denies, as any consume. In a denied
/// request those charges are applied on their own (in order, from the
/// stored state), so the other keys stay uncharged.
///
/// `states[i]` is the stored state of key `i` (`None` = never seen);
/// charges on the same key must carry the same key index and the same
/// algorithm. `put` receives `(key index, new state)` for every key whose
/// state changed. Cost-0 checks and refunds on a full bucket write nothing.
pub fn apply_request(
    charges: &[(usize, ChargeSpec)],
    states: &[Option<State>],
    now_us: u64,
    mut put: impl FnMut(usize, State),
) -> RequestResult {
    // Per key: (level after every charge, dirty), the level after only the
    // charges taken when denied, and the level read before any charge.
    let mut work: SmallVec<[Option<(Level, bool)>; 4]> = smallvec![None; states.len()];
    let mut kept: SmallVec<[Option<Level>; 4]> = smallvec![None; states.len()];
    let mut read: SmallVec<[Option<Level>; 4]> = smallvec![None; states.len()];
    let mut results = Vec::with_capacity(charges.len());
    let mut admitted = true;
    for (key, spec) in charges {
        let limit = &spec.limit;
        let slot = match &mut work[*key] {
            // A later charge on the same key may carry another limit.
            Some(slot) => {
                slot.0 = limit.rebase(slot.0);
                slot
            }
            none => {
                let level = limit.level(states[*key].as_ref(), now_us);
                read[*key] = Some(level);
                none.insert((level, false))
            }
        };
        match spec.kind {
            ChargeKind::Refund => {
                let new = limit.refund(slot.0, spec.cost);
                if new != slot.0 {
                    *slot = (new, true);
                }
                results.push(ChargeResult {
                    enough: true,
                    remaining_micro: 0,
                });
            }
            ChargeKind::Consume => {
                let c = limit.consume(slot.0, spec.cost);
                if c.changed {
                    *slot = (c.level, true);
                }
                if spec.taken_when_denied() {
                    let from = match kept[*key] {
                        Some(k) => limit.rebase(k),
                        None => limit.level(states[*key].as_ref(), now_us),
                    };
                    kept[*key] = Some(limit.consume(from, spec.cost).level);
                }
                if !c.enough && !spec.shadow {
                    admitted = false;
                }
                results.push(ChargeResult {
                    enough: c.enough,
                    remaining_micro: 0,
                });
            }
        }
    }
    for (i, stored) in states.iter().enumerate() {
        let written = if admitted {
            match work[i] {
                Some((level, true)) => Some(level),
                _ => None,
            }
        } else {
            kept[i]
        };
        // Every write stores now. A key stamped after now (a clock stepped
        // back) that nothing else writes is written as it is, stamped now,
        // admitted or not: otherwise every later call would read "no time
        // elapsed" until the clock caught up (a freeze).
        let level = match (written, stored) {
            (Some(level), _) => level,
            (None, Some(s)) if s.is_stale(now_us) => match read[i] {
                Some(level) => level,
                None => continue,
            },
            _ => continue,
        };
        put(i, level.store(now_us));
    }
    if admitted {
        // Report what is left after the whole request.
        for ((key, _), r) in charges.iter().zip(results.iter_mut()) {
            r.remaining_micro = work[*key].map_or(0, |w| w.0.report());
        }
    } else {
        // Report what was left before the request, under each charge's limit.
        for ((key, spec), r) in charges.iter().zip(results.iter_mut()) {
            r.remaining_micro = spec.limit.level(states[*key].as_ref(), now_us).report();
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
    charges: &[super::Charge],
    result: &RequestResult,
) -> Vec<Option<i64>> {
    if !charges.iter().any(|c| c.spec.taken_when_denied()) {
        return Vec::new();
    }
    let mut level: std::collections::HashMap<&str, Level> = std::collections::HashMap::new();
    for (c, r) in charges.iter().zip(&result.charges) {
        if !c.spec.taken_when_denied() {
            continue;
        }
        let limit = &c.spec.limit;
        let l = level
            .entry(c.key.as_str())
            .or_insert_with(|| limit.level_of_report(r.remaining_micro));
        *l = limit.consume(limit.rebase(*l), c.spec.cost).level;
    }
    charges
        .iter()
        .map(|c| level.get(c.key.as_str()).map(|l| l.report()))
        .collect()
}

/// Micro-units each charge needs on its key for the whole request to pass,
/// in charge order: a consume needs its own cost (at least 1 token: a check
/// needs one) plus the costs of the earlier consumes of the same request on
/// the same key (shadow ones too: they take tokens). An earlier refund is
/// not subtracted, so a wait computed from it is never too short. Refunds
/// need 0.
#[must_use]
pub fn request_needs(charges: &[super::Charge]) -> Vec<u128> {
    // Taken so far per key: a list searched in order for a few charges (no
    // hashing), a map for many.
    const LINEAR_UP_TO: usize = 16;
    let mut few: SmallVec<[(&str, u128); LINEAR_UP_TO]> = SmallVec::new();
    let mut many: std::collections::HashMap<&str, u128> = std::collections::HashMap::new();
    charges
        .iter()
        .map(|c| {
            if c.spec.kind != ChargeKind::Consume {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU64;

    #[test]
    fn request_needs_add_up_earlier_consumes_of_the_same_key() {
        let c = |key: &str, cost: u64, kind: ChargeKind| super::super::Charge {
            key: key.into(),
            spec: ChargeSpec {
                limit: BucketLimit {
                    requests_per_unit: 10,
                    unit_secs: NonZeroU64::MIN,
                    burst: 10,
                    max_debt: 0,
                }
                .into(),
                cost,
                kind,
                shadow: false,
            },
        };
        let charges = [
            c("a", 3, ChargeKind::Consume),
            c("b", 0, ChargeKind::Consume),
            c("a", 0, ChargeKind::Consume),
            c("a", 2, ChargeKind::Refund),
            c("a", 4, ChargeKind::Consume),
        ];
        let m = u128::from(MICRO);
        assert_eq!(request_needs(&charges), vec![3 * m, m, 4 * m, 0, 7 * m]);
    }

    /// Every algorithm has its own number in the script, and the script
    /// text registers a table under it.
    #[test]
    fn script_ids_are_registered_in_the_script() {
        let src = crate::storage::redis::script::SOURCE;
        assert!(src.contains(&format!("\n[{}] = (function()", TokenBucket::SCRIPT_ID)));
    }
}
