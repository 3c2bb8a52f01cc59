//! The quota script (`lua/quota.lua`, assembled with the algorithms'
//! parts as the request script is): its text, the argument encoding of one
//! usage report, the `EVALSHA` call with one reload on `NOSCRIPT`, and
//! reply parsing. Used by every Redis backend (on a Cluster one call per
//! hash slot of a report, routed as the request script's calls are).

use super::script::{algorithm_part, algorithms_table, push_charge};
use crate::metrics as m;
use crate::storage::quota::{Held, QuotaReport, QuotaView, SubscriberRecord, unpack};
use crate::storage::{BackendKind, StorageError};
use ::redis::aio::ConnectionLike;
use ::redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};

/// The script source: the table of algorithms, then `lua/quota.lua`.
pub const SOURCE: &str = concat!(
    "local function PART(a)\n",
    algorithm_part!(0, "token_bucket.lua"),
    algorithm_part!(1, "fixed_window.lua"),
    algorithm_part!(2, "sliding_window.lua"),
    "end\n",
    algorithms_table!(),
    include_str!("../../../lua/quota.lua")
);

/// Bytes of one packed report entry (`ARGV[3]`).
pub const ENTRY_BYTES: usize = 64;

/// The quota script and its SHA-1.
#[derive(Clone, Debug)]
pub struct QuotaScript {
    sha: String,
}

impl Default for QuotaScript {
    fn default() -> Self {
        Self {
            sha: ::redis::Script::new(SOURCE).get_hash().to_owned(),
        }
    }
}

impl QuotaScript {
    /// Runs the `EVALSHA` of `args`; on `NOSCRIPT`,
    /// `SCRIPT LOAD` and one more `EVALSHA` (safe: `NOSCRIPT` proves it did
    /// not run). Counts reloads in `bucket_rls_redis_script_reload_total`.
    ///
    /// # Errors
    /// The Redis error of the last command sent.
    pub async fn eval<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        args: &QuotaArgs,
    ) -> Result<Value, RedisError> {
        let first = self.evalsha_cmd(args).query_async::<Value>(conn).await;
        match first {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                metrics::counter!(m::REDIS_SCRIPT_RELOAD).increment(1);
                let _: String = ::redis::cmd("SCRIPT")
                    .arg("LOAD")
                    .arg(SOURCE)
                    .query_async(conn)
                    .await?;
                self.evalsha_cmd(args).query_async::<Value>(conn).await
            }
            other => other,
        }
    }

    /// The `EVALSHA` command of `args` ([`QuotaScript::eval`] adds the
    /// `NOSCRIPT` handling).
    #[must_use]
    pub fn evalsha_cmd(&self, args: &QuotaArgs) -> Cmd {
        let mut cmd = ::redis::cmd("EVALSHA");
        cmd.arg(&self.sha);
        args.push_keys_and_args(&mut cmd);
        cmd
    }

    /// The `EVAL` command of `args` with the full source: runs the call and
    /// loads the script on that node (the answer to `NOSCRIPT` on a Cluster,
    /// where a separate `SCRIPT LOAD` could reach another node).
    #[must_use]
    pub fn eval_cmd(args: &QuotaArgs) -> Cmd {
        let mut cmd = ::redis::cmd("EVAL");
        cmd.arg(SOURCE);
        args.push_keys_and_args(&mut cmd);
        cmd
    }
}

/// KEYS and ARGV of one report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuotaArgs {
    keys: Vec<String>,
    args: Vec<Vec<u8>>,
    entries: usize,
}

impl QuotaArgs {
    /// Encodes `reports` (each entry with its own subscriber id: a stream
    /// is one subscriber per bucket id) with an explicit test `now_us` and
    /// shortest expiry, or none in production.
    #[must_use]
    pub fn new(reports: &[QuotaReport], test_now: Option<(u64, u64)>) -> Self {
        let mut keys = Vec::with_capacity(2 * reports.len());
        let mut packed = Vec::with_capacity(ENTRY_BYTES * reports.len());
        for r in reports {
            keys.push(r.bucket.clone());
            keys.push(r.subscribers.clone());
            push_charge(&mut packed, keys.len() - 1, &r.charge);
            packed.extend_from_slice(
                &r.demand_milli
                    .min(crate::storage::quota::UNMEASURED_DEMAND)
                    .to_be_bytes(),
            );
            let (t, m) = r
                .held
                .map_or((u32::MAX, u32::MAX), |h| (h.tokens_per_fill, h.max_tokens));
            packed.extend_from_slice(&t.to_be_bytes());
            packed.extend_from_slice(&m.to_be_bytes());
            packed.extend_from_slice(&r.live_ms.to_be_bytes());
            packed.extend_from_slice(&r.budget.tokens_per_fill.to_be_bytes());
            packed.extend_from_slice(&r.budget.max_tokens.to_be_bytes());
        }
        let (now, min_ttl) = match test_now {
            Some((now, ttl)) => (now.to_string().into_bytes(), ttl.to_string().into_bytes()),
            None => (Vec::new(), Vec::new()),
        };
        let mut args = Vec::with_capacity(3 + reports.len());
        args.extend([now, min_ttl, packed]);
        args.extend(reports.iter().map(|r| r.subscriber.clone().into_bytes()));
        Self {
            keys,
            args,
            entries: reports.len(),
        }
    }

    /// Appends the key count, KEYS and ARGV to `cmd`.
    fn push_keys_and_args(&self, cmd: &mut Cmd) {
        cmd.arg(self.keys.len());
        for k in &self.keys {
            cmd.arg(k.as_bytes());
        }
        for a in &self.args {
            cmd.arg(a.as_slice());
        }
    }

    /// Parses the script's reply.
    ///
    /// # Errors
    /// [`StorageError::Backend`] (`reply`) for a reply of another shape.
    pub fn parse_reply(&self, reply: &Value) -> Result<Vec<QuotaView>, StorageError> {
        let bad = |what: &str| {
            StorageError::backend(BackendKind::Reply, format!("quota script reply: {what}"))
        };
        let Value::Array(items) = reply else {
            return Err(bad("not an array"));
        };
        if items.len() != 2 * self.entries {
            return Err(bad("wrong length"));
        }
        let mut out = Vec::with_capacity(self.entries);
        for pair in items.chunks(2) {
            let Value::Int(balance_micro) = pair[0] else {
                return Err(bad("balance is not an integer"));
            };
            let Value::Array(records) = &pair[1] else {
                return Err(bad("records are not an array"));
            };
            let mut subscribers = Vec::with_capacity(records.len() / 2);
            for r in records.chunks(2) {
                let (Value::BulkString(id), Some(Value::BulkString(v))) = (&r[0], r.get(1)) else {
                    return Err(bad("a record is not two strings"));
                };
                let Some((demand_milli, held, _)) = unpack(v) else {
                    return Err(bad("a record has the wrong length"));
                };
                subscribers.push(SubscriberRecord {
                    id: String::from_utf8_lossy(id).into_owned(),
                    demand_milli,
                    held: held.map(|h: Held| h),
                });
            }
            subscribers.sort_by(|a, b| a.id.cmp(&b.id));
            out.push(QuotaView {
                balance_micro,
                subscribers,
            });
        }
        Ok(out)
    }
}
