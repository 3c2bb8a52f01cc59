//! Tests of the `serve` flags and their conversion into settings.

use super::*;
use crate::cli::{Cli, Command};
use clap::Parser as _;
use std::io::Write as _;

/// `serve --config c.yaml` plus `flags`, parsed as the binary parses them.
/// The `BUCKET_RLS_*` variables are not read, so the tests do not depend
/// on the environment they run in.
fn serve_args(flags: &[&str]) -> ServeArgs {
    let argv: Vec<&str> = ["--config", "c.yaml"]
        .into_iter()
        .chain(flags.iter().copied())
        .collect();
    try_serve_args(&argv).expect("flags parse")
}

/// `serve` plus `flags` (no `--config` added), or clap's error.
fn try_serve_args(flags: &[&str]) -> Result<ServeArgs, clap::Error> {
    use clap::{CommandFactory as _, FromArgMatches as _};
    let argv = ["bucket-rls", "serve"]
        .into_iter()
        .chain(flags.iter().copied());
    let matches = Cli::command()
        .mut_subcommand("serve", |serve| {
            serve.mut_args(|arg| arg.env(None::<&'static str>))
        })
        .try_get_matches_from(argv)?;
    match Cli::from_arg_matches(&matches)?.command {
        Command::Serve(args) => Ok(*args),
        other => panic!("not serve: {other:?}"),
    }
}

fn backend(flags: &[&str]) -> Result<Backend, SetupError> {
    Backend::try_from(&serve_args(flags))
}

/// The error's message, with its sources as `main` prints them.
fn refused(flags: &[&str]) -> (SetupError, String) {
    let e = backend(flags).expect_err("must be refused");
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        msg = format!("{msg}: {s}");
        source = s.source();
    }
    (e, msg)
}

/// A file holding a PEM certificate block (only its presence is checked
/// here; parsing is the backend builder's job).
fn ca_file() -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().expect("temp file");
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])
        .expect("self-signed certificate");
    f.write_all(cert.cert.pem().as_bytes()).expect("write");
    f
}

fn redis_defaults() -> RedisOptions {
    RedisOptions {
        timeout: Duration::from_millis(50),
        local_cache_size: 100_000,
        tls_root_ca_pem: None,
        tls_client: None,
        ..RedisOptions::default()
    }
}

#[test]
fn no_redis_flag_selects_memory_with_its_bucket_cap() {
    assert_eq!(
        backend(&[]).expect("memory"),
        Backend::Memory {
            max_buckets: crate::storage::memory::DEFAULT_MAX_BUCKETS
        }
    );
    assert_eq!(
        backend(&["--memory-max-buckets", "7"]).expect("memory"),
        Backend::Memory { max_buckets: 7 }
    );
}

#[test]
fn redis_url_selects_one_node_with_the_shared_options() {
    assert_eq!(
        backend(&["--redis-url", "redis://127.0.0.1:1"]).expect("redis"),
        Backend::Redis {
            url: "redis://127.0.0.1:1".into(),
            redis: redis_defaults(),
        }
    );
    let b = backend(&[
        "--redis-url",
        "redis://127.0.0.1:1",
        "--redis-timeout",
        "250",
        "--local-cache-size",
        "0",
    ])
    .expect("redis");
    let redis = b.redis().expect("a Redis backend");
    assert_eq!(redis.timeout, Duration::from_millis(250));
    assert_eq!(redis.local_cache_size, 0);
}

