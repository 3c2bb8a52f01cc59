//! The binary started as `ratelimit` (a link named like the Go service's
//! binary) with no arguments and only the Go service's environment: Envoy
//! Gateway's (file mode), the Istio sample's and the Go docker-compose's.
//! Certificates are made here in Envoy Gateway's shape: RSA 2048 keys
//! (PKCS#1 files), a CA named `envoy-gateway`, a leaf with CN `*` and SAN
//! `*.envoy-gateway-system`, no extended key usage. RSA keys come from the
//! `openssl` command (rcgen's ring backend signs with RSA but cannot make
//! RSA keys); the test fails when it is missing.

use crate::common::eventually::eventually;
use crate::common::http::get as http_get;
use crate::common::procs::{Envoy, Proc, bucket_rls_bin};
use crate::common::redis::RedisServer;
use crate::common::{desc, free_port, req};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

/// Generous deadline for anything a loaded 2-core machine does.
const DEADLINE: Duration = Duration::from_secs(30);

/// The name the client asks for: covered by the leaf's wildcard SAN (the
/// handshake itself sends no SNI).
const SERVER_NAME: &str = "envoy-ratelimit.envoy-gateway-system";

/// An RSA 2048 key: (PKCS#8 PEM for rcgen, PKCS#1 PEM for the files).
fn rsa_key(dir: &Path) -> (String, String) {
    let (k8, k1) = (dir.join("k8.pem"), dir.join("k1.pem"));
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .output()
            .expect("run openssl (install the Debian package openssl)");
        assert!(out.status.success(), "openssl {args:?}: {out:?}");
    };
    let (k8s, k1s) = (k8.to_str().expect("utf-8"), k1.to_str().expect("utf-8"));
    run(&[
        "genpkey",
        "-algorithm",
        "RSA",
        "-pkeyopt",
        "rsa_keygen_bits:2048",
        "-out",
        k8s,
    ]);
    run(&["pkey", "-in", k8s, "-traditional", "-out", k1s]);
    let pkcs1 = std::fs::read_to_string(&k1).expect("read");
    assert!(
        pkcs1.starts_with("-----BEGIN RSA PRIVATE KEY-----"),
        "{pkcs1}"
    );
    (std::fs::read_to_string(&k8).expect("read"), pkcs1)
}

/// Envoy Gateway's CA, able to issue leaves.
struct EgCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: String,
    tmp: tempfile::TempDir,
}

impl EgCa {
    fn new() -> Self {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (k8, _) = rsa_key(tmp.path());
        let key = rcgen::KeyPair::from_pem(&k8).expect("RSA key");
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        p.distinguished_name
            .push(rcgen::DnType::CommonName, "envoy-gateway");
        let pem = p.self_signed(&key).expect("CA").pem();
        Self {
            issuer: rcgen::Issuer::new(p, key),
            pem,
            tmp,
        }
    }

    /// The rate limit server's leaf: (certificate PEM, PKCS#1 key PEM).
    fn server_leaf(&self) -> (String, String) {
        let (k8, k1) = rsa_key(self.tmp.path());
        let key = rcgen::KeyPair::from_pem(&k8).expect("RSA key");
        let mut p = rcgen::CertificateParams::new(vec!["*.envoy-gateway-system".to_owned()])
            .expect("params");
        p.distinguished_name.push(rcgen::DnType::CommonName, "*");
        (p.signed_by(&key, &self.issuer).expect("leaf").pem(), k1)
    }

    /// A client leaf with `san` (ECDSA: its shape does not matter here).
    fn client_leaf(&self, san: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().expect("key");
        let p = rcgen::CertificateParams::new(vec![san.to_owned()]).expect("params");
        (
            p.signed_by(&key, &self.issuer).expect("leaf").pem(),
            key.serialize_pem(),
        )
    }
}

/// Writes `/certs` as Envoy Gateway's certgen Secret does: `ca.crt`,
/// `tls.crt`, `tls.key`. Replaces files by rename, as a Secret volume does.
fn write_certs(dir: &Path, ca: &str, leaf: &(String, String)) {
    std::fs::create_dir_all(dir).expect("mkdir");
    for (name, text) in [("ca.crt", ca), ("tls.crt", &leaf.0), ("tls.key", &leaf.1)] {
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(&tmp, dir.join(name)).expect("rename");
    }
}

/// Verifies the server's chain against the CA but not its name, as Envoy
/// Gateway's Envoy does (no SAN match configured; webpki would refuse the
/// wildcard `*.envoy-gateway-system` over a single label anyway).
#[derive(Debug)]
struct ChainOnly(Arc<rustls::client::WebPkiServerVerifier>);

