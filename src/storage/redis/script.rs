//! The one Rust wrapper of the request script: its text (assembled at build
//! time from the algorithms' parts and the request driver) as a script and
//! as a Redis Functions library, argument encoding, the only builder of its
//! `FCALL`, `FUNCTION LOAD`, `EVALSHA`, `EVAL` and `SCRIPT LOAD` commands,
//! and the call (`FCALL`, or `EVALSHA` where Functions are refused or for
//! one call refused for memory) with one reload-and-retry on `Function not
//! found` or `NOSCRIPT`; reply parsing is in `script_reply.rs`. Everything
//! here is topology-independent, so a Cluster or Sentinel backend calls the
//! same functions per node or per slot.

use crate::metrics as m;
use crate::storage::algorithm::{ChargeKind, ChargeSpec, RequestResult, ReservationId};
use crate::storage::key;
use crate::storage::{BackendKind, Charge, StorageError, group_by_key};
use ::redis::aio::ConnectionLike;
use ::redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};

/// Wraps one algorithm's script part (`lua/algorithms/<name>.lua`, a chunk
/// that returns its functions) as the branch `$id` of the function `PART`,
/// which makes the part's functions of the algorithm it is given; `$id` is
/// the algorithm's
/// [`SCRIPT_ID`](crate::storage::algorithm::Algorithm::SCRIPT_ID). (One
/// function with a branch per part, not a table of functions: the script
/// makes its functions and tables on every call.)
macro_rules! algorithm_part {
    ($id:literal, $file:literal) => {
        concat!(
            "if a == ",
            $id,
            " then\n",
            include_str!(concat!("../../../lua/algorithms/", $file)),
            "\nend\n"
        )
    };
}

/// The driver's `ALGORITHMS` table over `PART`: an algorithm's functions
/// are made by `MAKE` the first time they are used (the driver writes
/// `(ALGORITHMS[a] or MAKE(a))`), so a script call pays for the algorithms
/// its charges use, not for every algorithm the script has (a script's
/// closures are made anew on every call; a library's once). No metatable:
/// a Functions library cannot call `setmetatable` when it is loaded.
macro_rules! algorithms_table {
    () => {
        "local ALGORITHMS = {}\nlocal function MAKE(a)\n  local f = PART(a)\n  ALGORITHMS[a] = f\n  return f\nend\n"
    };
}

pub(crate) use {algorithm_part, algorithms_table};

/// The text shared by the script and the library: the table of algorithm
/// parts, the table of algorithms made from them on first use, and the
/// request driver (`lua/request.lua`) as the function `REQUEST(KEYS,
/// ARGV)`.
macro_rules! request_body {
    () => {
        concat!(
            "local function PART(a)\n",
            algorithm_part!(0, "token_bucket.lua"),
            algorithm_part!(1, "fixed_window.lua"),
            algorithm_part!(2, "sliding_window.lua"),
            "end\n",
            algorithms_table!(),
            "local function REQUEST(KEYS, ARGV)\n",
            include_str!("../../../lua/request.lua"),
            "\nend\n"
        )
    };
}

/// The script source, assembled at build time: the table of algorithm
/// parts, the table of algorithms made from them on first use, then the
/// request driver (`lua/request.lua`), so a request is one script call
/// whatever mix of algorithms it carries. As a script, all of it is made
/// anew on every call; [`LIBRARY`] holds the same text as a Redis Functions
/// library, whose algorithm functions are made once, on first use, and
/// kept.
pub const SOURCE: &str = concat!(request_body!(), "return REQUEST(KEYS, ARGV)\n");

/// The request script as a Redis Functions library (Redis 7 and later,
/// Valkey): `name` (`bucket_rls_` and 16 hex digits of the SHA-1 of its
/// text, so that two versions of the service on one Redis each keep their
/// own) is the library's and its one function's; `code` is what
/// `FUNCTION LOAD` takes. Loaded, the algorithms' functions are made once,
/// on first use, and kept: a call (`FCALL`) runs only the driver.
pub struct Library {
    /// The library's name and its function's.
    pub name: String,
    /// `#!lua name=<name>`, the text [`SOURCE`] shares (without its
    /// `return REQUEST(KEYS, ARGV)`), and the registration of `REQUEST`
    /// under `name`.
    pub code: String,
}

