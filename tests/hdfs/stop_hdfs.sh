#!/usr/bin/env bash
# Stop the HDFS that tests/hdfs/start_hdfs.sh started in WORK_DIR: only the PIDs it wrote to
# WORK_DIR/pids (and only while they still run that cluster's command line); SIGTERM, up to
# RECPS_HDFS_STOP_TIMEOUT seconds (default 15), then SIGKILL. The data stays in WORK_DIR.
#
#   tests/hdfs/stop_hdfs.sh WORK_DIR
set -uo pipefail
[ $# -eq 1 ] || { echo "usage: $0 WORK_DIR" >&2; exit 2; }
[ -d "$1" ] || { echo "stop_hdfs: no directory $1" >&2; exit 1; }
WORK=$(cd "$1" && pwd)
PIDS_FILE=$WORK/pids
[ -f "$PIDS_FILE" ] || { echo "stop_hdfs: no $PIDS_FILE: nothing to stop" >&2; exit 0; }
WAIT=${RECPS_HDFS_STOP_TIMEOUT:-15}

# A pid is ours while its command line names this work dir (the JVMs get -Drecps.hdfs.dir=WORK,
# the watchdog gets WORK as its last argument): a recycled pid is left alone.
cmdline() {
  if [ -d /proc/self ]; then tr '\0' ' ' 2>/dev/null < "/proc/$1/cmdline"
  else ps -ww -o args= -p "$1" 2>/dev/null; fi
}
ours() {
  local args; args=" $(cmdline "$1") "
  [[ $args == *" -Drecps.hdfs.dir=$WORK "* || $args == *" $WORK "* ]]
}
pids=()
while read -r name pid; do
  [ -n "${pid:-}" ] || continue
  [ "$pid" = "$$" ] && continue          # the watchdog runs this script itself
  if ours "$pid"; then pids+=("$pid"); kill -TERM "$pid" 2>/dev/null || true; fi
done < "$PIDS_FILE"

alive() { local p; for p in "${pids[@]}"; do ours "$p" && return 0; done; return 1; }
deadline=$(( $(date +%s) + WAIT ))
while [ ${#pids[@]} -gt 0 ] && alive && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.2; done
if [ ${#pids[@]} -gt 0 ] && alive; then
  for p in "${pids[@]}"; do ours "$p" && { echo "stop_hdfs: SIGKILL $p" >&2; kill -KILL "$p" 2>/dev/null; }; done
  deadline=$(( $(date +%s) + 5 ))
  while alive && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.2; done
fi
if [ ${#pids[@]} -gt 0 ] && alive; then echo "stop_hdfs: still running: ${pids[*]}" >&2; exit 1; fi
rm -f "$PIDS_FILE"
echo "stop_hdfs: stopped $WORK" >&2
