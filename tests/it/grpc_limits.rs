//! The gRPC port against abusive clients, over a raw HTTP/2 client: one
//! connection that opens streams and never grants flow-control window cannot
//! make the process hold an unbounded number of responses, and a body that is
//! not a valid message is the client's error.

use crate::common::procs::BucketRls;
use bytes::Bytes;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use futures::StreamExt;
use prost::Message;
use std::time::Duration;

const CONFIG: &str = "domain: flood\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1000000}\n";

/// A `ShouldRateLimit` request head for the raw client.
fn post(addr: std::net::SocketAddr) -> http::Request<()> {
    http::Request::post(format!(
        "http://{addr}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(())
    .unwrap()
}

/// `msg` as a gRPC message frame (uncompressed, 5-byte prefix).
fn framed(msg: &[u8]) -> Bytes {
    let mut b = Vec::with_capacity(5 + msg.len());
    b.push(0);
    b.extend_from_slice(&u32::try_from(msg.len()).unwrap().to_be_bytes());
    b.extend_from_slice(msg);
    Bytes::from(b)
}

/// A gRPC unary request frame (uncompressed, 5-byte prefix) for `ShouldRateLimit`.
fn frame(i: usize) -> Bytes {
    let msg = crate::common::req(
        "flood",
        vec![crate::common::desc(&[("k", &format!("value-{i}"))])],
        1,
    )
    .encode_to_vec();
    framed(&msg)
}

/// The service on [`CONFIG`] and a raw HTTP/2 client connected to its gRPC
/// port (the directory holds the config while the service runs).
async fn served_with_raw_client() -> (tempfile::TempDir, BucketRls, h2::client::SendRequest<Bytes>)
{
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("flood.yaml");
    std::fs::write(&config, CONFIG).unwrap();
    let rls = BucketRls::start(&config, &["--log-level", "warn"]).await;
    let tcp = tokio::net::TcpStream::connect(rls.grpc).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.expect("HTTP/2 handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let client = client.ready().await.expect("ready");
    (dir, rls, client)
}

/// The service on [`CONFIG`] with a process-wide memory budget of `bytes`
/// (the directory holds the config while the service runs).
async fn served_with_budget(bytes: &str) -> (tempfile::TempDir, BucketRls) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("flood.yaml");
    std::fs::write(&config, CONFIG).unwrap();
    let rls = BucketRls::start(
        &config,
        &["--log-level", "warn", "--max-buffered-request-bytes", bytes],
    )
    .await;
    (dir, rls)
}

/// The attack: `h2load -c 1 -m N -w 0` with a `ShouldRateLimit` body. One
/// connection with a stream window of 0 tries to open 20,000 streams; before
/// the bound, every one was decided and its response held in memory (about
/// 6 KiB each: 20,000 streams took over 100 MiB). Now the server advertises
/// `SETTINGS_MAX_CONCURRENT_STREAMS`, the client can open no more, and RSS
/// stays within a bound that does not depend on the number of streams asked
/// for. Other connections keep being served.
#[tokio::test]
async fn a_peer_granting_no_window_holds_bounded_streams_and_memory() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("flood.yaml");
    std::fs::write(&config, CONFIG).unwrap();
    let rls = BucketRls::start(&config, &["--log-level", "warn"]).await;
    let (rss_before, _) = rls.proc.rss_kib();

    let tcp = tokio::net::TcpStream::connect(rls.grpc).await.unwrap();
    let (client, mut conn) = h2::client::Builder::new()
        .initial_window_size(0)
        .max_concurrent_reset_streams(0)
        .handshake::<_, Bytes>(tcp)
        .await
        .expect("HTTP/2 handshake");
    let mut pings = conn.ping_pong().expect("ping handle");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    // A PONG arrives after the server's SETTINGS: the limit is known now.
    pings.ping(h2::Ping::opaque()).await.expect("pong");
    let advertised = client.current_max_send_streams();
    assert!(
        advertised <= bucket_rls::grpc::PortLimits::DEFAULT.max_concurrent_streams as usize,
        "server advertises at most {} concurrent streams, not {advertised}",
        bucket_rls::grpc::PortLimits::DEFAULT.max_concurrent_streams
    );

    const ASKED: usize = 20_000;
    let mut client = client;
    let mut held = futures::stream::FuturesUnordered::new();
    for i in 0..ASKED {
        client = client.ready().await.expect("connection alive");
        let (resp, mut body) = client.send_request(post(rls.grpc), false).expect("stream");
        body.send_data(frame(i), true).expect("body");
        held.push(async move { (resp.await, body) });
    }
    // The client queues streams past the advertised limit; a slot frees only
    // when a response completes, which needs window this client never grants.
    // Count the streams the server answered (response headers are not flow
    // controlled) until none arrives for 2 s.
    let mut answered = Vec::new();
    while let Ok(Some(r)) = tokio::time::timeout(Duration::from_secs(2), held.next()).await {
        answered.push(r);
    }
    let opened = answered.len();
    assert!(
        opened <= bucket_rls::grpc::PortLimits::DEFAULT.max_concurrent_streams as usize,
        "one connection had {opened} of {ASKED} streams answered"
    );

    // The server has decided what it accepted (the responses wait for
    // window); sample its memory while it holds them.
    let other = format!("http://{}", rls.grpc);
    let mut grpc = RateLimitServiceClient::connect(other)
        .await
        .expect("connect");
    let mut peak = 0;
    for i in 0..20 {
        let r = grpc
            .should_rate_limit(crate::common::req(
                "flood",
                vec![crate::common::desc(&[("k", &format!("other-{i}"))])],
                1,
            ))
            .await
            .expect("another connection is served while one is flooded");
        assert_eq!(r.into_inner().overall_code, 1, "OK");
        peak = peak.max(rls.proc.rss_kib().0);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let grown_mib = peak.saturating_sub(rss_before) >> 10;
    eprintln!(
        "flood: {opened} of {ASKED} streams opened; RSS {} KiB before, {peak} KiB peak",
        rss_before
    );
    assert!(
        grown_mib <= 48,
        "one connection grew RSS by {grown_mib} MiB ({opened} streams)"
    );
    drop((answered, held));
}

/// A call is answered once its one message has arrived; the rest of its
/// body is never read or held, so a client that keeps sending after the
/// message (without ending the stream) cannot grow the server's memory.
#[tokio::test]
async fn a_call_is_answered_once_its_message_is_complete_and_its_tail_is_not_held() {
    let (_dir, rls, mut client) = served_with_raw_client().await;
    let (rss_before, _) = rls.proc.rss_kib();
    let mut answered = 0;
    for i in 0..8 {
        client = client.ready().await.expect("connection alive");
        let (resp, mut body) = client.send_request(post(rls.grpc), false).expect("stream");
        body.send_data(frame(i), false).expect("message");
        // 4 MiB more on the same stream, never ended.
        let tail = Bytes::from(vec![0u8; 64 * 1024]);
        for _ in 0..64 {
            body.reserve_capacity(tail.len());
            if body.send_data(tail.clone(), false).is_err() {
                break;
            }
        }
        let resp = tokio::time::timeout(Duration::from_secs(5), resp)
            .await
            .expect("answered before the stream ends")
            .expect("response");
        assert_eq!(resp.status(), 200);
        let mut resp_body = resp.into_body();
        let msg = resp_body.data().await.expect("message").expect("data");
        let decoded =
            envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse::decode(&msg[5..])
                .expect("a RateLimitResponse");
        assert_eq!(decoded.overall_code, 1, "OK");
        answered += 1;
    }
    assert_eq!(answered, 8);
    let grown_mib = rls.proc.rss_kib().0.saturating_sub(rss_before) >> 10;
    assert!(grown_mib <= 48, "RSS grew by {grown_mib} MiB");
}

/// Streams a client resets before the server takes them (Envoy cancelling
/// calls at its timeout) do not close the connection: the calls after them
/// on the same connection are answered.
#[tokio::test]
async fn many_streams_reset_before_they_are_taken_keep_the_connection() {
    let (_dir, rls, mut client) = served_with_raw_client().await;
    // All in one burst: each request's HEADERS and DATA, then its RST_STREAM.
    for i in 0..200 {
        client = client.ready().await.expect("connection alive");
        let (_resp, mut body) = client.send_request(post(rls.grpc), false).expect("stream");
        body.send_data(frame(i), false).expect("message");
        body.send_reset(h2::Reason::CANCEL);
    }
    for i in 0..3 {
        client = client.ready().await.expect("connection still open");
        let (resp, mut body) = client.send_request(post(rls.grpc), false).expect("stream");
        body.send_data(frame(1000 + i), true).expect("message");
        let resp = tokio::time::timeout(Duration::from_secs(5), resp)
            .await
            .expect("answered")
            .expect("the connection was not closed");
        assert_eq!(resp.status(), 200);
    }
}

/// A domain that is not UTF-8 (protobuf `string` fields must be) is the
/// client's error: `INVALID_ARGUMENT`, not tonic's `INTERNAL`, which reads as
/// a fault of the service. The service keeps serving.
#[tokio::test]
async fn a_request_that_does_not_decode_is_invalid_argument() {
    let (_dir, rls, mut client) = served_with_raw_client().await;
    // Field 1 (domain), length 2, bytes that are not UTF-8.
    for msg in [&[0x0a, 0x02, 0xff, 0xfe][..], &[0x0a, 0x09, b'x'][..]] {
        let (resp, mut body) = client.send_request(post(rls.grpc), false).expect("stream");
        body.send_data(framed(msg), true).expect("body");
        let resp = resp.await.expect("response");
        let status = resp
            .headers()
            .get("grpc-status")
            .map(|v| v.to_str().unwrap().to_owned());
        assert_eq!(status.as_deref(), Some("3"), "{msg:?}: {resp:?}");
        client = client.ready().await.expect("ready");
    }
    let mut grpc = RateLimitServiceClient::connect(format!("http://{}", rls.grpc))
        .await
        .expect("connect");
    let r = grpc
        .should_rate_limit(crate::common::req(
            "flood",
            vec![crate::common::desc(&[("k", "v")])],
            1,
        ))
        .await
        .expect("still serving");
    assert_eq!(r.into_inner().overall_code, 1);
}

/// The process-wide budget of buffered request bytes (5 MiB here): two
/// gRPC calls that declare 2 MiB messages and never finish them hold 4 MiB;
/// of three such calls exactly one is refused at once with
/// `RESOURCE_EXHAUSTED`, a small call is still decided, and an admin
/// request with a 1.5 MiB body gets 503 before its body is read. Once the
/// unfinished calls are reset the budget is free again.
#[tokio::test]
async fn past_the_request_memory_budget_new_calls_are_refused_and_others_finish() {
    let (_dir, rls) = served_with_budget("5242880").await;
    let tcp = tokio::net::TcpStream::connect(rls.grpc).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.expect("HTTP/2 handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut client = client.ready().await.expect("ready");
    // Three calls, each declaring a 2 MiB message and sending 1,000 bytes.
    let mut big = Vec::new();
    for _ in 0..3 {
        let (resp, mut body) = client.send_request(post(rls.grpc), false).expect("stream");
        let mut head = vec![0u8];
        head.extend_from_slice(&(2u32 << 20).to_be_bytes());
        head.extend_from_slice(&[0u8; 1000]);
        body.send_data(Bytes::from(head), false)
            .expect("part of a message");
        big.push((resp, body));
        client = client.ready().await.expect("ready");
    }
    let mut refused = 0;
    let mut waiting = Vec::new();
    for (resp, body) in big {
        match tokio::time::timeout(Duration::from_secs(2), resp).await {
            Ok(r) => {
                let r = r.expect("response");
                let status = r
                    .headers()
                    .get("grpc-status")
                    .map(|v| v.to_str().unwrap().to_owned());
                assert_eq!(status.as_deref(), Some("8"), "{r:?}");
                refused += 1;
            }
            Err(_) => waiting.push(body),
        }
    }
    assert_eq!((refused, waiting.len()), (1, 2), "one of three refused");
    // A small call fits in what is left.
    let (resp, mut body) = client.send_request(post(rls.grpc), false).expect("stream");
    body.send_data(frame(1), true).expect("message");
    let resp = tokio::time::timeout(Duration::from_secs(5), resp)
        .await
        .expect("answered")
        .expect("response");
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().get("grpc-status").is_none(), "{resp:?}");
    // The admin port refuses a 1.5 MiB body before reading it.
    let json = r#"{"domain":"flood","descriptors":[{"entries":[{"key":"k","value":"v"}]}]}"#;
    let padded = format!("{}{json}", " ".repeat(3 << 19));
    let r = crate::common::http::request(rls.http, "POST", "/json", Some(&padded)).await;
    assert_eq!(r.status, 503, "{r:?}");
    // The unfinished calls end: the budget is given back.
    for mut b in waiting {
        b.send_reset(h2::Reason::CANCEL);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = crate::common::http::request(rls.http, "POST", "/json", Some(&padded)).await;
        if r.status == 200 {
            break;
        }
        assert_eq!(r.status, 503, "{r:?}");
        assert!(
            std::time::Instant::now() < deadline,
            "the budget was not given back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sends a small call until it is admitted (OK), for at most `within`;
/// until then every answer must be `RESOURCE_EXHAUSTED` (the budget is
/// used up). Panics with `what` when the time runs out.
async fn admitted_within(
    grpc: &mut RateLimitServiceClient<tonic::transport::Channel>,
    within: Duration,
    what: &str,
) {
    let deadline = std::time::Instant::now() + within;
    loop {
        let call = crate::common::req("flood", vec![crate::common::desc(&[("k", "admitted")])], 1);
        match grpc.should_rate_limit(call).await {
            Ok(r) => {
                assert_eq!(r.into_inner().overall_code, 1, "OK");
                return;
            }
            Err(s) => {
                assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{s:?}");
                assert!(std::time::Instant::now() < deadline, "{what}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// What one window-less connection got for its calls: answers that began
/// (response headers without `grpc-status`: the message waits for window)
/// and calls refused with `RESOURCE_EXHAUSTED`. The connection is dropped
/// on return.
async fn window_less_calls(rls: &BucketRls, calls: usize) -> (usize, usize) {
    let tcp = tokio::net::TcpStream::connect(rls.grpc).await.unwrap();
    let (client, mut conn) = h2::client::Builder::new()
        .initial_window_size(0)
        .handshake::<_, Bytes>(tcp)
        .await
        .expect("HTTP/2 handshake");
    let mut pings = conn.ping_pong().expect("ping handle");
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    pings.ping(h2::Ping::opaque()).await.expect("pong");
    let mut client = client;
    let mut held = futures::stream::FuturesUnordered::new();
    for i in 0..calls {
        client = client.ready().await.expect("connection alive");
        let (resp, mut body) = client.send_request(post(rls.grpc), false).expect("stream");
        body.send_data(frame(i), true).expect("body");
        held.push(async move { (resp.await, body) });
    }
    let (mut begun, mut refused) = (0, 0);
    let mut kept = Vec::new();
    while let Ok(Some((resp, body))) =
        tokio::time::timeout(Duration::from_secs(2), held.next()).await
    {
        let resp = resp.expect("a response, not a reset");
        match resp
            .headers()
            .get("grpc-status")
            .map(|v| v.to_str().unwrap().to_owned())
        {
            None => begun += 1,
            Some(s) => {
                assert_eq!(s, "8", "refused with RESOURCE_EXHAUSTED: {resp:?}");
                refused += 1;
            }
        }
        kept.push((resp, body));
    }
    drop((kept, held, client));
    task.abort();
    (begun, refused)
}

/// Streams count in the process-wide budget from the moment they are taken
/// until their answer is sent: a peer that opens calls and never grants
/// window to answer them holds at most what the budget allows (1 MiB here,
/// about 4 KiB a stream), past it its calls are refused at once with
/// `RESOURCE_EXHAUSTED`, and when it goes away the budget is free again
/// for the next one. (Before, every stream's answer waited in memory
/// outside the budget, so connections multiplied it.)
#[tokio::test]
async fn streams_whose_answers_a_peer_does_not_take_count_in_the_memory_budget() {
    let (_dir, rls) = served_with_budget("1048576").await;
    const CALLS: usize = 600;
    let most = 1_048_576 / bucket_rls::grpc::STREAM_STATE_BYTES;
    let (begun, refused) = window_less_calls(&rls, CALLS).await;
    assert!(
        begun >= 1,
        "some answers began ({begun} began, {refused} refused)"
    );
    assert!(
        refused >= CALLS - most,
        "at most {most} of {CALLS} streams fit in the budget: {refused} refused, {begun} began"
    );
    // Another client is served once that peer is gone.
    let mut grpc = RateLimitServiceClient::connect(format!("http://{}", rls.grpc))
        .await
        .expect("connect");
    admitted_within(
        &mut grpc,
        Duration::from_secs(10),
        "the budget never came back",
    )
    .await;
    // The same peer again gets as many streams as the first time.
    let (begun_again, refused_again) = window_less_calls(&rls, CALLS).await;
    assert_eq!(
        begun_again, begun,
        "{refused_again} refused the second time"
    );
}

/// Long-lived streams answered by the fallback (reflection here; health
/// `Watch` and the quota service alike) count in the budget too, and an
/// answer the peer grants no window for gives the budget back after the
/// same 10 s as a unary answer, while the peer stays connected. While the
/// budget is used up, gRPC health checks still answer from their own small
/// reserve, so liveness probes of a serving replica do not fail.
#[tokio::test]
async fn fallback_streams_count_in_the_budget_and_health_checks_keep_answering() {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    let (_dir, rls) = served_with_budget("65536").await;
    let tcp = tokio::net::TcpStream::connect(rls.grpc).await.unwrap();
    let (client, mut conn) = h2::client::Builder::new()
        .initial_window_size(0)
        .handshake::<_, Bytes>(tcp)
        .await
        .expect("HTTP/2 handshake");
    let mut pings = conn.ping_pong().expect("ping handle");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    pings.ping(h2::Ping::opaque()).await.expect("pong");
    let list = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    }
    .encode_to_vec();
    let mut client = client;
    let mut held = Vec::new();
    for _ in 0..40 {
        client = client.ready().await.expect("connection alive");
        let req = http::Request::post(format!(
            "http://{}/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            rls.grpc
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
        let (resp, mut body) = client.send_request(req, false).expect("stream");
        // The stream stays open: more questions could follow.
        body.send_data(framed(&list), false).expect("question");
        held.push((resp, body));
    }
    let mut grpc = RateLimitServiceClient::connect(format!("http://{}", rls.grpc))
        .await
        .expect("connect");
    let call = || crate::common::req("flood", vec![crate::common::desc(&[("k", "probe")])], 1);
    // The reflection streams fill the 64 KiB budget (as soon as the
    // service has read them: a loaded machine may take a while).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match grpc.should_rate_limit(call()).await {
            Err(s) if s.code() == tonic::Code::ResourceExhausted => break,
            other => {
                assert!(other.is_ok(), "{other:?}");
                assert!(
                    std::time::Instant::now() < deadline,
                    "the budget never filled"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    // Health checks answer all the same.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", rls.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let status = health
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("a health check past the budget")
        .into_inner()
        .status;
    assert_eq!(
        ServingStatus::try_from(status).unwrap(),
        ServingStatus::Serving
    );
    // The reflection answers wait for window at most 10 s: then the budget
    // is back although the peer is still connected.
    admitted_within(
        &mut grpc,
        Duration::from_secs(40),
        "the budget never came back while the peer stayed",
    )
    .await;
    assert!(
        client.ready().await.is_ok(),
        "the peer's connection is still open"
    );
    drop(held);
}
