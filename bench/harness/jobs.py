"""The benchmark's jobs and daemons: what each workload runs, in which environment, and
how a set of jobs is launched at once on the emulated hosts (`cluster.py`) or this host.

Shared by the colocation benchmarks (`makespan`, `paired`, `priority`), `gpu/sharing`,
`examples/demo.py` and the tests that run real jobs.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.harness.cluster import EmulatedCluster
from bench.harness.common import REPO, module_argv
from crossover.daemon.relay.launch import relay_mca_env
from crossover.launch.local import Job, mpirun, run_together, terminate_group
from crossover.probe import stop_world

#: The benchmark's training job, run as a module (`JOB_ENV` puts the repository on its path).
JOB = "bench.harness.training_job"

#: Workloads: job-script arguments, sized so compute and communication are comparable
#: at the middle link rate (see docs/benchmarks.md for the measured split).
WORKLOADS: dict[str, list[str]] = {
    "mlp": ["--model", "mlp", "--width", "640", "--layers", "4", "--batch", "512"],
    "cnn": ["--model", "cnn", "--width", "32", "--batch", "32"],
    "transformer": ["--model", "transformer", "--width", "256", "--layers", "2",
                    "--batch", "8"],
}
#: The same models as PyTorch DDP jobs under torchrun ("ddp-mlp", ...).
WORKLOADS.update({f"ddp-{name}": ["--framework", "ddp", *args]
                  for name, args in list(WORKLOADS.items())})

def job_workloads(wl: str, n_jobs: int) -> list[list[str]]:
    """Each job's workload arguments: `wl` names a workload, or several joined by "+"
    (job i runs the i-th, cycling: "mlp+cnn" pairs two different models)."""
    kinds = wl.split("+")
    return [WORKLOADS[kinds[i % len(kinds)]] for i in range(n_jobs)]


#: The jobs' transport: "gloo" (waits in the kernel) or "mpi" (Open MPI TCP, polls).
TRANSPORT = os.environ.get("CROSSOVER_BENCH_TRANSPORT", "gloo")

# what torch prints when a std::thread of its gloo process group is torn down unjoined
# at exit, now and then, after the job has finished and even with its process group
# destroyed (tests/conftest.py tolerates it in reference runs alike)
TORCH_EXIT_ABORT = "terminate called without an active exception"
#: Horovod's background cycle: its default 1 ms polling competes for the host's only core.
JOB_ENV = {"HOROVOD_CYCLE_TIME": "5", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
#: One host: MPI ranks yield when they wait (several ranks share each core).
ONE_HOST_ENV = {**JOB_ENV, "OMPI_MCA_mpi_yield_when_idle": "1"}


def is_ddp(argv: list[str]) -> bool:
    """Whether a job's command runs the job script as a DDP job (launched by torchrun)."""
    return any(a == "--framework" and b == "ddp" for a, b in zip(argv, argv[1:], strict=False))


def cluster_launch(cluster: EmulatedCluster) -> Callable[[list[str]], list[str]]:
    """How a job's command runs on the emulated hosts (one rank on each): a DDP job under
    torchrun on each host, a Horovod job by TRANSPORT."""
    horovod = cluster.gloo_run if TRANSPORT == "gloo" else cluster.mpirun
    return lambda argv: cluster.torchrun(argv) if is_ddp(argv) else horovod(argv)


def one_host_launch(argv: list[str]) -> list[str]:
    """A job's command as two ranks on this host: a DDP job under torchrun, a Horovod job
    under mpirun (`make demo` where it cannot build emulated hosts; with ONE_HOST_ENV)."""
    return torchrun_standalone(2, argv) if is_ddp(argv) else mpirun(2, *argv)


