"""Chrome-trace events of slot use: pid = job, tid = rank; merge; Gantt chart.

Each rank writes its own file (no coordination needed at exit); `merge` joins the
files of several jobs into one that chrome://tracing or Perfetto opens. Timestamps are
wall-clock microseconds, so files from different processes line up.
"""

from __future__ import annotations

import json
import os
import zlib
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path


def job_pid(job: str) -> int:
    """A stable integer process id for a job name (Chrome traces want numbers)."""
    return zlib.crc32(job.encode()) & 0x7FFFFFFF


class TraceRecorder:
    """Collects one rank's spans in memory and writes them as Chrome trace JSON.

    Args:
        job: the job's name (the trace's process).
        rank: the rank (the trace's thread).
        path: the file `flush` writes.
    """

    def __init__(self, job: str, rank: int, path: str | os.PathLike) -> None:
        self.job, self.rank, self.path = job, rank, Path(path)
        pid = job_pid(job)
        self.events: list[dict] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": rank, "args": {"name": job}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": rank,
             "args": {"name": f"rank {rank}"}},
        ]

    def span(self, name: str, start_s: float, end_s: float, **args) -> None:
        """Record a complete event from `start_s` to `end_s` (seconds since the epoch)."""
        self.events.append({
            "ph": "X", "name": name, "pid": job_pid(self.job), "tid": self.rank,
            "ts": start_s * 1e6, "dur": max(0.0, end_s - start_s) * 1e6, "args": args,
        })

    def instant(self, name: str, at_s: float, **args) -> None:
        """Record a moment (a mode switch, say) at `at_s` seconds since the epoch."""
        self.events.append({"ph": "i", "s": "p", "name": name, "pid": job_pid(self.job),
                            "tid": self.rank, "ts": at_s * 1e6, "args": args})

    def flush(self) -> None:
        """Write all events so far (the file is replaced, so flushing twice is fine)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"traceEvents": self.events}))
        tmp.replace(self.path)


def load(path: str | os.PathLike) -> list[dict]:
    """The events of a Chrome trace file (either the object or the bare-list form).

    Raises:
        ValueError: the file is not a Chrome trace, naming the file.
    """
    text = Path(path).read_text().strip()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        # Horovod's timeline is a JSON list left open while the job runs.
        try:
            data = json.loads(text.rstrip(",\n ") + "]")
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a Chrome trace ({exc})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    # Horovod's timeline counts from its start, given once in a metadata event; ours
    # count from the epoch. Shift so merged files share one clock.
    start = next((ev["args"]["start_time_since_epoch_in_micros"] for ev in events
                  if ev.get("ph") == "M" and isinstance(ev.get("args"), dict)
                  and "start_time_since_epoch_in_micros" in ev["args"]), 0)
    if start:
        for ev in events:
            if "ts" in ev:
                ev["ts"] += start
    return events


def merge(paths: Iterable[str | os.PathLike], out: str | os.PathLike) -> list[dict]:
    """Merge trace files into `out`; returns the merged events."""
    events: list[dict] = []
    seen_meta = set()
    for p in paths:
        for ev in load(p):
            if ev.get("ph") == "M":
                key = (ev.get("name"), ev.get("pid"), ev.get("tid"))
                if key in seen_meta:
                    continue
                seen_meta.add(key)
            events.append(ev)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"traceEvents": events}))
    return events


def holds_by_device(events: Iterable[dict]) -> dict[str, list[tuple[float, float, str, int]]]:
    """Slot holds grouped by device: {device: [(start_us, end_us, job, rank), ...]} sorted.

    The job name comes from the process_name metadata.
    """
    names = {ev["pid"]: ev["args"]["name"] for ev in events
             if ev.get("ph") == "M" and ev.get("name") == "process_name"
             and "name" in ev.get("args", {})}
    out: dict[str, list] = defaultdict(list)
    for ev in events:
        # (a rank that lost its daemon mid-hold records no device: not a device's hold)
        if ev.get("ph") == "X" and ev.get("name") == "hold" and \
                ev.get("args", {}).get("device") is not None:
            job = names.get(ev["pid"], str(ev["pid"]))
            out[ev["args"].get("device", "?")].append(
                (ev["ts"], ev["ts"] + ev["dur"], job, ev["tid"]))
    return {dev: sorted(spans) for dev, spans in sorted(out.items())}


def rank_skew(events: Iterable[dict]) -> dict[str, dict[str, float]]:
    """How far apart in time a job's ranks on different devices start their holds.

    In antiphase a job's ranks should hold their devices together (the same turn of the
    global sequence on every device): a rank that starts later delays the job's
    allreduce, which waits for the last gradient. For each hold of a rank other than
    the job's lowest, the skew is the distance to the nearest hold start of that lowest
    rank on another device. Returns {job: {"median_ms", "p90_ms", "hold_ms" (the
    job's median hold), "holds", "apart"}} for jobs with ranks on two or more devices.
    `apart` is the share of holds more than half the median hold from the nearest: with
    two jobs alternating, hosts that far apart run different jobs at once, and each
    job's allreduce waits for its later rank (docs/benchmarks.md, "The hosts' phases
    drift apart in antiphase").
    """
    by_rank: dict[tuple[str, int], list[tuple[float, float, str]]] = defaultdict(list)
    for dev, spans in holds_by_device(events).items():
        for start, end, job, rank in spans:
            by_rank[(job, rank)].append((start, end - start, dev))
    out = {}
    for job in sorted({job for job, _ in by_rank}):
        ranks = sorted(r for j, r in by_rank if j == job)
        first = sorted(by_rank[(job, ranks[0])])
        skews = []
        for rank in ranks[1:]:
            for start, _, dev in by_rank[(job, rank)]:
                near = [abs(start - s0) for s0, _, d0 in first if d0 != dev]
                if near:
                    skews.append(min(near) / 1e3)
        if skews:
            holds = sorted(h / 1e3 for spans in (by_rank[(job, r)] for r in ranks)
                           for _, h, _ in spans)
            skews.sort()
            hold_ms = holds[len(holds) // 2]
            out[job] = {"median_ms": skews[len(skews) // 2],
                        "p90_ms": skews[int(0.9 * (len(skews) - 1))],
                        "hold_ms": hold_ms, "holds": len(skews),
                        "apart": sum(s > hold_ms / 2 for s in skews) / len(skews)}
    return out


def handovers(events: Iterable[dict]) -> dict[str, int]:
    """Per device, how many times its holds passed from one job to another. Jobs that ran
    at the same time hand a shared device back and forth; jobs that ran one after the
    other hand it over once: a check that holds never overlap says nothing about them."""
    return {dev: sum(a[2] != b[2] for a, b in zip(spans, spans[1:], strict=False))
            for dev, spans in holds_by_device(events).items()}


def busy(events: Iterable[dict]) -> dict[str, float]:
    """Per device, the share of its traced time (first hold's start to last hold's end)
    in which some rank held it: near 1, turns left the device idle almost never, and a
    makespan above the jobs' compute comes from the holds themselves."""
    out = {}
    for dev, spans in holds_by_device(events).items():
        first, last = spans[0][0], max(end for _, end, _, _ in spans)
        held, reach = 0.0, first
        for start, end, _, _ in spans:  # sorted by start: count each instant once
            held += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        out[dev] = held / (last - first) if last > first else 1.0
    return out


def overlaps(events: Iterable[dict]) -> list[tuple[str, tuple, tuple]]:
    """Pairs of holds by different jobs on one device that overlap in time."""
    found = []
    for dev, spans in holds_by_device(events).items():
        latest = None  # the span reaching furthest right so far
        for span in spans:
            if latest is not None and span[0] < latest[1] and span[2] != latest[2]:
                found.append((dev, latest, span))
            if latest is None or span[1] > latest[1]:
                latest = span
    return found


def plot_gantt(events: Iterable[dict], png: str | os.PathLike, title: str = "",
               marks: Iterable[tuple[str, float]] = ()) -> None:
    """Draw slot holds per device (one lane each, split into a strip per job so that
    concurrent holds show side by side instead of one painted over the other), coloured
    by job, and the mode switches the ranks recorded, to a PNG.

    `marks`: (label, wall-clock seconds) of other moments to show (a pipeline's cut,
    say), as solid lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = list(events)
    by_dev = holds_by_device(events)
    if not by_dev:
        raise ValueError("no 'hold' events to plot")
    t0 = min(s[0] for spans in by_dev.values() for s in spans)
    jobs = sorted({s[2] for spans in by_dev.values() for s in spans})
    colors = {j: plt.cm.tab10(i % 10) for i, j in enumerate(jobs)}
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * len(by_dev)))
    strip = 0.8 / len(jobs)
    for lane, spans in enumerate(by_dev.values()):
        for i, job in enumerate(jobs):
            bars = [((s[0] - t0) / 1e3, (s[1] - s[0]) / 1e3) for s in spans if s[2] == job]
            ax.broken_barh(bars, (lane + 0.4 - (i + 1) * strip, strip), color=colors[job])
    # Mode switches (policy auto): one dashed line per switch, however many ranks saw it.
    seen: list[float] = []
    span_ms = (max(s[1] for spans in by_dev.values() for s in spans) - t0) / 1e3
    labelled = -span_ms  # where the last label went (ms)
    for ev in sorted((e for e in events if e.get("ph") == "i"
                      and str(e.get("name", "")).startswith("mode ")), key=lambda e: e["ts"]):
        if seen and ev["ts"] - seen[-1] < 2e5:  # the other ranks learn it within 0.2 s
            continue
        seen.append(ev["ts"])
        x = (ev["ts"] - t0) / 1e3
        ax.axvline(x, color="grey", ls="--", lw=0.8)
        # in a margin above the lanes, so the label never hides a hold; a switch soon
        # after the last labelled one gets its line only, or the labels overprint
        if x - labelled >= 0.04 * span_ms:
            ax.text(x, len(by_dev) - 0.38, ev["name"].removeprefix("mode "), fontsize=7,
                    va="bottom", ha="left", color="dimgrey")
            labelled = x
    # Marks: a row of labels above the switches', spaced the same way.
    marks = sorted(marks, key=lambda m: m[1])
    labelled = -span_ms
    for label, at_s in marks:
        x = (at_s * 1e6 - t0) / 1e3
        ax.axvline(x, color="black", lw=1.2)
        if x - labelled >= 0.04 * span_ms:
            ax.text(x, len(by_dev) - 0.12, f" {label}", fontsize=7, va="bottom", ha="left")
            labelled = x
    ax.set_ylim(-0.5, len(by_dev) - 0.5 + (0.6 if marks else 0.3 if seen else 0.0))
    ax.set_yticks(range(len(by_dev)), list(by_dev))
    ax.set_xlabel("time (ms)")
    ax.set_title(title or "device slot holds")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colors[j]) for j in jobs],
              labels=jobs, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
