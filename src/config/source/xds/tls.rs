//! The client side of the TLS connection to the management server: TLS 1.2
//! and 1.3, ALPN `h2` (gRPC servers built on grpc-go refuse a TLS client that
//! does not negotiate it), the server certificate checked against the
//! built-in web roots plus the given CA, for the host of the server address
//! or an override (`CONFIG_GRPC_XDS_SERVER_TLS_SAN`), and an optional client
//! certificate. The files are read each time [`client_config`] is called: the
//! client calls it for every connection attempt, so a rotated certificate is
//! picked up on reconnect.

use super::XdsTls;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::path::Path;
use std::sync::Arc;

/// A TLS client config and the name the server must prove.
#[derive(Debug, Clone)]
pub struct ClientTls {
    /// rustls config with ALPN `h2`.
    pub config: Arc<rustls::ClientConfig>,
    /// Expected server name.
    pub server_name: ServerName<'static>,
}

/// Builds the TLS client config for `host` (reading every file now).
///
/// # Errors
/// A message naming the file that cannot be read or holds no certificate
/// or key, or a server name that is not a DNS name or IP address.
pub fn client_config(tls: &XdsTls, host: &str) -> Result<ClientTls, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(ca) = &tls.ca_cert {
        let certs = certs(ca)?;
        let (added, _) = roots.add_parsable_certificates(certs);
        if added == 0 {
            return Err(format!(
                "xDS CA file {}: no usable CA certificate",
                ca.display()
            ));
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("xDS TLS: {e}"))?
        .with_root_certificates(roots);
    let mut config = match (&tls.client_cert, &tls.client_key) {
        (Some(cert), Some(key)) => {
            let chain = certs(cert)?;
            let key = PrivateKeyDer::from_pem_file(key).map_err(|e| {
                format!("xDS client key {}: no PEM private key ({e})", key.display())
            })?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| format!("xDS client certificate {}: {e}", cert.display()))?
        }
        _ => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    let name = tls.server_name.as_deref().unwrap_or(host);
    let server_name = ServerName::try_from(name.to_owned())
        .map_err(|_| format!("xDS TLS server name '{name}' is not a DNS name or IP address"))?;
    Ok(ClientTls {
        config: Arc::new(config),
        server_name,
    })
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("xDS TLS file {}: {e}", path.display()))?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("xDS TLS file {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "xDS TLS file {}: no PEM certificate",
            path.display()
        ));
    }
    Ok(certs)
}

/// Opens a TCP connection to `addr` and runs the TLS handshake; fails when
/// the server does not agree on ALPN `h2`.
///
/// # Errors
/// The connection or handshake error.
pub async fn connect(
    tls: &ClientTls,
    host: &str,
    port: u16,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let tcp = tokio::net::TcpStream::connect((host, port)).await?;
    tcp.set_nodelay(true)?;
    let stream = tokio_rustls::TlsConnector::from(tls.config.clone())
        .connect(tls.server_name.clone(), tcp)
        .await?;
    if stream.get_ref().1.alpn_protocol() != Some(b"h2") {
        return Err(std::io::Error::other(
            "xDS server did not negotiate ALPN h2",
        ));
    }
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_name_is_the_host_unless_overridden_and_alpn_is_h2() {
        let plain = XdsTls::default();
        let c = client_config(&plain, "envoy-gateway").expect("config");
        assert_eq!(
            c.server_name,
            ServerName::try_from("envoy-gateway").expect("name")
        );
        assert_eq!(c.config.alpn_protocols, vec![b"h2".to_vec()]);
        let over = XdsTls {
            server_name: Some("envoy-gateway.envoy-gateway-system.svc".into()),
            ..XdsTls::default()
        };
        let c = client_config(&over, "10.0.0.7").expect("config");
        assert_eq!(
            c.server_name,
            ServerName::try_from("envoy-gateway.envoy-gateway-system.svc").expect("name")
        );
        let ip = client_config(&plain, "127.0.0.1").expect("config");
        assert!(matches!(ip.server_name, ServerName::IpAddress(_)));
    }

    #[test]
    fn unreadable_or_empty_files_are_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let empty = dir.path().join("ca.crt");
        std::fs::write(&empty, "not a certificate").expect("write");
        let e = client_config(
            &XdsTls {
                ca_cert: Some(empty.clone()),
                ..XdsTls::default()
            },
            "h",
        )
        .unwrap_err();
        assert!(
            e.contains(&empty.display().to_string()) && e.contains("no PEM certificate"),
            "{e}"
        );
        let missing = dir.path().join("missing.crt");
        let e = client_config(
            &XdsTls {
                client_cert: Some(missing.clone()),
                client_key: Some(missing.clone()),
                ..XdsTls::default()
            },
            "h",
        )
        .unwrap_err();
        assert!(e.contains("missing.crt"), "{e}");
    }
}
