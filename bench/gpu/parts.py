"""The parts of bench/device_suite.sh: what each runs, which files it writes, the figures
its record keeps and the targets they are held to, on the GPU machine and (toy sized, on
this CPU) in a dry run. The runner is bench/gpu/suite.py; docs/gpu.md says what each
part measures.

Sizes are chosen so that the required parts fit 8 minutes on one H100 or H200 with 16
cores (see BUDGET_S); a part's budget is its own `timeout`. Nothing here imports torch or
crossover: the runner checks the machine before anything heavy starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.common import REPO

#: The whole suite's wall time on the GPU machine: a device call may run 10 minutes, and
#: the machine's start and the transfers come out of the same lease.
BUDGET_S = 480.0
#: A dry run's whole budget: its parts are toy sized, on this CPU, and take about 2
#: minutes together on an idle 2-core machine; the budgets leave room for a busy one.
DRY_BUDGET_S = 400.0


@dataclass(frozen=True)
class Figure:
    """A key figure: `key` (dotted) in result file `file` (relative to the results
    root); `target`, if any, as (operator, value): "==", ">=", "<=" or ">"."""

    file: str
    key: str
    target: tuple[str, float] | None = None


@dataclass
class Plan:
    """What a part does on this machine: its commands (run in order under the part's
    budget), its key figures, and notes for its record (e.g. what a dry run leaves out)."""

    steps: list[list[str]]
    figures: dict[str, Figure]
    notes: list[str] = field(default_factory=list)

    def files(self) -> list[str]:
        """The result files its figures come from, each once, in order."""
        return list(dict.fromkeys(f.file for f in self.figures.values()))


@dataclass(frozen=True)
class Run:
    """The suite's run: dry or on the GPU machine, the Python for the parts, the results
    root (bench/results, or a temporary directory in a dry run), and the cores."""

    dry: bool
    python: str
    results: Path
    cores: int

    @property
    def bench(self) -> list[str]:
        """How a bench script is started: this run's Python, unbuffered."""
        return [self.python, "-u"]


@dataclass(frozen=True)
class Part:
    """One part of the suite.

    Attributes:
        name: its key in the records and in --parts.
        title: one line for the summary.
        budget_s, dry_budget_s: its own time limit on the GPU machine and in a dry run.
        optional: runs only when the time left, less the budgets of the required parts
            after it, covers its budget (else it is recorded as skipped, and why).
        needs: the preconditions it cannot run without (names in device_suite.CHECKS).
        plan: its commands and figures for a run; None: not built yet (a hook).
        why_not_built: for a hook, what it waits for.
    """

    name: str
    title: str
    budget_s: float
    dry_budget_s: float
    optional: bool = False
    needs: tuple[str, ...] = ()
    plan: Callable[[Run], Plan] | None = None
    why_not_built: str = ""

    def budget(self, run: Run) -> float:
        return self.dry_budget_s if run.dry else self.budget_s


def ddp_plan(run: Run) -> Plan:
    """Two 2-rank DDP jobs on one GPU: the release check first (CUPTI: no kernel runs
    after its job's release, and the control without the device sync shows some), then
    the sharing arms (each alone, plain together, under crossover's default policy)."""
    # on an H100 a phase of the arms takes about 20 s to start its jobs; 40 checked steps
    # hold about 2 x 4 x 40 holds, 20 steps a job make each arm's makespan
    gpu = ["--framework", "ddp", "--reps", "1", "--steps", "20", "--check-steps", "40"]
    toy = ["--framework", "ddp", "--device", "cpu", "--skip-release", "--reps", "1",
           "--steps", "2"]
    prefix = "cpu_ddp_" if run.dry else "ddp_"
    sharing = f"gpu/{prefix}sharing.json"
    figures = {
        "crossover_vs_sequential": Figure(sharing, "crossover_vs_sequential"),
        "crossover_vs_plain_together": Figure(sharing, "crossover_vs_plain_together"),
        "weights_equal_solo": Figure(sharing, "weights_equal_solo.crossover"),
    }
    notes = []
    if run.dry:
        notes.append("release check left out: it needs a GPU's kernels (CUPTI)")
    else:
        release = f"gpu/{prefix}release.json"
        figures = {
            "kernels_checked": Figure(release, "with_device_sync.kernels"),
            "kernel_overruns": Figure(release, "with_device_sync.kernel_overruns", ("==", 0)),
            "kernels_after_release": Figure(release, "with_device_sync.kernels_released",
                                            ("==", 0)),
            # the negative control must catch something, or the check proves nothing
            "control_kernels_after_release": Figure(
                release, "without_device_sync.kernels_released", (">", 0)),
            **figures}
    return Plan([[*run.bench, "-m", "bench.gpu.sharing", *(toy if run.dry else gpu)]],
                figures, notes)


