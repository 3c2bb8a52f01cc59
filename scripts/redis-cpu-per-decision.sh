#!/usr/bin/env bash
# Redis's own CPU per rate limit decision: two bucket-rls binaries and the
# Go service's command pattern, against one redis-server, in one run. Usage:
#
#   scripts/redis-cpu-per-decision.sh OLD_BIN NEW_BIN
#
# One redis-server (no persistence) on a free loopback port serves every
# row. For each scenario (SCENARIOS, default "hot1 hot5 cold1 cold5": 1 or 5
# descriptors, on one hot bucket each or on 1,000,000 values of each) and
# each number of concurrent streams (STREAMS, default "1 16 64": 1x1, 4x4
# and 4x16 connections x streams), each binary is started on that Redis,
# warmed up, and sent REQUESTS calls (default 50000; a fifth of it at 1
# stream): h2load (Debian package nghttp2-client) for the hot scenarios,
# `NEW_BIN loadgen` for the cold ones (h2load sends one body only). Then
# the Go service's pattern for the same decisions, with redis-benchmark: per
# decision and descriptor one INCRBY and one EXPIRE, as one pipeline per
# decision (`go`) and with WINDOW decisions per pipeline (`go-window`, the
# Go service's implicit pipelining; default 16), from as many clients as
# streams (so STREAMS x WINDOW decisions in flight); `go-inflight` is the
# window with as many decisions in flight as bucket-rls has streams, as the
# Go service would have (STREAMS / WINDOW clients with WINDOW decisions per
# pipeline, or one client with STREAMS); a cold key is `__rand_int__` of
# 1,000,000.
#
# Printed per row: decisions/s as the client measured it, Redis CPU per
# decision in microseconds (user + system time of the redis-server process
# from /proc/PID/stat, over the run, divided by the decisions), and from
# INFO commandstats the script calls per decision and the microseconds
# Redis spent inside them per decision (bucket-rls rows only).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n 2,29p "$0"; exit 2; }
OLD=$1 NEW=$2
SCENARIOS=${SCENARIOS:-hot1 hot5 cold1 cold5}
STREAMS=${STREAMS:-1 16 64}
REQUESTS=${REQUESTS:-50000} WINDOW=${WINDOW:-16}
command -v h2load >/dev/null || { echo "h2load is missing: install nghttp2-client" >&2; exit 1; }
command -v redis-benchmark >/dev/null || { echo "redis-benchmark is missing: install redis-tools" >&2; exit 1; }
W=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$W"; }
trap cleanup EXIT
. scripts/bench-common.sh
bench_config "$W/b.yaml"
bench_body "$W/body.1" 1
bench_body "$W/body.5" 5
rp=$(free_port)
redis-server --port "$rp" --bind 127.0.0.1 --save '' --appendonly no >"$W/redis.log" 2>&1 &
rpid=$!
PIDS+=("$rpid")
for _ in $(seq 50); do redis-cli -p "$rp" ping >/dev/null 2>&1 && break; sleep 0.1; done
hz=$(getconf CLK_TCK)
rticks() { awk '{print $14 + $15}' "/proc/$rpid/stat"; }
# evalsha: "calls usec" of the request script so far (EVALSHA and FCALL)
evalsha() {
  redis-cli -p "$rp" info commandstats | tr -d '\r' |
    awk -F'[:=,]' '/^cmdstat_(evalsha|fcall):/ {c += $3; u += $5} END {print c + 0, u + 0}'
}
shape() { case $1 in 1) echo "1 1" ;; 16) echo "4 4" ;; 64) echo "4 16" ;; *) echo "4 $(($1 / 4))" ;; esac; }
# row NAME STREAMS N RPS T0 T1 [C0 U0 C1 U1]
row() {
  awk -v scen="$SCEN" -v name="$1" -v s="$2" -v n="$3" -v rps="$4" -v d=$(($6 - $5)) -v hz="$hz" \
    -v c0="${7:-}" -v u0="${8:-}" -v c1="${9:-}" -v u1="${10:-}" 'BEGIN {
      calls = "-"; inside = "-"
      if (c0 != "") { calls = sprintf("%.3f", (c1 - c0) / n); inside = sprintf("%.2f", (u1 - u0) / n) }
      printf "%-9s %-8s %7s %10.0f %10.2f %10s %10s\n", scen, name, s, rps, d / hz / n * 1e6, calls, inside
    }'
}
printf '%-9s %-8s %7s %10s %10s %10s %10s\n' scenario server streams "dec/s" "redis us" "calls/dec" "script us"
for SCEN in $SCENARIOS; do
  case $SCEN in
    hot1) d=1 cold=0 ;; hot5) d=5 cold=0 ;; cold1) d=1 cold=1 ;; cold5) d=5 cold=1 ;;
    *) echo "unknown scenario $SCEN" >&2; exit 2 ;;
  esac
  for s in $STREAMS; do
    read -r conns streams < <(shape "$s")
    n=$REQUESTS
    [ "$s" -eq 1 ] && n=$((REQUESTS / 5))
    for which in old new; do
      bin=$OLD; [ "$which" = new ] && bin=$NEW
      gp=$(free_port) hp=$(free_port)
      "$bin" serve --config "$W/b.yaml" --grpc-addr "127.0.0.1:$gp" --http-addr "127.0.0.1:$hp" \
        --redis-url "redis://127.0.0.1:$rp" --log-level warn 2>"$W/serve.log" &
      pid=$!
      for _ in $(seq 100); do curl -sf "http://127.0.0.1:$hp/healthcheck" >/dev/null 2>&1 && break; sleep 0.1; done
      url="http://127.0.0.1:$gp/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
      hdr=(-H 'content-type: application/grpc' -H 'te: trailers')
      descs=()
      for k in hot d1 d2 d3 d4; do descs+=(--descriptor "$k=x"); done
      descs=("${descs[@]:0:$((2 * d))}")
      load() { # load N: prints decisions/s
        if [ "$cold" = 0 ]; then
          h2load -n "$1" -c "$conns" -m "$streams" "${hdr[@]}" -d "$W/body.$d" "$url" |
            awk '/^finished in/ {gsub(",", ""); print $4}'
        else
          "$NEW" loadgen --target "127.0.0.1:$gp" --domain bench "${descs[@]}" --keys 1000000 \
            --requests "$1" --concurrency "$s" --connections "$conns" --quiet |
            awk '/^requests\/s:/ {print $2}'
        fi
      }
      load 5000 >/dev/null
      read -r c0 u0 < <(evalsha); t0=$(rticks)
      rps=$(load "$n")
      t1=$(rticks); read -r c1 u1 < <(evalsha)
      kill "$pid"; wait "$pid" 2>/dev/null || true
      row "$which" "$s" "$n" "$rps" "$t0" "$t1" "$c0" "$u0" "$c1" "$u1"
    done
    # The Go service's pattern: per descriptor INCRBY + EXPIRE.
    key=bench_hot
    rnd=()
    [ "$cold" = 1 ] && key=bench_cold:__rand_int__ rnd=(-r 1000000)
    for go in go go-window go-inflight; do
      # clients x decisions per pipeline
      clients=$s per=1
      [ "$go" = go-window ] && per=$WINDOW
      if [ "$go" = go-inflight ]; then
        per=$((s < WINDOW ? s : WINDOW)) clients=$(((s + WINDOW - 1) / WINDOW))
      fi
      t0=$(rticks) start=$(date +%s.%N)
      for cmd in "INCRBY $key 1" "EXPIRE $key 3600"; do
        # shellcheck disable=SC2086
        redis-benchmark -p "$rp" -c "$clients" -n $((n * d)) -P $((2 * per * d)) "${rnd[@]}" -q $cmd >/dev/null
      done
      t1=$(rticks) end=$(date +%s.%N)
      rps=$(awk -v n="$n" -v a="$start" -v b="$end" 'BEGIN {print n / (b - a)}')
      row "$go" "$s" "$n" "$rps" "$t0" "$t1"
    done
  done
done
