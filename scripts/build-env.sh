#!/usr/bin/env bash
# Builds the heavy layer of the environment into the directory $1 (a fresh venv):
# torch, TensorFlow, mpi4py and Horovod 0.28.1 from its sdist with our patch.
# scripts/bootstrap.sh keys the directory by a hash of this file, the pins and the patch.
set -euo pipefail
venv=$1
repo=$(cd "$(dirname "$0")/.." && pwd)
req="$repo/requirements"
horovod_version=0.28.1
log() { printf '[build-env] %s\n' "$*" >&2; }

pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$req/constraints.txt")
pin() { grep -E "^$1==" "$req/base.txt"; }
"${pip[@]}" --upgrade pip setuptools wheel
"${pip[@]}" "$(pin torch)"
"${pip[@]}" "$(pin tensorflow-cpu)" "$(pin numpy)"
"${pip[@]}" --no-deps "tf-keras==$(pin tensorflow-cpu | cut -d= -f3)"
"${pip[@]}" -r "$req/base.txt"

log "building Horovod $horovod_version (2-4 minutes)"
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
"$venv/bin/python" -m pip download -q --no-deps --no-binary :all: \
  "horovod==$horovod_version" -d "$src"
tar xzf "$src/horovod-$horovod_version.tar.gz" -C "$src"
(cd "$src/horovod-$horovod_version" && patch -s -p1 < "$repo/third_party/horovod-$horovod_version.patch")
HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
  HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=-j"$(nproc)" \
  "${pip[@]}" --no-build-isolation --no-cache-dir "$src/horovod-$horovod_version"
