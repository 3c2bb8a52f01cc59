//! xDS config source: an Aggregated Discovery Service (ADS) state-of-the-world
//! client that receives `RateLimitConfig` resources from a control plane
//! (Envoy Gateway, or any go-control-plane server) and swaps them in as the
//! config in force, like the file watcher does for files.
//!
//! - [`resources`]: `RateLimitConfig` resources -> the same [`crate::config::Config`]
//!   the file loader builds (same validation), and YAML dumps of them for
//!   `check-config`.
//! - [`client`]: the stream, ACK/NACK, reconnects with jittered backoff.
//! - [`tls`]: the client side of the mTLS connection.
//!
//! Protocol (the Go service's `xds_grpc_sotw_provider` and go-control-plane's
//! SotW client): one stream of
//! `envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources`,
//! wildcard subscription (no resource names) to
//! [`resources::RATE_LIMIT_CONFIG_TYPE_URL`], the node (id, metadata) in every
//! request. Every response is the whole config: it is applied and ACKed
//! (`version_info` and `response_nonce` of the response) or refused whole and
//! NACKed (`version_info` = the last version ACKed on this stream, the
//! response's nonce, and an `error_detail` naming the resource and the
//! descriptor path). A new stream starts with an empty version and nonce, so
//! the server always sends its full state (a stale version could otherwise
//! match a restarted server's counter and get no answer). See docs/xds.md.

pub mod client;
pub mod resources;
pub mod tls;

pub use client::{XdsClient, spawn};

use std::path::PathBuf;
use std::time::Duration;

/// Default largest response accepted, in bytes (gRPC's usual 4 MiB, the Go
/// service's default when `XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES` is unset).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 << 20;

/// Default node id (the Go service's `CONFIG_GRPC_XDS_NODE_ID` default;
/// Envoy Gateway sets `envoy-ratelimit`).
pub const DEFAULT_NODE_ID: &str = "default";

/// Most bytes of an `error_detail` message in a NACK; longer reports are cut
/// and say how many problems were left out.
pub const MAX_ERROR_DETAIL_BYTES: usize = 16 * 1024;

/// Longest control-plane string (version, nonce) shown in `/rlconfig`, logs
/// and metric labels, in bytes (requests still echo it whole).
pub const MAX_SHOWN_BYTES: usize = 128;

/// Everything the xDS source needs. Built from `serve --config-xds` flags
/// ([`crate::cli`]; the Go service's variables map onto those flags in
/// [`crate::go::env`]).
/// `Debug` shows the header names only (their values may be credentials).
#[derive(Clone, PartialEq)]
pub struct XdsSettings {
    /// The management server, `host:port` (a gRPC target as the Go service
    /// takes it), optionally with `http://` or `https://`.
    pub server: String,
    /// `Node.id` (the control plane picks the snapshot by it).
    pub node_id: String,
    /// `Node.metadata`: string values, in order given.
    pub node_metadata: Vec<(String, String)>,
    /// Extra gRPC metadata sent on the stream (lower-case ASCII names).
    pub headers: Vec<(String, String)>,
    /// TLS to the server; `None` is plaintext HTTP/2.
    pub tls: Option<XdsTls>,
    /// Waits between connection attempts.
    pub backoff: Backoff,
    /// Largest `DiscoveryResponse` accepted, in bytes.
    pub max_message_bytes: usize,
    /// How long one connection attempt (TCP and TLS) may take.
    pub connect_timeout: Duration,
    /// Whether the service starts serving before the first config arrives
    /// (the Go service's `FORCE_START_WITHOUT_INITIAL_CONFIG`). Until then
    /// ShouldRateLimit answers an error (gRPC `UNKNOWN`, "no rate limit
    /// configuration loaded"), so Envoy's failure mode decides. `false`:
    /// `serve` binds its ports only once the first config is in force.
    pub start_without_config: bool,
}

