#!/bin/bash
# Slurm Prolog: start this node's Crossover service for every user if none answers, in
# one world with the other nodes' (every node Slurm knows). Runs as root on each node of
# an allocation before its job (slurm.conf: Prolog=/etc/crossover/slurm/prolog.sh and
# PrologFlags=Alloc, so that every node of a job has its service before the job starts).
#
# Settings: crossover.env beside this script, else /etc/crossover/world.env (root only):
# CROSSOVER_WORLD_KEY (the same on every node), PATH with the crossover command, and
# optionally CROSSOVER_SYSTEM_DIR, CROSSOVER_SERVICE_ARGS (e.g. "--allow-group gpu"),
# CROSSOVER_SERVICE_LOG, and Open MPI's settings for the world's mpirun (docs/deploy.md).
# It never fails a job: without a service the job trains uncoordinated.
set -u
here=$(cd "$(dirname "$0")" && pwd)
conf=$here/crossover.env
[ -r "$conf" ] || conf=/etc/crossover/world.env
set -a
# shellcheck source=/dev/null
. "$conf" || { echo "crossover prolog: cannot read $conf" >&2; exit 0; }
set +a
dir=${CROSSOVER_SYSTEM_DIR:-/run/crossover}
node=${CROSSOVER_NODE:-$(hostname)}  # the node's name, as its ranks call it
if [ -S "$dir/node-$node.sock" ] && crossover status --once >/dev/null 2>&1; then
  exit 0  # running (started by another job's prolog, or by systemd)
fi
mkdir -p "$dir" && chmod 0755 "$dir"
# every node of every partition, hidden ones too, in one order on every node
hosts=$(sinfo -a -h -N -o %N | sort -u | paste -sd, -)
if [ -z "$hosts" ]; then
  echo "crossover prolog: sinfo listed no node; no node service started" >&2
  exit 0
fi
# The service outlives this job: none of the job's variables (an mpirun that finds
# SLURM_JOB_ID would start the world's relays as steps of this job)
for var in $(compgen -e); do
  case $var in SLURM_CONF) ;; SLURM_*) unset "$var" ;; esac
done
# (a prolog running at once for another job starts one too: one of them holds the
# node's lock and serves, the other exits)
# shellcheck disable=SC2086
setsid crossover daemon --system --hosts "$hosts" ${CROSSOVER_SERVICE_ARGS:-} \
  </dev/null >>"${CROSSOVER_SERVICE_LOG:-/var/log/crossover-service.log}" 2>&1 &
for _ in $(seq 150); do
  [ -S "$dir/node-$node.sock" ] && exit 0
  sleep 0.2
done
echo "crossover prolog: no node service on $node after 30 s; see ${CROSSOVER_SERVICE_LOG:-/var/log/crossover-service.log}" >&2
exit 0
