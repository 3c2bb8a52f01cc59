//! Redis Cluster latency against the number of hash slots a request touches
//! (BENCHMARKS.md, "Redis Cluster: latency against slots touched"; the goal
//! is in `docs/cases.md`, "Cluster latency does not grow with the slots
//! touched"). Starts its own six-node cluster on loopback (three masters,
//! three replicas), measures on it, then announces its masters behind a
//! proxy that adds 2 ms to every reply and measures again. Requests go one
//! after another through the service core, with 1 descriptor and with 8
//! descriptors in 8 slots spread over the three masters. Prints p50, p90 and
//! p99.
//!
//! `cargo bench --bench cluster_latency` measures (release build, 2,000
//! requests per shape on loopback, 500 with the added latency). Under
//! `cargo test` (no `--bench` argument) it runs a few requests per shape and
//! only checks the answers, so CI keeps the code path working without
//! spending time on measurements. Needs `redis-server` and `redis-cli`.

#[path = "../tests/common/mod.rs"]
mod common;

use bucket_rls::grpc::ShouldRateLimit as _;
use bucket_rls::limiter::Limiter;
use bucket_rls::storage::redis::cluster::{RedisClusterStorage, key_slot};
use common::cluster::{RedisCluster, Shard, bucket, connected, delay_proxy, value_in};
use common::eventually::eventually_blocking;
use common::{desc, limiter, req, unique_prefix};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

/// A `route` rule far too large to deny: only call latency is measured.
const ROUTE_YAML: &str = "
domain: c
descriptors:
  - key: route
    rate_limit: {unit: second, requests_per_unit: 1000000}
";

/// Requests per shape: warm-up and measured.
#[derive(Clone, Copy)]
struct Rounds {
    warm: usize,
    measured: usize,
}

fn main() {
    let measuring = std::env::args().any(|a| a == "--bench");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let (loopback, delayed) = if measuring {
        (
            Rounds {
                warm: 200,
                measured: 2000,
            },
            Rounds {
                warm: 50,
                measured: 500,
            },
        )
    } else {
        let few = Rounds {
            warm: 5,
            measured: 20,
        };
        (few, few)
    };
    rt.block_on(async {
        let c = tokio::task::spawn_blocking(RedisCluster::start)
            .await
            .expect("cluster");
        let report = on_loopback(&c, loopback).await;
        print(measuring, &report);
        // The same cluster, its masters now announced behind the proxies.
        let report = with_2ms_per_master(&c, delayed).await;
        print(measuring, &report);
    });
}

fn print(measuring: bool, report: &[String]) {
    if measuring {
        for line in report {
            println!("{line}");
        }
    }
}

/// Eight `route` values whose buckets are in eight distinct slots, spread
/// round-robin over the three shards.
fn eight_values_on_three_masters(shards: &[Shard], prefix: &str) -> Vec<String> {
    let mut values = Vec::new();
    let mut used = Vec::new();
    for i in 0..8 {
        let v = value_in(
            &shards[i % 3],
            prefix,
            "c",
            "route",
            &format!("v{i}_"),
            &used,
        );
        used.push(key_slot(&bucket(prefix, "c", "route", &v)));
        values.push(v);
    }
    values
}

/// Sequential requests with the first 1 and the first 8 of `values` as
/// descriptors; every answer must be OK. One report line per shape.
async fn measure(l: &Limiter, values: &[String], rounds: Rounds, setup: &str) -> Vec<String> {
    let mut report = Vec::new();
    for n in [1usize, 8] {
        let request = req(
            "c",
            values[..n]
                .iter()
                .map(|v| desc(&[("route", v.as_str())]))
                .collect(),
            0,
        );
        for _ in 0..rounds.warm {
            let _ = l.should_rate_limit(&request).await;
        }
        let mut lat = Vec::with_capacity(rounds.measured);
        for _ in 0..rounds.measured {
            let t = Instant::now();
            let r = l
                .should_rate_limit(&request)
                .await
                .unwrap_or_else(|s| panic!("unexpected gRPC error {s:?}"));
            lat.push(t.elapsed());
            assert_eq!(r.overall_code, Code::Ok as i32, "{r:?}");
        }
        lat.sort();
        let p = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)];
        report.push(format!(
            "cluster{setup}, {n} descriptor(s) on {n} slot(s): p50 {:?} p90 {:?} p99 {:?}",
            p(0.5),
            p(0.9),
            p(0.99)
        ));
    }
    report
}

/// Plain loopback: the cost of 8 parallel script calls and of merging them.
async fn on_loopback(c: &RedisCluster, rounds: Rounds) -> Vec<String> {
    let prefix = unique_prefix("latency");
    let values = eight_values_on_three_masters(&c.shards(), &prefix);
    let s = RedisClusterStorage::builder(c.seeds())
        .timeout(Duration::from_secs(1))
        .build()
        .expect("valid seeds");
    connected(&s).await;
    let l = limiter(ROUTE_YAML, Arc::new(s), &prefix);
    measure(&l, &values, rounds, "").await
}

/// Every master's replies 2 ms late (a delaying proxy announced as the
/// master's address): 8 slots cost about one round trip, not eight.
async fn with_2ms_per_master(c: &RedisCluster, rounds: Rounds) -> Vec<String> {
    let prefix = unique_prefix("latency2ms");
    let mut proxied = Vec::new();
    for s in &c.shards() {
        let p = delay_proxy(s.master, Arc::new(AtomicU64::new(2))).await;
        let _: () = c.node(s.master).query(
            redis::cmd("CONFIG")
                .arg("SET")
                .arg("cluster-announce-port")
                .arg(p),
        );
        proxied.push(p);
    }
    tokio::task::block_in_place(|| {
        eventually_blocking(
            Duration::from_secs(30),
            "every node announces the proxies",
            || {
                c.nodes.iter().all(|n| {
                    let masters: Vec<u16> =
                        c.shards_from(n.port).iter().map(|s| s.master).collect();
                    proxied.iter().all(|p| masters.contains(p))
                })
            },
        );
    });
    // Shards as seen through the proxies (same slot ranges).
    let values = eight_values_on_three_masters(&c.shards(), &prefix);
    // Seeds through the proxies only, so every call pays the latency.
    let s = RedisClusterStorage::builder(proxied.iter().map(|p| format!("127.0.0.1:{p}")))
        .timeout(Duration::from_secs(1))
        .build()
        .expect("seeds");
    connected(&s).await;
    let l = limiter(ROUTE_YAML, Arc::new(s), &prefix);
    measure(&l, &values, rounds, " +2 ms per master").await
}
