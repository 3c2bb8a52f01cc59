//! One script call in one hash slot, routed as the cluster answers: `MOVED`
//! and `ASK` are followed, `TRYAGAIN` waits and retries, `NOSCRIPT` is
//! answered with one `EVAL` of the full source, and a library the node does
//! not have (`Function not found`) with one `FUNCTION LOAD` on that node;
//! a refusal of Functions and an `OOM` (memory full refuses a function
//! before it runs; a script only at its first write) with one `EVAL`.
//! Each of these replies proves the script did not run, so the retry is
//! safe; nothing else is retried. The same routing serves the request
//! script and the quota script.

use crate::metrics as m;
use crate::storage::redis::quota_script::{QuotaArgs, QuotaScript};
use crate::storage::redis::script::{
    BucketScript, ScriptCall, function_missing, refused_for_memory, refuses_functions,
};
use ::redis::cluster_async::ClusterConnection;
use ::redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use ::redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};
use std::time::Duration;

/// One call of a script, as `FCALL` of its library or `EVALSHA`, or (the
/// answer to `NOSCRIPT`, or to a node that refuses Functions) as `EVAL`
/// with the full source, which also loads it on that node.
pub(crate) trait SlotScript: Send {
    /// The script's name in logs.
    const NAME: &'static str;
    /// The command of the call as calls go now (`FCALL` or `EVALSHA`).
    fn call(&self) -> Cmd;
    /// The `EVAL` command of the call, with the full source.
    fn eval(&self) -> Cmd;
    /// When the call goes as `FCALL`: the `FUNCTION LOAD` of its library.
    fn function_load(&self) -> Option<Cmd> {
        None
    }
    /// A node refused Functions (`e`): calls go as `EVALSHA` from now on.
    fn refuse_functions(&self, _e: &RedisError) {}
    /// A node had lost the library: counted as a reload.
    fn reloaded(&self) {}
}

impl SlotScript for (&BucketScript, &ScriptCall) {
    const NAME: &'static str = "token bucket";

    fn call(&self) -> Cmd {
        self.0.call_cmd(self.1)
    }

    fn eval(&self) -> Cmd {
        BucketScript::eval_cmd(self.1)
    }

    fn function_load(&self) -> Option<Cmd> {
        self.0
            .uses_functions()
            .then(BucketScript::function_load_cmd)
    }

    fn refuse_functions(&self, e: &RedisError) {
        self.0.refuse_functions(e);
    }

    fn reloaded(&self) {
        self.0
            .reloaded("the token bucket library on a cluster node (Function not found)");
    }
}

impl SlotScript for (&QuotaScript, &QuotaArgs) {
    const NAME: &'static str = "quota";

    fn call(&self) -> Cmd {
        self.0.evalsha_cmd(self.1)
    }

    fn eval(&self) -> Cmd {
        QuotaScript::eval_cmd(self.1)
    }
}

/// Redirects (`MOVED`, `ASK`), `TRYAGAIN` waits and `NOSCRIPT` reloads one
/// slot call may go through before it gives up (within its timeout anyway).
const MAX_ATTEMPTS: usize = 6;
/// Wait before retrying after `TRYAGAIN` (a slot being migrated).
const TRYAGAIN_DELAY: Duration = Duration::from_millis(5);

/// Where the next attempt of a slot call goes.
enum Target {
    /// The slot's master in the client's slot map.
    Slot,
    /// A node named by `MOVED`.
    Moved(String, u16),
    /// A node named by `ASK` (needs `ASKING` first).
    Ask(String, u16),
}

fn redirect(e: &RedisError) -> Option<(String, u16)> {
    let (addr, _slot) = e.redirect_node()?;
    let (host, port) = addr.rsplit_once(':')?;
    Some((host.to_owned(), port.parse().ok()?))
}