/// The request library ([`Library`]), made once.
pub static LIBRARY: std::sync::LazyLock<Library> = std::sync::LazyLock::new(|| {
    let body = request_body!();
    let hash = ::redis::Script::new(body).get_hash().to_owned();
    let name = format!("bucket_rls_{}", &hash[..16]);
    let code = format!("#!lua name={name}\n{body}redis.register_function('{name}', REQUEST)\n");
    Library { name, code }
});

/// Largest explicit `now_us` the script computes with exactly (2^53 - 1).
pub const MAX_EXPLICIT_NOW_US: u64 = (1 << 53) - 1;

/// Shortest expiry written in test mode (explicit `now_us`): one hour. A
/// paused test clock does not stop Redis from expiring keys in real time, so
/// without it a bucket could vanish (and come back full) while test time
/// stands still.
pub const TEST_MIN_TTL_MS: u64 = 3_600_000;

/// Flag bit of a refund charge in the script's `flags` argument.
const FLAG_REFUND: u8 = 1;
/// Flag bit of a shadow-mode charge in the script's `flags` argument.
const FLAG_SHADOW: u8 = 2;

/// The request script and library: how calls go (`FCALL` or `EVALSHA`),
/// the script's SHA-1 (what `EVALSHA` takes), and the reloads seen.
#[derive(Clone, Debug)]
pub struct BucketScript {
    sha: String,
    /// `Function not found` and `NOSCRIPT` replies after a call had run
    /// (shared by clones).
    reloads: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Whether a call (`FCALL` or `EVALSHA`) has succeeded yet (shared by
    /// clones): a lost library or script before that is the first load.
    ran: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Whether calls go as `FCALL` of [`LIBRARY`] (shared by clones): true
    /// until a Redis refuses Functions (a Redis before 7, an ACL without
    /// them), then `EVALSHA` of [`SOURCE`]; true again when a later
    /// [`BucketScript::load`] succeeds.
    functions: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Default for BucketScript {
    fn default() -> Self {
        Self::new()
    }
}

impl BucketScript {
    /// The request script ([`SOURCE`]).
    #[must_use]
    pub fn new() -> Self {
        Self {
            sha: ::redis::Script::new(SOURCE).get_hash().to_owned(),
            reloads: std::sync::Arc::default(),
            ran: std::sync::Arc::default(),
            functions: std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true)),
        }
    }

