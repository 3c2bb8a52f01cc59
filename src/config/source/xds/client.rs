//! The ADS state-of-the-world stream: connect, subscribe, apply each
//! response, ACK or NACK it, reconnect with jittered backoff.
//!
//! Rules (the Go service's client, go-control-plane's SotW client):
//! - A new stream starts with a request carrying an empty `version_info` and
//!   nonce, so the server sends its whole state.
//! - A response that compiles is swapped in, then ACKed with its own
//!   `version_info` and nonce. One that does not (any resource) is refused
//!   whole: the config in force stays and the NACK carries the last version
//!   ACKed on this stream, the response's nonce and an `error_detail`
//!   (`INVALID_ARGUMENT`, message naming the resource and the descriptor
//!   path).
//! - A server that resends content already refused (go-control-plane answers
//!   a NACK by sending the same snapshot again at once) gets its NACKs after
//!   a growing delay, and the failure is logged and counted once.
//! - Any stream error closes the connection; the next attempt waits
//!   [`super::Backoff::delay`]. The config in force keeps serving meanwhile.
//! - TLS files are read again for every connection attempt.

use super::resources::{RATE_LIMIT_CONFIG_TYPE_URL, compile_resources};
use super::{MAX_ERROR_DETAIL_BYTES, XdsSettings, shown};
use crate::config::compile::LoadOptions;
use crate::config::{ConfigErrors, ConfigHandle, OnSwap, Origin, Outcome, PushStatus};
use crate::metrics::{XDS_CONNECTED, XDS_RESPONSES};
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use std::time::SystemTime;
use tokio::sync::{mpsc, watch};

/// gRPC `INVALID_ARGUMENT`, the code of a NACK's `error_detail`.
const INVALID_ARGUMENT: i32 = 3;

/// A running xDS source. Dropping it stops the stream (the config in force
/// stays).
#[derive(Debug)]
pub struct XdsClient {
    task: tokio::task::JoinHandle<()>,
    first: watch::Receiver<bool>,
    /// Serve only once the first config is in force.
    wait: bool,
}

impl XdsClient {
    /// Resolves once a first config has been swapped in (at once if one
    /// was).
    pub async fn first_config(&self) {
        let mut rx = self.first.clone();
        let _ = rx.wait_for(|got| *got).await;
    }
}

impl Drop for XdsClient {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The xDS client as a config source: no reload on demand (there is nothing
/// on disk to re-read), and the service waits for the first push unless
/// [`XdsSettings::start_without_config`].
impl From<XdsClient> for crate::config::source::SourceHandle {
    fn from(client: XdsClient) -> Self {
        let (first, wait) = (client.first.clone(), client.wait);
        Self::new(Box::new(client), first, wait, None)
    }
}

/// Starts the xDS source: pushes are compiled with `load`, handed to
/// [`ConfigHandle::apply`] on `handle` (which runs `on_swap` after each
/// swap). Must be called inside a Tokio runtime. Connection problems are
/// logged and retried forever.
#[must_use]
pub fn spawn(
    settings: XdsSettings,
    handle: Arc<ConfigHandle>,
    on_swap: OnSwap,
    load: LoadOptions,
) -> XdsClient {
    let wait = !settings.start_without_config;
    tracing::info!(server = %settings.server, node = %settings.node_id, tls = settings.tls.is_some(), wait_for_config = wait, "config from xDS");
    let (first_tx, first) = watch::channel(!handle.is_awaiting_first_config());
    handle.update_source_status(|s| {
        s.kind = "xds";
        s.location = shown(&settings.server);
        s.connected = Some(false);
    });
    crate::metrics::register_xds_series();
    let node = node(&settings);
    let source = Source {
        settings,
        node,
        handle,
        on_swap,
        load,
        refused: None,
        first: first_tx,
    };
    XdsClient {
        task: tokio::spawn(source.run()),
        first,
        wait,
    }
}

fn node(settings: &XdsSettings) -> Node {
    Node {
        id: settings.node_id.clone(),
        metadata: (!settings.node_metadata.is_empty()).then(|| Struct {
            fields: settings
                .node_metadata
                .iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        Value {
                            kind: Some(Kind::StringValue(v.clone())),
                        },
                    )
                })
                .collect(),
        }),
        user_agent_name: "bucket-rls".into(),
        ..Node::default()
    }
}

/// The content last refused, and how often it came again.
#[derive(Debug)]
struct Refused {
    fingerprint: [u8; 32],
    message: String,
    repeats: u32,
}