impl rustls::client::danger::ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        use rustls::{CertificateError, Error};
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(rustls::client::danger::ServerCertVerified::assertion()),
            other => other,
        }
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// A rustls client config trusting `ca_pem`, sending no SNI, offering `h2`.
fn client_config(ca_pem: &str, client: Option<&(String, String)>) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.expect("CA PEM")).expect("CA");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .expect("verifier");
    let b = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(ChainOnly(verifier)));
    let mut cfg = match client {
        None => b.with_no_client_auth(),
        Some((cert, key)) => b
            .with_client_auth_cert(
                CertificateDer::pem_slice_iter(cert.as_bytes())
                    .collect::<Result<_, _>>()
                    .expect("client cert"),
                PrivateKeyDer::from_pem_slice(key.as_bytes()).expect("client key"),
            )
            .expect("client auth"),
    };
    cfg.enable_sni = false;
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    cfg
}

/// One TLS handshake; the server's leaf certificate (DER).
async fn served_leaf(addr: SocketAddr, ca_pem: &str) -> std::io::Result<Vec<u8>> {
    let c = tokio_rustls::TlsConnector::from(Arc::new(client_config(ca_pem, None)));
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let tls = c
        .connect(ServerName::try_from(SERVER_NAME).expect("name"), tcp)
        .await?;
    let (_, conn) = tls.get_ref();
    assert_eq!(conn.alpn_protocol(), Some(&b"h2"[..]), "ALPN h2");
    Ok(conn.peer_certificates().expect("certs")[0].to_vec())
}

/// A gRPC client over TLS (no SNI) with an optional client certificate.
async fn tls_client(
    addr: SocketAddr,
    ca_pem: &str,
    client: Option<&(String, String)>,
) -> RateLimitServiceClient<tonic::transport::Channel> {
    RateLimitServiceClient::new(tls_channel(addr, ca_pem, client).await)
}

/// A gRPC channel over TLS (no SNI) with an optional client certificate.
async fn tls_channel(
    addr: SocketAddr,
    ca_pem: &str,
    client: Option<&(String, String)>,
) -> tonic::transport::Channel {
    let c = tokio_rustls::TlsConnector::from(Arc::new(client_config(ca_pem, client)));
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect_with_connector(tower::service_fn(move |_| {
            let c = c.clone();
            async move {
                let tcp = tokio::net::TcpStream::connect(addr).await?;
                let tls = c
                    .connect(ServerName::try_from(SERVER_NAME).expect("name"), tcp)
                    .await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
            }
        }))
        .await
        .expect("TLS channel")
}

/// Envoy Gateway's descriptor shape for one rule: the rule's generic key,
/// then the client address masked to /0.
const EG_CONFIG: &str = "\
domain: default/eg/http
descriptors:
  - key: default/eg/http/rule-0-match-0
    value: rule-0-match-0
    descriptors:
      - key: masked_remote_address
        value: 0.0.0.0/0
        rate_limit:
          unit: minute
          requests_per_unit: 2
";

fn eg_request() -> envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest {
    req(
        "default/eg/http",
        vec![desc(&[
            ("default/eg/http/rule-0-match-0", "rule-0-match-0"),
            ("masked_remote_address", "0.0.0.0/0"),
        ])],
        1,
    )
}

/// A `ratelimit` link to the binary, in its own directory.
fn ratelimit_link() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let link = dir.path().join("ratelimit");
    std::os::unix::fs::symlink(bucket_rls_bin(), &link).expect("symlink");
    (dir, link)
}

/// Loopback ports of one `ratelimit` process.
struct Ports {
    grpc: SocketAddr,
    http: SocketAddr,
    debug: SocketAddr,
    prometheus: SocketAddr,
}

impl Ports {
    fn new() -> Self {
        let p = || SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
        Self {
            grpc: p(),
            http: p(),
            debug: p(),
            prometheus: p(),
        }
    }

