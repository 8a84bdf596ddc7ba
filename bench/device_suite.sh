#!/usr/bin/env bash
# Every figure that only a GPU machine (or its 16 cores) can settle, in one run of at
# most 8 minutes: run it first, in one call, whenever a GPU machine is at hand (see
# DEVELOPERS.md and docs/gpu.md).
#
#   bash bench/device_suite.sh [--parts ddp,neighbour,horovod,manycore,gpu_rows]
#                              [--budget 480] [--export DIR]
#   bash bench/device_suite.sh --dry-run     # every part toy sized on this CPU, into a
#                                            # temporary directory: a check, no figure
#
# Parts, in order, each under its own `timeout`, its record written the moment it ends:
#   ddp        two DDP jobs on one GPU: the release check (no kernel after a release),
#              then the sharing arms              -> bench/results/gpu/ddp_*.json
#   neighbour  a freezing pipeline beside a DDP job on the GPU: the job's step rate after
#              the pipeline's cut over before it  -> bench/results/gpu/freeze_neighbour.json
#   horovod    two Horovod jobs on one GPU, Horovod built first: only if the time left
#              allows, else recorded as skipped   -> bench/results/gpu/{release,sharing}.json
#   manycore   pipeline rows at 2, 4, 8 real ranks, one a core, and the simulator's error
#              at 2 ranks                         -> bench/results/pipeline_<cores>core.json
#   gpu_rows   a hook for the default policy's rows on one GPU (not built yet)
# Every run: bench/results/gpu/device_suite.json (each part's status, figures, targets).
#
# The Python is $PYTHON, else python3 (on the GPU machine: the one with CUDA torch); a dry
# run takes this clone's .venv when there is one. The runner is bench/gpu/suite.py, run
# from the repository root as a module.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-}
if [ -z "$py" ]; then
  py=python3
  case " $* " in
    *" --dry-run "*) [ -x "$repo/.venv/bin/python" ] && py="$repo/.venv/bin/python" ;;
  esac
fi
command -v "$py" >/dev/null || { echo "device_suite: no Python at '$py': set PYTHON" >&2; exit 2; }
cd "$repo"
exec "$py" -u -m bench.gpu.suite "$@"
