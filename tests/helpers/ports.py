"""A free TCP port for each multi-process launch, so launches that run at the same time (pytest-xdist
workers) never meet on Accelerate's default rendezvous port 29500."""
from __future__ import annotations

from torch.distributed.elastic.utils.distributed import get_free_port as free_port  # what torchrun itself uses

LAUNCHER = "accelerate.commands.launch"


def with_free_port(cmd: list[str]) -> list[str]:
    """``cmd`` with ``--main_process_port <free port>`` after an ``accelerate.commands.launch`` that names none."""
    if LAUNCHER not in cmd or "--main_process_port" in cmd:
        return list(cmd)
    at = cmd.index(LAUNCHER) + 1
    return [*cmd[:at], "--main_process_port", str(free_port()), *cmd[at:]]
