#!/usr/bin/env bash
# Latency of one bucket-rls binary at a steady request rate (not a saturated
# closed loop), Redis backend, with h2load (Debian package nghttp2-client) as
# the client. Usage:
#
#   scripts/h2load-steady.sh BIN [RUNS]          # RATE=10000 SECS=10 DESCRIPTORS=1
#
# Each run starts a fresh redis-server and the service on free loopback
# ports, warms up, then sends RATE calls per second for SECS seconds over 4
# connections (one stream each, `h2load --rps`), and prints p50, p99 and
# p99.9 in ms from h2load's per-request log, and the server's CPU time per
# decision.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n 2,12p "$0"; exit 2; }
BIN=$1 RUNS=${2:-3}
RATE=${RATE:-10000} SECS=${SECS:-10} DESCRIPTORS=${DESCRIPTORS:-1}
command -v h2load >/dev/null || { echo "h2load is missing: install nghttp2-client" >&2; exit 1; }
W=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$W"; }
trap cleanup EXIT
. scripts/bench-common.sh
bench_config "$W/b.yaml"
bench_body "$W/body" "$DESCRIPTORS"
printf '%-4s %8s %8s %8s %12s\n' run "p50 ms" "p99 ms" "p999 ms" "CPU us/dec"
for run in $(seq "$RUNS"); do
  rp=$(free_port) gp=$(free_port) hp=$(free_port)
  redis-server --port "$rp" --bind 127.0.0.1 --save '' --appendonly no >"$W/redis.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 50); do redis-cli -p "$rp" ping >/dev/null 2>&1 && break; sleep 0.1; done
  "$BIN" serve --config "$W/b.yaml" --grpc-addr "127.0.0.1:$gp" --http-addr "127.0.0.1:$hp" \
    --redis-url "redis://127.0.0.1:$rp" --log-level warn 2>"$W/serve.log" &
  pid=$!
  PIDS+=($pid)
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$hp/healthcheck" >/dev/null 2>&1 && break; sleep 0.1; done
  url="http://127.0.0.1:$gp/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
  hdr=(-H 'content-type: application/grpc' -H 'te: trailers')
  h2load -n 20000 -c 4 -m 16 "${hdr[@]}" -d "$W/body" "$url" >/dev/null
  n=$((RATE * SECS))
  t0=$(awk '{print $14 + $15}' "/proc/$pid/stat")
  h2load -n "$n" -c 4 -m 1 --rps $((RATE / 4)) "${hdr[@]}" -d "$W/body" --log-file "$W/log" "$url" >/dev/null
  t1=$(awk '{print $14 + $15}' "/proc/$pid/stat")
  hz=$(getconf CLK_TCK)
  cut -f3 "$W/log" | sort -n | awk -v d=$((t1 - t0)) -v hz="$hz" -v n="$n" -v r="$run" '{v[NR] = $1} END {
    printf "%-4s %8.2f %8.2f %8.2f %12.1f\n", r, v[int(NR*0.5)]/1000, v[int(NR*0.99)]/1000, v[int(NR*0.999)]/1000, d/hz/n*1e6 }'
  kill "$pid" "${PIDS[-2]}" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
done
