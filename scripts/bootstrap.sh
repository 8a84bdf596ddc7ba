#!/usr/bin/env bash
# One idempotent set-up for `make demo` and `make test` on a fresh Debian machine.
#
# 1. system packages (Open MPI, cmake, g++), only those missing, via apt-get as root;
# 2. a virtual environment in a cache directory outside the clone, named by a hash of
#    everything it is built from, so a second run with nothing changed takes seconds;
# 3. scripts/build-env.sh: torch, TensorFlow, mpi4py, and Horovod 0.28.1 from its PyPI
#    sdist with third_party/horovod-0.28.1.patch (C++17 for PyTorch >= 2.1, TF 2.21 XLA
#    headers, tf_keras backend);
# 4. the light requirements (tests, plotting) on top, keyed apart: adding one is seconds;
# 5. this project, editable; `.venv` in the repo root points at the environment.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${CROSSOVER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/crossover}
horovod_version=0.28.1
python=${PYTHON:-python3}

log() { printf '[bootstrap] %s\n' "$*" >&2; }

# --- 1. system packages ------------------------------------------------------------
need=()
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
[ -e /usr/include/x86_64-linux-gnu/openmpi/mpi.h ] || [ -n "$(find /usr/lib /usr/include -name mpi.h -path '*openmpi*' -print -quit 2>/dev/null)" ] || need+=(libopenmpi-dev)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v g++ >/dev/null 2>&1 || need+=(g++)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
# the emulated cluster's network faults (root only; bench/harness/cluster.py)
if [ "$(id -u)" = 0 ]; then command -v iptables >/dev/null 2>&1 || need+=(iptables); fi
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    log "missing system packages: ${need[*]}; run as root or install them: apt-get install -y ${need[*]}"
    exit 1
  fi
  log "apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi
# a real Prometheus scrapes the metrics endpoint in tests/test_metrics.py (root only; not
# its recommended node exporter)
if [ "$(id -u)" = 0 ] && ! command -v prometheus >/dev/null 2>&1; then
  log "apt-get install prometheus"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -qq --no-install-recommends prometheus ||
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus; }; } >/dev/null
fi

# Slurm and munge run the batch jobs of tests/test_slurm.py on the emulated hosts (root
# only: its daemons, users and namespaces need it)
if [ "$(id -u)" = 0 ] && ! { command -v slurmd && command -v munged; } >/dev/null 2>&1; then
  log "apt-get install slurm-wlm munge"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -qq --no-install-recommends slurm-wlm munge ||
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge; }; } >/dev/null
fi

# --- 2. the environment, keyed by what it is built from ----------------------------
req="$repo/requirements"
# The heavy layer's key: Python, the heavy pins, the Horovod patch, this script.
key=$( { "$python" -c 'import sys; print(sys.version)'; cat "$req/base.txt" \
  "$req/constraints.txt" "$repo/third_party/horovod-$horovod_version.patch" \
  "$repo/scripts/build-env.sh"; } | sha256sum | cut -c1-16)
venv="$cache/env-$key"

pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$req/constraints.txt")
if [ ! -f "$venv/.complete" ]; then
  log "building environment $venv (first time: about 10 minutes)"
  rm -rf "$venv"
  mkdir -p "$cache"
  "$python" -m venv "$venv"
  bash "$repo/scripts/build-env.sh" "$venv"
  touch "$venv/.complete"
fi

# --- 3. the light layer, reinstalled when requirements/dev.txt changes -------------
dev_key=$(sha256sum "$req/dev.txt" | cut -c1-16)
if [ "$(cat "$venv/.dev-key" 2>/dev/null)" != "$dev_key" ]; then
  log "installing requirements/dev.txt"
  "${pip[@]}" -r "$req/dev.txt"
  echo "$dev_key" > "$venv/.dev-key"
fi

# --- 4. this project ---------------------------------------------------------------
# Editable, so the cached environment follows whichever clone ran the bootstrap last.
# setuptools prints pages of deprecation warnings on every run: keep them in a log that
# is shown only if the install fails.
install_log="$cache/install-$(printf '%s' "$repo" | sha256sum | cut -c1-8).log"
if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    --no-build-isolation -e "$repo" >"$install_log" 2>&1; then
  cat "$install_log" >&2
  log "installing this project failed (log above, kept in $install_log)"
  exit 1
fi
ln -sfn "$venv" "$repo/.venv"
log "environment ready: $repo/.venv -> $venv"
