//! `bucket-rls xds-server`: a small xDS management server that serves the
//! `RateLimitConfig` resources of one YAML dump file (the shape
//! `check-config --xds-resources` reads) and pushes them again whenever the
//! file changes. It is for trying the xDS config source (`serve
//! --config-xds`, Envoy Gateway's `CONFIG_TYPE=GRPC_XDS_SOTW`) on one
//! machine, without Kubernetes, and the test suite's xDS tests run against
//! it ([`Ads`]); it is not a control plane for production (plaintext, no
//! authentication, loopback only unless `--allow-remote`).
//!
//! It answers as go-control-plane's snapshot cache (the server Envoy Gateway
//! runs) does for one snapshot: a request whose `version_info` differs from
//! the snapshot's is answered at once with the whole set (so after a NACK the
//! same set comes again), a request on the snapshot's version waits for the
//! next snapshot, and every new snapshot goes to every open stream. With
//! `--node-id` only that node is answered, as Envoy Gateway answers only
//! `envoy-ratelimit`. The file's resources are pushed as they are, valid or
//! not: the client's ACK or NACK is the check, and each one is printed.

use crate::config::source::xds::cut;
use crate::config::source::xds::resources::{RATE_LIMIT_CONFIG_TYPE_URL, pack, parse_dump};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use parking_lot::Mutex;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

/// How often the resource file is read, and how long it must stay
/// unchanged before it is pushed (a file caught mid-write is not pushed).
pub const POLL: Duration = Duration::from_millis(200);

/// Largest resource file read, in bytes (the cap of a config file).
pub const MAX_FILE_BYTES: u64 = 64 * 1024 * 1024;

/// Longest client-chosen text (node id, version, NACK message) printed, in
/// bytes; longer text is cut with `...`.
const MAX_PRINTED_BYTES: usize = 16 * 1024;

/// Flags of `xds-server`.
#[derive(Debug, Clone, clap::Args)]
pub struct XdsServerArgs {
    /// YAML dump of `RateLimitConfig` resources (documents separated by
    /// `---`, the shape `check-config --xds-resources` reads). Read every
    /// 200 ms; a change that stays 200 ms is pushed as the next version. A
    /// missing file serves nothing until it appears. Replace it by renaming
    /// a temporary file into place.
    #[arg(long, value_name = "FILE")]
    pub resources: PathBuf,
    /// Address to listen on, `HOST:PORT`. Must be loopback (127.0.0.0/8 or
    /// ::1) unless `--allow-remote` is given.
    #[arg(long, default_value = "127.0.0.1:18000")]
    pub listen: SocketAddr,
    /// Allow a listen address that is not loopback (the server has no
    /// authentication and no TLS).
    #[arg(long)]
    pub allow_remote: bool,
    /// Answer only this `Node.id` (Envoy Gateway answers only
    /// `envoy-ratelimit`); other nodes' requests are printed, never
    /// answered. Default: every node.
    #[arg(long)]
    pub node_id: Option<String>,
}

/// What the server serves: a version and its resources.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// `version_info` of the responses; empty: nothing to serve yet.
    pub version: String,
    /// The resources, each a packed `RateLimitConfig` (or anything else a
    /// test wants to push).
    pub resources: Vec<Any>,
}

/// What the server has seen.
#[derive(Debug, Default)]
pub struct Seen {
    /// Every request not yet taken ([`Ads::take_requests`]), in arrival
    /// order.
    pub requests: Mutex<Vec<DiscoveryRequest>>,
    /// Streams opened.
    pub streams: AtomicUsize,
}

/// The aggregated discovery service (state of the world only) over a
/// [`Snapshot`]; clones share the snapshot and what was seen.
#[derive(Clone, Debug)]
pub struct Ads {
    snapshot: watch::Sender<Snapshot>,
    seen: Arc<Seen>,
    /// Set when the server stops: every open stream ends with `UNAVAILABLE`.
    stopped: watch::Sender<bool>,
    node_id: Option<String>,
}

type Responses =
    Pin<Box<dyn futures::Stream<Item = Result<DiscoveryResponse, tonic::Status>> + Send>>;
type DeltaResponses =
    Pin<Box<dyn futures::Stream<Item = Result<DeltaDiscoveryResponse, tonic::Status>> + Send>>;

impl Ads {
    /// A server of `snapshot` that answers every node, or only `node_id`.
    #[must_use]
    pub fn new(snapshot: Snapshot, node_id: Option<String>) -> Self {
        Self {
            snapshot: watch::Sender::new(snapshot),
            seen: Arc::new(Seen::default()),
            stopped: watch::Sender::new(false),
            node_id,
        }
    }