#[test]
fn sentinel_needs_a_master_name_and_carries_the_master_credentials() {
    let b = backend(&[
        "--redis-sentinel",
        "127.0.0.1:1,127.0.0.1:2",
        "--redis-master-name",
        "mymaster",
        "--redis-master-username",
        "app",
        "--redis-master-password",
        "pw",
    ])
    .expect("sentinel");
    assert_eq!(
        b,
        Backend::Sentinel {
            sentinels: vec!["127.0.0.1:1".into(), "127.0.0.1:2".into()],
            master_name: "mymaster".into(),
            master_auth: MasterAuth {
                username: Some("app".into()),
                password: Some("pw".into()),
            },
            redis: redis_defaults(),
        }
    );
    let shown = format!("{b:?}");
    assert!(
        shown.contains("***") && !shown.contains("\"pw\""),
        "password in Debug: {shown}"
    );

    let (e, msg) = refused(&["--redis-sentinel", "127.0.0.1:1"]);
    assert!(matches!(e, SetupError::MissingMasterName), "{e:?}");
    assert_eq!(msg, "--redis-sentinel needs --redis-master-name");
}

#[test]
fn debug_output_shows_no_password() {
    for flags in [
        &["--redis-url", "redis://app:s3cret@127.0.0.1:1"][..],
        &["--redis-cluster", "redis://:s3cret@127.0.0.1:1,127.0.0.1:2"][..],
        &[
            "--redis-sentinel",
            "redis://:s3cret@127.0.0.1:1",
            "--redis-master-name",
            "m",
            "--redis-master-password",
            "s3cret",
        ][..],
    ] {
        let shown = format!("{:?}", backend(flags).expect("backend"));
        assert!(
            shown.contains("***") && !shown.contains("s3cret"),
            "{flags:?}: {shown}"
        );
    }
}

