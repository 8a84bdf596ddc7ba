#!/bin/bash
# Slurm Epilog: once no job runs on this node any more, stop its Crossover service (the
# one prolog.sh started); it leaves no process, socket or lock behind. Settings as for
# prolog.sh. A service systemd runs is left alone: do not install this epilog then.
set -u
here=$(cd "$(dirname "$0")" && pwd)
conf=$here/crossover.env
[ -r "$conf" ] || conf=/etc/crossover/world.env
set -a
# shellcheck source=/dev/null
. "$conf" || exit 0
set +a
node=$(hostname)
# (this job is completing, not running; another that ends at once stops it too)
if squeue -h -w "$node" -t RUNNING,CONFIGURING -o %A | grep -qvx "${SLURM_JOB_ID:-}"; then
  exit 0  # another job still runs here
fi
pid=$(crossover status --json 2>/dev/null | python3 -c \
  'import json, socket, sys; print(json.load(sys.stdin)[socket.gethostname()]["daemon"]["pid"])' \
  2>/dev/null) || exit 0  # none answers
kill -TERM "$pid" 2>/dev/null || exit 0
for _ in $(seq 150); do
  kill -0 "$pid" 2>/dev/null || exit 0
  sleep 0.1
done
echo "crossover epilog: the node service (process $pid) did not stop within 15 s" >&2
exit 0
