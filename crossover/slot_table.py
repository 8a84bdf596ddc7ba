"""The node's slot table (the native fast path): what the daemon's side and a rank's
side share. The design is in native/table.hpp; the daemon's side is
`crossover.daemon.node.table`, a rank's `crossover.client.fastpath`.

The daemon decides, the table executes (docs/design.md). A rank appends its
requests and releases to its device's ring in the table; when the daemon's published
plan holds, the event's grants happen at once, a futex wake from rank to rank with no
daemon on the path. Without the compiled module (`crossover._native`) every rank uses the
socket path, and the daemon says so once.
"""

from __future__ import annotations

from pathlib import Path

from crossover.protocol import PLANNED_PHASE, Phase

try:
    from crossover import _native
    UNAVAILABLE = ""
except ImportError as exc:  # not built (no compiler or CMake at install time)
    _native = None
    UNAVAILABLE = f"crossover._native is not importable ({exc})"

PHASES = list(Phase)  # a release's phase travels through the table as its index here
__all__ = ["PHASES", "PLANNED_PHASE", "UNAVAILABLE", "table_path"]


def table_path(socket_file: Path) -> Path:
    """Where the daemon listening on `socket_file` keeps its slot table."""
    return socket_file.with_suffix(".slots")
