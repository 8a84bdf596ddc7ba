"""Every figure that only a GPU machine (or its many cores) can settle, in one run.

    bash bench/device_suite.sh [--dry-run] [--parts ddp,neighbour,...] [--budget S]
                               [--out DIR] [--export DIR]

The parts (bench/gpu/parts.py) run in order, each under its own `timeout`; the moment
one ends, its record is written (a run cut off keeps what finished): its result files get
the device, the code (`git describe` when the suite started) and the commands, and
<results>/gpu/device_suite.json gets every part's status, key figures and targets. An
optional part runs only when the time left, less the budgets of the required parts after
it, covers its own. The machine is checked first, and what is missing is named with its
fix; a part that needs what is missing is recorded as skipped. One table at the end.

`--dry-run` runs every part toy sized on this CPU, into a temporary directory (or --out),
never over the committed results. `--export DIR` writes DIR/device_suite.tar.gz after
every part: the results written so far, as paths under bench/results/ (unpack it in the
repository's root), for a machine whose files come back only from one folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.gpu.checks import SITES, check, device, install
from bench.gpu.parts import BUDGET_S, DRY_BUDGET_S, PARTS, REPO, Part, Plan, Run
from bench.harness.common import RESULTS, code_version

#: A part is sent SIGINT at its budget less this, and SIGKILL this later: the benches
#: stop their jobs and daemons on SIGINT (KeyboardInterrupt), not on SIGTERM.
GRACE_S = 15.0
#: Less time than this left for a required part: it is skipped rather than started.
LEAST_S = 30.0


def dig(doc: dict, key: str) -> object:
    """doc["a"]["b"] for key "a.b"; None where any part is missing."""
    for part in key.split("."):
        if not isinstance(doc, dict) or part not in doc:
            return None
        doc = doc[part]
    return doc


def met(value: object, target: tuple[str, float]) -> bool | None:
    """Whether `value` meets `target`; None where there is no number to judge."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    op, want = target
    return {"==": value == want, ">=": value >= want, "<=": value <= want,
            ">": value > want}[op]


