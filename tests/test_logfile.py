"""The daemons' shared log (crossover/daemon/logfile.py): several real processes write
one file, which stays bounded however much they write, and loses none of their last
lines."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import textwrap

from crossover.daemon.logfile import OLDER

WRITER = textwrap.dedent("""
    import logging, os, sys
    from pathlib import Path
    from crossover.daemon.logfile import log_to
    log_to(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    for i in range(int(sys.argv[4])):
        logging.getLogger("x").info("line %d of %s, padded to some length %s", i,
                                    sys.argv[3], "." * 20)
    os.write(2, f"raw end of {sys.argv[3]}\\n".encode())  # what C code or a traceback writes
    logging.getLogger("x").info("last of %s", sys.argv[3])
""")


def test_writers_of_one_log_keep_it_bounded_and_the_latest_lines(tmp_path):
    log, limit = tmp_path / "daemon.log", 4096

    def writers(names: list[str], lines: int) -> None:
        procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(log), str(limit), name,
                                   str(lines)], stderr=subprocess.PIPE, text=True)
                 for name in names]
        for p in procs:
            assert p.wait(timeout=120) == 0, p.stderr.read() if p.stderr else ""
    writers(["w0", "w1", "w2"], 2000)  # ~3 x 2000 lines of ~90 bytes, at once
    writers(["late"], 3)
    older = log.with_name(log.name + OLDER)
    assert older.exists()
    # a file passes the limit by at most the line each writer wrote after its last look
    for f in (log, older):
        assert f.stat().st_size < limit + 3 * 200, (f, f.stat().st_size)
    assert older.stat().st_size >= limit  # one whole older generation is kept
    text = older.read_text() + log.read_text()
    assert "line 2 of late" in text and "raw end of late" in text and "last of late" in text
    assert text.rstrip().endswith("last of late")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["daemon.log", "daemon.log.1",
                                                         "daemon.log.lock"]


def test_a_writer_never_waits_for_a_rotation_another_process_holds(tmp_path):
    """A daemon stopped (SIGSTOP) while it rotates holds the lock: the others log on,
    past the limit, and rotate once the lock is free."""
    log, limit = tmp_path / "daemon.log", 4096
    lock = open(tmp_path / "daemon.log.lock", "w")  # noqa: SIM115 - held across the run
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        done = subprocess.run([sys.executable, "-c", WRITER, str(log), str(limit), "w",
                               "200"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert log.stat().st_size > 4 * limit and not log.with_name("daemon.log.1").exists()
    finally:
        lock.close()
    done = subprocess.run([sys.executable, "-c", WRITER, str(log), str(limit), "v", "3"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert log.with_name("daemon.log.1").exists() and log.stat().st_size < limit


ADOPT = textwrap.dedent("""
    import logging, sys
    from pathlib import Path
    from crossover.daemon.logfile import adopt
    print(adopt(Path(sys.argv[1]), 1 << 20, "crossover-daemon"), file=sys.__stdout__)
    logging.getLogger("x").warning("a record")
""")


def test_a_daemon_adopts_the_log_only_when_its_output_already_goes_there(tmp_path):
    log = tmp_path / "daemon.log"
    with open(log, "a") as out:
        done = subprocess.run([sys.executable, "-c", ADOPT, str(log)], stdout=out,
                              stderr=out, timeout=60)
    assert done.returncode == 0
    lines = log.read_text().splitlines()
    assert lines[0] == "True" and lines[1].startswith("crossover-daemon ")
    assert lines[1].endswith(" a record")
    # run by hand (its output a terminal or pipe): it keeps it
    done = subprocess.run([sys.executable, "-c", ADOPT, str(log)], capture_output=True,
                          text=True, timeout=60)
    assert done.stdout == "False\n" and "a record" in done.stderr
    assert len(log.read_text().splitlines()) == 2
