//! Command line: `serve`, `check-config`, `xds-server`, `loadgen`, one
//! module per subcommand. Each entry point returns what happened; only `main` turns it
//! into an exit code.
//!
//! - [`serve_args`]: the flags of `serve` ([`ServeArgs`]; every one also
//!   reads an environment variable `BUCKET_RLS_<FLAG>`) and their conversion
//!   into [`Settings`](crate::settings::Settings), which refuses flags that
//!   contradict each other ([`SetupError`](crate::settings::SetupError)).
//! - [`serve`]: `serve` itself: settings, tracing export, the app built, the
//!   ports bound, served until SIGTERM.
//! - [`check`]: `check-config` and `check-config --xds-resources`.
//! - [`diff`]: `check-config --diff`, with the fetch of a replica's
//!   `/rlconfig`.
//! - [`xds_server`]: `xds-server`, a small xDS management server that serves
//!   a file of `RateLimitConfig` resources (for trying `--config-xds` on one
//!   machine, and the xDS tests' server).
//!
//! `loadgen` lives in its own module (`crate::loadgen`, cargo feature
//! `loadgen`).

pub mod check;
pub mod diff;
pub mod serve;
pub mod serve_args;
pub mod xds_server;

pub use check::CheckArgs;
pub use serve_args::{LogFormat, ServeArgs};

use clap::{Parser, Subcommand};

/// bucket-rls: Envoy rate limit service with exact token buckets.
#[derive(Debug, Parser)]
#[command(name = "bucket-rls", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve ShouldRateLimit over gRPC and the admin API over HTTP.
    Serve(Box<ServeArgs>),
    /// Load config files or directories with the service's loader and print
    /// every problem; exit 0 only when all are valid.
    CheckConfig(CheckArgs),
    /// Serve the RateLimitConfig resources of a YAML dump over xDS (ADS,
    /// state of the world), pushing them again when the file changes, and
    /// print every ACK and NACK: a stand-in for Envoy Gateway's control
    /// plane on one machine (plaintext; loopback only unless
    /// `--allow-remote`).
    XdsServer(xds_server::XdsServerArgs),
    /// Load a rate limit service over gRPC and report throughput and latency
    /// (loopback targets only unless `--allow-remote`).
    #[cfg(feature = "loadgen")]
    Loadgen(Box<crate::loadgen::LoadgenArgs>),
}
