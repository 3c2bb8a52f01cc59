//! The one Rust wrapper of `lua/token_bucket.lua`: argument encoding, the
//! only builder of its `EVALSHA`, `EVAL` and `SCRIPT LOAD` commands, the
//! `EVALSHA` call with one reload-and-retry on `NOSCRIPT`, and reply parsing.
//! Everything here is topology-independent, so a Cluster or Sentinel backend
//! calls the same functions per node or per slot.

use crate::metrics as m;
use crate::storage::bucket::{ChargeKind, ChargeResult, ChargeSpec, RequestResult};
use crate::storage::{BackendKind, Charge, StorageError, group_by_key};
use ::redis::aio::ConnectionLike;
use ::redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};

/// The script source, embedded at build time.
pub const SOURCE: &str = include_str!("../../../lua/token_bucket.lua");

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

/// The token bucket script: its source and SHA-1 (what `EVALSHA` takes).
#[derive(Clone, Debug)]
pub struct BucketScript {
    sha: String,
    /// `NOSCRIPT` reloads so far (shared by clones).
    reloads: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Default for BucketScript {
    fn default() -> Self {
        Self::new()
    }
}

impl BucketScript {
    /// The script of `lua/token_bucket.lua`.
    #[must_use]
    pub fn new() -> Self {
        Self {
            sha: ::redis::Script::new(SOURCE).get_hash().to_owned(),
            reloads: std::sync::Arc::default(),
        }
    }

    /// `NOSCRIPT` replies seen so far: each means Redis restarted, failed
    /// over or flushed its scripts, so what it said about buckets before may
    /// no longer hold.
    #[must_use]
    pub fn reloads(&self) -> u64 {
        self.reloads.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// SHA-1 of the source, as Redis reports it from `SCRIPT LOAD`.
    #[must_use]
    pub fn sha(&self) -> &str {
        &self.sha
    }

    /// Runs one prepared call: `EVALSHA`; on `NOSCRIPT` (the script cache was
    /// flushed, or Redis restarted or failed over) `SCRIPT LOAD` and one more
    /// `EVALSHA`. `NOSCRIPT` proves the script did not run, so the retry is
    /// safe; any other failure, in particular a timeout after sending, is
    /// returned as is and never replayed (docs/design.md, "Ambiguous failures are never replayed"). Counts reloads in
    /// `bucket_rls_redis_script_reload_total`.
    ///
    /// # Errors
    /// The Redis error of the last command sent.
    pub async fn eval<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        call: &ScriptCall,
    ) -> Result<Value, RedisError> {
        let first = self.evalsha_cmd(call).query_async::<Value>(conn).await;
        match first {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                metrics::counter!(m::REDIS_SCRIPT_RELOAD).increment(1);
                self.reloads
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::info!("Redis lost the token bucket script (NOSCRIPT); loading it again");
                let _: String = Self::load_cmd().query_async(conn).await?;
                self.evalsha_cmd(call).query_async::<Value>(conn).await
            }
            other => other,
        }
    }

    /// Loads the script into the script cache (`SCRIPT LOAD`), e.g. at startup.
    ///
    /// # Errors
    /// The Redis error.
    pub async fn load<C: ConnectionLike + Send>(&self, conn: &mut C) -> Result<(), RedisError> {
        let _: String = Self::load_cmd().query_async(conn).await?;
        Ok(())
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
        let mut cmd = ::redis::cmd("EVALSHA");
        cmd.arg(&self.sha);
        call.push_keys_and_args(&mut cmd);
        cmd
    }

    /// The `EVAL` command of one call, with the full source: runs the call
    /// and loads the script on that node (the answer to `NOSCRIPT` where a
    /// separate `SCRIPT LOAD` could reach another node).
    #[must_use]
    pub fn eval_cmd(call: &ScriptCall) -> Cmd {
        let mut cmd = ::redis::cmd("EVAL");
        cmd.arg(SOURCE);
        call.push_keys_and_args(&mut cmd);
        cmd
    }
}

/// The KEYS and ARGV of one script call (one request, or one slot's part of it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScriptCall {
    /// Distinct bucket keys (KEYS).
    pub keys: Vec<String>,
    /// ARGV: explicit now (or empty), shortest expiry in ms (or empty), then
    /// six values per charge.
    pub args: Vec<String>,
    /// Number of charges (the reply has `1 + 2 * charges` integers).
    pub charges: usize,
}

impl ScriptCall {
    /// Encodes `charges` for the script. `now_us` is the explicit test clock
    /// (`None` in production: the script reads Redis `TIME`); with it, keys
    /// live at least [`TEST_MIN_TTL_MS`] (see `ScriptCall::with_min_ttl_ms`, cargo feature `test-util`).
    ///
    /// Costs are clamped to capacity + `max_debt` + 1 token for consumes and
    /// to capacity + `u32::MAX` (the deepest debt) for refunds, which changes
    /// no outcome (see
    /// [`ChargeSpec::need_micro`]; a debt charge that large is clamped at
    /// `-max_debt` anyway) and keeps every micro-token amount below 2^53
    /// inside Lua (a capacity and a debt bound are at most `u32::MAX` tokens
    /// each and a unit at least 1 s, by their types).
    ///
    /// # Errors
    /// [`StorageError::Backend`] ([`BackendKind::Argument`]) for an explicit
    /// `now_us` above [`MAX_EXPLICIT_NOW_US`]: the script could not compute
    /// with it exactly.
    pub fn new(charges: &[Charge], now_us: Option<u64>) -> Result<Self, StorageError> {
        let (keys, indexed) = group_by_key(charges);
        let mut args = Vec::with_capacity(2 + 6 * indexed.len());
        match now_us {
            Some(t) if t > MAX_EXPLICIT_NOW_US => {
                return Err(argument(format!("explicit now_us {t} is above 2^53")));
            }
            Some(t) => {
                args.push(t.to_string());
                args.push(TEST_MIN_TTL_MS.to_string());
            }
            None => {
                args.push(String::new());
                args.push(String::new());
            }
        }
        for (key_idx, spec) in &indexed {
            push_charge(&mut args, key_idx + 1, spec);
        }
        Ok(Self {
            keys: keys.into_iter().map(str::to_owned).collect(),
            args,
            charges: indexed.len(),
        })
    }