struct Source {
    settings: XdsSettings,
    node: Node,
    handle: Arc<ConfigHandle>,
    on_swap: OnSwap,
    load: LoadOptions,
    refused: Option<Refused>,
    first: watch::Sender<bool>,
}

/// How a stream ended.
struct Ended {
    /// At least one response arrived (the backoff starts over).
    got_response: bool,
    why: String,
}

/// A number in `[0, 1)` for jitter, from the standard library's randomly
/// keyed hasher (no crate needed for this).
fn random() -> f64 {
    use std::hash::BuildHasher as _;
    let h = std::collections::hash_map::RandomState::new().hash_one(std::time::Instant::now());
    #[allow(clippy::cast_precision_loss)]
    let r = (h >> 11) as f64 / (1u64 << 53) as f64;
    r
}

impl Source {
    async fn run(mut self) {
        let mut attempt = 0u32;
        loop {
            let ended = self.session().await;
            self.handle
                .update_source_status(|s| s.connected = Some(false));
            metrics::gauge!(XDS_CONNECTED).set(0.0);
            if ended.got_response {
                attempt = 0;
            }
            let wait = self.settings.backoff.delay(attempt, random());
            attempt = attempt.saturating_add(1);
            tracing::warn!(
                server = %self.settings.server,
                error = %ended.why,
                retry_in_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                kept = %self.handle.current().hash,
                "xDS stream closed; the config in force keeps serving"
            );
            tokio::time::sleep(wait).await;
        }
    }

