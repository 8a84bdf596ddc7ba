"""`crossover-torchrun`: torchrun with the crossover plugin flags.

    crossover-torchrun [plugin flags] <every torchrun argument, unchanged>

Without --crossover it is torchrun. With it, the job's processes get the injection hook
on their PYTHONPATH (an unmodified DDP script runs under crossover: DDP's constructor is
wrapped), and this host's daemon is found or started. The plugin flags are crossoverrun's
(`crossover.launch.cli`), read the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from pathlib import Path

import crossover
from crossover import environment as E
from crossover.daemon.relay.launch import relay_mca_flags
from crossover.launch import cli
from crossover.launch.daemons import UsageError, daemon_watch, ensure_daemon
from crossover.launch.running import merge_traces, run_runner_child
from crossover.transport import system_service_in_use

PROG = "crossover-torchrun"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def torchrun_args(rest: list[str]) -> argparse.Namespace | None:
    """torchrun's own reading of its arguments; None where it finds them wrong (it says
    what is wrong when it runs)."""
    from torch.distributed.run import get_args_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return get_args_parser().parse_args(rest)
    except SystemExit:
        return None


def _torchrun_command(args: list[str]) -> list[str] | None:
    parsed = torchrun_args(args)
    if parsed is None:
        return None
    return [parsed.training_script, *parsed.training_script_args]


def _command_start(argv: list[str]) -> int:
    return cli.command_start(argv, _torchrun_command)


def usage() -> str:
    from torch.distributed.run import get_args_parser

    return (cli.plugin_parser(PROG, "torchrun").format_help()
            + "\ntorchrun arguments (handed to torchrun unchanged):\n\n"
            + get_args_parser().format_help())


def version() -> str:
    import torch

    return f"{PROG} {crossover.__version__} (PyTorch {torch.__version__})"


def _single_node(parsed: argparse.Namespace) -> bool:
    return parsed.standalone or str(parsed.nnodes) in ("1", "1:1")


def job_name(parsed: argparse.Namespace) -> str:
    """The job's name where --crossover-job gives none: one on every node of the job,
    from torchrun's --rdzv-id, else Slurm's job (and step) id, else the script and this
    launcher's pid (one node's alone: a job across nodes then needs --crossover-job)."""
    stem = Path(parsed.training_script).stem.replace(".", "_")
    slurm = os.environ.get("SLURM_JOB_ID")
    step = os.environ.get("SLURM_STEP_ID")
    if parsed.rdzv_id and parsed.rdzv_id != "none":
        shared = parsed.rdzv_id
    elif slurm:
        shared = slurm + (f".{step}" if step else "")
    else:
        shared = str(os.getpid())
    # (a name holds no '/': its traces are files named after it)
    return f"{stem}-{shared}".replace("/", "_")[:200]


def main(argv: list[str] | None = None) -> int:
    """Entry point of `crossover-torchrun`; returns torchrun's exit status."""
    argv = sys.argv[1:] if argv is None else argv
    asked = cli.own_flag(argv, _command_start)
    if asked is not None:  # before anything is checked or started
        print(version() if asked == "--version" else usage())
        return 0
    bad = E.check()  # the job, the daemon and this launcher all inherit them
    if bad:
        for line in bad:
            print(f"{PROG}: error: {line}", file=sys.stderr)
        return 2
    try:
        flags, rest = cli.split_argv(argv, _command_start)
        args = cli.parse_plugin(flags)
        if args.jobs:
            raise UsageError("--jobs is crossoverrun's: run `crossoverrun --jobs FILE`, "
                             "with `launcher: torchrun` on the torchrun jobs")
        parsed = torchrun_args(rest)
        if not args.crossover or parsed is None:  # torchrun runs, or says what is wrong
            return run_runner_child([*TORCHRUN, *rest])
        if not _single_node(parsed) and args.crossover_daemon == "auto" \
                and system_service_in_use() is None:
            raise UsageError(f"--nnodes {parsed.nnodes}: --crossover-daemon auto starts a "
                             f"daemon for this host only; run the node service on every "
                             f"node (crossover daemon --system: docs/deploy.md), or start "
                             f"one daemon world over the nodes (mpirun "
                             f"{' '.join(relay_mca_flags())} -H ... crossover daemon) and "
                             f"give its runtime directory to --crossover-daemon on every "
                             f"node")
        job = args.crossover_job or job_name(parsed)
        hosts = ["localhost"]
        rdir = ensure_daemon(args.crossover_daemon, args.crossover_policy, hosts,
                             args.crossover_idle_shutdown)
    except (UsageError, PermissionError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    os.environ.update(cli.job_env(args, rdir, job, starts_every_rank=_single_node(parsed)))
    with daemon_watch(args, hosts):
        rc = run_runner_child([*TORCHRUN, *rest])
    if args.crossover_trace:
        merge_traces(args.crossover_trace, job)
    return rc


if __name__ == "__main__":
    sys.exit(main())
