//! The xDS config source against the management server of `bucket-rls
//! xds-server` ([`bucket_rls::cli::xds_server::Ads`], served in-process):
//! the behaviour of go-control-plane's snapshot cache (the server Envoy
//! Gateway runs): it answers a request whose `version_info` differs from its
//! snapshot's at once (so a NACK gets the same set again), and pushes each
//! new snapshot to every open stream. Plaintext and mTLS with certificates
//! shaped like Envoy Gateway's; the replicas are in-process limiters (memory
//! backend), and one test runs the binary behind a real Envoy.

use crate::common::eventually::eventually;
use bucket_rls::cli::xds_server::{Ads, Seen, Snapshot};
use bucket_rls::config::ConfigHandle;
use bucket_rls::config::compile::LoadOptions;
use bucket_rls::config::source::xds::resources::{RATE_LIMIT_CONFIG_TYPE_URL, pack};
use bucket_rls::config::source::xds::{Backoff, XdsClient, XdsSettings, XdsTls};
use bucket_rls::grpc::ShouldRateLimit as _;
use bucket_rls::limiter::Limiter;
use bucket_rls::settings::ServiceSettings;
use bucket_rls::storage::clock::SystemClock;
use bucket_rls::storage::memory::MemoryStorage;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use parking_lot::Mutex;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// Generous deadline of every wait (a loaded 2-core machine).
const DEADLINE: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------
// The management server: `bucket-rls xds-server`'s ADS service, served here
// in-process, plaintext or over TLS.

/// What the TLS listener saw.
#[derive(Default)]
struct TlsSeen {
    /// TLS handshakes that failed.
    handshake_failures: AtomicUsize,
    /// Common names of the client certificates presented, per connection.
    client_cns: Mutex<Vec<String>>,
}

/// A running management server; stops when dropped.
struct ControlPlane {
    ads: Ads,
    tls: Arc<TlsSeen>,
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.ads.stop();
        self.task.abort();
    }
}

impl ControlPlane {
    /// Plaintext on a free loopback port.
    async fn start() -> Self {
        Self::start_on(None, None, Snapshot::default()).await
    }

    /// On `port` (a free one when `None`), over TLS when `tls` is given,
    /// serving `snapshot`.
    async fn start_on(
        port: Option<u16>,
        tls: Option<Arc<rustls::ServerConfig>>,
        snapshot: Snapshot,
    ) -> Self {
        let port = port.unwrap_or_else(crate::common::free_port);
        // A stopped server's listener closes once its aborted task is
        // dropped, which the runtime does soon, not at once.
        let (listener, _) = eventually(DEADLINE, "the control plane port to bind", || async {
            tokio::net::TcpListener::bind(("127.0.0.1", port))
                .await
                .ok()
        })
        .await;
        let addr = listener.local_addr().expect("addr");
        let ads = Ads::new(snapshot, None);
        let tls_seen = Arc::new(TlsSeen::default());
        let router = tonic::transport::Server::builder().add_service(ads.service());
        let task = match tls {
            None => tokio::spawn(async move {
                let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
                let _ = router.serve_with_incoming(incoming).await;
            }),
            Some(config) => {
                let seen = tls_seen.clone();
                tokio::spawn(async move {
                    let (tx, rx) = mpsc::channel::<Result<TlsConn, std::io::Error>>(16);
                    let acceptor = tokio_rustls::TlsAcceptor::from(config);
                    let accept = async move {
                        loop {
                            let Ok((tcp, _)) = listener.accept().await else {
                                return;
                            };
                            let (acceptor, tx, seen) = (acceptor.clone(), tx.clone(), seen.clone());
                            tokio::spawn(async move {
                                match acceptor.accept(tcp).await {
                                    Ok(s) => {
                                        if let Some(cert) = s
                                            .get_ref()
                                            .1
                                            .peer_certificates()
                                            .and_then(|c| c.first())
                                        {
                                            seen.client_cns.lock().push(common_name(cert));
                                        }
                                        let _ = tx.send(Ok(TlsConn(s))).await;
                                    }
                                    Err(_) => {
                                        seen.handshake_failures.fetch_add(1, Ordering::SeqCst);
                                    }
                                }
                            });
                        }
                    };
                    tokio::join!(accept, async {
                        let _ = router.serve_with_incoming(ReceiverStream::new(rx)).await;
                    });
                })
            }
        };
        Self {
            ads,
            tls: tls_seen,
            addr,
            task,
        }
    }

    /// Serves `resources` as `version` from now on (pushed to open streams).
    fn set(&self, version: &str, resources: Vec<Any>) {
        self.ads.set(Snapshot {
            version: version.into(),
            resources,
        });
    }

    fn seen(&self) -> &Seen {
        self.ads.seen()
    }

    /// Requests received so far.
    fn requests(&self) -> Vec<DiscoveryRequest> {
        self.seen().requests.lock().clone()
    }

    /// Waits for a request that ACKs `version` (no error detail).
    async fn acked(&self, version: &str) -> DiscoveryRequest {
        eventually(
            DEADLINE,
            &format!("an ACK of version {version}"),
            || async {
                self.requests().into_iter().find(|r| {
                    r.version_info == version
                        && r.error_detail.is_none()
                        && !r.response_nonce.is_empty()
                })
            },
        )
        .await
        .0
    }

