//! Helpers for the admin, metrics and reload tests: reading metric values
//! from the Prometheus text, a minimal HTTP/1.1 client, polling with a deadline.
#![allow(dead_code)]

use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The process-wide metrics, rendered now.
pub fn scrape() -> String {
    bucket_rls::metrics::install().render()
}

/// The value of the series `name{labels}` in Prometheus text `text` (labels
/// must match exactly, in any order); `None` when the series is absent.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut want: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    want.sort();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (n, got) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.strip_suffix('}')?),
                None => (series, ""),
            };
            if n != name {
                return None;
            }
            let mut got: Vec<String> = if got.is_empty() {
                Vec::new()
            } else {
                got.split(',').map(str::to_owned).collect()
            };
            got.sort();
            (got == want).then(|| value.parse().ok()).flatten()
        })
}

/// Like [`metric`] on a fresh scrape, with an absent series read as 0.
pub fn counter(name: &str, labels: &[(&str, &str)]) -> f64 {
    metric(&scrape(), name, labels).unwrap_or(0.0)
}

/// Number of series (sample lines) of metric family `name` in `text`.
pub fn series_count(text: &str, name: &str) -> usize {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.split(['{', ' ']).next().is_some_and(|n| {
                n == name || n.strip_prefix(name).is_some_and(|s| s.starts_with('_'))
            })
        })
        .count()
}

/// Polls `check` every 10 ms until it returns `Some`, or panics after
/// `deadline` with `what`. Returns the value and the time it took.
pub async fn poll<T, F, Fut>(deadline: Duration, what: &str, mut check: F) -> (T, Duration)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return (v, start.elapsed());
        }
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A response from [`http`].
#[derive(Debug)]
pub struct Reply {
    /// Status code.
    pub status: u16,
    /// Lower-cased header lines `name: value`.
    pub headers: Vec<String>,
    /// Body.
    pub body: String,
}

/// One HTTP/1.1 request over a new connection (`Connection: close`).
pub async fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> Reply {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.expect("read");
    let raw = String::from_utf8(raw).expect("utf-8 response");
    let (head, rest) = raw.split_once("\r\n\r\n").expect("header end");
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let headers: Vec<String> = lines.map(str::to_ascii_lowercase).collect();
    let body = if headers.iter().any(|h| h == "transfer-encoding: chunked") {
        dechunk(rest)
    } else {
        rest.to_owned()
    };
    Reply {
        status,
        headers,
        body,
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).expect("chunk size");
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}
