//! Tests of the Go environment mapping.

use super::*;
use crate::settings::{Backend, HealthMode, MasterAuth, Settings};

fn env(pairs: &[(&str, &str)]) -> Env {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn settings(pairs: &[(&str, &str)]) -> Settings {
    let (args, _) = serve_args(&env(pairs)).expect("maps");
    Settings::try_from(&args).expect("settings")
}

/// The variables Envoy Gateway sets in file mode (its xDS variables
/// left aside), with Redis and Prometheus.
const EG: &[(&str, &str)] = &[
    ("RUNTIME_ROOT", "/data"),
    ("RUNTIME_SUBDIRECTORY", "ratelimit"),
    ("RUNTIME_IGNOREDOTFILES", "true"),
    ("RUNTIME_WATCH_ROOT", "false"),
    ("LOG_LEVEL", "info"),
    ("USE_STATSD", "false"),
    ("GRPC_SERVER_USE_TLS", "true"),
    ("GRPC_SERVER_TLS_CERT", "/certs/tls.crt"),
    ("GRPC_SERVER_TLS_KEY", "/certs/tls.key"),
    ("GRPC_SERVER_TLS_CA_CERT", "/certs/ca.crt"),
    ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
    ("REDIS_SOCKET_TYPE", "tcp"),
    ("REDIS_URL", "redis.redis-system.svc.cluster.local:6379"),
    ("USE_PROMETHEUS", "true"),
    ("PROMETHEUS_ADDR", ":19001"),
    ("PROMETHEUS_MAPPER_YAML", "/etc/statsd-exporter/conf.yaml"),
    ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
];

#[test]
fn envoy_gateways_xds_environment_gives_mtls_xds_settings_with_go_defaults() {
    use crate::config::source::xds::{Backoff, XdsTls};
    use std::time::Duration;
    let mut vars = EG.to_vec();
    vars.extend([
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/certs/tls.crt"),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "/certs/tls.key"),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/certs/ca.crt"),
    ]);
    let s = settings(&vars);
    let crate::settings::ConfigSource::Xds(x) = &s.config else {
        panic!("not xDS: {:?}", s.config);
    };
    assert_eq!(x.host_port().unwrap(), ("envoy-gateway".into(), 18001));
    assert_eq!(x.node_id, "envoy-ratelimit");
    assert!(
        x.start_without_config,
        "FORCE_START_WITHOUT_INITIAL_CONFIG=true"
    );
    assert_eq!(
        x.tls,
        Some(XdsTls {
            client_cert: Some("/certs/tls.crt".into()),
            client_key: Some("/certs/tls.key".into()),
            ca_cert: Some("/certs/ca.crt".into()),
            server_name: None,
        })
    );
    // The Go service's defaults.
    assert_eq!(
        x.backoff,
        Backoff {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(60),
            jitter: 0.5
        }
    );
    assert_eq!(x.max_message_bytes, 4 << 20);
}

#[test]
fn go_xds_variables_for_metadata_headers_backoff_and_size_are_read() {
    use crate::config::source::xds::Backoff;
    use std::time::Duration;
    let s = settings(&[
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_NODE_METADATA", "zone=a,broken,team=rl"),
        (
            "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
            "X-Token:abc,x-env:prod",
        ),
        ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "250ms"),
        ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "1m30s"),
        ("XDS_CLIENT_BACKOFF_JITTER", "false"),
        ("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", "16777216"),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "false"),
    ]);
    let crate::settings::ConfigSource::Xds(x) = &s.config else {
        panic!("not xDS: {:?}", s.config);
    };
    assert_eq!(x.server, "localhost:18000");
    assert_eq!(x.node_id, "default");
    assert_eq!(
        x.node_metadata,
        vec![("zone".into(), "a".into()), ("team".into(), "rl".into())]
    );
    assert_eq!(
        x.headers,
        vec![
            ("x-token".into(), "abc".into()),
            ("x-env".into(), "prod".into())
        ]
    );
    assert_eq!(
        x.backoff,
        Backoff {
            initial: Duration::from_millis(250),
            max: Duration::from_secs(90),
            jitter: 0.0
        }
    );
    assert_eq!(x.max_message_bytes, 16 << 20);
    assert!(
        !x.start_without_config,
        "the Go default waits for the first config"
    );
    assert_eq!(x.tls, None);
    for (k, v) in [
        ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "ten"),
        ("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", "0"),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "yes please"),
        ("XDS_CLIENT_BACKOFF_RANDOM_FACTOR", "2"),
    ] {
        let e = serve_args(&env(&[("CONFIG_TYPE", "GRPC_XDS_SOTW"), (k, v)])).unwrap_err();
        assert_eq!(e.var, k, "{e}");
    }
}