    /// Serves `snapshot` from now on: pushed at once to every open stream
    /// whose client runs another version.
    pub fn set(&self, snapshot: Snapshot) {
        self.snapshot.send_replace(snapshot);
    }

    /// What the server has seen.
    #[must_use]
    pub fn seen(&self) -> &Seen {
        &self.seen
    }

    /// The requests received since the last call (the list is emptied).
    #[must_use]
    pub fn take_requests(&self) -> Vec<DiscoveryRequest> {
        std::mem::take(&mut *self.seen.requests.lock())
    }

    /// Ends every open stream with `UNAVAILABLE` (as a stopping server
    /// does); streams opened later end at once.
    pub fn stop(&self) {
        self.stopped.send_replace(true);
    }

    /// The tonic service, with no limit on the size of a response (a test
    /// pushes more than gRPC's default 4 MiB).
    #[must_use]
    pub fn service(&self) -> AggregatedDiscoveryServiceServer<Self> {
        AggregatedDiscoveryServiceServer::new(self.clone()).max_encoding_message_size(usize::MAX)
    }

    fn answers(&self, r: &DiscoveryRequest) -> bool {
        self.node_id
            .as_deref()
            .is_none_or(|id| r.node.as_ref().is_some_and(|n| n.id == id))
    }
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = Responses;
    type DeltaAggregatedResourcesStream = DeltaResponses;

    async fn stream_aggregated_resources(
        &self,
        request: tonic::Request<tonic::Streaming<DiscoveryRequest>>,
    ) -> Result<tonic::Response<Responses>, tonic::Status> {
        self.seen.streams.fetch_add(1, Ordering::SeqCst);
        let mut inbound = request.into_inner();
        let mut snap = self.snapshot.subscribe();
        let mut stopped = self.stopped.subscribe();
        let ads = self.clone();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            let mut nonce = 0u64;
            // The version the client last reported; None before its first
            // request (and for a node this server does not answer).
            let mut client_version: Option<String> = None;
            loop {
                let send = tokio::select! {
                    _ = async { let _ = stopped.wait_for(|s| *s).await; } => {
                        let _ = tx.send(Err(tonic::Status::unavailable("server stopping"))).await;
                        return;
                    }
                    r = inbound.message() => match r {
                        Ok(Some(r)) => {
                            let answered = ads.answers(&r);
                            if answered {
                                client_version = Some(r.version_info.clone());
                            }
                            ads.seen.requests.lock().push(r);
                            answered
                        }
                        _ => return,
                    },
                    c = snap.changed() => {
                        if c.is_err() {
                            return;
                        }
                        client_version.is_some()
                    }
                };
                let s = snap.borrow_and_update().clone();
                // No snapshot yet, or the client runs this version: no
                // answer (go-control-plane opens a watch instead).
                if !send || s.version.is_empty() || client_version.as_deref() == Some(&s.version) {
                    continue;
                }
                nonce += 1;
                let resp = DiscoveryResponse {
                    version_info: s.version,
                    resources: s.resources,
                    type_url: RATE_LIMIT_CONFIG_TYPE_URL.into(),
                    nonce: nonce.to_string(),
                    ..Default::default()
                };
                if tx.send(Ok(resp)).await.is_err() {
                    return;
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn delta_aggregated_resources(
        &self,
        _: tonic::Request<tonic::Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<tonic::Response<DeltaResponses>, tonic::Status> {
        Err(tonic::Status::unimplemented(
            "state of the world only (StreamAggregatedResources)",
        ))
    }
}

/// Why `xds-server` stopped.
#[derive(Debug, thiserror::Error)]
pub enum XdsServerError {
    /// The listen address is not loopback and `--allow-remote` was not given.
    #[error(
        "refusing to listen on {0}: not a loopback address (127.0.0.0/8 or ::1); this server has no authentication; pass --allow-remote to listen there anyway"
    )]
    NotLoopback(SocketAddr),
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The listen address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The async runtime or the signal handler could not be set up.
    #[error("cannot start: {0}")]
    Runtime(std::io::Error),
}

/// Runs `xds-server` until SIGINT or SIGTERM, printing what it serves and
/// every request (ACK, NACK with its message, a node it does not answer) to
/// standard output.
///
/// # Errors
/// A listen address refused or not bound; no runtime or signal handler.
pub fn run(args: &XdsServerArgs) -> Result<(), XdsServerError> {
    if !args.allow_remote && !args.listen.ip().to_canonical().is_loopback() {
        return Err(XdsServerError::NotLoopback(args.listen));
    }
    let listen_err = |source| XdsServerError::Listen {
        addr: args.listen,
        source,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(XdsServerError::Runtime)?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .map_err(listen_err)?;
        let ads = Ads::new(Snapshot::default(), args.node_id.clone());
        let router = tonic::transport::Server::builder().add_service(ads.service());
        tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let _ = router.serve_with_incoming(incoming).await;
        });
        say(&format!(
            "listening on {} (ADS, state of the world, {RATE_LIMIT_CONFIG_TYPE_URL}); resources from {}; {}",
            args.listen,
            args.resources.display(),
            match &args.node_id {
                Some(id) => format!("answering node '{}' only", cut(id, MAX_PRINTED_BYTES)),
                None => "answering every node".to_owned(),
            }
        ));
        let mut file = FileState::default();
        let mut tick = tokio::time::interval(POLL);
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(XdsServerError::Runtime)?;
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => break,
                _ = term.recv() => break,
                _ = tick.tick() => {
                    if let Some(snapshot) = file.poll(&args.resources) {
                        ads.set(snapshot);
                    }
                    for r in ads.take_requests() {
                        say(&describe(&r, ads.answers(&r), &ads.snapshot.borrow().version));
                    }
                }
            }
        }
        // Open streams end with UNAVAILABLE, as a stopping control plane's do.
        ads.stop();
        tokio::time::sleep(Duration::from_millis(100)).await;
        say("stopped");
        Ok(())
    })
}

