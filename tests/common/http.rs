//! The one HTTP/1.1 client of the tests: a request over a new connection
//! (`Connection: close`) from a chosen loopback source address, the whole
//! response read, chunked bodies decoded. Enough for the service's admin port
//! and for requests through Envoy; no keep-alive, no TLS.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long connecting may take before the request fails.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long reading the whole response may take before the request fails.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);

/// An HTTP/1.1 response.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Headers in order, names lower-cased, values trimmed.
    pub headers: Vec<(String, String)>,
    /// Body as text (chunked encoding removed).
    pub body: String,
}

impl HttpResponse {
    /// Every value of header `name` (lower-case).
    pub fn all(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// The only value of header `name`; panics if it appears more than once.
    pub fn header(&self, name: &str) -> Option<&str> {
        let all = self.all(name);
        assert!(
            all.len() <= 1,
            "header {name} appears {} times: {all:?}",
            all.len()
        );
        all.first().copied()
    }

    /// Header `name` parsed as a number; panics when absent or not a number.
    pub fn num(&self, name: &str) -> u64 {
        let v = self
            .header(name)
            .unwrap_or_else(|| panic!("no {name} header in {self:?}"));
        v.parse()
            .unwrap_or_else(|_| panic!("{name}: {v:?} is not a number"))
    }
}

/// `GET path` from an ephemeral port on 127.0.0.1.
///
/// # Errors
/// Connection, timeout or protocol failures.
pub async fn get(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> std::io::Result<HttpResponse> {
    get_from(IpAddr::V4(Ipv4Addr::LOCALHOST), addr, path, headers).await
}

/// `GET path` with the connection's source address on `from` (any
/// 127.0.0.0/8 address works on Linux loopback), so tests can act as
/// distinct clients for Envoy's `remote_address` descriptor.
///
/// # Errors
/// Connection, timeout or protocol failures.
pub async fn get_from(
    from: IpAddr,
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> std::io::Result<HttpResponse> {
    send(from, addr, "GET", path, headers, None).await
}

/// `method path` with an optional JSON `body`, from 127.0.0.1; panics on
/// connection or protocol failures (for the service's own admin port, which
/// must answer).
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> HttpResponse {
    send(
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        addr,
        method,
        path,
        &[],
        body,
    )
    .await
    .unwrap_or_else(|e| panic!("{method} {path} on {addr}: {e}"))
}

/// One request over a new connection bound to `from`. A `body` is sent as
/// `application/json` with its `Content-Length`.
///
/// # Errors
/// Connection, timeout or protocol failures, and a response that is not
/// UTF-8.
pub async fn send(
    from: IpAddr,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> std::io::Result<HttpResponse> {
    let timed_out = |what: &str| std::io::Error::new(std::io::ErrorKind::TimedOut, what.to_owned());
    let sock = match from {
        IpAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        IpAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    sock.bind(SocketAddr::new(from, 0))?;
    let mut s = tokio::time::timeout(CONNECT_TIMEOUT, sock.connect(addr))
        .await
        .map_err(|_| timed_out("connect timed out"))??;
    let mut req = format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(body) = body {
        req.push_str(&format!(
            "content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        ));
    } else {
        req.push_str("\r\n");
    }
    s.write_all(req.as_bytes()).await?;
    let mut buf = Vec::new();
    tokio::time::timeout(RESPONSE_TIMEOUT, s.read_to_end(&mut buf))
        .await
        .map_err(|_| timed_out("response timed out"))??;
    parse_response(buf)
}

fn parse_response(buf: Vec<u8>) -> std::io::Result<HttpResponse> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_owned());
    let text = String::from_utf8(buf).map_err(|_| bad("response is not UTF-8"))?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| bad("no end of headers"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().ok_or_else(|| bad("empty response"))?;
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| bad("bad status line"))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect::<Vec<_>>();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    let body = if chunked {
        dechunk(body).ok_or_else(|| bad("malformed chunked body"))?
    } else {
        body.to_owned()
    };
    Ok(HttpResponse {
        status,
        headers,
        body,
    })
}

/// The body of a chunked response, `None` when a chunk size is not hex or a
/// chunk is cut short.
fn dechunk(mut s: &str) -> Option<String> {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).ok()?;
        if n == 0 {
            return Some(out);
        }
        out.push_str(rest.get(..n)?);
        s = rest[n..].strip_prefix("\r\n")?;
    }
    None
}
