"""``accelerate launch`` that exits 143 when preempted: ``python -m rlhf_train.tools.launch ARGS``.

Takes exactly ``accelerate launch``'s arguments (``--config_file``, ``--num_processes``, ``--num_machines``,
``--machine_rank``, ``--main_process_ip`` / ``--main_process_port``, ...) and runs the same launch, in
this process. What differs is the exit status when the launch was preempted:

* SIGTERM / SIGINT to this launcher: torch elastic relays the signal to every worker, which finish their
  iteration, checkpoint together and exit 143, then re-raises it (``accelerate launch``: a traceback and
  exit 1). Here: one line and exit 128 + the signal (143 for SIGTERM), what SLURM / k8s requeue on.
* every failed worker exited 143 (the scheduler signalled the workers directly): exit 143 too.
Any other failure keeps ``accelerate launch``'s behaviour (its traceback, exit 1).

The workers outlive neither this launcher nor ``accelerate launch``: ``python -m rlhf_train`` asks the
kernel for SIGKILL when its parent dies (:func:`rlhf_train.infra.preemption.die_with_parent`).
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (default 30 s) bounds the time workers get to checkpoint.
"""
from __future__ import annotations

import sys

from rlhf_train.infra.preemption import PREEMPTED_EXIT_CODE


def main(argv: list[str] | None = None) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        launch_command(args)
    except SignalException as err:
        code = 128 + int(err.sigval)
        print(f"[rlhf_train] launcher received {err.sigval.name}: the workers were told to checkpoint and stop; "
              f"exit {code} (resume with trainer.resume=auto)", file=sys.stderr, flush=True)
        return code
    except ChildFailedError as err:
        codes = {f.exitcode for f in err.failures.values()}
        if codes == {PREEMPTED_EXIT_CODE}:
            print(f"[rlhf_train] the workers were preempted (exit {PREEMPTED_EXIT_CODE}); resume with "
                  f"trainer.resume=auto", file=sys.stderr, flush=True)
            return PREEMPTED_EXIT_CODE
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
