//! The gRPC port (served on h2 directly, `src/grpc/`) seen by a raw
//! HTTP/2 client: tonic's status codes for malformed messages, other paths
//! answered by tonic, and many concurrent calls on one connection answered
//! each exactly once.

use bucket_rls::app::{self, Listeners};
use bucket_rls::storage::clock::ManualClock;
use bucket_rls::storage::memory::MemoryStorage;
use bucket_rls::storage::{Charge, RequestResult, Storage, StorageError};
use bytes::Bytes;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use http::{HeaderMap, Request};
use prost::Message as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

const YAML: &str = "domain: edge\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 10}\n";
const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// Serves a memory-backed limiter on loopback until the returned sender is dropped.
async fn server() -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    server_on(Arc::new(MemoryStorage::new(Arc::new(ManualClock::new(
        1_000_000,
    )))))
    .await
}

/// Serves a limiter over `storage` on loopback until the returned sender is dropped.
async fn server_on(storage: Arc<dyn Storage>) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let l = crate::common::limiter(YAML, storage, "e:");
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = grpc.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(app::run(Listeners { grpc, http }, l, async move {
        let _ = stopped.await;
    }));
    (addr, stop)
}

async fn connect(addr: SocketAddr) -> h2::client::SendRequest<Bytes> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    client
}

/// One call: the response headers, its data, and its trailers (`None` for a
/// trailers-only answer, whose status is in the headers).
async fn call(
    client: &h2::client::SendRequest<Bytes>,
    path: &str,
    body: Vec<u8>,
) -> (HeaderMap, Vec<u8>, Option<HeaderMap>) {
    call_with(client, path, body, &[]).await
}

/// [`call`] with extra request headers.
async fn call_with(
    client: &h2::client::SendRequest<Bytes>,
    path: &str,
    body: Vec<u8>,
    headers: &[(&str, &str)],
) -> (HeaderMap, Vec<u8>, Option<HeaderMap>) {
    let mut req = Request::post(format!("http://localhost{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(()).unwrap();
    let mut client = client.clone().ready().await.unwrap();
    let (resp, mut send) = client.send_request(req, false).unwrap();
    send.send_data(Bytes::from(body), true).unwrap();
    let (parts, mut recv) = resp.await.unwrap().into_parts();
    let mut data = Vec::new();
    while let Some(chunk) = recv.data().await {
        let chunk = chunk.unwrap();
        let _ = recv.flow_control().release_capacity(chunk.len());
        data.extend_from_slice(&chunk);
    }
    let trailers = recv.trailers().await.unwrap();
    (parts.headers, data, trailers)
}

fn framed(flag: u8, msg: &[u8]) -> Vec<u8> {
    let mut out = vec![flag];
    out.extend_from_slice(&u32::try_from(msg.len()).unwrap().to_be_bytes());
    out.extend_from_slice(msg);
    out
}

fn request(user: &str) -> Vec<u8> {
    let req = RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "user".into(),
                value: user.into(),
            }],
            ..Default::default()
        }],
        ..Default::default()
    };
    framed(0, &req.encode_to_vec())
}

