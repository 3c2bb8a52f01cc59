//! The algorithm seam: what a limit is, what a key stores, and how all the
//! charges of one request are evaluated together.
//!
//! An algorithm ([`token_bucket`], [`fixed_window`], [`sliding_window`]) is
//! a zero-sized type
//! implementing [`Algorithm`]: its limit type, its stored state, the working
//! value of a key during a request (its *level*), and the evaluation of one
//! charge against it. The enums [`Limit`], [`State`] and the private `Level`
//! have one variant per algorithm and dispatch with a `match` (static
//! dispatch, nothing allocated), so adding a variant makes the compiler list
//! every site a new algorithm must handle. [`apply_request`] is the
//! per-request driver every backend runs (the memory backend directly; the
//! Lua driver `lua/request.lua` mirrors it and is tested against it):
//! charges on one key add up, and the request is all-or-nothing, whatever
//! mix of algorithms it carries.
//!
//! Units: amounts are counted in **micro-units** ([`MICRO`] per token or
//! request) and time in **microseconds**, both as integers. What a charge
//! reports back ([`ChargeResult::remaining_micro`]) is what its limit has
//! left, in micro-units (negative while a bucket is in debt, or a window is
//! over its limit); a window also reports when storage evaluated it
//! ([`WindowReport`]). The limiter turns these into remaining counts and
//! waits through [`Limit`]'s methods ([`Limit::reset_us`],
//! [`Limit::wait_us`]), so it does no arithmetic of an algorithm's own.
//!
//! A key's stored state belongs to one algorithm: read under another (a
//! rule whose `algorithm` a reload changed), it is the same as never seen.

pub mod fixed_window;
pub mod request;
pub mod reservation;
pub mod sliding_window;
pub mod token_bucket;

pub use request::{
    apply_request, apply_request_with_books, ceil_secs, remaining_after_denial, request_needs,
    whole,
};

pub use fixed_window::{FixedWindow, WindowLimit, WindowState};
pub use reservation::{Book, Held, ReservationId, ReservationOutcome, Reserve};
pub use sliding_window::{SlidingLevel, SlidingWindow};
use smallvec::{SmallVec, smallvec};
pub use token_bucket::{BucketLimit, BucketState, TokenBucket};

/// Micro-units per token (or request).
pub const MICRO: u64 = 1_000_000;

/// [`MICRO`] as a signed amount (a bucket's balance goes below zero in debt).
pub const MICRO_I64: i64 = 1_000_000;

/// Which algorithm a rule is evaluated with (`rate_limit.algorithm`, or the
/// service-wide `--default-algorithm`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AlgorithmKind {
    /// A token bucket ([`token_bucket`]): bucket-rls's own, the default.
    #[default]
    TokenBucket,
    /// A fixed window ([`fixed_window`]): the Go service's meaning.
    FixedWindow,
    /// A sliding window counter ([`sliding_window`]).
    SlidingWindow,
}

impl AlgorithmKind {
    /// Every algorithm, in the order the docs list them.
    pub const ALL: [Self; 3] = [Self::TokenBucket, Self::FixedWindow, Self::SlidingWindow];

    /// The name as configs, flags, `/rlconfig` and metric labels write it
    /// (`token_bucket`, `fixed_window`, `sliding_window`).
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::TokenBucket => "token_bucket",
            Self::FixedWindow => "fixed_window",
            Self::SlidingWindow => "sliding_window",
        }
    }

    /// Parses a name as written ([`AlgorithmKind::as_str`], exactly).
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// Whether the algorithm counts requests in windows (no `burst`, no
    /// `max_debt`).
    #[must_use]
    pub const fn is_window(self) -> bool {
        !matches!(self, Self::TokenBucket)
    }
}

