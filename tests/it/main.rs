//! The small in-process suites, in one test binary: each test binary links
//! the whole crate and its dependencies again, so suites that need no process
//! of their own (no process-wide metric values asserted, no environment
//! changes) share this one. Run one suite with
//! `cargo test --test it config_errors::`.

#[path = "../common/mod.rs"]
mod common;

mod admin_json;
mod config_diff;
mod config_errors;
mod config_errors_text;
mod conn_limit;
mod go_service;
mod grpc_edge;
mod grpc_limits;
mod health;
mod local_cache;
mod observability;
mod otlp_tracing;
mod overrides;
mod rate_limit_headers;
mod reflection;
mod reload_stability;
mod xds;
