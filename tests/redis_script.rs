//! The request script (`lua/request.lua` with every algorithm's part under
//! `lua/algorithms/`) against its reference model (`algorithm::apply_request`
//! with each algorithm's model): random request sequences over keys of every
//! algorithm through the script (test-only explicit now) and through the
//! model give identical replies and identical stored state; every written
//! key expires exactly when its algorithm says (a bucket when full again, a
//! window at the end of what it must remember); random batches of requests
//! in one call give what the same requests give one at a time. Also the
//! stored size of a bucket (BENCHMARKS.md).

mod common;
#[path = "redis_script/key_changes.rs"]
mod key_changes;
#[path = "redis_script/named_steps.rs"]
mod named_steps;
#[path = "redis_script/run_edges.rs"]
mod run_edges;
#[path = "redis_script/runs.rs"]
mod runs;

use bucket_rls::storage::algorithm::{
    self, AlgorithmKind, Book, BucketLimit, BucketState, ChargeKind, ChargeSpec, Held, Limit,
    RequestResult, ReservationId, Reserve, State, WindowLimit, WindowState,
};
use bucket_rls::storage::redis::script::{BucketScript, SOURCE, ScriptCall};
use bucket_rls::storage::{Charge, group_by_key};
use common::redis::{RedisServer, decode_bucket, decode_window};
use named_steps::{Steps, agree, consume};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use std::cell::RefCell;
use std::collections::HashMap;
use std::num::NonZeroU64;

/// 2023-11-14 in microseconds: a realistic epoch time.
const T0_US: u64 = 1_700_000_000_000_000;
/// Longest expiry the script writes, in ms.
const MAX_TTL_MS: u128 = 1_000_000_000_000_000;
const UNITS: [u64; 7] = [1, 60, 3600, 86_400, 604_800, 2_592_000, 31_536_000];

fn bucket_limit() -> impl Strategy<Value = BucketLimit> {
    let rate = prop_oneof![
        1 => Just(0u32),
        4 => 1u32..20,
        1 => Just(u32::MAX),
        1 => any::<u32>(),
    ];
    let burst = prop_oneof![
        3 => Just(None),
        1 => Just(Some(u32::MAX)),
        2 => (1u32..50).prop_map(Some),
    ];
    let debt = prop_oneof![
        4 => Just(0u32),
        3 => 1u32..60,
        1 => Just(u32::MAX),
    ];
    (rate, prop::sample::select(UNITS.to_vec()), burst, debt).prop_map(|(r, u, b, d)| BucketLimit {
        requests_per_unit: r,
        unit_secs: NonZeroU64::new(u).expect("a unit"),
        burst: b.unwrap_or(r),
        max_debt: if r == 0 { 0 } else { d },
    })
}

fn window_limit() -> impl Strategy<Value = WindowLimit> {
    let rate = prop_oneof![
        1 => Just(0u32),
        4 => 1u32..20,
        1 => Just(u32::MAX),
        1 => any::<u32>(),
    ];
    // Short units often, so that steps cross window edges.
    let unit = prop_oneof![
        4 => Just(1u64),
        2 => Just(60u64),
        1 => prop::sample::select(UNITS.to_vec()),
    ];
    (rate, unit, prop::bool::weighted(0.8)).prop_map(|(r, u, counts_denied)| WindowLimit {
        requests_per_unit: r,
        unit_secs: NonZeroU64::new(u).expect("a unit"),
        counts_denied,
    })
}

/// A limit of one algorithm, and the same of each other algorithm (a key's
/// charges all use its algorithm: a per-charge limit is taken of it).
type Limits = (BucketLimit, WindowLimit);

fn limits() -> impl Strategy<Value = Limits> {
    (bucket_limit(), window_limit())
}

/// The algorithm of key number `k` of a case.
fn kind_of(kinds: &[AlgorithmKind], k: usize) -> AlgorithmKind {
    kinds[k % kinds.len()]
}

fn pick(kind: AlgorithmKind, l: Limits) -> Limit {
    match kind {
        AlgorithmKind::TokenBucket => Limit::TokenBucket(l.0),
        AlgorithmKind::FixedWindow => Limit::FixedWindow(l.1),
        AlgorithmKind::SlidingWindow => Limit::SlidingWindow(l.1),
    }
}