    /// Waits for a NACK (a request with an error detail); returns it.
    async fn nacked(&self) -> DiscoveryRequest {
        eventually(DEADLINE, "a NACK", || async {
            self.requests()
                .into_iter()
                .find(|r| r.error_detail.is_some())
        })
        .await
        .0
    }
}

/// The subject's common name of a DER certificate (the last CN in it: the
/// issuer's comes first; enough for rcgen's output).
fn common_name(cert: &[u8]) -> String {
    // OID 2.5.4.3 followed by a string type and length.
    let oid = [0x06, 0x03, 0x55, 0x04, 0x03];
    cert.windows(oid.len())
        .rposition(|w| w == oid)
        .and_then(|i| {
            let len = usize::from(*cert.get(i + oid.len() + 1)?);
            let start = i + oid.len() + 2;
            std::str::from_utf8(cert.get(start..start + len)?)
                .ok()
                .map(str::to_owned)
        })
        .unwrap_or_default()
}

/// A server-side TLS connection that tonic can serve.
struct TlsConn(tokio_rustls::server::TlsStream<tokio::net::TcpStream>);

impl tonic::transport::server::Connected for TlsConn {
    type ConnectInfo = ();
    fn connect_info(&self) {}
}

impl tokio::io::AsyncRead for TlsConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for TlsConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }
    fn poll_flush(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }
    fn poll_shutdown(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

// ---------------------------------------------------------------------------
// Certificates in Envoy Gateway's shape: a CA with CN `envoy-gateway`, the
// xDS server's leaf for the `envoy-gateway` service names, the rate limit
// service's leaf with CN `*` and SAN `*.<namespace>`; no ExtendedKeyUsage on
// the leaves. (Envoy Gateway's keys are RSA 2048; rcgen with ring makes
// ECDSA P-256 keys, which changes nothing in the checks made here.)

struct Pki {
    dir: tempfile::TempDir,
    ca: rcgen::Issuer<'static, rcgen::KeyPair>,
    ca_pem: String,
}

const NS: &str = "envoy-gateway-system";

impl Pki {
    fn new() -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "envoy-gateway");
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.self_signed(&key).expect("CA");
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("ca.crt"), cert.pem()).expect("write");
        Self {
            dir,
            ca: rcgen::Issuer::new(params, key),
            ca_pem: cert.pem(),
        }
    }

    /// A leaf with `cn` and `sans`, signed by the CA: (cert PEM, key PEM).
    fn leaf(&self, cn: &str, sans: &[String]) -> (String, String) {
        let mut params = rcgen::CertificateParams::new(sans.to_vec()).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.ca).expect("leaf");
        (cert.pem(), key.serialize_pem())
    }

    /// The xDS server's TLS config as Envoy Gateway runs it: TLS 1.3 only,
    /// a client certificate signed by the CA required, ALPN `h2`.
    fn server_config(&self) -> Arc<rustls::ServerConfig> {
        use rustls::pki_types::pem::PemObject as _;
        let sans: Vec<String> = [
            "envoy-gateway".to_owned(),
            format!("envoy-gateway.{NS}"),
            format!("envoy-gateway.{NS}.svc"),
            format!("envoy-gateway.{NS}.svc.cluster.local"),
        ]
        .into();
        let (cert, key) = self.leaf("envoy-gateway", &sans);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(
                rustls::pki_types::CertificateDer::from_pem_slice(self.ca_pem.as_bytes())
                    .expect("ca"),
            )
            .expect("add ca");
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .build()
        .expect("verifier");
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("TLS 1.3")
            .with_client_cert_verifier(verifier)
            .with_single_cert(
                vec![
                    rustls::pki_types::CertificateDer::from_pem_slice(cert.as_bytes())
                        .expect("cert"),
                ],
                rustls::pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes()).expect("key"),
            )
            .expect("server config");
        config.alpn_protocols = vec![b"h2".to_vec()];
        Arc::new(config)
    }

    /// Writes the rate limit service's client certificate (CN `cn`) to
    /// `tls.crt` / `tls.key` and returns the client's TLS settings.
    fn write_client(&self, cn: &str) -> XdsTls {
        let (cert, key) = self.leaf(cn, &[format!("*.{NS}")]);
        let d = self.dir.path();
        std::fs::write(d.join("tls.crt.tmp"), cert).expect("write");
        std::fs::write(d.join("tls.key.tmp"), key).expect("write");
        std::fs::rename(d.join("tls.crt.tmp"), d.join("tls.crt")).expect("rename");
        std::fs::rename(d.join("tls.key.tmp"), d.join("tls.key")).expect("rename");
        XdsTls {
            client_cert: Some(d.join("tls.crt")),
            client_key: Some(d.join("tls.key")),
            ca_cert: Some(d.join("ca.crt")),
            // Dialled as 127.0.0.1, verified as Envoy Gateway's service name.
            server_name: Some("envoy-gateway".into()),
        }
    }
}

// ---------------------------------------------------------------------------
// Replicas and configs.

/// A limiter fed by an xDS client.
struct Replica {
    limiter: Arc<Limiter>,
    _client: XdsClient,
}

