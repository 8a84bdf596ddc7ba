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
import signal
import subprocess
import sys
import threading
from pathlib import Path

import crossover
from crossover import environment as E
from crossover.launch import jobspec
from crossover.launch.daemons import UsageError, daemon_watch, ensure_daemon, hosts_of
from crossover.launch.inject import INJECT_ENV, inject_dir
from crossover.launch.local import terminate_group
from crossover.scheduler import POLICIES

PLUGIN_FLAGS = {  # flag -> takes a value
    "--crossover": False, "--crossover-policy": True, "--crossover-priority": True,
    "--crossover-trace": True, "--crossover-daemon": True, "--crossover-job": True,
    "--crossover-idle-shutdown": True, "--jobs": True,
}
#: crossoverrun's own answers, when given before the training command.
OWN_FLAGS = ("-h", "--help", "--version")
#: A --jobs job past its timeout gets SIGTERM (its ranks write their traces), and
#: SIGKILL this much later.
KILL_GRACE_S = 10.0


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate the plugin flags from horovodrun's arguments.

    Plugin flags are taken only before the training command (Horovod's parser tells
    where that starts), so a script's own `--jobs` flag is left alone.
    """
    from horovod.runner.launch import parse_args

    plugin, rest, i = [], [], 0
    command_start = _command_start(argv, parse_args)
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


def _command_start(argv: list[str], parse_args) -> int:
    """Index in argv where the training command begins (len(argv) if none)."""
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
    saved = sys.argv
    sys.argv = ["horovodrun", *stripped]
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # horovodrun reports it later
            command = parse_args().command
    except SystemExit:
        return len(argv)  # horovodrun will report the problem itself
    finally:
        sys.argv = saved
    if not command:
        return len(argv)
    return index_of[len(stripped) - len(command)]


def plugin_parser() -> argparse.ArgumentParser:
    """The plugin flags (their help is `crossoverrun --help`'s first part)."""
    parser = argparse.ArgumentParser(
        prog="crossoverrun", add_help=False, allow_abbrev=False, exit_on_error=False,
        usage="crossoverrun [plugin flags] [horovodrun arguments] COMMAND ...\n"
              "       crossoverrun --jobs FILE [plugin flags]",
        description="horovodrun with the crossover plugin: several jobs share devices, "
                    "one computing while another communicates. Plugin flags go before "
                    "the training command; everything else goes to Horovod's runner "
                    "unchanged.")
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
    if args.crossover_priority is not None and not args.crossover_priority > 0:
        raise UsageError(f"--crossover-priority must be > 0, got {args.crossover_priority}")
    if args.crossover_job is not None and not args.crossover_job.replace("-", "").replace(
            "_", "").isalnum():
        raise UsageError(f"--crossover-job: use letters, digits, '-' or '_', "
                         f"got {args.crossover_job!r}")
    if not args.crossover_idle_shutdown > 0:
        raise UsageError(f"--crossover-idle-shutdown must be > 0 seconds, got "
                         f"{args.crossover_idle_shutdown:g}")
    return args


def own_flag(argv: list[str]) -> str | None:
    """-h/--help or --version when given to crossoverrun itself (before the training
    command: `crossoverrun -np 2 python train.py --help` is the script's)."""
    from horovod.runner.launch import parse_args

    given = [i for i, tok in enumerate(argv) if tok in OWN_FLAGS]
    if not given:
        return None
    plain = [tok for tok in argv if tok not in OWN_FLAGS]
    # the tokens before the first own flag are all plain: its index counts in `plain` too
    return argv[given[0]] if given[0] <= _command_start(plain, parse_args) else None


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
def job_env(args: argparse.Namespace, rdir: Path, job: str) -> dict[str, str]:
    """The environment that puts a job's processes under crossover."""
    env = {
        INJECT_ENV: "1", "CROSSOVER_ENABLE": "1", "CROSSOVER_JOB": job,
        "CROSSOVER_RUNTIME_DIR": str(rdir),
        "PYTHONPATH": os.pathsep.join(
            p for p in (inject_dir(), os.environ.get("PYTHONPATH", "")) if p),
    }
    if args.crossover_priority is not None:
        env["CROSSOVER_PRIORITY"] = str(args.crossover_priority)
    if args.crossover_trace:
        env["CROSSOVER_TRACE"] = str(Path(args.crossover_trace).resolve())
    return env


def run_horovod_child(rest: list[str]) -> int:
    """Horovod's runner in a child process: it execs mpirun, and we have work after
    (merging the traces), also when we are asked to stop: a SIGTERM is passed on to the
    runner (a Ctrl-C reaches it from the terminal), and we wait for it to end."""
    proc = subprocess.Popen([sys.executable, "-m", "horovod.runner.launch", *rest])

    def pass_on(signum: int, _frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    saved = None
    if threading.current_thread() is threading.main_thread():
        saved = signal.signal(signal.SIGTERM, pass_on)
    try:
        return exit_code(proc.wait())
    except KeyboardInterrupt:  # the child got the same SIGINT; give it time to stop
        return exit_code(proc.wait(timeout=30))
    finally:
        if saved is not None:
            signal.signal(signal.SIGTERM, saved)


def exit_code(returncode: int) -> int:
    """A process's exit status as a shell reports it: a death by signal N is 128 + N
    (Popen gives -N, which `sys.exit` would turn into 256 - N)."""
    return 128 - returncode if returncode < 0 else returncode


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


def merge_traces(trace_dir: str, job: str) -> None:
    from crossover import trace

    files = sorted(Path(trace_dir).glob(f"{job}.rank*.json"))
    if files:
        out = Path(trace_dir) / f"{job}.trace.json"
        trace.merge(files, out)
        print(f"crossoverrun: trace of {job}: {out}", file=sys.stderr)


def run_jobs(args: argparse.Namespace, specs: list[jobspec.JobSpec]) -> int:
    """Run every job of a spec at once, each through crossoverrun, output prefixed."""
    hosts = sorted({h for s in specs for h in hosts_of(["-H", s.hosts or "localhost"])})
    rdir = ensure_daemon(args.crossover_daemon, args.crossover_policy, hosts,
                         args.crossover_idle_shutdown)
    with daemon_watch(args, hosts):
        return _run_specs(args, specs, rdir)


def _run_specs(args: argparse.Namespace, specs: list[jobspec.JobSpec], rdir: Path) -> int:
    procs = []
    for spec in specs:
        cmd = [sys.executable, "-m", "crossover.launch.cli", "--crossover",
               "--crossover-daemon", str(rdir), "--crossover-job", spec.name,
               "--crossover-priority", str(spec.priority)]
        if args.crossover_trace:
            cmd += ["--crossover-trace", args.crossover_trace]
        cmd += ["-np", str(spec.np), "-H", spec.hosts or f"localhost:{spec.np}",
                *spec.horovodrun_args, *spec.command]
        p = subprocess.Popen(cmd, env={**os.environ, **spec.env}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        t = threading.Thread(target=_prefix, args=(spec.name, p.stdout), daemon=True)
        t.start()
        procs.append((spec, p, t))
    worst = 0
    for spec, p, t in procs:
        try:
            rc = exit_code(p.wait(timeout=spec.timeout))
        except subprocess.TimeoutExpired:
            # SIGTERM first: the job's ranks write their traces and crossoverrun merges
            # them; SIGKILL only if the job is still there KILL_GRACE_S later
            terminate_group(p, KILL_GRACE_S)
            rc = 124  # as timeout(1) reports a command it stopped
            print(f"crossoverrun: job {spec.name} stopped after its {spec.timeout:g} s "
                  f"timeout", file=sys.stderr)
        t.join(timeout=5)
        print(f"crossoverrun: job {spec.name} exited {rc}", file=sys.stderr)
        worst = max(worst, rc)
    return worst


def _prefix(name: str, stream) -> None:
    for line in stream:
        sys.stdout.write(f"[{name}] {line}")
        sys.stdout.flush()


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
        job = args.crossover_job or f"{_script_name(rest)}-{os.getpid()}"
        hosts = hosts_of(rest)
        rdir = ensure_daemon(args.crossover_daemon, args.crossover_policy, hosts,
                             args.crossover_idle_shutdown)
    except (UsageError, jobspec.JobSpecError, PermissionError) as exc:
        print(f"crossoverrun: error: {exc}", file=sys.stderr)
        return 2
    os.environ.update(job_env(args, rdir, job))
    with daemon_watch(args, hosts):
        rc = run_horovod_child(rest)
    if args.crossover_trace:
        merge_traces(args.crossover_trace, job)
    return rc


def _script_name(rest: list[str]) -> str:
    scripts = [Path(t).stem for t in rest if t.endswith(".py")]
    return (scripts[-1] if scripts else "job").replace(".", "_")


if __name__ == "__main__":
    sys.exit(main())