    /// Sets the shortest expiry the script writes, in ms (0: none, exactly the
    /// time to full). **Tests only** (cargo feature `test-util`): production
    /// calls never carry one.
    #[cfg(any(test, feature = "test-util"))]
    #[must_use]
    pub fn with_min_ttl_ms(mut self, ms: u64) -> Self {
        self.args[1] = if ms == 0 {
            String::new()
        } else {
            ms.to_string()
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

    /// Appends `numkeys`, KEYS and ARGV to an `EVALSHA` or `EVAL` command.
    fn push_keys_and_args(&self, cmd: &mut Cmd) {
        cmd.arg(self.keys.len());
        for k in &self.keys {
            cmd.arg(k.as_bytes());
        }
        for a in &self.args {
            cmd.arg(a.as_bytes());
        }
    }
}

fn argument(message: String) -> StorageError {
    StorageError::backend(BackendKind::Argument, message)
}

fn push_charge(args: &mut Vec<String>, key_no: usize, spec: &ChargeSpec) {
    let l = &spec.limit;
    let burst = l.burst;
    let cap_tokens = if l.requests_per_unit == 0 {
        0
    } else {
        u64::from(burst)
    };
    // The debt bound rides in the flags (`flags / 4`): no extra argument
    // per charge on the hot path.
    let debt_tokens = if l.requests_per_unit == 0 {
        0
    } else {
        u64::from(l.max_debt)
    };
    let (cost, mut flags) = match spec.kind {
        ChargeKind::Consume => (spec.cost.min(cap_tokens + debt_tokens + 1), 0),
        // A balance is never below -u32::MAX tokens (the largest debt bound).
        ChargeKind::Refund => (
            spec.cost.min(cap_tokens + u64::from(u32::MAX)),
            u64::from(FLAG_REFUND),
        ),
    };
    if spec.shadow {
        flags |= u64::from(FLAG_SHADOW);
    }
    flags |= debt_tokens << 2;
    args.push(key_no.to_string());
    args.push(l.requests_per_unit.to_string());
    args.push(l.unit_secs.to_string());
    args.push(burst.to_string());
    args.push(cost.to_string());
    args.push(flags.to_string());
}

/// Parses `{ admitted, enough_1, tokens_1, ... }` for `charges` charges.
///
/// # Errors
/// [`StorageError::Backend`] (`reply`) when the reply has another shape.
pub(crate) fn parse_reply(reply: &Value, charges: usize) -> Result<RequestResult, StorageError> {
    let bad = |what: &str| {
        StorageError::backend(
            BackendKind::Reply,
            format!("unexpected token bucket script reply ({what}): {reply:?}"),
        )
    };
    let Value::Array(items) = reply else {
        return Err(bad("not an array"));
    };
    if items.len() != 1 + 2 * charges {
        return Err(bad("wrong length"));
    }
    let int = |v: &Value| match v {
        Value::Int(i) => Ok(*i),
        _ => Err(bad("not an integer")),
    };
    let admitted = match int(&items[0])? {
        0 => false,
        1 => true,
        _ => return Err(bad("admitted flag")),
    };
    let mut out = Vec::with_capacity(charges);
    for pair in items[1..].chunks_exact(2) {
        let enough = match int(&pair[0])? {
            0 => false,
            1 => true,
            _ => return Err(bad("enough flag")),
        };
        out.push(ChargeResult {
            enough,
            tokens_micro: int(&pair[1])?,
        });
    }
    Ok(RequestResult {
        admitted,
        charges: out,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::bucket::Limit;

    fn charge(key: &str, cost: u64, kind: ChargeKind, shadow: bool) -> Charge {
        Charge {
            key: key.into(),
            spec: ChargeSpec {
                limit: Limit {
                    requests_per_unit: 10,
                    unit_secs: std::num::NonZeroU64::new(60).expect("a minute"),
                    burst: 20,
                    max_debt: 0,
                },
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
        let expect: Vec<&str> = vec![
            "", "", "1", "10", "60", "20", "21", "0", "2", "10", "60", "20", "0", "2", "1", "10",
            "60", "20", "1000", "1",
        ];
        assert_eq!(call.args, expect);
        assert!(
            ScriptCall::new(&[charge("a", 1, ChargeKind::Consume, false)], Some(1 << 53)).is_err()
        );
    }

    #[test]
    fn replies_are_checked() {
        let ok = Value::Array(vec![Value::Int(1), Value::Int(1), Value::Int(5)]);
        let r = parse_reply(&ok, 1).expect("valid");
        assert!(r.admitted);
        assert_eq!(r.charges[0].tokens_micro, 5);
        assert!(parse_reply(&ok, 2).is_err());
        // A balance in debt is negative.
        let debt = parse_reply(
            &Value::Array(vec![Value::Int(0), Value::Int(0), Value::Int(-5)]),
            1,
        )
        .expect("valid");
        assert_eq!(debt.charges[0].tokens_micro, -5);
        assert!(
            parse_reply(
                &Value::Array(vec![Value::Int(2), Value::Int(1), Value::Int(5)]),
                1
            )
            .is_err()
        );
        assert!(parse_reply(&Value::Nil, 0).is_err());
    }
}