impl std::fmt::Display for AlgorithmKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

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
    /// The working value of a key while a request is evaluated (always at
    /// the request's time).
    type Level: Copy + Eq + std::fmt::Debug;
    /// The algorithm's number in the script's packed charges (the first
    /// byte of each charge; the index of its table in the Lua driver).
    const SCRIPT_ID: u8;

    /// The level of a key at `now_us` under `limit`, from its stored state
    /// (`None`: never seen or expired), and whether the state must be
    /// written again even when no charge changes it (stamped after
    /// `now_us`: a clock stepped back).
    fn read(limit: &Self::Limit, stored: Option<&Self::State>, now_us: u64) -> (Self::Level, bool);
    /// A level reached under the limit `from`, as seen under `limit` (a
    /// later charge on the same key may carry another limit); the same as
    /// reading, at the same time, the state `from` would store for it.
    fn rebase(limit: &Self::Limit, from: &Self::Limit, level: Self::Level) -> Self::Level;
    /// A consume of `cost` tokens (0: check only): whether it had enough,
    /// the level after it, whether that level must be written if the
    /// request stands, and whether it is taken even when the request is
    /// denied.
    fn consume(limit: &Self::Limit, level: Self::Level, cost: u64) -> Consumed<Self::Level>;
    /// A refund of `cost` tokens: the level after it. `taken_at_us`: the
    /// storage time of the charge it gives back, when known (a Redis
    /// Cluster compensation); a window then gives it back only to the
    /// window it was taken in.
    fn refund(
        limit: &Self::Limit,
        level: Self::Level,
        cost: u64,
        taken_at_us: Option<u64>,
        now_us: u64,
    ) -> Self::Level;
    /// Whether a consume of more than 0 on this limit is taken even when
    /// the request is denied, whatever the level (a bucket with a debt
    /// bound).
    fn charges_when_denied(limit: &Self::Limit) -> bool;
    /// Whether a consume of more than 0 that lacks room is taken anyway
    /// (and so stands in a denied request): a window that counts denied
    /// hits, as the Go service's fixed window does.
    fn counts_when_short(limit: &Self::Limit) -> bool;
    /// The state written for `level` at `now_us` under `limit`.
    fn store(limit: &Self::Limit, level: Self::Level, now_us: u64) -> Self::State;
    /// What a charge reports for `level` at `now_us`.
    fn report(limit: &Self::Limit, level: Self::Level, now_us: u64) -> Report;
    /// The level a report stands for (to replay the charges that are taken
    /// when denied, from the level reported before them).
    fn level_of_report(limit: &Self::Limit, report: &Report) -> Self::Level;
    /// Microseconds from `state`'s write until it is the same as never
    /// seen (0: forget it now), under `limit`. Memory drops the key then;
    /// the script part expires the Redis key then.
    fn expiry_us(limit: &Self::Limit, state: &Self::State) -> u128;
    /// When `state` was written, microseconds since the Unix epoch.
    fn updated_us(state: &Self::State) -> u64;
    /// The most the limit can hold, in micro-units.
    fn capacity_micro(limit: &Self::Limit) -> u128;
    /// Length of the limit's unit, in seconds (the RateLimit headers' window).
    fn unit_secs(limit: &Self::Limit) -> u64;
    /// Whether the limit admits nothing, ever (a rate of 0).
    fn admits_nothing(limit: &Self::Limit) -> bool;
    /// Micro-units a consume of `cost` tokens needs on its own, unclamped.
    fn need_micro(limit: &Self::Limit, cost: u64) -> u128;
    /// Microseconds until a key that reported `report` is back to its
    /// fresh state (`duration_until_reset` of an admitted descriptor).
    fn reset_us(limit: &Self::Limit, report: &Report) -> u128;
    /// Microseconds until a key that reported `report` has room for
    /// `need_micro`, at least 1 (`duration_until_reset` of a denied
    /// descriptor, `retry-after`).
    fn wait_us(limit: &Self::Limit, report: &Report, need_micro: u128) -> u128;
    /// What a key that reported `report` at `since_us` reports at `now_us`
    /// with no charge in between (the local over-limit cache; both times on
    /// the same clock, which need not be storage's: a window's time moves
    /// on by `now_us - since_us`).
    fn report_later(limit: &Self::Limit, report: &Report, since_us: u64, now_us: u64) -> Report;
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
    /// The consume is taken even when the request is denied (a debt
    /// charge; a window's count of hits it had no room for).
    pub stands: bool,
}

/// What a window algorithm reports beside what is left: the time storage
/// evaluated the charge at (its clock: Redis `TIME`, or the memory
/// backend's clock), which places it in its window, and the previous
/// window's count (the sliding window; 0 for a fixed window).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct WindowReport {
    /// Storage's time of the evaluation, microseconds since the Unix epoch.
    pub at_us: u64,
    /// The previous window's count, in micro-units.
    pub previous_micro: u64,
}

/// What one charge reports about its key: what is left and, for a
/// window, when.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// See [`ChargeResult::remaining_micro`].
    pub remaining_micro: i64,
    /// See [`ChargeResult::window`].
    pub window: Option<WindowReport>,
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
    /// The extra parameter (`flags / 4` in the packed charge), below 2^40.
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
    /// A fixed window ([`fixed_window`]).
    FixedWindow(WindowLimit),
    /// A sliding window counter ([`sliding_window`]).
    SlidingWindow(WindowLimit),
}

