//! A real six-node Redis Cluster (three masters, three replicas) for tests,
//! on free 127.0.0.1 ports, plus the process handling shared with the
//! Sentinel helper ([`Node`]).
//!
//! Every `redis-server` runs under a tiny `sh` watchdog that kills it when the
//! test process is gone, so a cluster kept in a `static` (shared by the cases
//! of one test binary) never outlives the test run; handles that are dropped
//! kill their processes at once. Panics (the test fails, never skips) when
//! `redis-server` or `redis-cli` is not installed.

use super::free_port;
use bucket_rls::storage::key::{KeyValue, encode};
use bucket_rls::storage::redis::cluster::{RedisClusterStorage, key_slot};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a node gets to answer `PING`, and the cluster to become `ok`.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Kills `redis-server` (or `redis-server --sentinel`) once the test process
/// (`$WATCH_PID`) exits; the server's pid is in `$!`.
const WATCHDOG: &str = r#"exec 0</dev/null
"$@" &
r=$!
while kill -0 "$WATCH_PID" 2>/dev/null && kill -0 "$r" 2>/dev/null; do sleep 0.3; done
kill -9 "$r" 2>/dev/null
"#;

/// One `redis-server` process (under its watchdog).
#[derive(Debug)]
pub struct Node {
    /// Client port.
    pub port: u16,
    /// The server's own pid (from `INFO server`).
    pid: u32,
    watchdog: Option<Child>,
    log: PathBuf,
    /// `requirepass` of the server, used by [`Node::url`] and queries.
    password: Option<String>,
}

impl Node {
    /// Starts `redis-server <args...>` (or any binary with `program`) with its
    /// log in `dir/<name>.log`, and waits until it answers `PING` on `port`.
    pub fn start(program: &str, args: &[String], port: u16, dir: &Path, name: &str) -> Self {
        Self::start_with_password(program, args, port, dir, name, None)
    }

