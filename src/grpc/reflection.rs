//! gRPC server reflection (`grpc.reflection.v1` and `v1alpha`) for the
//! services on the gRPC port, so `grpcurl` and other reflection clients can
//! list `envoy.service.ratelimit.v3.RateLimitService` and call
//! `ShouldRateLimit` without `.proto` files.
//!
//! The envoy-types crate compiles Envoy's protos but exports no descriptor
//! set, so the descriptors the reflection service serves are built here:
//! exactly the messages `ShouldRateLimit` reaches (request, response,
//! descriptor, header value, rate limit unit, and the well-known types they
//! use), with Envoy's package, message and field names and numbers
//! (`envoy/service/ratelimit/v3/rls.proto` and the files it imports). Each
//! file holds only what these messages need, so reflection never describes a
//! type the service does not speak. Validation annotations are left out.
//! A test encodes every field of the envoy-types messages and checks each
//! wire tag against these descriptors.

use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{
    DescriptorProto, EnumDescriptorProto, EnumValueDescriptorProto, FieldDescriptorProto,
    FileDescriptorProto, FileDescriptorSet, MessageOptions, MethodDescriptorProto,
    OneofDescriptorProto, ServiceDescriptorProto,
};

/// The service name reflection lists for `ShouldRateLimit`.
pub const RATE_LIMIT_SERVICE: &str = "envoy.service.ratelimit.v3.RateLimitService";

/// A field: `name`, number, type, and for messages and enums the full type
/// name (`.pkg.Msg`).
fn field(name: &str, number: i32, ty: Type, type_name: &str) -> FieldDescriptorProto {
    FieldDescriptorProto {
        name: Some(name.to_owned()),
        number: Some(number),
        label: Some(Label::Optional as i32),
        r#type: Some(ty as i32),
        type_name: (!type_name.is_empty()).then(|| type_name.to_owned()),
        json_name: Some(json_name(name)),
        ..Default::default()
    }
}

/// A repeated field.
fn repeated(name: &str, number: i32, ty: Type, type_name: &str) -> FieldDescriptorProto {
    FieldDescriptorProto {
        label: Some(Label::Repeated as i32),
        ..field(name, number, ty, type_name)
    }
}

/// A field in oneof number `oneof`.
fn in_oneof(mut f: FieldDescriptorProto, oneof: i32) -> FieldDescriptorProto {
    f.oneof_index = Some(oneof);
    f
}

/// protoc's JSON name: `snake_case` to `lowerCamelCase`.
fn json_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut upper = false;
    for c in name.chars() {
        if c == '_' {
            upper = true;
        } else if upper {
            out.push(c.to_ascii_uppercase());
            upper = false;
        } else {
            out.push(c);
        }
    }
    out
}

fn message(name: &str, fields: Vec<FieldDescriptorProto>) -> DescriptorProto {
    DescriptorProto {
        name: Some(name.to_owned()),
        field: fields,
        ..Default::default()
    }
}

fn enumeration(name: &str, values: &[(&str, i32)]) -> EnumDescriptorProto {
    EnumDescriptorProto {
        name: Some(name.to_owned()),
        value: values
            .iter()
            .map(|(n, v)| EnumValueDescriptorProto {
                name: Some((*n).to_owned()),
                number: Some(*v),
                options: None,
            })
            .collect(),
        ..Default::default()
    }
}

fn file(
    name: &str,
    package: &str,
    deps: &[&str],
    messages: Vec<DescriptorProto>,
    enums: Vec<EnumDescriptorProto>,
) -> FileDescriptorProto {
    FileDescriptorProto {
        name: Some(name.to_owned()),
        package: Some(package.to_owned()),
        dependency: deps.iter().map(|d| (*d).to_owned()).collect(),
        message_type: messages,
        enum_type: enums,
        syntax: Some("proto3".to_owned()),
        ..Default::default()
    }
}