/// One line to standard output (a closed output is ignored: the server
/// keeps serving).
fn say(line: &str) {
    let _ = writeln!(std::io::stdout(), "xds-server: {line}");
}

/// One request in words: a subscription, an ACK, a NACK with its message, or
/// a node this server does not answer.
fn describe(r: &DiscoveryRequest, answered: bool, serving: &str) -> String {
    let node = r.node.as_ref().map_or("", |n| n.id.as_str());
    let node = cut(node, MAX_PRINTED_BYTES);
    let version = cut(&r.version_info, MAX_PRINTED_BYTES);
    if !answered {
        return format!(
            "node '{node}': not answered (this server answers one node only, as Envoy Gateway answers only 'envoy-ratelimit')"
        );
    }
    if let Some(e) = &r.error_detail {
        // A NACK carries the last version ACKed on its stream.
        let last = if version.is_empty() {
            "no ACK on this stream yet".to_owned()
        } else {
            format!("its last ACK: version {version}")
        };
        let message = cut(&e.message, MAX_PRINTED_BYTES).replace('\n', "\n    ");
        return format!("node '{node}': NACK of version {serving} ({last}):\n    {message}");
    }
    if r.response_nonce.is_empty() {
        let since = if version.is_empty() {
            "asks for the whole set".to_owned()
        } else {
            format!("resumes at version {version}")
        };
        return format!("node '{node}': subscribed ({since})");
    }
    format!("node '{node}': ACK of version {version}")
}

/// The resource file as last read, and what was served from it.
#[derive(Default)]
struct FileState {
    /// The bytes read at the last poll (`None`: missing or unreadable).
    last_read: Option<Option<Vec<u8>>>,
    /// The bytes last acted on (served, or refused as unreadable).
    settled: Option<Option<Vec<u8>>>,
    /// Versions served so far.
    version: u64,
}

impl FileState {
    /// Reads `path`; when its content differs from the content last acted
    /// on and is the same as at the previous poll, acts on it: the next
    /// snapshot, or a printed reason why there is none.
    fn poll(&mut self, path: &Path) -> Option<Snapshot> {
        let now = read(path);
        let stable = self.last_read.as_ref() == Some(&now);
        self.last_read = Some(now.clone());
        if !stable || self.settled.as_ref() == Some(&now) {
            return None;
        }
        self.settled = Some(now.clone());
        let Some(bytes) = now else {
            say(&format!(
                "{} is missing or unreadable; serving {}",
                path.display(),
                self.serving()
            ));
            return None;
        };
        let name = path.display().to_string();
        let text = match std::str::from_utf8(&bytes) {
            Ok(t) => t,
            Err(e) => {
                say(&format!(
                    "{name} is not UTF-8 ({e}); serving {}",
                    self.serving()
                ));
                return None;
            }
        };
        match parse_dump(&name, text) {
            Ok(configs) => {
                self.version += 1;
                let domains: Vec<String> = configs
                    .iter()
                    .map(|c| cut(&c.domain, MAX_PRINTED_BYTES))
                    .collect();
                say(&format!(
                    "serving version {}: {} resource(s) from {name} (domains: {})",
                    self.version,
                    configs.len(),
                    domains.join(", ")
                ));
                Some(Snapshot {
                    version: self.version.to_string(),
                    resources: configs.iter().map(pack).collect(),
                })
            }
            Err(e) => {
                say(&format!(
                    "{name} is not a resource dump; serving {}:\n    {}",
                    self.serving(),
                    e.to_string().replace('\n', "\n    ")
                ));
                None
            }
        }
    }