#[test]
fn cluster_seed_nodes_are_split_at_commas() {
    assert_eq!(
        backend(&["--redis-cluster", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"]).expect("cluster"),
        Backend::Cluster {
            nodes: vec![
                "127.0.0.1:1".into(),
                "127.0.0.1:2".into(),
                "127.0.0.1:3".into()
            ],
            redis: redis_defaults(),
        }
    );
}

#[test]
fn two_topologies_are_refused_whichever_pair() {
    for flags in [
        &[
            "--redis-url",
            "redis://127.0.0.1:1",
            "--redis-cluster",
            "127.0.0.1:2",
        ][..],
        &[
            "--redis-cluster",
            "127.0.0.1:2",
            "--redis-sentinel",
            "127.0.0.1:3",
        ][..],
        &[
            "--redis-url",
            "redis://127.0.0.1:1",
            "--redis-sentinel",
            "127.0.0.1:3",
        ][..],
    ] {
        let (e, msg) = refused(flags);
        assert!(matches!(e, SetupError::ManyTopologies), "{flags:?}: {e:?}");
        assert_eq!(
            msg,
            "give only one of --redis-url, --redis-sentinel and --redis-cluster"
        );
    }
}

#[test]
fn master_credentials_without_sentinel_are_refused() {
    for flags in [
        &["--redis-master-password", "pw"][..],
        &[
            "--redis-url",
            "redis://127.0.0.1:1",
            "--redis-master-username",
            "u",
        ][..],
        &[
            "--redis-cluster",
            "127.0.0.1:1",
            "--redis-master-password",
            "pw",
        ][..],
    ] {
        let (e, msg) = refused(flags);
        assert!(
            matches!(e, SetupError::MasterAuthWithoutSentinel),
            "{flags:?}: {e:?}"
        );
        assert_eq!(
            msg,
            "--redis-master-username and --redis-master-password apply only with --redis-sentinel"
        );
    }
}

#[test]
fn a_ca_file_without_redis_is_refused_before_it_is_read() {
    let (e, msg) = refused(&["--redis-tls-ca-file", "/nonexistent/ca.pem"]);
    assert!(matches!(e, SetupError::TlsCaWithoutRedis), "{e:?}");
    assert_eq!(
        msg,
        "--redis-tls-ca-file needs a Redis backend (--redis-url, --redis-sentinel or --redis-cluster)"
    );
}

#[test]
fn an_unreadable_ca_file_is_named_with_the_reason() {
    let dir = tempfile::tempdir().expect("temp dir");
    let missing = dir.path().join("missing.pem");
    let path = missing.to_str().expect("utf-8 path");
    let (e, msg) = refused(&[
        "--redis-url",
        "rediss://127.0.0.1:1",
        "--redis-tls-ca-file",
        path,
    ]);
    assert!(
        matches!(&e, SetupError::TlsCaRead { path: p, source } if *p == missing && source.kind() == std::io::ErrorKind::NotFound),
        "{e:?}"
    );
    assert!(
        msg.starts_with(&format!("reading --redis-tls-ca-file {path}: ")),
        "{msg}"
    );
}

#[test]
fn a_ca_file_without_a_certificate_is_refused() {
    let mut f = tempfile::NamedTempFile::new().expect("temp file");
    f.write_all(b"not a certificate\n").expect("write");
    let path = f.path().to_str().expect("utf-8 path");
    let (e, msg) = refused(&[
        "--redis-url",
        "rediss://127.0.0.1:1",
        "--redis-tls-ca-file",
        path,
    ]);
    assert!(matches!(e, SetupError::TlsCaNoCertificate { .. }), "{e:?}");
    assert_eq!(
        msg,
        format!(
            "--redis-tls-ca-file {path}: no PEM certificate (-----BEGIN CERTIFICATE-----) in it"
        )
    );
}

#[test]
fn a_ca_file_is_read_for_every_redis_topology() {
    let ca = ca_file();
    let pem = std::fs::read(ca.path()).expect("read");
    let path = ca.path().to_str().expect("utf-8 path");
    for flags in [
        &["--redis-url", "rediss://127.0.0.1:1"][..],
        &["--redis-cluster", "rediss://127.0.0.1:1"][..],
        &[
            "--redis-sentinel",
            "rediss://127.0.0.1:1",
            "--redis-master-name",
            "m",
        ][..],
    ] {
        let flags: Vec<&str> = flags
            .iter()
            .copied()
            .chain(["--redis-tls-ca-file", path])
            .collect();
        let b = backend(&flags).expect("backend");
        assert_eq!(
            b.redis().and_then(|r| r.tls_root_ca_pem.as_deref()),
            Some(pem.as_slice()),
            "{flags:?}"
        );
    }
}

#[test]
fn the_checks_run_in_a_fixed_order() {
    // Two topologies win over credentials without Sentinel and a CA file.
    let (e, _) = refused(&[
        "--redis-url",
        "redis://127.0.0.1:1",
        "--redis-cluster",
        "127.0.0.1:2",
        "--redis-master-password",
        "pw",
    ]);
    assert!(matches!(e, SetupError::ManyTopologies), "{e:?}");
    // The CA file is checked before the missing master name.
    let (e, _) = refused(&[
        "--redis-sentinel",
        "127.0.0.1:1",
        "--redis-tls-ca-file",
        "/nonexistent/ca.pem",
    ]);
    assert!(matches!(e, SetupError::TlsCaRead { .. }), "{e:?}");
}

#[test]
fn service_settings_take_the_request_path_flags() {
    let s = Settings::try_from(&serve_args(&[
        "--grpc-addr",
        "127.0.0.1:9001",
        "--http-addr",
        "127.0.0.1:9002",
        "--redis-key-prefix",
        "t:",
        "--on-storage-error",
        "deny",
        "--near-limit-ratio",
        "0.5",
        "--max-descriptors",
        "3",
        "--exact-durations",
        "--rate-limit-headers",
        "ietf",
        "--max-debt-bursts",
        "2",
    ]))
    .expect("settings");
    assert_eq!(s.config, ConfigSource::File(PathBuf::from("c.yaml")));
    assert_eq!(s.grpc_addr, "127.0.0.1:9001".parse().expect("addr"));
    assert_eq!(s.http_addr, "127.0.0.1:9002".parse().expect("addr"));
    assert_eq!(s.service.key_prefix, "t:");
    assert_eq!(s.service.on_storage_error, OnStorageError::Deny);
    assert!((s.service.near_limit_ratio - 0.5).abs() < f64::EPSILON);
    assert_eq!(s.service.max_descriptors, 3);
    assert!(s.service.exact_durations);
    assert_eq!(s.service.max_debt_bursts, 2);
    assert_eq!(
        s.service.rate_limit_headers,
        crate::settings::RateLimitHeaders::Ietf
    );
    // Not a flag: the library default.
    assert_eq!(
        s.service.max_entries,
        ServiceSettings::default().max_entries
    );
}

#[test]
fn default_flags_give_the_default_service_settings() {
    let s = ServiceSettings::from(&serve_args(&[]));
    let d = ServiceSettings::default();
    assert_eq!(s.key_prefix, d.key_prefix);
    assert_eq!(s.on_storage_error, d.on_storage_error);
    assert!((s.near_limit_ratio - d.near_limit_ratio).abs() < f64::EPSILON);
    assert_eq!(s.max_descriptors, d.max_descriptors);
    assert_eq!(s.exact_durations, d.exact_durations);
    assert_eq!(s.rate_limit_headers, d.rate_limit_headers);
    assert_eq!(s.header_names, d.header_names);
    assert!(!s.global_shadow_mode && !s.global_quota_mode && !s.response_dynamic_metadata);
    assert_eq!((s.max_debt_bursts, d.max_debt_bursts), (0, 0));
    assert!(!s.rlqs_deny_unmatched && !d.rlqs_deny_unmatched);
    let s = ServiceSettings::from(&serve_args(&["--rlqs-unmatched", "deny"]));
    assert!(s.rlqs_deny_unmatched);
}

#[test]
fn go_mode_flags_reach_the_service_settings() {
    let args = serve_args(&[
        "--shadow-mode",
        "--quota-mode",
        "--response-dynamic-metadata",
        "--merge-domain-config",
        "--rate-limit-headers",
        "go",
        "--limit-header-name",
        "X-Limit",
    ]);
    let s = ServiceSettings::from(&args);
    assert!(s.global_shadow_mode && s.global_quota_mode && s.response_dynamic_metadata);
    assert_eq!(s.rate_limit_headers, crate::settings::RateLimitHeaders::Go);
    assert_eq!(s.header_names.limit, "X-Limit");
    assert_eq!(s.header_names.reset, "RateLimit-Reset");
    assert!(Settings::try_from(&args).unwrap().load.merge_domains);
    let bad = Cli::try_parse_from([
        "bucket-rls",
        "serve",
        "--config",
        "c.yaml",
        "--limit-header-name",
        "bad name",
    ]);
    assert!(
        bad.unwrap_err()
            .to_string()
            .contains("is not a header name")
    );
}

#[test]
fn config_xds_flags_become_xds_settings() {
    use crate::config::source::xds::XdsTls;
    let args = try_serve_args(&[
        "--config-xds",
        "envoy-gateway:18001",
        "--config-xds-node-id",
        "envoy-ratelimit",
        "--config-xds-node-metadata",
        "zone=a",
        "--config-xds-headers",
        "X-Token:t",
        "--config-xds-tls-cert",
        "/certs/tls.crt",
        "--config-xds-tls-key",
        "/certs/tls.key",
        "--config-xds-tls-ca",
        "/certs/ca.crt",
        "--config-xds-backoff-initial-ms",
        "100",
        "--config-xds-max-message-bytes",
        "8388608",
        "--config-xds-wait-for-config",
    ])
    .expect("flags parse");
    let Ok(Settings {
        config: ConfigSource::Xds(x),
        ..
    }) = Settings::try_from(&args)
    else {
        panic!("not xDS settings");
    };
    assert_eq!(x.node_id, "envoy-ratelimit");
    assert_eq!(x.node_metadata, vec![("zone".into(), "a".into())]);
    assert_eq!(x.headers, vec![("x-token".into(), "t".into())]);
    assert_eq!(
        x.tls,
        Some(XdsTls {
            client_cert: Some("/certs/tls.crt".into()),
            client_key: Some("/certs/tls.key".into()),
            ca_cert: Some("/certs/ca.crt".into()),
            server_name: None,
        })
    );
    assert_eq!(x.backoff.initial, Duration::from_millis(100));
    assert_eq!(x.max_message_bytes, 8 << 20);
    assert!(!x.start_without_config);
    // Plaintext unless a TLS flag or https:// asks for TLS.
    let args = try_serve_args(&["--config-xds", "127.0.0.1:18000"]).expect("flags parse");
    let Ok(Settings {
        config: ConfigSource::Xds(x),
        ..
    }) = Settings::try_from(&args)
    else {
        panic!("not xDS settings");
    };
    assert_eq!(x.tls, None);
    assert!(x.start_without_config);
}

#[test]
fn config_and_config_xds_are_exclusive_and_one_is_required() {
    assert!(try_serve_args(&["--config", "c.yaml", "--config-xds", "h:1"]).is_err());
    assert!(try_serve_args(&[]).is_err());
    let args =
        try_serve_args(&["--config", "c.yaml", "--config-xds-node-id", "x"]).expect("flags parse");
    let e = Settings::try_from(&args).unwrap_err().to_string();
    assert!(e.contains("--config-xds-node-id needs --config-xds"), "{e}");
    let args = try_serve_args(&["--config-xds", "no-port"]).expect("flags parse");
    let e = Settings::try_from(&args).unwrap_err().to_string();
    assert!(e.contains("host:port"), "{e}");
}

/// `--default-algorithm` sets the algorithm of every rule naming none (the
/// loader's options) and of overrides (the service settings); an unknown
/// name is refused listing the names.
#[test]
fn the_default_algorithm_reaches_the_loader_and_the_overrides() {
    use crate::storage::AlgorithmKind;
    let d = Settings::try_from(&serve_args(&[])).expect("settings");
    assert_eq!(d.load.default_algorithm, AlgorithmKind::TokenBucket);
    assert_eq!(d.service.default_algorithm, AlgorithmKind::TokenBucket);
    let s = Settings::try_from(&serve_args(&["--default-algorithm", "fixed_window"]))
        .expect("settings");
    assert_eq!(s.load.default_algorithm, AlgorithmKind::FixedWindow);
    assert_eq!(s.service.default_algorithm, AlgorithmKind::FixedWindow);
    let e = try_serve_args(&["--config", "c.yaml", "--default-algorithm", "leaky"])
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("leaky") && e.contains("token_bucket") && e.contains("fixed_window"),
        "{e}"
    );
}

#[test]
fn a_cluster_key_prefix_with_a_brace_needs_a_whole_hash_tag() {
    for prefix in ["rls{", "rls}", "rls{}:", "a}b{", "x}{"] {
        let (e, msg) = refused(&[
            "--redis-cluster",
            "127.0.0.1:2",
            "--redis-key-prefix",
            prefix,
        ]);
        assert!(
            matches!(e, SetupError::ClusterKeyPrefix(_)),
            "{prefix}: {e:?}"
        );
        assert!(msg.contains(prefix) && msg.contains("hash tag"), "{msg}");
    }
    for prefix in ["rls:", "rls:{limits}:", "}{t}", ""] {
        backend(&[
            "--redis-cluster",
            "127.0.0.1:2",
            "--redis-key-prefix",
            prefix,
        ])
        .unwrap_or_else(|e| panic!("{prefix:?} refused: {e}"));
    }
    // Without Cluster there are no slots: any prefix will do.
    backend(&[
        "--redis-url",
        "redis://127.0.0.1:1",
        "--redis-key-prefix",
        "rls{",
    ])
    .expect("single node");
}
