//! bucket-rls: an implementation of Envoy's external rate limit service
//! (`envoy.service.ratelimit.v3.RateLimitService`) with exact token buckets.
//!
//! Crate map:

/// Serving: bind outside, serve inside, drain on shutdown.
pub mod app;
/// Command line (`serve`, `check-config`).
pub mod cli;
/// YAML config: schema, loader and validation.
pub mod config;
/// HTTP admin API.
pub mod http;
/// Token buckets and the storage seam (memory, Redis).
pub mod limiter;
/// `bucket-rls loadgen`: gRPC load generator with latency histograms.
pub mod loadgen;
/// Compiled descriptor tree and matching.
pub mod matcher;
/// Metric names.
pub mod metrics;
/// The gRPC service: descriptors in, statuses out.
pub mod service;
/// Process settings used by the request path.
pub mod settings;