    fn serving(&self) -> String {
        if self.version == 0 {
            "nothing yet".to_owned()
        } else {
            format!("version {} still", self.version)
        }
    }
}

/// The file's bytes, `None` when it is missing, unreadable or larger than
/// [`MAX_FILE_BYTES`].
fn read(path: &Path) -> Option<Vec<u8>> {
    use std::io::Read as _;
    let f = std::fs::File::open(path).ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let mut bytes = Vec::new();
    f.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes).ok()?;
    (bytes.len() as u64 <= MAX_FILE_BYTES).then_some(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::Node;
    use envoy_types::pb::google::rpc::Status;

    fn request(node: &str, version: &str, nonce: &str, error: Option<&str>) -> DiscoveryRequest {
        DiscoveryRequest {
            node: Some(Node {
                id: node.into(),
                ..Default::default()
            }),
            version_info: version.into(),
            response_nonce: nonce.into(),
            type_url: RATE_LIMIT_CONFIG_TYPE_URL.into(),
            error_detail: error.map(|m| Status {
                code: 3,
                message: m.into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn requests_are_described_as_subscriptions_acks_and_nacks_with_their_message() {
        assert_eq!(
            describe(&request("n", "", "", None), true, "1"),
            "node 'n': subscribed (asks for the whole set)"
        );
        assert_eq!(
            describe(&request("n", "2", "5", None), true, "2"),
            "node 'n': ACK of version 2"
        );
        assert_eq!(
            describe(
                &request("n", "2", "6", Some("r: a: bad\nr: b: worse")),
                true,
                "3"
            ),
            "node 'n': NACK of version 3 (its last ACK: version 2):\n    r: a: bad\n    r: b: worse"
        );
        assert!(
            describe(&request("default", "", "", None), false, "1")
                .starts_with("node 'default': not answered")
        );
        // Client text is bounded.
        let long = describe(&request(&"x".repeat(100_000), "", "", None), true, "1");
        assert!(long.len() < MAX_PRINTED_BYTES + 100, "{}", long.len());
    }

    #[test]
    fn only_the_configured_node_is_answered() {
        let ads = Ads::new(Snapshot::default(), Some("envoy-ratelimit".into()));
        assert!(ads.answers(&request("envoy-ratelimit", "", "", None)));
        assert!(!ads.answers(&request("default", "", "", None)));
        assert!(!ads.answers(&DiscoveryRequest::default()));
        let any = Ads::new(Snapshot::default(), None);
        assert!(any.answers(&DiscoveryRequest::default()));
    }

    #[test]
    fn a_changed_file_is_served_once_it_stays_the_same_for_one_poll() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("r.yaml");
        let mut f = FileState::default();
        assert!(f.poll(&path).is_none(), "missing");
        assert!(f.poll(&path).is_none(), "still missing: nothing to serve");
        std::fs::write(&path, "name: a\ndomain: a\ndescriptors: []\n").expect("write");
        assert!(f.poll(&path).is_none(), "changed since the last poll");
        let s = f.poll(&path).expect("stable: served");
        assert_eq!((s.version.as_str(), s.resources.len()), ("1", 1));
        assert!(f.poll(&path).is_none(), "unchanged: not served again");
        std::fs::write(&path, "descriptors: [").expect("write");
        assert!(f.poll(&path).is_none());
        assert!(f.poll(&path).is_none(), "not a dump: nothing new served");
        std::fs::write(
            &path,
            "name: a\ndomain: a\ndescriptors: []\n---\nname: b\ndomain: b\ndescriptors: []\n",
        )
        .expect("write");
        assert!(f.poll(&path).is_none());
        let s = f.poll(&path).expect("served");
        assert_eq!((s.version.as_str(), s.resources.len()), ("2", 2));
    }

    #[test]
    fn a_listen_address_off_loopback_is_refused_without_allow_remote() {
        let args = XdsServerArgs {
            resources: "r.yaml".into(),
            listen: "0.0.0.0:18000".parse().expect("addr"),
            allow_remote: false,
            node_id: None,
        };
        assert!(matches!(run(&args), Err(XdsServerError::NotLoopback(_))));
    }
}