#[test]
fn the_startup_log_hides_xds_header_values_and_endpoint_passwords() {
    let (_, m) = serve_args(&env(&[
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        (
            "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
            "authorization:Bearer SECRET1,x-api-key:SECRET2",
        ),
        ("TRACING_ENABLED", "true"),
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://user:SECRET3@127.0.0.1:4318",
        ),
    ]))
    .expect("maps");
    let shown = m.shown();
    for secret in ["SECRET1", "SECRET2", "SECRET3"] {
        assert!(!shown.contains(secret), "{shown}");
    }
    assert!(
        shown.contains("--config-xds-headers 'authorization:***,x-api-key:***'"),
        "{shown}"
    );
    assert!(
        shown.contains("--otlp-endpoint 'http://user:***@127.0.0.1:4318'"),
        "{shown}"
    );
}

#[test]
fn go_tracing_variables_turn_otlp_export_on_or_off() {
    let on = settings(&[
        ("TRACING_ENABLED", "true"),
        ("TRACING_SERVICE_NAME", "rl"),
        ("TRACING_SAMPLING_RATE", "0.25"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318"),
    ]);
    assert_eq!(
        on.tracing,
        crate::otel::TracingSettings {
            otlp_endpoint: Some("http://collector:4318".into()),
            service_name: "rl".into(),
            sampling_rate: 0.25,
        }
    );
    let off = settings(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")]);
    assert_eq!(
        off.tracing.otlp_endpoint, None,
        "TRACING_ENABLED unset: off"
    );
}

#[test]
fn envoy_gateways_environment_gives_the_same_settings_as_the_flags() {
    let from_env = settings(EG);
    let cli = Cli::try_parse_from([
        "bucket-rls",
        "serve",
        "--config",
        "/data/ratelimit/config",
        "--grpc-addr",
        "0.0.0.0:8081",
        "--http-addr",
        "0.0.0.0:8080",
        "--debug-addr",
        "0.0.0.0:6070",
        "--grpc-tls-cert",
        "/certs/tls.crt",
        "--grpc-tls-key",
        "/certs/tls.key",
        "--redis-url",
        "redis://redis.redis-system.svc.cluster.local:6379",
        "--health-mode",
        "go",
        "--go-metrics-addr",
        "0.0.0.0:19001",
    ])
    .expect("flags");
    let Command::Serve(args) = cli.command else {
        panic!("serve")
    };
    let from_flags = Settings::try_from(&*args).expect("settings");
    assert_eq!(format!("{from_env:?}"), format!("{from_flags:?}"));
    assert_eq!(
        from_env.health,
        HealthMode::Go {
            require_config: false
        }
    );
}

#[test]
fn ipv6_any_hosts_are_bracketed_as_istio_sets_them() {
    let s = settings(&[("HOST", "::"), ("GRPC_HOST", "::"), ("DEBUG_PORT", "7000")]);
    assert_eq!(s.http_addr, "[::]:8080".parse().expect("addr"));
    assert_eq!(s.grpc_addr, "[::]:8081".parse().expect("addr"));
    assert_eq!(s.debug_addr, Some("0.0.0.0:7000".parse().expect("addr")));
    assert_eq!(
        s.config,
        crate::settings::ConfigSource::File(PathBuf::from("/srv/runtime_data/current/config"))
    );
}

#[test]
fn go_durations_become_milliseconds() {
    assert_eq!(go_duration_ms("10s"), Ok(10_000));
    assert_eq!(go_duration_ms("250ms"), Ok(250));
    assert_eq!(go_duration_ms("1.5s"), Ok(1_500));
    assert_eq!(go_duration_ms("1m30s"), Ok(90_000));
    assert_eq!(go_duration_ms("500us"), Ok(1));
    assert!(go_duration_ms("10").is_err());
    assert!(go_duration_ms("ten seconds").is_err());
    let s = settings(&[("REDIS_URL", "h:1"), ("REDIS_TIMEOUT", "2s")]);
    assert_eq!(
        s.backend.redis().expect("redis").timeout,
        std::time::Duration::from_millis(2_000)
    );
    let e = serve_args(&env(&[("REDIS_URL", "h:1"), ("REDIS_TIMEOUT", "2h")])).unwrap_err();
    assert_eq!(e.var, "REDIS_TIMEOUT", "{e}");
}

#[test]
fn logrus_level_names_map_onto_log_levels() {
    for (go, ours) in [
        ("WARNING", "warn"),
        ("Info", "info"),
        ("fatal", "error"),
        ("panic", "error"),
        ("trace", "trace"),
    ] {
        let (args, _) = serve_args(&env(&[("LOG_LEVEL", go)])).expect("maps");
        assert_eq!(args.log_level, ours, "{go}");
    }
    let (args, _) = serve_args(&env(&[])).expect("maps");
    assert_eq!(args.log_level, "warn", "the Go default");
    assert_eq!(
        serve_args(&env(&[("LOG_LEVEL", "verbose")]))
            .unwrap_err()
            .var,
        "LOG_LEVEL"
    );
}

#[test]
fn redis_types_map_onto_the_three_topologies_with_credentials() {
    let s = settings(&[
        ("REDIS_URL", "h:1"),
        ("REDIS_AUTH", "u:p@ss"),
        ("REDIS_TLS", "true"),
    ]);
    assert!(
        matches!(&s.backend, Backend::Redis { url, .. } if url == "rediss://u:p%40ss@h:1"),
        "{:?}",
        s.backend
    );
    let s = settings(&[
        ("REDIS_TYPE", "sentinel"),
        ("REDIS_URL", "mymaster,s1:26379,s2:26379"),
        ("REDIS_AUTH", "pw"),
        ("REDIS_SENTINEL_AUTH", "spw"),
    ]);
    match &s.backend {
        Backend::Sentinel {
            sentinels,
            master_name,
            master_auth,
            ..
        } => {
            assert_eq!(
                sentinels,
                &["redis://:spw@s1:26379", "redis://:spw@s2:26379"]
            );
            assert_eq!(master_name, "mymaster");
            assert_eq!(
                master_auth,
                &MasterAuth {
                    username: None,
                    password: Some("pw".into())
                }
            );
        }
        b => panic!("{b:?}"),
    }
    let s = settings(&[("REDIS_TYPE", "CLUSTER"), ("REDIS_URL", "a:1, b:2")]);
    assert!(
        matches!(&s.backend, Backend::Cluster { nodes, .. } if nodes == &["redis://a:1", "redis://b:2"]),
        "{:?}",
        s.backend
    );
    assert_eq!(
        serve_args(&env(&[("REDIS_URL", "a:1,b:2")]))
            .unwrap_err()
            .var,
        "REDIS_URL"
    );
    assert_eq!(
        serve_args(&env(&[("REDIS_TYPE", "sentinel"), ("REDIS_URL", "m")]))
            .unwrap_err()
            .var,
        "REDIS_URL"
    );
}

#[test]
fn feature_variables_reach_the_same_settings_as_their_flags() {
    let s = settings(&[
        ("SHADOW_MODE", "true"),
        ("QUOTA_MODE", "1"),
        ("RESPONSE_DYNAMIC_METADATA", "True"),
        ("MERGE_DOMAIN_CONFIG", "t"),
        ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
        ("LIMIT_REMAINING_HEADER", "X-Left"),
        ("NEAR_LIMIT_RATIO", "0.5"),
        ("CACHE_KEY_PREFIX", ""),
        ("REDIS_URL", "h:1"),
        ("LOCAL_CACHE_SIZE_IN_BYTES", "1280"),
        ("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", "true"),
        ("PROMETHEUS_PATH", "/m"),
        ("USE_PROMETHEUS", "true"),
    ]);
    let v = &s.service;
    assert!(v.global_shadow_mode && v.global_quota_mode && v.response_dynamic_metadata);
    assert!(s.load.merge_domains);
    assert_eq!(v.rate_limit_headers, crate::settings::RateLimitHeaders::Go);
    assert_eq!(v.header_names.remaining, "X-Left");
    assert_eq!(v.header_names.limit, "RateLimit-Limit");
    assert!((v.near_limit_ratio - 0.5).abs() < f64::EPSILON);
    assert_eq!(v.key_prefix, "");
    assert_eq!(s.backend.redis().expect("redis").local_cache_size, 10);
    assert_eq!(
        s.health,
        HealthMode::Go {
            require_config: true
        }
    );
    let g = s.go_metrics.expect("prometheus");
    assert_eq!(
        (g.addr, g.path.as_str()),
        ("0.0.0.0:9090".parse().expect("addr"), "/m")
    );
}

#[test]
fn every_refused_variable_gives_its_reason() {
    for (pairs, var, why) in [
        (
            &[("BACKEND_TYPE", "memcache")][..],
            "BACKEND_TYPE",
            "keeps its buckets in Redis",
        ),
        (
            &[("USE_STATSD", "true")][..],
            "USE_STATSD",
            "statsd is not supported",
        ),
        (
            &[("REDIS_PERSECOND", "true")][..],
            "REDIS_PERSECOND",
            "per-second",
        ),
        (&[("GRPC_UDS", "/tmp/s")][..], "GRPC_UDS", "Unix socket"),
        (
            &[("REDIS_SOCKET_TYPE", "unix")][..],
            "REDIS_SOCKET_TYPE",
            "only tcp",
        ),
        (
            &[("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", "true")][..],
            "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
            "REDIS_TLS_CACERT",
        ),
        (
            &[
                ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
                ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "soon"),
            ][..],
            "XDS_CLIENT_BACKOFF_MAX_INTERVAL",
            "not a duration",
        ),
        (
            &[
                ("TRACING_ENABLED", "true"),
                ("TRACING_EXPORTER_PROTOCOL", "grpc"),
            ][..],
            "TRACING_EXPORTER_PROTOCOL",
            "OTLP/HTTP",
        ),
        (
            &[("REDIS_TYPE", "ring")][..],
            "REDIS_TYPE",
            "SINGLE, SENTINEL or CLUSTER",
        ),
        (
            &[("GRPC_SERVER_USE_TLS", "true")][..],
            "GRPC_SERVER_TLS_CERT",
            "needs",
        ),
        (
            &[("SHADOW_MODE", "yes")][..],
            "SHADOW_MODE",
            "not a boolean",
        ),
        (
            &[("NEAR_LIMIT_RATIO", "2")][..],
            "NEAR_LIMIT_RATIO",
            "not between 0 and 1",
        ),
    ] {
        let mut e = env(pairs);
        // The variables that a refusal depends on.
        if var == "REDIS_TYPE" {
            e.insert("REDIS_URL".into(), "h:1".into());
        }
        let err = serve_args(&e).unwrap_err();
        assert_eq!(err.var, var, "{pairs:?}: {err}");
        assert!(err.reason.contains(why), "{pairs:?}: {err}");
    }
}

#[test]
fn the_logged_flags_show_no_password() {
    for pairs in [
        &[("REDIS_URL", "h:1"), ("REDIS_AUTH", "s3cret")][..],
        &[
            ("REDIS_TYPE", "SENTINEL"),
            ("REDIS_URL", "m,h:1"),
            ("REDIS_AUTH", "u:s3cret"),
            ("REDIS_SENTINEL_AUTH", "s3cret"),
        ][..],
    ] {
        let m = map_env(&env(pairs)).expect("maps");
        let shown = m.shown();
        assert!(
            !shown.contains("s3cret") && shown.contains("***"),
            "{shown}"
        );
    }
}

#[test]
fn tuning_and_xds_variables_are_ignored_and_unknown_ones_named() {
    let (_, m) = serve_args(&env(&[
        ("REDIS_POOL_SIZE", "20"),
        ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
        ("MEMCACHE_HOST_PORT", "memcached:11211"),
        ("REDIS_NO_SUCH_THING", "1"),
        ("GRPC_NO_SUCH_THING", "1"),
        ("PATH", "/bin"),
        // gRPC libraries' own variables, inherited from an image.
        ("GRPC_DEFAULT_SSL_ROOTS_FILE_PATH", "/etc/ssl/roots.pem"),
        ("GRPC_TRACE", "all"),
        ("GRPC_GO_LOG_SEVERITY_LEVEL", "info"),
        ("GRPC_XDS_BOOTSTRAP", "/etc/bootstrap.json"),
    ]))
    .expect("maps");
    assert_eq!(
        m.ignored,
        [
            "CONFIG_GRPC_XDS_SERVER_URL",
            "MEMCACHE_HOST_PORT",
            "REDIS_POOL_SIZE"
        ]
    );
    assert_eq!(m.unknown, ["GRPC_NO_SUCH_THING", "REDIS_NO_SUCH_THING"]);
}

#[test]
fn the_startup_line_is_a_command_that_can_be_pasted() {
    let (_, m) = serve_args(&env(&[
        ("REDIS_URL", "127.0.0.1:6379"),
        ("TRACING_ENABLED", "false"),
        ("LOG_LEVEL", "debug"),
    ]))
    .expect("maps");
    let shown = m.shown();
    assert!(shown.starts_with("bucket-rls serve "), "{shown}");
    // Tracing off is an empty endpoint: a quoted empty word, not two spaces.
    assert!(shown.contains("--otlp-endpoint '' "), "{shown}");
    assert!(!shown.contains("  "), "{shown}");
    assert_eq!(super::shell_word("a b"), "'a b'");
    assert_eq!(super::shell_word("it's"), "'it'\\''s'");
    assert_eq!(super::shell_word("redis://h:6379/0"), "redis://h:6379/0");
    assert_eq!(super::shell_word("***"), "'***'");
}
