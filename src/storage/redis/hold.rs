//! Keeping existing buckets after a reload (`Storage::hold_existing`): every
//! key under the prefix is kept at least as long as the new config needs,
//! on a single node or Sentinel master ([`hold_keys`]) and on every master
//! of a Cluster ([`hold_cluster`]).
//!
//! One hold runs at a time per backend ([`HoldQueue`]): a hold asked while
//! one runs waits, and a later one for the same key prefix (the same slowed
//! rule) replaces the waiting one (keeping the longer hold), so a burst of
//! reloads costs at most one more scan per rule. A hold's
//! Redis work is paced: after each step (one `SCAN` of 500 and one script
//! call) it pauses [`PACE`] times as long as the step took, so it takes at
//! most a quarter of the time of the connection it shares with requests.

use super::cluster::slot::key_slot_bytes;
use super::errors::redact;
use ::redis::aio::ConnectionLike;
use ::redis::cluster_async::ClusterConnection;
use ::redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use futures::future::BoxFuture;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// After each step of a hold, a pause of this many times the step's
/// duration.
pub(crate) const PACE: u32 = 3;

/// Pauses [`PACE`] times the time since `step`.
async fn pace(step: Instant) {
    tokio::time::sleep(step.elapsed() * PACE).await;
}

/// A hold run: given the hold in milliseconds, the future that runs it.
type HoldRun = Box<dyn FnOnce(u64) -> BoxFuture<'static, ()> + Send>;

/// The holds of one backend, one running at a time (see the module doc).
#[derive(Default)]
pub(crate) struct HoldQueue {
    state: Mutex<QueueState>,
}

#[derive(Default)]
struct QueueState {
    running: bool,
    /// The holds waiting for the running one, in arrival order: the key
    /// prefix each holds, its hold and its run.
    waiting: Vec<(String, u64, HoldRun)>,
}

impl std::fmt::Debug for HoldQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.state.lock();
        f.debug_struct("HoldQueue")
            .field("running", &st.running)
            .field("waiting", &st.waiting.len())
            .finish()
    }
}

impl HoldQueue {
    /// Runs `run(hold_ms)` for the keys under `prefix` in the background
    /// now, or after the holds before it; a hold already waiting for the
    /// same prefix is replaced by this one, with the longer of the two
    /// holds (so reloads in a burst wait as at most one hold per prefix).
    pub(crate) fn submit(self: &Arc<Self>, prefix: &str, hold_ms: u64, run: HoldRun) {
        {
            let mut st = self.state.lock();
            if st.running {
                if let Some(w) = st.waiting.iter_mut().find(|w| w.0 == prefix) {
                    w.1 = w.1.max(hold_ms);
                    w.2 = run;
                } else {
                    st.waiting.push((prefix.to_owned(), hold_ms, run));
                }
                return;
            }
            st.running = true;
        }
        let queue = self.clone();
        tokio::spawn(async move {
            let (mut hold_ms, mut run) = (hold_ms, run);
            loop {
                run(hold_ms).await;
                let mut st = queue.state.lock();
                if st.waiting.is_empty() {
                    st.running = false;
                    return;
                }
                let (_, h, r) = st.waiting.remove(0);
                (hold_ms, run) = (h, r);
            }
        });
    }
}

/// Keeps each key of `KEYS` at least `ARGV[1]` ms: `PEXPIRE` only where the
/// key's TTL is shorter (a key already gone, or without a TTL, is left
/// alone). Returns how many keys it extended.
pub(crate) const HOLD_SCRIPT: &str = "local n = 0 \
    for _, k in ipairs(KEYS) do \
      local t = redis.call('PTTL', k) \
      if t >= 0 and t < tonumber(ARGV[1]) then redis.call('PEXPIRE', k, ARGV[1]); n = n + 1 end \
    end return n";

/// `prefix` as a `SCAN MATCH` pattern for every key under it (`*?[]\`
/// escaped).
fn prefix_pattern(prefix: &str) -> String {
    let mut p = String::with_capacity(prefix.len() + 2);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            p.push('\\');
        }
        p.push(c);
    }
    p.push('*');
    p
}

/// `SCAN`s the keys under `prefix` on the node behind `conn` and keeps each
/// at least `hold_ms` (`Storage::hold_existing`): 500 keys per step, one
/// script call per step. Returns how many keys were extended.
///
/// # Errors
/// The first failing `SCAN` or script call.
pub(crate) async fn hold_keys<C: ConnectionLike>(
    conn: &mut C,
    prefix: &str,
    hold_ms: u64,
) -> ::redis::RedisResult<u64> {
    let pattern = prefix_pattern(prefix);
    let mut cursor: u64 = 0;
    let mut extended = 0u64;
    loop {
        let step = Instant::now();
        let (next, keys): (u64, Vec<Vec<u8>>) = ::redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(500)
            .query_async(conn)
            .await?;
        if !keys.is_empty() {
            // Plain EVAL: rare and small, no script cache to keep loaded.
            let n: u64 = ::redis::cmd("EVAL")
                .arg(HOLD_SCRIPT)
                .arg(keys.len())
                .arg(keys)
                .arg(hold_ms)
                .query_async(conn)
                .await?;
            extended += n;
        }
        if next == 0 {
            return Ok(extended);
        }
        cursor = next;
        pace(step).await;
    }
}

