//! `bucket-rls loadgen`: a gRPC load generator for any
//! `envoy.service.ratelimit.v3.RateLimitService` (this one or another).
//!
//! Two modes:
//! - **closed loop** (no `--rate`): `--concurrency` tasks each send the next
//!   request as soon as their previous one is answered; latency is measured
//!   from the actual send.
//! - **open loop** (`--rate R`): request `k` is due at `start + k / R`. A pacer
//!   thread (sub-millisecond sleeps, unlike tokio's 1 ms timer) releases due
//!   requests to the `--concurrency` tasks, and latency is measured from the
//!   *scheduled* time. When the service (or the generator) falls behind, the wait
//!   for a free task counts as latency, so coordinated omission is avoided.
//!
//! Safety and bounds: targets outside `127.0.0.0/8` and `::1` are refused
//! unless `--allow-remote` is given; every run ends by itself (after
//! `--requests`, after `--duration`, and never later than [`MAX_RUN`]), and each
//! call has a `--timeout`.
//!
//! Output: a progress line on stderr every second (unless `--quiet`), then one
//! line per figure on stdout (`requests/s: <number>`, `p99: <ms> ms`, ...), and
//! optionally the same figures as JSON (`--json FILE`). Latencies are recorded
//! for every call, answered or failed, in microseconds (hdrhistogram, 3
//! significant digits).

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution as _, Zipf};
use std::collections::BTreeMap;
use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tonic::transport::{Channel, Endpoint};

/// Hard cap on one run, whatever the flags say.
pub const MAX_RUN: Duration = Duration::from_secs(600);
/// Run length when neither `--duration` nor `--requests` is given.
pub const DEFAULT_DURATION: Duration = Duration::from_secs(10);
/// Highest latency the histogram holds; longer calls are recorded as this.
const MAX_LATENCY_US: u64 = 120_000_000;

/// Flags of `loadgen`.
#[derive(Debug, Clone, clap::Args)]
pub struct LoadgenArgs {
    /// gRPC address of the rate limit service, `HOST:PORT`. Must be loopback
    /// (127.0.0.0/8 or ::1) unless `--allow-remote` is given.
    #[arg(long, default_value = "127.0.0.1:8081")]
    pub target: String,
    /// Allow a target that is not a loopback address.
    #[arg(long)]
    pub allow_remote: bool,
    /// Requests in flight at once (one task each).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub concurrency: u32,
    /// HTTP/2 connections; the tasks are spread over them round-robin.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub connections: u32,
    /// How long to send, e.g. `10s`, `500ms`, `2m` (default 10s without
    /// `--requests`; at most 10m).
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// How many requests to send (the run also stops at `--duration` if given).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub requests: Option<u64>,
    /// Open loop: send this many requests per second on a fixed schedule and
    /// measure latency from each scheduled send time. Omitted: as fast as the
    /// `--concurrency` tasks can go (closed loop).
    #[arg(long, value_parser = parse_rate)]
    pub rate: Option<f64>,
    /// Domain of every request.
    #[arg(long)]
    pub domain: String,
    /// One descriptor, `k=v[,k2=v2...]`; repeat for several descriptors per request.
    #[arg(long = "descriptor", required = true, value_parser = parse_descriptor)]
    pub descriptors: Vec<Vec<(String, String)>>,
    /// Distinct values of each descriptor's last entry: with N > 1 the value is
    /// `<value>-<i>` for `i` in `0..N`, one `i` chosen per request (shared by all
    /// its descriptors).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub keys: u64,
    /// How `i` is chosen.
    #[arg(long, value_enum, default_value = "uniform")]
    pub distribution: KeyDistribution,
    /// Exponent `s` of the Zipf distribution (rank `r` has weight `1 / r^s`).
    #[arg(long, default_value_t = 1.0)]
    pub zipf_exponent: f64,
    /// Request-level `hits_addend` (tokens each request costs per descriptor).
    #[arg(long, default_value_t = 1)]
    pub hits: u32,
    /// Per-call timeout; a call that takes longer counts as an error.
    #[arg(long, value_parser = parse_duration, default_value = "1s")]
    pub timeout: Duration,
    /// Runtime worker threads (default: the number of CPUs).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Seed of the key choice; runs with the same seed send the same keys
    /// (default: from the clock, printed as `seed:`). Beware: repeating a seed
    /// against a live server replays the same hot values and can push them
    /// over their limit.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// No progress lines on stderr.
    #[arg(long)]
    pub quiet: bool,
}

