"""What every benchmark records beside its numbers: the machine and the command."""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


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


def write_result(name: str, payload: dict) -> Path:
    """Write bench/results/<name>.json with the machine, the command and a timestamp."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.json"
    cmd = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    doc = {"command": cmd, "machine": machine(),
           "when": datetime.now(timezone.utc).isoformat(timespec="seconds"), **payload}
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return out


def rotation(n: int, rep: int) -> list[int]:
    """The order in which to run `n` arms in repetition `rep`.

    Arms run one after another on a machine whose speed drifts (another tenant, the
    thermal state); in a fixed order the last arm always meets the drift first. Each
    repetition starts one stride further on, with a stride near n/2 and coprime with n,
    so over a few repetitions every arm takes early, middle and late places.
    """
    if n < 1 or rep < 0:
        raise ValueError(f"rotation of {n} arms for repetition {rep}: need n >= 1, rep >= 0")
    stride = next(s for s in range(max(n // 2, 1), 0, -1) if math.gcd(s, n) == 1)
    start = rep * stride % n
    return [(start + i) % n for i in range(n)]


def stop_all(daemons: Sequence[Any]) -> None:
    """Stop every daemon (each has `stop()`), even when a signal interrupts one stop:
    a second Ctrl-C during the teardown left the other arms' daemons running."""
    if not daemons:
        return
    try:
        daemons[0].stop()
    finally:
        stop_all(daemons[1:])