/// Sends `cmd` to `target` (the master of `slot`, or the node a redirect
/// named; `ASKING` first for an `ASK`).
async fn send(
    conn: &mut ClusterConnection,
    slot: u16,
    target: &Target,
    cmd: Cmd,
) -> Result<Value, RedisError> {
    let by_address = |host: &String, port: &u16| SingleNodeRoutingInfo::ByAddress {
        host: host.clone(),
        port: *port,
    };
    match target {
        Target::Slot => {
            let route = SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master));
            conn.route_command(cmd, RoutingInfo::SingleNode(route))
                .await
        }
        Target::Moved(host, port) => {
            conn.route_command(cmd, RoutingInfo::SingleNode(by_address(host, port)))
                .await
        }
        Target::Ask(host, port) => {
            let mut pipe = ::redis::pipe();
            pipe.cmd("ASKING").add_command(cmd);
            conn.route_pipeline(pipe, 1, 1, by_address(host, port))
                .await
                .and_then(|mut v| v.pop().unwrap_or(Value::Nil).extract_error())
        }
    }
}

/// Runs one script call on the master of `slot`, following `MOVED` and
/// `ASK`, waiting on `TRYAGAIN`, answering `NOSCRIPT` with one `EVAL` and
/// `Function not found` with one `FUNCTION LOAD` on that node (or, where
/// the node refuses Functions, with `EVAL`); each of these replies proves
/// the script did not run. Any other error (a timeout, a dropped
/// connection) is returned and never replayed.
pub(crate) async fn eval_in_slot<S: SlotScript>(
    conn: &mut ClusterConnection,
    slot: u16,
    call: S,
) -> Result<Value, RedisError> {
    let mut target = Target::Slot;
    let mut with_source = false;
    let mut loaded = false;
    let mut last = None;
    for _ in 0..MAX_ATTEMPTS {
        let cmd = if with_source {
            call.eval()
        } else {
            call.call()
        };
        // The cluster client returns most server errors as a value.
        let e = match send(conn, slot, &target, cmd)
            .await
            .and_then(Value::extract_error)
        {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        let library = if with_source {
            None
        } else {
            call.function_load()
        };
        match e.kind() {
            ErrorKind::Server(ServerErrorKind::NoScript) if !with_source => {
                metrics::counter!(m::REDIS_SCRIPT_RELOAD).increment(1);
                tracing::info!(
                    slot,
                    script = S::NAME,
                    "a Redis Cluster node lost the script (NOSCRIPT); sending it with EVAL"
                );
                with_source = true;
            }
            _ if library.is_some() && refuses_functions(&e) => {
                call.refuse_functions(&e);
                with_source = true;
            }
            // Memory full: the node refused the function before running
            // it; as a script (`EVAL`) a call that writes nothing is
            // answered, one that writes refused at its first write.
            _ if library.is_some() && refused_for_memory(&e) => with_source = true,
            _ if library.is_some() && function_missing(&e) && !loaded => {
                loaded = true;
                call.reloaded();
                let load = library.unwrap_or_else(BucketScript::function_load_cmd);
                match send(conn, slot, &target, load)
                    .await
                    .and_then(Value::extract_error)
                {
                    Ok(_) => {}
                    Err(le) if refuses_functions(&le) => {
                        call.refuse_functions(&le);
                        with_source = true;
                    }
                    Err(le) if refused_for_memory(&le) => with_source = true,
                    Err(le) => return Err(le),
                }
            }
            ErrorKind::Server(ServerErrorKind::Moved) => match redirect(&e) {
                Some((h, p)) => target = Target::Moved(h, p),
                None => return Err(e),
            },
            ErrorKind::Server(ServerErrorKind::Ask) => match redirect(&e) {
                Some((h, p)) => target = Target::Ask(h, p),
                None => return Err(e),
            },
            ErrorKind::Server(ServerErrorKind::TryAgain) => {
                tokio::time::sleep(TRYAGAIN_DELAY).await;
                target = Target::Slot;
            }
            _ => return Err(e),
        }
        last = Some(e);
    }
    Err(last.unwrap_or_else(|| RedisError::from((ErrorKind::Client, "no attempt made"))))
}
