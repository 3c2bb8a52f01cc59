//! Keeping existing buckets after a reload (`Storage::hold_existing`): every
//! key under the prefix is kept at least as long as the new config needs,
//! on a single node or Sentinel master ([`spawn_hold`]) and on every master
//! of a Cluster ([`hold_cluster`]).

use super::cluster::slot::key_slot_bytes;
use super::errors::redact;
use ::redis::aio::ConnectionLike;
use ::redis::cluster_async::ClusterConnection;
use ::redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use std::collections::HashMap;

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
    }
}

/// Runs [`hold_keys`] in the background and logs the outcome.
pub(crate) fn spawn_hold<C>(mut conn: C, prefix: &str, hold_us: u64, secret: Option<String>)
where
    C: ConnectionLike + Send + 'static,
{
    let prefix = prefix.to_owned();
    let hold_ms = hold_us.div_ceil(1000);
    tokio::spawn(async move {
        let result = hold_keys(&mut conn, &prefix, hold_ms).await;
        log_hold(&result, hold_ms, secret.as_deref());
    });
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
        }
    }
    Ok(extended)
}