impl std::fmt::Debug for XdsSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let headers: Vec<(&str, &str)> = self
            .headers
            .iter()
            .map(|(k, _)| (k.as_str(), "***"))
            .collect();
        f.debug_struct("XdsSettings")
            .field("server", &self.server)
            .field("node_id", &self.node_id)
            .field("node_metadata", &self.node_metadata)
            .field("headers", &headers)
            .field("tls", &self.tls)
            .field("backoff", &self.backoff)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("connect_timeout", &self.connect_timeout)
            .field("start_without_config", &self.start_without_config)
            .finish()
    }
}

impl XdsSettings {
    /// Settings for `server` with every other field at its default.
    #[must_use]
    pub fn new(server: impl Into<String>) -> Self {
        Self {
            server: server.into(),
            node_id: DEFAULT_NODE_ID.into(),
            node_metadata: Vec::new(),
            headers: Vec::new(),
            tls: None,
            backoff: Backoff::default(),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            connect_timeout: Duration::from_secs(5),
            start_without_config: true,
        }
    }

    /// `(host, port)` of [`Self::server`].
    ///
    /// # Errors
    /// A message when the server is not `host:port`, or carries credentials
    /// (`user:password@`).
    pub fn host_port(&self) -> Result<(String, u16), String> {
        // Credentials in the address would reach `/rlconfig` and the logs
        // (and this very message): refused without echoing the address.
        if self.server.contains('@') {
            return Err(
                "xDS server address carries credentials (user:password@host): they would be printed in /rlconfig and the logs; give host:port and pass credentials with --config-xds-headers (for example authorization:Bearer ...) or client TLS"
                    .into(),
            );
        }
        let s = self.server.trim();
        let s = s
            .strip_prefix("https://")
            .or_else(|| s.strip_prefix("http://"))
            .unwrap_or(s)
            .trim_end_matches('/');
        let bad = || {
            format!(
                "xDS server '{}' is not host:port (e.g. envoy-gateway:18001)",
                self.server
            )
        };
        let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || host.contains('/') {
            return Err(bad());
        }
        let port = port.parse::<u16>().map_err(|_| bad())?;
        Ok((host.to_owned(), port))
    }

    /// Checks what can be checked before connecting: the address, header
    /// names and values, a TLS key given with its certificate.
    ///
    /// # Errors
    /// A message naming the bad setting.
    pub fn check(&self) -> Result<(), String> {
        self.host_port()?;
        if self.node_id.is_empty() {
            return Err("xDS node id must not be empty".into());
        }
        for (k, v) in &self.headers {
            if tonic::metadata::MetadataKey::<tonic::metadata::Ascii>::from_bytes(k.as_bytes())
                .is_err()
                || k.ends_with("-bin")
            {
                return Err(format!(
                    "xDS header name '{k}' is not a valid gRPC metadata name"
                ));
            }
            if tonic::metadata::MetadataValue::<tonic::metadata::Ascii>::try_from(v.as_str())
                .is_err()
            {
                return Err(format!("xDS header '{k}': value is not printable ASCII"));
            }
        }
        if let Some(t) = &self.tls
            && t.client_cert.is_some() != t.client_key.is_some()
        {
            return Err("xDS client TLS needs both a certificate and its key (or neither)".into());
        }
        if self.max_message_bytes == 0 {
            return Err("xDS max message size must be at least 1 byte".into());
        }
        self.backoff.check()
    }
}

/// TLS to the management server.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XdsTls {
    /// Client certificate chain (PEM), presented for mTLS; re-read on every
    /// connection attempt, so a rotated certificate is used after reconnect.
    pub client_cert: Option<PathBuf>,
    /// Its private key (PEM: PKCS#1, PKCS#8 or SEC1).
    pub client_key: Option<PathBuf>,
    /// CA certificates (PEM) trusted besides the built-in web roots.
    pub ca_cert: Option<PathBuf>,
    /// Name the server certificate must hold (default: the host of
    /// [`XdsSettings::server`]); the Go service's `CONFIG_GRPC_XDS_SERVER_TLS_SAN`.
    pub server_name: Option<String>,
}