fn cost() -> impl Strategy<Value = u64> {
    prop_oneof![
        2 => Just(0u64),
        6 => 1u64..4,
        2 => 1u64..100,
        1 => Just(u64::MAX),
        1 => Just(u64::from(u32::MAX)),
        1 => any::<u64>(),
    ]
}

/// Microseconds the clock moves before a step (sometimes backwards).
fn step_us() -> impl Strategy<Value = i64> {
    prop_oneof![
        3 => Just(0i64),
        3 => 1i64..1000,
        3 => 1i64..10_000_000,
        1 => 1i64..100_000_000_000,
        1 => Just(31_536_000_000_000i64),
        1 => -5_000_000i64..0,
    ]
}

/// What a charge does: consume, refund, or give back a charge taken this
/// many microseconds earlier (a Redis Cluster compensation).
#[derive(Clone, Copy, Debug)]
enum KindGen {
    Consume,
    Refund,
    Return(u64),
    /// A reserve of reservation `id` kept `ttl` seconds, at most `max_open`
    /// open per bucket.
    Reserve(u8, u32, u32),
    /// A settlement of reservation `id`.
    Settle(u8),
    /// The undoing of a reserve of reservation `id`.
    Unreserve(u8),
}

fn kind() -> impl Strategy<Value = KindGen> {
    prop_oneof![
        16 => Just(KindGen::Consume),
        3 => Just(KindGen::Refund),
        1 => prop_oneof![Just(0u64), 0u64..3_000_000, 0u64..120_000_000].prop_map(KindGen::Return),
        5 => (0u8..4, prop::sample::select(vec![1u32, 2, 60]), 1u32..4)
            .prop_map(|(id, ttl, max_open)| KindGen::Reserve(id, ttl, max_open)),
        4 => (0u8..4).prop_map(KindGen::Settle),
        2 => (0u8..4).prop_map(KindGen::Unreserve),
    ]
}

fn reservation_id(n: u8) -> ReservationId {
    ReservationId::of(&format!("request-{n}"))
}

/// One charge: key number, optional own limit (else the key's: a charge
/// with another limit on the same bucket is what a per-request `limit`
/// override on a rule's bucket would be), cost, kind, shadow.
type ChargeGen = (usize, Option<Limits>, u64, KindGen, bool);

fn charge() -> impl Strategy<Value = ChargeGen> {
    (
        0usize..3,
        prop_oneof![4 => Just(None), 1 => limits().prop_map(Some)],
        cost(),
        kind(),
        prop::bool::weighted(0.2),
    )
}

/// A case: the algorithm of each key (by key number), the keys' limits.
type Keys = (Vec<AlgorithmKind>, Vec<Limits>);

fn keys() -> impl Strategy<Value = Keys> {
    (
        prop::collection::vec(prop::sample::select(AlgorithmKind::ALL.to_vec()), 1..4),
        prop::collection::vec(limits(), 3),
    )
}

fn sequence() -> impl Strategy<Value = (Keys, Vec<(i64, Vec<ChargeGen>)>)> {
    (
        keys(),
        prop::collection::vec((step_us(), prop::collection::vec(charge(), 1..5)), 1..12),
    )
}

/// The model's store: what the memory backend keeps (a full bucket, an
/// empty window is dropped), and the books of reservations by bucket key.
#[derive(Default)]
struct Model {
    states: HashMap<String, State>,
    books: HashMap<String, Book>,
    /// The books written by the requests run since it was last cleared.
    books_written: std::collections::HashSet<String>,
}

impl Model {
    fn get(&self, key: &str) -> Option<&State> {
        self.states.get(key)
    }
}

