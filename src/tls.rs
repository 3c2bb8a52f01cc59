//! TLS on the gRPC port, and PEM loading any TLS side can reuse.
//!
//! - [`load_certs`] / [`load_key`] read PEM files (certificate chains; PKCS#1
//!   `RSA PRIVATE KEY`, PKCS#8 or SEC1 keys) with errors naming the file.
//! - [`ServerTls`] is a rustls server config whose certificate is re-read
//!   from disk every [`RELOAD_INTERVAL`] ([`ServerTls::spawn_reloader`]): a
//!   replaced file (a Kubernetes Secret update) is used for new connections;
//!   a file that does not load keeps the certificate in force and is logged
//!   once per distinct content.
//! - With a client CA, client certificates are required and verified
//!   against it, optionally with a subject alternative name they must carry
//!   (the Go service's `GRPC_CLIENT_TLS_CACERT` and `GRPC_CLIENT_TLS_SAN`).
//! - [`incoming`] turns accepted TCP connections into TLS connections for
//!   the gRPC port ([`crate::grpc::serve`]), each handshake in its own task (bounded
//!   by [`HANDSHAKE_TIMEOUT`]) so a slow client never holds up the others.
//!
//! Handshakes need no SNI (Envoy sends none to the rate limit cluster): the
//! single certificate is presented whatever the client asks. ALPN offers
//! `h2`; a client offering no ALPN is served too.

use crate::settings::GrpcTls;
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ParsedCertificate, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{
    DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig, SignatureScheme,
};
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// How often the certificate files are read again (a replaced certificate
/// is served to new connections within this time).
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(2);

/// Longest a TLS handshake may take before the connection is closed.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Most handshakes waiting to be taken by the server; past it the accept
/// loop waits.
const PENDING_CONNECTIONS: usize = 64;

/// A TLS file that cannot be used: which file and why.
#[derive(Debug, thiserror::Error)]
#[error("{what} {}: {message}", path.display())]
pub struct TlsError {
    /// What the file is for (`gRPC server certificate`, ...).
    pub what: &'static str,
    /// The file.
    pub path: PathBuf,
    /// Why it cannot be used.
    pub message: String,
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| TlsError {
        what,
        path: path.to_owned(),
        message: e.to_string(),
    })
}

/// Parses every `CERTIFICATE` block of `pem`.
///
/// # Errors
/// A message when a block is malformed or there is none.
pub fn certs_from_pem(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("malformed PEM: {e}"))?;
    if certs.is_empty() {
        return Err("no PEM certificate (-----BEGIN CERTIFICATE-----) in it".into());
    }
    Ok(certs)
}

/// Parses the first private key of `pem`: PKCS#1 (`RSA PRIVATE KEY`, what
/// Envoy Gateway's certgen writes), PKCS#8 (`PRIVATE KEY`) or SEC1 (`EC
/// PRIVATE KEY`).
///
/// # Errors
/// A message when there is no key or it is malformed.
pub fn key_from_pem(pem: &[u8]) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => {
            "no PEM private key (RSA PRIVATE KEY, PRIVATE KEY or EC PRIVATE KEY) in it".to_owned()
        }
        e => format!("malformed PEM: {e}"),
    })
}

/// Reads a PEM certificate chain from `path`.
///
/// # Errors
/// [`TlsError`] naming `what` and `path`.
pub fn load_certs(
    what: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    certs_from_pem(&read(what, path)?).map_err(|message| TlsError {
        what,
        path: path.to_owned(),
        message,
    })
}

/// Reads a PEM private key from `path` (formats of [`key_from_pem`]).
///
/// # Errors
/// [`TlsError`] naming `what` and `path`.
pub fn load_key(what: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    key_from_pem(&read(what, path)?).map_err(|message| TlsError {
        what,
        path: path.to_owned(),
        message,
    })
}

/// A root store holding every certificate of the PEM file at `path`.
///
/// # Errors
/// [`TlsError`] when the file cannot be read or a certificate is refused.
pub fn load_roots(what: &'static str, path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in load_certs(what, path)? {
        roots.add(c).map_err(|e| TlsError {
            what,
            path: path.to_owned(),
            message: e.to_string(),
        })?;
    }
    Ok(roots)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificate and key files of the server, loaded together.
fn load_pair(cert: &Path, key: &Path, raw: (&[u8], &[u8])) -> Result<CertifiedKey, TlsError> {
    let err = |what, path: &Path, message: String| TlsError {
        what,
        path: path.to_owned(),
        message,
    };
    let chain = certs_from_pem(raw.0).map_err(|m| err("gRPC server certificate", cert, m))?;
    let der = key_from_pem(raw.1).map_err(|m| err("gRPC server key", key, m))?;
    CertifiedKey::from_der(chain, der, &provider()).map_err(|e| {
        err(
            "gRPC server key",
            key,
            format!("{e} (does it belong to the certificate?)"),
        )
    })
}

