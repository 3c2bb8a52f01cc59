//! bucket-rls: an implementation of Envoy's external rate limit service
//! (`envoy.service.ratelimit.v3.RateLimitService`) with exact token buckets.
//!
//! Crate map (every module; each module's own docs say more). The request
//! path runs edge → core → storage; no module below the edges names a
//! protobuf or tonic type. docs/architecture.md has the layout and recipes
//! for adding a protocol, a config source, a storage backend or an
//! algorithm.
//!
//! - Edges
//!   - [`grpc`]: the gRPC port: `ShouldRateLimit` on `h2` directly with the
//!     one codec of Envoy's messages, health and reflection through tonic.
//!   - [`http`]: the admin API (health, metrics, the `/rlconfig` view) and `/json`.
//!   - [`cli`]: command line, one module per subcommand (`serve`,
//!     `check-config`, `--diff`); the flags of `serve` into settings.
//!   - [`go`]: the Go reference service's surfaces: its environment
//!     variables, metric names, health semantics and debug `/rlconfig`.
//! - Core
//!   - [`limiter`]: the decision core: request and decision types, plan,
//!     verdict, RateLimit headers, storage failure policy.
//!   - [`matcher`]: compiled descriptor tree and matching.
//!   - [`config`]: the config: schema, compilation, files, the
//!     [`config::ConfigHandle`] in force (the one way a config is applied)
//!     and the sources that keep it current (file watcher, xDS).
//! - Storage
//!   - [`storage`]: the storage seam, the algorithms (the token bucket
//!     model), memory and Redis (single node, Sentinel, Cluster) backends.
//! - Process
//!   - [`app`]: serving: the storage and limiter built from settings, bind
//!     outside, serve inside (ports, background tasks), drain on shutdown;
//!     process signals.
//!   - [`settings`]: process settings (request path, storage backend, config
//!     source) and setup errors.
//!   - [`conn_limit`]: connection caps for the listening ports and the
//!     process-wide budget of buffered request bytes.
//!   - [`metrics`]: every metric name, the recorder, the zero series and the
//!     native exposition.
//!   - `otel` (private): OTLP tracing, the server span of a call and the
//!     client span of a Redis script call.
//!   - `tls` (private): PEM loading for every TLS side and the gRPC port's
//!     reloading server certificate.
//!   - `loadgen`: `bucket-rls loadgen`: gRPC load generator with latency
//!     histograms (cargo feature `loadgen`, on by default).
//!   - `test_log` (tests only): captures the log lines a unit test's code
//!     emits.

pub mod app;
pub mod cli;
pub mod config;
pub mod conn_limit;
pub mod go;
pub mod grpc;
pub mod http;
pub mod limiter;
#[cfg(feature = "loadgen")]
pub mod loadgen;
pub mod matcher;
pub mod metrics;
mod otel;
pub mod settings;
pub mod storage;
#[cfg(test)]
mod test_log;
mod tls;