impl From<BucketLimit> for Limit {
    fn from(l: BucketLimit) -> Self {
        Self::TokenBucket(l)
    }
}

/// Calls `$body` with `$a` bound to the algorithm type and `$l` to the
/// limit of every variant of `$limit`.
macro_rules! each_limit {
    ($limit:expr, |$a:ident, $l:ident| $body:expr) => {
        match $limit {
            Limit::TokenBucket($l) => {
                type $a = TokenBucket;
                $body
            }
            Limit::FixedWindow($l) => {
                type $a = FixedWindow;
                $body
            }
            Limit::SlidingWindow($l) => {
                type $a = SlidingWindow;
                $body
            }
        }
    };
}

impl Limit {
    /// The algorithm.
    #[must_use]
    pub const fn kind(&self) -> AlgorithmKind {
        match self {
            Self::TokenBucket(_) => AlgorithmKind::TokenBucket,
            Self::FixedWindow(_) => AlgorithmKind::FixedWindow,
            Self::SlidingWindow(_) => AlgorithmKind::SlidingWindow,
        }
    }

    /// The token bucket limit, if this is one.
    #[must_use]
    pub fn token_bucket(&self) -> Option<&BucketLimit> {
        match self {
            Self::TokenBucket(l) => Some(l),
            Self::FixedWindow(_) | Self::SlidingWindow(_) => None,
        }
    }

    /// How far below zero a charge may take the state, in tokens (`max_debt`;
    /// 0 for an algorithm without debt).
    #[must_use]
    pub fn max_debt(&self) -> u32 {
        match self {
            Self::TokenBucket(l) => l.max_debt,
            Self::FixedWindow(_) | Self::SlidingWindow(_) => 0,
        }
    }

    /// The most the limit can hold, in micro-units (a bucket's capacity, a
    /// window's limit; 0 when it admits nothing).
    #[must_use]
    pub fn capacity_micro(&self) -> u128 {
        each_limit!(self, |A, l| A::capacity_micro(l))
    }

    /// Length of the unit in seconds.
    #[must_use]
    pub fn unit_secs(&self) -> u64 {
        each_limit!(self, |A, l| A::unit_secs(l))
    }

    /// Whether the limit admits nothing, ever (a rate of 0).
    #[must_use]
    pub fn admits_nothing(&self) -> bool {
        each_limit!(self, |A, l| A::admits_nothing(l))
    }

    /// Whether a consume of more than 0 is taken even when the request is
    /// denied, whatever the level (a bucket with a `max_debt`).
    #[must_use]
    pub fn charges_when_denied(&self) -> bool {
        each_limit!(self, |A, l| A::charges_when_denied(l))
    }

    /// Whether a consume of more than 0 that lacks room is counted anyway
    /// (a fixed window, as the Go service counts a denied request's hits).
    #[must_use]
    pub fn counts_when_short(&self) -> bool {
        each_limit!(self, |A, l| A::counts_when_short(l))
    }

