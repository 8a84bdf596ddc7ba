"""The hosts a cluster's node services form their world from (`crossover daemon --system
--hosts ... | --hostfile ...`): a host list as Slurm writes one, or a hostfile as
Open MPI and Horovod read one. Pure: no lookups, no processes.

Slurm's form (`SLURM_JOB_NODELIST`, `sinfo -h -o %N`, `scontrol show hostnames`'s
input): names separated by commas, where brackets give ranges and lists of numbers,
zero-padded as the lower bound is (`gpu[01-03,07]` is gpu01, gpu02, gpu03, gpu07), and
several bracket groups multiply (`r[1-2]n[1-2]`: r1n1, r1n2, r2n1, r2n2). A `:N` after
a name (horovodrun's slots) is dropped: a node runs one service whatever its slots.
"""

from __future__ import annotations

import re
from pathlib import Path

#: more names than this from one list is a typo (`n[1-1000000]`), not a cluster
MAX_HOSTS = 65536
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
#: what a host name may hold outside its brackets (a DNS name, Slurm's node names)
_NAME = re.compile(r"[A-Za-z0-9._-]*")


def expand(spec: str) -> list[str]:
    """The host names of a host list (`a,b[1-3],c:2`; commas or white space between
    them, as `sinfo` and `scontrol` print them), in order, each once.

    Raises:
        ValueError: an empty name, a character no host name has, an unbalanced bracket,
            a range that is not numbers or runs backwards, or more than MAX_HOSTS names;
            naming the part and the form.
    """
    hosts: dict[str, None] = {}  # (ordered, and a set)
    items = _split_top(spec)
    if not any(item.strip() for item in items):
        raise ValueError(f"host list {spec!r} has an empty name; write names "
                         f"separated by commas, e.g. gpu[01-04],login1")
    for item in items:
        name = item
        if ":" in name:
            name, slots = name.rsplit(":", 1)
            if not slots.isdigit() or not slots.isascii():
                raise ValueError(f"host list {spec!r}: {item!r} has slots {slots!r}; "
                                 f"write host or host:N")
        if not name:
            raise ValueError(f"host list {spec!r} has an empty name; write names "
                             f"separated by commas, e.g. gpu[01-04],login1")
        outside = re.sub(r"\[[^]]*\]", "", name)
        if not _NAME.fullmatch(outside):
            raise ValueError(f"host list {spec!r}: {item!r} is no host name (letters, "
                             f"digits, '.', '-' and '_', with [ranges])")
        if _count(name, spec) + len(hosts) > MAX_HOSTS:
            raise ValueError(f"host list {spec!r} names over {MAX_HOSTS} hosts")
        hosts.update(dict.fromkeys(_expand_one(name, spec)))
    return list(hosts)


def _split_top(spec: str) -> list[str]:
    """`spec` split at the commas outside brackets, and at white space; empty items
    kept where two commas meet (a mistake), dropped around white space."""
    items, depth, start = [], 0, 0
    spec = re.sub(r"\s*,\s*", ",", spec.strip())
    for i, ch in enumerate(spec):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"host list {spec!r}: brackets inside brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"host list {spec!r}: a ']' without its '['")
        elif (ch == "," or ch.isspace()) and depth == 0:
            items.append(spec[start:i])
            start = i + 1
        elif ch.isspace():
            raise ValueError(f"host list {spec!r}: white space inside brackets")
    if depth:
        raise ValueError(f"host list {spec!r}: a '[' without its ']'")
    return [*items, spec[start:]]


def _ranges(body: str, spec: str) -> list[tuple[str, str]]:
    """The (low, high) of each part of a bracket's `body` (`1-4,7`), checked."""
    out = []
    for part in body.split(","):
        match = _RANGE.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"host list {spec!r}: [{body}] must hold numbers and ranges "
                             f"such as [1-4,7] or [01-16]")
        low, high = match[1], match[2] if match[2] is not None else match[1]
        if int(high) < int(low):
            raise ValueError(f"host list {spec!r}: the range {part.strip()} runs backwards")
        out.append((low, high))
    return out


def _count(name: str, spec: str) -> int:
    """How many names one item stands for, counted before any is made."""
    total = 1
    for body in re.findall(r"\[([^]]*)\]", name):
        total *= sum(int(high) - int(low) + 1 for low, high in _ranges(body, spec))
    return total


def _expand_one(name: str, spec: str) -> list[str]:
    """The names one item of a host list stands for (its bracket groups multiplied)."""
    open_ = name.find("[")
    if open_ < 0:
        return [name]
    close = name.index("]", open_)
    head, body, tail = name[:open_], name[open_ + 1:close], name[close + 1:]
    numbers = [str(n).zfill(len(low)) for low, high in _ranges(body, spec)
               for n in range(int(low), int(high) + 1)]
    return [f"{head}{n}{rest}" for n in numbers for rest in _expand_one(tail, spec)]


def read_hostfile(path: str | Path) -> list[str]:
    """The hosts of a hostfile: one host a line (`host`, `host slots=N`, or Slurm's
    `gpu[01-04]`), `#` comments and blank lines skipped, each host once.

    Raises:
        ValueError: the file cannot be read, or a line is not a host list (naming the
            file and the line).
    """
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"hostfile {path}: cannot read it ({exc})") from None
    hosts: list[str] = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        try:
            found = expand(words[0])
        except ValueError as exc:
            raise ValueError(f"hostfile {path}, line {number}: {exc}") from None
        hosts += [h for h in found if h not in hosts]
    if not hosts:
        raise ValueError(f"hostfile {path} names no host: write one host a line")
    return hosts


def place_of(node: str, hosts: list[str]) -> int:
    """Where this node (`node`, as it calls itself) is in the world's host list.

    Raises:
        ValueError: the list does not name it; where a name differs only in its domain,
            saying which name to use.
    """
    if node in hosts:
        return hosts.index(node)
    short = node.split(".", 1)[0]
    alike = [h for h in hosts if h.split(".", 1)[0] == short]
    hint = (f"; the list's {alike[0]!r} differs from this node's name only in its domain: "
            f"write {node!r}, or set CROSSOVER_NODE={alike[0]} for the service and its "
            f"jobs" if alike else "; add it, or set CROSSOVER_NODE to its name there")
    raise ValueError(f"the world's hosts ({', '.join(hosts[:8])}"
                     f"{', ...' if len(hosts) > 8 else ''}) do not name this node "
                     f"({node}){hint}")


def world_hosts(spec: str | None, hostfile: str | None, node: str) -> list[str]:
    """The hosts of `--hosts` or `--hostfile`, checked to name this node (`node`).

    Raises:
        ValueError: both given, a bad list or file, or one without this node.
    """
    if spec is not None and hostfile is not None:
        raise ValueError("--hosts or --hostfile, not both")
    hosts = expand(spec) if spec is not None else read_hostfile(hostfile or "")
    place_of(node, hosts)
    return hosts


__all__ = ["MAX_HOSTS", "expand", "place_of", "read_hostfile", "world_hosts"]