/// How the varying part of the descriptor values is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KeyDistribution {
    /// Every value equally likely.
    Uniform,
    /// A few values are hot (rank `r` has weight `1 / r^s`, `--zipf-exponent`).
    Zipf,
    /// Request `k` uses value `k mod N`: every value once before any repeats
    /// (to create exactly N buckets).
    Sequential,
}

/// Why a load run could not start or finish.
#[derive(Debug, thiserror::Error)]
pub enum LoadgenError {
    /// The flags do not describe a run.
    #[error("invalid arguments: {0}")]
    Args(String),
    /// The target is not loopback and `--allow-remote` was not given.
    #[error(
        "refusing target {target} ({addr}): not a loopback address (127.0.0.0/8 or ::1); pass --allow-remote to load a remote service"
    )]
    NotLoopback {
        /// As given.
        target: String,
        /// The address it resolved to.
        addr: SocketAddr,
    },
    /// The target does not resolve.
    #[error("cannot resolve target {0}: {1}")]
    Resolve(String, String),
    /// A connection could not be opened before the run.
    #[error("cannot connect to {0}: {1}")]
    Connect(SocketAddr, String),
    /// The async runtime or the JSON file failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// What one run measured.
#[derive(Debug, Clone)]
pub struct Report {
    /// Target address.
    pub target: SocketAddr,
    /// Requests completed (answered or failed).
    pub requests: u64,
    /// `overall_code` OK.
    pub ok: u64,
    /// `overall_code` OVER_LIMIT.
    pub over_limit: u64,
    /// Failed calls (gRPC status, timeout, or an unexpected `overall_code`).
    pub errors: u64,
    /// Failed calls by kind (`UNAVAILABLE`, `timeout`, ...).
    pub errors_by_kind: BTreeMap<String, u64>,
    /// From the first send to the last answer.
    pub elapsed: Duration,
    /// Latency histogram, microseconds.
    pub latency_us: Histogram<u64>,
    /// Seed the key choice used.
    pub seed: u64,
}

impl Report {
    /// Completed requests per second.
    #[must_use]
    pub fn requests_per_sec(&self) -> f64 {
        let s = self.elapsed.as_secs_f64();
        if s > 0.0 {
            self.requests as f64 / s
        } else {
            0.0
        }
    }

    fn quantile_ms(&self, q: f64) -> f64 {
        self.latency_us.value_at_quantile(q) as f64 / 1000.0
    }

    /// The final figures, one per line (`name: value`).
    ///
    /// # Errors
    /// Writing to `out` failed.
    pub fn write_lines(&self, args: &LoadgenArgs, out: &mut impl Write) -> std::io::Result<()> {
        let mode = match args.rate {
            Some(r) => format!("open loop at {r} requests/s"),
            None => "closed loop".to_owned(),
        };
        writeln!(out, "target: {}", self.target)?;
        writeln!(out, "mode: {mode}")?;
        writeln!(out, "concurrency: {}", args.concurrency)?;
        writeln!(out, "connections: {}", args.connections)?;
        writeln!(out, "descriptors/request: {}", args.descriptors.len())?;
        writeln!(out, "keys: {} ({:?})", args.keys, args.distribution)?;
        writeln!(out, "seed: {}", self.seed)?;
        writeln!(out, "duration: {:.3} s", self.elapsed.as_secs_f64())?;
        writeln!(out, "requests: {}", self.requests)?;
        writeln!(out, "requests/s: {:.1}", self.requests_per_sec())?;
        writeln!(out, "ok: {}", self.ok)?;
        writeln!(out, "over_limit: {}", self.over_limit)?;
        writeln!(out, "errors: {}", self.errors)?;
        for (kind, n) in &self.errors_by_kind {
            writeln!(out, "errors[{kind}]: {n}")?;
        }
        writeln!(out, "p50: {:.3} ms", self.quantile_ms(0.5))?;
        writeln!(out, "p90: {:.3} ms", self.quantile_ms(0.9))?;
        writeln!(out, "p99: {:.3} ms", self.quantile_ms(0.99))?;
        writeln!(out, "p99.9: {:.3} ms", self.quantile_ms(0.999))?;
        writeln!(out, "max: {:.3} ms", self.latency_us.max() as f64 / 1000.0)?;
        Ok(())
    }

