# Shared by the benchmark scripts (sourced, not run): the config every
# server is started on and the ShouldRateLimit bodies h2load sends.

# bench_config FILE: domain `bench` with the keys hot, d1..d4, never over
# their limit (4,000,000,000 per hour each).
bench_config() {
  cat >"$1" <<'YAML'
domain: bench
descriptors:
  - {key: hot, rate_limit: {unit: hour, requests_per_unit: 4000000000}}
  - {key: d1, rate_limit: {unit: hour, requests_per_unit: 4000000000}}
  - {key: d2, rate_limit: {unit: hour, requests_per_unit: 4000000000}}
  - {key: d3, rate_limit: {unit: hour, requests_per_unit: 4000000000}}
  - {key: d4, rate_limit: {unit: hour, requests_per_unit: 4000000000}}
YAML
}

# bench_body FILE N: a length-prefixed gRPC RateLimitRequest {domain: bench,
# descriptors: [{hot=x}, {d1=x}, ...]} with N (1..5) descriptors.
bench_body() {
  python3 - "$1" "$2" <<'PY'
import sys
def field(n, b): return bytes([n << 3 | 2, len(b)]) + b
keys = ["hot", "d1", "d2", "d3", "d4"][: int(sys.argv[2])]
msg = field(1, b"bench") + b"".join(
    field(2, field(1, field(1, k.encode()) + field(2, b"x"))) for k in keys)
open(sys.argv[1], "wb").write(b"\0" + len(msg).to_bytes(4, "big") + msg)
PY
}

# free_port: a free TCP port on 127.0.0.1.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