/// Settings for `server` with fast reconnects.
fn settings(server: SocketAddr) -> XdsSettings {
    let mut s = XdsSettings::new(server.to_string());
    s.node_id = "envoy-ratelimit".into();
    s.backoff = Backoff {
        initial: Duration::from_millis(100),
        max: Duration::from_millis(500),
        jitter: 0.2,
    };
    s
}

fn replica(settings: XdsSettings) -> Replica {
    let handle = Arc::new(ConfigHandle::awaiting_first_config());
    let storage = Arc::new(MemoryStorage::with_max_buckets(
        Arc::new(SystemClock),
        100_000,
    ));
    let limiter = Arc::new(Limiter::with_handle(
        handle,
        storage,
        ServiceSettings::default(),
    ));
    let client = bucket_rls::config::source::xds::spawn(
        settings,
        limiter.config_handle().clone(),
        limiter.on_swap(),
        LoadOptions::default(),
    );
    Replica {
        limiter,
        _client: client,
    }
}

impl Replica {
    async fn ask(
        &self,
        domain: &str,
        entries: &[(&str, &str)],
    ) -> Result<RateLimitResponse, tonic::Status> {
        let req = RateLimitRequest {
            domain: domain.into(),
            descriptors: vec![crate::common::desc(entries)],
            hits_addend: 0,
        };
        self.limiter.should_rate_limit(&req).await
    }

    async fn code(&self, domain: &str, entries: &[(&str, &str)]) -> Code {
        let r = self.ask(domain, entries).await.expect("a decision");
        Code::try_from(r.overall_code).expect("code")
    }

    fn hash(&self) -> String {
        self.limiter.config().hash.clone()
    }

    /// Waits until the config in force has `domain`.
    async fn has_domain(&self, domain: &str) {
        eventually(DEADLINE, &format!("domain {domain} in force"), || async {
            self.limiter
                .config()
                .domains
                .contains_key(domain)
                .then_some(())
        })
        .await;
    }

    /// The body of an admin `GET path`.
    async fn admin(&self, path: &str) -> Vec<u8> {
        use tower::ServiceExt as _;
        let r = bucket_rls::http::router(self.limiter.clone())
            .oneshot(
                axum::http::Request::get(path)
                    .body(axum::body::Body::empty())
                    .expect("request"),
            )
            .await
            .expect("response");
        axum::body::to_bytes(r.into_body(), 1 << 24)
            .await
            .expect("body")
            .to_vec()
    }

    /// `/rlconfig` as JSON.
    async fn rlconfig(&self) -> serde_json::Value {
        serde_json::from_slice(&self.admin("/rlconfig").await).expect("JSON")
    }
}

fn desc(key: &str, value: &str) -> RateLimitDescriptor {
    RateLimitDescriptor {
        key: key.into(),
        value: value.into(),
        ..Default::default()
    }
}

fn policy(rpu: u32, unit: RateLimitUnit) -> Option<RateLimitPolicy> {
    Some(RateLimitPolicy {
        unit: unit as i32,
        requests_per_unit: rpu,
        ..Default::default()
    })
}

const ROUTE: &str = "httproute/default/backend/rule/0/match/0/www_example_com";

/// Envoy Gateway's listener domain for one route with a header rule
/// (key-only `rule-0-match-0`, one bucket per header value) of `rpu` per
/// hour, and a CIDR rule (`masked_remote_address`) of 3 per week.
fn eg_listener(rpu: u32) -> RateLimitConfig {
    let mut header = desc("rule-0-match-0", "");
    header.rate_limit = policy(rpu, RateLimitUnit::Hour);
    let mut cidr = desc("masked_remote_address", "0.0.0.0/0");
    cidr.rate_limit = policy(3, RateLimitUnit::Week);
    let mut route = desc(ROUTE, ROUTE);
    route.descriptors = vec![header, cidr];
    RateLimitConfig {
        name: "default/eg/http".into(),
        domain: "default/eg/http".into(),
        descriptors: vec![route],
    }
}

/// A shared policy's domain in shadow mode: 1 per month.
fn eg_shared_shadow() -> RateLimitConfig {
    let rule = "default/policy/rule/0";
    let mut leaf = desc("rule-0-match--1", "rule-0-match--1");
    leaf.rate_limit = policy(1, RateLimitUnit::Month);
    leaf.shadow_mode = true;
    let mut parent = desc(rule, rule);
    parent.shadow_mode = true;
    parent.descriptors = vec![leaf];
    RateLimitConfig {
        name: "default/policy".into(),
        domain: "default/policy".into(),
        descriptors: vec![parent],
    }
}

fn eg_set(rpu: u32) -> Vec<Any> {
    vec![pack(&eg_listener(rpu)), pack(&eg_shared_shadow())]
}

const DOMAIN: &str = "default/eg/http";

