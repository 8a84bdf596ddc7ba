"""Run a Python script as a rank whose descriptors start above 1024.

    python -m bench.robustness.high_fds SCRIPT [ARGS...]

Data loaders with workers, NCCL and a raised `ulimit -n` put a rank's sockets past
descriptor 1024, where `select.select` fails; the chaos soak runs some of its ranks
through this so that the client's socket (opened after this) lands there.
"""

from __future__ import annotations

import os
import resource
import runpy
import sys

FLOOR = 1100  # descriptors held open before the script starts



def main() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FLOOR + 1024
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE,
                           (min(want, hard) if hard > 0 else want, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(FLOOR)]  # open while it runs
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
    del held


if __name__ == "__main__":
    main()
