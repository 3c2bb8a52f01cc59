#!/usr/bin/env bash
# Instructions the whole server executes per ShouldRateLimit call, counted by
# valgrind's callgrind (deterministic up to thread interleaving, so usable
# on a loaded machine where wall-clock figures are noise). Usage:
#
#   scripts/server-instructions.sh BIN [BIN...]
#
# Each binary is started under `valgrind --tool=callgrind` with the memory
# backend (REDIS_URL=redis://... switches to Redis), warmed up with 2,000
# calls, its counters zeroed, then sent REQUESTS (default 20000) calls with
# DESCRIPTORS (default 1) descriptors by h2load over CONNS x STREAMS
# (default 4 x 16). Printed: instructions per call (all threads, user space
# only: system calls show up in `strace -c -f`, not here) and, with
# SYSCALLS=1, a second run under `strace -c -f` giving system calls per call.
# The callgrind output stays in $OUT (default /tmp/server-instructions) for
# `callgrind_annotate`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n 2,17p "$0"; exit 2; }
REQUESTS=${REQUESTS:-20000} CONNS=${CONNS:-4} STREAMS=${STREAMS:-16} DESCRIPTORS=${DESCRIPTORS:-1}
OUT=${OUT:-/tmp/server-instructions}
mkdir -p "$OUT"
for tool in valgrind callgrind_control h2load; do
  command -v "$tool" >/dev/null || { echo "$tool is missing (Debian: valgrind, nghttp2-client)" >&2; exit 1; }
done
WORK=$(mktemp -d)
PID=
cleanup() { [ -n "$PID" ] && kill "$PID" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
. scripts/bench-common.sh
bench_config "$WORK/bench.yaml"
bench_body "$WORK/body" "$DESCRIPTORS"
h2() {
  h2load -n "$2" -c "$CONNS" -m "$STREAMS" -H 'content-type: application/grpc' -H 'te: trailers' \
    -d "$WORK/body" "http://127.0.0.1:$1/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" \
    | awk '/^status codes:/ && $3 != "'"$2"'" {print "non-2xx: " $0 > "/dev/stderr"}'
}
flags=()
[ -n "${REDIS_URL:-}" ] && flags=(--redis-url "$REDIS_URL")
serve() { # serve PREFIX... : starts BIN under PREFIX, waits for health; sets PID, PORT
  local http; PORT=$(free_port); http=$(free_port)
  "$@" serve --config "$WORK/bench.yaml" --grpc-addr "127.0.0.1:$PORT" --http-addr "127.0.0.1:$http" \
    --log-level warn "${flags[@]}" 2>>"$WORK/serve.log" &
  PID=$!
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$http/healthcheck" >/dev/null 2>&1 && return; sleep 0.1; done
  echo "server did not start" >&2; cat "$WORK/serve.log" >&2; exit 1
}
n=0
for bin in "$@"; do
  n=$((n + 1))
  out="$OUT/callgrind.$n.out"
  serve valgrind --tool=callgrind --compress-strings=no --callgrind-out-file="$out" "$bin"
  h2 "$PORT" 2000
  callgrind_control -z "$PID" >/dev/null
  h2 "$PORT" "$REQUESTS"
  callgrind_control -d "$PID" >/dev/null
  kill "$PID"; wait "$PID" 2>/dev/null || true; PID=
  # The dump after zeroing holds only the measured calls; sum its Ir over
  # all threads' files.
  ir=$(for f in "$out".*; do grep -h '^summary:' "$f" || true; done | awk '{s += $2} END {print s}')
  ls "$out"* >/dev/null
  echo "$bin: $(awk -v i="$ir" -v n="$REQUESTS" 'BEGIN {printf "%.0f", i / n}') instructions per call ($DESCRIPTORS descriptors, $REQUESTS calls)"
  if [ "${SYSCALLS:-0}" = 1 ]; then
    serve strace -f -c -o "$WORK/strace" "$bin"
    h2 "$PORT" "$REQUESTS"
    # Stop the server, not strace (which would detach and leave it running).
    kill -INT "$(pgrep -P "$PID")"; wait "$PID" 2>/dev/null || true; PID=
    awk -v n="$REQUESTS" '/total/ {printf "  %.2f system calls per call\n", $4 / n}
      $NF ~ /^(writev|write|sendmsg|sendto|recvfrom|read|readv|epoll_wait|futex|sched_yield)$/ {printf "    %s %.2f\n", $NF, $4 / n}' "$WORK/strace"
  fi
done
