//! Helpers shared by the integration tests: one free-port helper
//! ([`free_port`]), one HTTP client ([`http`]), one way to wait
//! ([`eventually`]), metric reading ([`metrics`]), real Redis processes
//! ([`redis`], [`cluster`], [`sentinel`]), real service and Envoy processes
//! ([`procs`]), Envoy's quota filter and a scripted quota server ([`rlqs`]),
//! and the conformance cases every backend runs
//! ([`conformance`]).
#![allow(dead_code, unused_imports)]

pub mod cluster;
pub mod conformance;
pub mod eventually;
pub mod http;
pub mod metrics;
pub mod procs;
pub mod redis;
pub mod rlqs;
pub mod sentinel;
pub mod tls;

use bucket_rls::config::{compile, files};
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

/// Ports [`free_port`] hands out: below the kernel's ephemeral range
/// (32768–60999 on Linux), so an outgoing connection or a `bind(0)` listener
/// never takes one between the check and a child process binding it.
const PORT_RANGE: std::ops::Range<u16> = 20_000..32_000;

/// A TCP port on 127.0.0.1 that is free now and that no other call in this
/// process has returned: ports are walked from an offset derived from the
/// process id, so two tests of one binary never get the same port (before,
/// a `bind(0)` port could be handed out twice, and a test's `redis-server`
/// failed to bind while its `PING` reached another test's server).
pub fn free_port() -> u16 {
    free_ports(1)
}

/// `n` consecutive TCP ports on 127.0.0.1, each free now and none returned
/// by another call in this process (for a script that takes a base port).
pub fn free_ports(n: u16) -> u16 {
    static NEXT: std::sync::OnceLock<AtomicU64> = std::sync::OnceLock::new();
    let span = u64::from(PORT_RANGE.end - PORT_RANGE.start);
    let next = NEXT.get_or_init(|| AtomicU64::new(u64::from(std::process::id()) * 97 % span));
    for _ in 0..span {
        let offset = next.fetch_add(u64::from(n), Ordering::SeqCst) % span;
        let Ok(base) = u16::try_from(offset).map(|o| PORT_RANGE.start + o) else {
            continue;
        };
        if base.checked_add(n).is_some_and(|end| end <= PORT_RANGE.end)
            && (base..base + n).all(|p| TcpListener::bind((Ipv4Addr::LOCALHOST, p)).is_ok())
        {
            return base;
        }
    }
    panic!("no {n} free ports in {PORT_RANGE:?} on 127.0.0.1");
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
    compile::compile_texts(&texts).unwrap_or_else(|e| panic!("config does not load:\n{e}"))
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