/// Runs the model; returns its result and the keys it wrote.
fn run_model(model: &mut Model, charges: &[Charge], now_us: u64) -> (RequestResult, Vec<String>) {
    let (keys, indexed) = group_by_key(charges);
    let states: Vec<Option<State>> = keys.iter().map(|k| model.get(k).copied()).collect();
    let books: Vec<Option<&Book>> = keys.iter().map(|k| model.books.get(*k)).collect();
    let mut last = vec![None; keys.len()];
    for (i, spec) in &indexed {
        last[*i] = Some(spec.limit);
    }
    let mut puts = Vec::new();
    let mut book_puts = Vec::new();
    let r = algorithm::apply_request_with_books(
        &indexed,
        &states,
        &books,
        now_us,
        |i, st| puts.push((i, st)),
        |i, b| book_puts.push((i, b)),
    );
    for (i, b) in book_puts {
        model.books_written.insert(keys[i].to_owned());
        if b.is_empty() {
            model.books.remove(keys[i]);
        } else {
            model.books.insert(keys[i].to_owned(), b);
        }
    }
    let written = puts.iter().map(|(i, _)| keys[*i].to_owned()).collect();
    for (i, st) in puts {
        let l: Limit = last[i].expect("charged bucket has a limit");
        if l.expiry_us(&st) == 0 {
            model.states.remove(keys[i]);
        } else {
            model.states.insert(keys[i].to_owned(), st);
        }
    }
    (r, written)
}

/// Expected PX in ms for a stored state (ceil, at least 1, capped).
fn expected_px_ms(l: &Limit, st: &State, now_us: u64) -> u128 {
    let us = l.expiry_us(st) + u128::from(st.updated_us().saturating_sub(now_us));
    us.div_ceil(1000).clamp(1, MAX_TTL_MS)
}

/// A stored value decoded into the model's state (the window format, else a
/// bucket).
fn decode_state(raw: &[u8]) -> State {
    match decode_window(raw) {
        Some((tag, updated_us, unit_secs, previous, count)) => {
            let s = WindowState {
                updated_us,
                unit_secs,
                previous,
                count,
            };
            if tag == 241 {
                State::FixedWindow(s)
            } else {
                State::SlidingWindow(s)
            }
        }
        None => {
            let (tokens_micro, updated_us) = decode_bucket(raw);
            State::TokenBucket(BucketState {
                tokens_micro,
                updated_us,
            })
        }
    }
}

fn check_sequence(
    conn: &mut redis::Connection,
    script: &BucketScript,
    case: u64,
    limits: &Keys,
    steps: &[(i64, Vec<ChargeGen>)],
) -> Result<(), TestCaseError> {
    let batches: Vec<(i64, Vec<Vec<ChargeGen>>)> = steps
        .iter()
        .map(|(dt, gens)| (*dt, vec![gens.clone()]))
        .collect();
    check_batches(conn, script, case, limits, &batches)
}

/// The charges of one generated request, at `now_us`, on the keys of test
/// case `case`.
fn charges_of(case: u64, keys: &Keys, gens: &[ChargeGen], now_us: u64) -> Vec<Charge> {
    let (kinds, limits) = keys;
    gens.iter()
        .map(|(k, own, cost, kind, shadow)| Charge {
            key: format!("prop:{case}:{k}"),
            spec: ChargeSpec {
                limit: pick(kind_of(kinds, *k), own.unwrap_or(limits[*k])),
                cost: *cost,
                kind: match kind {
                    KindGen::Consume => ChargeKind::Consume,
                    KindGen::Refund => ChargeKind::Refund,
                    KindGen::Return(ago) => ChargeKind::Return {
                        taken_at_us: now_us.saturating_sub(*ago),
                    },
                    KindGen::Reserve(id, ttl_secs, max_open) => ChargeKind::Reserve(Reserve {
                        id: reservation_id(*id),
                        ttl_secs: *ttl_secs,
                        max_open: *max_open,
                    }),
                    KindGen::Settle(id) => ChargeKind::Settle {
                        id: reservation_id(*id),
                    },
                    KindGen::Unreserve(id) => ChargeKind::Unreserve {
                        id: reservation_id(*id),
                    },
                },
                shadow: *shadow,
            },
        })
        .collect()
}

