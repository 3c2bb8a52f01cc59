#!/usr/bin/env bash
# Side-by-side server cost of two bucket-rls binaries with a neutral client
# (h2load, Debian package nghttp2-client), on loopback, bounded in count.
# Usage:
#
#   scripts/h2load-compare.sh OLD_BIN NEW_BIN [BACKEND...]   # BACKEND: memory redis
#
# For each backend and each of ROUNDS rounds (default 3), each binary is
# started on the same config, warmed up, then sent REQUESTS (default 200000)
# ShouldRateLimit calls with one descriptor ("hot", never over the limit) over
# CONNS connections x STREAMS concurrent streams (default 4 x 16). Printed per
# run: requests/s as h2load measured it, and the server's own CPU time
# (user + system, from /proc/PID/stat) divided by the requests: microseconds
# of server CPU per decision. The binaries alternate within a round, so both
# see the same machine load. `redis` starts its own redis-server on a free
# port (no persistence).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n 2,16p "$0"; exit 2; }
OLD=$1 NEW=$2; shift 2
BACKENDS=${*:-memory redis}
ROUNDS=${ROUNDS:-3} REQUESTS=${REQUESTS:-200000} CONNS=${CONNS:-4} STREAMS=${STREAMS:-16}
DESCRIPTORS=${DESCRIPTORS:-1}
command -v h2load >/dev/null || { echo "h2load is missing: install the Debian package nghttp2-client" >&2; exit 1; }
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
cat >"$WORK/bench.yaml" <<'YAML'
domain: bench
descriptors:
  - {key: hot, rate_limit: {unit: hour, requests_per_unit: 4000000000}}
  - {key: d1, rate_limit: {unit: hour, requests_per_unit: 4000000000}}
  - {key: d2, rate_limit: {unit: hour, requests_per_unit: 4000000000}}
  - {key: d3, rate_limit: {unit: hour, requests_per_unit: 4000000000}}
  - {key: d4, rate_limit: {unit: hour, requests_per_unit: 4000000000}}
YAML
# The gRPC body: a length-prefixed RateLimitRequest {domain: bench,
# descriptors: [{entries: [{key: hot, value: x}]}, {d1=x} ...]}.
python3 - "$WORK/body" "$DESCRIPTORS" <<'PY'
import sys
def field(n, b): return bytes([n << 3 | 2, len(b)]) + b
keys = ["hot", "d1", "d2", "d3", "d4"][: int(sys.argv[2])]
msg = field(1, b"bench") + b"".join(
    field(2, field(1, field(1, k.encode()) + field(2, b"x"))) for k in keys)
open(sys.argv[1], "wb").write(b"\0" + len(msg).to_bytes(4, "big") + msg)
PY
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
h2() { # h2load on port $1 with $2 requests; prints req/s
  h2load -n "$2" -c "$CONNS" -m "$STREAMS" -H 'content-type: application/grpc' -H 'te: trailers' \
    -d "$WORK/body" "http://127.0.0.1:$1/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" \
    | awk '/^finished in/ {gsub(",", ""); print $4} /^status codes:/ && $3 != "'"$2"'" {print "non-2xx: " $0 > "/dev/stderr"}'
}
run() { # run BIN [serve flags]: prints "req/s cpu_us_per_decision"
  local bin=$1; shift
  local port http; port=$(free_port); http=$(free_port)
  "$bin" serve --config "$WORK/bench.yaml" --grpc-addr "127.0.0.1:$port" --http-addr "127.0.0.1:$http" \
    --log-level warn "$@" 2>"$WORK/serve.log" &
  local pid=$!
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$http/healthcheck" >/dev/null 2>&1 && break; sleep 0.1; done
  h2 "$port" 20000 >/dev/null
  local t0 t1 rps hz; hz=$(getconf CLK_TCK); t0=$(cpu_ticks "$pid")
  rps=$(h2 "$port" "$REQUESTS")
  t1=$(cpu_ticks "$pid")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  awk -v r="$rps" -v d=$((t1 - t0)) -v hz="$hz" -v n="$REQUESTS" 'BEGIN {printf "%.0f %.1f\n", r, d / hz / n * 1e6}'
}
for backend in $BACKENDS; do
  flags=()
  if [ "$backend" = redis ]; then
    rport=$(free_port)
    redis-server --port "$rport" --bind 127.0.0.1 --save '' --appendonly no --daemonize no >"$WORK/redis.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 50); do redis-cli -p "$rport" ping >/dev/null 2>&1 && break; sleep 0.1; done
    flags=(--redis-url "redis://127.0.0.1:$rport")
  fi
  for round in $(seq "$ROUNDS"); do
    for which in old new; do
      bin=$OLD; [ "$which" = new ] && bin=$NEW
      read -r rps cpu < <(run "$bin" "${flags[@]}")
      echo "$backend descriptors=$DESCRIPTORS round=$round $which: $rps req/s, $cpu us CPU/decision"
    done
  done
done
