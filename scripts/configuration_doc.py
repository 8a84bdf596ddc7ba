"""Write docs/configuration.md from the code: every flag of `crossover` and
`crossoverrun` (their argparse parsers) and every CROSSOVER_* variable
(`crossover.environment.VARS`). tests/test_docs.py fails when the file differs from what
this prints, so the manual cannot drift from the code.

    .venv/bin/python scripts/configuration_doc.py          # rewrite the file
    .venv/bin/python scripts/configuration_doc.py --check  # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from crossover import environment as E
from crossover.__main__ import build_parser
from crossover.launch.cli import plugin_parser

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

INTRO = """\
# Configuration

Every flag of `crossoverrun` and `crossover`, and every `CROSSOVER_*` environment
variable. This file is generated from the code by `scripts/configuration_doc.py` (a test
checks that it is current); `--help` of each command prints the same.
"""

CROSSOVERRUN = """\
## `crossoverrun`

```
crossoverrun [plugin flags] [horovodrun arguments] COMMAND ...
crossoverrun --jobs FILE [plugin flags]
```

Every `horovodrun` argument is accepted unchanged and handed to Horovod's runner.
Plugin flags go before the training command; a script's own flags (even `--jobs`) are
left alone. Without `--crossover` (or `--jobs`) it is `horovodrun`. The job's hosts come
from `-H/--hosts` or `--hostfile`; a host discovery script (elastic Horovod) is refused.
The exit status is the job's (for `--jobs`, the worst job's; a job stopped at its
`timeout` counts 124, a death by signal N 128 + N).

`crossover-torchrun [plugin flags] [torchrun arguments] SCRIPT ...` takes the same plugin
flags (but `--jobs`) before the training script, and every `torchrun` argument
unchanged. With `--crossover --crossover-daemon auto` it runs on one node (`--standalone`
or `--nnodes 1`); across nodes, give every node's launcher the runtime directory of a
daemon world with `--crossover-daemon DIR`.
"""

JOB_SPEC = """\
### The job spec (`--jobs FILE`)

Validated in full before anything starts; each problem is one line naming the job and
the field.

```yaml
jobs:
  - name: resnet                 # letters, digits, - and _; default job<i>
    command: python train.py     # required: a string (split like a shell) or a list
    np: 2                        # required: number of processes (per node for torchrun)
    launcher: horovodrun         # or torchrun: on this host, --standalone
    hosts: localhost:2           # horovodrun -H format; default localhost:<np>
    priority: 1                  # weight for the priority policy (> 0)
    env: {OMP_NUM_THREADS: "1"}  # extra environment
    horovodrun_args: [--gloo]    # extra horovodrun flags
    torchrun_args: [--max-restarts, "0"]  # extra torchrun flags (torchrun jobs)
    timeout: 3600                # seconds, then SIGTERM, SIGKILL 10 s later (default: none)
```
"""

ENVIRONMENT = """\
## Environment variables

An empty value is the same as an unset one. Flags take 1/0, true/false, yes/no or on/off.
`crossoverrun` sets the job side's for its jobs; set them yourself for jobs you launch
with `horovodrun` or `mpirun`. A value that does not parse is named in one line with its
accepted form: `crossoverrun`, `crossover daemon` and `crossover check` refuse it before
anything starts; a job says it once and goes on with the default (a bad
`CROSSOVER_ENABLE` or `CROSSOVER_INJECT` turns crossover off for the process, a bad
`CROSSOVER_NODE` or `CROSSOVER_FAKE_NODES` makes the process run uncoordinated).
"""


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.metavar}`"
    if action.choices is not None and action.option_strings:
        return f"{names} {{{','.join(map(str, action.choices))}}}"
    if action.nargs != 0 and action.option_strings and action.metavar:
        return f"{names} {action.metavar}"
    return names


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.required or not action.option_strings:
        return ""
    return "" if action.default in (None, argparse.SUPPRESS) else f"{action.default:g}" \
        if isinstance(action.default, float) else str(action.default)


def options_table(parser: argparse.ArgumentParser) -> list[str]:
    """A markdown table of a parser's flags and arguments (not -h, not subcommands, not
    the flags hidden from `--help`: how a program's own parts call each other)."""
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or \
                action.help == argparse.SUPPRESS:
            continue
        cells = (_flag(action), _default(action), action.help)
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return rows


def subcommands(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
    out = []
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {a.dest: a.help for a in action._choices_actions}
        for name, sub in action.choices.items():
            out += [f"### `{prefix} {name}`", "", _cell(helps.get(name, "")), ""]
            if len(options_table(sub)) > 2:
                out += [*options_table(sub), ""]
            out += subcommands(sub, f"{prefix} {name}")
    return out


def environment_table() -> list[str]:
    rows = ["| variable | read by | accepted | default | meaning |",
            "| --- | --- | --- | --- | --- |"]
    for var in E.VARS.values():
        rows.append(f"| `{var.name}` | {' and '.join(var.sides)} | "
                    f"{_cell(var.form.removeprefix('give '))} | {_cell(var.shown)} | "
                    f"{_cell(var.about)} |")
    return rows


def render() -> str:
    parser = build_parser()
    parts = [INTRO, CROSSOVERRUN, *options_table(plugin_parser()), "", JOB_SPEC,
             "## `crossover`", "", _cell(parser.description or ""), "",
             *options_table(parser), "", *subcommands(parser, "crossover"),
             ENVIRONMENT, *environment_table()]
    return "\n".join(parts).rstrip() + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if DOC.read_text() != text:
            print(f"{DOC} is stale: run .venv/bin/python scripts/configuration_doc.py",
                  file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
