//! OTLP tracing: with `--otlp-endpoint`, a `ShouldRateLimit` call whose
//! metadata carries a sampled W3C `traceparent` is exported as a server span
//! child of it, with one client span per Redis script call under it; a call
//! without a parent is sampled by `--tracing-sampling-rate`. The collector is
//! an OTLP/HTTP receiver in the test.

use crate::common::procs::BucketRls;
use crate::common::redis::RedisServer;
use crate::common::{desc, eventually::eventually, req};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Every span received, with its resource's `service.name`.
type Received = Arc<Mutex<Vec<(String, Span)>>>;

/// An OTLP/HTTP receiver: `POST /v1/traces` with a protobuf body.
async fn collector() -> (String, Received) {
    let received: Received = Arc::default();
    let store = received.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let store = store.clone();
            async move {
                let req = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf body");
                for rs in req.resource_spans {
                    let service = rs
                        .resource
                        .iter()
                        .flat_map(|r| &r.attributes)
                        .find(|a| a.key == "service.name")
                        .and_then(|a| match a.value.as_ref()?.value.as_ref()? {
                            Any::StringValue(s) => Some(s.clone()),
                            _ => None,
                        })
                        .unwrap_or_default();
                    for ss in rs.scope_spans {
                        for span in ss.spans {
                            store.lock().unwrap().push((service.clone(), span));
                        }
                    }
                }
                (
                    [("content-type", "application/x-protobuf")],
                    ExportTraceServiceResponse::default().encode_to_vec(),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .await
        .expect("bind collector");
    let addr = listener.local_addr().expect("collector addr");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("collector") });
    (format!("http://{addr}"), received)
}

fn attr<'a>(span: &'a Span, key: &str) -> Option<&'a Any> {
    span.attributes
        .iter()
        .find(|a| a.key == key)
        .and_then(|a| a.value.as_ref()?.value.as_ref())
}

#[tokio::test]
async fn a_sampled_envoy_trace_gets_a_server_span_and_a_redis_span_under_it() {
    let (endpoint, received) = collector().await;
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("d.yaml"),
        "domain: traced\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1}\n",
    )
    .expect("config");
    let rls = BucketRls::start(
        dir.path(),
        &[
            "--redis-url",
            &redis.url(),
            "--otlp-endpoint",
            &endpoint,
            "--tracing-service-name",
            "rls-under-test",
            // Calls without a parent are never traced: only the sampled
            // parent below makes a span.
            "--tracing-sampling-rate",
            "0",
        ],
    )
    .await;
    let mut client = RateLimitServiceClient::connect(format!("http://{}", rls.grpc))
        .await
        .expect("connect");
    // First, a call without a parent: at rate 0 it is not traced, and if it
    // were, its span would be queued before the next call's.
    client
        .should_rate_limit(req("traced", vec![desc(&[("user", "a")])], 1))
        .await
        .expect("call");
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let parent_id = "b7ad6b7169203331";
    let mut call = tonic::Request::new(req("traced", vec![desc(&[("user", "a")])], 1));
    call.metadata_mut().insert(
        "traceparent",
        format!("00-{trace_id}-{parent_id}-01")
            .parse()
            .expect("ascii"),
    );
    let answer = client
        .should_rate_limit(call)
        .await
        .expect("call")
        .into_inner();
    assert_eq!(
        answer.overall_code, 2,
        "the second call is over the 1/minute limit"
    );

    let (spans, _) = eventually(
        Duration::from_secs(20),
        "the server and Redis spans",
        || {
            let received = received.clone();
            async move {
                let got = received.lock().unwrap().clone();
                (got.len() >= 2).then_some(got)
            }
        },
    )
    .await;
    assert_eq!(
        spans.len(),
        2,
        "exactly the traced call's two spans: {spans:?}"
    );
    assert!(spans.iter().all(|(service, _)| service == "rls-under-test"));
    let server = &spans
        .iter()
        .find(|(_, s)| s.name == "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
        .expect("server span")
        .1;
    assert_eq!(hex::encode(&server.trace_id), trace_id);
    assert_eq!(hex::encode(&server.parent_span_id), parent_id);
    assert_eq!(server.kind, 2, "SPAN_KIND_SERVER");
    assert_eq!(
        attr(server, "ratelimit.domain"),
        Some(&Any::StringValue("traced".into()))
    );
    assert_eq!(
        attr(server, "ratelimit.overall_code"),
        Some(&Any::StringValue("OVER_LIMIT".into()))
    );
    let redis_span = &spans
        .iter()
        .find(|(_, s)| s.name == "FCALL")
        .expect("Redis span")
        .1;
    assert_eq!(redis_span.trace_id, server.trace_id);
    assert_eq!(redis_span.parent_span_id, server.span_id);
    assert_eq!(redis_span.kind, 3, "SPAN_KIND_CLIENT");
    assert_eq!(
        attr(redis_span, "db.system.name"),
        Some(&Any::StringValue("redis".into()))
    );
}
