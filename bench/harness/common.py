"""What every benchmark records beside its numbers: the machine and the command."""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
#: Where results go: bench/results, or $CROSSOVER_BENCH_RESULTS (bench/device_suite.sh
#: --dry-run points it at a temporary directory, so toy runs never touch the committed
#: figures).
RESULTS = Path(os.environ.get("CROSSOVER_BENCH_RESULTS") or REPO / "bench" / "results")


def module_argv(module: str, *args: str) -> list[str]:
    """The command line running a bench module as a script (`python -m bench.<area>.<name>`).
    The repository must be on the child's path: run it with `cwd=REPO`, or with
    `jobs.JOB_ENV`, whose PYTHONPATH names the repository."""
    return [sys.executable, "-m", module, *args]


def machine() -> dict:
    """CPU model, core count, memory, OS, and the versions of the parts that matter."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                .splitlines() if ln.startswith("model name")), platform.processor())
    mem_kb = int(next(ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines()
                      if ln.startswith("MemTotal")))
    versions = {}
    for mod in ("torch", "horovod", "mpi4py", "numpy"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_kb / 2**20, 1),
            "os": platform.platform(), "python": platform.python_version(), **versions}


def code_version() -> str:
    """The commit the benchmark ran (with -dirty for uncommitted changes), so that a
    result can be told apart from one of older code. Results do not count: a benchmark
    writes its pictures before its numbers."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=30)

    rev = git("rev-parse", "--short", "HEAD")
    if rev.returncode != 0:
        return "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                  ":(exclude)bench/results")
    return rev.stdout.strip() + ("-dirty" if changed.stdout.strip() else "")


def command_line() -> str:
    """How this benchmark was started, as a user would type it from the repository root."""
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    script = ["-m", spec.name] if spec is not None else sys.argv[:1]
    return shlex.join([Path(sys.executable).name, *script, *sys.argv[1:]])


def area_results(area: str) -> Path:
    """Where an area's results go: bench/results/<area>/ (a dry run's folder instead)."""
    return RESULTS / area


def write_result(folder: Path, name: str, payload: dict) -> Path:
    """Write <folder>/<name>.json with the machine, the command, the code and a timestamp."""
    out = folder / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"command": command_line(), "machine": machine(), "code": code_version(),
           "when": datetime.now(timezone.utc).isoformat(timespec="seconds"), **payload}
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return out


def arm_order(n: int, rep: int) -> list[int]:
    """The order in which to run `n` arms in repetition `rep`: a row of a Williams design.

    Arms run one after another on a machine whose speed drifts (another tenant, the
    thermal state): in a fixed order the last arm always meets the drift first, and an
    arm may also pay for the one before it (its processes' exit, its daemon's state). Row
    r is r added to 0, 1, n-1, 2, n-2, ... (mod n); the rows after the first n are those
    reversed. Over n repetitions (2n for odd n) every arm takes every place equally
    often and follows every other arm equally often; a cyclic rotation would keep each
    arm's neighbours.
    """
    if n < 1 or rep < 0:
        raise ValueError(f"order of {n} arms for repetition {rep}: need n >= 1, rep >= 0")
    base = [0]
    for i in range(1, n):
        base.append((i + 1) // 2 if i % 2 else n - i // 2)
    rows = n if n % 2 == 0 else 2 * n
    r = rep % rows
    row = [(b + r) % n for b in base]
    return row if r < n else row[::-1]


def stop_all(daemons: Sequence[Any]) -> None:
    """Stop every daemon (each has `stop()`), even when a signal interrupts one stop:
    a second Ctrl-C during the teardown left the other arms' daemons running."""
    if not daemons:
        return
    try:
        daemons[0].stop()
    finally:
        stop_all(daemons[1:])


class DecisionLog:
    """The mode decisions a daemon's log gained since the last `new()`: each switch's
    reason, in order (a daemon that serves many runs: what the latest run decided)."""

    PATTERN = re.compile(r" mode (?:antiphase|concurrent) for group \d+ \([^)]*\): (.*?)"
                         r"(?: \(decided in [0-9.]+ s\))?$", re.M)
    #: a node's hand-over delayed by the phase aligner (`--align-phases`): its lead, ms
    DELAYS = re.compile(r"'s turns (\d+) ms ahead of another node's", re.M)

    def __init__(self, log: Path, pattern: re.Pattern = PATTERN) -> None:
        self.log, self._read, self.pattern = log, 0, pattern

    def new(self) -> list[str]:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        end = text.rfind("\n") + 1  # a line still being written is read next time
        found, self._read = self.pattern.findall(text[self._read:end]), max(end, self._read)
        return found