    /// The listen variables (loopback here; Envoy Gateway leaves the hosts
    /// at their default, every address).
    fn env(&self) -> Vec<(String, String)> {
        [
            ("HOST", "127.0.0.1".to_owned()),
            ("PORT", self.http.port().to_string()),
            ("GRPC_HOST", "127.0.0.1".to_owned()),
            ("GRPC_PORT", self.grpc.port().to_string()),
            ("DEBUG_HOST", "127.0.0.1".to_owned()),
            ("DEBUG_PORT", self.debug.port().to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }
}

/// Starts `ratelimit` with exactly `env` (nothing inherited).
fn start(link: &Path, env: &[(String, String)]) -> Proc {
    let mut cmd = Command::new(link);
    cmd.env_clear().envs(env.iter().map(|(k, v)| (k, v)));
    Proc::spawn("ratelimit", cmd)
}

/// Waits for `/healthcheck` to answer 200 `OK`.
async fn wait_healthy(proc: &mut Proc, http: SocketAddr) {
    eventually(DEADLINE, "/healthcheck 200", || {
        proc.assert_running();
        async move {
            let r = http_get(http, "/healthcheck", &[]).await.ok()?;
            (r.status == 200).then_some(r.body)
        }
    })
    .await;
}

/// Envoy Gateway's environment (file mode: its xDS variables are set but
/// not read) with Redis, Prometheus, and `/certs` under `root`.
fn eg_env(root: &Path, ports: &Ports, redis: &RedisServer) -> Vec<(String, String)> {
    let certs = root.join("certs");
    let s = |p: &Path| p.to_string_lossy().into_owned();
    let mut env: Vec<(String, String)> = [
        ("RUNTIME_ROOT", s(&root.join("data"))),
        ("RUNTIME_SUBDIRECTORY", "ratelimit".into()),
        ("RUNTIME_IGNOREDOTFILES", "true".into()),
        ("RUNTIME_WATCH_ROOT", "false".into()),
        ("LOG_LEVEL", "info".into()),
        ("USE_STATSD", "false".into()),
        ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001".into()),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit".into()),
        ("GRPC_SERVER_USE_TLS", "true".into()),
        ("GRPC_SERVER_TLS_CERT", s(&certs.join("tls.crt"))),
        ("GRPC_SERVER_TLS_KEY", s(&certs.join("tls.key"))),
        ("GRPC_SERVER_TLS_CA_CERT", s(&certs.join("ca.crt"))),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true".into()),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", s(&certs.join("tls.crt"))),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", s(&certs.join("tls.key"))),
        (
            "CONFIG_GRPC_XDS_SERVER_TLS_CACERT",
            s(&certs.join("ca.crt")),
        ),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true".into()),
        ("REDIS_SOCKET_TYPE", "tcp".into()),
        ("REDIS_URL", format!("127.0.0.1:{}", redis.port())),
        ("USE_PROMETHEUS", "true".into()),
        ("PROMETHEUS_ADDR", ports.prometheus.to_string()),
        (
            "PROMETHEUS_MAPPER_YAML",
            "/etc/statsd-exporter/conf.yaml".into(),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    env.extend(ports.env());
    env
}

/// Writes `yaml` as the one config file under `$RUNTIME_ROOT/ratelimit/config`.
fn write_config(root: &Path, yaml: &str) {
    let dir = root.join("data/ratelimit/config");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("config.yaml"), yaml).expect("write");
}

#[tokio::test]
async fn envoy_gateways_environment_serves_tls_grpc_metrics_debug_and_go_health() {
    let redis = RedisServer::start();
    let root = tempfile::tempdir().expect("tempdir");
    let ca = EgCa::new();
    let first = ca.server_leaf();
    write_certs(&root.path().join("certs"), &ca.pem, &first);
    write_config(root.path(), EG_CONFIG);
    let ports = Ports::new();
    let mut env = eg_env(root.path(), &ports, &redis);
    env.push(("REDIS_NO_SUCH_SETTING".into(), "1".into()));
    // Keeps the ports open after SIGTERM, so the unhealthy answer is seen.
    env.push(("BUCKET_RLS_SHUTDOWN_DELAY_SECS".into(), "60".into()));
    let (_link_dir, link) = ratelimit_link();
    let mut rls = start(&link, &env);
    wait_healthy(&mut rls, ports.http).await;
    // A client that completes the TLS handshake and then sends nothing is
    // closed as a silent plaintext one is (awaited before the SIGTERM
    // below, which would close it anyway).
    let silent = {
        use tokio::io::AsyncReadExt as _;
        let c = tokio_rustls::TlsConnector::from(Arc::new(client_config(&ca.pem, None)));
        let addr = ports.grpc;
        tokio::spawn(async move {
            let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let mut tls = c
                .connect(ServerName::try_from(SERVER_NAME).expect("name"), tcp)
                .await
                .expect("handshake");
            let mut buf = [0u8; 256];
            loop {
                match tokio::time::timeout(Duration::from_secs(40), tls.read(&mut buf)).await {
                    Ok(Ok(0) | Err(_)) => return,
                    // The server's own HTTP/2 settings.
                    Ok(Ok(_)) => {}
                    Err(_) => panic!("a TLS connection silent for 40 s is still open"),
                }
            }
        })
    };
    let logs = rls.logs();
    assert_eq!(
        logs.matches("REDIS_NO_SUCH_SETTING").count(),
        1,
        "the unknown variable is named once:\n{logs}"
    );

    // TLS gRPC: OK, OK, then OVER_LIMIT (2 per minute).
    let mut client = tls_client(ports.grpc, &ca.pem, None).await;
    let mut codes = Vec::new();
    for _ in 0..3 {
        let r = client
            .should_rate_limit(eg_request())
            .await
            .expect("ShouldRateLimit over TLS")
            .into_inner();
        codes.push(r.overall_code);
    }
    assert_eq!(
        codes,
        [Code::Ok as i32, Code::Ok as i32, Code::OverLimit as i32]
    );
    // gRPC health under the Go service's name and the server-wide one.
    let health = tonic_health::pb::health_client::HealthClient::new(
        tls_channel(ports.grpc, &ca.pem, None).await,
    );
    for service in ["ratelimit", ""] {
        let health = health.clone();
        eventually(DEADLINE, "gRPC health SERVING", || {
            let mut health = health.clone();
            async move {
                let r = health
                    .check(tonic_health::pb::HealthCheckRequest {
                        service: service.into(),
                    })
                    .await
                    .ok()?
                    .into_inner();
                (r.status == tonic_health::pb::health_check_response::ServingStatus::Serving as i32)
                    .then_some(())
            }
        })
        .await;
    }

    // A plaintext client is refused.
    let plain = async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", ports.grpc))
            .expect("endpoint")
            .connect()
            .await?;
        RateLimitServiceClient::new(ch)
            .should_rate_limit(eg_request())
            .await
            .map_err(|e| e.into())
            .map(|_| ())
    };
    let refused: Result<(), Box<dyn std::error::Error>> = plain.await;
    assert!(
        refused.is_err(),
        "a plaintext call succeeded on the TLS port"
    );