    /// Micro-units a consume of `cost` needs on its own, unclamped: a
    /// bucket `max(cost, 1)` tokens (a check is answered as a 1-token
    /// request), a fixed window `cost` (the Go service's check passes
    /// while the window is not over).
    #[must_use]
    pub fn need_micro(&self, cost: u64) -> u128 {
        each_limit!(self, |A, l| A::need_micro(l, cost))
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

    /// Microseconds until a key that reported `report` is back to its
    /// fresh state (a bucket: full again, 0 when it already is; a fixed
    /// window: the end of its window).
    #[must_use]
    pub fn reset_us(&self, report: &Report) -> u128 {
        each_limit!(self, |A, l| A::reset_us(l, report))
    }

    /// Microseconds until a key that reported `report` has room for
    /// `need_micro`, at least 1 (a denial never says "now").
    #[must_use]
    pub fn wait_us(&self, report: &Report, need_micro: u128) -> u128 {
        each_limit!(self, |A, l| A::wait_us(l, report, need_micro))
    }

    /// What a key that reported `report` at `since_us` reports at `now_us`,
    /// with no charge in between.
    #[must_use]
    pub fn report_later(&self, report: &Report, since_us: u64, now_us: u64) -> Report {
        each_limit!(self, |A, l| A::report_later(l, report, since_us, now_us))
    }

    /// Microseconds from `state`'s write until it is the same as never
    /// seen (0: forget it now), under this limit (a state of another
    /// algorithm: 0).
    #[must_use]
    pub fn expiry_us(&self, state: &State) -> u128 {
        match (self, state) {
            (Self::TokenBucket(l), State::TokenBucket(s)) => TokenBucket::expiry_us(l, s),
            (Self::FixedWindow(l), State::FixedWindow(s)) => FixedWindow::expiry_us(l, s),
            (Self::SlidingWindow(l), State::SlidingWindow(s)) => SlidingWindow::expiry_us(l, s),
            _ => 0,
        }
    }

    /// This limit, `cost` and `kind` as the script's packed charge carries
    /// them.
    #[must_use]
    pub fn script_charge(&self, cost: u64, kind: ChargeKind) -> ScriptCharge {
        each_limit!(self, |A, l| A::script_charge(l, cost, kind))
    }

    /// The level of a key at `now_us` from its stored state, and whether
    /// the state is stale; a state of another algorithm is never seen.
    fn read(&self, stored: Option<&State>, now_us: u64) -> (Level, bool) {
        match self {
            Self::TokenBucket(l) => {
                let s = stored.and_then(State::token_bucket);
                let (v, stale) = TokenBucket::read(l, s, now_us);
                (Level::TokenBucket(v), stale)
            }
            Self::FixedWindow(l) => {
                let s = match stored {
                    Some(State::FixedWindow(s)) => Some(s),
                    _ => None,
                };
                let (v, stale) = FixedWindow::read(l, s, now_us);
                (Level::FixedWindow(v), stale)
            }
            Self::SlidingWindow(l) => {
                let s = match stored {
                    Some(State::SlidingWindow(s)) => Some(s),
                    _ => None,
                };
                let (v, stale) = SlidingWindow::read(l, s, now_us);
                (Level::SlidingWindow(v), stale)
            }
        }
    }

    /// `level`, reached under `from`, under this limit: the algorithm's
    /// rebase, or the fresh level when `from` is another algorithm.
    fn rebase(&self, from: &Self, level: Level, now_us: u64) -> Level {
        match (self, from, level) {
            (Self::TokenBucket(l), Self::TokenBucket(f), Level::TokenBucket(v)) => {
                Level::TokenBucket(TokenBucket::rebase(l, f, v))
            }
            (Self::FixedWindow(l), Self::FixedWindow(f), Level::FixedWindow(v)) => {
                Level::FixedWindow(FixedWindow::rebase(l, f, v))
            }
            (Self::SlidingWindow(l), Self::SlidingWindow(f), Level::SlidingWindow(v)) => {
                Level::SlidingWindow(SlidingWindow::rebase(l, f, v))
            }
            _ => self.read(None, now_us).0,
        }
    }

    fn consume(&self, level: Level, cost: u64, now_us: u64) -> Consumed<Level> {
        fn wrap<L>(c: Consumed<L>, f: impl FnOnce(L) -> Level) -> Consumed<Level> {
            Consumed {
                level: f(c.level),
                enough: c.enough,
                changed: c.changed,
                stands: c.stands,
            }
        }
        match (self, level) {
            (Self::TokenBucket(l), Level::TokenBucket(v)) => {
                wrap(TokenBucket::consume(l, v, cost), Level::TokenBucket)
            }
            (Self::FixedWindow(l), Level::FixedWindow(v)) => {
                wrap(FixedWindow::consume(l, v, cost), Level::FixedWindow)
            }
            (Self::SlidingWindow(l), Level::SlidingWindow(v)) => {
                wrap(SlidingWindow::consume(l, v, cost), Level::SlidingWindow)
            }
            _ => self.consume(self.read(None, now_us).0, cost, now_us),
        }
    }

    fn refund(&self, level: Level, cost: u64, taken_at_us: Option<u64>, now_us: u64) -> Level {
        match (self, level) {
            (Self::TokenBucket(l), Level::TokenBucket(v)) => {
                Level::TokenBucket(TokenBucket::refund(l, v, cost, taken_at_us, now_us))
            }
            (Self::FixedWindow(l), Level::FixedWindow(v)) => {
                Level::FixedWindow(FixedWindow::refund(l, v, cost, taken_at_us, now_us))
            }
            (Self::SlidingWindow(l), Level::SlidingWindow(v)) => {
                Level::SlidingWindow(SlidingWindow::refund(l, v, cost, taken_at_us, now_us))
            }
            _ => self.refund(self.read(None, now_us).0, cost, taken_at_us, now_us),
        }
    }

    fn store(&self, level: Level, now_us: u64) -> State {
        match (self, level) {
            (Self::TokenBucket(l), Level::TokenBucket(v)) => {
                State::TokenBucket(TokenBucket::store(l, v, now_us))
            }
            (Self::FixedWindow(l), Level::FixedWindow(v)) => {
                State::FixedWindow(FixedWindow::store(l, v, now_us))
            }
            (Self::SlidingWindow(l), Level::SlidingWindow(v)) => {
                State::SlidingWindow(SlidingWindow::store(l, v, now_us))
            }
            _ => self.store(self.read(None, now_us).0, now_us),
        }
    }

    fn report(&self, level: Level, now_us: u64) -> Report {
        match (self, level) {
            (Self::TokenBucket(l), Level::TokenBucket(v)) => TokenBucket::report(l, v, now_us),
            (Self::FixedWindow(l), Level::FixedWindow(v)) => FixedWindow::report(l, v, now_us),
            (Self::SlidingWindow(l), Level::SlidingWindow(v)) => {
                SlidingWindow::report(l, v, now_us)
            }
            _ => self.report(self.read(None, now_us).0, now_us),
        }
    }

    fn level_of_report(&self, report: &Report) -> Level {
        match self {
            Self::TokenBucket(l) => Level::TokenBucket(TokenBucket::level_of_report(l, report)),
            Self::FixedWindow(l) => Level::FixedWindow(FixedWindow::level_of_report(l, report)),
            Self::SlidingWindow(l) => {
                Level::SlidingWindow(SlidingWindow::level_of_report(l, report))
            }
        }
    }
}

/// What is stored for one key: the state of its algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum State {
    /// A token bucket's balance and stamp.
    TokenBucket(BucketState),
    /// A fixed window's count, unit and stamp.
    FixedWindow(WindowState),
    /// A sliding window's two counts, unit and stamp.
    SlidingWindow(WindowState),
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
            Self::FixedWindow(s) => FixedWindow::updated_us(s),
            Self::SlidingWindow(s) => SlidingWindow::updated_us(s),
        }
    }

    /// The token bucket state, if this is one.
    #[must_use]
    pub fn token_bucket(&self) -> Option<&BucketState> {
        match self {
            Self::TokenBucket(s) => Some(s),
            Self::FixedWindow(_) | Self::SlidingWindow(_) => None,
        }
    }

    /// The window state, if this is one.
    #[must_use]
    pub fn window(&self) -> Option<&WindowState> {
        match self {
            Self::TokenBucket(_) => None,
            Self::FixedWindow(s) | Self::SlidingWindow(s) => Some(s),
        }
    }
}