/// Runs each step's requests as one script call (one batch, at the step's
/// time) and, one at a time, through the model at that same time: every
/// request's reply, stored bucket and expiry must be what the model gives.
fn check_batches(
    conn: &mut redis::Connection,
    script: &BucketScript,
    case: u64,
    limits: &Keys,
    steps: &[(i64, Vec<Vec<ChargeGen>>)],
) -> Result<(), TestCaseError> {
    let mut model = Model::default();
    let mut now = T0_US;
    for (dt, requests) in steps {
        now = now.saturating_add_signed(*dt);
        let requests: Vec<Vec<Charge>> = requests
            .iter()
            .map(|gens| charges_of(case, limits, gens, now))
            .collect();
        // The model, one request after the other; per key written, the
        // limit of the last charge of the last request that wrote it.
        let mut expected = Vec::new();
        let mut last_limit: HashMap<String, Limit> = HashMap::new();
        model.books_written.clear();
        for charges in &requests {
            let (r, written) = run_model(&mut model, charges, now);
            for key in written {
                let l = charges
                    .iter()
                    .rev()
                    .find(|c| c.key == key)
                    .map(|c| c.spec.limit)
                    .expect("a written key is charged");
                last_limit.insert(key, l);
            }
            expected.push(r);
        }
        let calls: Vec<ScriptCall> = requests
            .iter()
            .map(|charges| {
                ScriptCall::new(charges, Some(now))
                    .expect("encodable")
                    .with_min_ttl_ms(0)
            })
            .collect();
        let call = ScriptCall::batch(&calls.iter().collect::<Vec<_>>());
        // One transaction: the script, then GET, PTTL and PERSIST of every
        // bucket, so no key can expire in real time between them.
        let mut pipe = redis::pipe();
        // The library (FCALL) and the script (EVALSHA) in turn.
        let (fcall, evalsha) = (script.fcall_cmd(&call), script.evalsha_cmd(&call));
        pipe.atomic().add_command(if case.is_multiple_of(2) {
            fcall
        } else {
            evalsha
        });
        // The buckets (the books are the keys named `{bucket}~r`).
        let buckets: Vec<&String> = call.keys.iter().filter(|k| !k.starts_with('{')).collect();
        for key in &buckets {
            pipe.cmd("GET").arg(key).cmd("PTTL").arg(key);
            // Keep it: Redis expires in real time, the model in test time.
            pipe.cmd("PERSIST").arg(key).ignore();
        }
        // Every book of the case's buckets, and its expiry.
        let book_keys: Vec<String> = (0..3).map(|k| format!("prop:{case}:{k}")).collect();
        for key in &book_keys {
            let book = bucket_rls::storage::key::book_key(key);
            pipe.cmd("HGETALL").arg(&book).cmd("PTTL").arg(&book);
            pipe.cmd("PERSIST").arg(&book).ignore();
        }
        let replies: Vec<redis::Value> = pipe
            .query(conn)
            .map_err(|e| TestCaseError::fail(format!("script failed: {e}")))?;
        let got: Vec<RequestResult> = if call.requests.is_empty() {
            vec![
                call.parse_reply(&replies[0])
                    .map_err(|e| TestCaseError::fail(e.to_string()))?,
            ]
        } else {
            call.parse_batch_reply(&replies[0])
                .map_err(|e| TestCaseError::fail(e.to_string()))?
                .into_iter()
                .map(|r| r.map_err(|e| TestCaseError::fail(e.to_string())))
                .collect::<Result<_, _>>()?
        };
        prop_assert_eq!(&got, &expected, "replies at now={} for {:?}", now, requests);
        // Every book: its live reservations as the model's, expiring with
        // the latest of them.
        let base = 1 + 2 * buckets.len();
        for (j, key) in book_keys.iter().enumerate() {
            let flat: Vec<(Vec<u8>, Vec<u8>)> =
                redis::from_redis_value(replies[base + 2 * j].clone()).expect("HGETALL reply");
            let pttl: i64 =
                redis::from_redis_value(replies[base + 2 * j + 1].clone()).expect("PTTL reply");
            let stored: Book = flat
                .into_iter()
                // The field "m" holds the latest expiry written.
                .filter(|(id, _)| id.as_slice() != b"m")
                .map(|(id, v)| {
                    let id: [u8; 16] = id.try_into().expect("16-byte id");
                    let tokens = u64::from_be_bytes(v[..8].try_into().expect("8 bytes"));
                    let expires_us = u64::from_be_bytes(v[8..16].try_into().expect("8 bytes"));
                    (ReservationId(id), Held { tokens, expires_us })
                })
                .collect();
            // Every entry, expired ones included: both drop an expired
            // entry only where they look at it.
            let want: Book = model.books.get(key).cloned().unwrap_or_default();
            prop_assert_eq!(&stored, &want, "book of {} at now={}", key, now);
            if let Some(latest) = want
                .values()
                .map(|h| h.expires_us)
                .filter(|e| *e > now)
                .max()
                .filter(|_| model.books_written.contains(key))
            {
                // The hash lives at least as long as its latest live entry
                // (it expires with the latest entry ever written).
                let px = u128::from(latest.saturating_sub(now)).div_ceil(1000);
                let pttl = u128::try_from(pttl).unwrap_or(0);
                prop_assert!(
                    pttl + 1000 >= px && pttl <= 200_000,
                    "book of {} PTTL {} for {}",
                    key,
                    pttl,
                    px
                );
            }
        }
        // Stored state and expiry of every bucket of the batch.
        for (i, key) in buckets.iter().copied().enumerate() {
            let raw: Option<Vec<u8>> =
                redis::from_redis_value(replies[1 + 2 * i].clone()).expect("GET reply");
            let pttl: i64 =
                redis::from_redis_value(replies[2 + 2 * i].clone()).expect("PTTL reply");
            let stored = raw.as_deref().map(decode_state);
            let want = model.get(key).copied();
            prop_assert_eq!(stored, want, "stored state of {}", key);
            // Written in this batch: the TTL follows the last write's limit.
            if let (Some(st), Some(l)) = (model.get(key), last_limit.get(key)) {
                // >= 0: a 1 ms expiry may read 0 once the millisecond ticks.
                prop_assert!(pttl >= 0, "{} has PTTL {} (no expiry)", key, pttl);
                let px = expected_px_ms(l, st, now);
                let pttl = u128::try_from(pttl).unwrap_or(0);
                // Exact except for years-long waits (computed with a margin).
                prop_assert!(
                    pttl <= px + px / 100_000_000 + 2,
                    "{} PTTL {} above expected {}",
                    key,
                    pttl,
                    px
                );
                prop_assert!(
                    pttl + 1000 >= px,
                    "{} PTTL {} below time to full {}",
                    key,
                    pttl,
                    px
                );
            }
        }
    }
    Ok(())
}

