"""A free TCP port for each multi-process launch, so launches that run at the same time (pytest-xdist
workers) never meet on Accelerate's default rendezvous port 29500."""
from __future__ import annotations

import socket

LAUNCHER = "accelerate.commands.launch"


def free_port() -> int:
    """A port the kernel has just handed out as free (the launch binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_free_port(cmd: list[str]) -> list[str]:
    """``cmd`` with ``--main_process_port <free port>`` after an ``accelerate.commands.launch`` that names none."""
    if LAUNCHER not in cmd or "--main_process_port" in cmd:
        return list(cmd)
    at = cmd.index(LAUNCHER) + 1
    return [*cmd[:at], "--main_process_port", str(free_port()), *cmd[at:]]
