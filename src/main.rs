//! bucket-rls binary: parse the command line, start logging, call the
//! library, turn the outcome into an exit code.

use anyhow::Context;
use bucket_rls::app::{self, Listeners};
use bucket_rls::cli::{Cli, Command, LogFormat, ServeArgs};
use bucket_rls::config::loader;
use bucket_rls::settings::{ConfigSource, Settings};
use clap::Parser;
use std::process::ExitCode;

/// jemalloc instead of glibc malloc: after a burst of distinct descriptor values
/// (1,000,000 buckets) is swept, glibc kept ~100 MiB of freed small allocations
/// resident; jemalloc's background purging returns it (BENCHMARKS.md).
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

/// Whether the process was started as `ratelimit` (the Go service's binary
/// name, `/bin/ratelimit` in the image) with no arguments.
fn started_as_go_service() -> bool {
    let mut args = std::env::args_os();
    let name = args.next().map(std::path::PathBuf::from);
    let base = name.as_deref().and_then(std::path::Path::file_name);
    base.is_some_and(|b| b == "ratelimit") && args.next().is_none()
}

/// `ratelimit` with no arguments: `serve` with the flags of the Go
/// service's environment variables ([`bucket_rls::go_env`]).
fn go_service_args() -> Result<(ServeArgs, bucket_rls::go_env::Mapped), String> {
    // Names or values that are not UTF-8 cannot be Go service settings.
    let env: bucket_rls::go_env::Env = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect();
    bucket_rls::go_env::serve_args(&env).map_err(|e| format!("{e} (not starting)"))
}

fn run_serve(args: ServeArgs, mapped: Option<bucket_rls::go_env::Mapped>) -> bool {
    init_tracing(&args.log_level, args.log_format);
    if let Some(m) = mapped {
        m.log_startup();
    }
    match tokio::runtime::Runtime::new() {
        Ok(rt) => rt
            .block_on(serve(args))
            .map_err(|e| report!(std::io::stderr(), "error: {e:#}"))
            .is_ok(),
        Err(e) => {
            report!(
                std::io::stderr(),
                "error: cannot start the async runtime: {e}"
            );
            false
        }
    }
}

fn main() -> ExitCode {
    let ok = if started_as_go_service() {
        match go_service_args() {
            Ok((args, mapped)) => run_serve(args, Some(mapped)),
            Err(e) => {
                report!(std::io::stderr(), "error: {e}");
                false
            }
        }
    } else {
        match Cli::parse().command {
            Command::CheckConfig {
                paths,
                merge_domain_config,
                diff: Some(old),
                ..
            } => {
                let load = loader::LoadOptions {
                    merge_domains: merge_domain_config,
                };
                return check_config_diff(&old, &paths, load);
            }
            other => command(other),
        }
    };
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Runs a subcommand; `true` on success.
fn command(command: Command) -> bool {
    match command {
        Command::CheckConfig {
            paths,
            merge_domain_config,
            xds_resources,
            ..
        } => {
            let load = loader::LoadOptions {
                merge_domains: merge_domain_config,
            };
            let check = if xds_resources {
                bucket_rls::cli::check_xds_dumps
            } else {
                bucket_rls::cli::check_config
            };
            check(&paths, load, &mut std::io::stdout(), &mut std::io::stderr())
        }
        #[cfg(feature = "loadgen")]
        Command::Loadgen(args) => bucket_rls::loadgen::main(&args)
            .map_err(|e| report!(std::io::stderr(), "error: {e}"))
            .is_ok(),
        Command::Serve(args) => run_serve(*args, None),
    }
}

/// `check-config --diff OLD NEW`: exit 0 (no change), 2 (only additions and
/// loosenings), 3 (changes to review) or 1 (a side does not load).
fn check_config_diff(
    old: &str,
    paths: &[std::path::PathBuf],
    load: loader::LoadOptions,
) -> ExitCode {
    let [new] = paths else {
        report!(
            std::io::stderr(),
            "error: check-config --diff OLD takes exactly one NEW config (file or directory), got {}",
            paths.len()
        );
        return ExitCode::FAILURE;
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            report!(
                std::io::stderr(),
                "error: cannot start the async runtime: {e}"
            );
            return ExitCode::FAILURE;
        }
    };
    let code = rt.block_on(bucket_rls::cli::diff_configs(
        old,
        new,
        load,
        &mut std::io::stdout(),
        &mut std::io::stderr(),
    ));
    ExitCode::from(u8::try_from(code).unwrap_or(1))
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
    let settings = Settings::try_from(&args)?;
    let tracing = bucket_rls::otel::init(&settings.tracing)?;
    let config = match &settings.config {
        ConfigSource::File(path) => {
            // Counted and logged by `App::build`, which applies it.
            let config = loader::load_source_with(path, settings.load)
                .map_err(|e| anyhow::anyhow!("invalid config, not starting:\n{e}"))?;
            Some(config)
        }
        ConfigSource::Xds(_) => None,
    };
    let (grpc_addr, http_addr) = (settings.grpc_addr, settings.http_addr);
    let go_metrics_addr = settings.go_metrics.as_ref().map(|m| m.addr);
    let debug_addr = settings.debug_addr;
    let app = app::App::build(settings, config)?;
    app.ready().await;
    let grpc = tokio::net::TcpListener::bind(grpc_addr)
        .await
        .with_context(|| format!("binding gRPC on {grpc_addr}"))?;
    let http = tokio::net::TcpListener::bind(http_addr)
        .await
        .with_context(|| format!("binding HTTP on {http_addr}"))?;
    let bind_extra = |addr: Option<std::net::SocketAddr>, what: &'static str| async move {
        match addr {
            None => Ok(None),
            Some(a) => tokio::net::TcpListener::bind(a)
                .await
                .map(Some)
                .with_context(|| format!("binding {what} on {a}")),
        }
    };
    let extra = app::ExtraListeners {
        go_metrics: bind_extra(go_metrics_addr, "Go-named metrics").await?,
        debug: bind_extra(debug_addr, "debug /rlconfig").await?,
    };
    tracing::info!(
        grpc = %grpc.local_addr()?,
        http = %http.local_addr()?,
        go_metrics = ?go_metrics_addr,
        debug = ?debug_addr,
        backend = app.limiter().storage().name(),
        "serving"
    );
    app.run_with(Listeners { grpc, http }, extra, app::shutdown_signal())
        .await?;
    // Spans still queued leave before the process does (bounded by the
    // exporter's 10 s timeout).
    if let Some(t) = tracing {
        let _ = tokio::task::spawn_blocking(move || t.shutdown()).await;
    }
    tracing::info!("stopped");
    Ok(())
}
