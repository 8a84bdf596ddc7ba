"""`crossover check`: is this environment ready to run jobs under crossover, and what is
missing, with the fix for each.

Every line is one part (MPI, Horovod and its frameworks and controllers, the native fast
path, the runtime directory, the CROSSOVER_* settings): `ok`, `warn` (works, with
less: say the native fast path is missing) or `MISSING` (jobs cannot run under crossover
until it is fixed; the exit status is then 1).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import crossover
from crossover import environment as E

#: The versions the test suite runs against (requirements/base.txt, requirements/dev.txt
#: and scripts/bootstrap.sh); others may work, and `check` says when one is untested.
TESTED = {
    "python": "3.11", "horovod": "0.28.1", "torch": "2.13", "tensorflow": "2.21",
    "tf_keras": "2.21", "lightning": "2.6", "mpi4py": "4.1", "open_mpi": "4.1",
}


@dataclass(frozen=True)
class Finding:
    """One part of the installation: its state and what to do about it."""

    status: str  # "ok", "warn" or "MISSING"
    part: str
    detail: str

    def line(self) -> str:
        return f"  {self.status:<8} {self.part:<12} {self.detail}"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _tested(name: str, version: str) -> str:
    """"" for a version whose major.minor is the tested one, else a note saying so."""
    def major_minor(text: str) -> tuple[str, ...]:
        return tuple(text.split("+")[0].split(" ")[0].split(".")[:2])

    same = major_minor(version) == major_minor(TESTED[name])
    return "" if same else f" (untested: tested with {TESTED[name]})"


def check_mpi() -> Finding:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return Finding("MISSING", "MPI", "no mpirun on PATH: install Open MPI "
                                         "(apt-get install openmpi-bin libopenmpi-dev)")
    try:
        import mpi4py

        mpi4py.rc.initialize = False  # the library's version needs no MPI_Init
        from mpi4py import MPI
    except ImportError as exc:
        return Finding("MISSING", "MPI", f"mpi4py cannot be imported ({exc}): "
                                         f"pip install mpi4py (it builds against mpicc)")
    library = MPI.Get_library_version().split(",")[0].strip()
    note = ""
    if library.startswith("Open MPI v"):
        note = _tested("open_mpi", library.removeprefix("Open MPI v"))
    return Finding("ok", "MPI", f"{library}{note}; mpirun {mpirun}; mpi4py "
                                f"{mpi4py.__version__}{_tested('mpi4py', mpi4py.__version__)}")


#: Imports one of Horovod's framework modules and prints its controllers as JSON.
_PROBE = """
import json, sys
hvd = __import__(sys.argv[1], fromlist=["mpi_built"])
print(json.dumps([name for name, built in (("MPI", hvd.mpi_built()), ("Gloo",
      hvd.gloo_built()), ("NCCL", hvd.nccl_built())) if built]))
