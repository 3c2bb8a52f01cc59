//! A private CA and a server certificate for TLS tests (`rediss://`, a
//! TLS-only Redis Cluster or Sentinel setup).

/// Writes `ca.crt`, `server.crt` and `server.key` into `dir`: a private CA
/// and a server certificate for `127.0.0.1` and `localhost` signed by it
/// (also usable as the client certificate of a cluster bus). Returns the CA
/// certificate as PEM.
pub fn write_tls_files(dir: &std::path::Path) -> Vec<u8> {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    // Distinct names: with rcgen's default name on both, OpenSSL (Redis's
    // side of a TLS cluster bus) takes the server certificate for self-signed.
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "bucket-rls test CA");
    let ca_key = rcgen::KeyPair::generate().expect("key");
    let ca_cert = ca_params.self_signed(&ca_key).expect("CA");
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let srv_key = rcgen::KeyPair::generate().expect("key");
    let mut srv_params =
        rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
            .expect("params");
    srv_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "127.0.0.1");
    let srv_cert = srv_params
        .signed_by(&srv_key, &issuer)
        .expect("server cert");
    std::fs::write(dir.join("ca.crt"), ca_cert.pem()).expect("write");
    std::fs::write(dir.join("server.crt"), srv_cert.pem()).expect("write");
    std::fs::write(dir.join("server.key"), srv_key.serialize_pem()).expect("write");
    ca_cert.pem().into_bytes()
}

/// `redis-server` TLS arguments for the files of [`write_tls_files`] in
/// `dir` (client certificates not required); the caller adds `--tls-port`.
pub fn tls_server_args(dir: &std::path::Path) -> Vec<String> {
    let path = |n: &str| dir.join(n).to_string_lossy().into_owned();
    vec![
        "--tls-cert-file".into(),
        path("server.crt"),
        "--tls-key-file".into(),
        path("server.key"),
        "--tls-ca-cert-file".into(),
        path("ca.crt"),
        "--tls-auth-clients".into(),
        "no".into(),
    ]
}
