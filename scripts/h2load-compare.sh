#!/usr/bin/env bash
# Side-by-side server cost of two bucket-rls binaries (and optionally a peer
# service) with a neutral client (h2load, Debian package nghttp2-client), on
# loopback, bounded in count. Usage:
#
#   scripts/h2load-compare.sh OLD_BIN NEW_BIN [SCENARIO...]
#
# SCENARIO: memory (1 descriptor), memory5 (5), redis (1), redis5 (5); the
# default is "memory redis redis5". DESCRIPTORS=N (1..5) changes the count of
# the plain "memory" and "redis" scenarios.
#
# For each scenario and each of ROUNDS rounds (default 3), each server is
# started on the same config, warmed up, then sent REQUESTS (default 200000)
# ShouldRateLimit calls (keys "hot", "d1".."d4", never over their limit) over
# CONNS connections x STREAMS concurrent streams (default 4 x 16). The
# servers alternate within a round (A B A B ...), so all see the same machine
# load. Printed per run: requests/s as h2load measured it and the server's
# own CPU time (user + system, from /proc/PID/stat) divided by the requests:
# microseconds of server CPU per decision; then latency p50, p99 and p99.9
# in ms from a second run of REQUESTS calls with h2load's per-request log
# (kept out of the first: writing it costs the client enough to lower the
# throughput it can drive). The last lines give the median of
# the rounds for each server. Redis scenarios start their own redis-server on
# a free port (no persistence), shared by the servers of one scenario.
#
# PEER_CMD (optional): a third server, started with `sh -c "exec $PEER_CMD"`
# with PORT (the gRPC port to listen on), SCENARIO (memory or redis) and
# REDIS_URL set; it must answer domain "bench" with the descriptors above
# and not be over its limits. PEER_READY (optional) is a command polled until
# it succeeds (default: wait 2 s). Example for a side-by-side row with a
# service built outside the repository:
#
#   PEER_CMD='/path/to/peer-server --port $PORT' scripts/h2load-compare.sh OLD NEW memory
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n 2,32p "$0"; exit 2; }
OLD=$1 NEW=$2; shift 2
SCENARIOS=${*:-memory redis redis5}
ROUNDS=${ROUNDS:-3} REQUESTS=${REQUESTS:-200000} CONNS=${CONNS:-4} STREAMS=${STREAMS:-16}
DESCRIPTORS=${DESCRIPTORS:-1}
PEER_CMD=${PEER_CMD:-}
command -v h2load >/dev/null || { echo "h2load is missing: install the Debian package nghttp2-client" >&2; exit 1; }
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
. scripts/bench-common.sh
bench_config "$WORK/bench.yaml"
body() { bench_body "$WORK/body.$1" "$1"; } # body N: writes $WORK/body.N
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
h2() { # h2 PORT N BODY [LOG]: h2load; prints req/s
  local log=()
  [ $# -ge 4 ] && log=(--log-file "$4")
  h2load -n "$2" -c "$CONNS" -m "$STREAMS" -H 'content-type: application/grpc' -H 'te: trailers' \
    -d "$3" "${log[@]}" "http://127.0.0.1:$1/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" \
    | awk '/^finished in/ {gsub(",", ""); print $4} /^status codes:/ && $3 != "'"$2"'" {print "non-2xx: " $0 > "/dev/stderr"}'
}
percentiles() { # percentiles LOG: "p50 p99 p99.9" in ms from h2load's per-request log
  cut -f3 "$1" | sort -n | awk '{v[NR] = $1} END {
    n = NR; if (n == 0) { print "- - -"; exit }
    i50 = int(n * 0.50); i99 = int(n * 0.99); i999 = int(n * 0.999)
    if (i50 < 1) i50 = 1; if (i99 < 1) i99 = 1; if (i999 < 1) i999 = 1
    printf "%.2f %.2f %.2f\n", v[i50] / 1000, v[i99] / 1000, v[i999] / 1000 }'
}
# run WHICH SCENARIO BODY [serve flags]: prints "req/s cpu_us p50 p99 p999"
run() {
  local which=$1 scenario=$2 body=$3; shift 3
  local port http pid; port=$(free_port); http=$(free_port)
  if [ "$which" = peer ]; then
    PORT=$port SCENARIO=$scenario REDIS_URL=${REDIS_URL:-} sh -c "exec $PEER_CMD" >"$WORK/peer.log" 2>&1 &
    pid=$!
    if [ -n "${PEER_READY:-}" ]; then
      for _ in $(seq 100); do PORT=$port sh -c "$PEER_READY" >/dev/null 2>&1 && break; sleep 0.1; done
    else
      sleep 2
    fi
  else
    local bin=$OLD; [ "$which" = new ] && bin=$NEW
    "$bin" serve --config "$WORK/bench.yaml" --grpc-addr "127.0.0.1:$port" --http-addr "127.0.0.1:$http" \
      --log-level warn "$@" 2>"$WORK/serve.log" &
    pid=$!
    for _ in $(seq 100); do curl -sf "http://127.0.0.1:$http/healthcheck" >/dev/null 2>&1 && break; sleep 0.1; done
  fi
  h2 "$port" 20000 "$body" >/dev/null
  local t0 t1 rps hz lat; hz=$(getconf CLK_TCK); t0=$(cpu_ticks "$pid")
  rps=$(h2 "$port" "$REQUESTS" "$body")
  t1=$(cpu_ticks "$pid")
  # Latency from a second run with h2load's per-request log, which costs the
  # client enough (15-20 % of a Redis run's throughput here) to skew the
  # throughput and CPU figures of the first.
  h2 "$port" "$REQUESTS" "$body" "$WORK/h2.log" >/dev/null
  kill "$pid"; wait "$pid" 2>/dev/null || true
  lat=$(percentiles "$WORK/h2.log")
  awk -v r="$rps" -v d=$((t1 - t0)) -v hz="$hz" -v n="$REQUESTS" -v lat="$lat" \
    'BEGIN {printf "%.0f %.1f %s\n", r, d / hz / n * 1e6, lat}'
}
median() { sort -n | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
WHICH=(old new); [ -n "$PEER_CMD" ] && WHICH+=(peer)
printf '%-8s %-5s %-4s %10s %8s %8s %8s %12s\n' scenario round bin "req/s" "p50 ms" "p99 ms" "p999 ms" "CPU us/dec"
for scenario in $SCENARIOS; do
  case $scenario in
    memory) backend=memory n=$DESCRIPTORS ;;
    memory5) backend=memory n=5 ;;
    redis) backend=redis n=$DESCRIPTORS ;;
    redis5) backend=redis n=5 ;;
    *) echo "unknown scenario $scenario (memory memory5 redis redis5)" >&2; exit 2 ;;
  esac
  body "$n"
  flags=()
  REDIS_URL=
  if [ "$backend" = redis ]; then
    rport=$(free_port)
    redis-server --port "$rport" --bind 127.0.0.1 --save '' --appendonly no --daemonize no >"$WORK/redis.log" 2>&1 &
    rpid=$!
    PIDS+=("$rpid")
    for _ in $(seq 50); do redis-cli -p "$rport" ping >/dev/null 2>&1 && break; sleep 0.1; done
    REDIS_URL="redis://127.0.0.1:$rport"
    flags=(--redis-url "$REDIS_URL")
  fi
  export REDIS_URL
  for round in $(seq "$ROUNDS"); do
    for which in "${WHICH[@]}"; do
      read -r rps cpu p50 p99 p999 < <(run "$which" "$backend" "$WORK/body.$n" "${flags[@]}")
      printf '%-8s %-5s %-4s %10s %8s %8s %8s %12s\n' "$scenario" "$round" "$which" "$rps" "$p50" "$p99" "$p999" "$cpu"
      echo "$rps $cpu $p50 $p99 $p999" >>"$WORK/res.$scenario.$which"
    done
  done
  for which in "${WHICH[@]}"; do
    f=$WORK/res.$scenario.$which
    printf '%-8s %-5s %-4s %10s %8s %8s %8s %12s\n' "$scenario" median "$which" \
      "$(cut -d' ' -f1 "$f" | median)" "$(cut -d' ' -f3 "$f" | median)" "$(cut -d' ' -f4 "$f" | median)" \
      "$(cut -d' ' -f5 "$f" | median)" "$(cut -d' ' -f2 "$f" | median)"
  done
  if [ "$backend" = redis ]; then kill "$rpid" 2>/dev/null || true; wait "$rpid" 2>/dev/null || true; fi
done