    fn request(&self, version: &str, nonce: &str, error: Option<String>) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: version.to_owned(),
            node: Some(self.node.clone()),
            resource_names: Vec::new(),
            type_url: RATE_LIMIT_CONFIG_TYPE_URL.to_owned(),
            response_nonce: nonce.to_owned(),
            error_detail: error.map(|message| RpcStatus {
                code: INVALID_ARGUMENT,
                message,
                details: Vec::new(),
            }),
            ..DiscoveryRequest::default()
        }
    }

    async fn connect(&self) -> Result<tonic::transport::Channel, String> {
        let (host, port) = self.settings.host_port()?;
        let authority = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{authority}"))
            .map_err(|e| format!("xDS server address {authority}: {e}"))?
            .connect_timeout(self.settings.connect_timeout)
            .tcp_nodelay(true)
            // Finds a server that vanished without closing the connection.
            // Not more often: grpc-go servers (Envoy Gateway's) answer pings
            // closer than 5 minutes apart with GOAWAY `too_many_pings`.
            .http2_keep_alive_interval(std::time::Duration::from_secs(300))
            .keep_alive_timeout(std::time::Duration::from_secs(20));
        match &self.settings.tls {
            None => endpoint
                .connect()
                .await
                .map_err(|e| format!("cannot connect to {authority}: {}", error_chain(&e))),
            Some(tls) => {
                let client = super::tls::client_config(tls, &host)?;
                let connector = tower::service_fn(move |_: tonic::codegen::http::Uri| {
                    let (client, host) = (client.clone(), host.clone());
                    async move {
                        super::tls::connect(&client, &host, port)
                            .await
                            .map(hyper_util::rt::TokioIo::new)
                    }
                });
                endpoint
                    .connect_with_connector(connector)
                    .await
                    .map_err(|e| {
                        format!(
                            "cannot connect to {authority} over TLS: {}",
                            error_chain(&e)
                        )
                    })
            }
        }
    }

    async fn session(&mut self) -> Ended {
        let fail = |why: String| Ended {
            got_response: false,
            why,
        };
        let channel = match self.connect().await {
            Ok(c) => c,
            Err(e) => return fail(e),
        };
        let max = self.settings.max_message_bytes;
        let mut client = AggregatedDiscoveryServiceClient::new(channel)
            .max_decoding_message_size(max)
            .max_encoding_message_size(usize::MAX);
        let (tx, rx) = mpsc::channel::<DiscoveryRequest>(4);
        // A new stream always starts from nothing: the server sends its whole
        // state, whatever version it counts from.
        let _ = tx.send(self.request("", "", None)).await;
        let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        for (k, v) in &self.settings.headers {
            if let (Ok(k), Ok(v)) = (
                tonic::metadata::MetadataKey::from_bytes(k.as_bytes()),
                tonic::metadata::MetadataValue::try_from(v.as_str()),
            ) {
                req.metadata_mut().insert(k, v);
            }
        }
        let mut stream = match client.stream_aggregated_resources(req).await {
            Ok(r) => r.into_inner(),
            Err(s) => return fail(format!("stream refused: {}", status_text(&s))),
        };
        tracing::info!(server = %self.settings.server, node = %self.settings.node_id, "xDS stream open");
        self.handle
            .update_source_status(|s| s.connected = Some(true));
        metrics::gauge!(XDS_CONNECTED).set(1.0);
        let mut acked = String::new();
        let mut got_response = false;
        loop {
            let resp = match stream.message().await {
                Ok(Some(r)) => r,
                Ok(None) => {
                    return Ended {
                        got_response,
                        why: "the server ended the stream".into(),
                    };
                }
                Err(s) => {
                    return Ended {
                        got_response,
                        why: status_text(&s),
                    };
                }
            };
            got_response = true;
            let (version, nonce) = (resp.version_info.clone(), resp.nonce.clone());
            let request = match self.handle_response(resp).await {
                Ok(()) => {
                    acked.clone_from(&version);
                    self.request(&version, &nonce, None)
                }
                Err(message) => self.request(&acked, &nonce, Some(message)),
            };
            if tx.send(request).await.is_err() {
                return Ended {
                    got_response,
                    why: "the request stream closed".into(),
                };
            }
        }
    }

    /// Applies one response. `Ok` = ACK; `Err(message)` = NACK with it.
    async fn handle_response(&mut self, mut resp: DiscoveryResponse) -> Result<(), String> {
        let at = SystemTime::now();
        let fingerprint = fingerprint(&resp);
        if let Some(r) = self.refused.as_mut()
            && r.fingerprint == fingerprint
        {
            // The same content again (a server that resends after a NACK):
            // answer it, later each time, without reporting it again.
            let wait = self.settings.backoff.delay(r.repeats, random());
            r.repeats = r.repeats.saturating_add(1);
            tracing::debug!(version = %shown(&resp.version_info), repeats = r.repeats, wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX), "xDS: the refused config was sent again; NACKing it after a delay");
            let message = r.message.clone();
            tokio::time::sleep(wait).await;
            metrics::counter!(XDS_RESPONSES, "result" => "nack").increment(1);
            self.note_push(&resp, at, Some(message.clone()));
            return Err(message);
        }
        let compiled = if resp.type_url == RATE_LIMIT_CONFIG_TYPE_URL {
            let (resources, load) = (std::mem::take(&mut resp.resources), self.load);
            tokio::task::spawn_blocking(move || compile_resources(&resources, load))
                .await
                .map_err(|e| format!("compiling the pushed config panicked: {e}"))
                .and_then(|r| r.map_err(|e| error_detail(&e)))
        } else {
            Err(format!(
                "response type URL '{}' is not {RATE_LIMIT_CONFIG_TYPE_URL}",
                shown(&resp.type_url)
            ))
        };
        let version = shown(&resp.version_info);
        let refusal = compiled.as_ref().err().cloned();
        let outcome = self
            .handle
            .apply(compiled, Origin::Xds { version: &version }, &self.on_swap);
        match (outcome, refusal) {
            (Outcome::Applied(_) | Outcome::Unchanged, _) => {
                self.refused = None;
                self.handle
                    .update_source_status(|s| s.version = Some(version.clone()));
                metrics::counter!(XDS_RESPONSES, "result" => "ack").increment(1);
                self.note_push(&resp, at, None);
                self.first.send_replace(true);
                Ok(())
            }
            (Outcome::Failed | Outcome::FailedAgain, refusal) => {
                metrics::counter!(XDS_RESPONSES, "result" => "nack").increment(1);
                let message = refusal.unwrap_or_default();
                self.refused = Some(Refused {
                    fingerprint,
                    message: message.clone(),
                    repeats: 0,
                });
                self.note_push(&resp, at, Some(message.clone()));
                Err(message)
            }
        }
    }

    fn note_push(&self, resp: &DiscoveryResponse, at: SystemTime, error: Option<String>) {
        self.handle.update_source_status(|s| {
            s.last_push = Some(PushStatus {
                at,
                version: shown(&resp.version_info),
                nonce: shown(&resp.nonce),
                accepted: error.is_none(),
                error,
            });
        });
    }
}

/// SHA-256 over the response's type URL and resources: equal for a resent
/// set whatever its version and nonce.
fn fingerprint(resp: &DiscoveryResponse) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(resp.type_url.as_bytes());
    for r in &resp.resources {
        h.update((r.type_url.len() as u64).to_be_bytes());
        h.update(r.type_url.as_bytes());
        h.update((r.value.len() as u64).to_be_bytes());
        h.update(&r.value);
    }
    h.finalize().into()
}

