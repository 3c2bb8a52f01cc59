//! bucket-rls: an implementation of Envoy's external rate limit service
//! (`envoy.service.ratelimit.v3.RateLimitService`) with exact token buckets.
//!
//! Crate map (one line per module; each module's own docs say more). The
//! request path runs edge → core → storage; no module below the edges names
//! a protobuf or tonic type.
//!
//! - Edges
//!   - [`grpc`]: the tonic `RateLimitService`: protos to and from the core.
//!   - [`grpc_h2`]: the gRPC port on `h2` directly: `ShouldRateLimit` inside
//!     each connection's task, health and reflection through tonic.
//!   - [`http`]: the admin API (health, metrics, the `/rlconfig` view) and `/json`.
//!   - [`cli`]: command line (`serve`, `check-config`, `loadgen`); flags into settings.
//! - Core
//!   - [`limiter`]: the decision core: request and decision types, plan,
//!     verdict, RateLimit headers, storage failure policy.
//!   - [`matcher`]: compiled descriptor tree and matching.
//!   - [`config`]: YAML config: schema, compile, files, the
//!     [`config::ConfigHandle`] in force (and its one writer,
//!     `ConfigHandle::apply`), and the config sources side by side
//!     (`config::source`: the file watcher and xDS).
//! - Storage
//!   - [`storage`]: the storage seam, the token bucket model, memory and
//!     Redis (single node, Sentinel, Cluster) backends.
//! - Process
//!   - [`app`]: serving: the storage and limiter built from settings, bind
//!     outside, serve inside, drain on shutdown; process signals.
//!   - [`settings`]: process settings (request path, storage backend) and
//!     setup errors.
//!   - [`conn_limit`]: connection caps for the two listening ports.
//!   - [`metrics`]: metric names, the recorder, rendering.
//!   - `loadgen`: `bucket-rls loadgen`: gRPC load generator with latency
//!     histograms (cargo feature `loadgen`, on by default).

pub mod app;
pub mod cli;
pub mod config;
pub mod conn_limit;
pub mod go_compat;
pub mod go_env;
pub mod grpc;
pub mod grpc_h2;
pub mod health;
pub mod http;
pub mod limiter;
#[cfg(feature = "loadgen")]
pub mod loadgen;
pub mod matcher;
pub mod metrics;
pub mod otel;
pub mod reflection;
pub mod settings;
pub mod storage;
#[cfg(test)]
mod test_log;
pub mod tls;
