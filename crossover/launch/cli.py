"""`crossoverrun`: horovodrun with the crossover plugin flag.

    crossoverrun [plugin flags] <every horovodrun argument, unchanged>
    crossoverrun --jobs jobs.yaml [plugin flags]

Without --crossover it is horovodrun (Horovod's own runner does all the work). With it,
the job's processes get the injection hook on their PYTHONPATH (an unmodified Horovod
script runs under crossover), and a daemon is found or started.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import crossover
from crossover import environment as E
from crossover.launch import jobspec
from crossover.launch.daemons import (
    UsageError,
    daemon_watch,
    ensure_daemon,
    hosts_of,
)
from crossover.launch.inject import INJECT_ENV, inject_dir
from crossover.launch.running import merge_traces, run_jobs, run_runner_child
from crossover.scheduler import POLICIES

#: crossoverrun's own answers, when given before the training command.
OWN_FLAGS = ("-h", "--help", "--version")


def horovod_args(rest: list[str]) -> argparse.Namespace | None:
    """horovodrun's own reading of its arguments; None where it finds them wrong (it
    says what is wrong when it runs, before anything of ours has started)."""
    from horovod.runner.launch import parse_args

    saved = sys.argv
    sys.argv = ["horovodrun", *rest]
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return parse_args()
    except (SystemExit, OSError, ValueError):  # a bad flag, an unreadable --config-file
        return None
    finally:
        sys.argv = saved


def split_argv(argv: list[str], command_start_of: Callable[[list[str]], int] | None = None
               ) -> tuple[list[str], list[str]]:
    """Separate the plugin flags from the runner's arguments.

    Plugin flags are taken only before the training command (the runner's parser tells
    where that starts: `command_start_of`, Horovod's by default), so a script's own
    `--jobs` flag is left alone.
    """
    plugin, rest, i = [], [], 0
    command_start = (command_start_of or _command_start)(argv)
    while i < len(argv):
        tok = argv[i]
        name = tok.split("=", 1)[0]
        if i < command_start and name in PLUGIN_FLAGS:
            if PLUGIN_FLAGS[name] and "=" not in tok:
                if i + 1 >= len(argv):
                    raise UsageError(f"{name} needs a value")
                plugin += [tok, argv[i + 1]]
                i += 2
                continue
            plugin.append(tok)
        elif i < command_start and name.startswith("--crossover"):
            raise UsageError(f"unknown plugin flag {name}; the plugin flags are "
                             f"{', '.join(sorted(PLUGIN_FLAGS))}")
        else:
            rest.append(tok)
        i += 1
    return plugin, rest


def _command_start(argv: list[str]) -> int:
    """Index in argv where horovodrun's training command begins (len(argv) if none)."""
    return command_start(argv, _horovod_command)


def _horovod_command(args: list[str]) -> list[str] | None:
    parsed = horovod_args(args)
    return parsed.command if parsed is not None else None


def command_start(argv: list[str], command_of: Callable[[list[str]], list[str] | None]) -> int:
    """Index in argv where the training command begins (len(argv) if none), given the
    runner's reading of its arguments without the plugin flags (`command_of`: the
    command it finds, None where it finds the arguments wrong)."""
    stripped, index_of = [], []
    i = 0
    while i < len(argv):  # drop plugin flags wherever they are, remember positions
        name = argv[i].split("=", 1)[0]
        if name in PLUGIN_FLAGS:
            i += 2 if PLUGIN_FLAGS[name] and "=" not in argv[i] else 1
            continue
        stripped.append(argv[i])
        index_of.append(i)
        i += 1
    command = command_of(stripped)
    if not command:
        return len(argv)  # the runner will report the problem itself
    return index_of[len(stripped) - len(command)]


def plugin_parser(prog: str = "crossoverrun", runner: str = "horovodrun"
                  ) -> argparse.ArgumentParser:
    """The plugin flags (their help is `crossoverrun --help`'s first part)."""
    usage = f"{prog} [plugin flags] [{runner} arguments] COMMAND ..."
    if runner == "horovodrun":
        usage += f"\n       {prog} --jobs FILE [plugin flags]"
    parser = argparse.ArgumentParser(
        prog=prog, add_help=False, allow_abbrev=False, exit_on_error=False, usage=usage,
        description=f"{runner} with the crossover plugin: several jobs share devices, "
                    f"one computing while another communicates. Plugin flags go before "
                    f"the training command; everything else goes to {runner} unchanged.")
    g = parser.add_argument_group("plugin flags")
    g.add_argument("--crossover", action="store_true",
                   help="run the job under crossover (every other plugin flag needs it, "
                        "except --jobs, which implies it)")
    g.add_argument("--crossover-policy", choices=list(POLICIES), default=None,
                   help="policy of the daemon that --crossover-daemon auto starts "
                        "(default auto); a running daemon must have it")
    g.add_argument("--crossover-priority", type=float, default=None, metavar="W",
                   help="this job's weight under the priority policy (> 0, default 1)")
    g.add_argument("--crossover-trace", default=None, metavar="DIR",
                   help="write per-rank Chrome traces to DIR, merged into "
                        "DIR/<job>.trace.json at the end")
    g.add_argument("--crossover-daemon", default="auto", metavar="auto|DIR",
                   help="auto (default): use this user's daemon, or start one detached "
                        "(under a lock, so jobs launched together share it); DIR: the "
                        "runtime directory of a running daemon")
    g.add_argument("--crossover-job", default=None, metavar="NAME",
                   help="the job's name (default <script>-<pid>); unique among running jobs")
    g.add_argument("--crossover-idle-shutdown", type=float, default=300.0, metavar="S",
                   help="a daemon started by --crossover-daemon auto exits after S seconds "
                        "with no job (default 300; `crossover daemon` started by hand runs "
                        "until `crossover stop`)")
    g.add_argument("--jobs", default=None, metavar="FILE",
                   help="run every job of a YAML job spec at once, output prefixed with "
                        "[name]")
    return parser


#: Every plugin flag -> whether it takes a value.
PLUGIN_FLAGS = {option: action.nargs != 0 for action in plugin_parser()._actions
                for option in action.option_strings}


def parse_plugin(flags: list[str]) -> argparse.Namespace:
    """The plugin flags, checked.

    Raises:
        UsageError: a bad value or combination, naming the flag and the fix.
    """
    try:
        args = plugin_parser().parse_args(flags)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise UsageError(str(exc)) from None
    args.crossover = args.crossover or args.jobs is not None
    if not args.crossover:
        given = [f.split("=")[0] for f in flags if f.startswith("--")]
        if given:
            raise UsageError(f"{given[0]} has no effect without --crossover; add --crossover")
    # the values the job's ranks read from the environment, by the same rules
    for flag, value, var in (("--crossover-priority", args.crossover_priority, E.PRIORITY),
                             ("--crossover-job", args.crossover_job, E.JOB)):
        if value is not None and E.problem(var, str(value)):
            raise UsageError(f"{flag}: {E.VARS[var].form}, got {value!r}")
    if args.crossover_job is not None and not args.crossover_job.replace("-", "").replace(
            "_", "").isalnum():  # it names trace files too
        raise UsageError(f"--crossover-job: use letters, digits, '-' or '_', "
                         f"got {args.crossover_job!r}")
    if not args.crossover_daemon:
        raise UsageError("--crossover-daemon needs a value: auto, or the runtime directory "
                         "of a running daemon")
    if not args.crossover_idle_shutdown > 0:
        raise UsageError(f"--crossover-idle-shutdown must be > 0 seconds, got "
                         f"{args.crossover_idle_shutdown:g}")
    return args


def own_flag(argv: list[str], command_start_of: Callable[[list[str]], int] | None = None
             ) -> str | None:
    """-h/--help or --version when given to the launcher itself (before the training
    command: `crossoverrun -np 2 python train.py --help` is the script's)."""
    given = [i for i, tok in enumerate(argv) if tok in OWN_FLAGS]
    if not given:
        return None
    plain = [tok for tok in argv if tok not in OWN_FLAGS]
    # the tokens before the first own flag are all plain: its index counts in `plain` too
    return argv[given[0]] if given[0] <= (command_start_of or _command_start)(plain) else None


def usage() -> str:
    """The plugin flags, then Horovod's own help: what crossoverrun accepts."""
    from horovod.runner.launch import parse_args

    saved, out = sys.argv, io.StringIO()
    sys.argv = ["horovodrun", "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            parse_args()
    finally:
        sys.argv = saved
    return (plugin_parser().format_help()
            + "\nhorovodrun arguments (handed to Horovod's runner unchanged):\n\n"
            + out.getvalue())


def version() -> str:
    import horovod

    return f"crossoverrun {crossover.__version__} (Horovod {horovod.__version__})"


# --- running -------------------------------------------------------------------------
def job_env(args: argparse.Namespace, rdir: Path, job: str,
            starts_every_rank: bool = True) -> dict[str, str]:
    """The environment that puts a job's processes under crossover.

    `starts_every_rank`: this launcher starts all the job's ranks, so its clock stamps the
    job's start (with the name, the job's place in the order); a launcher of one node's
    ranks of many leaves the start to the user (or 0: ordered by name).
    """
    env = {
        INJECT_ENV: "1", "CROSSOVER_ENABLE": "1", "CROSSOVER_JOB": job,
        "CROSSOVER_RUNTIME_DIR": str(rdir),
        "PYTHONPATH": os.pathsep.join(
            p for p in (inject_dir(), os.environ.get("PYTHONPATH", "")) if p),
    }
    if starts_every_rank:
        env[E.JOB_START] = str(time.time_ns())
    if args.crossover_priority is not None:
        env["CROSSOVER_PRIORITY"] = str(args.crossover_priority)
    if args.crossover_trace:
        env["CROSSOVER_TRACE"] = str(Path(args.crossover_trace).resolve())
    return env


def run_horovod(rest: list[str]) -> int:
    """Hand the arguments to Horovod's own runner, in this process, as horovodrun."""
    from horovod.runner.launch import run_commandline

    saved = sys.argv
    sys.argv = ["horovodrun", *rest]
    try:
        run_commandline()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except RuntimeError as exc:
        print(f"crossoverrun: {exc}", file=sys.stderr)
        return 1
    finally:
        sys.argv = saved
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `crossoverrun`; returns the exit status (the worst job's, for
    --jobs)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        import horovod.runner.launch  # noqa: F401 - Horovod's runner does the launching
    except ImportError as exc:
        print(f"crossoverrun: error: Horovod's runner cannot be imported ({exc}); install "
              f"Horovod with your framework (HOROVOD_WITH_PYTORCH=1 pip install horovod), "
              f"then `crossover check` says what else is missing", file=sys.stderr)
        return 2
    asked = own_flag(argv)
    if asked is not None:  # before anything is checked or started
        print(version() if asked == "--version" else usage())
        return 0
    # Every CROSSOVER_* value, before anything starts: the jobs, the daemon and this
    # launcher all inherit them, and a job would only warn and go on with a default.
    bad = E.check()
    if bad:
        for line in bad:
            print(f"crossoverrun: error: {line}", file=sys.stderr)
        return 2
    try:
        flags, rest = split_argv(argv)
        args = parse_plugin(flags)
        if args.jobs:
            if rest:
                raise UsageError(f"--jobs runs the jobs of its file; drop the other "
                                 f"arguments ({shlex.join(rest)}) or put them in the file")
            specs = jobspec.load(args.jobs)
            return run_jobs(args, specs)
        if not args.crossover:
            return run_horovod(rest)
        parsed = horovod_args(rest)
        if parsed is None:  # Horovod says what is wrong, before anything has started
            return run_horovod(rest)
        job = args.crossover_job or f"{_script_name(rest)}-{os.getpid()}"
        hosts = hosts_of(parsed)
        rdir = ensure_daemon(args.crossover_daemon, args.crossover_policy, hosts,
                             args.crossover_idle_shutdown)
    except (UsageError, jobspec.JobSpecError, PermissionError) as exc:
        print(f"crossoverrun: error: {exc}", file=sys.stderr)
        return 2
    os.environ.update(job_env(args, rdir, job))
    with daemon_watch(args, hosts):
        rc = run_runner_child([sys.executable, "-m", "horovod.runner.launch", *rest])
    if args.crossover_trace:
        merge_traces(args.crossover_trace, job)
    return rc


def _script_name(rest: list[str]) -> str:
    scripts = [Path(t).stem for t in rest if t.endswith(".py")]
    return (scripts[-1] if scripts else "job").replace(".", "_")


if __name__ == "__main__":
    sys.exit(main())