/// The `grpc-status` of an answer: from the trailers, or from the headers of
/// a trailers-only answer.
fn grpc_status(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> String {
    trailers
        .and_then(|t| t.get("grpc-status"))
        .or_else(|| headers.get("grpc-status"))
        .expect("a grpc-status")
        .to_str()
        .unwrap()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_get_tonics_status_codes_and_undecodable_ones_invalid_argument() {
    let (addr, _stop) = server().await;
    let client = connect(addr).await;

    let (h, data, t) = call(&client, PATH, request("a")).await;
    assert_eq!(h.get("content-type").unwrap(), "application/grpc");
    assert_eq!(grpc_status(&h, t.as_ref()), "0");
    let resp = RateLimitResponse::decode(&data[5..]).unwrap();
    assert_eq!(resp.overall_code, Code::Ok as i32);
    assert_eq!(
        usize::try_from(u32::from_be_bytes(data[1..5].try_into().unwrap())).unwrap(),
        data.len() - 5
    );

    // (body, expected grpc-status, words of the message)
    let cases: [(Vec<u8>, &str, &str); 4] = [
        (framed(1, b"\x0a\x04edge"), "13", "compressed-flag"),
        // Not a RateLimitRequest: the client's fault, INVALID_ARGUMENT
        // (tonic says INTERNAL).
        (framed(0, b"\xff\xff\xff"), "3", "invalid RateLimitRequest"),
        (Vec::new(), "13", "Missing request message"),
        (vec![0, 0x7f, 0xff, 0xff, 0xff], "11", "too large"),
    ];
    for (body, code, words) in cases {
        let (h, data, t) = call(&client, PATH, body.clone()).await;
        assert_eq!(grpc_status(&h, t.as_ref()), code, "body {body:?}");
        assert!(data.is_empty(), "an error carries no message");
        let msg = h
            .get("grpc-message")
            .map(|m| m.to_str().unwrap().replace("%20", " "))
            .unwrap_or_default();
        assert!(msg.contains(words), "{msg:?} for {body:?}");
    }

    let (h, _, t) = call_with(&client, PATH, request("a"), &[("grpc-encoding", "gzip")]).await;
    assert_eq!(grpc_status(&h, t.as_ref()), "12", "gzip is not enabled");
    assert_eq!(h.get("grpc-accept-encoding").unwrap(), "identity");

    // Other methods are tonic's: UNIMPLEMENTED.
    let other = "/envoy.service.ratelimit.v3.RateLimitService/NoSuchMethod";
    let (h, _, t) = call(&client, other, request("a")).await;
    assert_eq!(grpc_status(&h, t.as_ref()), "12");
    // The connection still serves after all of these.
    let (h, _, t) = call(&client, PATH, request("a")).await;
    assert_eq!(grpc_status(&h, t.as_ref()), "0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_on_one_connection_are_each_answered_once() {
    let (addr, _stop) = server().await;
    let client = connect(addr).await;
    let calls = (0..64).map(|_| {
        let client = client.clone();
        async move { call(&client, PATH, request("shared")).await }
    });
    let answers = futures::future::join_all(calls).await;
    let mut ok = 0;
    let mut over = 0;
    for (h, data, t) in &answers {
        assert_eq!(grpc_status(h, t.as_ref()), "0");
        let resp = RateLimitResponse::decode(&data[5..]).unwrap();
        if resp.overall_code == Code::Ok as i32 {
            ok += 1;
        } else {
            over += 1;
        }
    }
    // 10 per minute on a stopped clock: exactly 10 of the 64 pass.
    assert_eq!((ok, over), (10, 54));
}

/// A storage whose calls never finish; counts the calls started and the
/// calls dropped unfinished.
#[derive(Debug, Default)]
struct Stuck {
    started: AtomicUsize,
    dropped: Arc<AtomicUsize>,
}

struct DropCount(Arc<AtomicUsize>);

impl Drop for DropCount {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[async_trait::async_trait]
impl Storage for Stuck {
    async fn apply(&self, _: &[Charge]) -> Result<RequestResult, StorageError> {
        let _guard = DropCount(self.dropped.clone());
        self.started.fetch_add(1, Ordering::SeqCst);
        std::future::pending().await
    }
    async fn ping(&self) -> Result<(), StorageError> {
        Ok(())
    }
    fn name(&self) -> &'static str {
        "stuck"
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_the_client_resets_is_dropped_and_the_connection_serves_on() {
    let stuck = Arc::new(Stuck::default());
    let (addr, _stop) = server_on(stuck.clone()).await;
    let client = connect(addr).await;
    let req = Request::post(format!("http://localhost{PATH}"))
        .header("content-type", "application/grpc")
        .body(())
        .unwrap();
    let mut sender = client.clone().ready().await.unwrap();
    let (resp, mut send) = sender.send_request(req, false).unwrap();
    send.send_data(Bytes::from(request("a")), true).unwrap();
    let deadline = Duration::from_secs(10);
    crate::common::eventually::eventually(deadline, "the call to reach storage", || async {
        (stuck.started.load(Ordering::SeqCst) == 1).then_some(())
    })
    .await;
    assert_eq!(stuck.dropped.load(Ordering::SeqCst), 0);
    // Dropping both halves of the stream makes the client send RST_STREAM.
    drop((resp, send));
    crate::common::eventually::eventually(deadline, "the reset call to be dropped", || async {
        (stuck.dropped.load(Ordering::SeqCst) == 1).then_some(())
    })
    .await;
    // The connection is still usable: a call to another path is answered.
    let other = "/envoy.service.ratelimit.v3.RateLimitService/NoSuchMethod";
    let (h, _, t) = call(&client, other, request("a")).await;
    assert_eq!(grpc_status(&h, t.as_ref()), "12");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_its_grpc_timeout_is_cancelled_like_tonic() {
    let stuck = Arc::new(Stuck::default());
    let (addr, _stop) = server_on(stuck.clone()).await;
    let client = connect(addr).await;
    let (h, data, t) = call_with(&client, PATH, request("a"), &[("grpc-timeout", "50m")]).await;
    assert_eq!(grpc_status(&h, t.as_ref()), "1", "CANCELLED");
    assert_eq!(h.get("grpc-message").unwrap(), "Timeout%20expired");
    assert!(data.is_empty());
    assert_eq!(
        stuck.dropped.load(Ordering::SeqCst),
        1,
        "the storage call was dropped"
    );
}