    // The Go metric names after the denial, on PROMETHEUS_ADDR.
    let m = http_get(ports.prometheus, "/metrics", &[])
        .await
        .expect("GET /metrics");
    assert_eq!(m.status, 200);
    let labels = "domain=\"default/eg/http\",key1=\"default/eg/http/rule-0-match-0_rule-0-match-0\",key2=\"masked_remote_address_0_0_0_0/0\"";
    for line in [
        format!("ratelimit_service_rate_limit_over_limit{{{labels}}} 1"),
        format!("ratelimit_service_rate_limit_total_hits{{{labels}}} 3"),
        format!("ratelimit_service_rate_limit_within_limit{{{labels}}} 2"),
        "ratelimit_service_config_load_success 1".to_owned(),
        "ratelimit_service_total_requests{grpc_method=\"ShouldRateLimit\"} 3".to_owned(),
    ] {
        assert!(m.body.lines().any(|l| l == line), "no {line}:\n{}", m.body);
    }
    assert!(
        m.body.contains("\nprocess_resident_memory_bytes "),
        "{}",
        m.body
    );
    assert!(!m.body.contains("bucket_rls_"), "{}", m.body);
    // bucket-rls's own names stay on the admin port.
    let admin = http_get(ports.http, "/metrics", &[]).await.expect("GET");
    assert!(
        admin.body.contains("bucket_rls_over_limit_total"),
        "{}",
        admin.body
    );

    // The debug port lists its endpoints at / (and for an unknown path).
    let index = http_get(ports.debug, "/", &[]).await.expect("GET /");
    assert_eq!(
        (index.status, index.body.as_str()),
        (200, "/rlconfig: the config in force, one rule per line\n")
    );
    let missing = http_get(ports.debug, "/nope", &[])
        .await
        .expect("GET /nope");
    assert_eq!((missing.status, missing.body), (404, index.body));

    // The plain-text /rlconfig on the debug port.
    let d = http_get(ports.debug, "/rlconfig", &[])
        .await
        .expect("GET /rlconfig");
    assert_eq!(d.status, 200);
    assert!(
        d.body.contains("default/eg/http.default/eg/http/rule-0-match-0_rule-0-match-0.masked_remote_address_0.0.0.0/0: unit=MINUTE requests_per_unit=2"),
        "{}",
        d.body
    );

