//! The Go service's variable names, by what happens to them.

/// Go variables accepted and ignored: they tune Go internals (pools,
/// pipelines, jitter, statsd details, the stats mapper) or ask for what
/// bucket-rls always does.
pub const IGNORED: &[&str] = &[
    "RUNTIME_IGNOREDOTFILES",
    "RUNTIME_WATCH_ROOT",
    "GRPC_SERVER_TLS_CA_CERT",
    "GRPC_MAX_CONNECTION_AGE",
    "GRPC_MAX_CONNECTION_AGE_GRACE",
    "BACKEND_TYPE",
    "REDIS_SOCKET_TYPE",
    "REDIS_POOL_SIZE",
    "REDIS_PIPELINE_WINDOW",
    "REDIS_PIPELINE_LIMIT",
    "REDIS_CLUSTER_PIPELINE_PARALLELISM",
    "REDIS_POOL_ON_EMPTY_BEHAVIOR",
    "REDIS_POOL_ON_EMPTY_WAIT_DURATION",
    "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION",
    "REDIS_STARTUP_INITIAL_INTERVAL",
    "REDIS_STARTUP_MAX_INTERVAL",
    "REDIS_STARTUP_MAX_ELAPSED_TIME",
    "REDIS_PERSECOND",
    "EXPIRATION_JITTER_MAX_SECONDS",
    "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT",
    "USE_STATSD",
    "STATSD_HOST",
    "STATSD_PORT",
    "USE_DOG_STATSD",
    "USE_DOG_STATSD_MOGRIFIERS",
    "EXTRA_TAGS",
    "STATS_FLUSH_INTERVAL",
    "DISABLE_STATS",
    "PROMETHEUS_MAPPER_YAML",
    "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS",
    "TRACING_SERVICE_NAMESPACE",
    "TRACING_SERVICE_INSTANCE_ID",
    "MEMCACHE_HOST_PORT",
    "MEMCACHE_SRV",
    "MEMCACHE_SRV_REFRESH",
    "MEMCACHE_MAX_IDLE_CONNS",
];

/// Variables of the xDS config source (`CONFIG_TYPE=GRPC_XDS_SOTW`); in
/// file mode they are not read, as in the Go service.
pub const XDS: &[&str] = &[
    "CONFIG_GRPC_XDS_SERVER_URL",
    "CONFIG_GRPC_XDS_NODE_ID",
    "CONFIG_GRPC_XDS_NODE_METADATA",
    "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
    "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",
    "CONFIG_GRPC_XDS_SERVER_USE_TLS",
    "CONFIG_GRPC_XDS_CLIENT_TLS_CERT",
    "CONFIG_GRPC_XDS_CLIENT_TLS_KEY",
    "CONFIG_GRPC_XDS_SERVER_TLS_CACERT",
    "CONFIG_GRPC_XDS_SERVER_TLS_SAN",
    "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL",
    "XDS_CLIENT_BACKOFF_MAX_INTERVAL",
    "XDS_CLIENT_BACKOFF_RANDOM_FACTOR",
    "XDS_CLIENT_BACKOFF_JITTER",
    "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES",
    "FORCE_START_WITHOUT_INITIAL_CONFIG",
];