/// The server certificate in force, swapped by the reloader.
#[derive(Debug)]
struct Resolver {
    current: ArcSwap<CertifiedKey>,
    cert_path: PathBuf,
    key_path: PathBuf,
    /// Bytes of the files last read (loaded or refused), so an unchanged
    /// file is neither parsed nor logged again.
    last_seen: Mutex<(Vec<u8>, Vec<u8>)>,
}

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        // One certificate whatever the SNI (or none).
        Some(self.current.load_full())
    }
}

impl Resolver {
    /// Reads the files again; swaps the certificate when they changed and
    /// load. Returns whether a new certificate is in force.
    fn reload(&self) -> bool {
        let (cert, key) = match (
            std::fs::read(&self.cert_path),
            std::fs::read(&self.key_path),
        ) {
            (Ok(c), Ok(k)) => (c, k),
            (Err(e), _) | (_, Err(e)) => {
                tracing::debug!(error = %e, "gRPC TLS files not readable now; keeping the certificate in force");
                return false;
            }
        };
        let mut seen = self.last_seen.lock();
        if seen.0 == cert && seen.1 == key {
            return false;
        }
        let out = match load_pair(&self.cert_path, &self.key_path, (&cert, &key)) {
            Ok(ck) => {
                self.current.store(Arc::new(ck));
                tracing::info!(cert = %self.cert_path.display(), "gRPC TLS certificate reloaded");
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "new gRPC TLS files do not load; keeping the certificate in force");
                false
            }
        };
        *seen = (cert, key);
        out
    }
}

/// A client verifier that also requires a subject alternative name.
#[derive(Debug)]
struct SanVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    san: ServerName<'static>,
}

impl ClientCertVerifier for SanVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }
    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let ok = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        rustls::client::verify_server_name(&ParsedCertificate::try_from(end_entity)?, &self.san)?;
        Ok(ok)
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// TLS of the gRPC port: the rustls config and the reloadable certificate.
#[derive(Clone, Debug)]
pub struct ServerTls {
    config: Arc<ServerConfig>,
    resolver: Arc<Resolver>,
}

impl ServerTls {
    /// Loads the files of `settings`: the certificate chain and key, and the
    /// client CA when given (client certificates then required).
    ///
    /// # Errors
    /// [`TlsError`] naming the file that cannot be used.
    pub fn load(settings: &GrpcTls) -> Result<Self, TlsError> {
        let raw = (
            read("gRPC server certificate", &settings.cert_file)?,
            read("gRPC server key", &settings.key_file)?,
        );
        let ck = load_pair(&settings.cert_file, &settings.key_file, (&raw.0, &raw.1))?;
        let resolver = Arc::new(Resolver {
            current: ArcSwap::from_pointee(ck),
            cert_path: settings.cert_file.clone(),
            key_path: settings.key_file.clone(),
            last_seen: Mutex::new(raw),
        });
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError {
                what: "gRPC server certificate",
                path: settings.cert_file.clone(),
                message: e.to_string(),
            })?;
        let builder = match &settings.client_ca_file {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let what = "gRPC client CA";
                let roots = load_roots(what, ca)?;
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                        .build()
                        .map_err(|e| TlsError {
                            what,
                            path: ca.clone(),
                            message: e.to_string(),
                        })?;
                let verifier: Arc<dyn ClientCertVerifier> = match &settings.client_san {
                    None => verifier,
                    Some(san) => Arc::new(SanVerifier {
                        inner: verifier,
                        san: ServerName::try_from(san.clone()).map_err(|e| TlsError {
                            what,
                            path: ca.clone(),
                            message: format!("client SAN '{san}': {e}"),
                        })?,
                    }),
                };
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_cert_resolver(resolver.clone());
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Self {
            config: Arc::new(config),
            resolver,
        })
    }

    /// Reads the certificate files again now; `true` when a new
    /// certificate is in force (what the reloader does periodically).
    #[cfg(test)]
    #[must_use]
    fn reload_now(&self) -> bool {
        self.resolver.reload()
    }

    /// Starts the task that reads the certificate files again every `interval`; it
    /// ends when every clone of `self` is dropped.
    pub fn spawn_reloader(&self, interval: Duration) -> tokio::task::JoinHandle<()> {
        let weak: Weak<Resolver> = Arc::downgrade(&self.resolver);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(r) = weak.upgrade() else { return };
                // File reads off the async workers.
                let _ = tokio::task::spawn_blocking(move || r.reload()).await;
            }
        })
    }
}