    // A rotated certificate is served to new connections.
    let before = served_leaf(ports.grpc, &ca.pem).await.expect("handshake");
    let second = ca.server_leaf();
    write_certs(&root.path().join("certs"), &ca.pem, &second);
    let want = CertificateDer::from_pem_slice(second.0.as_bytes())
        .expect("pem")
        .to_vec();
    assert_ne!(before, want);
    let pem = ca.pem.clone();
    eventually(DEADLINE, "the new certificate on a new connection", || {
        let (pem, want) = (pem.clone(), want.clone());
        async move { (served_leaf(ports.grpc, &pem).await.ok()? == want).then_some(()) }
    })
    .await;
    // A bad new file keeps the certificate in force, and is logged.
    std::fs::write(root.path().join("certs/tls.crt"), "not a certificate\n").expect("write");
    eventually(DEADLINE, "the bad certificate logged", || {
        let logs = rls.logs();
        async move {
            logs.contains("do not load; keeping the certificate in force")
                .then_some(())
        }
    })
    .await;
    assert_eq!(
        served_leaf(ports.grpc, &ca.pem).await.expect("handshake"),
        want
    );
    // The existing TLS client still works.
    client
        .should_rate_limit(eg_request())
        .await
        .expect("call on the old connection");

    silent.await.expect("the silent TLS connection was closed");

    // /healthcheck turns 500 on SIGTERM.
    let ok = http_get(ports.http, "/healthcheck", &[])
        .await
        .expect("GET");
    assert_eq!((ok.status, ok.body.as_str()), (200, "OK"));
    let status = Command::new("kill")
        .args(["-TERM", &rls.pid().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    eventually(DEADLINE, "/healthcheck 500 after SIGTERM", || async move {
        let r = http_get(ports.http, "/healthcheck", &[]).await.ok()?;
        (r.status == 500).then_some(())
    })
    .await;
    rls.kill();
}

#[tokio::test]
async fn with_a_client_ca_a_client_without_a_certificate_is_refused() {
    let redis = RedisServer::start();
    let root = tempfile::tempdir().expect("tempdir");
    let ca = EgCa::new();
    write_certs(&root.path().join("certs"), &ca.pem, &ca.server_leaf());
    write_config(root.path(), EG_CONFIG);
    let ports = Ports::new();
    let mut env = eg_env(root.path(), &ports, &redis);
    let ca_file = root
        .path()
        .join("certs/ca.crt")
        .to_string_lossy()
        .into_owned();
    env.push(("GRPC_CLIENT_TLS_CACERT".into(), ca_file));
    env.push((
        "GRPC_CLIENT_TLS_SAN".into(),
        "envoy.envoy-gateway-system".into(),
    ));
    let (_link_dir, link) = ratelimit_link();
    let mut rls = start(&link, &env);
    wait_healthy(&mut rls, ports.http).await;

    let mut anonymous = tls_client(ports.grpc, &ca.pem, None).await;
    assert!(
        anonymous.should_rate_limit(eg_request()).await.is_err(),
        "a client without a certificate was served"
    );
    let wrong = ca.client_leaf("someone-else.example");
    let mut other = tls_client(ports.grpc, &ca.pem, Some(&wrong)).await;
    assert!(
        other.should_rate_limit(eg_request()).await.is_err(),
        "a client certificate without the SAN was served"
    );
    let right = ca.client_leaf("envoy.envoy-gateway-system");
    let mut client = tls_client(ports.grpc, &ca.pem, Some(&right)).await;
    let r = client
        .should_rate_limit(eg_request())
        .await
        .expect("served with the certificate")
        .into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32);
}

/// An Envoy bootstrap in Envoy Gateway's shape: the HTTP rate limit filter
/// to `ratelimit_cluster` over TLS (trusting `ca_file`, TLS 1.3 at most, no
/// SNI), the rule's generic key and the client address masked to /0.
fn eg_envoy(rls: SocketAddr, upstream: SocketAddr, ca_file: &Path) -> serde_json::Value {
    let cluster = |name: &str, addr: SocketAddr| {
        serde_json::json!({
            "name": name, "type": "STATIC", "connect_timeout": "2s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": addr.ip().to_string(), "port_value": addr.port()}}}}]}]}
        })
    };
    let mut rl = cluster("ratelimit_cluster", rls);
    rl["typed_extension_protocol_options"] = serde_json::json!({
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}
        }
    });
    rl["transport_socket"] = serde_json::json!({
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": {
                "tls_params": {"tls_maximum_protocol_version": "TLSv1_3"},
                "validation_context": {"trusted_ca": {"filename": ca_file.to_string_lossy()}}
            }
        }
    });
    serde_json::json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [{
                "name": "http",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "http",
                        "route_config": {"virtual_hosts": [{
                            "name": "all", "domains": ["*"],
                            "routes": [{"match": {"prefix": "/"}, "route": {
                                "cluster": "upstream",
                                "rate_limits": [{"actions": [
                                    {"generic_key": {"descriptor_key": "default/eg/http/rule-0-match-0", "descriptor_value": "rule-0-match-0"}},
                                    {"masked_remote_address": {"v4_prefix_mask_len": 0, "v6_prefix_mask_len": 0}}
                                ]}]
                            }}]
                        }]},
                        "http_filters": [
                            {"name": "envoy.filters.http.ratelimit", "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
                                "domain": "default/eg/http",
                                "timeout": "2s",
                                "failure_mode_deny": true,
                                "enable_x_ratelimit_headers": "DRAFT_VERSION_03",
                                "rate_limit_service": {
                                    "grpc_service": {"envoy_grpc": {"cluster_name": "ratelimit_cluster"}},
                                    "transport_api_version": "V3"
                                }
                            }},
                            {"name": "envoy.filters.http.router", "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                            }}
                        ]
                    }
                }]}]
            }],
            "clusters": [rl, cluster("upstream", upstream)]
        }
    })
}