    /// The figures as a JSON object (latencies in microseconds).
    #[must_use]
    pub fn to_json(&self, args: &LoadgenArgs) -> serde_json::Value {
        let h = &self.latency_us;
        serde_json::json!({
            "target": self.target.to_string(),
            "rate": args.rate,
            "concurrency": args.concurrency,
            "connections": args.connections,
            "domain": args.domain,
            "descriptors_per_request": args.descriptors.len(),
            "keys": args.keys,
            "distribution": format!("{:?}", args.distribution).to_lowercase(),
            "hits": args.hits,
            "seed": self.seed,
            "duration_secs": self.elapsed.as_secs_f64(),
            "requests": self.requests,
            "requests_per_sec": self.requests_per_sec(),
            "ok": self.ok,
            "over_limit": self.over_limit,
            "errors": self.errors,
            "errors_by_kind": self.errors_by_kind,
            "latency_us": {
                "min": h.min(),
                "mean": h.mean(),
                "p50": h.value_at_quantile(0.5),
                "p90": h.value_at_quantile(0.9),
                "p99": h.value_at_quantile(0.99),
                "p99_9": h.value_at_quantile(0.999),
                "p99_99": h.value_at_quantile(0.9999),
                "max": h.max(),
            },
        })
    }
}

/// Runs `loadgen` to completion on its own runtime, prints progress and the
/// final figures, and writes the JSON file if asked.
///
/// # Errors
/// [`LoadgenError`] when the run cannot start (bad flags, non-loopback target,
/// no connection) or the JSON file cannot be written. Failed calls during the
/// run are counted, not returned.
pub fn main(args: &LoadgenArgs) -> Result<Report, LoadgenError> {
    let target = resolve_target(&args.target, args.allow_remote)?;
    let threads = args
        .threads
        .or_else(|| std::thread::available_parallelism().ok().map(Into::into))
        .unwrap_or(2)
        .max(1);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()?;
    let report = rt.block_on(run(args, target))?;
    let mut out = std::io::stdout().lock();
    report.write_lines(args, &mut out)?;
    out.flush()?;
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report.to_json(args))
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        std::fs::write(path, text + "\n")?;
    }
    Ok(report)
}

/// Resolves `target` and refuses non-loopback addresses unless `allow_remote`.
///
/// # Errors
/// [`LoadgenError::Resolve`] or [`LoadgenError::NotLoopback`].
pub fn resolve_target(target: &str, allow_remote: bool) -> Result<SocketAddr, LoadgenError> {
    let addrs: Vec<SocketAddr> = target
        .to_socket_addrs()
        .map_err(|e| LoadgenError::Resolve(target.to_owned(), e.to_string()))?
        .collect();
    let first = *addrs
        .first()
        .ok_or_else(|| LoadgenError::Resolve(target.to_owned(), "no address found".to_owned()))?;
    if !allow_remote && let Some(bad) = addrs.iter().find(|a| !a.ip().to_canonical().is_loopback())
    {
        return Err(LoadgenError::NotLoopback {
            target: target.to_owned(),
            addr: *bad,
        });
    }
    Ok(first)
}

/// Parses `10s`, `250ms`, `2m`, `1h` or a bare number of seconds (`1.5`).
///
/// # Errors
/// A message naming the accepted forms.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("bad duration {s:?}: expected e.g. 10s, 500ms, 2m"))?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "us" => n / 1_000_000.0,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("bad duration unit in {s:?}: use us, ms, s, m or h")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("bad duration {s:?}: {e}"))
}

fn parse_rate(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(format!("bad rate {s:?}: expected requests per second > 0")),
    }
}

/// Parses one descriptor `k=v[,k2=v2...]` (a value may contain `=`, not `,`).
///
/// # Errors
/// An entry without `=` or with an empty key.
pub fn parse_descriptor(s: &str) -> Result<Vec<(String, String)>, String> {
    s.split(',')
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
            _ => Err(format!(
                "bad descriptor entry {kv:?} in {s:?}: expected key=value"
            )),
        })
        .collect()
}

/// Builds requests: the templates with the last entry's value varied by key index.
struct RequestFactory {
    domain: String,
    descriptors: Vec<Vec<Entry>>,
    vary: bool,
    hits: u32,
}

