//! The Go reference service's surfaces (envoyproxy/ratelimit), in one place,
//! for deployments that run bucket-rls as a drop-in replacement:
//!
//! - [`env`](mod@env): started as `ratelimit` with no arguments, the Go service's
//!   environment variables become the flags of `serve`;
//! - [`metrics`]: `/metrics` under the Go service's metric names, and the
//!   router of its listener (`--go-metrics-addr`);
//! - [`health`]: health with the Go service's semantics (`--health-mode go`);
//! - [`rlconfig`]: the Go debug port (`--debug-addr`): its router and its
//!   plain-text `/rlconfig`.

pub mod env;
pub mod health;
pub mod metrics;
pub mod rlconfig;