#[tokio::test]
async fn envoy_over_tls_without_sni_returns_429_with_retry_after() {
    let redis = RedisServer::start();
    let root = tempfile::tempdir().expect("tempdir");
    let ca = EgCa::new();
    write_certs(&root.path().join("certs"), &ca.pem, &ca.server_leaf());
    write_config(root.path(), EG_CONFIG);
    let ports = Ports::new();
    let env = eg_env(root.path(), &ports, &redis);
    let (_link_dir, link) = ratelimit_link();
    let mut rls = start(&link, &env);
    wait_healthy(&mut rls, ports.http).await;

    let upstream = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .await
        .expect("bind");
    let up = upstream.local_addr().expect("addr");
    tokio::spawn(async move {
        axum::serve(upstream, axum::Router::new().fallback(|| async { "ok\n" }))
            .await
            .expect("upstream");
    });
    let envoy = Envoy::start(&eg_envoy(ports.grpc, up, &root.path().join("certs/ca.crt"))).await;
    let mut statuses = Vec::new();
    let mut last = None;
    for _ in 0..3 {
        let r = http_get(envoy.listener, "/", &[])
            .await
            .expect("GET via Envoy");
        statuses.push(r.status);
        last = Some(r);
    }
    assert_eq!(statuses, [200, 200, 429]);
    let denied = last.expect("response");
    let wait: u64 = denied
        .header("retry-after")
        .unwrap_or_else(|| panic!("no retry-after: {denied:?}"))
        .parse()
        .expect("seconds");
    assert!((1..=60).contains(&wait), "retry-after {wait}");
    // Denied by the service, not by a failed call (failure_mode_deny).
    assert_eq!(envoy.stat("cluster.upstream.ratelimit.over_limit").await, 1);
    assert_eq!(envoy.stat("cluster.upstream.ratelimit.error").await, 0);
}

