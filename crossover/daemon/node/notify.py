"""systemd's notify protocol: a service of `Type=notify` says when it is ready and when
it stops, one datagram each, on the socket systemd names in $NOTIFY_SOCKET.

The protocol is one `KEY=value` line per field in a datagram (sd_notify(3)); a name
that starts with '@' is in the abstract namespace. Without $NOTIFY_SOCKET (not started
by systemd) nothing is sent. A failed send is logged and ignored: the service serves its
ranks whether or not its supervisor heard it.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("crossover.daemon")

NOTIFY_SOCKET = "NOTIFY_SOCKET"


def notify(**fields: str | int) -> bool:
    """Send `fields` (e.g. READY=1, STATUS=...) to systemd; whether it was sent."""
    address = os.environ.get(NOTIFY_SOCKET)
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    elif not address.startswith("/"):
        log.warning("%s=%r is neither a path nor an abstract name: not notifying",
                    NOTIFY_SOCKET, address)
        return False
    text = "".join(f"{key}={value}\n" for key, value in fields.items())
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(text.encode(), address)
    except OSError as exc:
        log.warning("could not tell systemd %s (%s)", text.strip(), exc)
        return False
    return True