/// Variables mapped onto `serve` flags (read by [`map_env`](super::map_env)).
pub const MAPPED: &[&str] = &[
    "CONFIG_TYPE",
    "RUNTIME_ROOT",
    "RUNTIME_SUBDIRECTORY",
    "RUNTIME_APPDIRECTORY",
    "MERGE_DOMAIN_CONFIG",
    "HOST",
    "PORT",
    "GRPC_HOST",
    "GRPC_PORT",
    "DEBUG_HOST",
    "DEBUG_PORT",
    "GRPC_SERVER_USE_TLS",
    "GRPC_SERVER_TLS_CERT",
    "GRPC_SERVER_TLS_KEY",
    "GRPC_CLIENT_TLS_CACERT",
    "GRPC_CLIENT_TLS_SAN",
    "LOG_LEVEL",
    "LOG_FORMAT",
    "REDIS_TYPE",
    "REDIS_URL",
    "REDIS_AUTH",
    "REDIS_SENTINEL_AUTH",
    "REDIS_TLS",
    "REDIS_TLS_CACERT",
    "REDIS_TLS_CLIENT_CERT",
    "REDIS_TLS_CLIENT_KEY",
    "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
    "REDIS_TIMEOUT",
    "CACHE_KEY_PREFIX",
    "LOCAL_CACHE_SIZE_IN_BYTES",
    "NEAR_LIMIT_RATIO",
    "LIMIT_RESPONSE_HEADERS_ENABLED",
    "LIMIT_LIMIT_HEADER",
    "LIMIT_REMAINING_HEADER",
    "LIMIT_RESET_HEADER",
    "SHADOW_MODE",
    "QUOTA_MODE",
    "RESPONSE_DYNAMIC_METADATA",
    "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
    "USE_PROMETHEUS",
    "PROMETHEUS_ADDR",
    "PROMETHEUS_PATH",
    "TRACING_ENABLED",
    "TRACING_SERVICE_NAME",
    "TRACING_SAMPLING_RATE",
    "TRACING_EXPORTER_PROTOCOL",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
];

/// Variables of the gRPC libraries themselves (gRPC core's and grpc-go's
/// environment: roots, tracing, resolver, xDS bootstrap, experiments),
/// inherited from a base image or a sidecar: they share the `GRPC_` prefix
/// with the Go service's settings but are none of them, so they are neither
/// mapped nor reported as unknown. Names ending in `_` are prefixes.
pub const GRPC_LIBRARY: &[&str] = &[
    "GRPC_ABORT_ON_LEAKS",
    "GRPC_ARES_",
    "GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS",
    "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH",
    "GRPC_DNS_",
    "GRPC_ENABLE_FORK_SUPPORT",
    "GRPC_EXPERIMENTAL_",
    "GRPC_EXPERIMENTS",
    "GRPC_GO_",
    "GRPC_NOT_USE_SYSTEM_SSL_ROOTS",
    "GRPC_POLL_STRATEGY",
    "GRPC_SSL_CIPHER_SUITES",
    "GRPC_STACKTRACE_MINLOGLEVEL",
    "GRPC_SYSTEM_SSL_ROOTS_DIR",
    "GRPC_TRACE",
    "GRPC_VERBOSITY",
    "GRPC_XDS_",
];

/// Whether `name` is a gRPC library variable ([`GRPC_LIBRARY`]).
#[must_use]
pub fn is_grpc_library(name: &str) -> bool {
    GRPC_LIBRARY.iter().any(|g| {
        if g.ends_with('_') {
            name.starts_with(g)
        } else {
            name == *g
        }
    })
}

/// Name prefixes of the Go service's variables: a variable with one of
/// them that is not known here is reported as unknown. Other variables
/// (`PATH`, `HOSTNAME`, `KUBERNETES_*`) are not the service's and are not
/// mentioned.
pub const FAMILIES: &[&str] = &[
    "BACKEND_",
    "CACHE_",
    "CONFIG_",
    "DEBUG_",
    "DISABLE_",
    "EXPIRATION_",
    "EXTRA_",
    "FORCE_",
    "GRPC_",
    "HEALTHY_",
    "LIMIT_",
    "LOCAL_CACHE_",
    "LOG_",
    "MEMCACHE_",
    "MERGE_",
    "NEAR_LIMIT_",
    "OTEL_",
    "PROMETHEUS_",
    "QUOTA_",
    "REDIS_",
    "RESPONSE_",
    "RUNTIME_",
    "SHADOW_",
    "STATSD_",
    "STATS_",
    "STOP_",
    "TRACING_",
    "USE_",
    "XDS_",
];
