//! bucket-rls binary: wiring only.

use anyhow::Context;
use bucket_rls::app::{self, Listeners};
use bucket_rls::cli::{Cli, Command, LogFormat, ServeArgs};
use bucket_rls::config::loader;
use bucket_rls::config::watcher::{ConfigWatcher, ReloadHandle, WatchOptions};
use bucket_rls::limiter::Limiter;
use bucket_rls::settings::ServiceSettings;
use bucket_rls::storage::Storage;
use bucket_rls::storage::memory::MemoryStorage;
use bucket_rls::storage::redis::RedisStorage;
use bucket_rls::storage::redis::cluster::RedisClusterStorage;
use bucket_rls::storage::redis::sentinel::RedisSentinelStorage;
use clap::Parser;
use std::process::ExitCode;
use std::sync::Arc;

/// jemalloc instead of glibc malloc: after a burst of distinct descriptor values
/// (1,000,000 buckets) is swept, glibc kept ~100 MiB of freed small allocations
/// resident; jemalloc's background purging returns it (BENCHMARKS.md, BR-31).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// `eprintln!` that ignores a failed write: with the reader of stderr gone
/// (`| head`, a dead log shipper) the exit code still tells the outcome,
/// instead of a panic on EPIPE.
macro_rules! report {
    ($out:expr, $($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!($out, $($arg)*);
    }};
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::CheckConfig {
            paths,
            merge_domain_config,
        } => check_config(&paths, merge_domain_config),
        Command::Loadgen(args) => match bucket_rls::loadgen::main(&args) {
            Ok(_) => ExitCode::SUCCESS,
            Err(e) => {
                report!(std::io::stderr(), "error: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Serve(args) => {
            init_tracing(&args.log_level, args.log_format);
            let rt = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => {
                    report!(
                        std::io::stderr(),
                        "error: cannot start the async runtime: {e}"
                    );
                    return ExitCode::FAILURE;
                }
            };
            match rt.block_on(serve(*args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    report!(std::io::stderr(), "error: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn check_config(paths: &[std::path::PathBuf], merge_domains: bool) -> ExitCode {
    let mut ok = true;
    let options = loader::LoadOptions { merge_domains };
    for p in paths {
        match loader::load_source_with(p, options) {
            Ok(c) => report!(
                std::io::stdout(),
                "{}: OK ({} domains, {} rules, sha256 {})",
                p.display(),
                c.domains.len(),
                c.rule_count(),
                c.hash
            ),
            Err(errs) => {
                ok = false;
                for e in errs.0 {
                    report!(std::io::stderr(), "{e}");
                }
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn init_tracing(level: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_new(level).unwrap_or_else(|e| {
        report!(
            std::io::stderr(),
            "warning: invalid --log-level '{level}' ({e}); logging at info"
        );
        tracing_subscriber::EnvFilter::new("info")
    });
    // Colours only on a terminal: log files and collectors get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        // A log line that cannot be written (the reader of stderr is gone:
        // EPIPE) is dropped. By default the subscriber reports it with
        // `eprintln!`, which panics on the same broken pipe and would take
        // down the request, the reload task or the process.
        .log_internal_errors(false);
    match format {
        LogFormat::Text => b.init(),
        LogFormat::Json => b.json().init(),
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    bucket_rls::metrics::install();
    let load = loader::LoadOptions {
        merge_domains: args.merge_domain_config,
    };
    let config = loader::load_source_with(&args.config, load)
        .map_err(|e| anyhow::anyhow!("invalid config, not starting:\n{e}"))?;
    metrics::counter!(bucket_rls::metrics::CONFIG_LOAD, "result" => "success").increment(1);
    tracing::info!(domains = config.domains.len(), rules = config.rule_count(), hash = %config.hash, "config loaded");
    let timeout = std::time::Duration::from_millis(args.redis_timeout);
    let cache_size = usize::try_from(args.local_cache_size).unwrap_or(usize::MAX);
    let topologies = usize::from(args.redis_url.is_some())
        + usize::from(!args.redis_sentinel.is_empty())
        + usize::from(!args.redis_cluster.is_empty());
    if topologies > 1 {
        anyhow::bail!("give only one of --redis-url, --redis-sentinel and --redis-cluster");
    }
    if args.redis_sentinel.is_empty()
        && (args.redis_master_username.is_some() || args.redis_master_password.is_some())
    {
        anyhow::bail!(
            "--redis-master-username and --redis-master-password apply only with --redis-sentinel"
        );
    }
    let tls_ca = match &args.redis_tls_ca_file {
        Some(ca) => {
            if topologies == 0 {
                anyhow::bail!(
                    "--redis-tls-ca-file needs a Redis backend (--redis-url, --redis-sentinel or --redis-cluster)"
                );
            }
            let pem = std::fs::read(ca)
                .with_context(|| format!("reading --redis-tls-ca-file {}", ca.display()))?;
            if !pem
                .windows(b"-----BEGIN CERTIFICATE-----".len())
                .any(|w| w == b"-----BEGIN CERTIFICATE-----")
            {
                anyhow::bail!(
                    "--redis-tls-ca-file {}: no PEM certificate (-----BEGIN CERTIFICATE-----) in it",
                    ca.display()
                );
            }
            Some(pem)
        }
        None => None,
    };
    let storage: Arc<dyn Storage> = if !args.redis_cluster.is_empty() {
        let mut builder = RedisClusterStorage::builder(args.redis_cluster.iter().cloned())
            .timeout(timeout)
            .local_cache_size(cache_size);
        if let Some(pem) = tls_ca {
            builder = builder.tls_root_ca_pem(pem);
        }
        let redis = builder.build()?;
        tracing::info!(
            nodes = redis.nodes(),
            timeout_ms = args.redis_timeout,
            "Redis Cluster backend (connecting in the background)"
        );
        Arc::new(redis)
    } else if !args.redis_sentinel.is_empty() {
        let name = args
            .redis_master_name
            .clone()
            .context("--redis-sentinel needs --redis-master-name")?;
        let mut builder = RedisSentinelStorage::builder(args.redis_sentinel.iter().cloned(), name)
            .timeout(timeout)
            .local_cache_size(cache_size)
            .master_auth(
                args.redis_master_username.clone(),
                args.redis_master_password.clone(),
            );
        if let Some(pem) = tls_ca {
            builder = builder.tls_root_ca_pem(pem);
        }
        let redis = builder.build()?;
        tracing::info!(
            sentinels = redis.sentinels(),
            timeout_ms = args.redis_timeout,
            "Redis Sentinel backend (discovering the master in the background)"
        );
        Arc::new(redis)
    } else if let Some(url) = &args.redis_url {
        let mut builder = RedisStorage::builder(url.as_str())
            .timeout(timeout)
            .local_cache_size(cache_size);
        if let Some(pem) = tls_ca {
            builder = builder.tls_root_ca_pem(pem);
        }
        let redis = builder.build()?;
        tracing::info!(
            url = redis.url(),
            timeout_ms = args.redis_timeout,
            "Redis backend (connecting in the background)"
        );
        Arc::new(redis)
    } else {
        Arc::new(MemoryStorage::with_max_buckets(
            Arc::new(bucket_rls::storage::clock::SystemClock),
            args.memory_max_buckets,
        ))
    };
    // Unlabelled series exist from startup (an alert on `== 0` has a series
    // to match); labelled ones appear with their first event.
    if topologies > 0 {
        metrics::gauge!(bucket_rls::metrics::REDIS_CIRCUIT_OPEN).increment(0.0);
        metrics::counter!(bucket_rls::metrics::REDIS_SCRIPT_RELOAD).increment(0);
        metrics::counter!(bucket_rls::metrics::LOCAL_CACHE_HITS).increment(0);
    } else {
        metrics::counter!(bucket_rls::storage::memory::EVICTIONS_METRIC).increment(0);
    }
    let settings = ServiceSettings {
        key_prefix: args.redis_key_prefix.clone(),
        on_storage_error: args.on_storage_error,
        near_limit_ratio: args.near_limit_ratio,
        max_descriptors: args.max_descriptors,
        exact_durations: args.exact_durations,
        rate_limit_headers: args.rate_limit_headers,
        header_names: bucket_rls::settings::HeaderNames {
            limit: args.limit_header_name.clone(),
            remaining: args.remaining_header_name.clone(),
            reset: args.reset_header_name.clone(),
        },
        global_shadow_mode: args.shadow_mode,
        global_quota_mode: args.quota_mode,
        response_dynamic_metadata: args.response_dynamic_metadata,
        ..ServiceSettings::default()
    };
    let limiter = Arc::new(Limiter::new(config, storage, settings));
    let grpc = tokio::net::TcpListener::bind(args.grpc_addr)
        .await
        .with_context(|| format!("binding gRPC on {}", args.grpc_addr))?;
    let http = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .with_context(|| format!("binding HTTP on {}", args.http_addr))?;
    let watcher = ConfigWatcher::spawn(
        args.config.clone(),
        limiter.config_handle().clone(),
        limiter.on_swap(),
        WatchOptions {
            load,
            ..WatchOptions::default()
        },
    );
    tokio::spawn(reload_on_sighup(watcher.reload_handle()));
    tracing::info!(grpc = %grpc.local_addr()?, http = %http.local_addr()?, backend = limiter.storage().name(), "serving");
    app::run(Listeners { grpc, http }, limiter, shutdown_signal()).await?;
    drop(watcher);
    tracing::info!("stopped");
    Ok(())
}

async fn reload_on_sighup(handle: ReloadHandle) {
    let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGHUP; reloads come from file events and the rescan only");
            return;
        }
    };
    while hup.recv().await.is_some() {
        tracing::info!("SIGHUP: reloading the config");
        handle.reload_now();
    }
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops the server");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