fn well_known_files() -> Vec<FileDescriptorProto> {
    let mut fields_entry = message(
        "FieldsEntry",
        vec![
            field("key", 1, Type::String, ""),
            field("value", 2, Type::Message, ".google.protobuf.Value"),
        ],
    );
    fields_entry.options = Some(MessageOptions {
        map_entry: Some(true),
        ..Default::default()
    });
    let mut strukt = message(
        "Struct",
        vec![repeated(
            "fields",
            1,
            Type::Message,
            ".google.protobuf.Struct.FieldsEntry",
        )],
    );
    strukt.nested_type = vec![fields_entry];
    let mut value = message(
        "Value",
        vec![
            in_oneof(
                field("null_value", 1, Type::Enum, ".google.protobuf.NullValue"),
                0,
            ),
            in_oneof(field("number_value", 2, Type::Double, ""), 0),
            in_oneof(field("string_value", 3, Type::String, ""), 0),
            in_oneof(field("bool_value", 4, Type::Bool, ""), 0),
            in_oneof(
                field("struct_value", 5, Type::Message, ".google.protobuf.Struct"),
                0,
            ),
            in_oneof(
                field("list_value", 6, Type::Message, ".google.protobuf.ListValue"),
                0,
            ),
        ],
    );
    value.oneof_decl = vec![OneofDescriptorProto {
        name: Some("kind".to_owned()),
        options: None,
    }];
    let seconds_nanos = |name: &str| {
        message(
            name,
            vec![
                field("seconds", 1, Type::Int64, ""),
                field("nanos", 2, Type::Int32, ""),
            ],
        )
    };
    vec![
        file(
            "google/protobuf/struct.proto",
            "google.protobuf",
            &[],
            vec![
                strukt,
                value,
                message(
                    "ListValue",
                    vec![repeated(
                        "values",
                        1,
                        Type::Message,
                        ".google.protobuf.Value",
                    )],
                ),
            ],
            vec![enumeration("NullValue", &[("NULL_VALUE", 0)])],
        ),
        file(
            "google/protobuf/duration.proto",
            "google.protobuf",
            &[],
            vec![seconds_nanos("Duration")],
            vec![],
        ),
        file(
            "google/protobuf/timestamp.proto",
            "google.protobuf",
            &[],
            vec![seconds_nanos("Timestamp")],
            vec![],
        ),
        file(
            "google/protobuf/wrappers.proto",
            "google.protobuf",
            &[],
            vec![message(
                "UInt64Value",
                vec![field("value", 1, Type::Uint64, "")],
            )],
            vec![],
        ),
    ]
}

