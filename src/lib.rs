//! bucket-rls: an implementation of Envoy's external rate limit service
//! (`envoy.service.ratelimit.v3.RateLimitService`) with exact token buckets.
//!
//! Crate map (one line per module; each module's own docs say more):
//!
//! - [`app`]: Serving: bind outside, serve inside, drain on shutdown; the
//!   storage backend built from settings; process signals.
//! - [`cli`]: Command line (`serve`, `check-config`, `loadgen`); flags into settings.
//! - [`conn_limit`]: Connection caps for the two listening ports.
//! - [`config`]: YAML config: schema, loader and validation.
//! - [`http`]: HTTP admin API.
//! - [`storage`]: Token buckets and the storage seam (memory, Redis).
//! - `loadgen`: `bucket-rls loadgen`: gRPC load generator with latency histograms
//!   (cargo feature `loadgen`, on by default).
//! - [`matcher`]: Compiled descriptor tree and matching.
//! - [`metrics`]: Metric names.
//! - [`service`]: The gRPC service: descriptors in, statuses out.
//! - [`settings`]: Process settings (request path, storage backend) and setup errors.

pub mod app;
pub mod cli;
pub mod config;
pub mod conn_limit;
pub mod http;
pub mod storage;
#[cfg(feature = "loadgen")]
pub mod loadgen;
pub mod matcher;
pub mod metrics;
pub mod service;
pub mod settings;