/// Runs [`hold_keys`] through `queue` and logs the outcome.
pub(crate) fn spawn_hold<C>(
    queue: &Arc<HoldQueue>,
    mut conn: C,
    prefix: &str,
    hold_us: u64,
    secret: Option<String>,
) where
    C: ConnectionLike + Send + 'static,
{
    let key = prefix.to_owned();
    let prefix = prefix.to_owned();
    queue.submit(
        &key,
        hold_us.div_ceil(1000),
        Box::new(move |hold_ms| {
            Box::pin(async move {
                let result = hold_keys(&mut conn, &prefix, hold_ms).await;
                log_hold(&result, hold_ms, secret.as_deref());
            })
        }),
    );
}

/// Logs the outcome of a background key hold (single node, Sentinel or
/// Cluster): the keys extended, or the error with the password redacted.
pub(crate) fn log_hold(result: &::redis::RedisResult<u64>, hold_ms: u64, secret: Option<&str>) {
    match result {
        Ok(n) => tracing::info!(
            extended = n,
            hold_secs = hold_ms / 1000,
            "kept existing Redis buckets until they are full under the new limits"
        ),
        Err(e) => tracing::warn!(
            error = %redact(&e.to_string(), secret),
            "could not extend existing Redis buckets after a reload; some may expire before they are full under the new limits"
        ),
    }
}

/// [`hold_keys`] on every master of a Cluster: `SCAN` each one (addressed as
/// `CLUSTER SLOTS` names it), then one script call per hash slot of each
/// batch (a call never spans two slots).
pub(crate) async fn hold_cluster(
    mut conn: ClusterConnection,
    prefix: &str,
    hold_ms: u64,
) -> ::redis::RedisResult<u64> {
    let slots = conn
        .route_command(
            ::redis::cmd("CLUSTER").arg("SLOTS").clone(),
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
        )
        .await?;
    let ranges: Vec<Vec<::redis::Value>> = ::redis::from_redis_value(slots)?;
    let mut masters = std::collections::BTreeSet::new();
    for range in ranges {
        // [start, end, [host, port, id, ...], replicas...]
        if let Some(node) = range.into_iter().nth(2) {
            let mut node: Vec<::redis::Value> = ::redis::from_redis_value(node)?;
            node.truncate(2);
            let (host, port): (String, u16) =
                ::redis::from_redis_value(::redis::Value::Array(node))?;
            masters.insert((host, port));
        }
    }
    let pattern = prefix_pattern(prefix);
    let mut extended = 0u64;
    for (host, port) in masters {
        let mut cursor: u64 = 0;
        loop {
            let step = Instant::now();
            let reply = conn
                .route_command(
                    ::redis::cmd("SCAN")
                        .arg(cursor)
                        .arg("MATCH")
                        .arg(&pattern)
                        .arg("COUNT")
                        .arg(500)
                        .clone(),
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                        host: host.clone(),
                        port,
                    }),
                )
                .await?;
            let (next, keys): (u64, Vec<Vec<u8>>) = ::redis::from_redis_value(reply)?;
            let mut by_slot: HashMap<u16, Vec<Vec<u8>>> = HashMap::new();
            for k in keys {
                by_slot.entry(key_slot_bytes(&k)).or_default().push(k);
            }
            for keys in by_slot.into_values() {
                let n: u64 = ::redis::cmd("EVAL")
                    .arg(HOLD_SCRIPT)
                    .arg(keys.len())
                    .arg(keys)
                    .arg(hold_ms)
                    .query_async(&mut conn)
                    .await?;
                extended += n;
            }
            if next == 0 {
                break;
            }
            cursor = next;
            pace(step).await;
        }
    }
    Ok(extended)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A run that records its hold, then waits for `gate` (if any).
    fn run(
        runs: &Arc<Mutex<Vec<u64>>>,
        gate: Option<tokio::sync::oneshot::Receiver<()>>,
        done: &Arc<AtomicUsize>,
    ) -> HoldRun {
        let (runs, done) = (runs.clone(), done.clone());
        Box::new(move |hold_ms| {
            Box::pin(async move {
                runs.lock().push(hold_ms);
                if let Some(g) = gate {
                    let _ = g.await;
                }
                done.fetch_add(1, Ordering::SeqCst);
            })
        })
    }

    #[tokio::test]
    async fn a_burst_of_holds_runs_one_more_scan_per_prefix_with_the_longest_hold() {
        let queue = Arc::new(HoldQueue::default());
        let runs = Arc::new(Mutex::new(Vec::new()));
        let done = Arc::new(AtomicUsize::new(0));
        let (open, gate) = tokio::sync::oneshot::channel();
        queue.submit("p:a", 1_000, run(&runs, Some(gate), &done));
        while runs.lock().is_empty() {
            tokio::task::yield_now().await;
        }
        // 100 reloads while the first scan runs, each holding the same two
        // rules: one hold per prefix waits, with the longest asked.
        for i in 0..100u64 {
            let h = if i == 37 { 9_000 } else { 2_000 + i };
            queue.submit("p:a", h, run(&runs, None, &done));
            queue.submit("p:b", 3, run(&runs, None, &done));
        }
        let _ = open.send(());
        while done.load(Ordering::SeqCst) < 3 {
            tokio::task::yield_now().await;
        }
        assert_eq!(*runs.lock(), vec![1_000, 9_000, 3]);
        // Idle again: the next hold runs at once.
        queue.submit("p:a", 5, run(&runs, None, &done));
        while done.load(Ordering::SeqCst) < 4 {
            tokio::task::yield_now().await;
        }
        assert_eq!(*runs.lock(), vec![1_000, 9_000, 3, 5]);
    }
}