"""


def _horovod_framework(module: str) -> tuple[bool, list[str], str | None]:
    """(built, controllers, error) of Horovod for one framework, asked in a process of
    its own: a framework that crashes on import, or talks while loading, costs this
    check one line, not the report."""
    try:
        res = subprocess.run([sys.executable, "-c", _PROBE, module], capture_output=True,
                             text=True, timeout=300,
                             env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    except subprocess.TimeoutExpired:
        return False, [], f"importing {module} took over 300 s"
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or [f"exit status {res.returncode}"])[-1]
        return False, [], last
    return True, json.loads(res.stdout.strip().splitlines()[-1]), None


#: Whether this PyTorch can run DDP jobs (torch.distributed with gloo), asked apart.
_DDP_PROBE = ("import torch, torch.distributed as d; print(d.is_available() and "
              "d.is_gloo_available(), d.is_nccl_available() if d.is_available() else False)")


def check_ddp() -> Finding:
    torch_version = _version("torch")
    if torch_version is None:
        return Finding("warn", "PyTorch DDP", "PyTorch is not installed: no DDP jobs")
    try:
        res = subprocess.run([sys.executable, "-c", _DDP_PROBE], capture_output=True,
                             text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return Finding("warn", "PyTorch DDP", "importing torch.distributed took over 300 s")
    try:
        gloo, nccl = res.stdout.split()
    except ValueError:
        last = (res.stderr.strip().splitlines() or [f"exit status {res.returncode}"])[-1]
        return Finding("warn", "PyTorch DDP", f"torch.distributed cannot be imported ({last})")
    if gloo != "True":
        return Finding("warn", "PyTorch DDP", "torch.distributed without gloo: no DDP jobs")
    backends = "gloo, nccl" if nccl == "True" else "gloo"
    return Finding("ok", "PyTorch DDP", f"torch.distributed ({backends}); "
                                        f"crossover-torchrun launches DDP jobs")


def check_horovod() -> list[Finding]:
    version = _version("horovod")
    if version is None:
        # DDP jobs need no Horovod: its absence stops only Horovod jobs
        status = "warn" if check_ddp().status == "ok" else "MISSING"
        return [Finding(status, "Horovod", "not installed: Horovod jobs cannot run; build it "
                                           "with your framework and MPI, e.g. "
                                           "HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 pip "
                                           "install horovod")]
    found, usable = [], 0
    for framework, dist, module in (("PyTorch", "torch", "horovod.torch"),
                                    ("TensorFlow", "tensorflow", "horovod.tensorflow")):
        fw_version = _version(dist) or _version(f"{dist}-cpu")
        if fw_version is None:
            continue
        built, controllers, error = _horovod_framework(module)
        note = _tested(dist, fw_version)
        if not built:
            found.append(Finding("warn", framework, f"{fw_version}{note}, but Horovod has no "
                                 f"{framework} support ({error}); rebuild it: "
                                 f"HOROVOD_WITH_{dist.upper()}=1 pip install --no-cache-dir "
                                 f"--force-reinstall horovod"))
            continue
        usable += 1
        found.append(Finding("ok", framework, f"{fw_version}{note}; Horovod controllers: "
                                              f"{', '.join(controllers) or 'none'}"))
    head = Finding("ok", "Horovod", f"{version}{_tested('horovod', version)}")
    if not usable:
        head = Finding("MISSING", "Horovod", f"{version}, but with no usable framework: "
                       f"install PyTorch or TensorFlow and rebuild Horovod with it")
    return [head, *found, *_check_keras()]


def _check_keras() -> list[Finding]:
    if _version("tensorflow") is None and _version("tensorflow-cpu") is None:
        return []
    if _version("tf_keras") is None:
        return [Finding("warn", "Keras", "tf_keras is not installed: Horovod's Keras API "
                                         "needs Keras 2 (pip install tf-keras, and set "
                                         "TF_USE_LEGACY_KERAS=1)")]
    return [Finding("ok", "Keras", f"tf_keras {_version('tf_keras')}; run Keras jobs with "
                                   f"TF_USE_LEGACY_KERAS=1 (under Keras 3 Horovod does not "
                                   f"average gradients)")]


def check_native() -> Finding:
    from crossover import slot_table

    if slot_table._native is None:
        return Finding("warn", "native path", f"{slot_table.UNAVAILABLE}; jobs use the "
                       f"socket path (slower handoffs). Reinstall with a C++ compiler "
                       f"present: pip install --force-reinstall --no-deps .")
    return Finding("ok", "native path", "crossover._native (the shared slot table)")


def check_runtime_dir() -> Finding:
    from crossover.probe import daemon_listens
    from crossover.transport import runtime_dir, system_dir

    try:
        rdir = runtime_dir(create=False)
    except PermissionError as exc:
        return Finding("MISSING", "runtime dir", str(exc))
    if not rdir.exists():
        parent = next((p for p in rdir.parents if p.exists()), rdir.anchor)
        if not os.access(parent, os.W_OK):
            return Finding("MISSING", "runtime dir", f"{rdir} cannot be made ({parent} is "
                           f"not writable); set CROSSOVER_RUNTIME_DIR to a directory of "
                           f"your own")
        return Finding("ok", "runtime dir", f"{rdir} (made by the first daemon); no daemon "
                                            f"running (crossoverrun --crossover starts one)")
    if rdir == system_dir():
        state = "listens" if daemon_listens(rdir) else "does not answer now"
        return Finding("ok", "runtime dir", f"{rdir}: this node's crossover service for every "
                                            f"user, which {state} (CROSSOVER_RUNTIME_DIR "
                                            f"names a daemon of your own instead)")
    daemon = "a daemon listens" if daemon_listens(rdir) else \
        "no daemon running (crossoverrun --crossover starts one)"
    return Finding("ok", "runtime dir", f"{rdir} (yours, 0700); {daemon}")


def check_settings() -> Finding:
    bad = E.check()  # the job's, the launcher's and the daemon's
    if bad:
        return Finding("MISSING", "settings", "; ".join(bad))
    given = sorted(k for k in os.environ if k.startswith("CROSSOVER_"))
    return Finding("ok", "settings", ", ".join(given) if given else "no CROSSOVER_* set")


def check_extras() -> list[Finding]:
    if importlib.util.find_spec("matplotlib") is None:
        return [Finding("warn", "plots", "matplotlib is not installed: `crossover trace plot` "
                                         "needs it (pip install matplotlib)")]
    return []


CHECKS: list[Callable[[], Finding | list[Finding]]] = [
    check_mpi, check_horovod, check_ddp, check_native, check_runtime_dir, check_settings,
    check_extras,
]


def run() -> Iterator[Finding]:
    """Every check's findings, in order, each as soon as it is known."""
    for check in CHECKS:
        found = check()
        yield from found if isinstance(found, list) else [found]


def main() -> int:
    """Print the findings; exit status 0 when jobs can run under crossover, else 1."""
    print(f"crossover {crossover.__version__} on Python {platform.python_version()} "
          f"({platform.system()} {platform.machine()})"
          f"{_tested('python', platform.python_version())}", flush=True)
    ready = True
    for finding in run():
        print(finding.line(), flush=True)
        ready = ready and finding.status != "MISSING"
    print("ready: jobs can run under crossover" if ready else
          "not ready: fix the MISSING lines above")
    return 0 if ready else 1