/// Steps of runs: per step a clock move, and runs of (request, copies).
type RunSteps = Vec<(i64, Vec<(Vec<ChargeGen>, usize)>)>;

/// The property test of batches made of runs: `cases` random cases of
/// `batches` (keys, and per step its runs), each run expanded into its
/// copies and each step one script call, checked by [`check_batches`]
/// against the model one request at a time. Case numbers (which name the
/// keys) start at `first_case`.
fn check_runs(cases: u32, first_case: u64, batches: impl Strategy<Value = (Keys, RunSteps)>) {
    let (_server, conn) = server_with_script();
    let conn = RefCell::new(conn);
    let script = BucketScript::new();
    let case = std::sync::atomic::AtomicU64::new(first_case);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&batches, |(limits, steps)| {
        let n = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let steps: Vec<(i64, Vec<Vec<ChargeGen>>)> = steps
            .into_iter()
            .map(|(dt, runs)| {
                let requests = runs
                    .into_iter()
                    .flat_map(|(gens, times)| std::iter::repeat_n(gens, times))
                    .collect();
                (dt, requests)
            })
            .collect();
        check_batches(&mut conn.borrow_mut(), &script, n, &limits, &steps)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// A fresh `redis-server` with the request script and library loaded.
fn server_with_script() -> (RedisServer, redis::Connection) {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let _: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(SOURCE)
        .query(&mut conn)
        .expect("SCRIPT LOAD");
    let _: String = BucketScript::function_load_cmd()
        .query(&mut conn)
        .expect("FUNCTION LOAD");
    (server, conn)
}

/// The differential property test: identical replies and stored state.
#[test]
fn lua_matches_reference_model() {
    let (_server, conn) = server_with_script();
    let conn = RefCell::new(conn);
    let script = BucketScript::new();
    let case = std::sync::atomic::AtomicU64::new(0);
    let mut runner = TestRunner::new(Config {
        cases: 1000,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&sequence(), |(limits, steps)| {
        let n = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        check_sequence(&mut conn.borrow_mut(), &script, n, &limits, &steps)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// Random request sequences split into random batches: each batch is one
/// script call, and every request in it gets the reply it gets alone, one
/// request after the other at the batch's time (the model), with the same
/// stored state and expiries; requests of one batch share buckets.
#[test]
fn batches_give_the_replies_of_one_request_at_a_time() {
    let (_server, conn) = server_with_script();
    let conn = RefCell::new(conn);
    let script = BucketScript::new();
    let case = std::sync::atomic::AtomicU64::new(0);
    let mut runner = TestRunner::new(Config {
        cases: 600,
        failure_persistence: None,
        ..Config::default()
    });
    let batches = (
        keys(),
        prop::collection::vec(
            (
                step_us(),
                prop::collection::vec(prop::collection::vec(charge(), 1..5), 1..8),
            ),
            1..8,
        ),
    );
    let result = runner.run(&batches, |(limits, steps)| {
        let n = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        check_batches(&mut conn.borrow_mut(), &script, n, &limits, &steps)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// A charge without a reservation: consume, refund, or a give-back.
fn plain_charge() -> impl Strategy<Value = ChargeGen> {
    let kind = prop_oneof![
        8 => Just(KindGen::Consume),
        3 => Just(KindGen::Refund),
        1 => prop_oneof![Just(0u64), 0u64..3_000_000].prop_map(KindGen::Return),
    ];
    (
        0usize..3,
        prop_oneof![4 => Just(None), 1 => limits().prop_map(Some)],
        prop_oneof![2 => Just(0u64), 6 => 1u64..4, 1 => 1u64..100, 1 => any::<u64>()],
        kind,
        prop::bool::weighted(0.2),
    )
}

/// Batches made of runs of one request repeated (the hot bucket: the
/// script decodes and reads such a run once), of one charge or several on
/// distinct keys or on a shared key, with refunds, shadow charges, debt and
/// requests of several charges (now and then with a reservation) between
/// the runs: every request gets the reply it gets alone, one after the
/// other, with the same stored state and expiries.
#[test]
fn runs_of_identical_requests_give_the_replies_of_one_at_a_time() {
    let request = prop_oneof![
        5 => prop::collection::vec(plain_charge(), 1..2),
        3 => prop::collection::vec(plain_charge(), 2..4),
        1 => prop::collection::vec(charge(), 1..3),
    ];
    let batches = (
        keys(),
        prop::collection::vec(
            (
                step_us(),
                prop::collection::vec((request, 1usize..12), 1..5),
            ),
            1..6,
        ),
    );
    check_runs(400, 0, batches);
}

/// A foreign value under one bucket's name fails only the requests of a
/// batch that charge it, with the error their own calls get (`WRONGTYPE`);
/// the other requests are answered and written as alone.
#[test]
fn a_foreign_key_fails_only_its_requests_in_a_batch() {
    let (_server, mut conn) = server_with_script();
    let script = BucketScript::new();
    let _: () = redis::cmd("LPUSH")
        .arg("foreign")
        .arg("x")
        .query(&mut conn)
        .expect("LPUSH");
    let limit = BucketLimit {
        requests_per_unit: 10,
        unit_secs: NonZeroU64::new(60).expect("a unit"),
        burst: 10,
        max_debt: 0,
    };
    let charge = |key: &str| Charge {
        key: key.into(),
        spec: ChargeSpec {
            limit: limit.into(),
            cost: 3,
            kind: ChargeKind::Consume,
            shadow: false,
        },
    };
    let requests = [
        vec![charge("good")],
        vec![charge("good"), charge("foreign")],
        vec![charge("foreign")],
        vec![charge("good")],
    ];
    let calls: Vec<ScriptCall> = requests
        .iter()
        .map(|c| ScriptCall::new(c, Some(T0_US)).expect("encodable"))
        .collect();
    // Alone, a request on the foreign key fails with WRONGTYPE.
    let alone = script
        .evalsha_cmd(&calls[2])
        .query::<redis::Value>(&mut conn)
        .expect_err("WRONGTYPE");
    assert_eq!(alone.code(), Some("WRONGTYPE"), "{alone}");
    let call = ScriptCall::batch(&calls.iter().collect::<Vec<_>>());
    let reply: redis::Value = script.evalsha_cmd(&call).query(&mut conn).expect("script");
    let got = call.parse_batch_reply(&reply).expect("batch reply");
    let ok = |r: &Result<RequestResult, redis::RedisError>| {
        r.as_ref()
            .map(|r| (r.admitted, r.charges[0].remaining_micro))
            .map_err(|e| e.code().map(str::to_owned))
    };
    assert_eq!(
        got.iter().map(ok).collect::<Vec<_>>(),
        vec![
            Ok((true, 7_000_000)),
            Err(Some("WRONGTYPE".into())),
            Err(Some("WRONGTYPE".into())),
            Ok((true, 4_000_000)),
        ]
    );
    let raw: Vec<u8> = redis::cmd("GET").arg("good").query(&mut conn).expect("GET");
    assert_eq!(decode_bucket(&raw), (4_000_000, T0_US));
}

/// Pinned extremes (also reachable by the property test, kept as named cases).
#[test]
fn extremes_match_model() {
    let (_server, mut conn) = server_with_script();
    let script = BucketScript::new();
    let max = BucketLimit {
        requests_per_unit: u32::MAX,
        unit_secs: NonZeroU64::new(1).expect("a unit"),
        burst: u32::MAX,
        max_debt: 0,
    };
    let year = BucketLimit {
        requests_per_unit: u32::MAX,
        unit_secs: NonZeroU64::new(31_536_000).expect("a unit"),
        burst: u32::MAX,
        max_debt: 0,
    };
    let minute = BucketLimit {
        requests_per_unit: u32::MAX,
        unit_secs: NonZeroU64::new(60).expect("a unit"),
        burst: u32::MAX,
        max_debt: 0,
    };
    let zero = BucketLimit {
        requests_per_unit: 0,
        unit_secs: NonZeroU64::new(60).expect("a unit"),
        burst: 0,
        max_debt: 0,
    };
    let c = |l: BucketLimit, cost: u64, kind: ChargeKind| ChargeSpec {
        limit: l.into(),
        cost,
        kind,
        shadow: false,
    };
    let seqs: Vec<Vec<(u64, ChargeSpec)>> = vec![
        vec![
            (0, c(max, u64::from(u32::MAX) - 1, ChargeKind::Consume)),
            (1, c(max, u64::MAX, ChargeKind::Consume)),
            (20, c(max, u64::from(u32::MAX), ChargeKind::Consume)),
        ],
        vec![
            (0, c(year, u64::from(u32::MAX), ChargeKind::Consume)),
            (
                31_536_000_000_000 / 2,
                c(year, 1 << 40, ChargeKind::Consume),
            ),
            (0, c(year, u64::MAX, ChargeKind::Refund)),
        ],
        // Refills whose naive double product exceeds 2^53 and rounds across an
        // integer (floor(e * R / U) computed in doubles is off by one here).
        vec![
            (0, c(year, u64::from(u32::MAX), ChargeKind::Consume)),
            (1_000_000_004_207, c(year, 0, ChargeKind::Consume)),
        ],
        vec![
            (0, c(minute, u64::from(u32::MAX), ChargeKind::Consume)),
            (10_000_012, c(minute, 0, ChargeKind::Consume)),
        ],
        vec![
            (0, c(zero, 1, ChargeKind::Consume)),
            (0, c(zero, 0, ChargeKind::Consume)),
            (0, c(zero, 5, ChargeKind::Refund)),
        ],
    ];
    for (n, seq) in seqs.iter().enumerate() {
        let mut model = Model::default();
        let mut now = T0_US;
        for (dt, spec) in seq {
            now += dt;
            let charges = vec![Charge {
                key: format!("ext:{n}"),
                spec: *spec,
            }];
            let (expected, _) = run_model(&mut model, &charges, now);
            let call = ScriptCall::new(&charges, Some(now))
                .expect("encodable")
                .with_min_ttl_ms(0);
            let reply: redis::Value = script.evalsha_cmd(&call).query(&mut conn).expect("script");
            assert_eq!(
                call.parse_reply(&reply).expect("reply"),
                expected,
                "{n}: {spec:?}"
            );
            let raw: Option<Vec<u8>> = redis::cmd("GET")
                .arg(format!("ext:{n}"))
                .query(&mut conn)
                .expect("GET");
            assert_eq!(
                raw.as_deref().map(decode_state),
                model.get(&format!("ext:{n}")).copied()
            );
        }
    }
}

/// `MEMORY USAGE` of a bucket key with a 30-byte name against a plain integer
/// string key of the same name (BENCHMARKS.md, "Redis storage").
#[test]
fn bucket_memory_usage() {
    let (_server, mut conn) = server_with_script();
    let script = BucketScript::new();
    let name = "rls:d4:edge|k2:ip=v9:10.0.0.07";
    assert_eq!(name.len(), 30);
    let usage = |conn: &mut redis::Connection| -> i64 {
        redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(name)
            .arg("SAMPLES")
            .arg(0)
            .query(conn)
            .expect("MEMORY USAGE")
    };
    let _: () = redis::cmd("SET")
        .arg(name)
        .arg(1_700_000_000_123_456_u64)
        .query(&mut conn)
        .expect("SET");
    let plain = usage(&mut conn);
    let mut report = vec![format!("plain integer key: {plain} bytes")];
    for (burst, cost) in [(10u32, 1u64), (1000, 1), (1_000_000, 1), (u32::MAX, 1)] {
        let _: () = redis::cmd("DEL").arg(name).query(&mut conn).expect("DEL");
        let charges = vec![Charge {
            key: name.to_owned(),
            spec: ChargeSpec {
                limit: BucketLimit {
                    requests_per_unit: burst,
                    unit_secs: NonZeroU64::new(60).expect("a unit"),
                    burst,
                    max_debt: 0,
                }
                .into(),
                cost,
                kind: ChargeKind::Consume,
                shadow: false,
            },
        }];
        let call = ScriptCall::new(&charges, None).expect("encodable");
        let _: redis::Value = script.evalsha_cmd(&call).query(&mut conn).expect("script");
        let bucket = usage(&mut conn);
        let raw: Vec<u8> = redis::cmd("GET").arg(name).query(&mut conn).expect("GET");
        report.push(format!(
            "bucket, burst {burst}: {bucket} bytes ({} byte value, {:+})",
            raw.len(),
            bucket - plain
        ));
        if u64::from(burst) * 1_000_000 < 1 << 40 {
            assert!(bucket - plain <= 16, "{}", report.join("\n"));
        }
    }
    println!("{}", report.join("\n"));
}

/// Test mode (explicit now) keeps keys at least an hour, so a paused test
/// clock is not undone by Redis expiring keys in real time; production calls
/// write exactly the time to full.
#[test]
fn test_mode_keeps_keys_alive() {
    let (_server, mut conn) = server_with_script();
    let script = BucketScript::new();
    let fast = |key: &str| Charge {
        key: key.into(),
        spec: ChargeSpec {
            limit: BucketLimit {
                requests_per_unit: 6000,
                unit_secs: NonZeroU64::new(1).expect("a unit"),
                burst: 6000,
                max_debt: 0,
            }
            .into(),
            cost: 1,
            kind: ChargeKind::Consume,
            shadow: false,
        },
    };
    for (key, now, min_pttl, max_pttl) in [
        ("test", Some(T0_US), 3_590_000, 3_600_000),
        ("prod", None, 1, 1),
    ] {
        let call = ScriptCall::new(&[fast(key)], now).expect("encodable");
        // One transaction, so a 1 ms expiry cannot pass before PTTL.
        let (_, pttl): (redis::Value, i64) = redis::pipe()
            .atomic()
            .add_command(script.evalsha_cmd(&call))
            .cmd("PTTL")
            .arg(key)
            .query(&mut conn)
            .expect("script and PTTL");
        assert!(
            (min_pttl - 1..=max_pttl).contains(&pttl),
            "{key}: PTTL {pttl}"
        );
    }
}
