"""Does a job's GPU work stay inside its slot? The check behind bench/results/gpu/release.json.

A rank must release its device only after the device has finished the kernels of its
hold (hooks/_lifecycle.py synchronises the stream before releasing), and it launches no
kernel until its next grant. Two records of one process are laid on one clock:

- the torch profiler's kernel timeline (CUPTI: when each kernel really ran on the GPU);
- the crossover trace's `hold` spans (wall clock, written by the slot client).

`mark_phases()` puts a marker in the profiler's trace at every phase change, carrying
the wall-clock time in its name, so the offset between the two clocks is measured (the
median over all markers), not assumed. `check_rank` then finds every kernel that ends
after the hold it started in (or starts outside any hold). With the device sync there
must be none; with the sync switched off (`--skip-device-sync` of training_job.py, the
negative control) the backward kernels still queued at release show up.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Iterable
from pathlib import Path

from crossover import trace
from crossover.client import SlotClient

#: Prefix of the phase markers in the profiler's trace: "crossover:<phase>@<epoch s>".
MARK = "crossover:"

#: Kernel events of the torch profiler's Chrome trace; copies are counted apart, since
#: Horovod's completion callback copies the averaged gradients back while not holding
#: (that is the communication the slot was released for).
KERNEL_CATEGORIES = ("kernel",)
COPY_CATEGORIES = ("gpu_memcpy", "gpu_memset")


def mark_phases() -> None:
    """Mark every slot phase change of this process in the torch profiler's trace.

    Call before the profiler starts; patches SlotClient for the process (a bench tool,
    never the library's behaviour).
    """
    import torch

    original = SlotClient._enter

    def _enter(self: SlotClient, phase: str | None) -> None:
        original(self, phase)
        with torch.profiler.record_function(f"{MARK}{phase}@{time.time():.6f}"):
            pass

    SlotClient._enter = _enter


def clock_offset_us(profile: list[dict]) -> float:
    """Profiler clock minus wall clock (µs), the median over the phase markers.

    Raises:
        ValueError: the profile holds no markers (mark_phases was not called first).
    """
    marks = [ev["ts"] - float(ev["name"].rsplit("@", 1)[1]) * 1e6 for ev in profile
             if ev.get("ph") == "X" and str(ev.get("name", "")).startswith(MARK)]
    if not marks:
        raise ValueError("no crossover phase markers in the profile: call "
                         "release_check.mark_phases() before the profiler starts")
    return statistics.median(marks)


def _spans(profile: Iterable[dict], categories: tuple[str, ...], offset_us: float
           ) -> list[tuple[float, float]]:
    """(start, end) in wall-clock µs of the profile's events of these categories."""
    return sorted((ev["ts"] - offset_us, ev["ts"] + ev.get("dur", 0) - offset_us)
                  for ev in profile if ev.get("ph") == "X" and ev.get("cat") in categories)


def check_rank(profile: list[dict], holds: list[tuple[float, float]],
               slack_us: float = 10.0) -> dict:
    """GPU work of one rank measured against its holds.

    Work is kernels and copies. Launched while holding, it should finish before the
    release: one that runs past the end of its hold is an overrun, a kernel's and a copy's
    counted apart. A kernel overrun is a violation (compute of this job beside the next
    holder's). A copy overrun is the communication the slot was released for, begun while
    holding: torch's gloo allreduce copies a DDP bucket to host memory on its own stream as
    soon as the bucket is handed over, on the copy engines, not the SMs. Launched while not
    holding, a kernel is a violation; a copy is communication (Horovod's callback copies
    the averaged gradients back to the GPU), counted apart.

    Args:
        profile: the rank's torch-profiler trace events.
        holds: its `hold` spans, (start, end) in wall-clock µs.
        slack_us: tolerance for the clock mapping (the markers are a few µs apart from
            the instants they stand for).

    Returns:
        kernels, copies: the work checked; overruns: kernel_overruns plus copy_overruns;
        outside: overruns plus kernels started while not holding; max_overrun_us,
        overrun_s: the largest and the total time past a hold's end; min_margin_us: the
        least time between a hold's last work and its release (negative when work
        overran); copies_released: copies started while not holding.

    Raises:
        ValueError: the profile holds no kernels, or no phase markers.
    """
    holds = sorted(holds)
    starts = [s for s, _ in holds]
    offset = clock_offset_us(profile)
    kernels = _spans(profile, KERNEL_CATEGORIES, offset)
    copies = _spans(profile, COPY_CATEGORIES, offset)
    if not kernels:
        raise ValueError("no GPU kernels in the profile: was it recorded with "
                         "ProfilerActivity.CUDA on a GPU run?")
    overruns, released_kernels, released_copies, kernel_overruns = [], 0, 0, 0
    last_end: dict[int, float] = {}
    for work, is_kernel in ((kernels, True), (copies, False)):
        for start, end in work:
            i = bisect.bisect_right(starts, start) - 1  # the last hold begun by then
            if i < 0 or start > holds[i][1]:  # launched while not holding
                released_kernels += is_kernel
                released_copies += not is_kernel
                continue
            last_end[i] = max(last_end.get(i, float("-inf")), end)
            if end - holds[i][1] > slack_us:
                overruns.append(end - holds[i][1])
                kernel_overruns += is_kernel
    margins = [holds[i][1] - e for i, e in last_end.items() if i < len(holds) - 1]
    return {"kernels": len(kernels), "copies": len(copies),
            "outside": len(overruns) + released_kernels, "overruns": len(overruns),
            "kernel_overruns": kernel_overruns, "copy_overruns": len(overruns) - kernel_overruns,
            "kernels_released": released_kernels,
            "max_overrun_us": max(overruns, default=0.0),
            "overrun_s": sum(overruns) / 1e6,
            "min_margin_us": min(margins, default=float("nan")),
            "holds": len(holds), "copies_released": released_copies,
            "clock_offset_us": offset}


def busy_union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) spans as sorted disjoint spans."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def overlap_s(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds during which both unions (µs spans, disjoint and sorted) are busy."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total / 1e6


