//! Unique client values (docs/cases.md, "Unique client values"), bounded:
//! 200,000 unique client values (half of them with a
//! per-request `limit` override) leave the number of exported metric series
//! unchanged, the memory backend holds a bounded number of buckets while they
//! arrive and none once they are full again.
//! `CARDINALITY_VALUES=1000000 cargo test --release --test cardinality` runs the
//! full million of the case.
//!
//! Its own test binary: the series count covers the whole process.

mod common;

use bucket_rls::grpc::ShouldRateLimit as _;
use bucket_rls::storage::Storage;
use bucket_rls::storage::clock::ManualClock;
use bucket_rls::storage::memory::MemoryStorage;
use common::metrics::scrape;
use common::{desc, limiter, req};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use std::sync::Arc;
use std::time::Duration;

/// Unique values sent: `CARDINALITY_VALUES`, default 200,000.
fn unique() -> usize {
    std::env::var("CARDINALITY_VALUES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000)
}

fn series(text: &str) -> usize {
    text.lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .count()
}

/// Resident set size in bytes (Linux).
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[tokio::test]
async fn unique_values_grow_neither_series_nor_buckets() {
    bucket_rls::metrics::install();
    let clock = ManualClock::new(1_000_000);
    let memory = Arc::new(MemoryStorage::new(Arc::new(clock.clone())));
    let l = limiter(
        "domain: br31\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: minute, requests_per_unit: 10}\n",
        memory.clone() as Arc<dyn Storage>,
        "br31:",
    );
    // 1,000,000 calls over 5 minutes is one call per 300 us: the clock moves
    // that much per call, so buckets fill up again (one token at 10/min takes
    // 6 s) and are dropped while new values arrive, as in the real run.
    let call = |i: usize| {
        let l = l.clone();
        let clock = clock.clone();
        async move {
            clock.advance(Duration::from_micros(300));
            let value = format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255);
            let mut d = desc(&[("remote_address", &value)]);
            if i % 2 == 1 {
                d.limit = Some(RateLimitOverride {
                    requests_per_unit: 20,
                    unit: RateLimitUnit::Minute as i32,
                });
            }
            l.should_rate_limit(&req("br31", vec![d], 1)).await.unwrap();
        }
    };
    // Warm-up: every series that will ever exist exists now.
    for i in 0..1_000 {
        call(i).await;
    }
    let before = series(&scrape());
    let rss_before = rss_bytes();
    let unique = unique();
    for i in 1_000..unique {
        call(i).await;
    }
    let text = scrape();
    assert_eq!(
        series(&text),
        before,
        "metric series grew with unique values"
    );
    assert!(
        !text.contains("10.1."),
        "a client value leaked into a label"
    );
    // Live buckets: those of the last 6 s (20,000 values), plus what the
    // amortised sweep has not dropped yet; bounded whatever the value count.
    let held = memory.len();
    assert!(held <= 100_000, "{held} buckets held after {unique} values");
    let grown = rss_bytes().saturating_sub(rss_before);
    eprintln!(
        "unique client values: {unique} unique values, {before} series before and after, {held} buckets held, RSS +{} KiB",
        grown >> 10
    );
    assert!(grown <= 64 << 20, "RSS grew by {} MiB", grown >> 20);

    // A minute later every bucket is full again and nothing is held.
    clock.advance(Duration::from_secs(61));
    assert_eq!(memory.sweep(), 0);
    assert!(memory.is_empty());
}
