"""Free ports for what a test launches, drawn below Linux's ephemeral range (32768 and up): every client connection
of every test running beside this one takes its port from that range, so a port the OS calls free there now is
often taken by the time a server (or torchrun's rendezvous store) binds it (seen with two pytest workers:
EADDRINUSE at torchrun's store)."""

from __future__ import annotations

import os
import random
import socket
import time


def server_ports(span: int = 1) -> int:
    """A base port with ports base .. base + span - 1 free now, for servers a test launches at fixed offsets (the
    SGLang launcher's port_base + i, a node's + 10). Drawn below Linux's ephemeral range (32768 and up), where every
    client connection of every test running beside this one takes its port: a port next to a free ephemeral one is
    often such a connection's (seen with two pytest workers)."""
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(500):
        base = rng.randrange(20000, 32768 - span)
        if all(_bindable(base + i) for i in range(span)):
            return base
    raise RuntimeError(f"no {span} free ports in a row below 32768")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