class Suite:
    """One run of the parts: the deadline, the records, the summary."""

    def __init__(self, run: Run, parts: list[Part], budget_s: float, export: Path | None,
                 env: dict, named: bool = False) -> None:
        self.run, self.parts, self.export, self.env = run, parts, export, env
        self.named = named  # the parts were chosen by --parts
        self.started_wall = time.time()
        self.deadline = time.monotonic() + budget_s
        self.code = code_version()  # before any result makes the tree dirty
        self.record = {
            "command": " ".join(shlex.quote(a) for a in ["bash", "bench/device_suite.sh",
                                                         *sys.argv[1:]]),
            "code": self.code, "device": device(run.dry), "dry_run": run.dry,
            "budget_s": budget_s, "results": str(run.results),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "preconditions": {}, "parts": {}}
        self.path = run.results / "gpu" / "device_suite.json"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        """The suite's record and, with --export, the tarball of what was written."""
        self.record["wall_s"] = round(time.time() - self.started_wall, 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.record, indent=2) + "\n")
        if self.export is None:
            return
        self.export.mkdir(parents=True, exist_ok=True)
        tmp = self.export / "device_suite.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for path in sorted(self.run.results.rglob("*")):
                if path.is_file() and path.stat().st_mtime >= self.started_wall:
                    tar.add(path, f"bench/results/{path.relative_to(self.run.results)}")
        tmp.replace(self.export / "device_suite.tar.gz")

    def preconditions(self) -> set[str]:
        """Check what the chosen parts need, print it; the names of those not met."""
        needed = dict.fromkeys(n for p in self.parts if p.plan for n in p.needs)
        missing = set()
        print("device suite: preconditions", flush=True)
        for name in needed:
            ok, what = check(name, self.run, self.env)
            self.record["preconditions"][name] = {"met": ok, "detail": what}
            print(f"  {'ok     ' if ok else 'MISSING'} {name}: {what}", flush=True)
            if not ok:
                missing.add(name)
        return missing

    def reserve_after(self, index: int, missing: set[str]) -> float:
        """The budgets of the required parts after `index` that can run."""
        return sum(p.budget(self.run) for p in self.parts[index + 1:]
                   if not p.optional and p.plan and not set(p.needs) & missing)

    def run_part(self, index: int, missing: set[str]) -> dict:
        """Run one part (or say why not); its record."""
        part = self.parts[index]
        rec: dict = {"title": part.title, "budget_s": part.budget(self.run)}
        if part.plan is None:
            return {**rec, "status": "not built", "reason": part.why_not_built}
        lacking = sorted(set(part.needs) & missing)
        if lacking:
            return {**rec, "status": "skipped", "reason": f"missing: {', '.join(lacking)} "
                    f"(see the preconditions)"}
        if part.optional and self.run.dry and not self.named:
            # a whole dry run stays within 2 minutes; the toy run is there by name
            return {**rec, "status": "skipped", "reason": f"optional: a dry run runs it "
                    f"only when named (--dry-run --parts {part.name})"}
        allowed = self.left() - self.reserve_after(index, missing)
        if (part.optional and allowed < part.budget(self.run)) or allowed < LEAST_S:
            return {**rec, "status": "skipped", "reason": f"time: {self.left():.0f} s left, "
                    f"{allowed:.0f} s after the later parts' budgets; it needs "
                    f"{part.budget(self.run):.0f} s (run it alone with --parts {part.name})"}
        plan = part.plan(self.run)
        rec["commands"] = [" ".join(shlex.quote(a) for a in s) for s in plan.steps]
        rec["notes"] = plan.notes
        started = time.time()
        status, reason = self.steps(plan, min(part.budget(self.run), allowed))
        rec.update(status=status, reason=reason, wall_s=round(time.time() - started, 1))
        rec.update(self.figures(plan, part, rec, started))
        return rec

    def steps(self, plan: Plan, budget: float) -> tuple[str, str]:
        """The plan's commands in order, each under `timeout` until the part's end."""
        end = time.monotonic() + budget
        for i, step in enumerate(plan.steps):
            limit = end - time.monotonic() - GRACE_S
            if limit < 1:
                return "timeout", f"no time left for step {i + 1}"
            cmd = ["timeout", "--signal=INT", f"--kill-after={GRACE_S:.0f}", f"{limit:.0f}",
                   *step]
            print(f"device suite: $ {' '.join(shlex.quote(a) for a in step)}  "
                  f"(at most {limit:.0f} s)", flush=True)
            proc = subprocess.Popen(cmd, env=self.env, cwd=REPO)
            try:
                code = proc.wait()
            except KeyboardInterrupt:
                proc.send_signal(signal.SIGINT)  # timeout passes it on to the bench
                proc.wait(timeout=2 * GRACE_S + 5)
                raise
            if code in (124, 137):
                return "timeout", f"step {i + 1} ran past its {limit:.0f} s"
            if code != 0:
                return "failed", f"step {i + 1} exited {code}"
        return "ok", ""

    def figures(self, plan: Plan, part: Part, rec: dict, started: float) -> dict:
        """The part's key figures from the result files it wrote (those older than the
        part are not its), each file stamped with the device, the code and the commands;
        `files` are those files, relative to the results root."""
        docs, files = {}, []
        for name in plan.files():
            path = self.run.results / name
            if not path.exists() or path.stat().st_mtime < started:
                continue
            try:
                doc = json.loads(path.read_text())
            except ValueError as exc:  # cut off while writing it
                rec["notes"] = [*rec.get("notes", []), f"{name} unreadable: {exc}"]
                continue
            doc.update(device=self.record["device"], code=self.code,
                       suite={"part": part.name, "commands": rec["commands"],
                              "suite_command": self.record["command"],
                              "dry_run": self.run.dry, "status": rec["status"]})
            path.write_text(json.dumps(doc, indent=2) + "\n")
            docs[name], files = doc, [*files, name]
        values = {label: dig(docs[f.file], f.key) if f.file in docs else None
                  for label, f in plan.figures.items()}
        # a toy run's figures say nothing about the targets: not judged
        targets = {label: {"want": f"{f.target[0]} {f.target[1]:g}",
                           "met": None if self.run.dry else met(values[label], f.target)}
                   for label, f in plan.figures.items() if f.target}
        return {"files": files, "figures": values, "targets": targets}

    def go(self) -> int:
        """Every part in order; the summary. Exit status: 0 unless a part failed."""
        missing = self.preconditions()
        self.save()
        error = install(self.run, self.env, min(self.deadline, time.monotonic() + 120))
        if error:
            print(f"device suite: {error}", file=sys.stderr, flush=True)
            self.record["install_error"] = error
            self.save()
            return 2
        interrupted = False
        for i, part in enumerate(self.parts):
            print(f"device suite: part {part.name}: {part.title} ({self.left():.0f} s left)",
                  flush=True)
            try:
                rec = self.run_part(i, missing)
            except KeyboardInterrupt:
                rec, interrupted = {"title": part.title, "status": "interrupted"}, True
            self.record["parts"][part.name] = rec
            self.save()
            print(f"device suite: part {part.name}: {brief(rec)}", flush=True)
            if interrupted:
                break
        print(summary(self.record), flush=True)
        print(f"device suite: records in {self.path}", flush=True)
        statuses = [r["status"] for r in self.record["parts"].values()]
        return 130 if interrupted else 1 if {"failed", "timeout"} & set(statuses) else 0