impl RequestFactory {
    fn new(args: &LoadgenArgs) -> Self {
        Self {
            domain: args.domain.clone(),
            descriptors: args
                .descriptors
                .iter()
                .map(|d| {
                    d.iter()
                        .map(|(k, v)| Entry {
                            key: k.clone(),
                            value: v.clone(),
                        })
                        .collect()
                })
                .collect(),
            vary: args.keys > 1,
            hits: args.hits,
        }
    }

    fn build(&self, key: u64) -> RateLimitRequest {
        let descriptors = self
            .descriptors
            .iter()
            .map(|entries| {
                let mut entries = entries.clone();
                if self.vary
                    && let Some(last) = entries.last_mut()
                {
                    use std::fmt::Write as _;
                    let _ = write!(last.value, "-{key}");
                }
                RateLimitDescriptor {
                    entries,
                    ..Default::default()
                }
            })
            .collect();
        RateLimitRequest {
            domain: self.domain.clone(),
            descriptors,
            hits_addend: self.hits,
        }
    }
}

/// Draws key indexes in `0..keys`.
enum KeyPicker {
    One,
    Uniform(u64),
    Zipf(Zipf<f64>),
    Sequential(u64),
}

impl KeyPicker {
    fn new(args: &LoadgenArgs) -> Result<Self, LoadgenError> {
        Ok(match (args.keys, args.distribution) {
            (1, _) => Self::One,
            (n, KeyDistribution::Uniform) => Self::Uniform(n),
            (n, KeyDistribution::Sequential) => Self::Sequential(n),
            (n, KeyDistribution::Zipf) => Self::Zipf(
                Zipf::new(n as f64, args.zipf_exponent)
                    .map_err(|e| LoadgenError::Args(format!("--zipf-exponent: {e}")))?,
            ),
        })
    }

    /// The key index of request number `k`.
    fn pick(&self, k: u64, rng: &mut SmallRng) -> u64 {
        match self {
            Self::One => 0,
            Self::Sequential(n) => k % n,
            Self::Uniform(n) => rng.random_range(0..*n),
            // Zipf samples ranks 1..=n as floats.
            Self::Zipf(z) => (z.sample(rng) as u64).saturating_sub(1),
        }
    }
}

/// Counters shared with the progress printer.
#[derive(Default)]
struct Live {
    done: AtomicU64,
    ok: AtomicU64,
    over: AtomicU64,
    errors: AtomicU64,
}

/// What each task hands back.
struct TaskResult {
    hist: Histogram<u64>,
    errors_by_kind: BTreeMap<String, u64>,
}

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_LATENCY_US, 3).expect("constant histogram bounds are valid")
}