fn envoy_files() -> Vec<FileDescriptorProto> {
    const DESC: &str = ".envoy.extensions.common.ratelimit.v3.RateLimitDescriptor";
    const RESP: &str = ".envoy.service.ratelimit.v3.RateLimitResponse";
    let mut descriptor = message(
        "RateLimitDescriptor",
        vec![
            repeated("entries", 1, Type::Message, &format!("{DESC}.Entry")),
            field(
                "limit",
                2,
                Type::Message,
                &format!("{DESC}.RateLimitOverride"),
            ),
            field(
                "hits_addend",
                3,
                Type::Message,
                ".google.protobuf.UInt64Value",
            ),
            field("is_negative_hits", 4, Type::Bool, ""),
        ],
    );
    descriptor.nested_type = vec![
        message(
            "Entry",
            vec![
                field("key", 1, Type::String, ""),
                field("value", 2, Type::String, ""),
            ],
        ),
        message(
            "RateLimitOverride",
            vec![
                field("requests_per_unit", 1, Type::Uint32, ""),
                field("unit", 2, Type::Enum, ".envoy.type.v3.RateLimitUnit"),
            ],
        ),
    ];

    let mut rate_limit = message(
        "RateLimit",
        vec![
            field("name", 3, Type::String, ""),
            field("requests_per_unit", 1, Type::Uint32, ""),
            field("unit", 2, Type::Enum, &format!("{RESP}.RateLimit.Unit")),
        ],
    );
    rate_limit.enum_type = vec![enumeration(
        "Unit",
        &[
            ("UNKNOWN", 0),
            ("SECOND", 1),
            ("MINUTE", 2),
            ("HOUR", 3),
            ("DAY", 4),
            ("WEEK", 7),
            ("MONTH", 5),
            ("YEAR", 6),
        ],
    )];
    let mut quota = message(
        "Quota",
        vec![
            field("requests", 1, Type::Uint32, ""),
            in_oneof(
                field(
                    "valid_until",
                    2,
                    Type::Message,
                    ".google.protobuf.Timestamp",
                ),
                0,
            ),
            field("id", 3, Type::String, ""),
        ],
    );
    quota.oneof_decl = vec![OneofDescriptorProto {
        name: Some("expiration_specifier".to_owned()),
        options: None,
    }];
    let status = message(
        "DescriptorStatus",
        vec![
            field("code", 1, Type::Enum, &format!("{RESP}.Code")),
            field(
                "current_limit",
                2,
                Type::Message,
                &format!("{RESP}.RateLimit"),
            ),
            field("limit_remaining", 3, Type::Uint32, ""),
            field(
                "duration_until_reset",
                4,
                Type::Message,
                ".google.protobuf.Duration",
            ),
            field("quota", 5, Type::Message, &format!("{RESP}.Quota")),
        ],
    );
    let mut response = message(
        "RateLimitResponse",
        vec![
            field("overall_code", 1, Type::Enum, &format!("{RESP}.Code")),
            repeated(
                "statuses",
                2,
                Type::Message,
                &format!("{RESP}.DescriptorStatus"),
            ),
            repeated(
                "response_headers_to_add",
                3,
                Type::Message,
                ".envoy.config.core.v3.HeaderValue",
            ),
            repeated(
                "request_headers_to_add",
                4,
                Type::Message,
                ".envoy.config.core.v3.HeaderValue",
            ),
            field("raw_body", 5, Type::Bytes, ""),
            field(
                "dynamic_metadata",
                6,
                Type::Message,
                ".google.protobuf.Struct",
            ),
            field("quota", 7, Type::Message, &format!("{RESP}.Quota")),
        ],
    );
    response.nested_type = vec![rate_limit, quota, status];
    response.enum_type = vec![enumeration(
        "Code",
        &[("UNKNOWN", 0), ("OK", 1), ("OVER_LIMIT", 2)],
    )];
    let request = message(
        "RateLimitRequest",
        vec![
            field("domain", 1, Type::String, ""),
            repeated("descriptors", 2, Type::Message, DESC),
            field("hits_addend", 3, Type::Uint32, ""),
        ],
    );
    let mut rls = file(
        "envoy/service/ratelimit/v3/rls.proto",
        "envoy.service.ratelimit.v3",
        &[
            "envoy/config/core/v3/base.proto",
            "envoy/extensions/common/ratelimit/v3/ratelimit.proto",
            "google/protobuf/duration.proto",
            "google/protobuf/struct.proto",
            "google/protobuf/timestamp.proto",
        ],
        vec![request, response],
        vec![],
    );
    rls.service = vec![ServiceDescriptorProto {
        name: Some("RateLimitService".to_owned()),
        method: vec![MethodDescriptorProto {
            name: Some("ShouldRateLimit".to_owned()),
            input_type: Some(".envoy.service.ratelimit.v3.RateLimitRequest".to_owned()),
            output_type: Some(RESP.to_owned()),
            ..Default::default()
        }],
        options: None,
    }];
    vec![
        file(
            "envoy/type/v3/ratelimit_unit.proto",
            "envoy.type.v3",
            &[],
            vec![],
            vec![enumeration(
                "RateLimitUnit",
                &[
                    ("UNKNOWN", 0),
                    ("SECOND", 1),
                    ("MINUTE", 2),
                    ("HOUR", 3),
                    ("DAY", 4),
                    ("MONTH", 5),
                    ("YEAR", 6),
                ],
            )],
        ),
        file(
            "envoy/config/core/v3/base.proto",
            "envoy.config.core.v3",
            &[],
            vec![message(
                "HeaderValue",
                vec![
                    field("key", 1, Type::String, ""),
                    field("value", 2, Type::String, ""),
                    field("raw_value", 3, Type::Bytes, ""),
                ],
            )],
            vec![],
        ),
        file(
            "envoy/extensions/common/ratelimit/v3/ratelimit.proto",
            "envoy.extensions.common.ratelimit.v3",
            &[
                "envoy/type/v3/ratelimit_unit.proto",
                "google/protobuf/wrappers.proto",
            ],
            vec![descriptor],
            vec![],
        ),
        rls,
    ]
}

