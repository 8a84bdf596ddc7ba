#!/usr/bin/env bash
# The GPU figures (bench/results/gpu/) in one command, on a machine with an NVIDIA GPU:
#
#   bash bench/gpu/sharing.sh [--build-only] [bench/gpu/sharing.py options]
#   bash bench/gpu/sharing.sh --framework ddp [options]   (two DDP jobs: no Horovod build)
#
# CI has no GPU and never runs this; the CPU suite (`make test`) stays the gate.
# 1. Checks its preconditions and names what is missing: nvidia-smi, a python3 whose
#    torch is a CUDA build that sees a GPU, cmake and nvcc to build Horovod.
# 2. Builds Horovod 0.28.1 with PyTorch and Gloo into .gpu/horovod-site unless it is
#    already importable there (the sdist: $HOROVOD_SDIST, else .gpu/horovod-0.28.1.tar.gz,
#    else pip download; its build needs cffi: from .gpu/wheels offline, else pip). CUDA comes in through PyTorch, with no HOROVOD_GPU_* operation,
#    so Horovod averages CUDA tensors through host memory over Gloo (NCCL refuses two
#    ranks of one communicator on one GPU). No MPI is needed: the jobs use Gloo and a
#    one-node daemon runs without mpirun. Patches: third_party/horovod-0.28.1.patch and
#    third_party/horovod-0.28.1-cuda.patch (CUDA kernels as C++17 for nvcc 13, no
#    distutils on Python 3.12).
# 3. Installs this project into .gpu/crossover-site and runs bench/gpu/sharing.py.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-python3}
work="$repo/.gpu"
hvd_site="$work/horovod-site"
cx_site="$work/crossover-site"
log() { printf '[gpu/sharing] %s\n' "$*" >&2; }
die() { log "$*"; exit 2; }

command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this needs an NVIDIA GPU and its driver"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 \
  || die "nvidia-smi sees no GPU"
"$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || die "$py has no CUDA build of torch that sees the GPU (torch: $("$py" -c 'import torch; print(torch.__version__)' 2>&1 | tail -1))"

export PYTHONPATH="$cx_site:$hvd_site${PYTHONPATH:+:$PYTHONPATH}"
# DDP jobs (--framework ddp) need no Horovod.
needs_horovod=1
case " $* " in *" --framework ddp "*|*" --framework=ddp "*) needs_horovod=0 ;; esac
if [ "$needs_horovod" = 1 ] && ! "$py" -c 'import horovod.torch' 2>/dev/null; then
  command -v cmake >/dev/null || die "cmake not found (pip install cmake), needed to build Horovod"
  command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] \
    || die "nvcc not found: Horovod's build compiles its CUDA kernels when torch has CUDA"
  sdist=${HOROVOD_SDIST:-$work/horovod-0.28.1.tar.gz}
  if [ ! -f "$sdist" ]; then
    mkdir -p "$work"
    "$py" -m pip download -q --no-deps --no-binary :all: horovod==0.28.1 -d "$work" \
      || die "no Horovod sdist: put horovod-0.28.1.tar.gz in $work or set HOROVOD_SDIST"
  fi
  src=$(mktemp -d)
  trap 'rm -rf "$src"' EXIT
  tar xzf "$sdist" -C "$src"
  (cd "$src/horovod-0.28.1" && patch -s -p1 < "$repo/third_party/horovod-0.28.1.patch" \
    && patch -s -p1 < "$repo/third_party/horovod-0.28.1-cuda.patch")
  # Horovod's setup.py asks for cffi at build time; offline, its wheels come from .gpu/wheels.
  deps="$work/build-deps"
  if ! "$py" -c 'import cffi' 2>/dev/null; then
    where=(); [ -d "$work/wheels" ] && where=(--no-index --find-links "$work/wheels")
    "$py" -m pip install -q --no-deps "${where[@]}" --target "$deps" cffi pycparser \
      || die "Horovod's build needs cffi: put the cffi and pycparser wheels in $work/wheels"
  fi
  log "building Horovod 0.28.1 with PyTorch $("$py" -c 'import torch; print(torch.__version__)') and Gloo"
  rm -rf "$hvd_site"
  start=$(date +%s)
  # HOROVOD_BUILD_CUDA_CC_LIST: only this GPU's architecture (all of them takes minutes).
  # CMAKE_POLICY_VERSION_MINIMUM: CMake 4 refuses the vendored Gloo's minimum of 2.8.
  # CXXFLAGS: g++ 13 headers no longer include <string>, <stdexcept> and <cstdint> from
  # others, and Horovod 0.28.1 (with its Gloo) relies on that.
  cc=$("$py" -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}{n}")')
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_BUILD_CUDA_CC_LIST="$cc" \
    CMAKE_POLICY_VERSION_MINIMUM=3.5 \
    CXXFLAGS="${CXXFLAGS:-} -include string -include stdexcept -include cstdint" \
    MAKEFLAGS=-j"$(nproc)" PYTHONPATH="$deps:$PYTHONPATH" "$py" -m pip install -q --no-deps --no-build-isolation \
    --no-cache-dir --target "$hvd_site" "$src/horovod-0.28.1"
  log "Horovod built in $(( $(date +%s) - start )) s"
  "$py" -c 'import horovod, horovod.torch as hvd; print("horovod", horovod.__version__, "gloo built:", hvd.gloo_built())' >&2
fi
[ "${1:-}" = "--build-only" ] && exit 0

rm -rf "$cx_site"
"$py" -m pip install -q --no-deps --no-build-isolation --target "$cx_site" "$repo"
# a module of the repository, which goes last on the path: the crossover imported is the
# install above (with its native module); PYTHONSAFEPATH keeps the working directory off
cd "$repo"
PYTHONSAFEPATH=1 PYTHONPATH="$PYTHONPATH:$repo" exec "$py" -m bench.gpu.sharing "$@"
