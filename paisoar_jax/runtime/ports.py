"""A free port for a coordinator: the launcher's on one node, Ray Train's rank 0's."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the coordinator binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