def torchrun_standalone(nproc: int, argv: list[str]) -> list[str]:
    """A DDP job's command as `nproc` ranks on this host, under torchrun."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "--no-python", *argv]


class Daemons:
    """One crossover daemon per emulated host (one MPI world across the link).

    Args:
        cluster: the emulated cluster.
        runtime: socket directory (a filesystem path, so it is seen from every namespace).
        policy: the daemon's scheduling policy.
        log: file for the daemons' output.
        timeout_s: longest wait for both sockets.
    """

    def __init__(self, cluster: EmulatedCluster, runtime: Path, policy: str, log: Path,
                 timeout_s: float = 60.0) -> None:
        self.runtime, self.policy, self.hosts = runtime, policy, list(cluster.hosts)
        cmd = cluster.mpirun([sys.executable, "-m", "crossover", "daemon", "--policy",
                              *policy.split(), "--runtime-dir", str(runtime)])
        # one file with the node services' own log (they write the runtime directory's
        # daemon.log: they outlive the mpirun that started them)
        runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
        log.unlink(missing_ok=True)
        log.symlink_to(runtime / "daemon.log")
        self._log = log.open("a")
        # Open MPI's settings as crossoverrun starts a world: a relay's death ends only
        # that relay
        env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1",
               "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "PYTHONPATH": str(REPO),
               **relay_mca_env()}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        sockets = [runtime / f"node-{h}.sock" for h in cluster.hosts]
        deadline = time.monotonic() + timeout_s
        while not all(s.exists() for s in sockets):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"daemons did not start within {timeout_s:.0f} s; see {log}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop the daemons' world as `crossover stop` does (the node services outlive
        the mpirun that started them), then that mpirun's process group."""
        with contextlib.suppress(ConnectionError):
            stop_world(self.runtime, self.hosts[0], timeout_s=5.0)
            time.sleep(1.0)
        terminate_group(self.proc)
        self._log.close()


def result_line(output: str, returncode: int, reference: bool = False) -> str | None:
    """A job's JSON result line if it finished: exit 0, or (`reference`) torch's exit
    abort after the result was printed; else None."""
    line = next((ln for ln in output.splitlines() if ln.startswith('{"model"')), None)
    if line is None or returncode == 0:
        return line
    return line if reference and TORCH_EXIT_ABORT in output.split(line, 1)[1] else None


def run_jobs(launch: EmulatedCluster | Callable[[list[str]], list[str]], names: list[str],
             workload: list[str], steps: int | list[int], env: dict[str, str], log_dir: Path,
             timeout_s: float = 300.0, job_env: dict[str, str] | None = None,
             first_seed: int = 1, workloads: list[list[str]] | None = None,
             job_envs: list[dict[str, str]] | None = None,
             start_together: bool = False, reference: bool = False) -> list[dict]:
    """Run the named jobs at once and return their JSON lines (job i gets seed
    `first_seed + i`).

    Args:
        launch: the emulated cluster (one rank per host each), or a function that turns a
            job's command into its launch line (e.g. `rank_launch.local_gloo_run`).
        steps: every job's training steps, or each job's own.
        job_env: the jobs' base environment (default: JOB_ENV, for one core a host).
        workloads: per job, its own workload arguments (default: `workload` for all).
        job_envs: per job, variables added to its environment (e.g. CROSSOVER_PRIORITY).
        start_together: the jobs' training loops start together, once every rank of every
            job has set up (`training_job.py --start-barrier`): the makespan then holds
            no job's launch or start-up, as the sum of solo loops does not.
        reference: the jobs are read only for their results (runs without crossover to
            compare with): a job that printed its result and then ended in torch's exit
            abort (`TORCH_EXIT_ABORT`) counts as done.

    Raises:
        RuntimeError: a job failed (its output is in the message).
    """
    if isinstance(launch, EmulatedCluster):
        launch = cluster_launch(launch)
    jobs = []
    barrier: list[str] = []
    if start_together:
        where = Path(tempfile.mkdtemp(prefix="start-", dir=log_dir))
        barrier = ["--start-barrier", str(where), "--start-jobs", str(len(names))]
    for i, name in enumerate(names):
        args = workloads[i] if workloads is not None else workload
        own_steps = steps[i] if isinstance(steps, list) else steps
        cmd = launch([*module_argv(JOB), *args, "--steps", str(own_steps),
                      "--seed", str(first_seed + i), *barrier])
        own = job_envs[i] if job_envs is not None else {}
        jobs.append(Job(name, cmd, {**(JOB_ENV if job_env is None else job_env), **env, **own,
                                    "CROSSOVER_JOB": name}))
    out = []
    for res in run_together(jobs, timeout_s=timeout_s, log_dir=log_dir):
        line = result_line(res.output, res.returncode, reference)
        if line is None:
            raise RuntimeError(f"job {res.name} failed (rc {res.returncode}):\n{res.output}")
        if "CROSSOVER_RUNTIME_DIR" in env and "trains on uncoordinated" in res.output:
            # a fail-open run measures nothing about the scheduler: stop here
            raise RuntimeError(f"job {res.name} lost its daemon:\n{res.output}")
        out.append(json.loads(line))
    return out


def makespan(results: list[dict]) -> float:
    """From the first job's start to the last job's end (wall clock)."""
    return max(r["end"] for r in results) - min(r["start"] for r in results)

