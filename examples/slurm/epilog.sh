#!/bin/bash
# Slurm Epilog: once no job runs on this node any more, stop its Crossover service (the
# one prolog.sh started); it leaves no process or socket behind. Settings as for
# prolog.sh. A service systemd runs is left alone: do not install this epilog then.
set -u
here=$(cd "$(dirname "$0")" && pwd)
conf=$here/crossover.env
[ -r "$conf" ] || conf=/etc/crossover/world.env
set -a
# shellcheck source=/dev/null
. "$conf" || exit 0
set +a
# (this job is completing, not running; another that ends at once stops it too; where
# squeue cannot say, the service is kept)
ids=$(squeue -h -w "${SLURMD_NODENAME:-$(hostname)}" -t RUNNING,CONFIGURING -o %A) || exit 0
others=$(printf '%s\n' "$ids" | grep -vx -e "${SLURM_JOB_ID:-}" -e '' || true)
[ -z "$others" ] || exit 0  # another job still runs here
pid=$(crossover status --json 2>/dev/null | python3 -c '
import json, os, socket, sys
node = os.environ.get("CROSSOVER_NODE") or socket.gethostname()
print(json.load(sys.stdin)[node]["daemon"]["pid"])' 2>/dev/null) || exit 0  # none answers
kill -TERM "$pid" 2>/dev/null || exit 0
for _ in $(seq 150); do
  kill -0 "$pid" 2>/dev/null || exit 0
  sleep 0.1
done
echo "crossover epilog: the node service (process $pid) did not stop within 15 s" >&2
exit 0
