//! Helpers shared by the integration tests: one free-port helper
//! ([`free_port`]), one HTTP client ([`http`]), one way to wait
//! ([`eventually`]), metric reading ([`metrics`]), real Redis processes
//! ([`redis`], [`cluster`], [`sentinel`]), real service and Envoy processes
//! ([`procs`]), and the conformance cases every backend runs
//! ([`conformance`]).
#![allow(dead_code, unused_imports)]

pub mod cluster;
pub mod conformance;
pub mod eventually;
pub mod http;
pub mod metrics;
pub mod procs;
pub mod redis;
pub mod sentinel;
pub mod tls;

use bucket_rls::config::loader;
use bucket_rls::limiter::Limiter;
use bucket_rls::settings::ServiceSettings;
use bucket_rls::storage::Storage;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::UInt64Value;
use std::net::{Ipv4Addr, TcpListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A free TCP port on 127.0.0.1 (bound, read, released: another process could
/// take it in between, which is unlikely enough for tests).
pub fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

/// A key prefix no other test uses, so tests can share one Redis.
pub fn unique_prefix(name: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "t:{name}:{}:{}:",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// Compiles YAML files `(name, text)` into a config, panicking with every error.
pub fn config(files: &[(&str, &str)]) -> bucket_rls::config::Config {
    let texts: Vec<(String, Vec<u8>)> = files
        .iter()
        .map(|(n, t)| ((*n).to_owned(), t.as_bytes().to_vec()))
        .collect();
    loader::compile_texts(&texts).unwrap_or_else(|e| panic!("config does not load:\n{e}"))
}

/// A limiter over `storage` for one YAML file.
pub fn limiter(yaml: &str, storage: Arc<dyn Storage>, prefix: &str) -> Arc<Limiter> {
    let settings = ServiceSettings {
        key_prefix: prefix.to_owned(),
        ..ServiceSettings::default()
    };
    Arc::new(Limiter::new(
        config(&[("test.yaml", yaml)]),
        storage,
        settings,
    ))
}

/// One descriptor from `(key, value)` pairs.
pub fn desc(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        ..Default::default()
    }
}

/// A descriptor with its own `hits_addend`.
pub fn desc_hits(entries: &[(&str, &str)], hits: u64) -> RateLimitDescriptor {
    RateLimitDescriptor {
        hits_addend: Some(UInt64Value { value: hits }),
        ..desc(entries)
    }
}

/// A request.
pub fn req(
    domain: &str,
    descriptors: Vec<RateLimitDescriptor>,
    hits_addend: u32,
) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend,
    }
}
