//! A real Sentinel setup for tests: one master, one replica and three
//! Sentinels (`mymaster`, quorum 2, `down-after-milliseconds 1000`,
//! `failover-timeout 3000`), all on free 127.0.0.1 ports, killed on drop.

use super::cluster::Node;
use super::eventually::eventually_blocking;
use super::free_port;
use std::time::{Duration, Instant};

/// How long a replica sync, a Sentinel handshake or a failover may take.
const SETUP_DEADLINE: Duration = Duration::from_secs(30);

/// The master name the Sentinels watch.
pub const MASTER_NAME: &str = "mymaster";

/// Master, replica and three Sentinels.
#[derive(Debug)]
pub struct SentinelSetup {
    /// The two data nodes (initially `[master, replica]`).
    pub data: Vec<Node>,
    /// The three Sentinels.
    pub sentinels: Vec<Node>,
    /// TLS ports of the Sentinels (empty without TLS).
    sentinel_tls_ports: Vec<u16>,
    dir: tempfile::TempDir,
}

fn data_args(
    port: u16,
    dir: &std::path::Path,
    replica_of: Option<u16>,
    password: Option<&str>,
) -> Vec<String> {
    let mut a: Vec<String> = [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        &dir.to_string_lossy(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    if let Some(m) = replica_of {
        a.extend(["--replicaof".into(), "127.0.0.1".into(), m.to_string()]);
    }
    if let Some(p) = password {
        // Both data nodes: either may become the master.
        a.extend([
            "--requirepass".into(),
            p.into(),
            "--masterauth".into(),
            p.into(),
        ]);
    }
    a
}

impl SentinelSetup {
    /// Starts everything and waits until the replica is in sync and every
    /// Sentinel knows the replica and the two other Sentinels.
    pub fn start() -> Self {
        Self::start_with_password(None)
    }

    /// [`SentinelSetup::start`] with `requirepass password` on both data
    /// nodes (the Sentinels get `auth-pass`; they have no password
    /// themselves).
    pub fn start_with_password(password: Option<&str>) -> Self {
        Self::start_inner(tempfile::tempdir().expect("tempdir"), password, false)
    }

    /// [`SentinelSetup::start`] where the master, the replica and the
    /// Sentinels also listen with TLS (certificates from
    /// [`super::tls::write_tls_files`], `tls-replication yes`, so Sentinels
    /// name the master by its TLS port). The plain ports stay for the test's
    /// own queries. Returns the CA certificate (PEM) too.
    pub fn start_tls() -> (Self, Vec<u8>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = super::tls::write_tls_files(dir.path());
        (Self::start_inner(dir, None, true), ca)
    }

    fn start_inner(dir: tempfile::TempDir, password: Option<&str>, tls: bool) -> Self {
        let tls_args = |tls_port: u16| -> Vec<String> {
            if !tls {
                return Vec::new();
            }
            let mut a = super::tls::tls_server_args(dir.path());
            a.extend([
                "--tls-port".into(),
                tls_port.to_string(),
                "--tls-replication".into(),
                "yes".into(),
            ]);
            a
        };
        let (mp, mp_tls) = (free_port(), free_port());
        let (rp, rp_tls) = (free_port(), free_port());
        // With TLS, replication and Sentinels use the master's TLS port.
        let master_port = if tls { mp_tls } else { mp };
        let mut args = data_args(mp, dir.path(), None, password);
        args.extend(tls_args(mp_tls));
        let master = Node::start_with_password(
            "redis-server",
            &args,
            mp,
            dir.path(),
            &format!("master-{mp}"),
            password,
        );
        let mut args = data_args(rp, dir.path(), Some(master_port), password);
        args.extend(tls_args(rp_tls));
        let replica = Node::start_with_password(
            "redis-server",
            &args,
            rp,
            dir.path(),
            &format!("replica-{rp}"),
            password,
        );
        eventually_blocking(SETUP_DEADLINE, "replica in sync", || {
            replica
                .try_query::<String>(redis::cmd("INFO").arg("replication"))
                .is_ok_and(|i| i.contains("master_link_status:up"))
        });
        let mut sentinels = Vec::new();
        let mut sentinel_tls_ports = Vec::new();
        for i in 0..3 {
            let sp = free_port();
            let conf = dir.path().join(format!("sentinel-{sp}.conf"));
            let tls_conf = if tls {
                let tp = free_port();
                sentinel_tls_ports.push(tp);
                let a = tls_args(tp);
                a.chunks(2)
                    .map(|kv| format!("{} {}\n", kv[0].trim_start_matches("--"), kv[1]))
                    .collect::<String>()
            } else {
                String::new()
            };
            std::fs::write(
                &conf,
                format!(
                    "port {sp}\nbind 127.0.0.1\ndir {dir}\n{tls_conf}\
                     sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2\n\
                     sentinel down-after-milliseconds {MASTER_NAME} 1000\n\
                     sentinel failover-timeout {MASTER_NAME} 3000\n\
                     sentinel parallel-syncs {MASTER_NAME} 1\n{auth}",
                    dir = dir.path().display(),
                    auth = password
                        .map(|p| format!("sentinel auth-pass {MASTER_NAME} {p}\n"))
                        .unwrap_or_default(),
                ),
            )
            .expect("write sentinel.conf");
            sentinels.push(Node::start(
                "redis-server",
                &[conf.to_string_lossy().into_owned(), "--sentinel".into()],
                sp,
                dir.path(),
                &format!("sentinel{i}-{sp}"),
            ));
        }
        let s = Self {
            data: vec![master, replica],
            sentinels,
            sentinel_tls_ports,
            dir,
        };
        eventually_blocking(
            SETUP_DEADLINE,
            "Sentinels know the replica and each other",
            || {
                s.sentinels.iter().all(|n| {
                    let reps: redis::RedisResult<Vec<redis::Value>> =
                        n.try_query(redis::cmd("SENTINEL").arg("REPLICAS").arg(MASTER_NAME));
                    let sens: redis::RedisResult<Vec<redis::Value>> =
                        n.try_query(redis::cmd("SENTINEL").arg("SENTINELS").arg(MASTER_NAME));
                    reps.is_ok_and(|r| r.len() == 1) && sens.is_ok_and(|r| r.len() == 2)
                })
            },
        );
        s
    }

    /// `rediss://127.0.0.1:TLS_PORT` of each Sentinel (a [`Self::start_tls`]
    /// setup).
    pub fn sentinel_tls_urls(&self) -> Vec<String> {
        self.sentinel_tls_ports
            .iter()
            .map(|p| format!("rediss://127.0.0.1:{p}"))
            .collect()
    }

    /// `127.0.0.1:PORT` of each Sentinel.
    pub fn sentinel_addrs(&self) -> Vec<String> {
        self.sentinels.iter().map(Node::addr).collect()
    }

    /// The master's port as the first answering Sentinel reports it.
    pub fn master_port(&self) -> u16 {
        for s in &self.sentinels {
            if let Ok((_, port)) = s.try_query::<(String, u16)>(
                redis::cmd("SENTINEL")
                    .arg("GET-MASTER-ADDR-BY-NAME")
                    .arg(MASTER_NAME),
            ) {
                return port;
            }
        }
        panic!("no Sentinel answers");
    }

    /// The data node on `port`.
    pub fn data_node(&self, port: u16) -> &Node {
        self.data
            .iter()
            .find(|n| n.port == port)
            .expect("a data node")
    }

    /// Stops the data node on `port` (SIGKILL).
    pub fn stop_data(&mut self, port: u16) {
        self.data
            .iter_mut()
            .find(|n| n.port == port)
            .expect("a data node")
            .stop();
    }

    /// `SENTINEL FAILOVER mymaster` on the first Sentinel (no agreement
    /// needed), then waits until every Sentinel reports the other node as
    /// master and that node says it is one. Returns the new master's port.
    pub fn failover(&self) -> u16 {
        let old = self.master_port();
        let _: () =
            self.sentinels[0].query(redis::cmd("SENTINEL").arg("FAILOVER").arg(MASTER_NAME));
        self.wait_master_change(old)
    }

    /// Waits until every running Sentinel names a master other than `old`
    /// and that node reports `role:master`; returns its port.
    pub fn wait_master_change(&self, old: u16) -> u16 {
        let mut new = 0;
        eventually_blocking(SETUP_DEADLINE, "failover", || {
            let ports: Vec<u16> = self
                .sentinels
                .iter()
                .filter_map(|s| {
                    s.try_query::<(String, u16)>(
                        redis::cmd("SENTINEL")
                            .arg("GET-MASTER-ADDR-BY-NAME")
                            .arg(MASTER_NAME),
                    )
                    .ok()
                    .map(|(_, p)| p)
                })
                .collect();
            if ports.len() != self.sentinels.len()
                || ports.iter().any(|p| *p == old || *p != ports[0])
            {
                return false;
            }
            new = ports[0];
            self.data_node(new)
                .try_query::<String>(redis::cmd("INFO").arg("replication"))
                .is_ok_and(|i| i.contains("role:master"))
        });
        new
    }

    /// The temporary directory with logs and configs.
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }
}