def shown(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "-" if value is None else str(value)


def brief(rec: dict) -> str:
    """A part's record in one line, printed as it ends (a run cut off later has it)."""
    figures = "; ".join(f"{k} {shown(v)}" for k, v in (rec.get("figures") or {}).items())
    return ", ".join(x for x in (rec["status"], f"{rec.get('wall_s', 0):.0f} s",
                                 rec.get("reason", ""), figures) if x)


def summary(record: dict) -> str:
    """One table: each part's status and time, each key figure and its target."""
    rows = [("part", "status", "s / budget", "figure", "value", "target")]
    judged = {True: "met", False: "MISSED", None: "not judged: a toy run" if
              record["dry_run"] else "no figure"}
    for name, rec in record["parts"].items():
        time_s = f"{rec.get('wall_s', 0):.0f} / {rec.get('budget_s', 0):.0f}"
        figures = rec.get("figures") or {"": None}
        for j, (label, value) in enumerate(figures.items()):
            tgt = rec.get("targets", {}).get(label)
            verdict = f"{tgt['want']}: {judged[tgt['met']]}" if tgt else ""
            rows.append((name if j == 0 else "", rec["status"] if j == 0 else "",
                         time_s if j == 0 else "", label, shown(value) if label else "",
                         verdict))
        if rec.get("reason"):
            rows.append(("", "", "", f"({rec['reason']})", "", ""))
    widths = [max(len(r[c]) for r in rows if len(r[3]) < 60 or c != 3) for c in range(6)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    head = f"device suite: {record['device']['gpu']}, code {record['code']}, " \
           f"{record.get('wall_s', 0):.0f} s of {record['budget_s']:.0f}"
    return "\n".join([head, *lines])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="every part toy sized on this CPU, into a temporary directory")
    ap.add_argument("--parts", default=",".join(p.name for p in PARTS),
                    help="comma-separated parts to run, in the suite's order (default all)")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"the whole run's seconds (default {BUDGET_S:.0f}; dry run "
                         f"{DRY_BUDGET_S:.0f})")
    ap.add_argument("--out", type=Path, default=None,
                    help="results root (default bench/results; a dry run: a new "
                         "temporary directory)")
    ap.add_argument("--export", type=Path, default=None,
                    help="after every part, write DIR/device_suite.tar.gz of the results "
                         "written so far")
    args = ap.parse_args()
    names = [n for n in args.parts.split(",") if n]
    unknown = sorted(set(names) - {p.name for p in PARTS})
    if unknown or not names:
        ap.error(f"--parts {args.parts!r}: unknown {unknown}; choose from "
                 f"{', '.join(p.name for p in PARTS)}")
    budget = args.budget if args.budget is not None else \
        DRY_BUDGET_S if args.dry_run else BUDGET_S
    if budget <= 0:
        ap.error(f"--budget {budget:g}: give the run's seconds, more than 0")
    if not shutil.which("timeout"):
        ap.error("the `timeout` command (GNU coreutils) is not on PATH: install coreutils")
    results = args.out or (Path(tempfile.mkdtemp(prefix="device-suite-dry-"))
                           if args.dry_run else RESULTS)
    if args.dry_run and results.resolve() == RESULTS.resolve():
        ap.error("--dry-run --out bench/results would write toy figures over the "
                 "committed ones: give another directory")
    run = Run(dry=args.dry_run, python=sys.executable, results=results.resolve(),
              cores=os.cpu_count() or 1)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CROSSOVER_BENCH_RESULTS": str(run.results)}
    if not run.dry:  # this tree's install, and Horovod once built, before anything else;
        # the parts run as modules (`-m bench.gpu...`), which would put the repository
        # first and its crossover (no native module built there) before the install's:
        # PYTHONSAFEPATH keeps the working directory off the path, the repository goes last
        env["PYTHONPATH"] = os.pathsep.join(
            [*map(str, SITES), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []),
             str(REPO)])
        env["PYTHONSAFEPATH"] = "1"
    # a Python handler: the parts start with SIGINT at its default (stop), even where the
    # suite itself was started with SIGINT ignored (in the background, under nohup)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    chosen = [p for p in PARTS if p.name in names]
    print(f"device suite: {'dry run, ' if run.dry else ''}parts {', '.join(names)}; "
          f"results in {run.results}; {budget:.0f} s", flush=True)
    return Suite(run, chosen, budget, args.export, env,
                 named=args.parts != ap.get_default("parts")).go()


if __name__ == "__main__":
    sys.exit(main())
