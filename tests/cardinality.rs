//! BR-31, bounded: 200,000 unique client values (half of them with a
//! per-request `limit` override) leave the number of exported metric series
//! unchanged, and the memory backend holds no bucket once they are full again.
//! (The million-value run with RSS sampling is `loadgen`'s job.)
//!
//! Its own test binary: the series count covers the whole process.

mod admin_support;
mod common;

use admin_support::scrape;
use bucket_rls::limiter::Storage;
use bucket_rls::limiter::clock::ManualClock;
use bucket_rls::limiter::memory::MemoryStorage;
use common::{desc, limiter, req};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use std::sync::Arc;
use std::time::Duration;

const UNIQUE: usize = 200_000;

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
async fn br31_unique_values_grow_neither_series_nor_buckets() {
    bucket_rls::metrics::install();
    let clock = ManualClock::new(1_000_000);
    let memory = Arc::new(MemoryStorage::new(Arc::new(clock.clone())));
    let l = limiter(
        "domain: br31\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: minute, requests_per_unit: 10}\n",
        memory.clone() as Arc<dyn Storage>,
        "br31:",
    );
    let call = |i: usize| {
        let l = l.clone();
        async move {
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
    for i in 1_000..UNIQUE {
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
    assert_eq!(memory.len(), UNIQUE, "one bucket per value while not full");

    // Ten tokens per minute: every bucket is full again after 6 s (one token
    // taken); after a minute nothing is held.
    clock.advance(Duration::from_secs(61));
    assert_eq!(memory.sweep(), 0);
    assert!(memory.is_empty());
    let grown = rss_bytes().saturating_sub(rss_before);
    assert!(grown <= 64 << 20, "RSS grew by {} MiB", grown >> 20);
}