/// A TLS connection on the gRPC port.
#[derive(Debug)]
pub struct TlsConn<S>(tokio_rustls::server::TlsStream<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for TlsConn<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for TlsConn<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected for TlsConn<S> {
    type ConnectInfo = S::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.0.get_ref().0.connect_info()
    }
}

/// Aborts the accept task when the server drops the incoming stream.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// TLS connections from `tcp` (accepted connections), for the gRPC port
/// ([`crate::grpc::serve`]). Each handshake runs in its own task and is
/// bounded by [`HANDSHAKE_TIMEOUT`]; a failed one (a plaintext client, a
/// missing or untrusted client certificate) is logged at debug level and
/// closed. Dropping the stream stops accepting.
pub fn incoming<S, T>(
    tcp: T,
    tls: &ServerTls,
) -> impl futures::Stream<Item = io::Result<TlsConn<S>>> + Send + 'static
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    T: futures::Stream<Item = io::Result<S>> + Send + 'static,
{
    use futures::StreamExt as _;
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.config.clone());
    let (tx, rx) = tokio::sync::mpsc::channel(PENDING_CONNECTIONS);
    let task = tokio::spawn(async move {
        let mut tcp = std::pin::pin!(tcp);
        while let Some(conn) = tcp.next().await {
            let Ok(conn) = conn else { continue };
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(conn)).await {
                    Ok(Ok(s)) => {
                        let _ = tx.send(TlsConn(s)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(error = %e, "gRPC TLS handshake failed"),
                    Err(_) => tracing::debug!("gRPC TLS handshake timed out"),
                }
            });
        }
    });
    let guard = AbortOnDrop(task);
    tokio_stream::wrappers::ReceiverStream::new(rx).map(move |c| {
        let _ = &guard;
        Ok(c)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf() -> (String, String) {
        let c = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).expect("cert");
        (c.cert.pem(), c.signing_key.serialize_pem())
    }

    fn files(dir: &Path, pair: &(String, String)) -> GrpcTls {
        std::fs::write(dir.join("tls.crt"), &pair.0).expect("write");
        std::fs::write(dir.join("tls.key"), &pair.1).expect("write");
        GrpcTls {
            cert_file: dir.join("tls.crt"),
            key_file: dir.join("tls.key"),
            client_ca_file: None,
            client_san: None,
        }
    }

    #[test]
    fn a_replaced_pair_is_swapped_in_and_a_bad_one_keeps_the_old() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = leaf();
        let tls = ServerTls::load(&files(dir.path(), &first)).expect("loads");
        let served = || tls.resolver.current.load().cert[0].to_vec();
        let der = |pem: &str| {
            CertificateDer::from_pem_slice(pem.as_bytes())
                .expect("pem")
                .to_vec()
        };
        assert_eq!(served(), der(&first.0));
        assert!(
            !tls.reload_now(),
            "unchanged files are not a new certificate"
        );
        let second = leaf();
        files(dir.path(), &second);
        assert!(tls.reload_now());
        assert_eq!(served(), der(&second.0));
        std::fs::write(dir.path().join("tls.crt"), "garbage").expect("write");
        assert!(!tls.reload_now());
        assert_eq!(
            served(),
            der(&second.0),
            "the bad file keeps the certificate"
        );
        // A key of another certificate is refused too.
        std::fs::write(dir.path().join("tls.crt"), &first.0).expect("write");
        assert!(!tls.reload_now());
        assert_eq!(served(), der(&second.0));
    }

    #[test]
    fn load_errors_name_the_file_and_the_reason() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b) = (leaf(), leaf());
        let mut f = files(dir.path(), &(a.0.clone(), b.1.clone()));
        let e = ServerTls::load(&f).expect_err("mismatched key");
        assert_eq!(e.what, "gRPC server key");
        assert!(e.to_string().contains("tls.key"), "{e}");
        f.cert_file = dir.path().join("missing.crt");
        let e = ServerTls::load(&f).expect_err("missing file");
        assert!(e.to_string().starts_with("gRPC server certificate "), "{e}");
        std::fs::write(dir.path().join("tls.crt"), &a.0).expect("write");
        std::fs::write(dir.path().join("tls.key"), "no key here").expect("write");
        f.cert_file = dir.path().join("tls.crt");
        let e = ServerTls::load(&f).expect_err("no key");
        assert!(e.message.contains("no PEM private key"), "{e}");
    }
}