/// A key's working value during one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Level {
    TokenBucket(<TokenBucket as Algorithm>::Level),
    FixedWindow(<FixedWindow as Algorithm>::Level),
    SlidingWindow(<SlidingWindow as Algorithm>::Level),
}

/// What to do with one key in a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChargeKind {
    /// Take `cost` tokens if the whole request is admitted (always, on a
    /// limit that [`Limit::charges_when_denied`]; a fixed window also counts
    /// a consume it has no room for). Cost 0 only checks.
    Consume,
    /// Give `cost` tokens back (`is_negative_hits`), capped at the capacity
    /// (a window's count never goes below zero).
    Refund,
    /// Give back `cost` taken by a consume that storage evaluated at
    /// `taken_at_us` (its clock): a Redis Cluster's compensation. A bucket
    /// takes it as a refund; a window gives it back to the window it was
    /// counted in, and not at all once that window is over.
    Return {
        /// Storage's time of the consume given back ([`WindowReport::at_us`]).
        taken_at_us: u64,
    },
    /// A token bucket reserve (docs/design.md, "Reservations"): a consume
    /// of the estimate `cost` that never stands in a denied request (also
    /// on a bucket with `max_debt`) and, when the request is admitted,
    /// keeps the estimate in the bucket's book. Denied when the book holds
    /// `max_open` other open reservations.
    Reserve(Reserve),
    /// A token bucket settlement of the actual `cost` for reservation `id`:
    /// charges the excess over the estimate (debt semantics) or gives the
    /// rest back, removes the reservation, always has enough and always
    /// stands. Without an open reservation, `cost` is charged in full.
    Settle {
        /// The reservation settled.
        id: ReservationId,
    },
    /// The undoing of an admitted reserve of `cost` for reservation `id`
    /// (a Redis Cluster's compensation): a refund of `cost` that also takes
    /// `cost` off the open reservation (forgetting it when nothing is left).
    Unreserve {
        /// The reservation the reserve went to.
        id: ReservationId,
    },
}

