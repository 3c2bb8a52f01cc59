//! Config matching ([`matcher::find`]) and bucket key encoding ([`key::encode`]).
//!
//! Trees are built with `Level::insert` (what the loader's compile step does),
//! not parsed from YAML, so that `cargo test --all-targets`, which runs each
//! benchmark once, stays fast even with 100,000 rules. Run with
//! `cargo bench --bench matching`.

use bucket_rls::matcher::{self, Level, Pattern, Selector};
use bucket_rls::storage::key::{self, KeyValue};
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use std::hint::black_box;

/// Rule counts measured.
const SIZES: [usize; 2] = [10, 100_000];
/// Largest number of wildcard siblings measured.
const MAX_WILDCARDS: usize = 1_000;

/// `n` exact rules `path=/v<i>`.
fn exact_tree(n: usize) -> Level {
    let mut root = Level::default();
    for i in 0..n {
        root.insert("path", Selector::Exact(format!("/v{i}"))).rule = Some(i);
    }
    root
}

/// `n - 10` exact rules plus 10 wildcard rules `/w<j>/*` under the same key:
/// the common shape, a few wildcards among many exact values.
fn wildcard_tree(n: usize) -> Level {
    let mut root = Level::default();
    for i in 0..n - 10 {
        root.insert("path", Selector::Exact(format!("/v{i}"))).rule = Some(i);
    }
    for j in 0..10 {
        root.insert(
            "path",
            Selector::Wildcard(Pattern::new(&format!("/w{j}/*"))),
        )
        .rule = Some(n - 10 + j);
    }
    root
}

/// `n` wildcard rules under one key: the worst case, since wildcards are tried
/// in config order (linear in their number). Measured with at most
/// [`MAX_WILDCARDS`] rules: building the tree is quadratic in the number of
/// wildcard siblings (`Level::insert` looks for a duplicate pattern).
fn all_wildcards_tree(n: usize) -> Level {
    let mut root = Level::default();
    for j in 0..n {
        root.insert(
            "path",
            Selector::Wildcard(Pattern::new(&format!("/w{j}/*"))),
        )
        .rule = Some(j);
    }
    root
}

/// `n` tenants, each `tenant=t<i>` -> `method` (key only) -> `path=/api/*`,
/// with one rule at each leaf.
fn nested_tree(n: usize) -> Level {
    let mut root = Level::default();
    for i in 0..n {
        let tenant = root.insert("tenant", Selector::Exact(format!("t{i}")));
        let method = tenant.children.insert("method", Selector::KeyOnly);
        method
            .children
            .insert("path", Selector::Wildcard(Pattern::new("/api/*")))
            .rule = Some(i);
    }
    root
}

fn bench_matching(c: &mut Criterion) {
    let mut g = c.benchmark_group("match");
    for n in SIZES {
        let tree = exact_tree(n);
        let value = format!("/v{}", n / 2);
        g.bench_with_input(BenchmarkId::new("exact", n), &n, |b, _| {
            b.iter(|| matcher::find(black_box(&tree), black_box(&[("path", value.as_str())])));
        });
        let tree = wildcard_tree(n);
        g.bench_with_input(BenchmarkId::new("wildcard", n), &n, |b, _| {
            b.iter(|| matcher::find(black_box(&tree), black_box(&[("path", "/w9/books/1")])));
        });
        let w = n.min(MAX_WILDCARDS);
        let tree = all_wildcards_tree(w);
        let value = format!("/w{}/x", w - 1);
        g.bench_with_input(BenchmarkId::new("wildcard_last_of_all", w), &w, |b, _| {
            b.iter(|| matcher::find(black_box(&tree), black_box(&[("path", value.as_str())])));
        });
        let tree = nested_tree(n);
        let tenant = format!("t{}", n / 2);
        g.bench_with_input(BenchmarkId::new("nested_3", n), &n, |b, _| {
            b.iter(|| {
                matcher::find(
                    black_box(&tree),
                    black_box(&[
                        ("tenant", tenant.as_str()),
                        ("method", "GET"),
                        ("path", "/api/users/42"),
                    ]),
                )
            });
        });
        let tree = exact_tree(n);
        g.bench_with_input(BenchmarkId::new("no_match", n), &n, |b, _| {
            b.iter(|| matcher::find(black_box(&tree), black_box(&[("path", "/nope")])));
        });
    }
    g.finish();
}

fn bench_key(c: &mut Criterion) {
    let mut g = c.benchmark_group("key_encode");
    g.bench_function("1_entry", |b| {
        b.iter(|| {
            key::encode(
                black_box("rls:"),
                black_box("edge"),
                black_box(&[("remote_address", KeyValue::Value("10.1.2.3"))]),
            )
        });
    });
    g.bench_function("3_entries", |b| {
        b.iter(|| {
            key::encode(
                black_box("rls:"),
                black_box("edge"),
                black_box(&[
                    ("tenant", KeyValue::Value("acme")),
                    ("method", KeyValue::Value("GET")),
                    ("path", KeyValue::Shared("/api/*")),
                ]),
            )
        });
    });
    g.bench_function("escaped_value", |b| {
        b.iter(|| {
            key::encode(
                black_box("rls:"),
                black_box("edge"),
                black_box(&[("path", KeyValue::Value("/a/{id}/100%"))]),
            )
        });
    });
    let long = "t".repeat(200);
    g.bench_function("hashed_200_byte_value", |b| {
        b.iter(|| {
            key::encode(
                black_box("rls:"),
                black_box("edge"),
                black_box(&[("api_key", KeyValue::Value(&long))]),
            )
        });
    });
    g.finish();
}

criterion_group!(benches, bench_matching, bench_key);
criterion_main!(benches);
