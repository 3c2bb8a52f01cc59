//! gRPC server reflection on the gRPC port, as grpcurl uses it: the
//! services are listed, the file of `RateLimitService` and every file it
//! imports are served, and a request built from the reflected field names
//! alone (as `grpcurl -d '{...}'` builds one) is the request the service
//! decodes. `--disable-grpc-reflection` turns it off.

use crate::common::procs::BucketRls;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use prost::Message;
use prost_types::{DescriptorProto, FileDescriptorProto};
use std::collections::BTreeMap;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

const CONFIG: &str = "domain: refl\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1}\n";

async fn ask(
    client: &mut ServerReflectionClient<tonic::transport::Channel>,
    req: MessageRequest,
) -> Result<MessageResponse, tonic::Status> {
    let stream = tokio_stream::iter([ServerReflectionRequest {
        host: String::new(),
        message_request: Some(req),
    }]);
    let mut answers = client.server_reflection_info(stream).await?.into_inner();
    let answer = answers.message().await?.expect("one answer");
    Ok(answer.message_response.expect("a response"))
}

/// Every file `symbol` needs, by name, fetched as a reflection client does.
async fn files_for(
    client: &mut ServerReflectionClient<tonic::transport::Channel>,
    symbol: &str,
) -> BTreeMap<String, FileDescriptorProto> {
    let mut files = BTreeMap::new();
    let mut todo = vec![MessageRequest::FileContainingSymbol(symbol.into())];
    while let Some(req) = todo.pop() {
        let MessageResponse::FileDescriptorResponse(r) =
            ask(client, req).await.expect("reflection")
        else {
            panic!("not a file descriptor answer");
        };
        for bytes in r.file_descriptor_proto {
            let f = FileDescriptorProto::decode(bytes.as_slice()).expect("descriptor");
            for d in &f.dependency {
                if !files.contains_key(d) {
                    todo.push(MessageRequest::FileByFilename(d.clone()));
                }
            }
            files.insert(f.name().to_owned(), f);
        }
    }
    files
}

fn message<'a>(
    files: &'a BTreeMap<String, FileDescriptorProto>,
    full: &str,
) -> &'a DescriptorProto {
    fn find<'a>(
        prefix: &str,
        ms: &'a [DescriptorProto],
        full: &str,
    ) -> Option<&'a DescriptorProto> {
        ms.iter().find_map(|m| {
            let name = format!("{prefix}.{}", m.name());
            if name == full {
                Some(m)
            } else {
                find(&name, &m.nested_type, full)
            }
        })
    }
    files
        .values()
        .find_map(|f| find(&format!(".{}", f.package()), &f.message_type, full))
        .unwrap_or_else(|| panic!("{full} not described"))
}

fn number(m: &DescriptorProto, field: &str) -> u32 {
    u32::try_from(
        m.field
            .iter()
            .find(|f| f.name() == field)
            .unwrap_or_else(|| panic!("{} has no field {field}", m.name()))
            .number(),
    )
    .expect("field number")
}

/// A length-delimited field.
fn bytes_field(n: u32, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    prost::encoding::encode_key(n, prost::encoding::WireType::LengthDelimited, &mut out);
    prost::encoding::encode_varint(body.len() as u64, &mut out);
    out.extend_from_slice(body);
    out
}

#[tokio::test]
async fn grpcurl_style_reflection_lists_describes_and_builds_a_request() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("refl.yaml"), CONFIG).expect("config");
    let rls = BucketRls::start(dir.path(), &[]).await;
    let mut client = ServerReflectionClient::new(
        tonic::transport::Endpoint::from_shared(format!("http://{}", rls.grpc))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect"),
    );

    let MessageResponse::ListServicesResponse(list) =
        ask(&mut client, MessageRequest::ListServices(String::new()))
            .await
            .expect("list services")
    else {
        panic!("not a service list");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for want in [
        "envoy.service.ratelimit.v3.RateLimitService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} not in {names:?}");
    }

    let files = files_for(&mut client, "envoy.service.ratelimit.v3.RateLimitService").await;
    let rls_file = &files["envoy/service/ratelimit/v3/rls.proto"];
    let method = &rls_file.service[0].method[0];
    assert_eq!(method.name(), "ShouldRateLimit");
    assert_eq!(
        method.input_type(),
        ".envoy.service.ratelimit.v3.RateLimitRequest"
    );

    // `{"domain": "refl", "descriptors": [{"entries": [{"key": "user",
    // "value": "ann"}]}]}`, encoded from the reflected names only.
    let request = message(&files, ".envoy.service.ratelimit.v3.RateLimitRequest");
    let descriptor = message(
        &files,
        ".envoy.extensions.common.ratelimit.v3.RateLimitDescriptor",
    );
    let entry = message(
        &files,
        ".envoy.extensions.common.ratelimit.v3.RateLimitDescriptor.Entry",
    );
    let entry_bytes = [
        bytes_field(number(entry, "key"), b"user"),
        bytes_field(number(entry, "value"), b"ann"),
    ]
    .concat();
    let wire = [
        bytes_field(number(request, "domain"), b"refl"),
        bytes_field(
            number(request, "descriptors"),
            &bytes_field(number(descriptor, "entries"), &entry_bytes),
        ),
    ]
    .concat();
    let decoded = RateLimitRequest::decode(wire.as_slice()).expect("the service's message");
    assert_eq!(decoded.domain, "refl");
    assert_eq!(decoded.descriptors[0].entries[0].key, "user");
    assert_eq!(decoded.descriptors[0].entries[0].value, "ann");
    let mut rl = RateLimitServiceClient::connect(format!("http://{}", rls.grpc))
        .await
        .expect("connect");
    let codes: Vec<i32> = [
        rl.should_rate_limit(decoded.clone()).await.expect("call"),
        rl.should_rate_limit(decoded).await.expect("call"),
    ]
    .into_iter()
    .map(|r| r.into_inner().overall_code)
    .collect();
    assert_eq!(codes, [1, 2], "OK, then OVER_LIMIT at 1 per minute");
}

#[tokio::test]
async fn reflection_can_be_turned_off() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("refl.yaml"), CONFIG).expect("config");
    let rls = BucketRls::start(dir.path(), &["--disable-grpc-reflection"]).await;
    let mut client = ServerReflectionClient::new(
        tonic::transport::Endpoint::from_shared(format!("http://{}", rls.grpc))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect"),
    );
    let err = ask(&mut client, MessageRequest::ListServices(String::new()))
        .await
        .expect_err("no reflection service");
    assert_eq!(err.code(), tonic::Code::Unimplemented, "{err:?}");
}
