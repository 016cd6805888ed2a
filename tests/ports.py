"""Ports for the servers the tests start, chosen so that nothing else on the machine can take them in between.

The usual trick (bind port 0, read the port, close, hand it to the server) leaves a window in which the kernel can
give the same port to any other socket: an outgoing connection or another bind(0) draws from the same ephemeral
range, and on a machine full of Ray processes that happens (a gloo rendezvous lost its port that way). Ports
below the ephemeral range are never handed out implicitly, only to an explicit bind, so a port picked there and
found free stays free until the server binds it. Ray's workers take 10002-19999 by default; the scan starts
above that, at an offset by process id so concurrent test processes do not probe the same ports, and each call
moves on from the last port it gave (a just-closed port may linger in TIME_WAIT).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

FIRST = 20_000
"""Above Ray's default worker port range (10002-19999)."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


_next = FIRST + (os.getpid() % 500) * 20


def free_port(host: str = "127.0.0.1") -> int:
    """A port below the ephemeral range that nothing holds on ``host`` now (``OSError`` when none is left)."""
    global _next
    low = _ephemeral_low()
    span = max(low - FIRST, 1)
    for i in range(span):
        port = FIRST + (_next - FIRST + i) % span
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _next = port + 1
        return port
    raise OSError(f"no free port in {FIRST}-{low - 1}")
