"""The daemons' log: one file per runtime directory, shared by every process that writes
it (the launcher's mpirun, relays, services), bounded in size.

A world that lives for weeks under faults writes without end (every lost node, every
generation), and several processes append to the one file, so no single process can own
its rotation. Each process instead points its stdout and stderr (fd 1 and 2: logging,
tracebacks, and what C code prints) at the file and, before each log record, looks at
it: past `CROSSOVER_LOG_BYTES` the first process to notice renames it to `daemon.log.1`
(replacing the older one) under a lock it never waits for, and every process that still writes to a
renamed file moves to the new one at its next record. The log and its one older
generation stay within about twice the limit; a process that wrote its last record
into a renamed file holds that file until it ends (it writes nothing more there).

mpirun's own lines (a relay that exited, say) reach the file through the launcher's
mpirun and are few; they land wherever its file is then.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
from pathlib import Path

#: the log's name in the runtime directory
LOG_FILE = "daemon.log"
#: the one older generation kept beside the log
OLDER = ".1"


class SharedLog:
    """This process's end of a shared, size-bounded log file.

    Args:
        path: the log (created if missing, appended to).
        max_bytes: the size past which it is rotated.
    """

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path, self.max_bytes = Path(path), max_bytes
        self._lock_path = self.path.with_name(self.path.name + ".lock")
        self._open()

    def _open(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    def check(self) -> None:
        """Rotate the log if it is past the limit, and follow it if another process did."""
        try:
            mine = os.fstat(2)
            if mine.st_size >= self.max_bytes:
                lock = os.open(self._lock_path, os.O_WRONLY | os.O_CREAT, 0o600)
                try:
                    # never wait: a holder may be a daemon stopped mid-rotation (SIGSTOP),
                    # and logging must not stop this one; it rotates at a later line
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    current = os.stat(self.path)
                    # another process may have rotated it while this one waited
                    if current.st_ino == mine.st_ino and current.st_size >= self.max_bytes:
                        os.replace(self.path, self.path.with_name(self.path.name + OLDER))
                finally:
                    os.close(lock)  # and with it the lock
            if os.stat(self.path).st_ino != mine.st_ino:
                self._open()
        except FileNotFoundError:  # renamed and not yet made again: make it
            with contextlib.suppress(OSError):
                self._open()
        except OSError:  # the lock is busy, or a log that cannot be checked: go on
            pass


class _Handler(logging.StreamHandler):
    def __init__(self, log: SharedLog) -> None:
        super().__init__(sys.stderr)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        self.log.check()
        super().emit(record)


def log_to(path: Path, max_bytes: int, prefix: str) -> SharedLog:
    """Send this process's output and its log records (at INFO and above, each line
    headed by `prefix` and the time) to the shared log at `path`."""
    log = SharedLog(path, max_bytes)
    handler = _Handler(log)
    handler.setFormatter(logging.Formatter(f"{prefix} %(asctime)s %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return log


def adopt(path: Path, max_bytes: int, prefix: str) -> bool:
    """`log_to(path, ...)` if this process's stderr already is that file (a service that
    a relay or the launcher started with its output there); False otherwise (a daemon
    run by hand keeps its terminal)."""
    try:
        mine, there = os.fstat(2), os.stat(path)
    except OSError:
        return False
    if (mine.st_dev, mine.st_ino) != (there.st_dev, there.st_ino):
        return False
    log_to(path, max_bytes, prefix)
    return True


__all__ = ["adopt", "LOG_FILE", "OLDER", "SharedLog", "log_to"]