async fn run(args: &LoadgenArgs, target: SocketAddr) -> Result<Report, LoadgenError> {
    if args.duration.is_some_and(|d| d > MAX_RUN) {
        return Err(LoadgenError::Args(format!(
            "--duration is at most {} s (10 minutes): load runs are bounded",
            MAX_RUN.as_secs()
        )));
    }
    let duration = match (args.duration, args.requests) {
        (Some(d), _) => d,
        (None, Some(_)) => MAX_RUN,
        (None, None) => DEFAULT_DURATION,
    };
    if args.descriptors.is_empty() {
        return Err(LoadgenError::Args("give at least one --descriptor".into()));
    }
    // Open loop: the number of sends is fixed up front.
    let total = match args.rate {
        Some(r) => {
            let by_time = (r * duration.as_secs_f64()).ceil() as u64;
            args.requests.map_or(by_time, |n| n.min(by_time))
        }
        None => args.requests.unwrap_or(u64::MAX),
    };
    let picker = Arc::new(KeyPicker::new(args)?);
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let factory = Arc::new(RequestFactory::new(args));

    let mut clients = Vec::with_capacity(args.connections as usize);
    for _ in 0..args.connections {
        let endpoint = Endpoint::from_shared(format!("http://{target}"))
            .map_err(|e| LoadgenError::Connect(target, e.to_string()))?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(5));
        let channel: Channel = endpoint
            .connect()
            .await
            .map_err(|e| LoadgenError::Connect(target, format!("{e:?}")))?;
        clients.push(RateLimitServiceClient::new(channel));
    }

    let live = Arc::new(Live::default());
    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + duration;
    let permits = args.rate.map(|_| Arc::new(Semaphore::new(0)));
    let stop_pacer = Arc::new(AtomicBool::new(false));
    let pacer = match (args.rate, &permits) {
        (Some(rate), Some(sem)) => {
            let sem = sem.clone();
            let stop = stop_pacer.clone();
            let wake_all = args.concurrency as usize;
            Some(std::thread::spawn(move || {
                pace(&sem, rate, total, start, &stop);
                // Let every waiting task see that the run is over.
                sem.add_permits(wake_all);
            }))
        }
        _ => None,
    };

    let mut tasks = Vec::with_capacity(args.concurrency as usize);
    for t in 0..args.concurrency {
        let mut client = clients[t as usize % clients.len()].clone();
        let (live, next, picker, factory, permits) = (
            live.clone(),
            next.clone(),
            picker.clone(),
            factory.clone(),
            permits.clone(),
        );
        let (rate, timeout) = (args.rate, args.timeout);
        tasks.push(tokio::spawn(async move {
            let mut rng =
                SmallRng::seed_from_u64(seed.wrapping_mul(1_000_003).wrapping_add(u64::from(t)));
            let mut hist = new_histogram();
            let mut errors_by_kind = BTreeMap::new();
            loop {
                if let Some(sem) = &permits {
                    match sem.acquire().await {
                        Ok(p) => p.forget(),
                        Err(_) => break,
                    }
                }
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= total {
                    break;
                }
                let now = Instant::now();
                if rate.is_none() && now >= deadline {
                    break;
                }
                let scheduled = rate.map_or(now, |r| start + Duration::from_secs_f64(k as f64 / r));
                let req = factory.build(picker.pick(k, &mut rng));
                let outcome = tokio::time::timeout(timeout, client.should_rate_limit(req)).await;
                let latency = scheduled.elapsed();
                hist.saturating_record(
                    u64::try_from(latency.as_micros())
                        .unwrap_or(u64::MAX)
                        .max(1),
                );
                match classify(outcome) {
                    Ok(Code::Ok) => live.ok.fetch_add(1, Ordering::Relaxed),
                    Ok(_) => live.over.fetch_add(1, Ordering::Relaxed),
                    Err(kind) => {
                        *errors_by_kind.entry(kind).or_insert(0) += 1;
                        live.errors.fetch_add(1, Ordering::Relaxed)
                    }
                };
                live.done.fetch_add(1, Ordering::Relaxed);
            }
            TaskResult {
                hist,
                errors_by_kind,
            }
        }));
    }

    let progress = (!args.quiet).then(|| {
        let live = live.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(
                tokio::time::Instant::from_std(start + Duration::from_secs(1)),
                Duration::from_secs(1),
            );
            let mut last = 0;
            loop {
                tick.tick().await;
                let done = live.done.load(Ordering::Relaxed);
                eprintln!(
                    "[{:6.1}s] {:>8} req/s  done {:>9}  ok {:>9}  over_limit {:>9}  errors {:>7}",
                    start.elapsed().as_secs_f64(),
                    done - last,
                    done,
                    live.ok.load(Ordering::Relaxed),
                    live.over.load(Ordering::Relaxed),
                    live.errors.load(Ordering::Relaxed),
                );
                last = done;
            }
        })
    });

    // Every task ends by `deadline` plus one call timeout; give it a margin,
    // then stop waiting for stragglers.
    let cap = duration + args.timeout + Duration::from_secs(5);
    let mut hist = new_histogram();
    let mut errors_by_kind: BTreeMap<String, u64> = BTreeMap::new();
    let joined = tokio::time::timeout(cap, futures::future::join_all(tasks)).await;
    let end = Instant::now();
    stop_pacer.store(true, Ordering::Relaxed);
    if let Some(p) = progress {
        p.abort();
    }
    if let Some(p) = pacer {
        let _ = tokio::task::spawn_blocking(move || p.join()).await;
    }
    match joined {
        Ok(results) => {
            for r in results.into_iter().flatten() {
                let _ = hist.add(&r.hist);
                for (k, n) in r.errors_by_kind {
                    *errors_by_kind.entry(k).or_insert(0) += n;
                }
            }
        }
        Err(_) => eprintln!(
            "warning: calls still in flight {cap:?} after the start; their latencies are not in the histogram"
        ),
    }
    Ok(Report {
        target,
        requests: live.done.load(Ordering::Relaxed),
        ok: live.ok.load(Ordering::Relaxed),
        over_limit: live.over.load(Ordering::Relaxed),
        errors: live.errors.load(Ordering::Relaxed),
        errors_by_kind,
        elapsed: end - start,
        latency_us: hist,
        seed,
    })
}

