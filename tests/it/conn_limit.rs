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
