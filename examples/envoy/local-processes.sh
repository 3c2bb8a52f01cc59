# Sourced by the loopback scripts (run-local.sh here and in rlqs/): the
# processes they start, their logs, and how they stop.
#
# After sourcing: `work` is a fresh directory for configs and logs, and
# `pids+=($!)` records a started process. On exit every recorded process
# is stopped; the logs are deleted after a success or a stop by SIGINT or
# SIGTERM, and kept (their last lines printed, their directory named)
# after a failure. SIGINT and
# SIGTERM stop everything, also when the script was started in the
# background by a non-interactive shell (which starts it with SIGINT
# ignored: the script then runs itself again with SIGINT restored, since a
# signal ignored at entry cannot be trapped).
if [ -z "${RUN_LOCAL_SIGINT_RESTORED:-}" ] \
  && [ $(( 0x$(awk '/^SigIgn:/ {print $2}' /proc/$$/status 2>/dev/null || echo 0) & 2 )) -ne 0 ]; then
  export RUN_LOCAL_SIGINT_RESTORED=1
  exec python3 -c 'import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.execvp(sys.argv[1], sys.argv[1:])' bash "$0" "$@"
fi

work="$(mktemp -d)"
pids=()
cleanup() {
  local status=$?
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ "$status" -eq 0 ] || [ "$status" -eq 130 ] || [ "$status" -eq 143 ]; then
    rm -rf "$work"
  else
    for f in "$work"/*.log; do
      [ -e "$f" ] || continue
      echo "--- last lines of $f" >&2
      tail -n 20 "$f" >&2
    done
    echo "run-local: exit status $status; configs and logs kept in $work" >&2
  fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