#[tokio::test]
async fn the_istio_sample_and_the_go_compose_environments_start_and_serve_their_configs() {
    let redis = RedisServer::start();
    let (_link_dir, link) = ratelimit_link();
    // The Istio sample's config in its shape: a domain `ratelimit`, one
    // path limited to 1 per minute, other paths to 100 per minute.
    let istio_yaml = "\
domain: ratelimit
descriptors:
  - key: PATH
    value: \"/productpage\"
    rate_limit:
      unit: minute
      requests_per_unit: 1
  - key: PATH
    rate_limit:
      unit: minute
      requests_per_unit: 100
";
    // The compose file's: a domain with a nested rule.
    let compose_yaml = "\
domain: rl
descriptors:
  - key: category
    value: account
    rate_limit:
      unit: second
      requests_per_unit: 1
";
    let root = tempfile::tempdir().expect("tempdir");
    let data = root.path().join("data");
    let redis_url = format!("127.0.0.1:{}", redis.port());
    let common = |sub: &str| -> Vec<(String, String)> {
        [
            ("LOG_LEVEL", "debug".to_owned()),
            ("REDIS_SOCKET_TYPE", "tcp".to_owned()),
            ("REDIS_URL", redis_url.clone()),
            ("USE_STATSD", "false".to_owned()),
            ("RUNTIME_ROOT", data.to_string_lossy().into_owned()),
            ("RUNTIME_SUBDIRECTORY", sub.to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    };
    for (sub, yaml, extra, domain, entry) in [
        (
            "istio",
            istio_yaml,
            &[
                ("RUNTIME_WATCH_ROOT", "false"),
                ("RUNTIME_IGNOREDOTFILES", "true"),
                ("HOST", "::"),
                ("GRPC_HOST", "::"),
            ][..],
            "ratelimit",
            ("PATH", "/productpage"),
        ),
        (
            "compose",
            compose_yaml,
            &[("MEMCACHE_HOST_PORT", "memcached:11211")][..],
            "rl",
            ("category", "account"),
        ),
    ] {
        let dir = data.join(sub).join("config");
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("config.yaml"), yaml).expect("write");
        // A ConfigMap mount's hidden copy: skipped, not a duplicate domain.
        std::fs::create_dir_all(dir.join("..data")).expect("mkdir");
        std::fs::write(dir.join("..data/config.yaml"), yaml).expect("write");
        let ports = Ports::new();
        let mut env = common(sub);
        env.extend(ports.env());
        // The Istio sample binds every address (`::`, dual stack); the test
        // reaches it on 127.0.0.1.
        for (k, v) in extra {
            env.retain(|(name, _)| name != k);
            env.push(((*k).to_owned(), (*v).to_owned()));
        }
        let mut rls = start(&link, &env);
        wait_healthy(&mut rls, ports.http).await;
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", ports.grpc))
            .expect("endpoint")
            .connect()
            .await
            .expect("plaintext gRPC");
        let mut client = RateLimitServiceClient::new(ch);
        let mut codes = Vec::new();
        for _ in 0..2 {
            let r = client
                .should_rate_limit(req(domain, vec![desc(&[entry])], 1))
                .await
                .unwrap_or_else(|e| panic!("{sub}: {e}"))
                .into_inner();
            codes.push(r.overall_code);
        }
        assert_eq!(codes, [Code::Ok as i32, Code::OverLimit as i32], "{sub}");
        let d = http_get(ports.debug, "/rlconfig", &[])
            .await
            .expect("GET /rlconfig");
        assert!(d.body.contains(&format!("{domain}.")), "{sub}: {}", d.body);
    }
}

/// A migration from the Go service keeps its windows: started as
/// `ratelimit` with `BUCKET_RLS_DEFAULT_ALGORITHM=fixed_window` beside the
/// Go variables, every rule naming no algorithm is a fixed window. The
/// debug port's `/rlconfig` line is then the Go service's own (no
/// `burst=`), the admin `/rlconfig` names the algorithm, and a denial waits
/// for the end of the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ratelimit_entry_point_takes_the_default_algorithm_from_the_environment() {
    let (_link_dir, link) = ratelimit_link();
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("data/compose/config");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(
        dir.join("config.yaml"),
        "domain: rl\ndescriptors:\n  - key: category\n    value: account\n    rate_limit:\n      unit: year\n      requests_per_unit: 1\n",
    )
    .expect("write");
    let ports = Ports::new();
    let mut env: Vec<(String, String)> = [
        ("USE_STATSD", "false".to_owned()),
        (
            "RUNTIME_ROOT",
            root.path().join("data").to_string_lossy().into_owned(),
        ),
        ("RUNTIME_SUBDIRECTORY", "compose".to_owned()),
        ("BUCKET_RLS_DEFAULT_ALGORITHM", "fixed_window".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    env.extend(ports.env());
    let mut rls = start(&link, &env);
    wait_healthy(&mut rls, ports.http).await;
    let d = http_get(ports.debug, "/rlconfig", &[])
        .await
        .expect("GET /rlconfig");
    assert_eq!(
        d.body,
        "rl.category_account: unit=YEAR requests_per_unit=1, shadow_mode: false\n"
    );
    let j = http_get(ports.http, "/rlconfig", &[])
        .await
        .expect("GET /rlconfig");
    assert!(
        j.body.contains("\"algorithm\":\"fixed_window\""),
        "{}",
        j.body
    );
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", ports.grpc))
        .expect("endpoint")
        .connect()
        .await
        .expect("plaintext gRPC");
    let mut client = RateLimitServiceClient::new(ch);
    let mut answers = Vec::new();
    for _ in 0..2 {
        let r = client
            .should_rate_limit(req("rl", vec![desc(&[("category", "account")])], 1))
            .await
            .expect("answered")
            .into_inner();
        let wait = r.statuses[0]
            .duration_until_reset
            .as_ref()
            .map_or(0, |d| d.seconds);
        answers.push((r.overall_code, wait));
    }
    // Both waits are the time to the end of the same year's window (a
    // yearly window, so that the two calls do not straddle an edge).
    assert_eq!(answers[0].0, Code::Ok as i32);
    assert_eq!(answers[1].0, Code::OverLimit as i32);
    for (_, wait) in &answers {
        assert!((1..=31_536_000).contains(wait), "{answers:?}");
    }
    assert!(answers[1].1 <= answers[0].1, "{answers:?}");
}

#[test]
fn every_refused_variable_stops_startup_with_its_reason() {
    let (_link_dir, link) = ratelimit_link();
    for (var, value, reason) in [
        (
            "BACKEND_TYPE",
            "memcache",
            "bucket-rls keeps its buckets in Redis",
        ),
        ("USE_STATSD", "true", "statsd is not supported"),
        (
            "REDIS_PERSECOND",
            "true",
            "per-second limits is not supported",
        ),
        ("CONFIG_TYPE", "GRPC_XDS_DELTA", "is not a config type"),
        ("REDIS_SOCKET_TYPE", "unix", "only tcp is supported"),
        ("GRPC_UDS", "/run/rls.sock", "Unix socket is not supported"),
    ] {
        let mut cmd = Command::new(&link);
        cmd.env_clear().envs(Ports::new().env()).env(var, value);
        let mut proc = Proc::spawn("ratelimit", cmd);
        // It must exit by itself; one that keeps serving fails the wait.
        let deadline = std::time::Instant::now() + DEADLINE;
        let status = loop {
            if let Some(s) = proc.try_wait() {
                break s;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{var}={value} started"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let err = proc.logs();
        assert!(!status.success(), "{var}={value} exited with success");
        assert!(
            err.contains(&format!("{var}: ")) && err.contains(reason),
            "{var}={value}: {err}"
        );
    }
}

#[tokio::test]
async fn redis_over_tls_with_a_client_certificate_from_the_go_variables() {
    let dir = tempfile::tempdir().expect("tempdir");
    crate::common::tls::write_tls_files(dir.path());
    let tls_port = free_port();
    let mut args = crate::common::tls::tls_server_args(dir.path());
    // Clients must present a certificate signed by the CA.
    *args.last_mut().expect("--tls-auth-clients value") = "yes".into();
    args.extend(["--tls-port".into(), tls_port.to_string()]);
    let _redis = RedisServer::start_with(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let root = tempfile::tempdir().expect("tempdir");
    write_config(root.path(), EG_CONFIG);
    let (_link_dir, link) = ratelimit_link();
    let file = |n: &str| dir.path().join(n).to_string_lossy().into_owned();
    for with_cert in [true, false] {
        let ports = Ports::new();
        let mut env = ports.env();
        env.extend(
            [
                (
                    "RUNTIME_ROOT",
                    root.path().join("data").to_string_lossy().into_owned(),
                ),
                ("RUNTIME_SUBDIRECTORY", "ratelimit".into()),
                ("USE_STATSD", "false".into()),
                ("REDIS_SOCKET_TYPE", "tcp".into()),
                ("REDIS_URL", format!("127.0.0.1:{tls_port}")),
                ("REDIS_TLS", "true".into()),
                ("REDIS_TLS_CACERT", file("ca.crt")),
                ("REDIS_TIMEOUT", "2s".into()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v)),
        );
        if with_cert {
            // The server's certificate doubles as a client certificate.
            env.push(("REDIS_TLS_CLIENT_CERT".into(), file("server.crt")));
            env.push(("REDIS_TLS_CLIENT_KEY".into(), file("server.key")));
        }
        let mut rls = start(&link, &env);
        let grpc = ports.grpc;
        let connect = || async move {
            let ch = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
                .expect("endpoint")
                .connect()
                .await
                .ok()?;
            Some(RateLimitServiceClient::new(ch))
        };
        let (mut client, _) = eventually(DEADLINE, "the gRPC port", || {
            rls.assert_running();
            connect()
        })
        .await;
        if with_cert {
            wait_healthy(&mut rls, ports.http).await;
            let r = client
                .should_rate_limit(eg_request())
                .await
                .expect("charged in Redis over TLS")
                .into_inner();
            assert_eq!(r.overall_code, Code::Ok as i32);
        } else {
            let e = client
                .should_rate_limit(eg_request())
                .await
                .expect_err("Redis refuses a client without a certificate");
            assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
            let h = http_get(ports.http, "/healthcheck", &[])
                .await
                .expect("GET");
            assert_eq!(h.status, 500, "{}", h.body);
            assert!(
                h.body.contains("storage has not answered yet"),
                "{}",
                h.body
            );
        }
    }
}