// ---------------------------------------------------------------------------
// Tests.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_gateway_push_is_acked_and_its_limits_are_enforced() {
    let cp = ControlPlane::start().await;
    cp.set("1", eg_set(2));
    let r = replica(settings(cp.addr));
    let ack = cp.acked("1").await;
    r.has_domain(DOMAIN).await;
    // Node id in every request; wildcard subscription; the first request of
    // the stream starts from nothing.
    let first = cp.requests().into_iter().next().expect("a request");
    assert_eq!(
        (first.version_info.as_str(), first.response_nonce.as_str()),
        ("", "")
    );
    assert!(cp.requests().iter().all(
        |q| q.node.as_ref().is_some_and(|n| n.id == "envoy-ratelimit")
            && q.resource_names.is_empty()
            && q.type_url == RATE_LIMIT_CONFIG_TYPE_URL
    ));
    assert_eq!(ack.response_nonce, "1");

    // One bucket per header value, 2 per hour.
    let user = [(ROUTE, ROUTE), ("rule-0-match-0", "alice")];
    assert_eq!(r.code(DOMAIN, &user).await, Code::Ok);
    assert_eq!(r.code(DOMAIN, &user).await, Code::Ok);
    assert_eq!(r.code(DOMAIN, &user).await, Code::OverLimit);
    assert_eq!(
        r.code(DOMAIN, &[(ROUTE, ROUTE), ("rule-0-match-0", "bob")])
            .await,
        Code::Ok
    );
    // The CIDR rule: 3 per week for the whole range.
    let cidr = [(ROUTE, ROUTE), ("masked_remote_address", "0.0.0.0/0")];
    for _ in 0..3 {
        assert_eq!(r.code(DOMAIN, &cidr).await, Code::Ok);
    }
    assert_eq!(r.code(DOMAIN, &cidr).await, Code::OverLimit);
    let resp = r.ask(DOMAIN, &cidr).await.expect("decision");
    let limit = resp.statuses[0]
        .current_limit
        .as_ref()
        .expect("current_limit");
    assert_eq!(limit.requests_per_unit, 3);
    // Shadow mode: over its limit, still OK.
    let shared = [
        ("default/policy/rule/0", "default/policy/rule/0"),
        ("rule-0-match--1", "rule-0-match--1"),
    ];
    assert_eq!(r.code("default/policy", &shared).await, Code::Ok);
    assert_eq!(r.code("default/policy", &shared).await, Code::Ok);

    let v = r.rlconfig().await;
    assert_eq!(v["source"]["kind"], "xds");
    assert_eq!(v["source"]["version"], "1");
    assert_eq!(v["source"]["connected"], true);
    assert_eq!(v["source"]["awaiting_first_config"], false);
    assert_eq!(v["source"]["last_push"]["outcome"], "ack");
    assert_eq!(v["domains"].as_array().map(Vec::len), Some(2));
    let metrics = String::from_utf8(r.admin("/metrics").await).expect("UTF-8");
    assert!(
        metrics.contains("bucket_rls_xds_version_info{version=\"1\"} 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!(
            "bucket_rls_config_info{{hash=\"{}\"}} 1\n",
            r.hash()
        )),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_the_first_push_should_rate_limit_answers_unknown() {
    let cp = ControlPlane::start().await;
    let r = replica(settings(cp.addr));
    // Connected, no snapshot yet: the server stays silent, as Envoy Gateway
    // does before it has translated a Gateway.
    eventually(DEADLINE, "the first request", || async {
        (!cp.requests().is_empty()).then_some(())
    })
    .await;
    let e = r
        .ask(DOMAIN, &[("k", "v")])
        .await
        .expect_err("no config yet");
    assert_eq!(e.code(), tonic::Code::Unknown);
    assert!(
        e.message().contains("no rate limit configuration loaded"),
        "{e:?}"
    );
    assert_eq!(r.rlconfig().await["source"]["awaiting_first_config"], true);
    cp.set("1", eg_set(5));
    r.has_domain(DOMAIN).await;
    assert_eq!(r.code(DOMAIN, &[(ROUTE, ROUTE)]).await, Code::Ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_push_is_nacked_with_the_reason_and_the_old_limits_keep_working() {
    let cp = ControlPlane::start().await;
    cp.set("1", eg_set(1));
    let r = replica(settings(cp.addr));
    cp.acked("1").await;
    r.has_domain(DOMAIN).await;
    let hash = r.hash();
    let user = [(ROUTE, ROUTE), ("rule-0-match-0", "alice")];
    assert_eq!(r.code(DOMAIN, &user).await, Code::Ok);

    // Version 2: the header rule lost its unit.
    let mut bad = eg_listener(100);
    bad.descriptors[0].descriptors[0]
        .rate_limit
        .as_mut()
        .expect("policy")
        .unit = 0;
    cp.set("2", vec![pack(&bad), pack(&eg_shared_shadow())]);
    let nack = cp.nacked().await;
    assert_eq!(
        nack.version_info, "1",
        "a NACK carries the last ACKed version"
    );
    assert_ne!(
        nack.response_nonce, "1",
        "a NACK carries the refused response's nonce"
    );
    let detail = nack.error_detail.expect("error detail");
    // Each level of the path names its key and value (the header rule is
    // key-only), in the NACK and on /rlconfig alike.
    let problem = format!(
        "default/eg/http: descriptors[0](key={ROUTE}, value={ROUTE}).descriptors[0](key=rule-0-match-0).rate_limit: bad unit 'UNKNOWN'"
    );
    assert!(detail.message.contains(&problem), "{}", detail.message);
    // The old config stays: same hash, alice is still limited to 1.
    assert_eq!(r.hash(), hash);
    assert_eq!(r.code(DOMAIN, &user).await, Code::OverLimit);
    let v = r.rlconfig().await;
    assert_eq!(v["source"]["version"], "1");
    assert_eq!(v["source"]["last_push"]["outcome"], "nack");
    assert_eq!(v["source"]["last_push"]["version"], "2");
    assert!(
        v["last_reload_error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains(&problem)),
        "{v}"
    );

    // Version 3 fixes it: applied, error cleared.
    cp.set("3", eg_set(100));
    cp.acked("3").await;
    eventually(DEADLINE, "version 3 in force", || async {
        (r.rlconfig().await["source"]["version"] == "3").then_some(())
    })
    .await;
    assert!(r.rlconfig().await["last_reload_error"].is_null());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raised_limit_is_enforced_soon_after_the_push() {
    let cp = ControlPlane::start().await;
    cp.set("1", eg_set(1));
    let r = replica(settings(cp.addr));
    r.has_domain(DOMAIN).await;
    let key = |n: usize| format!("user-{n}");
    let limit_of = |resp: RateLimitResponse| {
        resp.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| l.requests_per_unit)
    };
    let first = r
        .ask(DOMAIN, &[(ROUTE, ROUTE), ("rule-0-match-0", &key(0))])
        .await
        .expect("decision");
    assert_eq!(limit_of(first), Some(1));
    let pushed = Instant::now();
    cp.set("2", eg_set(50));
    let mut n = 1;
    let ((), took) = eventually(DEADLINE, "the raised limit in answers", || {
        n += 1;
        let k = key(n);
        let r = &r;
        async move {
            let resp = r
                .ask(DOMAIN, &[(ROUTE, ROUTE), ("rule-0-match-0", &k)])
                .await
                .expect("decision");
            (limit_of(resp) == Some(50)).then_some(())
        }
    })
    .await;
    eprintln!(
        "raised limit enforced {:?} after the push ({took:?} of polling)",
        pushed.elapsed()
    );
    // A user of the old limit now gets the raised one too.
    let user = [(ROUTE, ROUTE), ("rule-0-match-0", "steady")];
    for _ in 0..5 {
        assert_eq!(r.code(DOMAIN, &user).await, Code::Ok);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_server_with_a_new_config_is_applied_after_reconnect_and_limits_serve_throughout()
{
    let cp = ControlPlane::start().await;
    let port = cp.addr.port();
    cp.set("1", eg_set(2));
    let r = replica(settings(cp.addr));
    r.has_domain(DOMAIN).await;
    let user = [(ROUTE, ROUTE), ("rule-0-match-0", "alice")];
    assert_eq!(r.code(DOMAIN, &user).await, Code::Ok);
    drop(cp);
    eventually(
        DEADLINE,
        "the client to notice the server is gone",
        || async { (r.rlconfig().await["source"]["connected"] == false).then_some(()) },
    )
    .await;
    // Disconnected: the last good config keeps serving.
    assert_eq!(r.code(DOMAIN, &user).await, Code::Ok);
    assert_eq!(r.code(DOMAIN, &user).await, Code::OverLimit);

    // The server comes back counting from 1 again (as Envoy Gateway does
    // after a restart) with a different config: the client starts its new
    // stream from an empty version, so it gets it.
    let mut other = eg_listener(2);
    other.domain = "default/eg/https".into();
    other.name = "default/eg/https".into();
    let cp = ControlPlane::start_on(
        Some(port),
        None,
        Snapshot {
            version: "1".into(),
            resources: vec![pack(&other)],
        },
    )
    .await;
    r.has_domain("default/eg/https").await;
    cp.acked("1").await;
    assert!(!r.limiter.config().domains.contains_key(DOMAIN));
    let first = cp.requests().into_iter().next().expect("a request");
    assert_eq!(
        first.version_info, "",
        "a new stream starts from an empty version"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_converge_on_the_same_hash() {
    let cp = ControlPlane::start().await;
    cp.set("1", eg_set(2));
    let a = replica(settings(cp.addr));
    let b = replica(settings(cp.addr));
    a.has_domain(DOMAIN).await;
    b.has_domain(DOMAIN).await;
    assert_eq!(a.hash(), b.hash());
    let before = a.hash();
    // The same set in another order is the same config.
    let mut reordered = eg_set(2);
    reordered.reverse();
    cp.set("2", reordered);
    eventually(DEADLINE, "both replicas to ACK version 2", || async {
        (cp.requests()
            .iter()
            .filter(|q| q.version_info == "2")
            .count()
            >= 2)
            .then_some(())
    })
    .await;
    assert_eq!((a.hash(), b.hash()), (before.clone(), before.clone()));
    cp.set("3", eg_set(7));
    eventually(DEADLINE, "both replicas on version 3", || async {
        (a.hash() != before && a.hash() == b.hash()).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_set_means_no_domains() {
    let cp = ControlPlane::start().await;
    cp.set("1", eg_set(1));
    let r = replica(settings(cp.addr));
    r.has_domain(DOMAIN).await;
    let user = [(ROUTE, ROUTE), ("rule-0-match-0", "alice")];
    r.code(DOMAIN, &user).await;
    assert_eq!(r.code(DOMAIN, &user).await, Code::OverLimit);
    cp.set("2", Vec::new());
    cp.acked("2").await;
    eventually(DEADLINE, "no domains", || async {
        r.limiter.config().domains.is_empty().then_some(())
    })
    .await;
    assert_eq!(r.code(DOMAIN, &user).await, Code::Ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_with_envoy_gateway_shaped_certificates() {
    let pki = Pki::new();
    let cp = ControlPlane::start_on(
        None,
        Some(pki.server_config()),
        Snapshot {
            version: "1".into(),
            resources: eg_set(2),
        },
    )
    .await;
    let port = cp.addr.port();
    let mut s = settings(cp.addr);
    s.tls = Some(pki.write_client("first"));
    let r = replica(s.clone());
    r.has_domain(DOMAIN).await;
    cp.acked("1").await;
    let cns = cp.tls.client_cns.lock().clone();
    assert!(
        !cns.is_empty() && cns.iter().all(|c| c == "first"),
        "{cns:?}"
    );

    // Without a client certificate the server refuses the handshake.
    let mut anonymous = settings(cp.addr);
    anonymous.tls = Some(XdsTls {
        client_cert: None,
        client_key: None,
        ..s.tls.clone().expect("tls")
    });
    let a = replica(anonymous);
    eventually(DEADLINE, "a refused handshake", || async {
        (cp.tls.handshake_failures.load(Ordering::SeqCst) > 0).then_some(())
    })
    .await;
    assert!(a.limiter.config_handle().is_awaiting_first_config());

    // A rotated client certificate is used after reconnecting.
    drop(a);
    pki.write_client("rotated");
    drop(cp);
    let cp = ControlPlane::start_on(
        Some(port),
        Some(pki.server_config()),
        Snapshot {
            version: "2".into(),
            resources: eg_set(9),
        },
    )
    .await;
    cp.acked("2").await;
    let cns = cp.tls.client_cns.lock().clone();
    assert!(
        !cns.is_empty() && cns.iter().all(|c| c == "rotated"),
        "{cns:?}"
    );
    assert_eq!(r.rlconfig().await["source"]["version"], "2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_above_4_mib_needs_a_larger_message_limit() {
    // About 6 MiB: 600 resources with 10 KiB values.
    let big: Vec<Any> = (0..600)
        .map(|i| {
            let mut d = desc("k", &format!("{i:0>10240}"));
            d.rate_limit = policy(1, RateLimitUnit::Second);
            pack(&RateLimitConfig {
                name: format!("d{i}"),
                domain: format!("d{i}"),
                descriptors: vec![d],
            })
        })
        .collect();
    let bytes: usize = big.iter().map(|a| a.value.len()).sum();
    assert!(bytes > 5 << 20, "{bytes}");
    let cp = ControlPlane::start().await;
    cp.set("1", big);
    let mut small = settings(cp.addr);
    small.node_id = "small".into();
    let mut large = settings(cp.addr);
    large.max_message_bytes = 16 << 20;
    let s = replica(small);
    let l = replica(large);
    l.has_domain("d599").await;
    // The default limit refuses the message: that stream fails and the
    // client reconnects, without ever getting the config.
    eventually(DEADLINE, "the small client to reconnect", || async {
        (cp.seen().streams.load(Ordering::SeqCst) >= 3).then_some(())
    })
    .await;
    assert!(s.limiter.config_handle().is_awaiting_first_config());
    assert!(!cp.requests().iter().any(|q| q.node.as_ref().is_some_and(|n| n.id == "small") && !q.version_info.is_empty()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_resources_in_one_push() {
    let set: Vec<Any> = (0..10_000)
        .map(|i| {
            let mut c = eg_listener(2);
            c.name = format!("ns-{i}/eg/http");
            c.domain = c.name.clone();
            pack(&c)
        })
        .collect();
    let cp = ControlPlane::start().await;
    let mut s = settings(cp.addr);
    s.max_message_bytes = 64 << 20;
    let r = replica(s);
    let pushed = Instant::now();
    cp.set("1", set);
    cp.acked("1").await;
    eprintln!(
        "10,000 resources applied and ACKed {:?} after the push",
        pushed.elapsed()
    );
    let c = r.limiter.config();
    assert_eq!(c.domains.len(), 10_000);
    assert_eq!(c.rule_count(), 20_000);
    let user = [(ROUTE, ROUTE), ("rule-0-match-0", "alice")];
    assert_eq!(r.code("ns-9999/eg/http", &user).await, Code::Ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resource_of_the_wrong_type_url_is_nacked() {
    let cp = ControlPlane::start().await;
    let mut wrong = pack(&eg_listener(1));
    wrong.type_url = "type.googleapis.com/envoy.config.cluster.v3.Cluster".into();
    cp.set("1", vec![pack(&eg_shared_shadow()), wrong]);
    let r = replica(settings(cp.addr));
    let nack = cp.nacked().await;
    assert_eq!(nack.version_info, "");
    let m = nack.error_detail.expect("detail").message;
    assert!(
        m.contains(
            "resources[1]: type URL 'type.googleapis.com/envoy.config.cluster.v3.Cluster' is not"
        ),
        "{m}"
    );
    // Nothing applied, not even the good resource.
    assert!(r.limiter.config_handle().is_awaiting_first_config());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_loop_against_a_resending_server_is_slowed_down() {
    let cp = ControlPlane::start().await;
    cp.set("1", eg_set(1));
    let r = replica(settings(cp.addr));
    r.has_domain(DOMAIN).await;
    let hash = r.hash();
    let mut bad = eg_listener(1);
    bad.descriptors[0].key = String::new();
    // The server answers every NACK with the same set at once.
    cp.set("2", vec![pack(&bad)]);
    cp.nacked().await;
    let start = Instant::now();
    let nacks = || {
        cp.requests()
            .iter()
            .filter(|q| q.error_detail.is_some())
            .count()
    };
    let at_start = nacks();
    eventually(DEADLINE, "a few more NACKs", || async {
        (nacks() >= at_start + 3).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let elapsed = start.elapsed();
    let sent = nacks() - at_start;
    eprintln!("{sent} NACKs of the same set in {elapsed:?}");
    // Each repeat waits at least half the 100 ms initial backoff (jitter
    // 0.2), growing to the 500 ms max: far fewer than an unthrottled loop.
    let ceiling = usize::try_from(elapsed.as_millis() / 80).expect("count") + 2;
    assert!(sent <= ceiling, "{sent} NACKs in {elapsed:?}");
    // Every NACK keeps naming the problem; the config in force is unchanged.
    assert!(
        cp.requests()
            .iter()
            .filter_map(|q| q.error_detail.as_ref())
            .all(|d| d.message.contains("descriptor without 'key'"))
    );
    assert_eq!(r.hash(), hash);
    // A new version ends the loop.
    cp.set("3", eg_set(4));
    cp.acked("3").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_sees_429s_after_a_push() {
    use crate::common::procs::{Envoy, Proc, bucket_rls_bin, envoy_for_loopback, yaml_file};
    let cp = ControlPlane::start().await;
    // Domain `edge` of the example bootstrap: 1000 per hour per API key.
    let mut api = desc("api_key", "");
    api.rate_limit = policy(1000, RateLimitUnit::Hour);
    let edge = |api: RateLimitDescriptor| RateLimitConfig {
        name: "edge".into(),
        domain: "edge".into(),
        descriptors: vec![api],
    };
    cp.set("1", vec![pack(&edge(api.clone()))]);

    let grpc = SocketAddr::from(([127, 0, 0, 1], crate::common::free_port()));
    let http = SocketAddr::from(([127, 0, 0, 1], crate::common::free_port()));
    let mut cmd = std::process::Command::new(bucket_rls_bin());
    cmd.args([
        "serve",
        "--config-xds",
        &cp.addr.to_string(),
        "--config-xds-node-id",
        "envoy-ratelimit",
        "--config-xds-backoff-initial-ms",
        "100",
        "--config-xds-wait-for-config",
        "--grpc-addr",
        &grpc.to_string(),
        "--http-addr",
        &http.to_string(),
    ])
    .env("BUCKET_RLS_LOG_LEVEL", "info");
    let mut rls = Proc::spawn("bucket-rls", cmd);
    cp.acked("1").await;
    eventually(DEADLINE, "bucket-rls healthy", || async {
        crate::common::http::get(http, "/healthcheck", &[])
            .await
            .ok()
            .filter(|r| r.status == 200)
            .map(|_| ())
    })
    .await;
    rls.assert_running();

    let upstream = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .expect("bind");
    let up = upstream.local_addr().expect("addr");
    tokio::spawn(async move {
        let app = axum::Router::new().fallback(|| async { "ok\n" });
        let _ = axum::serve(upstream, app).await;
    });
    let example =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/envoy/envoy.yaml");
    let mut bootstrap = envoy_for_loopback(
        yaml_file(&example),
        &[("bucket_rls", &[grpc]), ("upstream", &[up])],
    );
    // The example's 100 ms budget is for production; a loaded CI machine
    // could fail open where this test expects 429.
    let filters = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"]
        .as_array_mut()
        .expect("http_filters");
    let rl = filters
        .iter_mut()
        .find(|f| f["name"] == "envoy.filters.http.ratelimit")
        .expect("ratelimit filter");
    rl["typed_config"]["timeout"] = "2s".into();
    let envoy = Envoy::start(&bootstrap).await;
    let listener = envoy.listener;
    let get = |key: &'static str| async move {
        crate::common::http::get(listener, "/x", &[("x-api-key", key)])
            .await
            .expect("request")
            .status
    };
    assert_eq!(get("k1").await, 200);
    assert_eq!(get("k1").await, 200);

    // Version 2: nothing passes for an API key.
    api.rate_limit = policy(0, RateLimitUnit::Hour);
    let pushed = Instant::now();
    cp.set("2", vec![pack(&edge(api))]);
    cp.acked("2").await;
    eventually(DEADLINE, "429 through Envoy", || async {
        (get("k2").await == 429).then_some(())
    })
    .await;
    eprintln!(
        "push visible as 429 through Envoy {:?} after it",
        pushed.elapsed()
    );
    assert_eq!(get("k1").await, 429);
    // SIGHUP (a reload for a file config) is logged and ignored.
    let status = std::process::Command::new("kill")
        .args(["-HUP", &rls.pid().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    eventually(DEADLINE, "the SIGHUP to be logged", || async {
        rls.logs().contains("SIGHUP ignored").then_some(())
    })
    .await;
    rls.assert_running();
    assert_eq!(get("k1").await, 429);
}

/// The drop-in case: the binary started as `ratelimit` with Envoy Gateway's
/// xDS environment (mTLS to the control plane with Envoy Gateway-shaped
/// names, node id `envoy-ratelimit`, `FORCE_START_WITHOUT_INITIAL_CONFIG`,
/// Redis as `host:port`) is healthy before any push, answers UNKNOWN until
/// the first config, then enforces the pushed limits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ratelimit_under_envoy_gateways_xds_environment_enforces_pushed_limits() {
    use crate::common::http::get as http_get;
    use crate::common::procs::{Proc, bucket_rls_bin};
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    let pki = Pki::new();
    let cp = ControlPlane::start_on(None, Some(pki.server_config()), Snapshot::default()).await;
    let tls = pki.write_client("envoy-ratelimit");
    let redis = crate::common::redis::RedisServer::start();
    let link_dir = tempfile::tempdir().expect("tempdir");
    let link = link_dir.path().join("ratelimit");
    std::os::unix::fs::symlink(bucket_rls_bin(), &link).expect("symlink");
    let (grpc, http) = (crate::common::free_port(), crate::common::free_port());
    let s = |p: &Option<std::path::PathBuf>| p.as_ref().expect("path").display().to_string();
    let mut cmd = std::process::Command::new(&link);
    cmd.env_clear().envs([
        ("RUNTIME_ROOT", "/data".to_owned()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit".to_owned()),
        ("RUNTIME_IGNOREDOTFILES", "true".to_owned()),
        ("RUNTIME_WATCH_ROOT", "false".to_owned()),
        ("LOG_LEVEL", "info".to_owned()),
        ("USE_STATSD", "false".to_owned()),
        ("CONFIG_TYPE", "GRPC_XDS_SOTW".to_owned()),
        ("CONFIG_GRPC_XDS_SERVER_URL", cp.addr.to_string()),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit".to_owned()),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true".to_owned()),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", s(&tls.client_cert)),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", s(&tls.client_key)),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", s(&tls.ca_cert)),
        // Dialled as 127.0.0.1; Envoy Gateway's certificate names the service.
        ("CONFIG_GRPC_XDS_SERVER_TLS_SAN", "envoy-gateway".to_owned()),
        ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "100ms".to_owned()),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true".to_owned()),
        ("REDIS_SOCKET_TYPE", "tcp".to_owned()),
        ("REDIS_URL", format!("127.0.0.1:{}", redis.port())),
        ("HOST", "127.0.0.1".to_owned()),
        ("PORT", http.to_string()),
        ("GRPC_HOST", "127.0.0.1".to_owned()),
        ("GRPC_PORT", grpc.to_string()),
        ("DEBUG_HOST", "127.0.0.1".to_owned()),
        ("DEBUG_PORT", crate::common::free_port().to_string()),
    ]);
    let mut proc = Proc::spawn("ratelimit", cmd);
    let http_addr = SocketAddr::from(([127, 0, 0, 1], http));
    // Healthy without any config (Envoy Gateway may never push one).
    eventually(DEADLINE, "/healthcheck 200 before any push", || {
        proc.assert_running();
        async move {
            let r = http_get(http_addr, "/healthcheck", &[]).await.ok()?;
            (r.status == 200).then_some(())
        }
    })
    .await;
    let mut client = RateLimitServiceClient::connect(format!("http://127.0.0.1:{grpc}"))
        .await
        .expect("connect");
    let user = [(ROUTE, ROUTE), ("rule-0-match-0", "alice")];
    let ask = |c: &mut RateLimitServiceClient<tonic::transport::Channel>| {
        let req = RateLimitRequest {
            domain: DOMAIN.into(),
            descriptors: vec![crate::common::desc(&user)],
            hits_addend: 0,
        };
        let mut c = c.clone();
        async move { c.should_rate_limit(req).await }
    };
    let before = ask(&mut client).await.expect_err("no config yet");
    assert_eq!(before.code(), tonic::Code::Unknown, "{before:?}");

    cp.set("1", eg_set(2));
    cp.acked("1").await;
    let cns = cp.tls.client_cns.lock().clone();
    assert!(cns.iter().all(|c| c == "envoy-ratelimit"), "{cns:?}");
    let (codes, _) = eventually(DEADLINE, "the pushed limit in force", || {
        let mut c = client.clone();
        async move {
            let mut codes = Vec::new();
            for _ in 0..3 {
                codes.push(ask(&mut c).await.ok()?.into_inner().overall_code);
            }
            Some(codes)
        }
    })
    .await;
    assert_eq!(
        codes,
        [Code::Ok as i32, Code::Ok as i32, Code::OverLimit as i32],
        "2 per hour per header value"
    );
}