def check_run(profile_dir: Path, trace_dir: Path, jobs: list[str], ranks: int) -> dict:
    """Every rank of every job of one run: per-rank results, totals, and how long kernels
    of different jobs ran at the same time (wall clock, from the mapped timelines).

    Files: profile_dir/<job>.rank<r>.json (torch profiler), trace_dir/<job>.rank<r>.json
    (crossover trace).
    """
    per_rank, busy = {}, {}
    for job in jobs:
        spans: list[tuple[float, float]] = []
        for r in range(ranks):
            profile = trace.load(profile_dir / f"{job}.rank{r}.json")
            holds = [(ev["ts"], ev["ts"] + ev["dur"]) for ev in
                     trace.load(trace_dir / f"{job}.rank{r}.json")
                     if ev.get("ph") == "X" and ev.get("name") == "hold"]
            per_rank[f"{job}.rank{r}"] = check_rank(profile, holds)
            spans += _spans(profile, KERNEL_CATEGORIES, clock_offset_us(profile))
        busy[job] = busy_union(spans)
    rows = per_rank.values()
    cross = sum(overlap_s(busy[a], busy[b]) for i, a in enumerate(jobs) for b in jobs[i + 1:])
    return {"kernels": sum(r["kernels"] for r in rows),
            "copies": sum(r["copies"] for r in rows),
            "outside": sum(r["outside"] for r in rows),
            "overruns": sum(r["overruns"] for r in rows),
            "kernel_overruns": sum(r["kernel_overruns"] for r in rows),
            "copy_overruns": sum(r["copy_overruns"] for r in rows),
            "kernels_released": sum(r["kernels_released"] for r in rows),
            "max_overrun_us": max(r["max_overrun_us"] for r in rows),
            "overrun_s": sum(r["overrun_s"] for r in rows),
            "min_margin_us": min(r["min_margin_us"] for r in rows),
            "holds": sum(r["holds"] for r in rows),
            "copies_released": sum(r["copies_released"] for r in rows),
            "kernels_of_two_jobs_at_once_s": cross,
            "per_rank": per_rank}
