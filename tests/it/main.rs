//! The small in-process suites, in one test binary: each test binary links
//! the whole crate and its dependencies again, so suites that need no process
//! of their own (no process-wide metric values asserted, no environment
//! changes) share this one. Run one suite with
//! `cargo test --test it config_errors::`.

#[path = "../common/mod.rs"]
mod common;

mod config_diff;
mod config_errors;
mod conn_limit;
mod grpc_edge;
mod observability;
mod otlp_tracing;
mod rate_limit_headers;