/// The descriptors reflection serves: `RateLimitService` and every message
/// it reaches, dependencies before the files that import them.
#[must_use]
pub fn file_descriptor_set() -> FileDescriptorSet {
    let mut file = well_known_files();
    file.extend(envoy_files());
    FileDescriptorSet { file }
}

/// The `grpc.reflection.v1` service, describing `RateLimitService` and
/// `grpc.health.v1.Health`.
///
/// # Errors
/// The descriptor set does not resolve (a bug caught by the tests).
pub fn service_v1() -> Result<
    tonic_reflection::server::v1::ServerReflectionServer<
        impl tonic_reflection::server::v1::ServerReflection,
    >,
    tonic_reflection::server::Error,
> {
    tonic_reflection::server::Builder::configure()
        .register_file_descriptor_set(file_descriptor_set())
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
}

/// The same as [`service_v1`] under `grpc.reflection.v1alpha`, which older
/// clients (grpcurl before 1.8.8) ask for.
///
/// # Errors
/// As [`service_v1`].
pub fn service_v1alpha() -> Result<
    tonic_reflection::server::v1alpha::ServerReflectionServer<
        impl tonic_reflection::server::v1alpha::ServerReflection,
    >,
    tonic_reflection::server::Error,
> {
    tonic_reflection::server::Builder::configure()
        .register_file_descriptor_set(file_descriptor_set())
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::HeaderValue;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
        Entry, RateLimitOverride,
    };
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
        DescriptorStatus, Quota, RateLimit, quota::ExpirationSpecifier,
    };
    use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
    use prost::Message;
    use std::collections::HashMap;

    /// Message full name (`.pkg.Msg.Nested`) -> descriptor.
    fn index(set: &FileDescriptorSet) -> HashMap<String, DescriptorProto> {
        fn walk(prefix: &str, m: &DescriptorProto, out: &mut HashMap<String, DescriptorProto>) {
            let name = format!("{prefix}.{}", m.name());
            for n in &m.nested_type {
                walk(&name, n, out);
            }
            out.insert(name, m.clone());
        }
        let mut out = HashMap::new();
        for f in &set.file {
            for m in &f.message_type {
                walk(&format!(".{}", f.package()), m, &mut out);
            }
        }
        out
    }

    /// Reads one varint from `buf`.
    fn varint(buf: &mut &[u8]) -> u64 {
        prost::encoding::decode_varint(buf).expect("varint")
    }

    /// Walks the wire format of `bytes` as message `name`, asserting every
    /// tag is a field of the descriptor with a matching wire type; returns
    /// the field paths seen.
    fn check(
        bytes: &[u8],
        name: &str,
        idx: &HashMap<String, DescriptorProto>,
        seen: &mut Vec<String>,
    ) {
        let d = idx
            .get(name)
            .unwrap_or_else(|| panic!("no descriptor for {name}"));
        let mut buf = bytes;
        while !buf.is_empty() {
            let key = varint(&mut buf);
            let (number, wire) = (i32::try_from(key >> 3).expect("field number"), key & 7);
            let f = d
                .field
                .iter()
                .find(|f| f.number() == number)
                .unwrap_or_else(|| {
                    panic!("{name}: field {number} on the wire is not in the descriptor")
                });
            seen.push(format!("{name}.{}", f.name()));
            let want = match f.r#type() {
                Type::Message | Type::String | Type::Bytes => 2,
                Type::Double | Type::Fixed64 => 1,
                _ => 0,
            };
            assert_eq!(wire, want, "{name}.{}: wire type", f.name());
            match wire {
                0 => {
                    varint(&mut buf);
                }
                1 => buf = &buf[8..],
                2 => {
                    let len = usize::try_from(varint(&mut buf)).expect("length");
                    let (body, rest) = buf.split_at(len);
                    if f.r#type() == Type::Message {
                        check(body, f.type_name(), idx, seen);
                    }
                    buf = rest;
                }
                _ => panic!("{name}: unexpected wire type {wire}"),
            }
        }
    }

    #[test]
    fn descriptors_match_every_field_envoy_types_encodes() {
        let idx = index(&file_descriptor_set());
        let req = RateLimitRequest {
            domain: "d".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "k".into(),
                    value: "v".into(),
                }],
                limit: Some(RateLimitOverride {
                    requests_per_unit: 3,
                    unit: 2,
                }),
                hits_addend: Some(envoy_types::pb::google::protobuf::UInt64Value { value: 4 }),
                is_negative_hits: true,
            }],
            hits_addend: 5,
        };
        let mut seen = Vec::new();
        check(
            &req.encode_to_vec(),
            ".envoy.service.ratelimit.v3.RateLimitRequest",
            &idx,
            &mut seen,
        );

        let mut meta = envoy_types::pb::google::protobuf::Struct::default();
        let v = |k| envoy_types::pb::google::protobuf::Value { kind: Some(k) };
        use envoy_types::pb::google::protobuf::value::Kind;
        meta.fields.insert("n".into(), v(Kind::NumberValue(1.5)));
        meta.fields
            .insert("s".into(), v(Kind::StringValue("x".into())));
        meta.fields.insert("b".into(), v(Kind::BoolValue(true)));
        meta.fields.insert("z".into(), v(Kind::NullValue(0)));
        meta.fields.insert(
            "l".into(),
            v(Kind::ListValue(
                envoy_types::pb::google::protobuf::ListValue {
                    values: vec![v(Kind::StructValue(Default::default()))],
                },
            )),
        );
        let quota = Quota {
            requests: 1,
            id: "q".into(),
            expiration_specifier: Some(ExpirationSpecifier::ValidUntil(
                envoy_types::pb::google::protobuf::Timestamp {
                    seconds: 1,
                    nanos: 2,
                },
            )),
        };
        let header = HeaderValue {
            key: "a".into(),
            value: "b".into(),
            raw_value: vec![1],
        };
        let resp = RateLimitResponse {
            overall_code: 2,
            statuses: vec![DescriptorStatus {
                code: 2,
                current_limit: Some(RateLimit {
                    name: "n".into(),
                    requests_per_unit: 1,
                    unit: 7,
                }),
                limit_remaining: 1,
                duration_until_reset: Some(envoy_types::pb::google::protobuf::Duration {
                    seconds: 1,
                    nanos: 1,
                }),
                quota: Some(quota.clone()),
            }],
            response_headers_to_add: vec![header.clone()],
            request_headers_to_add: vec![header],
            raw_body: vec![1],
            dynamic_metadata: Some(meta),
            quota: Some(quota),
        };
        check(
            &resp.encode_to_vec(),
            ".envoy.service.ratelimit.v3.RateLimitResponse",
            &idx,
            &mut seen,
        );
        // Every field of every message described was on the wire at least
        // once, so none of them goes unchecked.
        for (name, d) in &idx {
            for f in &d.field {
                let path = format!("{name}.{}", f.name());
                assert!(seen.contains(&path), "{path} never encoded");
            }
        }
    }

    #[test]
    fn reflection_services_build_from_the_descriptor_set() {
        // tonic-reflection resolves every type name; a dangling one fails here.
        assert!(service_v1().is_ok());
        assert!(service_v1alpha().is_ok());
        let set = file_descriptor_set();
        let names: Vec<&str> = set.file.iter().map(FileDescriptorProto::name).collect();
        // Each file comes after the files it imports.
        for (i, f) in set.file.iter().enumerate() {
            for d in &f.dependency {
                let at = names
                    .iter()
                    .position(|n| n == d)
                    .unwrap_or_else(|| panic!("{d} missing"));
                assert!(at < i, "{} imports {d}, which comes later", f.name());
            }
        }
    }
}
