//! Connection caps: idle connections beyond the cap wait instead of exhausting
//! file descriptors, and the port serves again as soon as one closes.

use bucket_rls::conn_limit::{LimitedListener, per_port_limit};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The body of `GET /livez` (status 200) over a new connection.
async fn get(addr: std::net::SocketAddr) -> String {
    let r = crate::common::http::get(addr, "/livez", &[])
        .await
        .expect("GET /livez");
    assert_eq!(r.status, 200, "{r:?}");
    r.body
}

/// Serves `GET /livez` on a free loopback port through the listener `wrap`
/// makes; returns the address.
async fn serve_livez(
    wrap: impl FnOnce(tokio::net::TcpListener) -> LimitedListener,
) -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let app = axum::Router::new().route("/livez", axum::routing::get(|| async { "OK\n" }));
    let listener = wrap(l);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

#[tokio::test]
async fn idle_connections_beyond_the_cap_wait_and_the_port_recovers() {
    let addr = serve_livez(|l| LimitedListener::new(l, 2, false, "test")).await;
    assert!(get(addr).await.ends_with("OK\n"));
    // Two idle connections take both permits.
    let idle1 = TcpStream::connect(addr).await.expect("connect");
    let _idle2 = TcpStream::connect(addr).await.expect("connect");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waiting = tokio::spawn(get(addr));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "a third connection is not served while two are held"
    );
    drop(idle1);
    let body = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("served once a permit frees")
        .expect("task");
    assert!(body.ends_with("OK\n"), "{body}");
}

#[test]
fn the_cap_follows_the_open_files_limit() {
    let n = per_port_limit();
    assert!(
        (16..=bucket_rls::conn_limit::MAX_PER_PORT).contains(&n),
        "{n}"
    );
}

/// A connection that sends nothing within the first-byte timeout is closed
/// and gives its permit back; a connection that spoke may then stay idle
/// longer than that timeout and is still served (Envoy keeps its gRPC
/// connection open between requests).
#[tokio::test]
async fn silent_connections_are_closed_after_the_first_byte_timeout() {
    let addr = serve_livez(|l| {
        LimitedListener::new(l, 2, false, "test").first_byte_timeout(Duration::from_millis(300))
    })
    .await;
    // A client that speaks, then idles past the timeout: still served.
    let mut talker = TcpStream::connect(addr).await.expect("connect");
    let request = b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n";
    let mut buf = [0u8; 1024];
    talker.write_all(request).await.expect("write");
    let n = talker.read(&mut buf).await.expect("read");
    assert!(String::from_utf8_lossy(&buf[..n]).ends_with("OK\n"));
    // A silent client takes the other permit, and is closed after ~300 ms.
    let mut silent = TcpStream::connect(addr).await.expect("connect");
    let closed = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut buf))
        .await
        .expect("closed by the server within 5 s");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
    // Its permit is free again: a new client is served while the talker
    // still holds the other one.
    assert!(get(addr).await.ends_with("OK\n"));
    tokio::time::sleep(Duration::from_millis(500)).await;
    talker.write_all(request).await.expect("write");
    let n = talker.read(&mut buf).await.expect("read");
    assert!(
        String::from_utf8_lossy(&buf[..n]).ends_with("OK\n"),
        "an idle connection that spoke is kept"
    );
}