/// Waits between connection attempts: `initial`, doubling per failed attempt
/// up to `max`, each multiplied by a random factor in `[1 - jitter, 1 + jitter]`
/// (still at most `max`). Reset after a stream that received a response.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Backoff {
    /// First wait.
    pub initial: Duration,
    /// Longest wait.
    pub max: Duration,
    /// Jitter fraction from 0 to 1 (0 = no jitter).
    pub jitter: f64,
}

impl Default for Backoff {
    /// 1 s doubling to 30 s, 50 % jitter.
    fn default() -> Self {
        Self {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(30),
            jitter: 0.5,
        }
    }
}

impl Backoff {
    /// Checks the bounds.
    ///
    /// # Errors
    /// A zero initial wait, `max < initial`, or jitter outside 0..=1.
    pub fn check(&self) -> Result<(), String> {
        if self.initial.is_zero() {
            return Err("xDS backoff: the initial interval must be above 0".into());
        }
        if self.max < self.initial {
            return Err("xDS backoff: the max interval must be at least the initial one".into());
        }
        if !(0.0..=1.0).contains(&self.jitter) {
            return Err("xDS backoff: jitter must be between 0 and 1".into());
        }
        Ok(())
    }

    /// The wait before attempt `attempt` (0-based) with `random` in `[0, 1)`.
    #[must_use]
    pub fn delay(&self, attempt: u32, random: f64) -> Duration {
        let base = self
            .initial
            .saturating_mul(1u32 << attempt.min(20))
            .min(self.max);
        let factor = 1.0 + self.jitter * (2.0 * random.clamp(0.0, 1.0) - 1.0);
        base.mul_f64(factor.max(0.0)).min(self.max)
    }
}

/// `k1<sep>v1,k2<sep>v2` as pairs; entries without `sep` or with an empty key
/// are dropped (as the Go service's parsing does).
#[must_use]
pub fn pairs(s: &str, sep: char) -> Vec<(String, String)> {
    s.split(',')
        .filter_map(|e| e.split_once(sep))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .filter(|(k, _)| !k.is_empty())
        .collect()
}

/// `s` cut to [`MAX_SHOWN_BYTES`] on a character boundary (with `...`).
#[must_use]
pub fn shown(s: &str) -> String {
    cut(s, MAX_SHOWN_BYTES)
}

/// `s` cut to at most `max` bytes on a character boundary, with `...` added
/// when it was cut.
#[must_use]
pub fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn backoff_doubles_up_to_the_max_within_the_jitter() {
        let b = Backoff {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(10),
            jitter: 0.5,
        };
        assert_eq!(b.delay(0, 0.5), Duration::from_secs(1));
        assert_eq!(b.delay(2, 0.5), Duration::from_secs(4));
        assert_eq!(b.delay(30, 0.5), Duration::from_secs(10));
        assert_eq!(b.delay(0, 0.0), Duration::from_millis(500));
        assert!(b.delay(0, 0.999) < Duration::from_millis(1500));
        assert_eq!(b.delay(9, 0.999), Duration::from_secs(10));
    }

    #[test]
    fn debug_hides_header_values() {
        let mut s = XdsSettings::new("h:1");
        s.headers = vec![("authorization".into(), "Bearer s3cret".into())];
        let d = format!("{s:?}");
        assert!(d.contains("authorization") && !d.contains("s3cret"), "{d}");
    }

    #[test]
    fn server_addresses_accept_a_scheme_and_ipv6() {
        let mut s = XdsSettings::new("https://[::1]:18001/");
        assert_eq!(s.host_port().unwrap(), ("::1".into(), 18001));
        s.server = "http://127.0.0.1:1".into();
        assert_eq!(s.host_port().unwrap(), ("127.0.0.1".into(), 1));
        s.headers = vec![("bad header".into(), "v".into())];
        assert!(s.check().is_err());
    }

    #[test]
    fn credentials_in_the_server_address_are_refused_without_being_echoed() {
        for server in [
            "https://eg:s3cret@envoy-gateway:18001",
            "eg:s3cret@envoy-gateway:18001",
        ] {
            let e = XdsSettings::new(server).check().expect_err(server);
            assert!(e.contains("credentials") && !e.contains("s3cret"), "{e}");
        }
    }
}