    /// Whether calls go as `FCALL` of [`LIBRARY`] now (false: `EVALSHA` of
    /// [`SOURCE`], after a Redis refused Functions).
    #[must_use]
    pub fn uses_functions(&self) -> bool {
        self.functions.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Calls go as `EVALSHA` of [`SOURCE`] from now on (until a
    /// [`BucketScript::load`] of the library succeeds): `e` showed that
    /// this Redis has no Functions for us. Logged once per switch.
    pub(crate) fn refuse_functions(&self, e: &RedisError) {
        if self
            .functions
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::info!(error = %e, "Redis refused Functions; the token bucket script runs as EVALSHA");
        }
    }

    /// `Function not found` and `NOSCRIPT` replies seen since a call first
    /// ran: each means Redis restarted, failed over or flushed its
    /// functions or scripts, so what it said about buckets before may no
    /// longer hold. One before any call ran (the first request beat the
    /// startup load) is not counted: nothing was said before it.
    #[must_use]
    pub fn reloads(&self) -> u64 {
        self.reloads.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// SHA-1 of the source, as Redis reports it from `SCRIPT LOAD`.
    #[must_use]
    pub fn sha(&self) -> &str {
        &self.sha
    }

    /// Runs one prepared call: `FCALL` of [`LIBRARY`], or `EVALSHA` of
    /// [`SOURCE`] where Redis has no Functions. A library Redis does not
    /// have (`Function not found`: Redis restarted without persistence,
    /// `FUNCTION FLUSH`) is loaded (`FUNCTION LOAD REPLACE`) and the call
    /// sent once more; a script it does not have (`NOSCRIPT`) likewise
    /// (`SCRIPT LOAD`). Both replies prove the call did not run, so the
    /// retry is safe; so do a refusal of `FCALL` or `FUNCTION` (an unknown
    /// command before Redis 7, a `NOPERM` naming the command), after which
    /// calls go as `EVALSHA`, and an `OOM` (memory full: a function that
    /// may write is refused before it runs), after which this call goes as
    /// `EVALSHA`, answered if it writes nothing. Any other failure, in
    /// particular a timeout after sending,
    /// is returned as is and never replayed (docs/design.md, "Ambiguous
    /// failures are never replayed"). Counts reloads in
    /// `bucket_rls_redis_script_reload_total`.
    ///
    /// # Errors
    /// The Redis error of the last command sent.
    pub async fn eval<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        call: &ScriptCall,
    ) -> Result<Value, RedisError> {
        use std::sync::atomic::Ordering;
        let reply = match self.eval_function(conn, call).await {
            Ok(reply) => reply,
            Err(count) => self.eval_script(conn, call, count).await,
        };
        if reply.is_ok() {
            self.ran.store(true, Ordering::Relaxed);
        }
        reply
    }

    /// The call as `FCALL` (loading the library once when Redis lacks it);
    /// `Err` when it is to go as `EVALSHA` (nothing ran): calls go so, or
    /// this Redis just refused Functions (`Err(true)`), or it refused this
    /// call because memory is full (`Err(false)`: a `NOSCRIPT` then is the
    /// script's first load, not a lost script).
    async fn eval_function<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        call: &ScriptCall,
    ) -> Result<Result<Value, RedisError>, bool> {
        if !self.uses_functions() {
            return Err(true);
        }
        let mut reply = self.fcall_cmd(call).query_async::<Value>(conn).await;
        if reply.as_ref().is_err_and(function_missing) {
            self.reloaded("the token bucket library (Function not found)");
            reply = match Self::function_load_cmd().query_async::<String>(conn).await {
                Ok(_) => self.fcall_cmd(call).query_async::<Value>(conn).await,
                Err(e) => Err(e),
            };
        }
        match reply {
            Err(e) if refuses_functions(&e) => {
                self.refuse_functions(&e);
                Err(true)
            }
            // This call alone goes as `EVALSHA`: answered if it writes
            // nothing, refused at its first write otherwise.
            Err(e) if refused_for_memory(&e) => Err(false),
            other => Ok(other),
        }
    }