impl ChargeKind {
    /// Whether the charge gives tokens back ([`ChargeKind::Refund`] or
    /// [`ChargeKind::Return`]).
    #[must_use]
    pub const fn gives_back(self) -> bool {
        matches!(
            self,
            Self::Refund | Self::Return { .. } | Self::Unreserve { .. }
        )
    }

    /// Whether the charge takes its cost only when it fits
    /// ([`ChargeKind::Consume`] or [`ChargeKind::Reserve`]).
    #[must_use]
    pub const fn takes(self) -> bool {
        matches!(self, Self::Consume | Self::Reserve(_))
    }
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
    /// Micro-units this charge needs to be admitted
    /// ([`ChargeSpec::own_need_micro`]), and anything above the capacity
    /// is clamped to capacity + 1 token (it can never be admitted).
    #[must_use]
    pub fn need_micro(&self) -> u128 {
        self.own_need_micro()
            .min(self.limit.capacity_micro() + u128::from(MICRO))
    }

    /// Micro-units this charge asks for on its own, unclamped
    /// ([`Limit::need_micro`]: `max(cost, 1)` tokens on a bucket,
    /// docs/design.md, "Costs"; `cost` on a fixed window).
    #[must_use]
    pub fn own_need_micro(&self) -> u128 {
        self.limit.need_micro(self.cost)
    }

    /// The cost in micro-units.
    #[must_use]
    pub fn cost_micro(&self) -> u128 {
        u128::from(self.cost) * u128::from(MICRO)
    }

    /// Whether this charge is taken even when the request is denied,
    /// whatever storage finds: a consume of more than 0 on a limit that
    /// [`Limit::charges_when_denied`] (a debt charge, docs/design.md,
    /// "Debt").
    #[must_use]
    pub fn taken_when_denied(&self) -> bool {
        self.kind == ChargeKind::Consume && self.cost > 0 && self.limit.charges_when_denied()
    }

    /// Whether this charge was taken in a request storage denied, given
    /// whether it had `enough`: a debt charge, or a consume of more than 0
    /// that lacked room on a limit that [`Limit::counts_when_short`] (a
    /// fixed window counts the hits it denies).
    #[must_use]
    pub fn stood(&self, enough: bool) -> bool {
        self.taken_when_denied()
            || (self.kind == ChargeKind::Consume
                && self.cost > 0
                && !enough
                && self.limit.counts_when_short())
    }
}

/// Result for one charge.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChargeResult {
    /// The key had enough for this charge (always true for refunds).
    pub enough: bool,
    /// What the key's limit has left, in micro-units (a bucket's balance, a
    /// window's limit less its count): after the request when it was
    /// admitted, before it otherwise (a denied request's debt charges and
    /// counted hits are taken but not reported). Negative while in debt or
    /// over a window's limit.
    pub remaining_micro: i64,
    /// For a window: when storage evaluated it, and the previous window's
    /// count; `None` for a token bucket.
    pub window: Option<WindowReport>,
    /// What a reserve or settlement did to the bucket's book
    /// ([`ReservationOutcome::None`] for any other charge).
    pub reservation: ReservationOutcome,
    /// Expired reservations this charge dropped from the book (counted
    /// only when the book was written).
    pub expired: u32,
}

impl ChargeResult {
    /// What the charge reported, as the limit's methods take it.
    #[must_use]
    pub const fn report(&self) -> Report {
        Report {
            remaining_micro: self.remaining_micro,
            window: self.window,
        }
    }
}

/// Result for a whole request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestResult {
    /// Every non-shadow consume charge had enough, so all were charged.
    pub admitted: bool,
    /// One result per charge, in request order.
    pub charges: Vec<ChargeResult>,
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
    /// text makes its part under it.
    #[test]
    fn script_ids_are_registered_in_the_script() {
        let src = crate::storage::redis::script::SOURCE;
        for id in [
            TokenBucket::SCRIPT_ID,
            FixedWindow::SCRIPT_ID,
            SlidingWindow::SCRIPT_ID,
        ] {
            assert!(src.contains(&format!("\nif a == {id} then\n")), "{id}");
        }
    }
}
