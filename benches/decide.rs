//! The memory backend ([`MemoryStorage::apply_sync`]) and a whole decision
//! ([`Limiter::should_rate_limit`] on the memory backend, metrics recorder
//! installed as in `serve`). Run with `cargo bench --bench decide`.
//!
//! "hot" is one key hit over and over with a limit it never reaches; "1M keys"
//! cycles over 1,000,000 distinct keys at 10 per minute (the shape of
//! docs/cases.md, "Unique client values": each bucket stays in memory for 6 s
//! after its hit).

use bucket_rls::config::compile;
use bucket_rls::grpc::ShouldRateLimit as _;
use bucket_rls::limiter::Limiter;
use bucket_rls::settings::ServiceSettings;
use bucket_rls::storage::memory::MemoryStorage;
use bucket_rls::storage::{BucketLimit, Charge, ChargeKind, ChargeSpec, Limit};
use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use std::hint::black_box;
use std::sync::Arc;

const MANY_KEYS: u64 = 1_000_000;

/// Never reached at benchmark speed: 4e9 tokens, refilling 1.1e6 per second.
const HUGE: Limit = Limit::TokenBucket(BucketLimit {
    requests_per_unit: 4_000_000_000,
    unit_secs: std::num::NonZeroU64::new(3600).unwrap(),
    burst: 4_000_000_000,
    max_debt: 0,
});
/// 10 per minute.
const SMALL: Limit = Limit::TokenBucket(BucketLimit {
    requests_per_unit: 10,
    unit_secs: std::num::NonZeroU64::new(60).unwrap(),
    burst: 10,
    max_debt: 0,
});

fn charge(key: String, limit: Limit) -> Charge {
    Charge {
        key,
        spec: ChargeSpec {
            limit,
            cost: 1,
            kind: ChargeKind::Consume,
            shadow: false,
        },
    }
}

/// `n` charges on distinct keys (descriptors `d0..d<n>`), the last entry
/// carrying `value`.
fn charges(n: usize, value: &str, limit: Limit) -> Vec<Charge> {
    (0..n)
        .map(|d| {
            charge(
                format!("rls:d4:edge|k2:d{d}=v{}:{value}", value.len()),
                limit,
            )
        })
        .collect()
}

fn bench_memory(c: &mut Criterion) {
    let mut g = c.benchmark_group("memory_apply");
    for n in [1, 5] {
        let m = MemoryStorage::default();
        let hot = charges(n, "hot", HUGE);
        g.bench_function(format!("{n}_desc_hot_key"), |b| {
            b.iter(|| black_box(m.apply_sync(black_box(&hot))));
        });
        let m = MemoryStorage::default();
        let mut i = 0u64;
        g.bench_function(format!("{n}_desc_1M_keys"), |b| {
            b.iter_batched(
                || {
                    i = (i + 1) % MANY_KEYS;
                    charges(n, &format!("10.{i}"), SMALL)
                },
                |cs| black_box(m.apply_sync(&cs)),
                BatchSize::SmallInput,
            );
        });
        let m = MemoryStorage::default();
        let over = charges(n, "flood", SMALL);
        g.bench_function(format!("{n}_desc_over_limit"), |b| {
            b.iter(|| black_box(m.apply_sync(black_box(&over))));
        });
    }
    g.finish();
}

const CONFIG: &str = "\
domain: edge
descriptors:
  - key: d0
    rate_limit: {unit: hour, requests_per_unit: 4000000000}
  - key: d1
    rate_limit: {unit: hour, requests_per_unit: 4000000000}
  - key: d2
    rate_limit: {unit: hour, requests_per_unit: 4000000000}
  - key: d3
    rate_limit: {unit: hour, requests_per_unit: 4000000000}
  - key: d4
    rate_limit: {unit: hour, requests_per_unit: 4000000000}
  - key: ip
    rate_limit: {unit: minute, requests_per_unit: 10}
";

fn request(keys: &[&str], value: &str) -> RateLimitRequest {
    RateLimitRequest {
        domain: "edge".into(),
        descriptors: keys
            .iter()
            .map(|k| RateLimitDescriptor {
                entries: vec![Entry {
                    key: (*k).into(),
                    value: value.into(),
                }],
                ..Default::default()
            })
            .collect(),
        hits_addend: 0,
    }
}

fn bench_limiter(c: &mut Criterion) {
    bucket_rls::metrics::install();
    let config = compile::compile_texts(&[("edge.yaml".into(), CONFIG.as_bytes().to_vec())])
        .unwrap_or_else(|e| panic!("bench config does not load:\n{e}"));
    let limiter = |_: ()| {
        Limiter::new(
            config.clone(),
            Arc::new(MemoryStorage::default()),
            ServiceSettings::default(),
        )
    };
    let mut g = c.benchmark_group("should_rate_limit");
    let l = limiter(());
    let one = request(&["d0"], "hot");
    g.bench_function("1_desc_hot_key", |b| {
        b.iter(|| futures::executor::block_on(l.should_rate_limit(black_box(&one))));
    });
    let l = limiter(());
    let five = request(&["d0", "d1", "d2", "d3", "d4"], "hot");
    g.bench_function("5_desc_hot_key", |b| {
        b.iter(|| futures::executor::block_on(l.should_rate_limit(black_box(&five))));
    });
    let l = limiter(());
    let mut i = 0u64;
    g.bench_function("1_desc_1M_keys", |b| {
        b.iter_batched(
            || {
                i = (i + 1) % MANY_KEYS;
                request(&["ip"], &format!("10.{i}"))
            },
            |r| futures::executor::block_on(l.should_rate_limit(&r)),
            BatchSize::SmallInput,
        );
    });
    let l = limiter(());
    let flood = request(&["ip"], "flood");
    g.bench_function("1_desc_over_limit", |b| {
        b.iter(|| futures::executor::block_on(l.should_rate_limit(black_box(&flood))));
    });
    g.finish();
}

criterion_group!(benches, bench_memory, bench_limiter);
criterion_main!(benches);
