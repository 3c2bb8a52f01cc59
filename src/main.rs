//! bucket-rls binary: parse the command line (or the Go service's
//! environment), start logging, run the subcommand, turn its outcome into an
//! exit code.

use bucket_rls::cli::check::{self, Checked};
use bucket_rls::cli::diff::Verdict;
use bucket_rls::cli::{Cli, Command, LogFormat, serve};
use bucket_rls::go;
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
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

fn main() -> ExitCode {
    // `ratelimit` with no arguments: `serve` with the Go service's environment.
    let (command, go_env) = if go::env::started_as_ratelimit(std::env::args_os()) {
        match go::env::serve_args(&go::env::process_env()) {
            Ok((args, mapped)) => (Command::Serve(Box::new(args)), Some(mapped)),
            Err(e) => {
                report!("error: {e} (not starting)");
                return ExitCode::FAILURE;
            }
        }
    } else {
        (Cli::parse().command, None)
    };
    match command {
        Command::Serve(args) => {
            init_tracing(&args.log_level, args.log_format);
            if let Some(m) = go_env {
                m.log_startup();
            }
            done(serve::run(&args).map_err(|e| format!("{:#}", anyhow::Error::from(e))))
        }
        Command::CheckConfig(args) => {
            match check::run(&args, &mut std::io::stdout(), &mut std::io::stderr()) {
                Checked::Valid | Checked::Diff(Verdict::Unchanged) => ExitCode::SUCCESS,
                Checked::Invalid | Checked::Diff(Verdict::NotLoaded) => ExitCode::FAILURE,
                Checked::Diff(Verdict::AddsOrLoosens) => ExitCode::from(2),
                Checked::Diff(Verdict::NeedsReview) => ExitCode::from(3),
            }
        }
        Command::XdsServer(args) => {
            done(bucket_rls::cli::xds_server::run(&args).map_err(|e| e.to_string()))
        }
        #[cfg(feature = "loadgen")]
        Command::Loadgen(args) => done(
            bucket_rls::loadgen::main(&args)
                .map(drop)
                .map_err(|e| e.to_string()),
        ),
    }
}

/// Exit 0, or print the error and exit 1.
fn done(result: Result<(), String>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            report!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn init_tracing(level: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_new(level).unwrap_or_else(|e| {
        report!("warning: invalid --log-level '{level}' ({e}); logging at info");
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