/// The attack: connections that send one byte and stop fill the admin port's
/// cap, so `/livez` waits and a liveness probe fails (a restart loop under
/// attack). With shedding, the new connection closes the one silent for the
/// longest and is served at once; connections that speak are kept.
#[tokio::test]
async fn at_the_cap_a_probe_is_served_by_closing_the_longest_silent_connection() {
    let addr = serve_livez(|l| {
        LimitedListener::new(l, 4, false, "test")
            .idle_timeout(Duration::from_secs(600))
            .shed_idle_when_full()
    })
    .await;
    let mut flood = Vec::new();
    for _ in 0..4 {
        let mut c = TcpStream::connect(addr).await.expect("connect");
        c.write_all(b"G").await.expect("one byte");
        flood.push(c);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    for round in 0..8 {
        let body = tokio::time::timeout(Duration::from_secs(10), get(addr))
            .await
            .unwrap_or_else(|_| panic!("probe {round} not served at the cap"));
        assert!(body.ends_with("OK\n"));
    }
    // The oldest one-byte connections were closed to make room.
    let mut buf = [0u8; 64];
    let closed = tokio::time::timeout(Duration::from_secs(5), flood[0].read(&mut buf))
        .await
        .expect("the longest-silent connection is closed");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
}

/// A connection that stops in the middle of a request head is closed after
/// the idle timeout and gives its permit back.
#[tokio::test]
async fn a_connection_stalled_mid_request_is_closed_after_the_idle_timeout() {
    let addr = serve_livez(|l| {
        LimitedListener::new(l, 1, false, "test").idle_timeout(Duration::from_millis(300))
    })
    .await;
    let mut stalled = TcpStream::connect(addr).await.expect("connect");
    stalled
        .write_all(b"GET /livez HTTP/1.1\r\nhost: x\r\n")
        .await
        .expect("write");
    let mut buf = [0u8; 1024];
    let closed = tokio::time::timeout(Duration::from_secs(10), stalled.read(&mut buf))
        .await
        .expect("closed by the server within 10 s");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
    let body = tokio::time::timeout(Duration::from_secs(10), get(addr))
        .await
        .expect("the permit is free again");
    assert!(body.ends_with("OK\n"));
}

/// On the gRPC port the whole HTTP/2 preface must arrive within the
/// first-byte timeout: one byte does not buy a connection forever.
#[tokio::test]
async fn a_connection_that_sends_part_of_its_opening_bytes_is_closed() {
    let addr = serve_livez(|l| {
        LimitedListener::new(l, 1, false, "test")
            .first_byte_timeout(Duration::from_millis(300))
            .opening_bytes(bucket_rls::conn_limit::HTTP2_PREFACE_BYTES)
    })
    .await;
    let mut c = TcpStream::connect(addr).await.expect("connect");
    c.write_all(b"P").await.expect("one byte");
    let mut buf = [0u8; 64];
    let closed = tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf))
        .await
        .expect("closed by the server within 10 s");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
}

/// Every HTTP port of the process (admin, Go metrics, debug) follows the
/// same rules. Started with 160 open files (16 connections a port): 20
/// connections that send one byte and stop fill each port, and a scrape is
/// answered at once by closing the longest silent one; and a request head
/// trickled a byte at a time (never silent long enough for the idle
/// timeout) is closed once the head deadline passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_http_port_sheds_silent_connections_and_bounds_the_request_head() {
    use crate::common::procs::{Proc, bucket_rls_bin};
    use crate::common::{free_port, http::get as http_get};
    use std::net::{Ipv4Addr, SocketAddr};
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("c.yaml");
    std::fs::write(
        &config,
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
    )
    .expect("config");
    let addr = || SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let (grpc, http, go, debug) = (addr(), addr(), addr(), addr());
    let mut cmd = std::process::Command::new("sh");
    cmd.arg("-c")
        .arg("ulimit -n 160 && exec \"$0\" \"$@\"")
        .arg(bucket_rls_bin())
        .args(["serve", "--config"])
        .arg(&config)
        .args(["--grpc-addr", &grpc.to_string()])
        .args(["--http-addr", &http.to_string()])
        .args(["--go-metrics-addr", &go.to_string()])
        .args(["--debug-addr", &debug.to_string()]);
    let mut proc = Proc::spawn("bucket-rls", cmd);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !matches!(http_get(http, "/healthcheck", &[]).await, Ok(r) if r.status == 200) {
        proc.assert_running();
        assert!(std::time::Instant::now() < deadline, "not healthy");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (port, path) in [(http, "/metrics"), (go, "/metrics"), (debug, "/rlconfig")] {
        let mut silent = Vec::new();
        for _ in 0..20 {
            let mut c = TcpStream::connect(port).await.expect("connect");
            c.write_all(b"G").await.expect("one byte");
            silent.push(c);
        }
        let r = tokio::time::timeout(Duration::from_secs(5), http_get(port, path, &[]))
            .await
            .unwrap_or_else(|_| panic!("{path} on {port} not answered with the port full"))
            .expect("GET");
        assert_eq!(r.status, 200, "{path} on {port}");
        drop(silent);
    }
    // A head trickled at a byte every 400 ms: never 10 s silent, closed by
    // the 10 s head deadline.
    let mut trickle = TcpStream::connect(go).await.expect("connect");
    let head = b"GET /metrics HTTP/1.1\r\nhost: x\r\nx-pad: ".to_vec();
    let started = std::time::Instant::now();
    let mut closed = false;
    for i in 0..100 {
        let byte = head.get(i).copied().unwrap_or(b'a');
        if trickle.write_all(&[byte]).await.is_err() {
            closed = true;
            break;
        }
        let mut buf = [0u8; 512];
        // The server answering (408) or closing ends the head.
        if tokio::time::timeout(Duration::from_millis(400), trickle.read(&mut buf))
            .await
            .is_ok()
        {
            closed = true;
            break;
        }
    }
    assert!(
        closed,
        "a trickled head is still open after {:?}",
        started.elapsed()
    );
    proc.assert_running();
}
