#!/usr/bin/env python3
"""Calls ShouldRateLimit on a bucket-rls gRPC port, with no .proto files: the
message types come from the port's server reflection, as grpcurl gets them.

Usage: scripts/rls-call.py [--target HOST:PORT] REQUEST_JSON

REQUEST_JSON is a RateLimitRequest in protobuf JSON (the shape `/json`
takes). Prints the RateLimitResponse as protobuf JSON; exits 1 on a gRPC
error. Needs `pip install grpcio grpcio-reflection` (scripts/test.sh puts
them in .venv).
"""
import argparse
import sys

import grpc
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

SERVICE = "envoy.service.ratelimit.v3.RateLimitService"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="127.0.0.1:8081")
    ap.add_argument("request", help="RateLimitRequest as protobuf JSON")
    args = ap.parse_args()
    with grpc.insecure_channel(args.target) as channel:
        pool = DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        method = pool.FindServiceByName(SERVICE).FindMethodByName("ShouldRateLimit")
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        call = channel.unary_unary(
            f"/{SERVICE}/ShouldRateLimit",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_cls.FromString,
        )
        try:
            response = call(json_format.Parse(args.request, request_cls()), timeout=5)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        print(json_format.MessageToJson(response, indent=None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