    /// The call as `EVALSHA` (loading the script once on `NOSCRIPT`,
    /// counted as a reload when `count`).
    async fn eval_script<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        call: &ScriptCall,
        count: bool,
    ) -> Result<Value, RedisError> {
        match self.evalsha_cmd(call).query_async::<Value>(conn).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                if count {
                    self.reloaded("the token bucket script (NOSCRIPT)");
                }
                let _: String = Self::load_cmd().query_async(conn).await?;
                self.evalsha_cmd(call).query_async::<Value>(conn).await
            }
            other => other,
        }
    }

    /// Counts a reload in `bucket_rls_redis_script_reload_total`, and, when
    /// the script had run before, in [`BucketScript::reloads`] (logged).
    pub(crate) fn reloaded(&self, what: &str) {
        use std::sync::atomic::Ordering;
        metrics::counter!(m::REDIS_SCRIPT_RELOAD).increment(1);
        if self.ran.load(Ordering::Relaxed) {
            self.reloads.fetch_add(1, Ordering::Relaxed);
            tracing::info!("Redis lost {what}; loading it again");
        }
    }

    /// Loads the library (`FUNCTION LOAD REPLACE`), or, where Redis refuses
    /// it, the script (`SCRIPT LOAD`), e.g. at startup or after a
    /// (re)connection: calls then go as `FCALL` (once loaded), or as they
    /// went. A refused `FUNCTION LOAD` does not make calls leave `FCALL`:
    /// an ACL user may be allowed `FCALL` of a library another user loaded;
    /// the first call tells (a refused `FCALL`, or `Function not found`
    /// and a refused load, make calls go as `EVALSHA`).
    ///
    /// # Errors
    /// The Redis error.
    pub async fn load<C: ConnectionLike + Send>(&self, conn: &mut C) -> Result<(), RedisError> {
        match Self::function_load_cmd().query_async::<String>(conn).await {
            Ok(_) => {
                self.functions
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                Ok(())
            }
            Err(e) if refuses_functions(&e) => {
                let _: String = Self::load_cmd().query_async(conn).await?;
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// `FUNCTION LOAD REPLACE` of [`LIBRARY`] (on a Cluster connection,
    /// routed to every master). Replaces a library of the same name, which
    /// has the same text.
    #[must_use]
    pub fn function_load_cmd() -> Cmd {
        let mut cmd = ::redis::cmd("FUNCTION");
        cmd.arg("LOAD").arg("REPLACE").arg(&LIBRARY.code);
        cmd
    }

    /// The `FCALL` of [`LIBRARY`]'s function for one call.
    #[must_use]
    pub fn fcall_cmd(&self, call: &ScriptCall) -> Cmd {
        let mut cmd = call.sized_cmd(LIBRARY.name.len());
        cmd.arg("FCALL").arg(&LIBRARY.name);
        call.push_keys_and_args(&mut cmd);
        cmd
    }

    /// The call's command as calls go now: `FCALL`, or `EVALSHA` where
    /// Redis refused Functions.
    #[must_use]
    pub fn call_cmd(&self, call: &ScriptCall) -> Cmd {
        if self.uses_functions() {
            self.fcall_cmd(call)
        } else {
            self.evalsha_cmd(call)
        }
    }

    /// `SCRIPT LOAD` of the source (on a Cluster connection, routed to every
    /// master).
    #[must_use]
    pub fn load_cmd() -> Cmd {
        let mut cmd = ::redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(SOURCE);
        cmd
    }

    /// The `EVALSHA` command of one call (for pipelines or a synchronous
    /// connection; [`BucketScript::eval`] adds the `NOSCRIPT` handling).
    #[must_use]
    pub fn evalsha_cmd(&self, call: &ScriptCall) -> Cmd {
        let mut cmd = call.sized_cmd(self.sha.len());
        cmd.arg("EVALSHA").arg(&self.sha);
        call.push_keys_and_args(&mut cmd);
        cmd
    }

    /// The `EVAL` command of one call, with the full source: runs the call
    /// and loads the script on that node (the answer to `NOSCRIPT` where a
    /// separate `SCRIPT LOAD` could reach another node).
    #[must_use]
    pub fn eval_cmd(call: &ScriptCall) -> Cmd {
        let mut cmd = call.sized_cmd(SOURCE.len());
        cmd.arg("EVAL").arg(SOURCE);
        call.push_keys_and_args(&mut cmd);
        cmd
    }
}

/// Whether `e` is a refusal of Functions that proves nothing ran: `FCALL`
/// or `FUNCTION` unknown (Redis before 7: `ERR unknown command`), or not
/// allowed to this user (`NOPERM`).
/// A `NOPERM` about a key (an ACL that limits the user's keys) refuses
/// the call's keys, not Functions: `EVALSHA` would be refused alike, so it
/// is no reason to leave `FCALL` (the requests on permitted keys go on as
/// they were).
pub(crate) fn refuses_functions(e: &RedisError) -> bool {
    if e.kind() == ErrorKind::Server(ServerErrorKind::NoPerm) {
        // Redis 7.0: "this user has no permissions to run the 'fcall'
        // command"; Redis 7.2 and Valkey: "User <name> has no permissions
        // to run the 'function|load' command".
        return e
            .detail()
            .is_some_and(|d| d.contains("'fcall'") || d.contains("'function"));
    }
    e.code() == Some("ERR") && e.detail().is_some_and(|d| d.starts_with("unknown command"))
}

/// Whether `e` is Redis refusing, before running it, a function that may
/// write because memory is full (`OOM` under `noeviction`): a function is
/// refused whole where a script (`EVALSHA`, `EVAL`) runs and is refused
/// only at its first write, so a call that writes nothing (a denial, a
/// check) is still answered as a script. Nothing ran.
pub(crate) fn refused_for_memory(e: &RedisError) -> bool {
    e.code() == Some("OOM")
}

/// Whether `e` is Redis's `ERR Function not found`: it does not have the
/// library (it restarted without persistence, or `FUNCTION FLUSH`); the
/// call did not run.
pub(crate) fn function_missing(e: &RedisError) -> bool {
    e.code() == Some("ERR")
        && e.detail()
            .is_some_and(|d| d.starts_with("Function not found"))
}

/// The KEYS and ARGV of one script call: one request (or one slot's part
/// of it), or a batch of requests ([`ScriptCall::batch`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScriptCall {
    /// Distinct bucket keys (KEYS).
    pub keys: Vec<String>,
    /// ARGV: explicit now (or empty), shortest expiry in ms (or empty), then
    /// every charge packed in one binary argument ([`CHARGE_BYTES`] each),
    /// and for a batch its runs of identical requests: per run the charges
    /// per request and the requests (4 bytes each; the run's charges are
    /// packed once).
    pub args: Vec<Vec<u8>>,
    /// Number of charges (the reply of one request has `1 + 9 * charges`
    /// bytes, and 16 more per window charge).
    pub charges: usize,
    /// Charges of each request of a batch, in order; empty for one request.
    pub requests: Vec<usize>,
}

/// Why one request of a batch failed where the others did not: the Redis
/// error the script caught for it (a `WRONGTYPE` read of one of its keys),
/// exactly as the request's own call would have raised it.
pub type BatchItemError = RedisError;

impl ScriptCall {
    /// Encodes `charges` for the script. `now_us` is the explicit test clock
    /// (`None` in production: the script reads Redis `TIME`); with it, keys
    /// live at least [`TEST_MIN_TTL_MS`] (see `ScriptCall::with_min_ttl_ms`, cargo feature `test-util`).
    ///
    /// Each algorithm packs its limit and clamps the cost so that no outcome
    /// changes and every amount stays exact inside Lua
    /// ([`Limit::script_charge`](crate::storage::Limit::script_charge); the
    /// token bucket's: capacity + `max_debt` + 1 token for consumes,
    /// capacity + `u32::MAX` for refunds).
    ///
    /// # Errors
    /// [`StorageError::Backend`] ([`BackendKind::Argument`]) for an explicit
    /// `now_us` above [`MAX_EXPLICIT_NOW_US`]: the script could not compute
    /// with it exactly.
    pub fn new(charges: &[Charge], now_us: Option<u64>) -> Result<Self, StorageError> {
        let (keys, indexed) = group_by_key(charges);
        let mut args = Vec::with_capacity(3);
        match now_us {
            Some(t) if t > MAX_EXPLICIT_NOW_US => {
                return Err(argument(format!("explicit now_us {t} is above 2^53")));
            }
            Some(t) => {
                args.push(t.to_string().into_bytes());
                args.push(TEST_MIN_TTL_MS.to_string().into_bytes());
            }
            None => {
                args.push(Vec::new());
                args.push(Vec::new());
            }
        }
        let mut packed = Vec::with_capacity(CHARGE_BYTES * indexed.len());
        for (key_idx, spec) in &indexed {
            push_charge(&mut packed, key_idx + 1, spec);
        }
        args.push(packed);
        let mut keys: Vec<String> = keys.into_iter().map(str::to_owned).collect();
        // The reservation records (ARGV[5]) and the books they name, as
        // more keys (in each bucket's hash slot).
        let mut records = Vec::new();
        for (n, (key_idx, spec)) in indexed.iter().enumerate() {
            let (op, id, ttl_secs, max_open) = match spec.kind {
                ChargeKind::Reserve(r) => (1u8, r.id, r.ttl_secs, r.max_open),
                ChargeKind::Settle { id } => (2, id, 0, 0),
                ChargeKind::Unreserve { id } => (3, id, 0, 0),
                _ => continue,
            };
            if spec.limit.token_bucket().is_none() {
                continue;
            }
            let book = key::book_key(&keys[*key_idx]);
            let book_no = match keys.iter().position(|k| *k == book) {
                Some(i) => i + 1,
                None => {
                    keys.push(book);
                    keys.len()
                }
            };
            push_record(&mut records, n + 1, op, book_no, &id, ttl_secs, max_open);
        }
        if !records.is_empty() {
            args.push(Vec::new());
            args.push(records);
        }
        Ok(Self {
            keys,
            args,
            charges: indexed.len(),
            requests: Vec::new(),
        })
    }

    /// One call for several requests, each prepared alone by
    /// [`ScriptCall::new`] with the same explicit `now_us` (and shortest
    /// expiry): the keys of all of them once each (a key several requests
    /// charge is read and written once), their charges one request after
    /// the other with the key numbers of the batch, and the charges per
    /// request (`ARGV[4]`). Consecutive identical requests (the same keys
    /// and charges, no reservation: a hot bucket under load) are sent once
    /// with their number, as a run. The script evaluates the requests in
    /// turn, each as if alone (lua/request.lua, "Batch"). A single request
    /// stays its own call, unchanged.
    #[must_use]
    pub fn batch(calls: &[&Self]) -> Self {
        if let [one] = calls {
            return (*one).clone();
        }
        let total: usize = calls.iter().map(|c| c.charges).sum();
        let mut keys: Vec<String> = Vec::with_capacity(total);
        let mut index: std::collections::HashMap<&str, usize> =
            std::collections::HashMap::with_capacity(total);
        let mut packed = Vec::with_capacity(CHARGE_BYTES * total);
        // Per run of identical requests: charges per request, requests.
        let mut runs: Vec<(u32, u32)> = Vec::with_capacity(calls.len());
        let mut records = Vec::new();
        let mut before = 0;
        let mut requests = Vec::with_capacity(calls.len());
        // Per request: its key numbers in the batch.
        let mut local: Vec<usize> = Vec::new();
        // The request before, when it may start a run (no reservation).
        let mut run_of: Option<&Self> = None;
        for call in calls {
            requests.push(call.charges);
            let plain = call.args.get(4).is_none_or(Vec::is_empty);
            if let Some(prev) = run_of
                && plain
                && prev.keys == call.keys
                && prev.args.get(2) == call.args.get(2)
            {
                // The same request again: one more of the run.
                if let Some((_, times)) = runs.last_mut() {
                    *times = times.saturating_add(1);
                }
                continue;
            }
            run_of = plain.then_some(*call);
            local.clear();
            for k in &call.keys {
                let next = index.len();
                let i = *index.entry(k.as_str()).or_insert(next);
                if i == next {
                    keys.push(k.clone());
                }
                local.push(i + 1);
            }
            for charge in call.args[2].chunks_exact(CHARGE_BYTES) {
                let head = u32::from_be_bytes([charge[0], charge[1], charge[2], charge[3]]);
                let own = usize::try_from(head & 0x00ff_ffff).unwrap_or(0);
                let key_no = local.get(own.wrapping_sub(1)).copied().unwrap_or(0);
                let head =
                    (head & 0xff00_0000) | u32::try_from(key_no.min(MAX_KEY_NO)).unwrap_or(0);
                packed.extend_from_slice(&head.to_be_bytes());
                packed.extend_from_slice(&charge[4..]);
            }
            if let Some(own) = call.args.get(4) {
                for r in own.chunks_exact(RECORD_BYTES) {
                    let n = u32::from_be_bytes([r[0], r[1], r[2], r[3]]) as usize;
                    let book = u32::from_be_bytes([0, r[5], r[6], r[7]]) as usize;
                    let book_no = local.get(book.wrapping_sub(1)).copied().unwrap_or(0);
                    let mut id = [0u8; 16];
                    id.copy_from_slice(&r[8..24]);
                    push_record(
                        &mut records,
                        before + n,
                        r[4],
                        book_no,
                        &ReservationId(id),
                        u32::from_be_bytes([r[24], r[25], r[26], r[27]]),
                        u32::from_be_bytes([r[28], r[29], r[30], r[31]]),
                    );
                }
            }
            before += call.charges;
            runs.push((u32::try_from(call.charges).unwrap_or(u32::MAX), 1u32));
        }
        let mut sizes = Vec::with_capacity(8 * runs.len());
        for (charges, times) in runs {
            sizes.extend_from_slice(&charges.to_be_bytes());
            sizes.extend_from_slice(&times.to_be_bytes());
        }
        let first = calls.first().map(|c| c.args.as_slice()).unwrap_or_default();
        let arg = |i: usize| first.get(i).cloned().unwrap_or_default();
        let mut args = vec![arg(0), arg(1), packed, sizes];
        if !records.is_empty() {
            args.push(records);
        }
        Self {
            keys,
            args,
            charges: total,
            requests,
        }
    }

    /// Parses the reply of a call made by [`ScriptCall::batch`] of several
    /// requests: one outcome per request, in order (an error that only one
    /// request met, as its own call would have raised it).
    ///
    /// # Errors
    /// [`StorageError::Backend`] (`reply`) when the reply does not have the
    /// documented shape.
    pub fn parse_batch_reply(
        &self,
        reply: &Value,
    ) -> Result<Vec<Result<RequestResult, BatchItemError>>, StorageError> {
        let bad = |what: &str| {
            StorageError::backend(
                BackendKind::Reply,
                format!("unexpected token bucket script batch reply ({what})"),
            )
        };
        let Value::BulkString(bytes) = reply else {
            return Err(bad("not a string"));
        };
        let mut out = Vec::with_capacity(self.requests.len());
        let mut rest = bytes.as_slice();
        while let Some(&n) = self.requests.get(out.len()) {
            match rest.first() {
                Some(0 | 1) => {
                    let (result, len) = parse_one(rest, n).map_err(&bad)?;
                    out.push(Ok(result));
                    rest = &rest[len..];
                }
                Some(3) => {
                    // The requests a run answers all have its number of
                    // charges.
                    let same = self.requests[out.len()..]
                        .iter()
                        .take_while(|&&m| m == n)
                        .count();
                    let len = parse_run(rest, n, same, &mut out).map_err(&bad)?;
                    rest = &rest[len..];
                }
                Some(2) => {
                    let len = rest
                        .get(1..3)
                        .map(|b| usize::from(u16::from_be_bytes([b[0], b[1]])))
                        .ok_or_else(|| bad("error length"))?;
                    let text = rest.get(3..3 + len).ok_or_else(|| bad("error text"))?;
                    out.push(Err(server_error(text)));
                    rest = &rest[3 + len..];
                }
                _ => return Err(bad("request flag")),
            }
        }
        if !rest.is_empty() {
            return Err(bad("too long"));
        }
        Ok(out)
    }

    /// Sets the shortest expiry the script writes, in ms (0: none, exactly the
    /// time to full). **Tests only** (cargo feature `test-util`): production
    /// calls never carry one.
    #[cfg(any(test, feature = "test-util"))]
    #[must_use]
    pub fn with_min_ttl_ms(mut self, ms: u64) -> Self {
        self.args[1] = if ms == 0 {
            Vec::new()
        } else {
            ms.to_string().into_bytes()
        };
        self
    }

    /// Parses the script's reply for this call.
    ///
    /// # Errors
    /// [`StorageError::Backend`] (`reply`) when the reply does not have the
    /// documented shape.
    pub fn parse_reply(&self, reply: &Value) -> Result<RequestResult, StorageError> {
        parse_reply(reply, self.charges)
    }

    /// An empty command with room for the command name, a script (or its
    /// SHA) of `script_bytes`, `numkeys`, KEYS and ARGV: built without
    /// growing its buffers.
    fn sized_cmd(&self, script_bytes: usize) -> Cmd {
        let args = 3 + self.keys.len() + self.args.len();
        let bytes = 8
            + script_bytes
            + 20
            + self.keys.iter().map(String::len).sum::<usize>()
            + self.args.iter().map(Vec::len).sum::<usize>();
        Cmd::with_capacity(args, bytes)
    }

    /// Appends `numkeys`, KEYS and ARGV to an `EVALSHA` or `EVAL` command.
    fn push_keys_and_args(&self, cmd: &mut Cmd) {
        cmd.arg(self.keys.len());
        for k in &self.keys {
            cmd.arg(k.as_bytes());
        }
        for a in &self.args {
            cmd.arg(a.as_slice());
        }
    }
}

fn argument(message: String) -> StorageError {
    StorageError::backend(BackendKind::Argument, message)
}

/// Bytes of one charge in the packed ARGV: the algorithm (1 byte) and the
/// key index (3), the limit's three parameters as big-endian u32, cost and
/// flags as big-endian u64 (lua/request.lua).
pub const CHARGE_BYTES: usize = 32;

/// Largest key index a packed charge carries (3 bytes). A request has at
/// most a few thousand descriptors.
const MAX_KEY_NO: usize = (1 << 24) - 1;

/// Bytes of one reservation record in `ARGV[5]` (lua/request.lua): charge
/// number (4), op (1), book key number (3), id (16), ttl in seconds (4),
/// `max_open` (4), big-endian.
pub const RECORD_BYTES: usize = 32;

fn push_record(
    out: &mut Vec<u8>,
    charge_no: usize,
    op: u8,
    book_no: usize,
    id: &ReservationId,
    ttl_secs: u32,
    max_open: u32,
) {
    out.extend_from_slice(&u32::try_from(charge_no).unwrap_or(u32::MAX).to_be_bytes());
    let head = (u32::from(op) << 24) | u32::try_from(book_no.min(MAX_KEY_NO)).unwrap_or(0);
    out.extend_from_slice(&head.to_be_bytes());
    out.extend_from_slice(&id.0);
    out.extend_from_slice(&ttl_secs.to_be_bytes());
    out.extend_from_slice(&max_open.to_be_bytes());
}

pub(crate) fn push_charge(packed: &mut Vec<u8>, key_no: usize, spec: &ChargeSpec) {
    let sc = spec.limit.script_charge(spec.cost, spec.kind);
    let mut flags = match spec.kind {
        ChargeKind::Consume | ChargeKind::Reserve(_) | ChargeKind::Settle { .. } => 0,
        ChargeKind::Refund | ChargeKind::Return { .. } | ChargeKind::Unreserve { .. } => {
            u64::from(FLAG_REFUND)
        }
    };
    if spec.shadow {
        flags |= u64::from(FLAG_SHADOW);
    }
    // The algorithm's extra parameter (the bucket's debt bound, a window's
    // target of a return) rides in the flags (`flags / 4`): no extra
    // argument per charge on the hot path.
    flags |= sc.extra << 2;
    let head = (u32::from(sc.algorithm) << 24) | u32::try_from(key_no.min(MAX_KEY_NO)).unwrap_or(0);
    packed.extend_from_slice(&head.to_be_bytes());
    for p in sc.params {
        packed.extend_from_slice(&p.to_be_bytes());
    }
    packed.extend_from_slice(&sc.cost.to_be_bytes());
    packed.extend_from_slice(&flags.to_be_bytes());
}

#[path = "script_reply.rs"]
mod reply;
pub(crate) use reply::parse_reply;
use reply::{parse_one, parse_run, server_error};

#[cfg(test)]
#[path = "script_tests.rs"]
mod tests;
