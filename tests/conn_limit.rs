//! Connection caps: idle connections beyond the cap wait instead of exhausting
//! file descriptors, and the port serves again as soon as one closes.

use bucket_rls::conn_limit::{LimitedListener, per_port_limit};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn get(addr: std::net::SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(b"GET /livez HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read");
    out
}

#[tokio::test]
async fn idle_connections_beyond_the_cap_wait_and_the_port_recovers() {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let app = axum::Router::new().route("/livez", axum::routing::get(|| async { "OK\n" }));
    tokio::spawn(async move {
        let _ = axum::serve(LimitedListener::new(l, 2, false, "test"), app).await;
    });
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