    /// [`Node::start`] for a server started with `requirepass password`:
    /// [`Node::url`] and every query of this handle authenticate.
    pub fn start_with_password(
        program: &str,
        args: &[String],
        port: u16,
        dir: &Path,
        name: &str,
        password: Option<&str>,
    ) -> Self {
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).expect("log file");
        let err = out.try_clone().expect("log");
        let watchdog = Command::new("sh")
            .arg("-c")
            .arg(WATCHDOG)
            .arg("sh")
            .arg(program)
            .args(args)
            .env("WATCH_PID", std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("sh");
        let mut node = Self {
            port,
            pid: 0,
            watchdog: Some(watchdog),
            log,
            password: password.map(str::to_owned),
        };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(info) = node.try_query::<String>(redis::cmd("INFO").arg("server")) {
                node.pid = info
                    .lines()
                    .find_map(|l| l.strip_prefix("process_id:"))
                    .and_then(|p| p.trim().parse().ok())
                    .expect("process_id in INFO server");
                return node;
            }
            if let Some(Ok(Some(_))) = node.watchdog.as_mut().map(Child::try_wait) {
                let which = Command::new("sh")
                    .arg("-c")
                    .arg(format!("command -v {program}"))
                    .output()
                    .map(|o| o.status.success())
                    .unwrap_or(false);
                assert!(
                    which,
                    "{program} is not installed (Debian packages redis-server and redis-tools)"
                );
                panic!("{program} exited:\n{}", node.logs());
            }
            assert!(
                Instant::now() < deadline,
                "{name} did not answer on port {port}:\n{}",
                node.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// What the server wrote to its log.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `redis://127.0.0.1:PORT` (`redis://:PASSWORD@...` with a password).
    pub fn url(&self) -> String {
        match &self.password {
            Some(p) => format!("redis://:{p}@127.0.0.1:{}", self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Runs one command on this node (a plain connection, no redirects).
    pub fn try_query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> redis::RedisResult<T> {
        let client = redis::Client::open(self.url())?;
        let mut c = client.get_connection_with_timeout(Duration::from_secs(2))?;
        c.set_read_timeout(Some(Duration::from_secs(5)))?;
        cmd.query(&mut c)
    }

    /// Runs one command on this node; panics on error.
    pub fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        self.try_query(cmd)
            .unwrap_or_else(|e| panic!("{cmd:?} on port {} failed: {e}", self.port))
    }

    /// Whether the process is running.
    pub fn running(&self) -> bool {
        self.watchdog.is_some()
    }

    /// SIGKILL now (connections drop at once), and reap the watchdog.
    pub fn stop(&mut self) {
        if let Some(mut w) = self.watchdog.take() {
            let _ = Command::new("kill")
                .args(["-9", &self.pid.to_string()])
                .status();
            let _ = w.kill();
            let _ = w.wait();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Six `redis-server --cluster-enabled yes` nodes joined by
/// `redis-cli --cluster create ... --cluster-replicas 1`.
#[derive(Debug)]
pub struct RedisCluster {
    /// The nodes, in creation order (masters are chosen by `redis-cli`).
    pub nodes: Vec<Node>,
    dir: tempfile::TempDir,
}

/// One master and the slot ranges it serves.
#[derive(Debug, Clone)]
pub struct Shard {
    /// The master's port.
    pub master: u16,
    /// Its replicas' ports.
    pub replicas: Vec<u16>,
    /// Inclusive slot ranges.
    pub ranges: Vec<(u16, u16)>,
}

impl Shard {
    /// Whether `slot` is served by this shard.
    pub fn serves(&self, slot: u16) -> bool {
        self.ranges.iter().any(|(a, b)| (*a..=*b).contains(&slot))
    }
}

/// Arguments of a cluster node on `port` (and a free bus port) on
/// 127.0.0.1, with `cluster-node-timeout 1000`,
/// `cluster-require-full-coverage no`, no persistence, files in `dir`, then
/// `extra`.
pub fn cluster_node_args(port: u16, dir: &Path, extra: &[&str]) -> Vec<String> {
    let dir = dir.to_string_lossy();
    let mut args: Vec<String> = [
        "--port",
        &port.to_string(),
        "--cluster-port",
        &free_port().to_string(),
        "--bind",
        "127.0.0.1",
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        &format!("{dir}/nodes-{port}.conf"),
        "--cluster-node-timeout",
        "1000",
        "--cluster-require-full-coverage",
        "no",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        &dir,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    args
}

/// `redis-cli --cluster create` over `nodes` with `replicas` replicas per
/// master. Bounded: redis-cli waits forever for nodes that cannot meet (a
/// cluster bus that fails its TLS handshake, say), so it is killed after 60 s
/// and the test fails with its output.
pub fn create_cluster(nodes: &[Node], replicas: u32) {
    let out = Command::new("timeout")
        .args(["60", "redis-cli", "--cluster", "create"])
        .args(nodes.iter().map(Node::addr))
        .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run timeout/redis-cli: {e}"));
    assert!(
        out.status.success(),
        "redis-cli --cluster create failed or timed out (is the Debian package redis-tools installed?):\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl RedisCluster {
    /// Starts six nodes with `cluster-node-timeout 1000` ms and
    /// `cluster-require-full-coverage no` (so a lost slot range does not stop
    /// the others), creates the cluster and waits for `cluster_state:ok` on
    /// every node, and for every node to agree on all 16,384 slots.
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut nodes = Vec::new();
        for i in 0..6 {
            let port = free_port();
            let args = cluster_node_args(port, dir.path(), &[]);
            nodes.push(Node::start(
                "redis-server",
                &args,
                port,
                dir.path(),
                &format!("node{i}-{port}"),
            ));
        }
        create_cluster(&nodes, 1);
        let c = Self { nodes, dir };
        let ports: Vec<u16> = c.nodes.iter().map(|n| n.port).collect();
        c.wait_ok(&ports);
        // Every master has its replica, in sync, as every node sees it
        // (otherwise a failover test could find no replica to promote).
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let ready = ports.iter().all(|p| {
                let shards = c.shards_from(*p);
                shards.len() == 3
                    && shards.iter().all(|s| {
                        s.replicas.len() == 1
                            && c.node(s.replicas[0])
                                .try_query::<String>(redis::cmd("INFO").arg("replication"))
                                .is_ok_and(|i| i.contains("master_link_status:up"))
                    })
            });
            if ready {
                return c;
            }
            assert!(
                Instant::now() < deadline,
                "replicas not attached in time: {:?}",
                c.shards()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until every node in `ports` reports `cluster_state:ok`, knows
    /// all slots, and they all agree on the masters.
    pub fn wait_ok(&self, ports: &[u16]) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let states: Vec<Option<String>> = ports
                .iter()
                .map(|p| {
                    let n = self.node(*p);
                    let info: String = n.try_query(redis::cmd("CLUSTER").arg("INFO")).ok()?;
                    let ok = info.contains("cluster_state:ok")
                        && info.contains("cluster_slots_assigned:16384");
                    ok.then(|| {
                        let mut s = self.shards_from(*p);
                        s.sort_by_key(|s| s.master);
                        format!(
                            "{:?}",
                            s.iter()
                                .map(|s| (s.master, s.ranges.clone()))
                                .collect::<Vec<_>>()
                        )
                    })
                })
                .collect();
            if states.iter().all(Option::is_some) && states.windows(2).all(|w| w[0] == w[1]) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "cluster not ok in time: {states:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The node on `port`.
    pub fn node(&self, port: u16) -> &Node {
        self.nodes
            .iter()
            .find(|n| n.port == port)
            .expect("a node of this cluster")
    }

    /// The node on `port`, mutable.
    pub fn node_mut(&mut self, port: u16) -> &mut Node {
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .expect("a node of this cluster")
    }

    /// Seed addresses `127.0.0.1:PORT` of every node.
    pub fn seeds(&self) -> Vec<String> {
        self.nodes.iter().map(Node::addr).collect()
    }

    /// The shards as one running node sees them (`CLUSTER SHARDS`-like, from
    /// `CLUSTER SLOTS`).
    pub fn shards(&self) -> Vec<Shard> {
        let p = self
            .nodes
            .iter()
            .find(|n| n.running())
            .expect("a running node")
            .port;
        self.shards_from(p)
    }

    /// The shards as the node on `port` sees them.
    pub fn shards_from(&self, port: u16) -> Vec<Shard> {
        let slots: Vec<redis::Value> = self.node(port).query(redis::cmd("CLUSTER").arg("SLOTS"));
        let mut shards: Vec<Shard> = Vec::new();
        for entry in slots {
            let redis::Value::Array(items) = entry else {
                continue;
            };
            let int = |v: &redis::Value| match v {
                redis::Value::Int(i) => u16::try_from(*i).expect("u16"),
                other => panic!("not an int: {other:?}"),
            };
            let port_of = |v: &redis::Value| match v {
                redis::Value::Array(n) => int(&n[1]),
                other => panic!("not a node: {other:?}"),
            };
            let (a, b) = (int(&items[0]), int(&items[1]));
            let master = port_of(&items[2]);
            let replicas = items[3..].iter().map(port_of).collect();
            match shards.iter_mut().find(|s| s.master == master) {
                Some(s) => s.ranges.push((a, b)),
                None => shards.push(Shard {
                    master,
                    replicas,
                    ranges: vec![(a, b)],
                }),
            }
        }
        shards
    }

    /// The shard serving `slot`.
    pub fn shard_of(&self, slot: u16) -> Shard {
        self.shards()
            .into_iter()
            .find(|s| s.serves(slot))
            .unwrap_or_else(|| panic!("slot {slot} is not served"))
    }

    /// `CLUSTER KEYSLOT key` as the server computes it.
    pub fn keyslot(&self, key: &str) -> u16 {
        let n: i64 = self
            .nodes
            .iter()
            .find(|n| n.running())
            .expect("a running node")
            .query(redis::cmd("CLUSTER").arg("KEYSLOT").arg(key));
        u16::try_from(n).expect("slot")
    }

    /// Reads one key from the master serving it (raw bytes, `None` if absent).
    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        let slot = self.keyslot(key);
        let master = self.shard_of(slot).master;
        self.node(master).query(redis::cmd("GET").arg(key))
    }

    /// Runs `cmd` on the master serving `key` (by the server's own
    /// `CLUSTER KEYSLOT`); panics on error.
    pub fn query_on<T: redis::FromRedisValue>(&self, key: &str, cmd: &redis::Cmd) -> T {
        let master = self.shard_of(self.keyslot(key)).master;
        self.node(master).query(cmd)
    }

    /// Calls of `command` (lower case) on the node `port` since it started.
    pub fn command_calls(&self, port: u16, command: &str) -> u64 {
        let info: String = self
            .node(port)
            .query(redis::cmd("INFO").arg("commandstats"));
        let prefix = format!("cmdstat_{command}:calls=");
        info.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |n| n.parse().expect("calls count"))
    }

    /// Calls of the request script on the node `port` since it started,
    /// whichever way they went (`FCALL` of its library, `EVALSHA`).
    pub fn script_calls(&self, port: u16) -> u64 {
        self.command_calls(port, "fcall") + self.command_calls(port, "evalsha")
    }

    /// The temporary directory with the node logs and configs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// Waits until the cluster storage has its slot map.
pub async fn connected(s: &RedisClusterStorage) {
    super::eventually::eventually(Duration::from_secs(10), "cluster storage connected", || {
        let done = s.connected();
        async move { done.then_some(()) }
    })
    .await;
}

/// A Cluster backend on `c` with response timeout `timeout`, connected.
pub async fn storage(c: &RedisCluster, timeout: Duration) -> RedisClusterStorage {
    let s = RedisClusterStorage::builder(c.seeds())
        .timeout(timeout)
        .build()
        .expect("valid seeds");
    connected(&s).await;
    s
}

/// The bucket key of descriptor `[[k=v]]` in `domain` under `prefix`.
pub fn bucket(prefix: &str, domain: &str, k: &str, v: &str) -> String {
    encode(prefix, domain, &[(k, KeyValue::Value(v))])
}

/// A value `<stem><n>` whose bucket key lands in `shard` (and not in `avoid`).
pub fn value_in(
    shard: &Shard,
    prefix: &str,
    domain: &str,
    k: &str,
    stem: &str,
    avoid: &[u16],
) -> String {
    (0..10_000)
        .map(|n| format!("{stem}{n}"))
        .find(|v| {
            let s = key_slot(&bucket(prefix, domain, k, v));
            shard.serves(s) && !avoid.contains(&s)
        })
        .expect("a value in that shard")
}

/// A TCP proxy on 127.0.0.1 that delays every byte from `upstream` to the
/// client by `delay_ms` milliseconds, read at each chunk (pure latency: chunks
/// keep their order and are not serialised behind each other's delay). Runs
/// until the test ends.
pub async fn delay_proxy(upstream: u16, delay_ms: Arc<AtomicU64>) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind proxy");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await else {
                continue;
            };
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut cr, &mut sw).await;
            });
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
            let delay_ms = delay_ms.clone();
            tokio::spawn(async move {
                use tokio::io::AsyncReadExt;
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n) = sr.read(&mut buf).await {
                    let delay = Duration::from_millis(delay_ms.load(Ordering::SeqCst));
                    if n == 0
                        || tx
                            .send((Instant::now() + delay, buf[..n].to_vec()))
                            .is_err()
                    {
                        break;
                    }
                }
            });
            tokio::spawn(async move {
                use tokio::io::AsyncWriteExt;
                while let Some((at, bytes)) = rx.recv().await {
                    tokio::time::sleep_until(at.into()).await;
                    if cw.write_all(&bytes).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    port
}