/// The problems of a refused set as one message, at most
/// [`MAX_ERROR_DETAIL_BYTES`] long (then ending with how many were left out).
#[must_use]
pub fn error_detail(errors: &ConfigErrors) -> String {
    let mut out = String::new();
    for (i, e) in errors.0.iter().enumerate() {
        let line = e.to_string();
        if out.len() + line.len() + 1 > MAX_ERROR_DETAIL_BYTES {
            out.push_str(&format!("\n... and {} more problems", errors.0.len() - i));
            break;
        }
        if i > 0 {
            out.push('\n');
        }
        out.push_str(&line);
    }
    out
}

fn status_text(s: &tonic::Status) -> String {
    format!("{:?}: {}", s.code(), shown(s.message()))
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::source::xds::resources::pack;
    use envoy_types::pb::ratelimit::config::ratelimit::v3::{
        RateLimitConfig, RateLimitDescriptor, RateLimitPolicy,
    };
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn response(version: &str, nonce: &str, key: &str) -> DiscoveryResponse {
        let config = RateLimitConfig {
            name: "d".into(),
            domain: "d".into(),
            descriptors: vec![RateLimitDescriptor {
                key: key.into(),
                rate_limit: Some(RateLimitPolicy {
                    unit: 1,
                    requests_per_unit: 5,
                    ..Default::default()
                }),
                ..Default::default()
            }],
        };
        DiscoveryResponse {
            version_info: version.into(),
            resources: vec![pack(&config)],
            type_url: RATE_LIMIT_CONFIG_TYPE_URL.into(),
            nonce: nonce.into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_refused_set_sent_again_is_nacked_again_but_reported_once() {
        let swaps = Arc::new(AtomicUsize::new(0));
        let handle = Arc::new(ConfigHandle::awaiting_first_config());
        let mut settings = XdsSettings::new("127.0.0.1:1");
        settings.backoff.initial = std::time::Duration::from_millis(1);
        settings.backoff.max = std::time::Duration::from_millis(2);
        let counted = swaps.clone();
        let (first, _) = watch::channel(false);
        let mut source = Source {
            node: node(&settings),
            settings,
            handle: handle.clone(),
            on_swap: Arc::new(move |_, _| {
                counted.fetch_add(1, Ordering::SeqCst);
            }),
            load: LoadOptions::default(),
            refused: None,
            first,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        let mut results = Vec::new();
        let logs = crate::test_log::logged(tracing::Level::INFO, || {
            rt.block_on(async {
                results.push(source.handle_response(response("1", "a", "k")).await);
                // Equal to the config in force: ACKed, not swapped again.
                results.push(source.handle_response(response("1", "b", "k")).await);
                results.push(source.handle_response(response("2", "c", "")).await);
                results.push(source.handle_response(response("2", "d", "")).await);
                results.push(source.handle_response(response("2", "e", "")).await);
            });
        });
        assert!(results[0].is_ok() && results[1].is_ok(), "{results:?}");
        assert_eq!(swaps.load(Ordering::SeqCst), 1);
        let nacks: Vec<&String> = results[2..]
            .iter()
            .map(|r| r.as_ref().unwrap_err())
            .collect();
        assert!(
            nacks
                .iter()
                .all(|m| m.as_str() == "d: descriptors[0](key=\"\"): descriptor without 'key'"),
            "{nacks:?}"
        );
        assert_eq!(logs.matches("xDS config refused").count(), 1, "{logs}");
        assert!(!handle.is_awaiting_first_config());
        let status = handle.source_status();
        assert_eq!(status.version.as_deref(), Some("1"));
        let last = status.last_push.expect("last push");
        assert_eq!(
            (last.version.as_str(), last.nonce.as_str(), last.accepted),
            ("2", "e", false)
        );
        // New content after the refusals: applied.
        let ok = rt.block_on(source.handle_response(response("3", "f", "k2")));
        assert!(ok.is_ok());
        assert_eq!(swaps.load(Ordering::SeqCst), 2);
        assert!(handle.last_error().is_none());
    }

    #[test]
    fn error_detail_is_bounded_and_says_what_was_left_out() {
        let errors = ConfigErrors(
            (0..2000)
                .map(|i| crate::config::ConfigError {
                    file: format!("resource-{i}"),
                    line: None,
                    path: "descriptors[0]".into(),
                    message: "descriptor without 'key'".into(),
                })
                .collect(),
        );
        let d = error_detail(&errors);
        assert!(d.len() <= MAX_ERROR_DETAIL_BYTES + 64, "{}", d.len());
        assert!(d.starts_with("resource-0: descriptors[0]: descriptor without 'key'\n"));
        assert!(d.ends_with("more problems"), "{d}");
    }
}