def neighbour_plan(run: Run) -> Plan:
    """A freezing pipeline (on the CPU) beside a 2-rank DDP job on the GPU: the job's step
    rate after the pipeline's cut over before it, against a pipeline that does not freeze.
    The dry run takes the digits workload, whose body needs no pretraining, with a
    threshold that freezes at once, and keeps the neighbour on the CPU."""
    common = ["--reps", "1", "--neighbour-framework", "ddp", "--area", "gpu"]
    # the cut comes about 3 epochs in (bench/results/freeze/freeze_finetune_glyphs.json)
    gpu = ["--workload", "finetune-glyphs", "--epochs", "8", "--neighbour-device", "cuda"]
    # 4 epochs: the cut comes in the first two, and the window after it must hold a few
    # of the neighbour's steps even on a busy machine
    toy = ["--workload", "digits", "--epochs", "4", "--freeze-threshold", "10",
           "--neighbour-device", "cpu"]
    out = "gpu/freeze_neighbour.json"
    return Plan([[*run.bench, "-m", "bench.freeze.neighbour", *common,
                  *(toy if run.dry else gpu)]],
                {"neighbour_speedup_after_cut": Figure(
                    out, "neighbour_speedup_after_cut.median", (">=", 1.3)),
                 "control_after_over_before": Figure(out, "control_after_over_before.median"),
                 "pipeline_speedup": Figure(out, "pipeline_speedup.median"),
                 "accuracy_loss_points": Figure(out, "accuracy_loss_points")},
                ["toy run: digits, the neighbour on the CPU"] if run.dry else [])


def horovod_plan(run: Run) -> Plan:
    """Two 2-rank Horovod jobs on one GPU, as the ddp part; Horovod is built first
    (bench/gpu/sharing.sh --build-only: about 2 minutes on 16 cores, from the sdist in
    .gpu/). A dry run uses the Horovod of this machine's environment."""
    if run.dry:
        return Plan([[*run.bench, "-c", "import horovod.torch"],
                     [*run.bench, "-m", "bench.gpu.sharing", "--framework", "horovod",
                      "--device", "cpu", "--skip-release", "--reps", "1", "--steps", "2"]],
                    {"crossover_vs_sequential": Figure("gpu/cpu_sharing.json",
                                                       "crossover_vs_sequential")},
                    ["release check left out: it needs a GPU's kernels (CUPTI)"])
    return Plan([["bash", str(REPO / "bench/gpu/sharing.sh"), "--build-only"],
                 [*run.bench, "-m", "bench.gpu.sharing", "--reps", "1", "--steps", "20",
                  "--check-steps", "40"]],
                {"kernel_overruns": Figure("gpu/release.json",
                                           "with_device_sync.kernel_overruns", ("==", 0)),
                 "kernels_after_release": Figure("gpu/release.json",
                                                 "with_device_sync.kernels_released", ("==", 0)),
                 "crossover_vs_sequential": Figure("gpu/sharing.json",
                                                   "crossover_vs_sequential")})


def manycore_plan(run: Run) -> Plan:
    """The pipeline benchmark's real rows at 2, 4 and 8 ranks, one a core (those that fit
    the cores), after measuring the runner's costs on this machine again: the simulator's
    error at 2 ranks is the target. Written to pipeline_<cores>core.json as it goes."""
    ranks = [2] if run.dry else [r for r in (2, 4, 8) if r <= run.cores] or [2]
    out = f"pipeline/pipeline_{run.cores}core.json"
    size = ["--models", "chain", "--pairs", "1"] if run.dry else \
        ["--models", "chain,two_tower", "--pairs", "2"]
    figures = {f"max_sim_error_{r}_ranks": Figure(out, f"max_sim_error_{r}_ranks",
                                                  ("<=", 0.10) if r == 2 else None)
               for r in ranks}
    figures.update({f"min_real_gpp_vs_spp_{r}_ranks": Figure(out, f"min_real_gpp_vs_spp_{r}_ranks")
                    for r in ranks})
    # a dry run leaves the developer's cached calibration as it was
    cache = ["--calibration", str(run.results / "pipeline-runtime.json")] if run.dry else []
    return Plan([[*run.bench, "-m", "bench.pipeline.compare", "--real-only", "--real-ranks",
                  ",".join(map(str, ranks)), "--recalibrate", *size, *cache,
                  "--out", str(run.results / out)]],
                figures)


PARTS = [
    Part("ddp", "two DDP jobs on one GPU, with the release check", 180, 120,
         needs=("gpu",), plan=ddp_plan),
    Part("neighbour", "the pipeline's spare device and a GPU neighbour after the cut", 125,
         120, needs=("gpu", "mpi"), plan=neighbour_plan),
    Part("horovod", "two Horovod jobs on one GPU (Horovod built first)", 270, 120,
         optional=True, needs=("gpu", "horovod_build"), plan=horovod_plan),
    Part("manycore", "pipeline rows at 2, 4, 8 real ranks and the 2-rank simulation error",
         105, 100, needs=("mpi",), plan=manycore_plan),
    Part("gpu_rows", "the default policy's rows on one GPU (a hook for later rows)", 120, 30,
         optional=True, needs=("gpu",),
         why_not_built="bench/colocation/makespan.py runs its jobs on the CPU only: give its "
                       "workloads a GPU form (training_job.py --device cuda), then give "
                       "this part a plan in bench/gpu/parts.py"),
]
