"""Ports: one helper for every process group and test server that needs a free one."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on ``host`` now (another process may still take it before it is bound)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