/// Releases one permit per due request: request `k` is due at `start + k / rate`.
/// Runs on its own thread, whose sleeps are precise to tens of microseconds.
fn pace(sem: &Semaphore, rate: f64, total: u64, start: Instant, stop: &AtomicBool) {
    let mut released: u64 = 0;
    while released < total && !stop.load(Ordering::Relaxed) {
        let elapsed = start.elapsed().as_secs_f64();
        let due = ((elapsed * rate).floor() as u64 + 1).min(total);
        if due > released {
            sem.add_permits(usize::try_from(due - released).unwrap_or(usize::MAX));
            released = due;
        }
        if released >= total {
            break;
        }
        let next_at = released as f64 / rate;
        let wait = next_at - start.elapsed().as_secs_f64();
        if wait > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(wait.min(0.1)));
        }
    }
}

type CallOutcome =
    Result<Result<tonic::Response<RateLimitResponse>, tonic::Status>, tokio::time::error::Elapsed>;

/// The overall code of an answer, or the kind of failure.
fn classify(outcome: CallOutcome) -> Result<Code, String> {
    match outcome {
        Err(_) => Err("timeout".into()),
        Ok(Err(status)) => Err(format!("{:?}", status.code())),
        Ok(Ok(resp)) => match Code::try_from(resp.get_ref().overall_code) {
            Ok(c @ (Code::Ok | Code::OverLimit)) => Ok(c),
            _ => Err(format!("overall_code {}", resp.get_ref().overall_code)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("5d").is_err());
    }

    #[test]
    fn descriptors() {
        assert_eq!(
            parse_descriptor("a=1,b=x=y"),
            Ok(vec![("a".into(), "1".into()), ("b".into(), "x=y".into())])
        );
        assert!(parse_descriptor("a").is_err());
        assert!(parse_descriptor("=v").is_err());
    }

    #[test]
    fn loopback_only_by_default() {
        assert!(resolve_target("127.0.0.1:1", false).is_ok());
        assert!(resolve_target("127.9.8.7:1", false).is_ok());
        assert!(resolve_target("[::1]:1", false).is_ok());
        assert!(resolve_target("[::ffff:127.0.0.1]:1", false).is_ok());
        assert!(matches!(
            resolve_target("10.0.0.1:1", false),
            Err(LoadgenError::NotLoopback { .. })
        ));
        assert!(matches!(
            resolve_target("[::2]:1", false),
            Err(LoadgenError::NotLoopback { .. })
        ));
        assert!(resolve_target("10.0.0.1:1", true).is_ok());
    }

    #[test]
    fn keys_vary_the_last_entry_only() {
        let args = LoadgenArgs {
            target: String::new(),
            allow_remote: false,
            concurrency: 1,
            connections: 1,
            duration: None,
            requests: None,
            rate: None,
            domain: "d".into(),
            descriptors: vec![vec![("a".into(), "x".into()), ("b".into(), "y".into())]],
            keys: 3,
            distribution: KeyDistribution::Zipf,
            zipf_exponent: 1.0,
            hits: 2,
            timeout: Duration::from_secs(1),
            threads: None,
            seed: Some(1),
            json: None,
            quiet: true,
        };
        let f = RequestFactory::new(&args);
        let r = f.build(2);
        assert_eq!(r.hits_addend, 2);
        assert_eq!(r.descriptors[0].entries[0].value, "x");
        assert_eq!(r.descriptors[0].entries[1].value, "y-2");
        let p = KeyPicker::new(&args).unwrap();
        let mut rng = SmallRng::seed_from_u64(1);
        assert!((0..1000).all(|k| p.pick(k, &mut rng) < 3));
        let args = LoadgenArgs {
            distribution: KeyDistribution::Sequential,
            ..args
        };
        let p = KeyPicker::new(&args).unwrap();
        let picks: Vec<u64> = (0..6).map(|k| p.pick(k, &mut rng)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
    }
}
