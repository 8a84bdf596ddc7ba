"""The multi-job spec of `crossoverrun --crossover --jobs jobs.yaml`: schema and checks.

    jobs:
      - name: resnet                 # unique; default job<i>
        command: python train.py     # required: a string (split like a shell) or a list
        np: 2                        # required: number of processes
        launcher: horovodrun         # or torchrun (on this host: --nproc-per-node np)
        hosts: localhost:2           # horovodrun -H format; default localhost:<np>
        priority: 1                  # weight for --crossover-policy priority (> 0)
        env: {OMP_NUM_THREADS: "1"}  # extra environment
        horovodrun_args: [--gloo]    # extra horovodrun flags
        torchrun_args: [--max-restarts, "0"]  # extra torchrun flags
        timeout: 3600                # seconds before the job is killed (default: none)

Every problem is reported, one line each naming the job and the field, before anything
starts.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from crossover import environment as E

FIELDS = {"name", "command", "np", "launcher", "hosts", "priority", "env", "horovodrun_args",
          "torchrun_args", "timeout"}
LAUNCHERS = ("horovodrun", "torchrun")


class JobSpecError(ValueError):
    """The spec is invalid; the message has one line per problem."""


@dataclass
class JobSpec:
    """One validated job of a spec file."""

    name: str
    command: list[str]
    np: int
    hosts: str | None = None
    priority: float = 1.0
    env: dict[str, str] = field(default_factory=dict)
    horovodrun_args: list[str] = field(default_factory=list)
    timeout: float | None = None
    launcher: str = "horovodrun"
    torchrun_args: list[str] = field(default_factory=list)


def host_slots(hosts: str) -> int:
    """Total slots of a horovodrun -H string ("a:2,b:2"; a host without :N has 1).

    Raises:
        ValueError: a malformed entry.
    """
    total = 0
    for entry in hosts.split(","):
        name, _, slots = entry.strip().partition(":")
        if not name:
            raise ValueError(f"empty host name in {hosts!r}")
        if slots and (not slots.isdigit() or int(slots) < 1):
            raise ValueError(f"slots of {name!r} must be a positive integer, got {slots!r}")
        total += int(slots) if slots else 1
    return total


def load(path: str | Path) -> list[JobSpec]:
    """Read and validate a spec file.

    Raises:
        JobSpecError: the file is unreadable, not YAML, or any job is invalid.
    """
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise JobSpecError(f"{path}: cannot read the job spec: {exc}") from None
    return parse(doc, str(path))


def parse(doc: Any, source: str = "jobs") -> list[JobSpec]:
    """Validate a loaded spec document (see the module doc for the schema)."""
    if not isinstance(doc, dict) or set(doc) != {"jobs"} or not isinstance(doc["jobs"], list) \
            or not doc["jobs"]:
        raise JobSpecError(f"{source}: expected a mapping with one key, 'jobs', holding a "
                           f"non-empty list of jobs")
    errors: list[str] = []
    jobs: list[JobSpec] = []
    for i, raw in enumerate(doc["jobs"]):
        label = f"{source}: job #{i + 1}"
        if not isinstance(raw, dict):
            errors.append(f"{label}: expected a mapping of fields, got {type(raw).__name__}")
            continue
        if isinstance(raw.get("name"), str) and raw["name"]:
            label = f"{source}: job {raw['name']!r}"
        problems = _check(raw)
        errors += [f"{label}: {p}" for p in problems]
        if not problems:
            cmd = raw["command"]
            command = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
            launcher = raw.get("launcher", "horovodrun")
            if launcher == "torchrun" and len(command) > 1 and \
                    Path(command[0]).name.startswith("python"):
                command = command[1:]  # torchrun runs the script with its own Python
            jobs.append(JobSpec(
                name=raw.get("name") or f"job{i + 1}",
                command=command,
                np=raw["np"], hosts=raw.get("hosts"), priority=float(raw.get("priority", 1)),
                env={k: str(v) for k, v in (raw.get("env") or {}).items()},
                horovodrun_args=list(raw.get("horovodrun_args") or []),
                timeout=raw.get("timeout"), launcher=launcher,
                torchrun_args=list(raw.get("torchrun_args") or []),
            ))
    names = [j.name for j in jobs]
    errors += [f"{source}: job {n!r}: field 'name': used by more than one job; names must be "
               f"unique" for n in sorted({n for n in names if names.count(n) > 1})]
    if errors:
        raise JobSpecError("\n".join(errors))
    return jobs


def _check(raw: dict) -> list[str]:
    out = [f"unknown field {k!r} (allowed: {', '.join(sorted(FIELDS))})"
           for k in raw if k not in FIELDS]
    cmd = raw.get("command")
    if cmd is None:
        out.append("field 'command': missing; give the training command, e.g. "
                   "'python train.py'")
    elif not (isinstance(cmd, str) and cmd.strip()) and not (
            isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd)):
        out.append(f"field 'command': expected a non-empty string or list of strings, "
                   f"got {cmd!r}")
    np_ = raw.get("np")
    if np_ is None:
        out.append("field 'np': missing; give the number of processes")
    elif not isinstance(np_, int) or isinstance(np_, bool) or np_ < 1:
        out.append(f"field 'np': expected a positive integer, got {np_!r}")
    hosts = raw.get("hosts")
    if hosts is not None:
        if not isinstance(hosts, str):
            out.append(f"field 'hosts': expected a string like 'host1:2,host2:2', "
                       f"got {hosts!r}")
        else:
            try:
                slots = host_slots(hosts)
            except ValueError as exc:
                out.append(f"field 'hosts': {exc}")
            else:
                if isinstance(np_, int) and np_ > slots:
                    out.append(f"field 'np': {np_} processes do not fit the {slots} slots of "
                               f"hosts {hosts!r}; lower np or add slots")
    prio = raw.get("priority", 1)
    if not isinstance(prio, int | float) or isinstance(prio, bool) or prio <= 0:
        out.append(f"field 'priority': expected a number > 0, got {prio!r}")
    env = raw.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str | int | float)
                                            for k, v in env.items()):
        out.append(f"field 'env': expected a mapping of names to strings, got {env!r}")
    else:  # the job's crossoverrun would refuse them only once the other jobs run
        out += [f"field 'env': {line}" for line in E.check(environ={
            k: str(v) for k, v in env.items()})]
    launcher = raw.get("launcher", "horovodrun")
    if launcher not in LAUNCHERS:
        out.append(f"field 'launcher': expected one of {', '.join(LAUNCHERS)}, got "
                   f"{launcher!r}")
    for key in ("horovodrun_args", "torchrun_args"):
        extra = raw.get(key, [])
        if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
            out.append(f"field {key!r}: expected a list of strings, got {extra!r}")
    own = {"horovodrun": "horovodrun_args", "torchrun": "torchrun_args"}
    for other, key in own.items():
        if launcher in own and other != launcher and key in raw:
            out.append(f"field {key!r}: not for a {launcher} job; use {own[launcher]!r}")
    if launcher == "torchrun" and hosts is not None:
        out.append("field 'hosts': a torchrun job runs on this host (--nproc-per-node np); "
                   "drop hosts, or run it with horovodrun")
    timeout = raw.get("timeout")
    if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
        out.append(f"field 'timeout': expected seconds > 0, got {timeout!r}")
    if "name" in raw and not (isinstance(raw["name"], str) and raw["name"]
                              and raw["name"].replace("-", "").replace("_", "").isalnum()):
        out.append(f"field 'name': expected letters, digits, '-' or '_', got {raw['name']!r}")
    return out
