#!/usr/bin/env bash
# Runs the load scenarios of BENCHMARKS.md against a release build, on loopback
# only, each bounded in time. Usage:
#
#   cargo build --release
#   scripts/loadtest.sh [SCENARIO...]      # default: all; results in target/loadtest/
#
# Scenarios: memory redis flood rss. `redis` and `flood` start their own
# redis-server on a free port (no persistence) and stop it afterwards.
# Set DURATION (default 10s) and CONCURRENCY (default 64) to change the runs.
# Pinning (the load generator shares the machine): PIN_SERVER, PIN_LOADGEN and
# PIN_REDIS take a CPU list for taskset, LOADGEN_THREADS the loadgen's threads,
# e.g. PIN_SERVER=0 PIN_REDIS=0 PIN_LOADGEN=1 LOADGEN_THREADS=1.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${BIN:-target/release/bucket-rls}
DURATION=${DURATION:-10s}
CONCURRENCY=${CONCURRENCY:-64}
CONNECTIONS=${CONNECTIONS:-2}
OUT=${OUT:-target/loadtest}
LOADGEN_THREADS=${LOADGEN_THREADS:-}
# pin VAR: the taskset prefix for a CPU list in $VAR, or nothing.
pin() { [ -n "${!1:-}" ] && echo "taskset -c ${!1}" || true; }
mkdir -p "$OUT"
WORK=$(mktemp -d)
SERVER_PID=
REDIS_PID=
cleanup() {
  [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  [ -n "$REDIS_PID" ] && kill "$REDIS_PID" 2>/dev/null && wait "$REDIS_PID" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT

. scripts/bench-common.sh
# hot, d1..d4: never reached at these speeds (4e9 tokens, 1.1 million per second).
bench_config "$WORK/bench.yaml"
cat >>"$WORK/bench.yaml" <<'EOF'
  # Per client address, the unbounded-client-values shape of docs/design.md: a bucket stays 6 s after one hit.
  - {key: ip, rate_limit: {unit: minute, requests_per_unit: 10}}
  # RSS: one token per minute, so a bucket stays in memory 60 s after its hit
  # (all 1,000,000 are held at once at the end of the run).
  - {key: client, rate_limit: {unit: minute, requests_per_unit: 1}}
  # Over-limit flood: 10 per minute on one key.
  - {key: flood, rate_limit: {unit: minute, requests_per_unit: 10}}
EOF


# start_server [serve flags...]: starts bucket-rls on port 0, sets GRPC and SERVER_PID.
start_server() {
  $(pin PIN_SERVER) "$BIN" serve --config "$WORK/bench.yaml" --grpc-addr 127.0.0.1:0 --http-addr 127.0.0.1:0 \
    --log-format json --log-level warn,bucket_rls::app=info,bucket_rls=info "$@" 2>"$WORK/serve.log" &
  SERVER_PID=$!
  for _ in $(seq 100); do
    GRPC=$(grep -o '"grpc":"[^"]*"' "$WORK/serve.log" | head -1 | cut -d'"' -f4 || true)
    if [ -n "$GRPC" ]; then
      # Warm-up (not recorded): the first open-loop run after a start showed a
      # one-off stall of ~50 ms.
      "$BIN" loadgen --target "$GRPC" --domain bench --quiet --requests 20000 --descriptor hot=warmup >/dev/null
      return 0
    fi
    sleep 0.1
  done
  echo "server did not start:" >&2
  cat "$WORK/serve.log" >&2
  exit 1
}

stop_server() {
  kill "$SERVER_PID" && wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=
}

start_redis() {
  REDIS_PORT=$(free_port)
  $(pin PIN_REDIS) redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --daemonize no --logfile "$WORK/redis.log" &
  REDIS_PID=$!
  for _ in $(seq 50); do
    redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "redis-server did not start" >&2
  exit 1
}

stop_redis() {
  kill "$REDIS_PID" && wait "$REDIS_PID" 2>/dev/null || true
  REDIS_PID=
}

rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }

# Commands Redis executed since the last CONFIG RESETSTAT, as `name=calls ...`.
redis_calls() {
  redis-cli -p "$REDIS_PORT" info commandstats | tr -d '\r' |
    awk -F'[:=,]' '/^cmdstat_/ {sub("cmdstat_", "", $1); printf "%s=%s ", $1, $3}'
}

# run NAME [loadgen flags...]: one bounded loadgen run, figures to $OUT/NAME.txt.
run() {
  local name=$1
  shift
  echo "== $name: loadgen $*"
  [ -n "$REDIS_PID" ] && redis-cli -p "$REDIS_PORT" config resetstat >/dev/null
  $(pin PIN_LOADGEN) "$BIN" loadgen --target "$GRPC" --domain bench --quiet --json "$OUT/$name.json" \
    ${LOADGEN_THREADS:+--threads "$LOADGEN_THREADS"} "$@" |
    tee "$OUT/$name.txt" | grep -E '^(requests/s|ok|over_limit|errors|p50|p99|p99.9|max):' | paste -sd' '
  if [ -n "$REDIS_PID" ]; then
    # Time Redis spent inside the script per call (wall time in the Redis thread).
    redis-cli -p "$REDIS_PORT" info commandstats | tr -d '\r' | grep '^cmdstat_evalsha:' |
      sed 's/^/   /' | tee -a "$OUT/$name.txt" || true
  fi
}

# The throughput/latency matrix for the backend currently served; TARGET_RATE
# is the backend's throughput target, also run open loop (fixed schedule).
matrix() {
  local b=$1 target_rate=$2
  local c="--concurrency $CONCURRENCY --connections $CONNECTIONS --duration $DURATION"
  run "$b-1desc-hot-open-$target_rate" --rate "$target_rate" $c --descriptor hot=x
  run "$b-1desc-hot" $c --descriptor hot=x
  run "$b-5desc-hot" $c --descriptor hot=x --descriptor d1=x --descriptor d2=x --descriptor d3=x --descriptor d4=x
  run "$b-1desc-1M-keys" $c --descriptor ip=10.0 --keys 1000000
  run "$b-5desc-1M-keys" $c --descriptor hot=x --descriptor d1=x --descriptor d2=x --descriptor d3=x --descriptor ip=10.0 --keys 1000000
  run "$b-1desc-10k-steady" --rate 10000 --concurrency "$CONCURRENCY" --connections "$CONNECTIONS" --duration "$DURATION" --descriptor ip=10.0 --keys 1000000
  run "$b-5desc-10k-steady" --rate 10000 --concurrency "$CONCURRENCY" --connections "$CONNECTIONS" --duration "$DURATION" --descriptor hot=x --descriptor d1=x --descriptor d2=x --descriptor d3=x --descriptor ip=10.0 --keys 1000000
}

scenario_memory() {
  start_server
  matrix memory 50000
  stop_server
}

scenario_redis() {
  start_redis
  start_server --redis-url "redis://127.0.0.1:$REDIS_PORT"
  matrix redis 30000
  stop_server
  stop_redis
}

scenario_flood() {
  start_redis
  for size in 100000 0; do
    start_server --redis-url "redis://127.0.0.1:$REDIS_PORT" --local-cache-size "$size"
    redis-cli -p "$REDIS_PORT" flushall >/dev/null
    run "redis-flood-cache-$size" --concurrency "$CONCURRENCY" --connections "$CONNECTIONS" --duration "$DURATION" --descriptor flood=x
    echo "   Redis commands during the run: $(redis_calls)" | tee -a "$OUT/redis-flood-cache-$size.txt"
    stop_server
  done
  stop_redis
}

scenario_rss() {
  start_server
  sleep 1
  local base after full
  base=$(rss_kib "$SERVER_PID")
  run memory-rss-1M-keys --concurrency "$CONCURRENCY" --connections "$CONNECTIONS" --requests 1000000 \
    --descriptor client=10.0 --keys 1000000 --distribution sequential
  after=$(rss_kib "$SERVER_PID")
  # Each bucket is full 60 s after its hit; the sweep runs every 5 s.
  sleep 70
  full=$(rss_kib "$SERVER_PID")
  echo "   RSS KiB: baseline $base, after 1,000,000 keys $after, 70 s later (buckets full, swept) $full" |
    tee "$OUT/memory-rss.txt"
  stop_server
}

scenarios=("$@")
[ ${#scenarios[@]} -eq 0 ] && scenarios=(memory redis flood rss)
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg) at $(date -u +%H:%M:%S) UTC;" \
  "pinning: server ${PIN_SERVER:-none}, redis ${PIN_REDIS:-none}, loadgen ${PIN_LOADGEN:-none} (threads ${LOADGEN_THREADS:-default})"
for s in "${scenarios[@]}"; do
  "scenario_$s"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg) at $(date -u +%H:%M:%S) UTC"
